"""Solve one task: re-assert its slot, call the backend once, write the answer once.

Outcomes and what happens to the slot and the task:

====================  ==========================================================
stale / duplicate     message for a task already solved, failed or re-dispatched
                      under another admission: release this admission, no call
running elsewhere     a redelivered or duplicated message whose call still runs
                      in a live worker (its heartbeat keeps the task's deadline
                      ahead): no call, and the slot stays the live call's
no room               the lease expired and its slot is taken (redelivery after
                      a crash), or the model was disabled: back to pending, no call
solved                as soon as the backend answers: settle the tokens as the
                      model's accounting says, lower the buckets to the
                      provider's remaining-quota headers, add the latency to
                      the model's sketch, release the slot and, with
                      ``take_next``, admit the head of the model's ready list
                      as the slot's next call (one round trip), and start
                      that call's task; then answer, usage and ``solved`` in
                      one guarded UPDATE (in a chain, on the process's answer
                      writer, while the next call runs)
rate_limited (429)    the model is paused for Retry-After, once per window
                      (atomically in Lua), so *every* dispatcher holds it,
                      whichever limit caused the 429; the task goes back to
                      pending at once, the call is not counted as an attempt,
                      and the task is ``failed`` after ``MAX_RATE_LIMITED`` 429s
transient             5xx, timeout, refused connection, malformed reply, or any
                      unexpected error (logged with its traceback): back to
                      pending with exponential back-off, preferring another
                      allowed model for the retry; ``failed`` after
                      ``max_attempts`` calls
circuit_open          a transient failure that opens the model's circuit, or
                      comes while it is open (see trip.lua): an outage of the
                      backend, not the task's fault. Back to pending with no
                      attempt used and no back-off; the model is paused and
                      probed one call at a time until it answers again
permanent             4xx: ``failed`` with the error
====================  ==========================================================

A *hedge* (``SolveMessage.hedge``) is a second call for a task whose first
call straggles, on another model (see the dispatcher). The first answer of the
two is written. A hedge that gets no answer (429, transient, permanent) only
frees its slot and leaves the task to its first call; while a hedge is in
flight, a failure of the first call does not send the task back, so the
hedge's answer still counts.

Whether the loser is cut off follows its model's ``on_disconnect``:

- ``stop``: the provider ends a request whose client went. The winner cancels
  the loser (:mod:`balancer.pipeline.cancellation`): its HTTP request is
  closed, its worker thread and slot are free at once (outcome
  ``cancelled``), and its reservation (prompt + max_tokens) stays charged,
  since nothing tells what the provider counted.
- ``finish`` (the default): a provider that got a non-streamed request keeps
  working on it, and charging it, after the client goes. Closing the request
  would free nothing the provider counts, and would lose the moment the call
  really ends. So the loser runs to its end; its slot is freed, and its
  tokens settled, by its own answer, which is then a duplicate and never
  written. (A model switched to ``finish`` while one of its calls is being
  cut off holds that slot, charged, until the call would have hit the backend
  timeout: :meth:`AdmissionCore.hold`.)

The slot is released as soon as the call ends, before any database write, and
in every case (``finally``), so nothing leaks even on an unexpected exception.
The answer write is retried while PostgreSQL is down: a worker that has an
answer never calls the backend again for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from balancer.admission import AdmissionCore, Admitted, ReadyTask, Settlement
from balancer.backends import Backend, Cancelled, Completion, Permanent, RateLimited, Transient
from balancer.pipeline.cancellation import CancelListener, cancel_call
from balancer.pipeline.heartbeat import Heartbeat
from balancer.services import Services
from balancer.storage.hedges import clear_hedge, start_hedge
from balancer.storage.retry import SOLVE_DEADLINE, with_db_retry
from balancer.storage.statements import SolveContext
from balancer.storage.transitions import Answer, Written, back_to_pending, is_running_elsewhere, mark_failed, mark_solved, start_solve

if TYPE_CHECKING:
    from balancer.pipeline.answers import AnswerWriter

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
    #: Set for a ready task a finishing call took as its slot's next call: its
    #: lease is started and both start gates are passed, so wait this long and
    #: call, with no renew. None: a message from the dispatcher (renew first).
    start_delay_ms: int | None = None

    @classmethod
    def taken(cls, ready: ReadyTask) -> SolveMessage:
        return cls(ready.task_id, ready.admission_id, ready.model, ready.estimated_tokens,
                   start_delay_ms=ready.start_delay_ms)


@dataclass(frozen=True)
class NextCall:
    """The call a finishing slot took from its model's ready list, and its start,
    tried as soon as it was taken: its task's context, or None if it did not
    start (stale, or its call runs elsewhere). ``restock``: the list now holds
    fewer entries than the model has slots (see :class:`ReadyTask`)."""

    msg: SolveMessage
    context: SolveContext | None
    restock: bool = True


def backoff_seconds(attempt: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Exponential back-off after the ``attempt``-th failed call.

    >>> [backoff_seconds(n) for n in (1, 2, 3, 6, 10)]
    [1.0, 2.0, 4.0, 30.0, 30.0]
    """
    return min(cap, base * 2 ** (attempt - 1))


