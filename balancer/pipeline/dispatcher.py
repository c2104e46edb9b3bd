"""One dispatch run: pending tasks in PostgreSQL → admission → ``solve`` messages.

Late binding: the backlog stays in PostgreSQL and a task is bound to a model
only when that model has room *now*, so model queues never hold more than
free capacity. A quota change, a slow model or a disabled model cannot strand
work in a queue.

Each round locks a window of pending tasks (priority, then age, skipping rows
another dispatcher holds), admits them in one atomic call, marks the admitted
ones ``queued`` and commits, and only then publishes their messages. A
dispatcher that dies between commit and publish leaves leases that were never
started: they expire and refund their tokens, and the reconcile tick returns
the tasks to pending.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from balancer.admission import Admitted, Candidate, NotNow, Rejected
from balancer.services import Services
from balancer.storage.tasks import claim_window, fail_pending, mark_queued


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


def dispatch(services: Services, publish: Publisher, *, window: int | None = None, max_rounds: int = 20) -> DispatchReport:
    """Admit and publish until nothing more fits (or ``max_rounds``)."""
    core = services.core
    window = window or services.settings.dispatch_window
    report = DispatchReport()
    for _ in range(max_rounds):
        open_models = core.open_models()
        if not open_models and not core.is_loaded():
            # Redis lost its data: restore now (the admit call would too, but an
            # empty live view means it would never be reached).
            core.restore()
            open_models = core.open_models()
        if not open_models:
            break
        with services.engine.begin() as conn:
            pending = claim_window(conn, window, open_models)
            if not pending:
                break
            decisions = core.admit([Candidate(p.estimated_tokens, p.allowed_models) for p in pending])
            admitted: list[Assignment] = []
            failed: list[tuple[int, str]] = []
            for task, decision in zip(pending, decisions):
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
