"""Solve one task: start its call, call the backend once, hand the answer to the writer.

Each message becomes a :class:`~balancer.calls.call.Call`, kept alive by
the process's heartbeat from the moment it is taken on to its answer's
durable write (see :mod:`balancer.calls.call`). Outcomes, and what each
does to the slot and the task (:data:`CHANGES` holds the rows that change a
task's status, in this order):

=================  ==============================================================
stale              message for a task already solved, failed or re-dispatched
                   under another admission: release this admission, no call
running_elsewhere  a redelivered or duplicated message whose call still runs in
                   a live worker (its heartbeat keeps the task's deadline
                   ahead): no call, and the slot stays the live call's
no_room            the lease expired and its slot is taken (redelivery after a
                   crash), or the model was disabled: back to pending, no
                   attempt used, no call
lease_lost         a next call taken from a ready list whose start waited past
                   its lease (a stalled PostgreSQL) and whose lease is gone,
                   or whose model's cap was lowered meanwhile below the calls
                   holding slots: back to pending, no attempt used, no call.
                   A call never starts on a lease it no longer holds, nor
                   above a lowered cap
rate_limited       a 429: the model is paused for Retry-After, once per window
                   (atomically in Lua), so *every* dispatcher holds it,
                   whichever limit caused the 429; back to pending at once, no
                   attempt used; ``failed`` (attempt not counted) after
                   ``MAX_RATE_LIMITED`` 429s
circuit_open       a transient failure that opens the model's circuit, or comes
                   while it is open (see trip.lua): an outage of the backend,
                   not the task's fault. Back to pending with no attempt used
                   and no back-off, avoiding the model; the model is paused and
                   probed one call at a time until it answers again
retry              5xx, timeout, refused connection, malformed reply, or any
                   unexpected error (logged with its traceback): back to
                   pending with exponential back-off, preferring another
                   allowed model
failed             4xx, or a transient failure on the ``max_attempts``-th call:
                   ``failed`` with the error
left_to_hedge      any of the five above while the task's hedge is in flight:
                   the status is left alone (the guarded change is refused),
                   the hedge's answer decides, and the hedge keeps the task's
                   deadline meanwhile; logged as such. If the hedge gets no
                   answer either, the sweep returns the task within a lease
solved             as soon as the backend answers: settle the tokens as the
                   model's accounting says, lower the buckets to the provider's
                   remaining-quota headers, add the latency to the model's
                   sketch, free the slot and, with ``take_next``, admit the
                   head of the model's ready list as the slot's next call (one
                   round trip) and start that call's task; then hand the answer
                   to the writer (answer, usage and ``solved`` in one guarded
                   UPDATE) while the next call runs
duplicate          the answer's write found the task finished, or no longer
                   under this admission: nothing written (logged) but the
                   call's ledger row
unstorable         the answer cannot be stored: its task failed, alone (see answers.py)
cancelled          the task's other call answered first and cut this one off
=================  ==============================================================

A *hedge* (``SolveMessage.hedge``) is a second call for a task whose first
call straggles, on another model (see the dispatcher; its start: ``Call.start_hedge``). The first answer of the
two is written (``hedge_won`` for the hedge's). A hedge that gets no answer
(429, transient, permanent: ``hedge_failed``; ``no_room``) only frees its
slot and clears itself from the task, leaving the task to its first call.

Whether the loser is cut off follows its model's ``on_disconnect``:

- ``stop``: the provider ends a request whose client went. The winner cancels
  the loser (:mod:`balancer.calls.cancellation`): its HTTP request is
  closed, its worker thread and slot are free at once (outcome
  ``cancelled``), and its reservation (prompt + max_tokens) stays charged,
  since nothing tells what the provider counted.
- ``continue`` (the default; ``finish`` is its old name): a provider that got a non-streamed request keeps
  working on it, and charging it, after the client goes. Closing the request
  would free nothing the provider counts, and would lose the moment the call
  really ends. So the loser runs to its end; its slot is freed, and its
  tokens settled, by its own answer, which is then a duplicate and never
  written. (A model switched to ``continue`` while one of its calls is being
  cut off holds that slot, charged, until the call would have hit the backend
  timeout: :meth:`AdmissionCore.hold`.)

Every call sent to the backend leaves a ledger row (:mod:`balancer.backlog.ledger`),
written by the answer writer: an answered call's in its answer's statement, the others' behind them, with the
tokens the provider likely bills (:func:`balancer.costs.cost.billed_tokens`). So spend counts hedges and retries.

The slot is freed as soon as the call ends, before any database write, and
in every case (``finally``), so nothing leaks even on an unexpected exception.
The answer write is retried while PostgreSQL is down: a worker that has an
answer never calls the backend again for it, and keeps its task's deadline
until it is written. Every wait ends by the solve's deadline.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import redis

from balancer.admission.core import AdmissionCore
from balancer.admission.values import Admitted, ReadyTask
from balancer.backends import Backend, Cancelled, Completion, Permanent, RateLimited, Transient
from balancer.backlog.retry import SOLVE_DEADLINE, with_db_retry
from balancer.backlog.statements import SolveContext
from balancer.backlog.transitions import Answer, is_running_elsewhere, start_solve
from balancer.calls.answers import AnswerWriter
from balancer.calls.call import Call, Change, SolveMessage
from balancer.calls.cancellation import CancelListener
from balancer.calls.heartbeat import Heartbeat
from balancer.calls.signals import answered, note_failed, pause_for, trip
from balancer.services import Services
from balancer.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["CHANGES", "MAX_RATE_LIMITED", "NextCall", "SolveMessage", "solve_chain", "solve_one"]

#: After this many 429s for one task, it is failed: the quotas are wrong, not the task.
MAX_RATE_LIMITED = 50


def backoff_seconds(attempt: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Exponential back-off after the ``attempt``-th failed call.

    >>> [backoff_seconds(n) for n in (1, 2, 3, 6, 10)]
    [1.0, 2.0, 4.0, 30.0, 30.0]
    """
    return min(cap, base * 2 ** (attempt - 1))


