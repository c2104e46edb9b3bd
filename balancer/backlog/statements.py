"""What every guarded status change of a task shares.

A change after dispatch applies only while the task is still ``queued`` or
``running`` under the admission id its message carries (or, for a hedge, its
hedge's id), so a late or duplicate message never overwrites what a newer
dispatch did, and a solved task is never written twice. The solve path's
writes are single statements sent in autocommit (:func:`one_statement`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from balancer.storage.schema import quotas, tasks


@dataclass(frozen=True)
class SolveContext:
    id: int
    status: str
    prompt: str
    max_tokens: int
    admission_id: str | None
    attempts: int
    rate_limited: int
    #: The task's source (its calls' ledger rows name it).
    source: str
    #: The call's model ends a request whose client went (``Quota.on_disconnect == "stop"``):
    #: only then is cutting the call off worth anything (see :mod:`balancer.calls.solver`).
    stops_on_disconnect: bool = False
    #: The call's model's prices and currency when the call starts: its ledger row's cost.
    price_per_million_input: float | None = None
    price_per_million_output: float | None = None
    currency: str | None = None


def admission_guard(task_id: Any, admission_id: Any):  # noqa: ANN202
    return sa.and_(tasks.c.id == task_id, tasks.c.admission_id == admission_id, tasks.c.status.in_(("ready", "queued", "running")))


def context_columns(model: Any) -> tuple[Any, ...]:
    """What a call on ``model`` (a column naming it) needs, in :class:`SolveContext` order;
    the model's ``on_disconnect`` and prices come in the same statement, from its quota row."""
    def of_quota(column: Any) -> Any:
        return sa.select(column).where(quotas.c.name == model).scalar_subquery()

    return (tasks.c.id, tasks.c.status, tasks.c.prompt, tasks.c.max_tokens, tasks.c.admission_id,
            tasks.c.attempts, tasks.c.rate_limited, tasks.c.source,
            sa.func.coalesce(of_quota(quotas.c.on_disconnect == "stop"), sa.false()),
            of_quota(quotas.c.price_per_million_input), of_quota(quotas.c.price_per_million_output),
            of_quota(quotas.c.currency))


def hedge_guard(task_id: Any, hedge_admission_id: Any):  # noqa: ANN202
    return sa.and_(tasks.c.id == task_id, tasks.c.hedge_admission_id == hedge_admission_id, tasks.c.status == "running")


@contextmanager
def one_statement(engine: Engine) -> Iterator[Connection]:
    """A connection for a write that is one statement, atomic on its own.

    In autocommit, psycopg2 sends the statement alone: one round trip, where a
    transaction costs three (its own BEGIN, the statement, COMMIT). The solve
    path's writes are all single guarded ``UPDATE ... RETURNING`` statements.
    The flag is set on the pooled psycopg2 connection and put back by hand:
    ``execution_options(isolation_level="AUTOCOMMIT")`` would do the same, but
    SQLAlchemy then resets the level at check-in with a ``SET``, one round trip
    more (seen with strace).
    """
    with engine.connect() as conn:
        dbapi: Any = conn.connection.driver_connection  # psycopg2's own connection
        dbapi.autocommit = True
        try:
            yield conn
        finally:
            if not dbapi.closed:
                dbapi.autocommit = False


# The solve path's two statements per task, built once with bound parameters.
# SQLAlchemy caches a statement's compiled SQL, but building the statement
# object again on every call cost about four times what executing it does
# (0.70 ms of CPU per start_solve against 0.16 ms; docs/benchmark-history.md, the hot path).
TASK_ID: Any = sa.bindparam("b_task_id")


ADMISSION_ID: Any = sa.bindparam("b_admission_id")


def update_where(engine: Engine, guard: Any, /, **values: object) -> bool:
    """Apply ``values`` (column names) to the one task ``guard`` matches; False if none does."""
    with one_statement(engine) as conn:
        return conn.execute(
            sa.update(tasks).where(guard).values(updated_at=sa.func.now(), **values).returning(tasks.c.id)
        ).first() is not None
