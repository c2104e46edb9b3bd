"""Database writes that outlast a PostgreSQL outage, within the solve's deadline."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The running solve's deadline (``time.monotonic()``), set by the solver for each call: its
#: database retries give up there, as its HTTP call ends by ``backend_timeout``.
SOLVE_DEADLINE: ContextVar[float | None] = ContextVar("solve_deadline", default=None)


def with_db_retry(operation: Callable[[], T], *, give_up_after: float = 120.0, sleep: Callable[[float], None] = time.sleep) -> T:
    """Run a database write, retrying while PostgreSQL is unreachable, or while
    every pooled connection is busy (a pool checkout timeout): an answer in
    hand is not dropped for want of a connection, until the solve's deadline
    (:data:`SOLVE_DEADLINE`), so no solve outlives the limit that
    ``Settings.check_timing`` compares with the broker's visibility timeout."""
    deadline = time.monotonic() + give_up_after
    solve_deadline = SOLVE_DEADLINE.get()
    if solve_deadline is not None:
        deadline = min(deadline, solve_deadline)
    delay = 0.2
    while True:
        try:
            return operation()
        except (DBAPIError, PoolTimeout) as exc:
            transient = isinstance(exc, (OperationalError, PoolTimeout)) or (
                isinstance(exc, DBAPIError) and exc.connection_invalidated
            )
            if not transient:
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            delay = min(delay, left)
            log.warning("database unavailable, retrying the write in %.1fs: %s", delay, str(exc).splitlines()[0])
            sleep(delay)
            delay = min(delay * 2, 5.0)
