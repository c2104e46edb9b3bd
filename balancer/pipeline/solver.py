"""Solve one task: re-assert its slot, call the backend once, write the answer once.

Outcomes and what happens to the slot and the task:

====================  ==========================================================
stale / duplicate     message for a task already solved, failed or re-dispatched
                      under another admission: release this admission, no call
no room               the lease expired and its slot is taken (redelivery after
                      a crash), or the model was disabled: back to pending, no call
solved                as soon as the backend answers: settle the tokens as the
                      model's accounting says, lower the buckets to the
                      provider's remaining-quota headers, add the latency to
                      the model's sketch and release the slot (one round
                      trip); then answer, usage and ``solved`` in one
                      guarded UPDATE
rate_limited (429)    the model is paused for Retry-After, once per window
                      (atomically in Lua), so *every* dispatcher holds it,
                      whichever limit caused the 429; the task goes back to
                      pending at once, the call is not counted as an attempt,
                      and the task is ``failed`` after ``MAX_RATE_LIMITED`` 429s
transient             5xx, timeout, refused connection, malformed reply: back to
                      pending with exponential back-off, preferring another
                      allowed model for the retry; ``failed`` after
                      ``max_attempts`` calls
permanent             4xx: ``failed`` with the error
====================  ==========================================================

A *hedge* (``SolveMessage.hedge``) is a second call for a task whose first
call straggles, on another model (see the dispatcher). The first answer of the
two is written; the other is a duplicate. A hedge that gets no answer (429,
transient, permanent) only frees its slot and leaves the task to its first
call; while a hedge is in flight, a failure of the first call does not send
the task back, so the hedge's answer still counts. The losing call is not cut
off: a provider that got a non-streamed request keeps working and charging for
it after a disconnect, so its slot stays held until the call ends, exactly as
if it had been allowed to finish, and its answer is dropped as a duplicate.

The slot is released as soon as the call ends, before any database write, and
in every case (``finally``), so nothing leaks even on an unexpected exception.
The answer write is retried while PostgreSQL is down: a worker that has an
answer never calls the backend again for it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from balancer.admission import AdmissionCore, Admitted, Settlement
from balancer.backends import Backend, Completion, Permanent, RateLimited, Transient
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
    hedge: bool = False


def backoff_seconds(attempt: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Exponential back-off after the ``attempt``-th failed call.

    >>> [backoff_seconds(n) for n in (1, 2, 3, 6, 10)]
    [1.0, 2.0, 4.0, 30.0, 30.0]
    """
    return min(cap, base * 2 ** (attempt - 1))


def with_db_retry(operation: Callable[[], T], *, give_up_after: float = 120.0, sleep: Callable[[float], None] = time.sleep) -> T:
    """Run a database write, retrying while PostgreSQL is unreachable, or while
    every pooled connection is busy (a pool checkout timeout): an answer in
    hand is never dropped for want of a connection."""
    deadline = time.monotonic() + give_up_after
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
            if time.monotonic() > deadline:
                raise
            log.warning("database unavailable, retrying the write in %.1fs: %s", delay, str(exc).splitlines()[0])
            sleep(delay)
            delay = min(delay * 2, 5.0)