@dataclass(frozen=True)
class Failure:
    """A call that got no answer: its model, its error, and the task's counts with it."""

    model: str
    error: str
    attempt: int
    was_429: bool = False


#: The docstring's table, for the outcomes that change a task's status.
CHANGES: dict[str, Callable[[Failure], Change]] = {
    "no_room": lambda f: Change("pending", f.error, uncount_attempt=True),
    "lease_lost": lambda f: Change("pending", f.error, uncount_attempt=True),
    "rate_limited": lambda f: Change("pending", f.error, rate_limited=True, uncount_attempt=True),
    "circuit_open": lambda f: Change("pending", f.error, uncount_attempt=True, avoid_model=f.model),
    "retry": lambda f: Change("pending", f.error, delay_seconds=backoff_seconds(f.attempt), avoid_model=f.model),
    "failed": lambda f: Change("failed", f.error, uncount_attempt=f.was_429),
}


def outcome_of(core: AdmissionCore, settings: Settings, msg: SolveMessage, ctx: SolveContext,
               exc: Exception) -> tuple[str, Failure]:
    """Which row of the table a failed call falls in; tells the model's pause,
    circuit and counters what happened on the way."""
    error, attempt = str(exc), ctx.attempts
    if isinstance(exc, (Transient, Permanent)):
        note_failed(core, msg.model, exc)
    if isinstance(exc, RateLimited):
        pause_for(core, settings, msg.model, exc, msg.admission_id)
        if ctx.rate_limited + 1 >= MAX_RATE_LIMITED:
            return "failed", Failure(msg.model, f"rate limited {MAX_RATE_LIMITED} times: {error}", attempt, was_429=True)
        return "rate_limited", Failure(msg.model, error, attempt, was_429=True)
    if isinstance(exc, Permanent):
        core.count(msg.model, "failed")
        return "failed", Failure(msg.model, error, attempt)
    if not isinstance(exc, Transient):  # a bug: still an attempt, so max_attempts ends any loop
        log.error("unexpected error calling %s for task %d", msg.model, msg.task_id, exc_info=exc)
        core.count(msg.model, "transient")
        error = f"unexpected {type(exc).__name__}: {error}"
    elif not trip(core, msg.model, error):
        return "circuit_open", Failure(msg.model, error, attempt)
    if attempt >= settings.max_attempts:
        return "failed", Failure(msg.model, f"after {attempt} attempts: {error}", attempt)
    return "retry", Failure(msg.model, error, attempt)


