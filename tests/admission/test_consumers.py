"""Work goes only where someone consumes it (issue 40, item 1): each worker process keeps a
live record per model it consumes, and the dispatcher admits nothing to a model with none.

The rule in the scripts and the reference model is held equal by tests/admission/test_differential.py
(``admit_consumed``, ``take_ready_consumed``, ``consume``); here the dispatcher against real
Redis and PostgreSQL, and real worker processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from balancer.admission.quota import Quota
from balancer.admission.values import Admitted, Candidate
from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import parse_tasks
from balancer.dispatch.dispatcher import Assignment, dispatch
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import tasks

pytestmark = pytest.mark.usefixtures("migrated")


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)
    return value


def workers_beating_for_a_while(services: Services) -> None:
    """Redis as it is once workers have beaten for longer than a record lives: their records
    are believed (the first beat with none on record is a resumption, balancer.admission.liveness)."""
    from balancer.admission.keys import consumers_heard
    from balancer.admission.liveness import TTL_MS

    now_ms = int(services.redis.time()[0]) * 1000
    services.redis.hset(consumers_heard(services.settings.namespace), mapping={"heard": now_ms, "resumed": now_ms - TTL_MS})


def worker_gone(services: Services, consumer: str, model: str) -> None:
    """``consumer``'s worker stops, or its host is cut off: its record of ``model`` ends now, while
    the other workers beat on. (A live worker beats every second; a loaded machine can take longer
    than SILENCE_MS between a test's beats, which reads as Redis hearing no worker, and then no
    record is believed: a fresh-clone CI run failed so.)"""
    services.core.note_consumers(consumer, [model], 0)
    workers_beating_for_a_while(services)


@pytest.fixture
def svc(monkeypatch: pytest.MonkeyPatch) -> Services:
    monkeypatch.setenv("BALANCER_CONSUMERS_REQUIRED", "on")
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([Quota("a", 4, 600_000, slow_start=False), Quota("b", 4, 600_000, slow_start=False)])
    workers_beating_for_a_while(services)
    return services


def submit(svc: Services, model: str | None, n: int) -> list[int]:
    lines = "\n".join(json.dumps({"prompt": f"p{i} {model}", **({"model": model} if model else {})}) for i in range(n))
    rows, errors = parse_tasks(lines, models={q.name: q.burst for q in svc.quotas.all()})
    assert not errors
    with svc.engine.begin() as conn:
        return insert_tasks(conn, rows)


def statuses(svc: Services, ids: list[int]) -> list[tuple[str, str | None]]:
    with svc.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(tasks.c.status, tasks.c.model).where(tasks.c.id.in_(ids))
                                                .order_by(tasks.c.id))]


def test_the_dispatcher_admits_nothing_to_a_model_no_worker_consumes(svc: Services) -> None:
    """Issue 40 finding 1: admission did not know whether anyone consumed model.<name>, so a cut
    worker host's models took their share of the work into queues nobody read. Now a model with
    no live consumer record is admitted nothing (a task that may go elsewhere goes elsewhere),
    its queued tasks go back to pending at the next run, and it takes work again once a worker
    says it consumes it. The router's admissions (callers outside Celery) need no consumer."""
    svc.core.note_consumers("w-a", ["a"], 60_000)
    sent: list[Assignment] = []
    only_b = submit(svc, "b", 2)
    anywhere = submit(svc, None, 3)
    dispatch(svc, sent.extend)
    assert {a.model for a in sent} == {"a"} and sorted(a.task_id for a in sent) == anywhere
    assert statuses(svc, only_b) == [("pending", None)] * 2
    routed = svc.core.admit([Candidate(10, ("b",))])[0]  # the router's callers: no consumer needed
    assert isinstance(routed, Admitted)
    svc.core.release(routed.admission_id)

    svc.core.note_consumers("w-b", ["b"], 60_000)  # a worker for b comes: b takes its tasks at the next run
    sent.clear()
    dispatch(svc, sent.extend)
    assert sorted(a.task_id for a in sent) == only_b and {a.model for a in sent} == {"b"}
    assert svc.core.live()["b"].in_flight >= 2

    worker_gone(svc, "w-b", "b")  # its worker stops: b's queued tasks go back now, leases freed
    sent.clear()
    report = dispatch(svc, sent.extend)
    assert report.unconsumed == 2 and sent == []
    assert statuses(svc, only_b) == [("pending", None)] * 2
    live = svc.core.live()["b"]
    assert live.in_flight == 0 and live.consumers == 0


