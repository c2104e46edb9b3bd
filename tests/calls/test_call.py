"""A call's life from start to durable write: its heartbeat registration, a hedged
task's deadline, bounded waits on the answer writer, and a lease lost during a
stalled start. Real simulator over HTTP (in a thread), real Redis and PostgreSQL."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

import pytest
import redis

from balancer.admission import keys
from balancer.admission.values import Admitted, Candidate
from balancer.backends import make_backend
from balancer.backlog.claims import mark_queued
from balancer.backlog.hedges import mark_hedged
from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import parse_tasks
from balancer.backlog.leases import return_expired, sweep_expired
from balancer.backlog.transitions import mark_solved_many, start_solve
from balancer.calls import answers
from balancer.calls import call as call_module
from balancer.calls import heartbeat as heartbeat_module
from balancer.calls.answers import AnswerWriter, WriterDied
from balancer.calls.heartbeat import Heartbeat, live_calls, redis_now_ms
from balancer.calls.solver import SolveMessage
from balancer.dispatch.dispatcher import Assignment
from balancer.services import Services
from balancer.settings import Settings
from tests.calls.test_solver import MODEL, dispatch_one, faults, message, sim, svc, task_row  # noqa: F401 - fixtures
from tests.solving import chain, stall_start

pytestmark = pytest.mark.usefixtures("migrated")


def with_settings(svc: Services, monkeypatch: pytest.MonkeyPatch, **env: str) -> Services:  # noqa: F811
    """``svc`` with some settings changed (the same clients; the core admits with the new lease)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings.from_env()
    return dataclasses.replace(svc, settings=settings, core=svc.core.with_lease(settings.lease_seconds * 1000))