#: A solve's outcome: its name, or, for an answer written behind the next call
#: (see :func:`solve_chain`), the name to come once it is written.
Outcome = str | Future[str]

class Slot:
    """The call's admission: freed once, in one round trip, on every path, unless
    a cancelled call hands it over to a hold.

    With ``take_next``, an answered call's slot also takes its next call from
    the model's ready list in that round trip (:attr:`next`)."""

    def __init__(self, core: AdmissionCore, admission_id: str, take_next: bool = False) -> None:
        self.core, self.admission_id, self.done = core, admission_id, False
        self.take_next = take_next
        self.next: ReadyTask | None = None
        #: ``next`` with its start, once it is started.
        self.next_call: NextCall | None = None

    def free(self, settlement: Settlement | None = None) -> None:
        """Free the slot, settling what the call tells."""
        if not self.done:
            self.done = True
            if self.take_next and settlement is not None:
                self.next = self.core.finish_and_take(self.admission_id, settlement)
            else:
                self.core.finish(self.admission_id, settlement)

    def disown(self) -> None:
        """This message does not own the slot (another worker's call runs under it): never free it."""
        self.done = True

    def let_go(self, services: Services, model: str, ran_s: float) -> None:
        """A cancelled call: its slot as the provider sees it (see the module docstring)."""
        if self.done:
            return
        self.done = True
        quota = services.quotas.get(model)
        if quota is not None and quota.on_disconnect == "stop":
            self.core.finish(self.admission_id)
        else:
            self.core.hold(self.admission_id, round(max(0.0, services.settings.backend_timeout - ran_s) * 1000))


def solve(services: Services, backend: Backend, msg: SolveMessage, listener: CancelListener | None = None,
          heartbeat: Heartbeat | None = None) -> str:
    """Process one ``solve`` message; returns the outcome name (for logs and tests).

    With a ``listener`` (when hedging is on), the call can be cancelled by the
    task's other call. With a ``heartbeat`` (in workers), the call's lease and
    its task's deadline are renewed while it runs, from its start to its write.
    The whole solve ends within ``settings.hard_time_limit``: the call within
    ``backend_timeout`` (total time), the writes' retries by the rest."""
    outcome = solve_one(services, backend, msg, listener, heartbeat)[0]
    return outcome if isinstance(outcome, str) else outcome.result()


def solve_one(services: Services, backend: Backend, msg: SolveMessage | NextCall, listener: CancelListener | None = None,
              heartbeat: Heartbeat | None = None, *, take_next: bool = False,
              writer: AnswerWriter | None = None) -> tuple[Outcome, NextCall | None]:
    """:func:`solve` for a message, or for a :class:`NextCall` (already started);
    and with ``take_next``, the slot's next call if its finish took one from
    the model's ready list: the caller must solve it (it is admitted and its
    task ``running``; if nobody does, its lease and its database deadline
    expire and the sweep returns it to pending). With a ``writer``, the
    answer of a call that took a next call is written there, and its outcome
    is a future, and any other answer is written there too (waited for)."""
    started = msg if isinstance(msg, NextCall) else None
    msg = msg.msg if isinstance(msg, NextCall) else msg
    token = SOLVE_DEADLINE.set(time.monotonic() + services.settings.hard_time_limit)
    slot = Slot(services.core, msg.admission_id, take_next=take_next and not msg.hedge)
    try:
        outcome = _solve(services, backend, msg, listener, heartbeat, slot, started, writer)
    finally:
        SOLVE_DEADLINE.reset(token)
    return outcome, slot.next_call


