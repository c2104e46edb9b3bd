"""One dispatch run: pending tasks in PostgreSQL → admission → ``solve`` messages.

Late binding: the backlog stays in PostgreSQL and a task is bound to a model
only when that model has room *now*, so model queues never hold more than
free capacity. A quota change, a slow model or a disabled model cannot strand
work in a queue.

Each round locks two sets of pending tasks, skipping rows another dispatcher
holds: a window (priority first, and within a priority, turns across sources by
weight, :mod:`balancer.dispatch.fairness`, so a backfill from one source does
not stand ahead of a live one; while several sources share it, their pinned
tasks take their turns in it too) and the *pinned lane* (for each model with
free slots, up to that many tasks pinned to it alone). Pinned tasks have nowhere
else to go, so they get first claim on their model: they go first in the batch,
and while a model still has pinned tasks pending (counting those another
dispatcher holds) it takes no flexible work. So a slow model's own tasks never
queue behind flexible work it took on, which is what sets the end of
``bench/scenarios/default.toml``. While sources share, the round robin keeps the
last word over the lane and the reservation (:func:`balancer.dispatch.fairness.pinned_lane`). It
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
:mod:`balancer.dispatch.ready`.

Work goes only where someone consumes it (:mod:`balancer.dispatch.served`): a
model no worker consumes is admitted and stocked nothing, and a run's first round
returns its queued and ready tasks to pending and hedges its calls in flight,
before new work.

A source whose budget per day is spent takes no new calls: the run reads
which sources are over budget once (:class:`HeldSources`), and its claims, stock and
hedges leave their tasks pending (:mod:`balancer.dispatch.budgets`).

The end of the backlog is different: a task handed to a slow model in the
last minute can end long after every other model has gone idle. When the
backlog would drain before a call started now on the slowest open model
would end, each task goes to the model that would finish it soonest, by the
models' learned latencies, and may wait for a busy fast model rather than take
an idle slow one (:func:`finish_time_aware`, :mod:`balancer.dispatch.endgame`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection

from balancer.admission.core import AdmissionCore
from balancer.admission.live import ModelLive, next_slot_ms, open_slots, slots_of
from balancer.admission.values import Admitted, Candidate, NotNow, Rejected
from balancer.backlog.claims import PendingTask, fail_pending, mark_queued
from balancer.backlog.hedges import hedge_spending, mark_hedged, stragglers
from balancer.backlog.ready import unstock
from balancer.dispatch import endgame, fairness
from balancer.dispatch.budgets import held_sources
from balancer.dispatch.placement import finish_time_aware, outlooks, planned_latency_field
from balancer.dispatch.served import consumed_only, orphaned, return_orphans, served_view, unserved
from balancer.dispatch.stocking import stock_ready
from balancer.services import Services

log = logging.getLogger(__name__)


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
    #: queued or ready tasks returned to pending because no worker consumes their model's queue
    unconsumed: int = 0
    #: sources over their budget: none of their tasks was claimed (balancer.dispatch.budgets)
    held: frozenset[str] = frozenset()
    #: ms until the earliest refused task could be admitted, or slow start opens a slot on a model
    #: it holds full (None: unknown or nothing waits)
    retry_in_ms: int | None = None
    by_model: dict[str, int] = field(default_factory=dict)

    def retry_within(self, ms: int | None) -> None:
        """Ask for the next round no later than ``ms`` from now (None: no new reason to)."""
        if ms is not None and (self.retry_in_ms is None or ms < self.retry_in_ms):
            self.retry_in_ms = ms

    def count_admitted(self, assignments: Sequence[Assignment]) -> None:
        self.admitted += len(assignments)
        for a in assignments:
            self.by_model[a.model] = self.by_model.get(a.model, 0) + 1


@dataclass
class HeldSources:
    """The sources over budget in one dispatch run, whose tasks wait this run: read
    once, where first needed (in the run's first transaction, or on a connection of
    its own when no round opened one), and kept on the run's report."""

    services: Services
    report: DispatchReport
    _read: bool = False

    def read(self, conn: Connection | None = None) -> frozenset[str]:
        if not self._read:
            self.report.held = held_sources(self.services, conn)
            self._read = True
        return self.report.held


Publisher = Callable[[Sequence[Assignment]], None]

