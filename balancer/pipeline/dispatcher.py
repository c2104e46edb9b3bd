"""One dispatch run: pending tasks in PostgreSQL → admission → ``solve`` messages.

Late binding: the backlog stays in PostgreSQL and a task is bound to a model
only when that model has room *now*, so model queues never hold more than
free capacity. A quota change, a slow model or a disabled model cannot strand
work in a queue.

Each round locks two sets of pending tasks, skipping rows another dispatcher
holds: the *pinned lane* (for each model with free slots, up to that many tasks
pinned to it alone) and a window of the rest by priority, then age. Pinned
tasks have nowhere else to go, so they get first claim on their model: they
go first in the batch, and while a model still has pinned tasks pending
(counting those another dispatcher holds) it takes no flexible work. So a slow
model's own tasks never queue behind flexible work it took on, which is what
set the tail of ``bench/scenarios/default.toml`` (docs/benchmarks.md). It
admits the batch in one atomic call, marks the admitted
ones ``queued`` and commits, and only then publishes their messages. A
dispatcher that dies between commit and publish leaves leases that were never
started: they expire and refund their tokens, and the reconcile tick returns
the tasks to pending.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from balancer.admission import Admitted, Candidate, NotNow, Rejected
from balancer.admission.core import open_slots
from balancer.services import Services
from balancer.storage.tasks import (
    PendingTask,
    claim_pinned,
    claim_window,
    fail_pending,
    mark_queued,
    models_with_pinned_backlog,
)


@dataclass(frozen=True)
class Assignment:
    task_id: int
    model: str
    admission_id: str
    estimated_tokens: int


@dataclass
class DispatchReport:
    admitted: int = 0
    failed: int = 0
    waiting: int = 0
    rounds: int = 0
    #: ms until the earliest refused task could be admitted (None: unknown or nothing waits)
    retry_in_ms: int | None = None
    by_model: dict[str, int] = field(default_factory=dict)


Publisher = Callable[[Sequence[Assignment]], None]


def dispatch(
    services: Services, publish: Publisher, *, window: int | None = None, max_rounds: int = 20,
    models: Collection[str] | None = None,
) -> DispatchReport:
    """Admit and publish until nothing more fits (or ``max_rounds``).

    ``models`` limits the round to tasks those models could take (the admission
    may still place a task on any model it allows): a worker refilling the slot
    it just freed looks only at its own model.
    """
    core = services.core
    window = window or services.settings.dispatch_window
    report = DispatchReport()
    for _ in range(max_rounds):
        view = core.live()
        if not view and not core.is_loaded():
            # Redis lost its data: restore now (the admit call would too, but an
            # empty live view means it would never be reached).
            core.restore()
            view = core.live()
        free = open_slots(view)
        if models is not None:
            free = {m: n for m, n in free.items() if m in models}
        if not free:
            break
        with services.engine.begin() as conn:
            pinned = claim_pinned(conn, {m: min(n, window) for m, n in free.items()})
            # Every model, not only the open ones: a full model's slot can free
            # between the live read and the admit call.
            reserved = models_with_pinned_backlog(conn, view, exclude=[t.id for t in pinned])
            batch = plan_batch(pinned, claim_window(conn, window, free), list(view), reserved)
            if not batch:
                break
            pending = [task for task, _ in batch]
            decisions = core.admit([candidate for _, candidate in batch])
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
        publish(admitted)
        report.rounds += 1
        report.admitted += len(admitted)
        report.failed += len(failed)
        for a in admitted:
            report.by_model[a.model] = report.by_model.get(a.model, 0) + 1
        if not admitted and not failed:
            break
    return report


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