def solve_chain(services: Services, backend: Backend, msg: SolveMessage, listener: CancelListener | None = None,
                heartbeat: Heartbeat | None = None, *, may_continue: Callable[[], bool] = lambda: False,
                ask_for_dispatch: Callable[[], object] = lambda: None, writer: AnswerWriter | None = None) -> list[str]:
    """Solve ``msg``, then each next call its slot took, while ``may_continue()``
    says so when a call ends (checked before the next is taken, so a taken
    call is always solved). ``ask_for_dispatch`` runs after a solve whose slot
    freed with no next call, or whose next call left its model's ready list
    below one entry per slot (the worker asks for a dispatch there). Above
    that the list still covers every slot, and a request per call only kept
    the dispatcher running after every call (docs/benchmarks.md, round 5).

    With a ``writer`` (the worker's), a call's answer is written there while
    the next call runs, so the durable commit's WAL flush (up to hundreds of
    ms when PostgreSQL's disk is busy) is not between the two calls; so is
    ``ask_for_dispatch``, once the answer is written. The chain returns only once
    every answer is written, so its message is acknowledged after them, as
    without a writer. Returns the outcomes in order."""
    outcomes: list[Outcome] = []
    call: SolveMessage | NextCall | None = msg
    while call is not None:
        outcome, call = solve_one(services, backend, call, listener, heartbeat, take_next=may_continue(), writer=writer)
        outcomes.append(outcome)
        if call is not None and not call.restock:
            continue
        if isinstance(outcome, Future):
            outcome.add_done_callback(lambda _: ask_for_dispatch())  # on the writer, off the path to the next call
        else:
            ask_for_dispatch()
    return [o.result() if isinstance(o, Future) else o for o in outcomes]


def _solve(services: Services, backend: Backend, msg: SolveMessage, listener: CancelListener | None,
           heartbeat: Heartbeat | None, slot: Slot, started: NextCall | None, writer: AnswerWriter | None = None) -> Outcome:
    engine, settings = services.engine, services.settings
    finish = slot.free

    def beating() -> contextlib.AbstractContextManager[None]:
        return heartbeat.running(msg.admission_id, hedge=msg.hedge) if heartbeat is not None else contextlib.nullcontext()

    if msg.hedge:
        try:
            return _solve_hedge(services, backend, msg, slot, listener, beating)
        finally:
            finish()

    try:
        ctx = started.context if started is not None else with_db_retry(
            lambda: start_solve(engine, msg.task_id, msg.admission_id, settings.lease_seconds)
        )
        if ctx is None:
            if with_db_retry(lambda: is_running_elsewhere(engine, msg.task_id, msg.admission_id)):
                slot.disown()  # a redelivered copy: the slot is the live call's, not this message's
                return "running_elsewhere"
            return "stale"
        with beating():
            return _call_and_write(services, backend, msg, ctx, slot, listener, writer)
    finally:
        finish()  # every path frees the slot, even an unexpected exception