def solve(services: Services, backend: Backend, msg: SolveMessage) -> str:
    """Process one ``solve`` message; returns the outcome name (for logs and tests)."""
    core, engine, settings = services.core, services.engine, services.settings
    finished = False

    def finish(settlement: Settlement | None = None) -> None:
        """Free the slot (settling what the call tells) once, in one round trip."""
        nonlocal finished
        if not finished:
            finished = True
            core.finish(msg.admission_id, settlement)

    if msg.hedge:
        try:
            return _solve_hedge(services, backend, msg)
        finally:
            finish()

    try:
        ctx = with_db_retry(lambda: store.start_solve(engine, msg.task_id, msg.admission_id, settings.lease_seconds))
        if ctx is None:
            return "stale"
        renewed = core.renew(msg.admission_id, msg.model, msg.estimated_tokens)
        if not isinstance(renewed, Admitted):
            with_db_retry(
                lambda: store.back_to_pending(
                    engine, msg.task_id, msg.admission_id, error="no slot to start the call", uncount_attempt=True
                )
            )
            return "no_room"
        attempt = ctx.attempts
        if renewed.start_delay_ms > 0:  # the RPM start gate: the provider paces call starts
            time.sleep(renewed.start_delay_ms / 1000)
        try:
            completion, latency_ms = _call(backend, msg, ctx)
        except RateLimited as exc:
            pause_for(core, msg.model, exc)
            finish()
            error = str(exc)
            if ctx.rate_limited + 1 >= MAX_RATE_LIMITED:
                reason = f"rate limited {MAX_RATE_LIMITED} times: {error}"
                with_db_retry(
                    lambda: store.mark_failed(engine, msg.task_id, msg.admission_id, reason, uncount_attempt=True)
                )
                return "failed"
            with_db_retry(  # a 429 is the quota's doing, not the task's: it does not use up an attempt
                lambda: store.back_to_pending(
                    engine, msg.task_id, msg.admission_id, error=error, rate_limited=True, uncount_attempt=True
                )
            )
            return "rate_limited"
        except Transient as exc:
            finish()
            error = str(exc)
            if attempt >= settings.max_attempts:
                reason = f"after {attempt} attempts: {error}"
                with_db_retry(lambda: store.mark_failed(engine, msg.task_id, msg.admission_id, reason))
                return "failed"
            with_db_retry(
                lambda: store.back_to_pending(
                    engine, msg.task_id, msg.admission_id, error=error, delay_seconds=backoff_seconds(attempt),
                    avoid_model=msg.model,
                )
            )
            return "retry"
        except Permanent as exc:
            finish()
            error = str(exc)
            with_db_retry(lambda: store.mark_failed(engine, msg.task_id, msg.admission_id, error))
            return "failed"
        # The provider's slot is free the moment it answered, so ours is freed now,
        # before the write: the write needs no slot, and keeps its retry and its
        # exactly-once guard. The next call can be on the wire while this one is stored.
        finish(answered(completion, ctx, latency_ms))
        written = with_db_retry(
            lambda: store.mark_solved(
                engine, msg.task_id, msg.admission_id, completion.answer, completion.prompt_tokens, completion.completion_tokens
            )
        )
        return "solved" if written else "duplicate"
    finally:
        finish()  # every path frees the slot, even an unexpected exception



def pause_for(core: AdmissionCore, model: str, exc: RateLimited) -> None:
    """Pause the model for the 429's Retry-After (1 s if absent) and sync to its headers."""
    retry_after = exc.retry_after if exc.retry_after is not None else 1.0
    core.penalize(model, math.ceil(retry_after * 1000), exc.remaining.tokens, exc.remaining.requests)


def _call(backend: Backend, msg: SolveMessage, ctx: store.SolveContext) -> tuple[Completion, int]:
    """The backend call, and how long it took in ms (a sample for the model's latency sketch)."""
    called_at = time.monotonic()
    completion = backend.complete(msg.model, ctx.prompt, ctx.max_tokens)
    return completion, round((time.monotonic() - called_at) * 1000)


def answered(completion: Completion, ctx: store.SolveContext, latency_ms: int) -> Settlement:
    """What an answered call tells the admission core (usage, headers, latency)."""
    return Settlement(
        used_tokens=completion.total_tokens,
        reserved_tokens=completion.prompt_tokens + ctx.max_tokens,
        remaining_tokens=completion.remaining.tokens,
        remaining_requests=completion.remaining.requests,
        latency_ms=latency_ms,
        completion_tokens=completion.completion_tokens,
    )


def _solve_hedge(services: Services, backend: Backend, msg: SolveMessage) -> str:
    """One hedge call: write its answer if it comes first; otherwise only free its slot."""
    core, engine = services.core, services.engine
    ctx = with_db_retry(lambda: store.start_hedge(engine, msg.task_id, msg.admission_id))
    if ctx is None:
        return "stale"  # the first call answered before the hedge started
    renewed = core.renew(msg.admission_id, msg.model, msg.estimated_tokens)
    if not isinstance(renewed, Admitted):
        with_db_retry(lambda: store.clear_hedge(engine, msg.task_id, msg.admission_id))
        return "no_room"
    if renewed.start_delay_ms > 0:
        time.sleep(renewed.start_delay_ms / 1000)
    try:
        completion, latency_ms = _call(backend, msg, ctx)
    except (RateLimited, Transient, Permanent) as exc:
        if isinstance(exc, RateLimited):
            pause_for(core, msg.model, exc)
        core.finish(msg.admission_id)
        with_db_retry(lambda: store.clear_hedge(engine, msg.task_id, msg.admission_id))
        return "hedge_failed"
    core.finish(msg.admission_id, answered(completion, ctx, latency_ms))
    written = with_db_retry(
        lambda: store.mark_solved(
            engine, msg.task_id, msg.admission_id, completion.answer, completion.prompt_tokens,
            completion.completion_tokens, hedge_model=msg.model,
        )
    )
    return "hedge_won" if written else "duplicate"