@dataclass(frozen=True)
class NextCall:
    """The call a finishing slot took from its model's ready list (already
    registered with the heartbeat), and its start, tried as soon as it was
    taken: its task's context, or None if it did not start (stale, or its call
    runs elsewhere). ``restock``: the list now holds fewer entries than the
    model has slots (see :class:`~balancer.admission.values.ReadyTask`)."""

    call: Call
    context: SolveContext | None
    restock: bool = True

    @property
    def msg(self) -> SolveMessage:
        return self.call.msg


#: A solve's outcome: its name, or, for an answer handed to the writer, the name
#: to come once it is written, with the solve's deadline (see :func:`solve_chain`).
Outcome = str | tuple[Future[str], float]


def solve_one(services: Services, backend: Backend, msg: SolveMessage | NextCall, listener: CancelListener | None,
              heartbeat: Heartbeat, writer: AnswerWriter, *,
              take_next: bool | Callable[[], bool] = False) -> tuple[Outcome, NextCall | None]:
    """Solve a message, or a :class:`NextCall` (already started); and with
    ``take_next`` (asked when the call ends), the slot's next call if its
    finish took one from the model's ready list: the caller must solve it (it is admitted, its task
    started, and it is kept alive by the heartbeat until it is solved)."""
    if isinstance(msg, NextCall):
        call, started = msg.call, msg
        call.slot.take_next = take_next
    else:
        call, started = Call(services, heartbeat, msg, take_next=take_next), None
    token = SOLVE_DEADLINE.set(call.deadline)
    taken: list[NextCall] = []
    try:
        if call.msg.hedge:
            outcome: Outcome = _solve_hedge(services, backend, call, listener, writer)
        else:
            outcome = _solve(services, backend, call, started, listener, writer, taken)
    except BaseException:
        for nxt in taken:  # taken, never to be solved: let it go (the sweep returns its task)
            nxt.call.free()
            nxt.call.end()
        raise
    finally:
        try:
            call.free()  # every path frees the slot, even an unexpected exception
        finally:  # (a Redis error freeing it must not keep the task alive: its lease expires on its own)
            if call.answer is None:
                call.end()  # nothing to write: the heartbeat lets it go now
            SOLVE_DEADLINE.reset(token)
    return outcome, (taken[0] if taken else None)