def in_thread(run: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``run`` in a thread; its result (or exception) lands in the list."""
    out: list[object] = []

    def target() -> None:
        try:
            out.append(run())
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stock_next(svc: Services, prompt: str) -> tuple[int, str]:  # noqa: F811
    """One task on m's ready list, ``queued`` under its ready id: (task id, admission id)."""
    rows, _ = parse_tasks(json.dumps({"prompt": prompt, "model": "m"}), models={"m": MODEL.quota().burst})
    with svc.engine.begin() as conn:
        (task_id,) = insert_tasks(conn, rows)
        mark_queued(conn, [(task_id, "m", f"r{task_id}")], 60)
    assert svc.core.stock([("m", task_id, rows[0].estimated_tokens, f"r{task_id}")], 60_000) == [True]
    return task_id, f"r{task_id}"


def test_a_first_call_failing_while_its_hedge_runs_leaves_the_task_to_the_hedge(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    """R2. The first call (on m) fails with a 500 while the task's hedge (on n) is
    on the wire for two leases. The failure changes nothing (the hedge decides)
    and says so; the hedge's heartbeat keeps the task's deadline, so the sweep
    never returns it; the hedge's answer is written."""
    short = with_settings(svc, monkeypatch, BALANCER_LEASE_SECONDS="2", BALANCER_BACKEND_TIMEOUT="8")
    url, simulator = sim
    faults(url, status={"m": 500}, hang={"m": 0.5, "n": 4.0})  # m fails after 0.5 s; n answers after 4 s
    caplog.set_level(logging.INFO, logger="balancer.calls.call")
    a = dispatch_one(short, {"prompt": "hedged", "model": "m", "max_tokens": 50})
    heartbeat, writer = Heartbeat(short), AnswerWriter(short.engine)
    backend = make_backend(short.settings)
    try:
        first, first_out = in_thread(lambda: chain(short, backend, message(a), heartbeat=heartbeat, writer=writer))
        wait_for(lambda: task_row(short, a.task_id).status == "running", what="the first call's start")
        hedge = short.core.admit([Candidate(a.estimated_tokens, allowed=("n",))])[0]
        assert isinstance(hedge, Admitted)
        with short.engine.begin() as conn:
            assert mark_hedged(conn, a.task_id, a.admission_id, hedge.admission_id, "n", a.estimated_tokens)
        hedge_msg = SolveMessage(a.task_id, hedge.admission_id, "n", a.estimated_tokens, hedge=True)
        second, second_out = in_thread(lambda: chain(short, backend, hedge_msg, heartbeat=heartbeat, writer=writer))
        first.join(10)
        assert first_out == [["left_to_hedge"]]
        row = task_row(short, a.task_id)
        assert (row.status, row.admission_id, row.hedge_admission_id) == ("running", a.admission_id, hedge.admission_id)
        while second.is_alive():  # two leases with no first call: the sweep, as beat runs it
            assert return_expired(short.engine) == 0, "the sweep took the task from its live hedge"
            second.join(0.2)
        assert second_out == [["hedge_won"]]
    finally:
        writer.close()
        heartbeat.close()
    row = task_row(short, a.task_id)
    assert row.status == "solved" and row.model == "n" and row.answer.startswith("[n]")
    assert [(e["model"], e["status"]) for e in simulator.log] == [("m", 500), ("n", 200)]
    assert f"task {a.task_id}: its call on m ended (retry: 500" in caplog.text
    assert "while its hedge is in flight" in caplog.text


def test_a_writer_that_dies_fails_the_chain_at_once(svc: Services, sim, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """R3. The writer's thread dies (here: a BaseException from its write). The chain
    waiting on it raises at once, not at the deadline or never, and the dead
    writer refuses new answers loudly."""
    def die(self, batch):  # noqa: ANN001, ANN202
        raise SystemExit("the writer thread is gone")

    monkeypatch.setattr(AnswerWriter, "_write", die)
    a = dispatch_one(svc, {"prompt": "p", "model": "m", "max_tokens": 20})
    writer = AnswerWriter(svc.engine)
    started = time.monotonic()
    thread, out = in_thread(lambda: chain(svc, make_backend(svc.settings), message(a), writer=writer))
    thread.join(10)
    assert not thread.is_alive(), "the chain hangs on a dead writer"
    assert isinstance(out[0], WriterDied) and time.monotonic() - started < 5
    assert not writer.alive
    with pytest.raises(WriterDied):
        writer.submit(answers.Answer(a.task_id, a.admission_id, "x", 1, 1), lambda w: "solved")


def test_a_write_that_hangs_past_the_deadline_returns_the_chain_and_keeps_the_task(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """R3, and R1's core. The answer's write hangs, and so does the heartbeat's
    deadline update (the worker's PostgreSQL connections are stalled). The
    chain returns at its solve's deadline, ``unwritten``, instead of never;
    the call stays registered with the heartbeat, which keeps it in Redis's
    live-call set, so the sweep keeps its task past its deadline instead of
    returning it, until the write lands; then the call lets go."""
    # The solve's deadline is 1 + 3 = 4 s; the call is let go one write grace later, at 7 s.
    quick = with_settings(svc, monkeypatch, BALANCER_BACKEND_TIMEOUT="1", BALANCER_WRITE_GRACE="3",
                          BALANCER_LEASE_SECONDS="2")
    stalled, writing = threading.Event(), threading.Event()

    def hung(engine, batch, usage=()):  # noqa: ANN001, ANN202
        writing.set()
        stalled.wait(30)
        return mark_solved_many(engine, batch, usage)

    monkeypatch.setattr(answers, "mark_solved_many", hung)
    monkeypatch.setattr(heartbeat_module, "extend_deadlines", lambda engine, ids, lease: stalled.wait(30) and 0)
    a = dispatch_one(quick, {"prompt": "p", "model": "m", "max_tokens": 20})
    heartbeat, writer = Heartbeat(quick), AnswerWriter(quick.engine)
    try:
        started = time.monotonic()
        thread, out = in_thread(lambda: chain(quick, make_backend(quick.settings), message(a), heartbeat=heartbeat,
                                              writer=writer))
        thread.join(10)
        assert not thread.is_alive(), "the chain waits for ever on a hung write"
        assert out == [["unwritten"]] and time.monotonic() - started < quick.settings.hard_time_limit + 2
        assert writing.is_set() and heartbeat.holds(a.admission_id)
        kept = 0
        until = time.monotonic() + 2  # the task's deadline (2 s after its start) passed, and nothing renews it
        while time.monotonic() < until:
            returned, now_kept = sweep_expired(quick.engine, live_calls(quick.redis, quick.settings.namespace), 2)
            assert returned == 0, "the sweep took the task of a call whose answer is waiting to be written"
            kept += now_kept
            time.sleep(0.2)
        assert kept >= 1  # its deadline did pass: the live-call set kept it
        stalled.set()
        wait_for(lambda: not heartbeat.holds(a.admission_id), what="the call to let go once written")
    finally:
        stalled.set()
        writer.close()
        heartbeat.close()
    assert task_row(quick, a.task_id).status == "solved"


def test_a_next_call_whose_lease_was_lost_during_a_stalled_start_is_not_called(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """Issue 26's finding: a finishing call takes its next task from the ready list,
    then blocks writing that task's start (PostgreSQL away) while the lease is
    lost (here: Redis drops it and the dispatcher fills the slot). When the start
    returns, the call re-asserts the lease, finds it gone, and does not call:
    the task goes back to pending with no attempt used."""
    short = with_settings(svc, monkeypatch, BALANCER_LEASE_SECONDS="3")
    url, simulator = sim
    first = dispatch_one(short, {"prompt": "first", "model": "m"})
    other, other_lid = stock_next(short, "next")
    refilled: list[str] = []

    def stall() -> None:
        short.core.release(other_lid)  # the lease is gone...
        again = short.core.admit([Candidate(1, allowed=("m",))])[0]  # ...and its slot is another call's
        assert isinstance(again, Admitted)
        refilled.append(again.admission_id)
        time.sleep(short.settings.heartbeat_seconds + 0.2)  # longer than a quick start

    stall_start(monkeypatch, other, stall)
    assert chain(short, make_backend(short.settings), message(first), may_continue=lambda: True) == ["solved", "lease_lost"]
    assert [e["status"] for e in simulator.log] == [200]  # the next task was never called
    row = task_row(short, other)
    assert row.status == "pending" and row.attempts == 0 and "lease expired" in row.error
    assert short.core.live()["m"].in_flight == 1  # only the call that took the slot over
    short.core.release(refilled[0])


def test_a_next_call_whose_cap_was_lowered_during_a_stalled_start_is_not_called(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """The chaos run's over-cap calls (seed 2026): a finishing call takes its next
    task from the ready list, its start blocks (the workers' PostgreSQL stalled)
    while ``quota set`` lowers the model's cap to 1 with another call running.
    When the start returns, the next call would be a new call above the new cap:
    it is not called, and its task goes back to pending with no attempt used.
    Before, its lease was only extended and the call started (two in flight, cap 1)."""
    url, simulator = sim
    first = dispatch_one(svc, {"prompt": "first", "model": "m"})
    other, _ = stock_next(svc, "next")
    running: list[str] = []

    def stall() -> None:
        again = svc.core.admit([Candidate(1, allowed=("m",))])[0]  # another call holds a slot...
        assert isinstance(again, Admitted) and isinstance(svc.core.renew(again.admission_id, "m", 1), Admitted)
        running.append(again.admission_id)
        svc.core.set_quota(dataclasses.replace(MODEL.quota(), max_concurrent_requests=1))  # ...and the cap drops
        time.sleep(call_module.LATE_START_S + 0.2)  # a late start

    stall_start(monkeypatch, other, stall)
    assert chain(svc, make_backend(svc.settings), message(first), may_continue=lambda: True) == ["solved", "lease_lost"]
    assert [e["status"] for e in simulator.log] == [200]  # the next task was never called
    row = task_row(svc, other)
    assert row.status == "pending" and row.attempts == 0 and "cap was lowered" in row.error
    assert svc.core.live()["m"].in_flight == 1  # only the running call
    svc.core.release(running[0])


def test_the_heartbeat_keeps_a_next_calls_slot_through_a_stalled_start(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """The next call is registered when it is taken, before its start is written:
    a start that blocks for one and a half leases keeps its slot (renewed by
    the heartbeat, so the dispatcher cannot fill it), and the call then goes ahead."""
    short = with_settings(svc, monkeypatch, BALANCER_LEASE_SECONDS="3")
    url, simulator = sim
    first = dispatch_one(short, {"prompt": "first", "model": "m"})
    other, lid = stock_next(short, "next")
    left_ms: list[float] = []  # the next call's lease: time left, on Redis's clock

    def stall() -> None:
        until = time.monotonic() + 4.5  # one and a half leases
        while time.monotonic() < until:
            expires = short.redis.zscore(keys.inflight(short.settings.namespace, "m"), lid)
            left_ms.append(-1.0 if expires is None else expires - redis_now_ms(short.redis))
            time.sleep(0.25)

    stall_start(monkeypatch, other, stall)
    assert chain(short, make_backend(short.settings), message(first), may_continue=lambda: True) == ["solved", "solved"]
    assert len(left_ms) > 10 and min(left_ms) > 0  # the next call's lease never ran out
    assert [e["status"] for e in simulator.log] == [200, 200]
    assert task_row(short, other).status == "solved" and short.core.live()["m"].in_flight == 0


def test_a_redis_error_freeing_an_answered_slot_still_writes_the_answer(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    """Issue 26, 1. The call answers; freeing its slot (and taking the next call)
    raises a Redis ConnectionError, and so does every ask for a dispatch. The paid
    answer is still written (once, one backend call), the chain returns its
    outcome, and no next call is taken; the finish is kept for when Redis answers (issue 40 item 3)."""
    import redis

    from balancer.admission.core import AdmissionCore

    def lost(self, admission_id, settlement):  # noqa: ANN001, ANN202
        raise redis.ConnectionError("Connection closed by server.")

    def no_dispatch() -> None:
        raise redis.ConnectionError("Connection closed by server.")

    url, simulator = sim
    a = dispatch_one(svc, {"prompt": "paid once", "model": "m", "max_tokens": 20})
    monkeypatch.setattr(AdmissionCore, "finish_and_take", lost)
    caplog.set_level(logging.WARNING)
    outcomes = chain(svc, make_backend(svc.settings), message(a), may_continue=lambda: True,
                     ask_for_dispatch=no_dispatch)
    assert outcomes == ["solved"]
    row = task_row(svc, a.task_id)
    assert row.status == "solved" and row.answer.startswith("[m]")
    assert [e["status"] for e in simulator.log] == [200]
    assert "its finish is kept and applied when Redis answers" in caplog.text
    assert "could not ask for a dispatch" in caplog.text


def test_the_heartbeat_extends_task_deadlines_while_redis_is_unreachable(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """Issue 26, 2. The heartbeat's Redis is unreachable (a port that refuses
    connections) for three leases while a call runs. Every Redis renewal fails,
    yet each pass still extends the task's deadline in PostgreSQL: the sweep
    never returns the task, so no second call can start on it."""
    import socket

    import redis

    from balancer.admission.core import AdmissionCore

    short = with_settings(svc, monkeypatch, BALANCER_LEASE_SECONDS="2")
    a = dispatch_one(short, {"prompt": "long call", "model": "m", "max_tokens": 20})
    assert start_solve(short.engine, a.task_id, a.admission_id, short.settings.lease_seconds) is not None
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, socket_timeout=1)
    cut_off = dataclasses.replace(short, redis=dead, core=AdmissionCore(
        dead, short.settings.namespace, lease_ms=short.settings.lease_seconds * 1000))
    heartbeat = Heartbeat(cut_off)
    try:
        heartbeat.register(a.admission_id, until=time.monotonic() + 60)
        heartbeat.started(a.admission_id)
        until = time.monotonic() + 3 * short.settings.lease_seconds
        while time.monotonic() < until:
            assert return_expired(short.engine) == 0, "the sweep took the task from its live call"
            time.sleep(0.2)
    finally:
        heartbeat.close()
    row = task_row(short, a.task_id)
    assert (row.status, row.admission_id) == ("running", a.admission_id)
    short.core.finish(a.admission_id)


def test_a_late_start_that_cannot_reach_redis_is_not_called_and_its_task_is_let_go(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """A CI chaos run (seed 1199918074): Redis was killed while a next call's start
    waited. Its lease re-check raised, freeing the slot in the solve's ``finally``
    raised again, and the call was never let go by the heartbeat: its task stayed
    ``running``, kept alive, for 230 s. Now the call is not made, its task goes back
    to pending at once, and the heartbeat lets it go."""
    url, simulator = sim
    first = dispatch_one(svc, {"prompt": "first", "model": "m"})
    other, next_id = stock_next(svc, "next")
    real_heartbeat, real_finish = svc.core.heartbeat, svc.core.finish
    down = threading.Event()

    def redis_down(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise redis.ConnectionError("Error 111 connecting to Redis. Connection refused.")

    def stall() -> None:
        time.sleep(call_module.LATE_START_S + 0.2)  # a late start, during which Redis goes down
        down.set()

    stall_start(monkeypatch, other, stall)
    monkeypatch.setattr(svc.core, "heartbeat", lambda *a, **k: redis_down() if down.is_set() else real_heartbeat(*a, **k))
    monkeypatch.setattr(svc.core, "finish", lambda *a, **k: redis_down() if down.is_set() else real_finish(*a, **k))
    heartbeat = Heartbeat(svc)
    try:
        outcomes = chain(svc, make_backend(svc.settings), message(first), may_continue=lambda: True,
                         heartbeat=heartbeat)
    finally:
        heartbeat.close()
    assert outcomes == ["solved", "lease_lost"]
    assert [e["status"] for e in simulator.log] == [200]  # the next task was never called
    row = task_row(svc, other)
    assert row.status == "pending" and row.attempts == 0 and "Redis could not say" in row.error
    assert not heartbeat.holds(next_id)  # let go: nothing keeps its task alive


def hedged_task(svc: Services) -> tuple[Assignment, SolveMessage]:  # noqa: F811
    """A task running on m (its call stalled: nothing renews its deadline, already past)
    with a hedge admitted on n and recorded; (the first call's assignment, the hedge's message)."""
    import sqlalchemy as sa

    from balancer.storage.schema import tasks

    a = dispatch_one(svc, {"prompt": "hedged", "model": "m", "max_tokens": 20})
    assert start_solve(svc.engine, a.task_id, a.admission_id, 60) is not None
    hedge = svc.core.admit([Candidate(a.estimated_tokens, allowed=("n",))])[0]
    assert isinstance(hedge, Admitted)
    with svc.engine.begin() as conn:
        assert mark_hedged(conn, a.task_id, a.admission_id, hedge.admission_id, "n", a.estimated_tokens)
        conn.execute(sa.update(tasks).where(tasks.c.id == a.task_id).values(deadline=sa.func.now() - sa.text(
            "interval '1 second'")))
    return a, SolveMessage(a.task_id, hedge.admission_id, "n", a.estimated_tokens, hedge=True)


def test_a_hedge_keeps_its_task_from_the_sweep_from_its_start(svc: Services, sim) -> None:  # noqa: F811
    """Issue 40 finding 4: a hedge joined the live-call set only at its worker's next heartbeat
    (a third of a lease later), and did not move its task's deadline; a sweep in between returned
    the task to pending and it was dispatched again while the hedge ran. Now the hedge's start
    moves the task's deadline a lease on and puts the hedge in the live-call set at once."""
    url, simulator = sim
    faults(url, hang={"n": 1.5})
    a, hedge_msg = hedged_task(svc)
    heartbeat, writer = Heartbeat(svc), AnswerWriter(svc.engine)  # a 60 s lease: its first beat is 20 s away
    try:
        thread, out = in_thread(lambda: chain(svc, make_backend(svc.settings), hedge_msg, heartbeat=heartbeat,
                                              writer=writer))
        wait_for(lambda: any(e["model"] == "n" for e in simulator.log) or bool(out), what="the hedge's call")
        assert hedge_msg.admission_id in live_calls(svc.redis, svc.settings.namespace)
        assert sweep_expired(svc.engine, (), 60) == (0, 0), "the sweep took the task of a starting hedge"
        thread.join(10)
        assert out == [["hedge_won"]]
    finally:
        writer.close()
        heartbeat.close()
    assert task_row(svc, a.task_id).status == "solved"


def test_a_hedge_that_wins_while_redis_is_away_still_ends_its_solve(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    """Issue 40's failover at the issue's size: a hedge's answer was written, then cutting off the
    task's other call (a Redis publish) failed with the master gone, and the error went up through
    the write's outcome: the Celery task raised ("raised unexpected: network:ConnectionError").
    Now the answer's solve ends as a win, and says that the other call runs to its end."""
    import redis

    from balancer.calls import call as call_module

    def unreachable(*args: object) -> int:
        raise redis.ConnectionError("Error 111 connecting to 10.213.87.11:6379. Connection refused.")

    monkeypatch.setattr(call_module, "cancel_call", unreachable)
    caplog.set_level(logging.WARNING, logger="balancer.calls.call")
    a, hedge_msg = hedged_task(svc)
    heartbeat, writer = Heartbeat(svc), AnswerWriter(svc.engine)
    try:
        assert chain(svc, make_backend(svc.settings), hedge_msg, heartbeat=heartbeat, writer=writer) == ["hedge_won"]
    finally:
        writer.close()
        heartbeat.close()
    assert task_row(svc, a.task_id).status == "solved"
    assert f"task {a.task_id}: answered; its other call could not be cut off (Error 111" in caplog.text


def test_a_hedge_answered_during_its_start_gate_does_not_call(svc: Services, sim,  # noqa: F811
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40 finding 5: a hedge that waited at its model's start gate called even though its
    task's first call had answered meanwhile (its answer written). Now it checks its task after
    the gate, frees its slot and does not call."""
    from balancer.backlog.transitions import Answer

    url, simulator = sim
    a, hedge_msg = hedged_task(svc)
    renew = svc.core.renew

    def gated(admission_id: str, model: str, estimated_tokens: int, lease_ms: int | None = None):  # noqa: ANN202
        decision = renew(admission_id, model, estimated_tokens, lease_ms)
        assert isinstance(decision, Admitted)
        # The first call's answer is written while the hedge waits at its gate.
        assert mark_solved_many(svc.engine, [Answer(a.task_id, a.admission_id, "first", 5, 5)]) != [None]
        return dataclasses.replace(decision, start_delay_ms=300)

    monkeypatch.setattr(svc.core, "renew", gated)
    assert chain(svc, make_backend(svc.settings), hedge_msg) == ["stale"]
    assert [e["model"] for e in simulator.log] == []
    assert svc.core.live()["n"].in_flight == 0
    row = task_row(svc, a.task_id)
    assert (row.status, row.answer) == ("solved", "first")


@pytest.mark.parametrize("hedge", [None, "running", "answered", "answered before the call listened"])
def test_a_first_call_is_cancelled_at_its_start_gate(svc: Services, sim,  # noqa: F811
                                                     monkeypatch: pytest.MonkeyPatch, hedge: str | None) -> None:
    """A first call waits at its model's start gate (the provider paces starts); meanwhile its
    task's hedge on another model may answer. The call used to start anyway, charged by the
    provider for an answer nobody reads. Now it waits on the cancel channel, which the hedge's
    written answer publishes to: cancelled, its wait ends there, its slot is freed and it does not
    call, as a hedge does. A cancel sent before the call listened (one publish, heard by nobody)
    is found in the key it leaves. With no hedge, or a hedge in flight that has not answered,
    the task is still the call's: it calls after the whole gate, and its answer is written."""
    from balancer.admission.keys import cancel_channel
    from balancer.backlog.transitions import Answer, mark_solved
    from balancer.calls.cancellation import CancelListener, cancel_call

    url, simulator = sim
    a = dispatch_one(svc, {"prompt": f"gated first call, hedge {hedge}", "model": "m", "max_tokens": 20})
    renew = svc.core.renew
    answered = hedge is not None and hedge.startswith("answered")
    gate_ms = 12_000 if answered else 300  # the cancel must end the wait, not the gate

    def gated(admission_id: str, model: str, estimated_tokens: int, lease_ms: int | None = None):  # noqa: ANN202
        decision = renew(admission_id, model, estimated_tokens, lease_ms)
        assert isinstance(decision, Admitted)
        if hedge is not None:
            other = svc.core.admit([Candidate(a.estimated_tokens, allowed=("n",))])[0]
            assert isinstance(other, Admitted)
            with svc.engine.begin() as conn:  # the task is running (its start is written before the renewal)
                assert mark_hedged(conn, a.task_id, a.admission_id, other.admission_id, "n", a.estimated_tokens)
            if answered:
                assert mark_solved(svc.engine, Answer(a.task_id, other.admission_id, "the hedge's", 5, 5, "n")) is not None
            if hedge == "answered before the call listened":  # as Call._won does, once
                cancel_call(svc.redis, svc.settings.namespace, a.admission_id)
        return dataclasses.replace(decision, start_delay_ms=gate_ms)

    monkeypatch.setattr(svc.core, "renew", gated)
    listener = CancelListener(svc.redis, svc.settings.namespace)
    began = time.monotonic()
    thread, out = in_thread(lambda: chain(svc, make_backend(svc.settings), message(a), listener))
    try:
        if hedge == "answered":  # on the channel alone (no key left behind), until the waiting call hears it
            wait_for(lambda: svc.redis.publish(cancel_channel(svc.settings.namespace), a.admission_id) >= 0
                     and bool(out), what="the cancelled call's end")
        thread.join(gate_ms / 1000 + 10)
        waited = time.monotonic() - began
    finally:
        listener.close()
    assert out == [["stale" if answered else "solved"]]
    assert [e["model"] for e in simulator.log] == ([] if answered else ["m"])  # the provider saw the call, or none
    assert (waited < gate_ms / 1000) if answered else (waited >= gate_ms / 1000)
    assert svc.core.live()["m"].in_flight == 0
    row = task_row(svc, a.task_id)
    assert row.status == "solved" and (row.answer == "the hedge's") == answered


def test_a_copy_of_a_running_call_taken_by_the_same_worker_keeps_the_call_alive(svc: Services, sim) -> None:  # noqa: F811
    """Issue 40's overlapping calls after every Redis client connection is dropped. kombu puts a
    worker's unacknowledged messages back in their queue the moment its broker connection drops,
    and the same worker (one process serves a model) takes the copy while the first call still
    runs. The copy makes no call (``running_elsewhere``), but it was registered with the heartbeat
    under the same admission id as the first call: its registration replaced the call's, and its
    end released it. The call then left the live-call set and its task's deadline was no longer
    extended, so a lease later the sweep returned a task whose call was still running or whose
    answer was still to be written, and it was called again. Each call now has a registration of
    its own: the copy's end leaves the running call's alone."""
    url, simulator = sim
    faults(url, hang={"m": 1.5})
    a = dispatch_one(svc, {"prompt": "first and copy", "model": "m", "max_tokens": 20})
    backend = make_backend(svc.settings)
    heartbeat, writer = Heartbeat(svc), AnswerWriter(svc.engine)
    try:
        thread, out = in_thread(lambda: chain(svc, backend, message(a), heartbeat=heartbeat, writer=writer))
        wait_for(lambda: task_row(svc, a.task_id).status == "running" or bool(out), what="the first call's start")
        assert chain(svc, backend, message(a), heartbeat=heartbeat, writer=writer) == ["running_elsewhere"]
        assert heartbeat.holds(a.admission_id), "the copy's end let go of the running call"
        heartbeat.beat()
        assert a.admission_id in live_calls(svc.redis, svc.settings.namespace)
        thread.join(10)
        assert out == [["solved"]]
    finally:
        writer.close()
        heartbeat.close()
    assert [e["status"] for e in simulator.log] == [200]
    assert task_row(svc, a.task_id).status == "solved"