#: Flexible tasks a round claims per open slot, up to the window: choice enough
#: for the WDRR order and for tasks some models refuse, not a whole window for a
#: few slots. A token-bound model shows free slots while its bucket is low;
#: claiming 200 tasks for them and refusing nearly all, round after round, made
#: a dispatch run take 0.2 to 0.8 s on fast.toml (docs/benchmark-history.md, the hot path).
CLAIMS_PER_OPEN_SLOT = 4

#: The soonest a dispatch run asks for the next round when slow start is what holds a model full.
RAMP_ROUND_MS = 50


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
    over_budget = HeldSources(services, report)
    idle = False  # the last round found nothing pending that a free slot could take
    view_predates_stock = False  # the round stocked after reading ``view``: its ready counts are old
    every: dict[str, ModelLive] = {}
    for round_no in range(max_rounds):
        view = core.live()
        view_predates_stock = False
        if not view and not core.is_loaded():
            # Redis lost its data: restore now (the admit call would too, but an
            # empty live view means it would never be reached).
            core.restore()
            view = core.live()
        if round_no == 0:
            orphans = orphaned(services, view)
            # take_ready.lua drops the lists of unserved models: not while their records lapsed unheard
            if any(m.ready for m in view.values()) and not unserved(services, view) - orphans:
                if take_from_ready(services, publish, report):
                    view = core.live()
            report.unconsumed += return_orphans(services, orphans)
        every = view  # unserved models too: their running calls are the first to hedge
        view = served_view(services, every)
        if round_no == 0 and services.settings.hedging and any(every[name].in_flight for name in orphans):
            # A call on a model no worker consumes may never end: it is hedged before new work takes the
            # free slots, not once the backlog is out.
            if hedged := hedge_stragglers(services, publish, every, over_budget.read(), orphans_only=True):
                report.hedges += hedged
                every = core.live()
                view = served_view(services, every)
        free = open_slots(view)
        if not free:
            break
        with withdrawn_unless_committed(core) as admitted_ids, services.engine.begin() as conn:
            held = over_budget.read(conn)
            who = fairness.pending(services, conn, held)
            limit = claim_limit(free, window)
            fair = fairness.claim_flexible(services, conn, limit, free, held, who)
            claimed = fair.tasks
            # Reserved among every model, not only the open ones: a full model's slot can free
            # between the live read and the admit call.
            pinned, reserved = fairness.pinned_lane(conn, {m: min(n, window) for m, n in free.items()},
                                                    slots_of(view), claimed, held, who)
            # A model with ready tasks takes those first (take_from_ready), not new flexible work.
            reserved |= {name for name, m in view.items() if m.ready}
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
            decisions = core.admit([candidate for _, candidate in batch], consumed_only=consumed_only(services))
            admitted_ids.extend(d.admission_id for d in decisions if isinstance(d, Admitted))
            admitted: list[Assignment] = []
            failed: list[tuple[int, str]] = []
            for task, decision in zip(pending, decisions, strict=True):
                if isinstance(decision, Admitted):
                    admitted.append(Assignment(task.id, decision.model, decision.admission_id, task.estimated_tokens))
                elif isinstance(decision, Rejected) and not decision.no_model:
                    failed.append((task.id, decision.reason))
                elif isinstance(decision, Rejected):  # its planned model removed since the view: the next round replans it
                    report.waiting += 1
                elif isinstance(decision, NotNow):
                    report.waiting += 1
                    report.retry_within(decision.wait_ms)
            mark_queued(conn, [(a.task_id, a.model, a.admission_id) for a in admitted], services.settings.lease_seconds)
            fail_pending(conn, failed)
        fairness.settle(services, fair, {a.task_id for a in admitted} | {task_id for task_id, _ in failed})
        publish(admitted)
        if round_no == 0 and stocking:
            # Refill the lists now, not only at the end: the next rounds publish
            # for a while, and every call that ends meanwhile takes its next from them.
            report.stocked += stock_ready(services, served_view(services, core.live()), held)
            view_predates_stock = True
        report.rounds += 1
        report.count_admitted(admitted)
        report.failed += len(failed)
        if not admitted and not failed:
            break
    if idle and services.settings.hedging:  # the view of the round that found nothing
        report.hedges += hedge_stragglers(services, publish, every, over_budget.read())
    if stocking and not view_predates_stock:  # (a view read before this run's stock would stock twice)
        report.stocked += stock_ready(services, view, over_budget.read())
    # A slot that slow start opens frees without a call ending, so nothing else would ask for
    # the round that fills it: the next tick would, with every slot opened meanwhile at once.
    # No sooner than RAMP_ROUND_MS: late in a ramp a slot opens every few ms. Only while a model
    # is full: the round that finds its new slot and nothing pending for it asks for no other.
    opens = next_slot_ms(view)
    report.retry_within(None if opens is None else max(opens, RAMP_ROUND_MS))
    return report