def solve_chain(services: Services, backend: Backend, msg: SolveMessage, listener: CancelListener | None,
                heartbeat: Heartbeat, writer: AnswerWriter, *, may_continue: Callable[[], bool] = lambda: False,
                ask_for_dispatch: Callable[[], object] = lambda: None) -> list[str]:
    """Solve ``msg``, then each next call its slot took, while ``may_continue()``
    says so when a call ends (asked by the finish that would take the next, so
    a SIGTERM during a call starts no new one, and a taken call is always
    solved). ``ask_for_dispatch`` runs after a solve whose slot
    freed with no next call, or whose next call left its model's ready list
    below one entry per slot (the worker asks for a dispatch there). Above
    that the list still covers every slot, and a request per call only kept
    the dispatcher running after every call (docs/benchmark-history.md, the hot path).

    Each answer is written by the ``writer`` while the next call runs, so the
    durable commit's WAL flush (up to hundreds of ms when PostgreSQL's disk is
    busy) is not between the two calls; so is ``ask_for_dispatch``, once the
    answer is written. The chain returns once every answer is written (its
    message is acknowledged after them), or once a solve's deadline passed
    with its answer unwritten (``unwritten``: the write goes on, and its call
    keeps its task alive meanwhile). A dead writer raises
    :class:`~balancer.calls.answers.WriterDied`. Returns the outcomes in order."""
    outcomes: list[Outcome] = []
    call: SolveMessage | NextCall | None = msg
    while call is not None:
        outcome, call = solve_one(services, backend, call, listener, heartbeat, writer, take_next=may_continue)
        outcomes.append(outcome)
        if call is not None and not call.restock:
            continue
        if isinstance(outcome, tuple):
            outcome[0].add_done_callback(lambda _: _ask(ask_for_dispatch))  # on the writer, off the path to the next call
        else:
            _ask(ask_for_dispatch)
    return [o if isinstance(o, str) else _written(writer, *o) for o in outcomes]


def _ask(ask_for_dispatch: Callable[[], object]) -> None:
    """Ask for a dispatch; a Redis error is logged and the chain goes on (the
    dispatcher's own tick refills the lists)."""
    try:
        ask_for_dispatch()
    except (redis.RedisError, OSError) as exc:
        log.warning("could not ask for a dispatch (%s); the chain goes on, and the dispatcher's tick refills", exc)


def _written(writer: AnswerWriter, answer: Future[str], deadline: float) -> str:
    outcome = writer.wait(answer, deadline)
    if outcome is None:
        log.warning("an answer was not written by its solve's deadline; the chain goes on, the write is still "
                    "retried, and its call keeps its task alive meanwhile")
        return "unwritten"
    return outcome


def _solve(services: Services, backend: Backend, call: Call, started: NextCall | None,
           listener: CancelListener | None, writer: AnswerWriter, taken: list[NextCall]) -> Outcome:
    """A task's own call: start, hold the slot, call, then the table's row."""
    engine, settings, core, msg = services.engine, services.settings, services.core, call.msg
    ctx = started.context if started is not None else with_db_retry(
        lambda: start_solve(engine, msg.task_id, msg.admission_id, settings.lease_seconds)
    )
    if ctx is None:
        if with_db_retry(lambda: is_running_elsewhere(engine, msg.task_id, msg.admission_id)):
            call.disown()
            return "running_elsewhere"
        return "stale"
    if started is not None:  # taken from a ready list: its lease was started with it
        if not call.still_holds_its_lease():
            with contextlib.suppress(redis.RedisError, OSError):  # Redis out: the lease expires on its own
                call.free()
            failure = Failure(msg.model, "its slot's lease expired, or its model's cap was lowered below the calls "
                                         "holding slots, or Redis could not say, while its start waited; not called",
                              ctx.attempts)
            return call.change("lease_lost", CHANGES["lease_lost"](failure))
        start_delay_ms = msg.start_delay_ms or 0
    else:  # from the dispatcher: re-assert the slot
        renewed = call.renew()
        if not isinstance(renewed, Admitted):
            call.free()
            return call.change("no_room", CHANGES["no_room"](Failure(msg.model, "no slot to start the call", ctx.attempts)))
        start_delay_ms = renewed.start_delay_ms
    # The start gates: the provider paces call starts and charges tokens on arrival.
    if start_delay_ms > 0 and not call.after_gate(start_delay_ms, listener):
        return "stale"  # answered by its hedge while the call waited (cancelled)
    try:
        completion, latency_ms = call.call_backend(backend, ctx, listener)
    except Cancelled as exc:
        call.unanswered(writer, ctx, exc)
        return "cancelled"  # the task's hedge answered it
    except Exception as exc:  # noqa: BLE001 - every failure is a row of the table
        outcome, failure = outcome_of(core, settings, msg, ctx, exc)  # a 429 pauses the model before its slot frees
        call.free()
        call.unanswered(writer, ctx, exc)  # its ledger row, written behind it
        return call.change(outcome, CHANGES[outcome](failure))
    # The provider's slot is free the moment it answered, so ours is freed now,
    # before the write: the write needs no slot, and keeps its retry and its
    # exactly-once guard. If the finish took the slot's next call, that call is
    # registered with the heartbeat and its task started at once (a start does
    # not wait for the WAL flush); this answer is stored while the next call runs.
    call.free_answered(answered(completion, ctx, latency_ms))
    if call.slot.next is not None:
        taken.extend(_start_next(services, call.heartbeat, call.slot.next))
    answer = call.hand_over(writer, answer_of(msg, completion), "solved", call.usage(ctx, "answered", completion))
    return answer, call.deadline


