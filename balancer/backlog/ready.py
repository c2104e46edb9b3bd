"""Ready-list entries in PostgreSQL: tasks with status ``ready`` (a task waiting
on its model's ready list; ``queued`` is a task whose solve message was
published). The admission ids the dispatcher names for them, marking them
``ready``, and returning entries dropped before any call to ``pending``."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from balancer.backlog.claims import mark_queued


def ready_admission_id() -> str:
    """A new admission id for a ready-list entry (admit.lua's are ``epoch-seq``:
    never the same, as this one has no ``-``)."""
    return uuid.uuid4().hex[:21]


def mark_ready(conn: Connection, entries: Sequence[tuple[int, str, str]], lease_seconds: int) -> None:
    """(task id, model, admission id) of tasks about to be stocked: pending to ``ready``."""
    mark_queued(conn, entries, lease_seconds, status="ready")


def unstock(conn: Connection, entries: Sequence[tuple[int, str]]) -> int:
    """(task id, admission id) of ready-list entries dropped before any call:
    back to pending, each only if still ``ready`` under that admission."""
    if not entries:
        return 0
    ids, admissions = zip(*entries, strict=True)
    result = conn.execute(
        sa.text(
            """
            UPDATE tasks AS t
               SET status = 'pending', model = NULL, admission_id = NULL, deadline = NULL, updated_at = now()
              FROM unnest(CAST(:ids AS bigint[]), CAST(:admissions AS text[])) AS v(id, admission_id)
             WHERE t.id = v.id AND t.admission_id = v.admission_id AND t.status = 'ready'
            """
        ),
        {"ids": list(ids), "admissions": list(admissions)},
    )
    return result.rowcount
