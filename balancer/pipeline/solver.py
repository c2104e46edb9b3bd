"""Solve one task: re-assert its slot, call the backend once, write the answer once.

Outcomes and what happens to the slot and the task:

====================  ==========================================================
stale / duplicate     message for a task already solved, failed or re-dispatched
                      under another admission: release this admission, no call
no room               the lease expired and its slot is taken (redelivery after
                      a crash), or the model was disabled: back to pending, no call
solved                answer, usage and ``solved`` in one guarded UPDATE; then
                      reconcile actual tokens, release the slot
rate_limited (429)    the model's bucket is debited for Retry-After seconds of
                      TPM, so *every* dispatcher pauses that model; the task goes
                      back to pending at once and may be sent to another model
transient             5xx, timeout, refused connection, malformed reply: back to
                      pending with exponential back-off; ``failed`` after
                      ``max_attempts`` calls
permanent             4xx: ``failed`` with the error
====================  ==========================================================

The slot is released in every case (``finally``), so nothing leaks even on an
unexpected exception. The answer write is retried while PostgreSQL is down:
a worker that has an answer never calls the backend again for it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError

from balancer.admission import Admitted
from balancer.backends import Backend, Permanent, RateLimited, Transient
from balancer.services import Services
from balancer.storage import tasks as store

log = logging.getLogger(__name__)
T = TypeVar("T")

#: After this many 429s for one task, it is failed: the quotas are wrong, not the task.
MAX_RATE_LIMITED = 50


@dataclass(frozen=True)
class SolveMessage:
    task_id: int
    admission_id: str
    model: str
    estimated_tokens: int


def backoff_seconds(attempt: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Exponential back-off after the ``attempt``-th failed call.

    >>> [backoff_seconds(n) for n in (1, 2, 3, 6, 10)]
    [1.0, 2.0, 4.0, 30.0, 30.0]
    """
    return min(cap, base * 2 ** (attempt - 1))


def with_db_retry(operation: Callable[[], T], *, give_up_after: float = 120.0, sleep: Callable[[float], None] = time.sleep) -> T:
    """Run a database write, retrying while PostgreSQL is unreachable."""
    deadline = time.monotonic() + give_up_after
    delay = 0.2
    while True:
        try:
            return operation()
        except DBAPIError as exc:
            if not (isinstance(exc, OperationalError) or exc.connection_invalidated):
                raise
            if time.monotonic() > deadline:
                raise
            log.warning("database unavailable, retrying the write in %.1fs: %s", delay, str(exc).splitlines()[0])
            sleep(delay)
            delay = min(delay * 2, 5.0)


def solve(services: Services, backend: Backend, msg: SolveMessage) -> str:
    """Process one ``solve`` message; returns the outcome name (for logs and tests)."""
    core, engine, settings = services.core, services.engine, services.settings
    actual_tokens: int | None = None  # reconciled against the estimate when known
    try:
        ctx = with_db_retry(lambda: store.start_solve(engine, msg.task_id, msg.admission_id, settings.lease_seconds))
        if ctx is None:
            return "stale"
        if not isinstance(core.renew(msg.admission_id, msg.model, msg.estimated_tokens), Admitted):
            with_db_retry(
                lambda: store.back_to_pending(
                    engine, msg.task_id, msg.admission_id, error="no slot to start the call", uncount_attempt=True
                )
            )
            return "no_room"
        attempt = ctx.attempts
        try:
            completion = backend.complete(msg.model, ctx.prompt, ctx.max_tokens)
        except RateLimited as exc:
            retry_after = exc.retry_after if exc.retry_after is not None else 1.0
            tpm = core.live().get(msg.model)
            penalty = math.ceil(retry_after * tpm.quota.max_tokens_per_minute / 60) if tpm else 0
            actual_tokens = msg.estimated_tokens + penalty
            error = str(exc)
            if ctx.rate_limited + 1 >= MAX_RATE_LIMITED:
                reason = f"rate limited {MAX_RATE_LIMITED} times: {error}"
                with_db_retry(lambda: store.mark_failed(engine, msg.task_id, msg.admission_id, reason))
                return "failed"
            with_db_retry(
                lambda: store.back_to_pending(engine, msg.task_id, msg.admission_id, error=error, rate_limited=True)
            )
            return "rate_limited"
        except Transient as exc:
            error = str(exc)
            if attempt >= settings.max_attempts:
                reason = f"after {attempt} attempts: {error}"
                with_db_retry(lambda: store.mark_failed(engine, msg.task_id, msg.admission_id, reason))
                return "failed"
            with_db_retry(
                lambda: store.back_to_pending(
                    engine, msg.task_id, msg.admission_id, error=error, delay_seconds=backoff_seconds(attempt)
                )
            )
            return "retry"
        except Permanent as exc:
            error = str(exc)
            with_db_retry(lambda: store.mark_failed(engine, msg.task_id, msg.admission_id, error))
            return "failed"
        written = with_db_retry(
            lambda: store.mark_solved(
                engine, msg.task_id, msg.admission_id, completion.answer, completion.prompt_tokens, completion.completion_tokens
            )
        )
        if not written:
            return "duplicate"
        actual_tokens = completion.total_tokens
        return "solved"
    finally:
        core.finish(msg.admission_id, actual_tokens)

