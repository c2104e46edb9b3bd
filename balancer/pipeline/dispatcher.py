"""One dispatch run: pending tasks in PostgreSQL → admission → ``solve`` messages.

Late binding: the backlog stays in PostgreSQL and a task is bound to a model
only when that model has room *now*, so model queues never hold more than
free capacity. A quota change, a slow model or a disabled model cannot strand
work in a queue.

Each round locks two sets of pending tasks, skipping rows another dispatcher
holds: the *pinned lane* (for each model with free slots, up to that many tasks
pinned to it alone) and a window of the rest: priority first, and within a
priority, turns across sources by weight (:mod:`balancer.pipeline.fairness`),
so a backfill from one source does not stand ahead of a live one. Pinned
tasks have nowhere else to go, so they get first claim on their model: they
go first in the batch, and while a model still has pinned tasks pending
(counting those another dispatcher holds) it takes no flexible work. So a slow
model's own tasks never queue behind flexible work it took on, which is what
set the tail of ``bench/scenarios/default.toml`` (docs/benchmarks.md). It
admits the batch in one atomic call, marks the admitted
ones ``queued`` and commits, and only then publishes their messages. If the
transaction fails, the commit included, the round's admissions are withdrawn
at once (:func:`withdrawn_unless_committed`). A dispatcher that dies between
commit and publish leaves leases that were never started: they expire and
refund their tokens, and the sweep tick returns the tasks to pending.

A freed slot should not wait for a round at all. For each model that its
concurrency cap binds, a dispatch run also *stocks* a ready list in Redis
(tasks marked ``queued`` under admission ids that are not yet leases), after
its first round and again at its end. The call that frees a slot admits the list's head
in the same round trip and the worker calls it next (``finish.lua``,
:meth:`AdmissionCore.finish_and_take`), so while the lists last, calls follow
each other with no broker hop and no dispatcher. A run first takes from the
lists what free slots can take now and returns what expired or can no longer
run to pending (:func:`take_from_ready`). How many tasks and for how long:
:mod:`balancer.domain.ready`.

The end of the backlog is different: a task handed to a slow model in the
last minute can end long after every other model has gone idle. When the
backlog would drain before a call started now on the slowest open model
would end, each task goes to the model that would finish it soonest, by the
models' learned latencies, and may wait for a busy fast model rather than take
an idle slow one (:func:`finish_time_aware`, :mod:`balancer.domain.endgame`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection

from balancer.admission import Admitted, Candidate, NotNow, Rejected
from balancer.admission.core import AdmissionCore, ModelLive, open_slots
from balancer.domain import endgame
from balancer.domain import ready as ready_lists
from balancer.pipeline import fairness
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.claims import (
    PendingTask,
    claim_pinned,
    fail_pending,
    mark_queued,
    models_with_pinned_backlog,
    pending_at_least,
    pending_backlog,
)
from balancer.storage.hedges import hedge_spending, mark_hedged, stragglers
from balancer.storage.ready import mark_ready, ready_admission_id, unstock

log = logging.getLogger(__name__)

#: The end game plans at most this many tasks beyond the claimed window (as
#: stand-ins of average size): enough to see where the backlog will go.
MAX_UNCLAIMED_PLANNED = 5_000


@dataclass(frozen=True)
class Assignment:
    task_id: int
    model: str
    admission_id: str
    estimated_tokens: int
    hedge: bool = False  # a second call for a straggling running task


@dataclass
class DispatchReport:
    admitted: int = 0
    failed: int = 0
    waiting: int = 0
    #: tasks the end game kept pending for a model that will finish them sooner
    held_for_faster: int = 0
    hedges: int = 0
    #: tasks put on ready lists, and ready tasks returned to pending (expired or stuck)
    stocked: int = 0
    unstocked: int = 0
    rounds: int = 0
    #: ms until the earliest refused task could be admitted (None: unknown or nothing waits)
    retry_in_ms: int | None = None
    by_model: dict[str, int] = field(default_factory=dict)

    def count_admitted(self, assignments: Sequence[Assignment]) -> None:
        self.admitted += len(assignments)
        for a in assignments:
            self.by_model[a.model] = self.by_model.get(a.model, 0) + 1


Publisher = Callable[[Sequence[Assignment]], None]

#: Flexible tasks a round claims per open slot, up to the window: choice enough
#: for the WDRR order and for tasks some models refuse, not a whole window for a
#: few slots. A token-bound model shows free slots while its bucket is low;
#: claiming 200 tasks for them and refusing nearly all, round after round, made
#: a dispatch run take 0.2 to 0.8 s on fast.toml (docs/benchmarks.md, round 4).
CLAIMS_PER_OPEN_SLOT = 4


def claim_limit(free: dict[str, int], window: int) -> int:
    """How many flexible tasks a round claims for these open slots.

    >>> claim_limit({"a": 2, "b": 1}, 200), claim_limit({"a": 80}, 200)
    (12, 200)
    """
    return min(window, CLAIMS_PER_OPEN_SLOT * sum(free.values()))


@contextlib.contextmanager
def withdrawn_unless_committed(core: AdmissionCore) -> Iterator[list[str]]:
    """Collects the admission ids admitted inside a PostgreSQL transaction: put
    it *before* ``engine.begin()`` in the ``with``, so it sees the commit's
    outcome. If the transaction fails (the commit included), the admissions
    are withdrawn (:meth:`AdmissionCore.withdraw`): their slots free now and
    their tokens go back, not at their leases' expiry."""
    admitted: list[str] = []
    try:
        yield admitted
    except BaseException:
        if admitted:
            try:
                core.withdraw(admitted)
            except Exception as exc:  # noqa: BLE001 - the leases still expire; the first error is the one to raise
                log.warning("could not withdraw %d admission(s) after a failed dispatch commit: %s", len(admitted), exc)
        raise