def _start_next(services: Services, heartbeat: Heartbeat, ready: ReadyTask) -> list[NextCall]:
    """Take on the slot's next call and start its task; nothing if the start fails for good."""
    nxt = Call(services, heartbeat, SolveMessage.taken(ready))
    try:
        ctx = with_db_retry(
            lambda: start_solve(services.engine, ready.task_id, ready.admission_id, services.settings.lease_seconds)
        )
    except Exception:  # this call's answer is still written; the next call's task waits for the sweep
        log.exception("could not start task %d, taken from %s's ready list; freeing its slot", ready.task_id,
                      ready.model)
        nxt.free()
        nxt.end()
        return []
    return [NextCall(nxt, ctx, ready.restock)]


def _solve_hedge(services: Services, backend: Backend, call: Call, listener: CancelListener | None,
                 writer: AnswerWriter) -> Outcome:
    """One hedge call: its answer is written if it comes first; otherwise it only frees its slot."""
    core, msg = services.core, call.msg
    ctx = call.start_hedge()
    if ctx is None:
        return "stale"  # the first call answered (or the sweep returned the task) before the hedge started
    renewed = call.renew()
    if not isinstance(renewed, Admitted):
        call.free()
        call.clear_hedge()
        return "no_room"
    if renewed.start_delay_ms > 0 and not call.after_gate(renewed.start_delay_ms, listener):
        return "stale"  # the first call answered while the hedge waited at its model's start gate
    try:
        completion, latency_ms = call.call_backend(backend, ctx, listener)
    except Cancelled as exc:
        call.unanswered(writer, ctx, exc)
        return "cancelled"  # the first call answered
    except (RateLimited, Transient, Permanent) as exc:
        call.unanswered(writer, ctx, exc)
        if isinstance(exc, RateLimited):
            pause_for(core, services.settings, msg.model, exc, msg.admission_id)
        elif isinstance(exc, Transient):
            note_failed(core, msg.model, exc)
            trip(core, msg.model, str(exc))
        else:
            note_failed(core, msg.model, exc)
            core.count(msg.model, "failed")
        call.free()
        call.clear_hedge()
        log.info("task %d: its hedge on %s got no answer (%s); the task is its first call's again", msg.task_id,
                 msg.model, exc)
        return "hedge_failed"
    call.free_answered(answered(completion, ctx, latency_ms))
    answer = call.hand_over(writer, answer_of(msg, completion, hedge=True), "hedge_won",
                            call.usage(ctx, "answered", completion))
    return answer, call.deadline


def answer_of(msg: SolveMessage, completion: Completion, *, hedge: bool = False) -> Answer:
    """The answer to store for this message's call (a hedge's names its model)."""
    return Answer(msg.task_id, msg.admission_id, completion.answer, completion.prompt_tokens,
                  completion.completion_tokens, hedge_model=msg.model if hedge else None)