def test_a_ready_list_of_a_model_no_worker_consumes_goes_back_at_once(svc: Services) -> None:
    """Issue 40 finding 1: the dispatcher's pass over the ready lists returns every entry of a
    model no worker consumes to pending at once (not when each expires)."""
    from balancer.backlog.ready import mark_ready

    svc.core.note_consumers("w-a", ["a"], 60_000)  # a's worker beats; nobody consumes b
    ids = submit(svc, "b", 3)
    with svc.engine.begin() as conn:
        mark_ready(conn, [(task_id, "b", f"r{task_id}") for task_id in ids], 60)
    svc.core.stock([("b", task_id, 100, f"r{task_id}") for task_id in ids], 60_000)
    report = dispatch(svc, lambda assignments: None)
    assert report.unstocked == 3 and svc.core.live()["b"].ready == 0
    assert statuses(svc, ids) == [("pending", None)] * 3


def test_a_ready_task_a_worker_took_before_its_host_was_cut_goes_back_at_once(svc: Services) -> None:
    """Issue 40's cut at the issue's size: a task its worker had taken from a ready list just
    before the cut was off the list, so the pass over the lists did not see it, and still
    ``ready`` in PostgreSQL, so the return of queued tasks did not either: it waited 30 s for
    the sweep. Now it goes back with the queued ones, and its lease is withdrawn."""
    from balancer.backlog.ready import mark_ready
    from balancer.backlog.transitions import start_solve

    svc.core.note_consumers("w-a", ["a"], 60_000)
    svc.core.note_consumers("w-b", ["b"], 60_000)
    (task_id,) = submit(svc, "b", 1)
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    with svc.engine.begin() as conn:  # as a worker's finish would leave it: taken from the list, not yet started
        conn.execute(sa.update(tasks).where(tasks.c.id == task_id).values(status="pending", model=None, admission_id=None))
        mark_ready(conn, [(task_id, "b", sent[0].admission_id)], 60)
    assert svc.core.live()["b"].ready == 0
    worker_gone(svc, "w-b", "b")  # b's host is cut off
    report = dispatch(svc, lambda assignments: None)
    assert report.unconsumed == 1 and statuses(svc, [task_id]) == [("pending", None)]
    assert svc.core.live()["b"].in_flight == 0
    assert start_solve(svc.engine, task_id, sent[0].admission_id, 60) is None  # the cut worker's late start: no call


def test_records_that_lapsed_while_redis_heard_no_worker_return_nothing(svc: Services) -> None:
    """Issue 40's failover: Redis was away for longer than a record lives (3 s), so every record
    had lapsed when it came back, and the dispatcher's first run returned the queued and ready
    tasks of every model whose worker had not beaten again yet: their workers were there all
    along. Now a record that lapsed while Redis heard no worker says nothing until every worker
    has had a record's life to renew its own; then the work of a model still unconsumed goes back."""
    from balancer.admission.keys import consumers_heard
    from balancer.backlog.ready import mark_ready

    svc.redis.delete(consumers_heard(svc.settings.namespace))  # Redis lost it, or no worker beat for a minute
    svc.core.note_consumers("w-a", ["a"], 60_000)
    assert not svc.core.consumer_records_trusted()  # a first beat with none on record: beats resumed
    workers_beating_for_a_while(svc)
    svc.core.note_consumers("w-b", ["b"], 60_000)
    queued = submit(svc, "b", 2)
    dispatch(svc, lambda assignments: None)
    ready = submit(svc, "b", 1)
    with svc.engine.begin() as conn:
        mark_ready(conn, [(task_id, "b", f"r{task_id}") for task_id in ready], 60)
    svc.core.stock([("b", task_id, 100, f"r{task_id}") for task_id in ready], 60_000)
    assert statuses(svc, queued) == [("queued", "b")] * 2

    # The failover, as the promoted replica holds it: b's record lapsed, no beat heard for 5 s;
    # then a's worker beats first.
    heard = consumers_heard(svc.settings.namespace)
    now_ms = int(svc.redis.time()[0]) * 1000
    svc.core.note_consumers("w-b", ["b"], 0)
    svc.redis.hset(heard, "heard", now_ms - 5_000)
    svc.core.note_consumers("w-a", ["a"], 60_000)
    assert not svc.core.consumer_records_trusted()
    report = dispatch(svc, lambda assignments: None)
    assert report.unconsumed == 0 and report.unstocked == 0
    assert statuses(svc, queued) == [("queued", "b")] * 2
    assert svc.core.live()["b"].ready == 1 and svc.core.live()["b"].in_flight == 2

    # A record's life after the beats resumed, b's worker has not come back: its work goes back.
    workers_beating_for_a_while(svc)  # resumed a record's life ago, a's worker heard just now
    assert svc.core.consumer_records_trusted()
    report = dispatch(svc, lambda assignments: None)
    assert report.unconsumed == 2 and report.unstocked == 1
    assert statuses(svc, queued + ready) == [("pending", None)] * 3


