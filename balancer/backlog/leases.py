"""Task deadlines in PostgreSQL, the other half of a call's lease: tasks whose
worker stopped renewing them go back to ``pending`` (the sweep; not those a
worker still keeps alive in Redis), the calls in
flight re-seed a Redis that lost its data. (Overdue calls are counted by
:func:`balancer.backlog.reads.overdue_count`.)"""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.admission.values import LeaseSeed
from balancer.storage.schema import tasks


def return_expired(engine: Engine) -> int:
    """Queued/running tasks past their deadline go back to pending (lost message, dead worker)."""
    return sweep_expired(engine, (), 0)[0]


def sweep_expired(engine: Engine, alive: Collection[str], lease_seconds: int) -> tuple[int, int]:
    """The sweep: ready/queued/running tasks past their deadline go back to pending (a
    lost message, a dead worker), except those whose call or hedge is in
    ``alive``: a worker still keeps that call alive in Redis, though it could
    not renew the deadline in PostgreSQL (see :mod:`balancer.calls.heartbeat`);
    their deadline moves one lease on. One transaction: the rows past their deadline
    are locked first, and both changes apply to exactly those. A row another transaction
    holds locked is skipped until a later sweep: a worker whose host was cut off in the
    middle of a write holds its rows until the cut heals, and the sweep (and the
    dispatcher's ticks after it) would wait that long. Returns (returned, kept)."""
    with engine.begin() as conn:
        rows = conn.execute(
            sa.select(tasks.c.id, tasks.c.admission_id, tasks.c.hedge_admission_id)
            .where(tasks.c.status.in_(("ready", "queued", "running")), tasks.c.deadline < sa.func.now())
            .with_for_update(skip_locked=True)
        ).all()
        live = set(alive)
        keep: list[int] = []
        back: list[int] = []
        for r in rows:
            (keep if r.admission_id in live or r.hedge_admission_id in live else back).append(r.id)
        if keep:
            conn.execute(sa.update(tasks).where(tasks.c.id.in_(keep))
                         .values(deadline=sa.func.now() + timedelta(seconds=lease_seconds)))
        if back:
            conn.execute(
                sa.update(tasks)
                .where(tasks.c.id.in_(back))
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
    return len(back), len(keep)


def _return_to_pending(engine: Engine, which: sa.ColumnElement[bool], reason: str,
                   statuses: tuple[str, ...] = ("queued",)) -> list[tuple[int, str]]:
    """Tasks in ``statuses`` matching ``which`` back to pending now; (task id, old admission id)
    of each.

    The old admission id comes from the locked subquery (RETURNING shows the row as updated).
    A row a worker is starting (locked) is skipped: its start wins, and the call runs. A
    message consumed later finds its task no longer under its admission and makes no call
    (``stale``). No attempt is counted."""
    old = (sa.select(tasks.c.id, tasks.c.model, tasks.c.admission_id)
           .where(tasks.c.status.in_(statuses), which).with_for_update(skip_locked=True).subquery("old"))
    statement = (
        sa.update(tasks).where(tasks.c.id == old.c.id)
        .values(status="pending", model=None, admission_id=None, deadline=None, updated_at=sa.func.now(),
                error=sa.literal(reason) + old.c.model)
        .returning(old.c.id, old.c.admission_id)
    )
    with engine.begin() as conn:
        rows = conn.execute(statement).all()
    return [(r.id, r.admission_id) for r in rows]


def return_unconsumed(engine: Engine, models: Collection[str]) -> list[tuple[int, str]]:
    """Queued tasks of models no worker consumes now (their solve messages wait in a queue
    nobody reads) back to pending at once, not at their deadline; (task id, admission id)
    of each, whose leases the caller withdraws. So are their ``ready`` tasks: a worker may have
    taken one from its list just before its host was cut off, and it would wait for its deadline.
    A returned task's start, if it ever comes, finds it no longer under its admission and makes no
    call; an entry left on a list is refused the same way when a finishing call takes it."""
    if not models:
        return []
    return _return_to_pending(engine, tasks.c.model.in_(sorted(models)), "returned to pending: no worker consumes model.",
                          statuses=("queued", "ready"))


def queued_since(engine: Engine, seconds: float) -> tuple[list[tuple[str, str, float]], list[tuple[str, str, float]]]:
    """(admission id, model, seconds queued) of the tasks ``queued``, and of those ``ready``, for
    longer than ``seconds``, in one query: their solve messages (or ready-list entries) should long
    have been taken (see :mod:`balancer.dispatch.lost`)."""
    age = sa.extract("epoch", sa.func.now() - tasks.c.queued_at)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.admission_id, tasks.c.model, age.label("age"), tasks.c.status)
            .where(tasks.c.status.in_(("queued", "ready")), tasks.c.admission_id.is_not(None),
                   tasks.c.queued_at < sa.func.now() - timedelta(seconds=seconds))
        ).all()
    queued = [(r.admission_id, r.model, float(r.age)) for r in rows if r.status == "queued"]
    ready = [(r.admission_id, r.model, float(r.age)) for r in rows if r.status == "ready"]
    return queued, ready


def return_lost(engine: Engine, admission_ids: Collection[str]) -> list[tuple[int, str]]:
    """Queued tasks whose solve messages the broker lost (in no queue, held by no live worker)
    back to pending now, not at their deadline; (task id, admission id) of each, whose leases
    the caller withdraws."""
    if not admission_ids:
        return []
    return _return_to_pending(engine, tasks.c.admission_id.in_(sorted(admission_ids)),
                          "returned to pending: the broker lost its solve message to model.")


def return_unlisted(engine: Engine, admission_ids: Collection[str]) -> list[tuple[int, str]]:
    """Ready tasks whose ready-list entries Redis lost (a failover) back to pending now, not at
    their deadline; (task id, admission id) of each."""
    if not admission_ids:
        return []
    return _return_to_pending(engine, tasks.c.admission_id.in_(sorted(admission_ids)),
                          "returned to pending: Redis lost its ready-list entry on model.", statuses=("ready",))


def in_flight_leases(engine: Engine, lease_ms: int) -> list[LeaseSeed]:
    """Calls PostgreSQL believes are in flight, to re-seed a restored Redis.

    Not a ``ready`` task (a ready-list entry): no call runs under it and its list
    is gone with the data, so it would only hold a slot; the dispatcher's look for lost
    entries returns it to pending within seconds (:mod:`balancer.dispatch.lost`)."""
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