def dispatch(services: Services, publish: Publisher, *, window: int | None = None, max_rounds: int = 20) -> DispatchReport:
    """Admit and publish until nothing more fits (or ``max_rounds``), and keep
    the ready lists stocked (after the first round and at the end)."""
    core = services.core
    window = window or services.settings.dispatch_window
    stocking = services.settings.ready_per_slot > 0
    report = DispatchReport()
    idle = False  # the last round found nothing pending that a free slot could take
    view_predates_stock = False  # the round stocked after reading ``view``: its ready counts are old
    for round_no in range(max_rounds):
        view = core.live()
        view_predates_stock = False
        if not view and not core.is_loaded():
            # Redis lost its data: restore now (the admit call would too, but an
            # empty live view means it would never be reached).
            core.restore()
            view = core.live()
        if round_no == 0 and any(m.ready for m in view.values()):
            if take_from_ready(services, publish, report):
                view = core.live()
        free = open_slots(view)
        if not free:
            break
        with withdrawn_unless_committed(core) as admitted_ids, services.engine.begin() as conn:
            pinned = claim_pinned(conn, {m: min(n, window) for m, n in free.items()})
            # Every model, not only the open ones: a full model's slot can free
            # between the live read and the admit call.
            reserved = models_with_pinned_backlog(conn, view, exclude=[t.id for t in pinned])
            # A model with ready tasks takes those first (take_from_ready), not new flexible work.
            reserved |= {name for name, m in view.items() if m.ready}
            limit = claim_limit(free, window)
            fair = fairness.claim_flexible(services, conn, limit, free)
            claimed = fair.tasks
            batch = plan_batch(pinned, claimed, list(view), reserved)
            if services.settings.end_game and batch:
                kept = finish_time_aware(
                    conn, batch, view, window_full=len(claimed) >= limit,
                    prior_s=services.settings.expected_latency_s, latency_field=planned_latency_field(services.settings),
                )
                report.held_for_faster += len(batch) - len(kept)
                batch = kept
            if not batch:
                idle = True
                break
            pending = [task for task, _ in batch]
            decisions = core.admit([candidate for _, candidate in batch])
            admitted_ids.extend(d.admission_id for d in decisions if isinstance(d, Admitted))
            admitted: list[Assignment] = []
            failed: list[tuple[int, str]] = []
            for task, decision in zip(pending, decisions, strict=True):
                if isinstance(decision, Admitted):
                    admitted.append(Assignment(task.id, decision.model, decision.admission_id, task.estimated_tokens))
                elif isinstance(decision, Rejected):
                    failed.append((task.id, decision.reason))
                elif isinstance(decision, NotNow):
                    report.waiting += 1
                    wait = decision.wait_ms
                    if wait is not None and (report.retry_in_ms is None or wait < report.retry_in_ms):
                        report.retry_in_ms = wait
            mark_queued(conn, [(a.task_id, a.model, a.admission_id) for a in admitted], services.settings.lease_seconds)
            fail_pending(conn, failed)
        fairness.settle(services, fair, {a.task_id for a in admitted} | {task_id for task_id, _ in failed})
        publish(admitted)
        if round_no == 0 and stocking:
            # Refill the lists now, not only at the end: the next rounds publish
            # for a while, and every call that ends meanwhile takes its next from them.
            report.stocked += stock_ready(services, core.live())  # as the round left the buckets
            view_predates_stock = True
        report.rounds += 1
        report.count_admitted(admitted)
        report.failed += len(failed)
        if not admitted and not failed:
            break
    if idle and services.settings.hedging:
        report.hedges = hedge_stragglers(services, publish, view)  # the view of the round that found nothing
    if stocking and not view_predates_stock:  # (a view read before this run's stock would stock twice)
        report.stocked += stock_ready(services, view)
    return report