def test_a_call_on_a_model_no_worker_consumes_is_hedged_on_one_that_is(svc: Services) -> None:
    """Issue 40 finding 1: a call whose model no worker consumes any longer (its worker's host
    cut off) may never end, and its task waited a whole lease for the sweep while other models
    sat idle. Now it is hedged at once on a model a worker consumes, whatever its latency says
    and whatever the hedge budget (here a call 0 s old, which no straggler rule would hedge)."""
    from balancer.backlog.transitions import start_solve

    svc.core.note_consumers("w-b", ["b"], 60_000)
    (task_id,) = submit(svc, None, 1)
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    assert [(a.task_id, a.model) for a in sent] == [(task_id, "b")]
    assert start_solve(svc.engine, task_id, sent[0].admission_id, 60) is not None
    worker_gone(svc, "w-b", "b")  # b's worker is gone; a's is there
    svc.core.note_consumers("w-a", ["a"], 60_000)
    sent.clear()
    report = dispatch(svc, sent.extend)
    assert report.hedges == 1 and [(a.task_id, a.model, a.hedge) for a in sent] == [(task_id, "a", True)]


def long_calls_on_b_and_a(monkeypatch: pytest.MonkeyPatch, hedge_budget: str) -> tuple[Services, int, int]:
    """Three served models a, b and c (4 slots each, no slow start), and two tasks that have been
    running 10 minutes, either of which may go to any model: one on b, one on a. Returns
    (services, the task on b, the task on a)."""
    from balancer.backlog.transitions import start_solve

    monkeypatch.setenv("BALANCER_CONSUMERS_REQUIRED", "on")
    monkeypatch.setenv("BALANCER_HEDGE_BUDGET", hedge_budget)
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota(name, 4, 600_000, slow_start=False) for name in ("a", "b", "c")])
    workers_beating_for_a_while(svc)
    for name in ("a", "b", "c"):
        svc.core.note_consumers(f"w-{name}", [name], 60_000)
    (on_b,) = submit(svc, "b", 1)
    (on_a,) = submit(svc, "a", 1)
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    for assignment in sent:
        assert start_solve(svc.engine, assignment.task_id, assignment.admission_id, 60) is not None
    with svc.engine.begin() as conn:
        conn.execute(sa.update(tasks).where(tasks.c.id.in_([on_b, on_a]))
                     .values(started_at=sa.func.now() - sa.text("interval '10 minutes'"), allowed_models=None))
    return svc, on_b, on_a


