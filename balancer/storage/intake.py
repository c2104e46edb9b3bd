"""New tasks into the backlog (``pending``)."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from balancer.domain.intake import TaskRow
from balancer.storage.schema import tasks


def insert_tasks(conn: Connection, rows: Sequence[TaskRow]) -> list[int]:
    """Insert pending tasks; returns their ids."""
    if not rows:
        return []
    result = conn.execute(
        sa.insert(tasks).returning(tasks.c.id),
        [
            {
                "source": r.source,
                "prompt": r.prompt,
                "priority": r.priority,
                "allowed_models": list(r.allowed_models) if r.allowed_models else None,
                "max_tokens": r.max_tokens,
                "estimated_tokens": r.estimated_tokens,
            }
            for r in rows
        ],
    )
    return [row.id for row in result]
