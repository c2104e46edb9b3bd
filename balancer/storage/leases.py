"""Task deadlines in PostgreSQL, the other half of a call's lease: tasks whose
worker stopped renewing them go back to ``pending`` (the sweep; not those a
worker still keeps alive in Redis), the calls in
flight re-seed a Redis that lost its data. (Overdue calls are counted by
:func:`balancer.storage.reads.overdue_count`.)"""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.admission import LeaseSeed
from balancer.storage.schema import tasks


def return_expired(engine: Engine) -> int:
    """Queued/running tasks past their deadline go back to pending (lost message, dead worker)."""
    return sweep_expired(engine, (), 0)[0]


def sweep_expired(engine: Engine, alive: Collection[str], lease_seconds: int) -> tuple[int, int]:
    """The sweep: ready/queued/running tasks past their deadline go back to pending (a
    lost message, a dead worker), except those whose call or hedge is in
    ``alive``: a worker still keeps that call alive in Redis, though it could
    not renew the deadline in PostgreSQL (see :mod:`balancer.pipeline.heartbeat`);
    their deadline moves one lease on. One transaction, so both statements
    judge "past" by the same ``now()``. Returns (returned, kept)."""
    expired = sa.and_(tasks.c.status.in_(("ready", "queued", "running")), tasks.c.deadline < sa.func.now())
    ids = list(alive)
    with engine.begin() as conn:
        kept = 0
        if ids:
            kept = conn.execute(
                sa.update(tasks)
                .where(expired, sa.or_(tasks.c.admission_id.in_(ids), tasks.c.hedge_admission_id.in_(ids)))
                .values(deadline=sa.func.now() + timedelta(seconds=lease_seconds))
            ).rowcount
        result = conn.execute(
            sa.update(tasks)
            .where(expired)
            .values(
                status="pending",
                model=None,
                admission_id=None,
                hedge_admission_id=None,
                hedge_model=None,
                deadline=None,
                updated_at=sa.func.now(),
                error="returned to pending: deadline passed while " + tasks.c.status,
            )
        )
    return result.rowcount, kept


#: The old admission id comes from the locked subquery (RETURNING shows the row as updated). A
#: row a worker is starting (locked) is skipped: its start wins, and the call runs.
_RETURN_UNCONSUMED = sa.text(
    """
    UPDATE tasks AS t
       SET status = 'pending', model = NULL, admission_id = NULL, deadline = NULL, updated_at = now(),
           error = 'returned to pending: no worker consumes model.' || old.model
      FROM (SELECT id, model, admission_id FROM tasks
             WHERE status = 'queued' AND model = ANY(CAST(:models AS text[])) FOR UPDATE SKIP LOCKED) AS old
     WHERE t.id = old.id
    RETURNING old.id, old.admission_id
    """
)


def return_unconsumed(engine: Engine, models: Collection[str]) -> list[tuple[int, str]]:
    """Queued tasks of models no worker consumes now (their solve messages wait in a queue
    nobody reads) back to pending at once, not at their deadline; (task id, admission id)
    of each, whose leases the caller withdraws. A message consumed later finds its task
    no longer under its admission and makes no call (``stale``). No attempt is counted."""
    if not models:
        return []
    with engine.begin() as conn:
        rows = conn.execute(_RETURN_UNCONSUMED, {"models": sorted(models)}).all()
    return [(r.id, r.admission_id) for r in rows]


def in_flight_leases(engine: Engine, lease_ms: int) -> list[LeaseSeed]:
    """Calls PostgreSQL believes are in flight, to re-seed a restored Redis.

    Not a ``ready`` task (a ready-list entry): no call runs under it and its list
    is gone with the data, so it would only hold a slot; the sweep returns it
    to pending at its deadline."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                tasks.c.admission_id,
                tasks.c.model,
                tasks.c.estimated_tokens,
                (sa.extract("epoch", sa.func.coalesce(tasks.c.deadline, sa.func.now()) - sa.func.now()) * 1000).label("remaining_ms"),
            ).where(tasks.c.status.in_(("queued", "running")), tasks.c.admission_id.is_not(None))
        ).all()
        hedges = conn.execute(
            sa.select(
                tasks.c.hedge_admission_id, tasks.c.hedge_model, tasks.c.estimated_tokens,
                (sa.extract("epoch", sa.func.coalesce(tasks.c.deadline, sa.func.now()) - sa.func.now()) * 1000).label("remaining_ms"),
            ).where(tasks.c.status == "running", tasks.c.hedge_admission_id.is_not(None))
        ).all()
    # Time left, not an instant: PostgreSQL's clock and Redis's may disagree, and
    # the restored lease is placed on Redis's (restore.lua adds its own now).
    return [LeaseSeed(r[0], r[1], r.estimated_tokens, max(0, int(r.remaining_ms))) for r in [*rows, *hedges]]