def _call_and_write(
    services: Services, backend: Backend, msg: SolveMessage, ctx: SolveContext, slot: Slot,
    listener: CancelListener | None, writer: AnswerWriter | None,
) -> Outcome:
    """The first call of a started task: renew the slot, call, settle, write."""
    core, engine, settings = services.core, services.engine, services.settings
    finish = slot.free
    start_delay_ms = msg.start_delay_ms
    if start_delay_ms is None:  # from the dispatcher: re-assert the slot (taken from a ready list: done)
        renewed = core.renew(msg.admission_id, msg.model, msg.estimated_tokens)
        if not isinstance(renewed, Admitted):
            with_db_retry(
                lambda: back_to_pending(
                    engine, msg.task_id, msg.admission_id, error="no slot to start the call", uncount_attempt=True
                )
            )
            return "no_room"
        start_delay_ms = renewed.start_delay_ms
    attempt = ctx.attempts
    if start_delay_ms > 0:  # the start gates: the provider paces call starts and charges tokens on arrival
        time.sleep(start_delay_ms / 1000)
    try:
        completion, latency_ms = _call(services, backend, msg, ctx, slot, listener)
    except Cancelled:
        return "cancelled"  # the task's hedge answered it
    except RateLimited as exc:
        pause_for(core, msg.model, exc)
        finish()
        error = str(exc)
        if ctx.rate_limited + 1 >= MAX_RATE_LIMITED:
            reason = f"rate limited {MAX_RATE_LIMITED} times: {error}"
            with_db_retry(
                lambda: mark_failed(engine, msg.task_id, msg.admission_id, reason, uncount_attempt=True)
            )
            return "failed"
        with_db_retry(  # a 429 is the quota's doing, not the task's: it does not use up an attempt
            lambda: back_to_pending(
                engine, msg.task_id, msg.admission_id, error=error, rate_limited=True, uncount_attempt=True
            )
        )
        return "rate_limited"
    except Permanent as exc:
        finish()
        core.count(msg.model, "failed")
        error = str(exc)
        with_db_retry(lambda: mark_failed(engine, msg.task_id, msg.admission_id, error))
        return "failed"
    except Exception as exc:  # Transient, or a bug: either way an attempt, so max_attempts ends any loop
        finish()
        error = str(exc)
        if not isinstance(exc, Transient):
            log.exception("unexpected error calling %s for task %d", msg.model, msg.task_id)
            core.count(msg.model, "transient")
            error = f"unexpected {type(exc).__name__}: {error}"
        elif not trip(core, msg.model, error):
            with_db_retry(  # the backend's failure, not the task's: no attempt used, no back-off
                lambda: back_to_pending(
                    engine, msg.task_id, msg.admission_id, error=error, uncount_attempt=True, avoid_model=msg.model,
                )
            )
            return "circuit_open"
        if attempt >= settings.max_attempts:
            reason = f"after {attempt} attempts: {error}"
            with_db_retry(lambda: mark_failed(engine, msg.task_id, msg.admission_id, reason))
            return "failed"
        with_db_retry(
            lambda: back_to_pending(
                engine, msg.task_id, msg.admission_id, error=error, delay_seconds=backoff_seconds(attempt),
                avoid_model=msg.model,
            )
        )
        return "retry"
    # The provider's slot is free the moment it answered, so ours is freed now,
    # before the write: the write needs no slot, and keeps its retry and its
    # exactly-once guard. If the finish took the slot's next call, that call's
    # task is started at once (a start does not wait for the WAL flush), and
    # with a writer this answer is stored while the next call runs.
    finish(answered(completion, ctx, latency_ms))
    taken = slot.next
    if taken is not None:
        try:
            next_ctx = with_db_retry(
                lambda: start_solve(engine, taken.task_id, taken.admission_id, settings.lease_seconds)
            )
        except Exception:  # this call's answer is still written; the next call's task waits for the sweep
            log.exception("could not start task %d, taken from %s's ready list; freeing its slot", taken.task_id,
                          taken.model)
            core.finish(taken.admission_id)
        else:
            slot.next_call = NextCall(SolveMessage.taken(taken), next_ctx, taken.restock)
    answer = answer_of(msg, completion)
    if writer is not None:  # batched with other threads' answers (see balancer.pipeline.answers)
        outcome = writer.submit(answer, lambda written: _won("solved", services, written))
        return outcome if taken is not None else outcome.result()  # a chain goes on; a last call waits
    return _won("solved", services, with_db_retry(lambda: mark_solved(engine, answer)))



def trip(core: AdmissionCore, model: str, error: str) -> bool:
    """Tell the model's circuit breaker about a transient failure; True if it
    counts against the task (the circuit was closed and stays closed)."""
    counted, opened = core.trip(model)
    if opened:
        log.warning("%s: circuit open after repeated transient failures (%s); pausing it, then probing", model, error)
    return counted


def pause_for(core: AdmissionCore, model: str, exc: RateLimited) -> None:
    """Pause the model for the 429's Retry-After (1 s if absent) and sync to its headers."""
    retry_after = exc.retry_after if exc.retry_after is not None else 1.0
    core.penalize(model, math.ceil(retry_after * 1000), exc.remaining.tokens, exc.remaining.requests,
                  limit_tokens=exc.remaining.limit_tokens, limit_requests=exc.remaining.limit_requests)


