"""Hedges: running calls that straggle, recording a hedge on one, what a hedge's
call needs, and clearing a hedge that got no answer."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from balancer.backlog.statements import (
    SolveContext,
    admission_guard,
    context_columns,
    hedge_guard,
    one_statement,
    update_where,
)
from balancer.storage.schema import tasks


def start_hedge(engine: Engine, task_id: int, hedge_admission_id: str, lease_seconds: int | None = None) -> SolveContext | None:
    """What a hedge's call needs; None if the task is no longer running with this hedge
    (its first call answered, or the sweep returned it).

    With ``lease_seconds`` (the hedge's start), the task's deadline is moved to at
    least one lease from now in the same statement, so the sweep cannot return the
    task between the hedge's start and its first heartbeat (issue 40 finding 4).
    Without it (the re-check after the start gate) it changes nothing. The task
    stays ``running`` under its first call either way, and a hedge does not count
    as an attempt.
    """
    guard = hedge_guard(task_id, hedge_admission_id)
    with one_statement(engine) as conn:
        if lease_seconds is None:
            row = conn.execute(sa.select(*context_columns(tasks.c.hedge_model)).where(guard)).first()
        else:
            later = sa.func.now() + timedelta(seconds=lease_seconds)
            row = conn.execute(
                sa.update(tasks).where(guard)
                .values(deadline=sa.func.greatest(sa.func.coalesce(tasks.c.deadline, later), later))
                .returning(*context_columns(tasks.c.hedge_model))
            ).first()
    return SolveContext(*row) if row else None


@dataclass(frozen=True)
class Straggler:
    """A running call that a hedge might overtake."""

    id: int
    model: str
    admission_id: str
    estimated_tokens: int
    allowed_models: tuple[str, ...] | None
    elapsed_ms: float
    source: str = "submit"
    hedge_admission_id: str | None = None  # a hedge in flight on one of the orphans, which a new hedge replaces


def stragglers(conn: Connection, max_hedges: int, limit: int = 50,
               orphans: Collection[str] | None = None) -> list[Straggler]:
    """Running tasks with no hedge in flight and fewer than ``max_hedges`` so far, longest-running
    first. With ``orphans`` (models no worker consumes), only the tasks whose call runs on one of
    them, whatever their hedges so far, and those whose hedge in flight runs on one of them too:
    a hedge sent to a model of the host that was then cut off stands in for nothing, and the task
    waited a whole lease for the sweep."""
    if orphans is None:
        which = sa.and_(tasks.c.hedge_admission_id.is_(None), tasks.c.hedges < max_hedges)
    else:
        names = sorted(orphans)
        which = sa.and_(tasks.c.model.in_(names),
                        sa.or_(tasks.c.hedge_admission_id.is_(None), tasks.c.hedge_model.in_(names)))
    rows = conn.execute(
        sa.select(
            tasks.c.id, tasks.c.model, tasks.c.admission_id, tasks.c.estimated_tokens, tasks.c.allowed_models,
            (sa.extract("epoch", sa.func.now() - tasks.c.started_at) * 1000).label("elapsed_ms"), tasks.c.source,
            tasks.c.hedge_admission_id,
        )
        .where(tasks.c.status == "running", tasks.c.started_at.is_not(None), which)
        .order_by(tasks.c.started_at)
        .limit(limit)
    ).all()
    return [
        Straggler(r.id, r.model, r.admission_id, r.estimated_tokens,
                  tuple(r.allowed_models) if r.allowed_models else None, float(r.elapsed_ms), r.source,
                  r.hedge_admission_id)
        for r in rows
    ]


def hedge_spending(conn: Connection) -> tuple[int, int]:
    """(tokens hedges were admitted with, tokens of the run) over the current run:
    the tasks created since the oldest one still unfinished."""
    oldest = (
        sa.select(sa.func.min(tasks.c.created_at))
        .where(tasks.c.status.in_(("pending", "ready", "queued", "running")))
        .scalar_subquery()
    )
    row = conn.execute(
        sa.select(sa.func.coalesce(sa.func.sum(tasks.c.hedge_tokens), 0),
                  sa.func.coalesce(sa.func.sum(tasks.c.estimated_tokens), 0))
        .where(tasks.c.created_at >= oldest)
    ).one()
    return int(row[0]), int(row[1])


def mark_hedged(conn: Connection, task_id: int, admission_id: str, hedge_admission_id: str, model: str, tokens: int,
                replacing: str | None = None) -> bool:
    """Record a hedge, if the task still runs under ``admission_id`` with no hedge in flight (or, with
    ``replacing``, with that one: a hedge on a model no worker consumes any more), and no other
    transaction holds its row (a worker writing its answer or renewing its deadline; one whose host
    was cut off mid-write holds it until the cut heals, which the dispatcher would wait for). A later
    round hedges it once the row is free."""
    free = tasks.alias("free")
    unlocked = sa.select(free.c.id).where(free.c.id == task_id).with_for_update(skip_locked=True)
    result = conn.execute(
        sa.update(tasks)
        .where(tasks.c.id == task_id, tasks.c.id.in_(unlocked.scalar_subquery()), tasks.c.status == "running",
               tasks.c.admission_id == admission_id,
               tasks.c.hedge_admission_id.is_(None) if replacing is None else tasks.c.hedge_admission_id == replacing)
        .values(hedge_admission_id=hedge_admission_id, hedge_model=model, hedges=tasks.c.hedges + 1,
                hedge_tokens=tasks.c.hedge_tokens + tokens, updated_at=sa.func.now())
    )
    return result.rowcount == 1


def clear_hedge(engine: Engine, task_id: int, hedge_admission_id: str) -> bool:
    """A hedge that got no answer: the task is again decided by its first call alone."""
    return update_where(engine, sa.and_(tasks.c.id == task_id, tasks.c.hedge_admission_id == hedge_admission_id),
                         hedge_admission_id=None, hedge_model=None)


def hedge_in_flight(engine: Engine, task_id: int, admission_id: str) -> bool | None:
    """For a task's first call whose status change was refused: whether a hedge is in flight
    (True: the hedge's answer decides), or not (False: the change may apply); None if the task
    is no longer queued or running under ``admission_id`` (answered, removed, or dispatched again)."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(tasks.c.hedge_admission_id).where(admission_guard(task_id, admission_id))
        ).first()
    return None if row is None else row[0] is not None