def take_from_ready(services: Services, publish: Publisher, report: DispatchReport) -> int:
    """Admit the ready tasks free slots can take now, and send dropped ones back
    to pending. Returns how many were admitted (published like any admission)."""
    taken, dropped = services.core.take_ready()
    if dropped:
        with services.engine.begin() as conn:
            report.unstocked += unstock(conn, [(t.task_id, t.admission_id) for t in dropped])
    assignments = [Assignment(t.task_id, t.model, t.admission_id, t.estimated_tokens) for t in taken]
    publish(assignments)
    report.count_admitted(assignments)
    return len(assignments)


def stock_targets(view: dict[str, ModelLive], settings: Settings, per_slot: float | None = None) -> dict[str, int]:
    """For each model whose slots bind it, how many tasks its ready list lacks
    (at ``per_slot`` entries per slot, default ``settings.ready_per_slot``).

    Only models that concurrency binds: enabled, not paused, a token bucket at
    least half full and requests in hand. A model that tokens or requests
    bind runs its bucket low; a freed slot there waits for tokens, not for a
    dispatch round, and a list would only bind its tasks early."""
    targets = {}
    for name, m in view.items():
        q = m.quota
        if not q.enabled or m.paused_ms > 0:
            continue
        if m.tokens_available < q.burst / 2 or (m.requests_available is not None and m.requests_available < 1):
            continue
        mean_ms = m.latency_estimate(settings.expected_latency_s).mean_ms if m.latency_known else None
        depth = ready_lists.depth(q.max_concurrent_requests, mean_ms,
                                  settings.ready_per_slot if per_slot is None else per_slot, settings.ready_ttl)
        room = depth - m.ready
        if room > 0:
            targets[name] = room
    return targets


def stock_ready(services: Services, view: dict[str, ModelLive]) -> int:
    """Fill the ready lists of the models their concurrency caps bind (see the
    module docstring and :mod:`balancer.domain.ready`). Returns how many were stocked.

    Each model takes its pinned tasks first; flexible tasks go to a model only
    if it has no more pinned ones, in the window's order, to the model with the
    most room. Nothing is stocked unless the backlog outlasts the slowest
    model's call even without the stocked tasks: the end game decides the rest.
    """
    settings = services.settings
    per_slot = fairness.ready_per_slot(services)  # shallow while sources share (balancer.domain.fairshare)
    targets = stock_targets(view, settings, per_slot)
    if not targets:
        return 0
    wanted = sum(targets.values())
    with services.engine.begin() as conn:
        pinned = claim_pinned(conn, targets)
        fair = fairness.claim_flexible(services, conn, wanted, targets)
        if fair.shares is not None and (shallow := fairness.ready_per_slot(services, shared_now=True)) < per_slot:
            targets = stock_targets(view, settings, shallow)  # sources met in this very claim
        placed = place_ready(pinned, fair.tasks, targets)
        if not placed:
            return 0
        mean_tokens = sum(t.estimated_tokens for t, _ in placed) / len(placed)
        enough = ready_lists.backlog_to_stock(mean_tokens, outlooks(view, settings.expected_latency_s),
                                              planned_latency_field(settings))
        if not pending_at_least(conn, enough + len(placed)):
            return 0
        entries = [(model, task.id, task.estimated_tokens, ready_admission_id()) for task, model in placed]
        # The database deadline outlives the Redis entry, so a task taken at the
        # last moment is still ``ready`` when its worker starts it.
        mark_ready(conn, [(task_id, model, lid) for model, task_id, _, lid in entries],
                    math.ceil(settings.ready_ttl) + settings.lease_seconds)
    # Committed: only now may a finishing call take them (it starts the task under
    # that id). A dispatcher that dies here leaves them queued until their
    # deadline, when the sweep returns them, as with a lost publish.
    stocked = services.core.stock(entries, round(settings.ready_ttl * 1000))
    lost = [(task_id, lid) for (_, task_id, _, lid), done in zip(entries, stocked, strict=True) if not done]
    fairness.settle(services, fair, {task_id for (_, task_id, _, _), done in zip(entries, stocked, strict=True) if done})
    if lost:  # the model was removed meanwhile
        with services.engine.begin() as conn:
            unstock(conn, lost)
    return len(entries) - len(lost)


