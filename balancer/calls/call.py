"""One call's life: a :class:`Call` owns one admission from its start to its
answer's durable write.

It holds the admission id, its :class:`Slot` (freed once, on every path), its
registration with the process's :class:`~balancer.calls.heartbeat.Heartbeat`,
and its answer's future on the process's
:class:`~balancer.calls.answers.AnswerWriter`, which also writes its ledger
row (:meth:`Call.usage`), answered or not. The registration is taken
when the worker takes the call on (a message received, or a next call taken
from a ready list, before its start is written) and released only when the
answer is durably written, or when the call ends with no answer to write: so
the call's slot, and then its task's deadline, are renewed through a stalled
start and a stalled write alike. What each outcome does to the task is the
solver's table (:mod:`balancer.calls.solver`); this module carries it out.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, cast

import redis

from balancer.admission.core import AdmissionCore
from balancer.admission.finishes import KeptFinishes
from balancer.admission.values import Decision, ReadyTask, Settlement
from balancer.backends import Backend, Cancelled, Completion
from balancer.backlog.hedges import clear_hedge, hedge_in_flight, start_hedge
from balancer.backlog.ledger import Usage
from balancer.backlog.retry import with_db_retry
from balancer.backlog.statements import SolveContext
from balancer.backlog.transitions import Answer, Written, back_to_pending, mark_failed
from balancer.calls.answers import AnswerWriter
from balancer.calls.cancellation import CancelListener, cancel_call, was_cancelled
from balancer.calls.heartbeat import Heartbeat
from balancer.calls.signals import believable
from balancer.costs.cost import CallEnd, billed_tokens, price_of
from balancer.services import Services

log = logging.getLogger(__name__)

#: A call taken from a ready list that starts later than this after the take
#: re-checks its lease and its model's cap first (a quota change reaches it).
LATE_START_S = 1.0


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


class Slot:
    """The call's admission: freed once, in one round trip, on every path, unless
    a cancelled call hands it over to a hold.

    With ``take_next`` (a flag, or a question asked when the call ends, so a
    worker's shutdown during the call is heard), an answered call's slot also
    takes its next call from the model's ready list in that round trip
    (:attr:`next`)."""

    def __init__(self, core: AdmissionCore, admission_id: str, take_next: bool | Callable[[], bool] = False,
                 kept: KeptFinishes | None = None) -> None:
        self.core, self.admission_id, self.done = core, admission_id, False
        self.take_next = take_next
        self.next: ReadyTask | None = None
        self.kept = kept

    def free(self, settlement: Settlement | None = None) -> bool:
        """Free the slot, settling what the call tells; False if it was already. If Redis
        cannot be reached and ``kept`` is given, the finish is kept and applied once Redis
        answers (:mod:`balancer.admission.finishes`): no next call is taken then."""
        if self.done:
            return False
        self.done = True
        try:
            if settlement is not None and (self.take_next() if callable(self.take_next) else self.take_next):
                self.next = self.core.finish_and_take(self.admission_id, settlement)
            else:
                self.core.finish(self.admission_id, settlement)
        except (redis.RedisError, OSError) as exc:
            if self.kept is None:
                raise
            self.kept.keep(self.admission_id, settlement)
            log.warning("freeing slot %s failed on Redis (%s); its finish is kept and applied when Redis answers",
                        self.admission_id, (str(exc).splitlines() or [""])[0])
        return True

    def disown(self) -> None:
        """This message does not own the slot (another worker's call runs under it): never free it."""
        self.done = True

    def let_go(self, services: Services, model: str, ran_s: float) -> None:
        """A cancelled call: its slot as the provider sees it (see the solver's docstring). If Redis
        cannot be reached and ``kept`` is given, the release is kept and applied once it answers."""
        if self.done:
            return
        self.done = True
        quota = services.quotas.get(model)
        stop = quota is not None and quota.on_disconnect == "stop"
        hold_ms = 0 if stop else round(max(0.0, services.settings.backend_timeout - ran_s) * 1000)
        try:
            if stop:
                self.core.finish(self.admission_id)
            else:
                self.core.hold(self.admission_id, hold_ms)
        except (redis.RedisError, OSError) as exc:
            if self.kept is None:
                raise
            self.kept.keep_hold(self.admission_id, hold_ms)  # (0: a finish)
            log.warning("letting go of slot %s failed on Redis (%s); kept and applied when Redis answers",
                        self.admission_id, (str(exc).splitlines() or [""])[0])


@dataclass(frozen=True)
class Change:
    """A status change for a task whose call got no answer (a row of the solver's table)."""

    status: Literal["pending", "failed"]
    error: str
    uncount_attempt: bool = False
    rate_limited: bool = False
    delay_seconds: float = 0.0
    avoid_model: str | None = None


class Call:
    """One admission, from the moment its worker takes it on to its answer's durable write."""

    def __init__(self, services: Services, heartbeat: Heartbeat, msg: SolveMessage, *,
                 take_next: bool | Callable[[], bool] = False) -> None:
        settings = services.settings
        self.services, self.heartbeat, self.msg = services, heartbeat, msg
        self.admission_id = msg.admission_id
        #: This call's own id: its ledger row's key (a redelivered message may call again under its admission).
        self.call_id = uuid.uuid4().hex
        self.taken_at = time.monotonic()
        #: The solve's deadline (monotonic): the call ends within it, and its writes' retries give up there.
        self.deadline = self.taken_at + settings.hard_time_limit
        self.slot = Slot(services.core, msg.admission_id, take_next=False if msg.hedge else take_next,
                         kept=heartbeat.finishes)
        #: The answer's write, once handed to the writer: its result is the outcome's name.
        self.answer: Future[str] | None = None
        self._over = False
        # Kept alive until the answer is written: a write hung on a stalled
        # connection is let go one write grace past the deadline.
        # Its own registration (by call id): a copy of this message taken by this process ends
        # without letting this call go.
        heartbeat.register(self.admission_id, until=self.deadline + settings.write_grace, key=self.call_id)

    # -- the slot ------------------------------------------------------------------------
    def free(self, settlement: Settlement | None = None) -> None:
        """Free the slot (once); the heartbeat renews only the task's deadline from now on."""
        if self.slot.free(settlement):
            self.heartbeat.slot_freed(self.call_id)

    def free_answered(self, settlement: Settlement) -> None:
        """Free the slot of a call that answered. A Redis error here must not lose
        the paid answer: the finish is kept and applied when Redis answers (the
        slot's :class:`Slot` ``kept``; without one, its lease expires on its own), no
        next call is taken, and the answer is still handed to the writer."""
        try:
            self.free(settlement)
        except (redis.RedisError, OSError) as exc:
            log.warning("task %d: its call on %s answered but freeing its slot failed (%s); the answer is still "
                        "written, the slot's lease expires on its own, and no next call is taken",
                        self.msg.task_id, self.msg.model, exc)
            self.slot.next = None
            self.heartbeat.slot_freed(self.call_id)

    def disown(self) -> None:
        """A redelivered copy: the slot is the live call's, not this message's."""
        self.slot.disown()
        self.heartbeat.slot_freed(self.call_id)

    def renew(self) -> Decision | None:
        """Re-assert the slot of a message from the dispatcher before calling (the RPM start
        gate's delay with it). None if Redis cannot be reached: no call, and the task goes
        back to pending now, not at its deadline (a failover), its slot's finish kept."""
        msg = self.msg
        try:
            return self.services.core.renew(msg.admission_id, msg.model, msg.estimated_tokens)
        except (redis.RedisError, OSError) as exc:
            log.warning("task %d: could not re-assert its slot on %s (%s); not called, back to pending",
                        msg.task_id, msg.model, (str(exc).splitlines() or [""])[0])
            return None

    def still_holds_its_lease(self) -> bool:
        """Re-assert the lease of a call taken from a ready list whose start took
        long (a stalled PostgreSQL): extended if alive, False if it expired (its
        slot may be another call's by now), or if its model's cap was lowered
        meanwhile below the calls holding slots (no new call starts above it).
        A start within LATE_START_S of the take needs no round trip: the take
        checked the cap, and the lease taken with it has most of its length left.
        A Redis error is False too: a call must not start on a lease it may have lost."""
        if time.monotonic() - self.taken_at < min(LATE_START_S, self.services.settings.heartbeat_seconds):
            return True
        try:
            return self.services.core.heartbeat(self.admission_id, self.services.settings.lease_seconds * 1000,
                                                starting=True)
        except (redis.RedisError, OSError) as exc:  # unknown is not held: no call on a lease it may have lost
            log.warning("task %d: could not re-check the lease of its late start on %s (%s); not called",
                        self.msg.task_id, self.msg.model, exc)
            return False

    # -- the backend call ----------------------------------------------------------------
    def call_backend(self, backend: Backend, ctx: SolveContext, listener: CancelListener | None) -> tuple[Completion, int]:
        """The backend call, and how long it took in ms (a sample for the model's latency sketch).

        Cancellable under its admission id when a listener is given and the model
        stops a call whose client went; a cancelled call has let its slot go
        (:meth:`Slot.let_go`) before ``Cancelled`` is raised."""
        msg = self.msg
        self.heartbeat.started(self.call_id)
        called_at = time.monotonic()
        watcher = listener if ctx.stops_on_disconnect else None
        try:
            with watcher.watch(msg.admission_id) if watcher is not None else contextlib.nullcontext():
                completion = backend.complete(msg.model, ctx.prompt, ctx.max_tokens)
        except Cancelled:
            self.slot.let_go(self.services, msg.model, time.monotonic() - called_at)
            self.heartbeat.slot_freed(self.call_id)
            raise
        return believable(completion, ctx), round((time.monotonic() - called_at) * 1000)  # usage capped

    # -- the task ------------------------------------------------------------------------
    def change(self, outcome: str, change: Change) -> str:
        """Apply a failed call's status change under its admission; returns the outcome
        that really happened: ``outcome``, or ``left_to_hedge`` when the task's hedge
        is in flight (its answer decides, and it keeps the task's deadline meanwhile),
        or ``stale`` when the task is no longer this call's."""
        engine, msg = self.services.engine, self.msg
        for _ in range(2):  # a hedge cleared between the two statements: the change applies now
            if change.status == "failed":
                done = with_db_retry(lambda: mark_failed(engine, msg.task_id, msg.admission_id, change.error,
                                                         uncount_attempt=change.uncount_attempt))
            else:
                done = with_db_retry(lambda: back_to_pending(
                    engine, msg.task_id, msg.admission_id, error=change.error, delay_seconds=change.delay_seconds,
                    rate_limited=change.rate_limited, uncount_attempt=change.uncount_attempt,
                    avoid_model=change.avoid_model))
            if done:
                return outcome
            hedged = with_db_retry(lambda: hedge_in_flight(engine, msg.task_id, msg.admission_id))
            if hedged is None:
                log.warning("task %d: its call on %s ended (%s: %s) but the task is no longer under this admission; "
                            "nothing changed", msg.task_id, msg.model, outcome, change.error)
                return "stale"
            if hedged:
                log.info("task %d: its call on %s ended (%s: %s) while its hedge is in flight; the hedge's answer "
                         "decides, and the task stays running", msg.task_id, msg.model, outcome, change.error)
                return "left_to_hedge"
        return "stale"

    def start_hedge(self) -> SolveContext | None:
        """A hedge's start: what its call needs (None: its task is no longer running with it).
        The task's deadline moves a lease on and the hedge joins the live-call set now, not
        at the next heartbeat, so the sweep cannot return a task whose hedge is starting."""
        engine, msg, lease = self.services.engine, self.msg, self.services.settings.lease_seconds
        ctx = with_db_retry(lambda: start_hedge(engine, msg.task_id, msg.admission_id, lease))
        if ctx is not None:
            self.heartbeat.mark_live_now(self.admission_id)
        return ctx

    def after_gate(self, delay_ms: int, listener: CancelListener | None) -> bool:
        """Wait out the call's start gate, then whether its task still wants the call. A hedge
        reads its task: still running unanswered with it (issue 40 finding 5). A first call waits
        on the cancel channel under its admission id: if the task's hedge answers meanwhile, its
        write cancels the call and the wait ends there; a cancel sent before the call listened,
        or lost with the listener's connection, is found in its key (:func:`was_cancelled`, read
        before and after the wait). No PostgreSQL read per gated call. Left to the write's guard
        (the call runs, its answer is not written): a task removed meanwhile, a cancel whose
        publish failed, and a worker with hedging off (no listener). Unwanted, the slot is freed
        and the call must not start: the provider would charge it."""
        engine, msg = self.services.engine, self.msg
        if msg.hedge:
            time.sleep(delay_ms / 1000)
            wanted = with_db_retry(lambda: start_hedge(engine, msg.task_id, msg.admission_id)) is not None
        elif listener is None:  # hedging off in this worker: nothing cancels its calls
            time.sleep(delay_ms / 1000)
            wanted = True
        else:
            until = time.monotonic() + delay_ms / 1000  # the listener's first subscription is inside the gate's wait
            with listener.watch(msg.admission_id) as handle:  # cancelled before it listened, while, or lost
                cancelled = self._cancelled() or handle.wait(max(0.0, until - time.monotonic())) or self._cancelled()
            wanted = not cancelled
        if wanted:
            return True
        self.free()
        log.info("task %d: answered or taken away while its %s on %s waited at the start gate; it does not call",
                 msg.task_id, "hedge" if msg.hedge else "call", msg.model)
        return False

    def _cancelled(self) -> bool:
        """Whether the task's other call answered and cancelled this one (Redis out: not known, so not)."""
        try:
            return was_cancelled(self.services.redis, self.services.settings.namespace, self.msg.admission_id)
        except (redis.RedisError, OSError):
            return False

    def clear_hedge(self) -> None:
        """A hedge that got no answer: the task is again its first call's alone."""
        with_db_retry(lambda: clear_hedge(self.services.engine, self.msg.task_id, self.admission_id))

    # -- the ledger ----------------------------------------------------------------------
    def usage(self, ctx: SolveContext, end: CallEnd, completion: Completion | None = None) -> Usage | None:
        """This call's ledger row: the tokens it is counted for
        (:func:`~balancer.costs.cost.billed_tokens`) and what they cost at its model's prices when
        it started; None if it never reached the backend."""
        msg = self.msg
        reported = (completion.prompt_tokens, completion.completion_tokens) if completion is not None else None
        tokens = billed_tokens(end, msg.estimated_tokens - ctx.max_tokens, reported)
        if tokens is None:
            return None
        price = price_of(ctx.price_per_million_input, ctx.price_per_million_output)
        return Usage(self.call_id, msg.task_id, ctx.source, msg.model, msg.admission_id, *tokens,
                     answered=end == "answered", hedge=msg.hedge, ended_at=datetime.now(UTC),
                     cost=None if price is None else price.cost(*tokens), currency=None if price is None else ctx.currency)

    def unanswered(self, writer: AnswerWriter, ctx: SolveContext, exc: BaseException) -> None:
        """A call that got no answer: its ledger row, written behind it (an unexpected
        error is counted as cut off: the request may have reached the backend)."""
        usage = self.usage(ctx, cast(CallEnd, getattr(exc, "ended", "cut_off")))
        if usage is not None:
            writer.record(usage, deadline=self.deadline)

    # -- the answer ----------------------------------------------------------------------
    def hand_over(self, writer: AnswerWriter, answer: Answer, outcome: str, usage: Usage | None = None) -> Future[str]:
        """Hand the answer (and the call's ledger row) to the writer; the call is over once it is written."""
        self.answer = writer.submit(answer, lambda written: self._won(outcome, written), deadline=self.deadline,
                                    usage=usage)
        self.answer.add_done_callback(lambda _: self.end())
        return self.answer

    def _won(self, outcome: str, written: Written | None) -> str:
        """After the write: cut off the task's other call if it had one; the outcome's name
        (``unstorable``: the answer could not be stored, and the task failed with the reason)."""
        if written is None:
            log.info("task %d: the answer of its call on %s was not written: the task was already finished or "
                     "taken from this call", self.msg.task_id, self.msg.model)
            return "duplicate"
        if written.other_call is not None:
            try:
                cancel_call(self.services.redis, self.services.settings.namespace, written.other_call)
            except (redis.RedisError, OSError) as exc:  # the answer is written: the solve must not fail for this
                log.warning("task %d: answered; its other call could not be cut off (%s): it runs to its end, and "
                            "its answer is not written", self.msg.task_id, (str(exc).splitlines() or [""])[0])
        if written.refused is not None:
            log.warning("task %d: the answer of its call on %s cannot be stored (%s): the task failed, and is not "
                        "called again", self.msg.task_id, self.msg.model, written.refused)
            return "unstorable"
        return outcome

    def end(self) -> None:
        """The call is over: the heartbeat lets it go (once)."""
        if not self._over:
            self._over = True
            self.heartbeat.release(self.call_id)