def take_from_ready(services: Services, publish: Publisher, report: DispatchReport) -> int:
    """Admit the ready tasks free slots can take now, and send dropped ones back
    to pending. Returns how many were admitted (published like any admission)."""
    taken, dropped = services.core.take_ready(consumed_only=consumed_only(services))
    if dropped:
        with services.engine.begin() as conn:
            report.unstocked += unstock(conn, [(t.task_id, t.admission_id) for t in dropped])
    assignments = [Assignment(t.task_id, t.model, t.admission_id, t.estimated_tokens) for t in taken]
    publish(assignments)
    report.count_admitted(assignments)
    return len(assignments)


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


def hedge_stragglers(services: Services, publish: Publisher, view: dict[str, ModelLive],
                     held: Collection[str] = (), *, orphans_only: bool = False) -> int:
    """Send hedges for straggling calls to free slots that no pending task can use, or, with
    ``orphans_only``, for the calls on models no worker consumes, before pending work (none for a
    task of a ``held`` source: a hedge is a call its budget pays for).

    Which calls and where is :func:`balancer.dispatch.endgame.pick_hedges`; each
    hedge is admitted like any call (so it never breaks a quota), recorded on
    its task (at most ``max_hedges`` per task, within ``hedge_budget`` of the
    run's tokens, which a hedge of an orphan's call does not spend) and
    published as a ``solve`` message marked as a hedge. ``view`` holds every
    model: a call on one no worker consumes is hedged first (on a served model).
    """
    core, settings = services.core, services.settings
    orphans = orphaned(services, view)
    # a model unserved but not orphaned (its record lapsed unheard) neither takes nor gives hedges
    unconsumed = unserved(services, view) - orphans
    models = outlooks({name: m for name, m in view.items() if name not in unconsumed}, settings.expected_latency_s)
    if not any(m.free_slots for m in models if m.name not in orphans) or not any(m.in_flight for m in models):
        return 0
    sent: list[Assignment] = []
    with withdrawn_unless_committed(core) as admitted_ids, services.engine.begin() as conn:
        calls = {c.id: c for c in stragglers(conn, settings.max_hedges, orphans=orphans if orphans_only else None)
                 if c.source not in held}
        if not calls:
            return 0
        spent, run_tokens = hedge_spending(conn)
        running = [endgame.Running(c.id, c.model, c.elapsed_ms, c.estimated_tokens, c.allowed_models) for c in calls.values()]
        allowance = endgame.hedge_allowance(settings.hedge_budget * run_tokens - spent, [c.estimated_tokens for c in running])
        picks = endgame.pick_hedges(running, models, allowance, orphans)
        if not picks:
            return 0
        decisions = core.admit([Candidate(calls[key].estimated_tokens, (model,)) for key, model in picks],
                               consumed_only=consumed_only(services))
        admitted_ids.extend(d.admission_id for d in decisions if isinstance(d, Admitted))
        for (key, _), decision in zip(picks, decisions, strict=True):
            if not isinstance(decision, Admitted):
                continue
            call = calls[key]
            # A hedge of a call no worker serves stands in for a call that may never answer, whatever
            # the budget: it spends none of it, or a cut host's calls would leave none for the stragglers.
            spends = 0 if call.model in orphans else call.estimated_tokens
            if mark_hedged(conn, key, call.admission_id, decision.admission_id, decision.model, spends,
                           replacing=call.hedge_admission_id):
                sent.append(Assignment(key, decision.model, decision.admission_id, call.estimated_tokens, hedge=True))
            else:  # the first call ended meanwhile, or a worker holds its row
                core.release(decision.admission_id)
    publish(sent)
    return len(sent)