def _call(
    services: Services, backend: Backend, msg: SolveMessage, ctx: SolveContext, slot: Slot,
    listener: CancelListener | None,
) -> tuple[Completion, int]:
    """The backend call, and how long it took in ms (a sample for the model's latency sketch).

    Cancellable under its admission id when a listener is given and the model
    stops a call whose client went; a cancelled call has let its slot go
    (:meth:`Slot.let_go`) before ``Cancelled`` is raised."""
    called_at = time.monotonic()
    watcher = listener if ctx.stops_on_disconnect else None
    try:
        with watcher.watch(msg.admission_id) if watcher is not None else contextlib.nullcontext():
            completion = backend.complete(msg.model, ctx.prompt, ctx.max_tokens)
    except Cancelled:
        slot.let_go(services, msg.model, time.monotonic() - called_at)
        raise
    return completion, round((time.monotonic() - called_at) * 1000)


def _won(outcome: str, services: Services, written: Written | None) -> str:
    """After a write: cut off the task's other call if it had one; the outcome name."""
    if written is None:
        return "duplicate"
    if written.other_call is not None:
        cancel_call(services.redis, services.settings.namespace, written.other_call)
    return outcome


def answer_of(msg: SolveMessage, completion: Completion) -> Answer:
    """The answer to store for this message's call."""
    return Answer(msg.task_id, msg.admission_id, completion.answer, completion.prompt_tokens,
                        completion.completion_tokens)


def answered(completion: Completion, ctx: SolveContext, latency_ms: int) -> Settlement:
    """What an answered call tells the admission core (usage, headers, latency)."""
    return Settlement(
        used_tokens=completion.total_tokens,
        reserved_tokens=completion.prompt_tokens + ctx.max_tokens,
        remaining_tokens=completion.remaining.tokens,
        remaining_requests=completion.remaining.requests,
        limit_tokens=completion.remaining.limit_tokens,
        limit_requests=completion.remaining.limit_requests,
        latency_ms=latency_ms,
        completion_tokens=completion.completion_tokens,
    )


def _solve_hedge(
    services: Services, backend: Backend, msg: SolveMessage, slot: Slot, listener: CancelListener | None,
    beating: Callable[[], contextlib.AbstractContextManager[None]],
) -> str:
    """One hedge call: write its answer if it comes first; otherwise only free its slot."""
    ctx = with_db_retry(lambda: start_hedge(services.engine, msg.task_id, msg.admission_id))
    if ctx is None:
        return "stale"  # the first call answered before the hedge started
    with beating():
        return _hedge_call(services, backend, msg, ctx, slot, listener)


def _hedge_call(
    services: Services, backend: Backend, msg: SolveMessage, ctx: SolveContext, slot: Slot,
    listener: CancelListener | None,
) -> str:
    core, engine = services.core, services.engine
    renewed = core.renew(msg.admission_id, msg.model, msg.estimated_tokens)
    if not isinstance(renewed, Admitted):
        with_db_retry(lambda: clear_hedge(engine, msg.task_id, msg.admission_id))
        return "no_room"
    if renewed.start_delay_ms > 0:
        time.sleep(renewed.start_delay_ms / 1000)
    try:
        completion, latency_ms = _call(services, backend, msg, ctx, slot, listener)
    except Cancelled:
        return "cancelled"  # the first call answered
    except (RateLimited, Transient, Permanent) as exc:
        if isinstance(exc, RateLimited):
            pause_for(core, msg.model, exc)
        elif isinstance(exc, Transient):
            trip(core, msg.model, str(exc))
        else:
            core.count(msg.model, "failed")
        slot.free()
        with_db_retry(lambda: clear_hedge(engine, msg.task_id, msg.admission_id))
        return "hedge_failed"
    slot.free(answered(completion, ctx, latency_ms))
    answer = answer_of(msg, completion)
    written = with_db_retry(lambda: mark_solved(engine, answer, hedge_model=msg.model))
    return _won("hedge_won", services, written)
