"""Ready-list entries in PostgreSQL: the admission ids the dispatcher names for
them, and returning entries dropped before any call to ``pending``."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

#: Admission ids the dispatcher names for ready-list entries (admit.lua's are ``epoch-seq``).
READY_ID_PREFIX = "r"


def ready_admission_id() -> str:
    """A new admission id for a ready-list entry (see :func:`in_flight_leases`)."""
    return READY_ID_PREFIX + uuid.uuid4().hex[:20]


def unstock(conn: Connection, entries: Sequence[tuple[int, str]]) -> int:
    """(task id, admission id) of ready-list entries dropped before any call:
    back to pending, each only if still queued under that admission."""
    if not entries:
        return 0
    ids, admissions = zip(*entries, strict=True)
    result = conn.execute(
        sa.text(
            """
            UPDATE tasks AS t
               SET status = 'pending', model = NULL, admission_id = NULL, deadline = NULL, updated_at = now()
              FROM unnest(CAST(:ids AS bigint[]), CAST(:admissions AS text[])) AS v(id, admission_id)
             WHERE t.id = v.id AND t.admission_id = v.admission_id AND t.status = 'queued'
            """
        ),
        {"ids": list(ids), "admissions": list(admissions)},
    )
    return result.rowcount