def place_ready(pinned: Sequence[PendingTask], flexible: Sequence[PendingTask],
                targets: dict[str, int]) -> list[tuple[PendingTask, str]]:
    """Which claimed task goes on which model's ready list.

    >>> pinned = [PendingTask(1, 10, ("a",))]
    >>> flexible = [PendingTask(2, 10, None), PendingTask(3, 10, ("b",)), PendingTask(4, 10, None)]
    >>> [(t.id, m) for t, m in place_ready(pinned, flexible, {"a": 2, "b": 2})]
    [(1, 'a'), (2, 'b'), (3, 'b'), (4, 'a')]

    Pinned tasks fill their model's room first. Only a model whose pinned lane
    came back short (no more pinned tasks pending for it) has room left for
    flexible ones: "a" asked for 2 and got 1 pinned, so task 4 may use it.
    """
    room = dict(targets)
    placed: list[tuple[PendingTask, str]] = []
    seen: set[int] = set()
    for task in pinned:
        model = task.allowed_models[0] if task.allowed_models else None
        if model in room and room[model] > 0:
            placed.append((task, model))
            room[model] -= 1
            seen.add(task.id)
    for task in flexible:
        if task.id in seen:
            continue
        options = [m for m, n in room.items() if n > 0 and (task.allowed_models is None or m in task.allowed_models)
                   and m != task.avoid_model]
        if not options:
            continue
        model = max(options, key=lambda m: room[m])
        placed.append((task, model))
        room[model] -= 1
        seen.add(task.id)
    return placed


def plan_batch(
    pinned: Sequence[PendingTask],
    window: Sequence[PendingTask],
    models: Sequence[str],
    reserved: Collection[str],
) -> list[tuple[PendingTask, Candidate]]:
    """The admission batch: the pinned lane first, then the window, each task once.

    Flexible tasks (any model, or several) may not use a ``reserved`` model,
    one that still has pinned tasks waiting; a flexible task whose models
    are all reserved sits this round out and stays pending. The window can
    repeat pinned tasks (our own locks do not skip them); they keep their place
    in the lane.

    >>> fast, slow = "fast", "slow"
    >>> lane = [PendingTask(9, 10, (slow,))]
    >>> window = [PendingTask(1, 10, None), PendingTask(9, 10, (slow,)), PendingTask(2, 10, (slow, fast))]
    >>> [(t.id, c.allowed) for t, c in plan_batch(lane, window, [fast, slow], {slow})]
    [(9, ('slow',)), (1, ('fast',)), (2, ('fast',))]
    >>> plan_batch([], [PendingTask(3, 10, (slow,)), PendingTask(4, 10, None)], [slow], {slow})[1:]
    []
    """
    seen: set[int] = set()
    batch: list[tuple[PendingTask, Candidate]] = []
    for task in [*pinned, *window]:
        if task.id in seen:
            continue
        seen.add(task.id)
        allowed = task.allowed_models
        if allowed is None or len(allowed) > 1:
            usable = tuple(m for m in (allowed or models) if m not in reserved)
            if not usable:
                continue
            if allowed is not None or len(usable) < len(models):
                allowed = usable
        batch.append((task, Candidate(task.estimated_tokens, allowed, task.avoid_model)))
    return batch


