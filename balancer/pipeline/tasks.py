"""Celery task entry points. Each is a thin wrapper over a plain function."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from celery.signals import worker_process_init, worker_ready
from celery.worker import state as worker_state

from balancer.admission import keys
from balancer.backlog.leases import sweep_expired
from balancer.calls import runtime
from balancer.calls.consumers import ConsumerBeat
from balancer.calls.heartbeat import live_calls
from balancer.calls.pool import QuotaWatcher
from balancer.calls.solver import SolveMessage, solve_chain
from balancer.dispatch.dispatcher import Assignment, DispatchReport, dispatch
from balancer.dispatch.fallback import FallbackTicks, Tick, mark_beat_seen
from balancer.dispatch.lost import LostMessages
from balancer.dispatch.trigger import LocalRound, clear_requests, request_dispatch, run_alone
from balancer.pipeline.app import app
from balancer.settings import Settings
from balancer.sources.polling import SourceReadLoop
from balancer.sources.writeback import WritebackLoop

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per backend call is noise
app.steps["consumer"].add(QuotaWatcher)
app.steps["consumer"].add(ConsumerBeat)  # each model this worker consumes: a live record (balancer.calls.consumers)
#: Tasks whose solve messages the broker lost (a failover) go back to pending within seconds.
lost_messages = LostMessages()


@worker_process_init.connect
def _fresh_handles_after_fork(**_: object) -> None:
    runtime.reset()


@worker_ready.connect
def freeze_startup_objects(**_: object) -> None:
    """Leave what start-up made (modules, the Celery app, SQLAlchemy's tables)
    out of every later garbage collection. A full collection scanned them all
    and stopped every thread of the process for 60 to 170 ms, every second or
    two under load: the refill gaps over 100 ms in one worker process were
    those pauses (docs/benchmark-history.md, the hot path)."""
    gc.freeze()


def publish(assignments: Sequence[Assignment]) -> None:
    """Send one ``solve`` message per admitted task to ``model.<name>``."""
    if not assignments:
        return
    with app.producer_or_acquire() as producer:
        for a in assignments:
            solve_task.apply_async(
                args=[a.task_id, a.admission_id, a.model, a.estimated_tokens, a.hedge],
                queue=keys.model_queue(a.model),
                shadow=keys.solve_shown(a.model),  # Flower's task list names the model
                producer=producer,
            )


def trigger_dispatch(delay_ms: int = 0) -> bool:
    svc = runtime.services()
    return request_dispatch(
        svc.redis,
        svc.settings.namespace,
        lambda countdown: dispatch_task.apply_async(countdown=countdown or None),
        delay_ms=delay_ms,
        max_delay_ms=int(svc.settings.dispatch_tick * 1000),
    )


#: This process's share of the round: the dispatcher runs two control tasks at once (``-c 2``, threads).
_local_round = LocalRound()


@app.task(name=keys.DISPATCH_TASK, send_events=False)  # a tick: not in a monitor's task list (Flower)
def dispatch_task(from_beat: bool = False) -> dict:
    svc = runtime.services()
    if from_beat:
        mark_beat_seen(svc.redis, svc.settings.namespace, svc.settings.dispatch_tick)
    reports = run_alone(svc.redis, svc.settings.namespace, _dispatch_once, _local_round)  # clears the request flag
    return {"admitted": sum(r.admitted for r in reports), "failed": sum(r.failed for r in reports)}


def _dispatch_once() -> DispatchReport:
    svc = runtime.services()
    lost_messages.check(svc)  # before the round, which dispatches the tasks it returns
    report = dispatch(svc, publish)
    if report.retry_in_ms is not None and report.retry_in_ms < svc.settings.dispatch_tick * 1000:
        trigger_dispatch(delay_ms=max(report.retry_in_ms, 10))
    if report.admitted or report.failed:
        log.info("dispatched %d, failed %d, by model %s%s", report.admitted, report.failed, report.by_model,
                 f"; over budget, waiting: {', '.join(sorted(report.held))}" if report.held else "")
    return report


def shutting_down() -> bool:
    """Whether this worker is stopping. Celery sets ``should_stop`` or
    ``should_terminate`` to an exit code, which on a warm shutdown is EX_OK
    (0, false): set means stop whatever the value, as Celery tests it
    (``is not None and is not False``)."""
    return any(flag is not None and flag is not False
               for flag in (worker_state.should_stop, worker_state.should_terminate))


@app.task(name=keys.SOLVE_TASK)
def solve_task(task_id: int, admission_id: str, model: str, estimated_tokens: int, hedge: bool = False) -> str:
    """Solve the message's task, then each next call its slot takes from the
    model's ready list, with no broker hop between them (see the solver).

    The chain holds this message unacknowledged, so it stops taking more while
    one more solve could still end before the broker's visibility timeout, and
    when the worker is shutting down."""
    svc = runtime.services()
    msg = SolveMessage(task_id, admission_id, model, estimated_tokens, hedge)
    started = time.monotonic()
    last_start = svc.settings.visibility_timeout - svc.settings.hard_time_limit  # > 0: Settings.check_timing

    def may_continue() -> bool:
        return time.monotonic() - started < last_start and not shutting_down()

    outcomes = solve_chain(
        svc, runtime.backend(), msg, runtime.cancel_listener(), runtime.heartbeat(), runtime.answer_writer(),
        may_continue=may_continue, ask_for_dispatch=trigger_dispatch,  # a slot freed, or a ready list ran low: refill now
    )
    return outcomes[0] if len(outcomes) == 1 else f"{outcomes[0]} and {len(outcomes) - 1} next"


@app.task(name=keys.SWEEP_TASK, send_events=False)  # a tick: not in a monitor's task list (Flower)
def sweep_task() -> int:
    """Return tasks past their deadline to pending (a dead worker, a lost
    message), except those whose calls a worker still keeps alive, make the
    live quotas match PostgreSQL's, and audit learned limits that have stood
    for a minute (balancer.quotas.learned_audit)."""
    from balancer.quotas.learned_audit import record_learned

    svc = runtime.services()
    repaired = svc.quotas.repair_drift()
    if repaired:
        log.warning("live quotas differed from PostgreSQL for %s; repaired", ", ".join(repaired))
    if svc.core.is_loaded():
        learned = record_learned(svc.engine, svc.core.live(), int(svc.redis.time()[0]) * 1000)
        if learned:
            log.info("limits in force changed by learning (audited): %s", ", ".join(learned))
    returned, kept = sweep_expired(svc.engine, live_calls(svc.redis, svc.settings.namespace), svc.settings.lease_seconds)
    if kept:
        log.warning("kept %d task(s) past their deadline: their workers still keep their calls alive (in Redis), "
                    "though they did not renew them in PostgreSQL", kept)
    if returned:
        log.warning("returned %d task(s) past their deadline to pending", returned)
        trigger_dispatch()
    return returned


@app.task(name=keys.INGEST_TASK, send_events=False)  # a tick: not in a monitor's task list (Flower)
def ingest_task() -> int:
    """The inbox. (Source tables are read by :class:`SourceReads`, off the control threads.)"""
    from balancer.sources.inbox import ingest_inbox

    svc = runtime.services()
    if not svc.settings.inbox:
        return 0
    files = ingest_inbox(svc, Path(svc.settings.inbox))
    created = sum(f.tasks for f in files)
    if created:
        log.info("ingested %d task(s) from %d file(s)", created, len(files))
        trigger_dispatch()
    return created


class DispatcherTicks(FallbackTicks):
    """Beat's ticks, sent by the dispatcher while beat is absent (see :mod:`balancer.dispatch.fallback`)."""

    def ticks(self, settings: Settings) -> list[Tick]:
        return [(settings.dispatch_tick, trigger_dispatch), (settings.sweep_tick, sweep_task.delay),
                (settings.ingest_tick, ingest_task.delay)]

    def connected(self) -> None:
        """A dispatch now, past any request flag left from before the broker went: after a Redis
        failover the dispatcher otherwise waited for beat's next tick to come through, or for its
        own after ABSENT_AFTER ticks, while the slots that freed meanwhile stood idle."""
        svc = runtime.services()
        clear_requests(svc.redis, svc.settings.namespace)
        trigger_dispatch()


class SourceReads(SourceReadLoop):
    """Source tables, each read on a thread of its own: a locked or slow team table never holds
    a control thread (dispatch, sweep). Tasks made ask for a dispatch."""

    def created(self) -> None:
        trigger_dispatch()


app.steps["consumer"].add(DispatcherTicks)
app.steps["consumer"].add(SourceReads)
app.steps["consumer"].add(WritebackLoop)  # source tables: ended tasks written back, in the dispatcher
