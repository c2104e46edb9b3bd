"""Removing a model: what it would strand, and failing the tasks only it could take."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from balancer.storage.schema import quotas, tasks


def _pinned_to(model: str, others: Sequence[str]) -> sa.ColumnElement[bool]:
    """Pending tasks that may run on ``model`` and on none of ``others``."""
    allowed = tasks.c.allowed_models
    condition = sa.and_(tasks.c.status == "pending", allowed.is_not(None), allowed.any_() == model)
    if others:
        condition = sa.and_(condition, sa.not_(allowed.overlap(sa.cast(list(others), allowed.type))))
    return condition


def _other_models(conn: Connection, model: str) -> list[str]:
    return [r[0] for r in conn.execute(sa.select(quotas.c.name).where(quotas.c.name != model))]


def model_occupancy(conn: Connection, model: str) -> tuple[int, int]:
    """(tasks bound to ``model``: ready, queued or running on it, a hedge included; pending tasks
    that only it may take): what removing it would strand. Runs in the caller's transaction."""
    others = _other_models(conn, model)
    in_flight = conn.execute(
        sa.select(sa.func.count()).where(
            tasks.c.status.in_(("ready", "queued", "running")), sa.or_(tasks.c.model == model, tasks.c.hedge_model == model)
        )
    ).scalar_one()
    pinned = conn.execute(sa.select(sa.func.count()).where(_pinned_to(model, others))).scalar_one()
    return int(in_flight), int(pinned)


def fail_pinned(conn: Connection, model: str, reason: str) -> int:
    """Fail the pending tasks that only ``model`` may take (it is being removed)."""
    others = _other_models(conn, model)
    result = conn.execute(
        sa.update(tasks).where(_pinned_to(model, others)).values(status="failed", error=reason, updated_at=sa.func.now())
    )
    return int(result.rowcount)
