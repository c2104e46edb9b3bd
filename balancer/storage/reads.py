"""Read-only queries over the backlog for ``status``, the metrics exporter and the drain ETA."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.storage.schema import TASK_STATUSES, tasks


def pending_groups(engine: Engine) -> list[tuple[list[str] | None, int, int]]:
    """The backlog's composition: (allowed models or None, pending tasks, their estimated tokens)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.allowed_models, sa.func.count(), sa.func.coalesce(sa.func.sum(tasks.c.estimated_tokens), 0))
            .where(tasks.c.status == "pending").group_by(tasks.c.allowed_models)
        ).all()
    return [(r[0], int(r[1]), int(r[2])) for r in rows]


def pending_groups_of(engine: Engine, sources: Collection[str]) -> list[tuple[list[str] | None, int]]:
    """The pending tasks of ``sources`` by allowed models (no query when there are none)."""
    if not sources:
        return []
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.allowed_models, sa.func.count())
            .where(tasks.c.status == "pending", tasks.c.source.in_(sorted(sources))).group_by(tasks.c.allowed_models)
        ).all()
    return [(r[0], int(r[1])) for r in rows]


def recent_solves(engine: Engine, window_s: float) -> tuple[list[tuple[list[str] | None, int]], float]:
    """The work solved in the last ``window_s`` seconds, grouped by allowed models,
    and the seconds it covers: the window, or less when the oldest of those
    tasks was created more recently (a run that started inside the window)."""
    since = sa.func.now() - timedelta(seconds=window_s)
    age = sa.extract("epoch", sa.func.now() - sa.func.min(tasks.c.created_at))
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.allowed_models, sa.func.count(), age)
            .where(tasks.c.status == "solved", tasks.c.updated_at >= since).group_by(tasks.c.allowed_models)
        ).all()
    covered = min([window_s, *(float(r[2]) for r in rows)])
    return [(r[0], int(r[1])) for r in rows], covered


def recent_solves_by_model(engine: Engine, window_s: float) -> dict[str, int]:
    """Tasks solved in the last ``window_s`` seconds, by the model that answered them."""
    since = sa.func.now() - timedelta(seconds=window_s)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.model, sa.func.count())
            .where(tasks.c.status == "solved", tasks.c.updated_at >= since, tasks.c.model.is_not(None))
            .group_by(tasks.c.model)
        ).all()
    return {r[0]: int(r[1]) for r in rows}


def running_calls(engine: Engine) -> dict[str, tuple[int, float]]:
    """Tasks running now, by model: how many, and the seconds they have run so far in all."""
    age = sa.func.coalesce(sa.func.sum(sa.extract("epoch", sa.func.now() - tasks.c.started_at)), 0)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.model, sa.func.count(), age)
            .where(tasks.c.status == "running", tasks.c.model.is_not(None), tasks.c.started_at.is_not(None))
            .group_by(tasks.c.model)
        ).all()
    return {r[0]: (int(r[1]), max(0.0, float(r[2]))) for r in rows}


def unfinished_count(engine: Engine) -> int:
    """Tasks not finished yet: pending, ready, queued or running (each counted once, however many calls it has)."""
    with engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).where(tasks.c.status.in_(("pending", "ready", "queued", "running")))).scalar_one())


def status_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(tasks.c.status, sa.func.count()).group_by(tasks.c.status)).all()
    counts = dict.fromkeys(TASK_STATUSES, 0)
    counts.update({status: n for status, n in rows})
    return counts


def stranded_pending(engine: Engine, models: Sequence[str]) -> int:
    """Pending tasks that none of ``models`` may take (they were pinned to models since removed)."""
    with engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.count())
            .where(tasks.c.status == "pending", tasks.c.allowed_models.is_not(None),
                   sa.not_(tasks.c.allowed_models.overlap(sa.cast(list(models), tasks.c.allowed_models.type))))
        ).scalar_one()
