"""Task deadlines in PostgreSQL, the other half of a call's lease: tasks whose
worker stopped renewing them go back to ``pending`` (the sweep), the calls in
flight re-seed a Redis that lost its data, and overdue calls are counted."""

from __future__ import annotations

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
