"""Task deadlines in PostgreSQL, the other half of a call's lease: tasks whose
worker stopped renewing them go back to ``pending`` (the sweep; not those a
worker still keeps alive in Redis), the calls in
flight re-seed a Redis that lost its data, and overdue calls are counted."""

from __future__ import annotations

from collections.abc import Collection

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.admission import LeaseSeed
from balancer.storage.ready import READY_ID_PREFIX
from balancer.storage.schema import tasks


def return_expired(engine: Engine) -> int:
    """Queued/running tasks past their deadline go back to pending (lost message, dead worker)."""
    with engine.begin() as conn:
        result = conn.execute(
            sa.update(tasks)
            .where(tasks.c.status.in_(("queued", "running")), tasks.c.deadline < sa.func.now())
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
    return result.rowcount


def keep_live_calls(engine: Engine, alive: Collection[str], lease_seconds: int) -> int:
    """Move the deadline one lease from now for queued/running tasks whose call or
    hedge is in ``alive`` (a worker still beats for it in Redis, though maybe it
    cannot reach PostgreSQL: see :mod:`balancer.pipeline.heartbeat`) and whose
    deadline is less than a lease away, so none passes before :func:`return_expired`,
    which the sweep runs next. Returns how many were past their deadline."""
    ids = list(alive)
    if not ids:
        return 0
    with engine.begin() as conn:
        overdue = conn.execute(
            sa.text(
                """
                UPDATE tasks AS t SET deadline = now() + make_interval(secs => :lease)
                  FROM (SELECT id, deadline < now() AS overdue FROM tasks
                         WHERE status IN ('queued', 'running') AND deadline < now() + make_interval(secs => :lease)
                           AND (admission_id = ANY(:ids) OR hedge_admission_id = ANY(:ids))
                           FOR UPDATE) AS old
                 WHERE t.id = old.id
             RETURNING old.overdue
                """
            ),
            {"lease": lease_seconds, "ids": ids},
        ).scalars().all()
    return sum(1 for o in overdue if o)


def in_flight_leases(engine: Engine, lease_ms: int) -> list[LeaseSeed]:
    """Calls PostgreSQL believes are in flight, to re-seed a restored Redis.

    Not a ready-list entry still ``queued``: no call runs under it and its list
    is gone with the data, so it would only hold a slot; the sweep returns it
    to pending at its deadline."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                tasks.c.admission_id,
                tasks.c.model,
                tasks.c.estimated_tokens,
                (sa.extract("epoch", sa.func.coalesce(tasks.c.deadline, sa.func.now()) - sa.func.now()) * 1000).label("remaining_ms"),
            ).where(tasks.c.status.in_(("queued", "running")), tasks.c.admission_id.is_not(None),
                    sa.not_(sa.and_(tasks.c.status == "queued", tasks.c.admission_id.startswith(READY_ID_PREFIX))))
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


def overdue_count(engine: Engine) -> int:
    """Queued or running tasks past their deadline: no heartbeat renewed them (their
    worker is gone) and the sweep tick has not returned them to pending yet."""
    with engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).where(tasks.c.status.in_(("queued", "running")), tasks.c.deadline < sa.func.now())
        ).scalar_one())
