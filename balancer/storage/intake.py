"""New tasks into the backlog (``pending``).

Idempotent by (source, key): a task whose (source, key) is already stored is
not inserted again (the partial unique index ``tasks_source_key``); tasks
without a key are always inserted.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection

from balancer.domain.intake import TaskRow
from balancer.storage.schema import tasks

_INSERT = (
    pg_insert(tasks)
    .on_conflict_do_nothing(index_elements=[tasks.c.source, tasks.c.key], index_where=tasks.c.key.is_not(None))
    .returning(tasks.c.id)
)


def insert_tasks(conn: Connection, rows: Sequence[TaskRow]) -> list[int]:
    """Insert pending tasks; returns the ids of those inserted (a keyed task
    already present is skipped, so ``len(rows) - len(ids)`` were already present)."""
    if not rows:
        return []
    result = conn.execute(
        _INSERT,
        [
            {
                "source": r.source,
                "prompt": r.prompt,
                "priority": r.priority,
                "allowed_models": list(r.allowed_models) if r.allowed_models else None,
                "max_tokens": r.max_tokens,
                "estimated_tokens": r.estimated_tokens,
                "key": r.key,
                "metadata": r.metadata if r.metadata is not None else sa.null(),
            }
            for r in rows
        ],
    )
    return [row.id for row in result]