def test_a_call_on_a_model_no_worker_consumes_is_hedged_before_new_work_takes_the_free_slots(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40's cut at the issue's size: the calls a cut host had in flight were hedged only when
    a dispatch round found no pending task for the free slots, so with a backlog they waited for
    its end (10 s of a 15 s batch) and then for their hedges. Now the first round of a run hedges
    them before it admits new work into those slots; a straggler on a served model is not hedged
    there, though a budget would pay for it and model c could take it."""
    svc, orphan, _ = long_calls_on_b_and_a(monkeypatch, "1")  # the call on a: a straggler, not an orphan
    worker_gone(svc, "w-b", "b")  # b's worker is gone; a's and c's are there, and a backlog waits
    backlog = submit(svc, None, 20)
    sent: list[Assignment] = []
    report = dispatch(svc, sent.extend)
    assert report.hedges == 1 and sent[0].task_id == orphan and sent[0].hedge and sent[0].model in ("a", "c")
    assert [a for a in sent[1:] if a.hedge] == [] and {a.task_id for a in sent[1:]} <= set(backlog)
    assert len(sent) == 7  # every free slot of a (three) and c (four): the hedge and six of the backlog


def test_a_call_whose_hedge_went_to_the_same_cut_host_is_hedged_again_on_one_that_is_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real-hosts test, 2 runs in 7: a straggler on b was hedged on c a moment before b's and c's
    host was cut off; the task had its one hedge, and both its calls were on the cut host, so it
    waited its whole lease for the sweep (a batch of 4 s took 11-12 s). A hedge on a model no
    worker consumes stands in for nothing: the call is hedged again on a served model, which
    replaces it."""
    from balancer.backlog.hedges import mark_hedged

    svc, on_b, on_a = long_calls_on_b_and_a(monkeypatch, "1")
    with svc.engine.begin() as conn:
        (admission,) = conn.execute(sa.select(tasks.c.admission_id).where(tasks.c.id == on_b)).scalars().all()
        assert mark_hedged(conn, on_b, admission, "hedge-on-c", "c", 10)
    worker_gone(svc, "w-b", "b")  # the host of b's and c's workers is cut off
    worker_gone(svc, "w-c", "c")
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    assert [(a.task_id, a.model) for a in sent if a.hedge and a.task_id == on_b] == [(on_b, "a")]
    with svc.engine.connect() as conn:
        row = conn.execute(sa.select(tasks.c.hedge_model, tasks.c.hedge_admission_id, tasks.c.hedges)
                           .where(tasks.c.id == on_b)).one()
    assert row.hedge_model == "a" and row.hedge_admission_id != "hedge-on-c" and row.hedges == 2


def test_a_call_whose_row_a_cut_worker_holds_locked_stalls_no_dispatch_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real-hosts test: a worker host cut mid-write (its heartbeat's COMMIT never sent) held
    its running rows locked, and the dispatcher's hedge of the orphan's call waited on its row
    until the cut healed, 13 s with free slots and a backlog. Now the round skips that row and
    the backlog goes out; the call is hedged in a round after the lock is gone."""
    from tests.backlog.test_locked_rows import WAIT_S, locked_by_a_cut_worker, within

    svc, orphan, _ = long_calls_on_b_and_a(monkeypatch, "1")
    worker_gone(svc, "w-b", "b")  # b's worker is gone, mid-write
    backlog = submit(svc, None, 5)  # a and c have seven free slots: two are left for hedges
    sent: list[Assignment] = []
    with locked_by_a_cut_worker(svc.engine, orphan):
        within(WAIT_S, lambda: dispatch(svc, sent.extend))
    assert orphan not in {a.task_id for a in sent} and {a.task_id for a in sent if not a.hedge} == set(backlog)
    sent.clear()
    workers_beating_for_a_while(svc)  # a and c's workers beat on (a loaded CI run took over 2 s to get here:
    dispatch(svc, sent.extend)        # with no worker heard for SILENCE_MS, no record is believed, b's included)
    assert [a.task_id for a in sent if a.hedge] == [orphan]


def test_a_hedge_of_an_orphans_call_spends_none_of_the_budget_a_straggler_needs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40's cut at the issue's size: the cut host's calls were hedged whatever the budget, but
    their hedges' tokens were counted against it, so the batch's slowest call on a served model
    (12 s, against a median of 2 s) went unhedged and the batch waited for it. The budget here pays
    for one hedge, of two equal tasks' tokens: the orphan's hedge and the straggler's are both sent."""
    from balancer.backlog.hedges import hedge_spending

    svc, orphan, straggler = long_calls_on_b_and_a(monkeypatch, "0.5")
    worker_gone(svc, "w-b", "b")  # b's worker is gone
    sent: list[Assignment] = []
    for _ in range(3):
        dispatch(svc, sent.extend)
    assert sorted(a.task_id for a in sent if a.hedge) == sorted([orphan, straggler])
    with svc.engine.connect() as conn:
        spent, run_tokens = hedge_spending(conn)
    (estimated,) = {a.estimated_tokens for a in sent}
    assert spent == estimated and run_tokens == 2 * estimated  # the straggler's hedge alone


@pytest.mark.e2e
@contextlib.contextmanager
def a_worker_per_model(tmp_path: Path) -> Iterator[Any]:
    """A pipeline of two models with a worker process each, consumer records required, once
    both workers' records are written."""
    from tests.pipeline_harness import Pipeline

    pipeline = Pipeline(tmp_path / "logs", model_count=2, extra_env={"BALANCER_CONSUMERS_REQUIRED": "on"})
    try:
        pipeline.start(workers=[["--model", "model-0"], ["--model", "model-1"]])
        svc = pipeline.services
        wait_until(lambda: all(m.consumers == 1 for m in svc.core.live().values()), 60, "both workers' records")
        yield pipeline
    finally:
        pipeline.stop()


def test_a_stopped_worker_s_model_gets_no_work_and_resumes_when_it_returns(tmp_path: Path) -> None:
    """Issue 40 finding 1, with real processes: two workers, one per model. One is frozen
    (SIGSTOP: its host cut off, as far as Redis can tell). Its record expires within seconds:
    the tasks queued for it meanwhile go back to pending, nothing more is admitted to it, the
    overview (status, top, the console, metrics) says no worker consumes its queue, and work
    that may go elsewhere does. Thawed, its model resumes within seconds, each task called once."""
    from balancer.admission.liveness import BEAT_MS, TTL_MS
    from balancer.views.overview import read_overview

    with a_worker_per_model(tmp_path) as pipeline:
        svc = pipeline.services
        frozen = next(c for c in pipeline.supervisor.children if c.name == "worker-1")
        os.killpg(frozen.process.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        pinned = submit(svc, "model-1", 4)
        wait_until(lambda: any(s == "queued" for s, _ in statuses(svc, pinned)), 5, "tasks queued for model-1")
        wait_until(lambda: all(s == "pending" for s, _ in statuses(svc, pinned)), TTL_MS / 1000 + 5,
                   "model-1's queued tasks back to pending")
        returned_after = time.monotonic() - stopped_at
        overview = read_overview(svc)
        assert [r.kind for r in overview.health.models["model-1"]] == ["no_consumer"]
        assert overview.health.models["model-0"] == []
        anywhere = submit(svc, None, 6)
        pipeline.wait_done(6)
        assert {m for _, m in statuses(svc, anywhere)} == {"model-0"}
        assert all(s == "pending" for s, _ in statuses(svc, pinned))  # nothing admitted to model-1 meanwhile
        os.killpg(frozen.process.pid, signal.SIGCONT)
        thawed = time.monotonic()
        pipeline.wait_done(10, timeout=30)
        resumed_after = time.monotonic() - thawed
        calls = [e for e in pipeline.sim_log() if e["model"] == "model-1"]
        assert len(calls) == 4, calls  # each pinned task called once: the stale messages made no call
        print(f"\nqueued tasks back {returned_after:.1f} s after the freeze; model-1 done {resumed_after:.1f} s "
              f"after the thaw (beat {BEAT_MS / 1000:g} s, record {TTL_MS / 1000:g} s)")
        assert resumed_after < 15


def test_a_worker_stopped_by_sigterm_removes_its_records_as_it_exits(tmp_path: Path) -> None:
    """A worker that is shut down (SIGTERM, a deploy) says so: its consumer records are gone
    when it has exited, not a record's life later, so its model gets no work meanwhile. Renewed
    every second for three, a record left behind would still be there at the exit."""
    with a_worker_per_model(tmp_path) as pipeline:
        leaving = next(c for c in pipeline.supervisor.children if c.name == "worker-1")
        signalled = time.monotonic()
        pipeline.supervisor.kill(leaving, signal.SIGTERM)
        leaving.process.wait(timeout=60)
        exited_after = time.monotonic() - signalled
        live = pipeline.services.core.live()
        assert live["model-1"].consumers == 0, f"a record outlived its worker (exit {exited_after:.1f} s after SIGTERM)"
        assert live["model-0"].consumers == 1