def outlooks(view: dict[str, ModelLive], prior_s: float) -> list[endgame.ModelOutlook]:
    """Each enabled model's outlook for the end-game plan, from the live view."""
    free = open_slots(view)
    out = []
    for name, m in view.items():
        q = m.quota
        if not q.enabled:
            continue
        rpm = q.max_requests_per_minute
        out.append(endgame.ModelOutlook(
            name,
            cap=q.max_concurrent_requests,
            free_slots=free.get(name, 0),
            in_flight=m.in_flight,
            latency=m.latency_estimate(prior_s),
            tokens_available=m.tokens_available,
            tokens_per_ms=(q.max_tokens_per_minute - m.external_tpm) / 60_000,
            requests_available=math.inf if m.requests_available is None else m.requests_available,
            requests_per_ms=rpm / 60_000 if rpm else math.inf,
            paused_ms=m.paused_ms,
        ))
    return out


def planned_latency_field(settings: Settings) -> str:
    """Plan a call's length at the mean latency when hedges can overtake stragglers, else at p90."""
    return endgame.HEDGED if settings.hedging else endgame.CAUTIOUS


def finish_time_aware(
    conn: Connection, batch: list[tuple[PendingTask, Candidate]], view: dict[str, ModelLive], *,
    window_full: bool, prior_s: float, latency_field: str = endgame.CAUTIOUS,
) -> list[tuple[PendingTask, Candidate]]:
    """The batch as the end game would bind it (see :mod:`balancer.domain.endgame`).

    In the bulk of the run it is returned unchanged. In the end game each task
    is bound to the model that would finish it soonest, or left pending if
    that model has no free slot now. A full window means more is pending than
    was claimed: the backlog's size and mean estimate then come from one count
    query, and the unclaimed rest is planned as stand-ins of average size.
    """
    models = outlooks(view, prior_s)
    pending = len(batch)
    mean_tokens = sum(c.estimated_tokens for _, c in batch) / len(batch)
    if not endgame.in_end_game(pending, mean_tokens, models, latency_field):
        return batch  # a larger backlog drains later still: the bulk of the run, no count needed
    if window_full:
        pending, mean_tokens = pending_backlog(conn)
        if not endgame.in_end_game(pending, mean_tokens, models, latency_field):
            return batch
    jobs = [endgame.Job(t.id, c.estimated_tokens, c.allowed, c.avoid) for t, c in batch]
    unclaimed = min(MAX_UNCLAIMED_PLANNED, max(0, pending - len(jobs)))
    placed = endgame.plan(jobs, models, [endgame.Job(-1 - i, round(mean_tokens)) for i in range(unclaimed)], latency_field)
    return [
        (task, dataclasses.replace(candidate, allowed=(model,)))
        for (task, candidate), model in zip(batch, placed, strict=True)
        if model is not None
    ]


def hedge_stragglers(services: Services, publish: Publisher, view: dict[str, ModelLive]) -> int:
    """Send hedges for straggling calls to free slots that no pending task can use.

    Which calls and where is :func:`balancer.domain.endgame.pick_hedges`; each
    hedge is admitted like any call (so it never breaks a quota), recorded on
    its task (at most ``max_hedges`` per task, within ``hedge_budget`` of the
    run's tokens) and published as a ``solve`` message marked as a hedge.
    """
    core, settings = services.core, services.settings
    models = outlooks(view, settings.expected_latency_s)
    if not any(m.free_slots for m in models) or not any(m.in_flight for m in models):
        return 0
    sent: list[Assignment] = []
    with withdrawn_unless_committed(core) as admitted_ids, services.engine.begin() as conn:
        calls = {c.id: c for c in stragglers(conn, settings.max_hedges)}
        if not calls:
            return 0
        spent, run_tokens = hedge_spending(conn)
        running = [endgame.Running(c.id, c.model, c.elapsed_ms, c.estimated_tokens, c.allowed_models) for c in calls.values()]
        picks = endgame.pick_hedges(running, models, settings.hedge_budget * run_tokens - spent)
        if not picks:
            return 0
        decisions = core.admit([Candidate(calls[key].estimated_tokens, (model,)) for key, model in picks])
        admitted_ids.extend(d.admission_id for d in decisions if isinstance(d, Admitted))
        for (key, _), decision in zip(picks, decisions, strict=True):
            if not isinstance(decision, Admitted):
                continue
            call = calls[key]
            if mark_hedged(conn, key, call.admission_id, decision.admission_id, decision.model, call.estimated_tokens):
                sent.append(Assignment(key, decision.model, decision.admission_id, call.estimated_tokens, hedge=True))
            else:  # the first call ended meanwhile
                core.release(decision.admission_id)
    publish(sent)
    return len(sent)
