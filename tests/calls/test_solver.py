"""One solve at a time, against the real simulator over HTTP (in a thread), real Redis and PostgreSQL."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from balancer.admission.values import Admitted, Candidate, Settlement
from balancer.backends import make_backend
from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import parse_tasks
from balancer.calls import answers, solver
from balancer.calls import call as call_module
from balancer.calls.answers import AnswerWriter
from balancer.calls.solver import MAX_RATE_LIMITED, SolveMessage
from balancer.devtools.embedded import free_port
from balancer.devtools.sim.config import Latency, SimModel
from balancer.devtools.sim.provider import Simulator
from balancer.devtools.sim.server import create_app
from balancer.dispatch.dispatcher import Assignment, dispatch
from balancer.services import Services
from balancer.settings import Settings
from tests.servers import served
from tests.solving import chain, solve

pytestmark = pytest.mark.usefixtures("migrated")

MODEL = SimModel("m", 4, 600_000, latency=Latency(0.01, 0.02, 0.0, 0.05))


@pytest.fixture
def sim() -> Iterator[tuple[str, Simulator]]:
    simulator = Simulator([MODEL, SimModel("n", 4, 600_000, latency=MODEL.latency)], time_scale=1.0)
    with served(create_app(simulator)) as url:
        yield url, simulator


@pytest.fixture
def svc(sim, monkeypatch: pytest.MonkeyPatch) -> Services:
    monkeypatch.setenv("BALANCER_BACKEND_URL", sim[0])
    monkeypatch.setenv("BALANCER_BACKEND_TIMEOUT", "2")
    monkeypatch.setenv("BALANCER_LEASE_SECONDS", "60")
    monkeypatch.setenv("BALANCER_MAX_ATTEMPTS", "3")
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([MODEL.quota(), SimModel("n", 4, 600_000).quota()])
    return services


def dispatch_one(svc: Services, line: dict) -> Assignment:
    """Insert one task and dispatch it, collecting the message instead of sending it."""
    rows, errors = parse_tasks(json.dumps(line), models={q.name: q.burst for q in svc.quotas.all()})
    assert not errors
    with svc.engine.begin() as conn:
        insert_tasks(conn, rows)
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    assert len(sent) == 1
    return sent[0]


def an_answer_in_between(svc: Services) -> None:
    """Another call on model m is answered (as its worker would report it): the
    next failure is the task's, not an outage's, so it counts (else m's circuit
    would open after three in a row)."""
    other = svc.core.admit([Candidate(1, allowed=("m",))])[0]
    assert isinstance(other, Admitted)
    svc.core.finish(other.admission_id, Settlement(used_tokens=1, reserved_tokens=1, latency_ms=10, completion_tokens=1))


def redispatch(svc: Services, task_id: int, *, clear_backoff: bool = False, timeout: float = 10.0) -> Assignment:
    """Dispatch a task that went back to pending, polling past a short 429 pause."""
    import sqlalchemy as sa

    from balancer.storage.schema import tasks

    if clear_backoff:
        with svc.engine.begin() as conn:
            conn.execute(sa.update(tasks).where(tasks.c.id == task_id).values(not_before=None))
    deadline = time.monotonic() + timeout
    while True:
        sent: list[Assignment] = []
        dispatch(svc, sent.extend)
        if sent:
            assert [s.task_id for s in sent] == [task_id]
            return sent[0]
        assert time.monotonic() < deadline, "the task was never dispatched again"


def stock_ready(svc: Services, prompts: list[str], *, mark: bool = True) -> list[int]:
    """New tasks for model "m" put on its ready list (admission ids ``r<task id>``) and, with
    ``mark``, marked ``ready`` in PostgreSQL as the dispatcher's stock does; their ids."""
    from balancer.backlog.ready import mark_ready

    rows, _ = parse_tasks("".join(json.dumps({"prompt": p, "model": "m"}) + "\n" for p in prompts),
                          models={"m": MODEL.quota().burst})
    with svc.engine.begin() as conn:
        ids = insert_tasks(conn, rows)
        if mark:
            mark_ready(conn, [(task_id, "m", f"r{task_id}") for task_id in ids], 60)
    svc.core.stock([("m", task_id, row.estimated_tokens, f"r{task_id}") for task_id, row in zip(ids, rows, strict=True)],
                   60_000)
    return ids


def message(a: Assignment) -> SolveMessage:
    return SolveMessage(a.task_id, a.admission_id, a.model, a.estimated_tokens)


def task_row(svc: Services, task_id: int):  # noqa: ANN201
    import sqlalchemy as sa

    from balancer.storage.schema import tasks

    with svc.engine.connect() as conn:
        return conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).one()


def faults(url: str, **table: dict) -> None:
    httpx.post(f"{url}/admin/faults", json=table, timeout=5).raise_for_status()


@pytest.mark.faults
def test_solved_once_then_duplicates_do_not_call_again(svc: Services, sim) -> None:
    url, simulator = sim
    a = dispatch_one(svc, {"prompt": "hello world", "model": "m", "max_tokens": 100})
    backend = make_backend(svc.settings)
    assert solve(svc, backend, message(a)) == "solved"
    row = task_row(svc, a.task_id)
    assert row.status == "solved" and row.answer and row.completion_tokens <= 100 and row.attempts == 1
    assert svc.core.live()["m"].in_flight == 0  # slot released
    live_tokens = svc.core.live()["m"].tokens_available
    # The same message again (redelivery, duplicate publish): no call, no second write, no double count.
    assert solve(svc, backend, message(a)) == "stale"
    assert len([e for e in simulator.log if e["status"] == 200]) == 1
    assert task_row(svc, a.task_id).answer == row.answer
    assert svc.core.live()["m"].tokens_available >= live_tokens - 1


@pytest.mark.faults
@pytest.mark.parametrize(
    "fault, expect_error",
    [
        ({"status": {"m": 500}}, "500"),
        ({"malformed": {"m": True}}, "malformed JSON"),
        ({"no_usage": {"m": True}}, "missing usage"),
    ],
)
def test_transient_failures_back_off_then_fail_after_max_attempts(
    svc: Services, sim, fault: dict, expect_error: str, reliability
) -> None:
    url, _ = sim
    faults(url, **fault)
    a = dispatch_one(svc, {"prompt": "boom", "model": "m"})
    backend = make_backend(svc.settings)
    assert solve(svc, backend, message(a)) == "retry"
    row = task_row(svc, a.task_id)
    assert row.status == "pending" and expect_error in row.error and row.not_before is not None
    assert svc.core.live()["m"].in_flight == 0
    import sqlalchemy as sa

    from balancer.storage.schema import tasks

    for _attempt in (2, 3):
        an_answer_in_between(svc)
        with svc.engine.begin() as conn:  # skip the back-off wait
            conn.execute(sa.update(tasks).where(tasks.c.id == a.task_id).values(not_before=None))
        sent: list[Assignment] = []
        dispatch(svc, sent.extend)
        outcome = solve(svc, backend, message(sent[0]))
    assert outcome == "failed"
    row = task_row(svc, a.task_id)
    assert row.status == "failed" and row.attempts == 3 and expect_error in row.error
    assert svc.core.live()["m"].in_flight == 0
    reliability({
        "fault": f"backend: {expect_error}", "injected": f"simulator fault {fault}",
        "tasks": 1, "lost": 0, "double_written": 0, "repeated_calls": "2 (retries)",
        "bound": "max_attempts - 1, with back-off, while other calls on the model succeed; "
                 "then `failed` with the error", "recovery_s": "-",
    })


@pytest.mark.faults
def test_connection_refused_and_timeout_are_transient(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch, reliability
) -> None:
    url, _ = sim
    a = dispatch_one(svc, {"prompt": "p", "model": "m"})
    # Both dispatched before a's retry: a dispatch after it took a again, with b, once a's back-off
    # had passed (on a loaded machine, before b's dispatch).
    b = dispatch_one(svc, {"prompt": "q", "model": "n"})
    refused = dataclasses.replace(Settings.from_env(), backend_url=f"http://127.0.0.1:{free_port()}")
    assert solve(svc, make_backend(refused), message(a)) == "retry"
    assert f"cannot reach backend at {refused.backend_url}/" in task_row(svc, a.task_id).error  # where it tried
    faults(url, hang={"n": 5.0})
    started = time.monotonic()
    assert solve(svc, make_backend(svc.settings), message(b)) == "retry"
    assert time.monotonic() - started < 4  # the 2 s client timeout, not the 5 s hang
    assert "timeout" in task_row(svc, b.task_id).error
    assert svc.core.live()["n"].in_flight == 0 and svc.core.live()["m"].in_flight == 0
    for fault in ("backend: connection refused", "backend: hangs past the call's time limit"):
        reliability({
            "fault": fault, "injected": "no server on the port" if "refused" in fault else "simulator hangs 5 s, timeout 2 s",
            "tasks": 1, "lost": 0, "double_written": 0, "repeated_calls": "retried with back-off",
            "bound": "max_attempts - 1; no slot held", "recovery_s": "-",
        })


@pytest.mark.faults
@pytest.mark.parametrize("retry_after", [3.0, None])
def test_429_goes_back_to_the_dispatcher_and_pauses_the_model(
    svc: Services, sim, retry_after: float | None, reliability
) -> None:
    url, _ = sim
    faults(url, status={"m": 429}, retry_after={"m": retry_after})
    a = dispatch_one(svc, {"prompt": "r", "models": ["m"], "max_tokens": 10})
    started = time.monotonic()
    assert solve(svc, make_backend(svc.settings), message(a)) == "rate_limited"
    row = task_row(svc, a.task_id)
    # A 429 is not the task's fault: it is counted apart and does not use up an attempt.
    assert row.status == "pending" and row.rate_limited == 1 and row.not_before is None and row.attempts == 0
    live = svc.core.live()["m"]
    elapsed_ms = (time.monotonic() - started) * 1000  # after the read: a slow read must not fail the bound
    pause_ms = (retry_after or 1.0) * 1000  # the model is held for Retry-After
    assert pause_ms - elapsed_ms - 50 <= live.paused_ms <= pause_ms
    assert live.in_flight == 0
    reliability({
        "fault": f"backend: 429 {'with' if retry_after else 'without'} Retry-After",
        "injected": "simulator answers 429 to every call",
        "tasks": 1, "lost": 0, "double_written": 0, "repeated_calls": "re-dispatched",
        "bound": "model paused for Retry-After (default 1 s); task `failed` after 50 429s", "recovery_s": "-",
    })


def test_a_task_is_failed_after_max_rate_limited_429s(svc: Services, sim) -> None:
    """The "failed after 50 429s" rule: the quotas are wrong, not the task."""
    url, _ = sim
    faults(url, status={"m": 429}, retry_after={"m": 0.001})
    a = dispatch_one(svc, {"prompt": "r", "models": ["m"], "max_tokens": 10})
    backend = make_backend(svc.settings)
    outcomes = [solve(svc, backend, message(a))]
    while outcomes[-1] == "rate_limited":
        outcomes.append(solve(svc, backend, message(redispatch(svc, a.task_id))))
    assert outcomes == ["rate_limited"] * (MAX_RATE_LIMITED - 1) + ["failed"]
    row = task_row(svc, a.task_id)
    assert row.status == "failed" and f"rate limited {MAX_RATE_LIMITED} times" in row.error and row.attempts == 0


def test_429s_do_not_use_up_attempts_for_5xx(svc: Services, sim) -> None:
    """A task that met 429s still gets all of its max_attempts for transient failures."""
    url, _ = sim
    faults(url, status={"m": 429}, retry_after={"m": 0.001})
    a = dispatch_one(svc, {"prompt": "r", "models": ["m"], "max_tokens": 10})
    backend = make_backend(svc.settings)
    assert solve(svc, backend, message(a)) == "rate_limited"
    for _ in range(3):
        assert solve(svc, backend, message(redispatch(svc, a.task_id))) == "rate_limited"
    faults(url, status={"m": 500})
    outcomes = []
    for _ in range(svc.settings.max_attempts):
        an_answer_in_between(svc)
        outcomes.append(solve(svc, backend, message(redispatch(svc, a.task_id, clear_backoff=True))))
    assert outcomes == ["retry"] * (svc.settings.max_attempts - 1) + ["failed"]
    row = task_row(svc, a.task_id)
    assert row.rate_limited == 4 and row.attempts == svc.settings.max_attempts


def test_disabled_model_does_not_start_admitted_call(svc: Services, sim) -> None:
    url, simulator = sim
    a = dispatch_one(svc, {"prompt": "late", "model": "m"})
    svc.quotas.set("m", {"enabled": False})
    assert solve(svc, make_backend(svc.settings), message(a)) == "no_room"
    row = task_row(svc, a.task_id)
    assert row.status == "pending" and row.attempts == 0
    assert simulator.log == []
    assert svc.core.live()["m"].in_flight == 0


def test_openai_compatible_backend(svc: Services, sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALANCER_BACKEND_KIND", "openai")
    settings = Settings.from_env()
    a = dispatch_one(svc, {"prompt": "chat please", "model": "n", "max_tokens": 50})
    assert solve(svc, make_backend(settings), message(a)) == "solved"
    row = task_row(svc, a.task_id)
    assert row.answer.startswith("[n]") and row.completion_tokens <= 50
    assert sim[1].log[-1]["endpoint"] == "openai"


@pytest.mark.faults
def test_api_key_never_appears_in_errors_or_logs(svc: Services, sim, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    canary = "sk-CANARY-7f3a9b"
    monkeypatch.setenv("BALANCER_BACKEND_API_KEY", canary)
    settings = Settings.from_env()
    assert canary not in repr(settings)
    caplog.set_level("DEBUG")
    faults(sim[0], status={"m": 500})
    a = dispatch_one(svc, {"prompt": "secret test", "model": "m"})
    assert solve(svc, make_backend(settings), message(a)) == "retry"
    refused = dataclasses.replace(settings, backend_url=f"http://127.0.0.1:{free_port()}")
    b = dispatch_one(svc, {"prompt": "secret test 2", "model": "n"})
    solve(svc, make_backend(refused), message(b))
    errors = [task_row(svc, a.task_id).error, task_row(svc, b.task_id).error]
    assert all(errors) and not any(canary in e for e in errors)
    assert canary not in caplog.text


def test_a_transient_failure_is_retried_on_another_allowed_model(svc: Services, sim) -> None:
    """Retry placement: the task failed on m with a 5xx, may use n, and n has room: it goes to n."""
    url, simulator = sim
    faults(url, status={"m": 500})
    a = dispatch_one(svc, {"prompt": "p", "models": ["m", "n"], "max_tokens": 10})
    if a.model != "m":  # make the first call land on m whichever way WDRR chose
        faults(url, status={a.model: 500})
    first = a.model
    assert solve(svc, make_backend(svc.settings), message(a)) == "retry"
    again = redispatch(svc, a.task_id, clear_backoff=True)
    assert again.model != first
    faults(url)
    assert solve(svc, make_backend(svc.settings), message(again)) == "solved"
    assert [(e["model"], e["status"]) for e in simulator.log] == [(first, 500), (again.model, 200)]


def test_a_solved_call_settles_as_its_model_counts(svc: Services, sim) -> None:
    """`reserve` (the default) keeps prompt + max_tokens spent; `settle` gives back the unused part."""
    for accounting in ("reserve", "settle"):
        svc.quotas.set("m", {"token_accounting": accounting, "max_tokens_per_minute": 60, "burst_tokens": 10_000})
        a = dispatch_one(svc, {"prompt": "x" * 400, "model": "m", "max_tokens": 1_000})
        before = svc.core.live()["m"].tokens_available
        assert solve(svc, make_backend(svc.settings), message(a)) == "solved"
        row = task_row(svc, a.task_id)
        credited = svc.core.live()["m"].tokens_available - before
        unused = a.estimated_tokens - (row.prompt_tokens + row.completion_tokens)
        assert unused > 100  # the simulator answers with 30-100 % of max_tokens
        if accounting == "reserve":
            assert credited < 5  # only the 1 token/s refill
        else:
            assert unused <= credited < unused + 5


class RoundTrips:
    """Counts every round trip the calling thread makes to Redis, and this engine to PostgreSQL.

    Redis: each packed write on a connection is one request/reply exchange (a
    pipeline is one; redis-py's SCRIPT EXISTS before a pipeline of scripts is
    another), from the thread that made the counter: the dispatch and the solve under
    test run there, and a thread another test left running (it shares the process
    under pytest-xdist) once added its own command to a round (4 == 3).
    PostgreSQL: each statement, psycopg2's BEGIN before the first one
    of a transaction, each COMMIT or ROLLBACK that has a transaction to end, and
    each pre-ping.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine) -> None:  # noqa: ANN001
        import threading

        import redis.connection
        import sqlalchemy as sa

        self.redis = self.sql = 0
        send = redis.connection.AbstractConnection.send_packed_command
        mine = threading.get_ident()

        def counted_send(conn, command, check_health=True):  # noqa: ANN001, ANN202
            if threading.get_ident() == mine:
                self.redis += 1
            return send(conn, command, check_health)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted_send)
        ping = engine.dialect.do_ping

        def counted_ping(dbapi_connection):  # noqa: ANN001, ANN202
            self.sql += 1
            return ping(dbapi_connection)

        monkeypatch.setattr(engine.dialect, "do_ping", counted_ping)
        sa.event.listen(engine, "before_cursor_execute", self._statement)
        sa.event.listen(engine, "commit", self._end)
        sa.event.listen(engine, "rollback", self._end)

    @staticmethod
    def _open(conn) -> tuple[bool, bool]:  # noqa: ANN001
        """(autocommit, a transaction is open) on the DBAPI connection under ``conn``."""
        import psycopg2.extensions

        dbapi = conn.connection.dbapi_connection
        return dbapi.autocommit, dbapi.info.transaction_status != psycopg2.extensions.TRANSACTION_STATUS_IDLE

    def _statement(self, conn, *_: object) -> None:  # noqa: ANN001
        # psycopg2 sends its own BEGIN, one exchange more, before the first
        # statement of a transaction (not in autocommit).
        autocommit, in_transaction = self._open(conn)
        self.sql += 1 if autocommit or in_transaction else 2

    def _end(self, conn) -> None:  # noqa: ANN001
        # A COMMIT or ROLLBACK with no transaction open (autocommit, or nothing
        # executed) sends nothing.
        autocommit, in_transaction = self._open(conn)
        self.sql += 1 if in_transaction and not autocommit else 0

    def reset(self) -> tuple[int, int]:
        counts = (self.redis, self.sql)
        self.redis = self.sql = 0
        return counts


def test_round_trips_per_solved_task(sim, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hot path's cost, counted: a regression in round trips fails here, not
    only in the benchmark. Per solved task: renew and finish on Redis (one script
    each, no SCRIPT EXISTS), and two PostgreSQL statements, each its own
    transaction in autocommit (no BEGIN, no COMMIT, no pre-ping). One dispatch
    round for one task: the live view (two pipelined reads), one admission; on
    PostgreSQL one transaction: its BEGIN, the budgets, the pinned lane, the pinned-backlog
    probe, the window, the queued mark and the commit."""
    from balancer.calls import runtime

    monkeypatch.setenv("BALANCER_BACKEND_URL", sim[0])
    monkeypatch.setenv("BALANCER_READY_PER_SLOT", "0")  # the path without ready lists (see the next test)
    runtime.reset()
    svc = runtime.services()  # the worker's own handles: no pre-ping
    svc.quotas.replace_all([MODEL.quota(), SimModel("n", 4, 600_000).quota()])
    svc.core.load_scripts()  # else each script's first call adds a SCRIPT LOAD in a fresh Redis
    rows, errors = parse_tasks("".join(json.dumps({"prompt": f"p{i}", "model": "m"}) + "\n" for i in range(4)),
                               models={"m": MODEL.quota().burst, "n": MODEL.quota().burst})
    assert not errors
    with svc.engine.begin() as conn:
        insert_tasks(conn, rows)
    counts = RoundTrips(monkeypatch, svc.engine)
    backend = make_backend(svc.settings)
    for _ in range(3):
        sent: list[Assignment] = []
        counts.reset()
        dispatch(svc, sent.extend, max_rounds=1, window=1)
        # (Redis, PostgreSQL). The window of one is full and the backlog short, so the
        # end game counts the backlog: one query more than a round in the bulk of a run.
        # The claims' skip scan of the pending model sets is one statement of its own
        # (balancer.backlog.claims: planned per model set, so a parked backlog costs nothing),
        # and so is the fair share's look for the sources with pending work (one source here),
        # and the budgets' (none set: one read of their table, in the round's transaction).
        assert len(sent) == 1 and counts.reset() == (3, 10)
        assert solve(svc, backend, message(sent[0])) == "solved"
        assert counts.reset() == (2, 2)
    runtime.reset()


def test_round_trips_per_task_taken_from_a_ready_list(sim, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot's next call from the model's ready list: the finish that frees the
    slot admits it (one Redis script, no renew, no dispatcher), then its start
    and its answer on PostgreSQL. Per chained task: Redis 1, PostgreSQL 2 (or
    fewer, when the writer takes two answers in one statement)."""
    import sqlalchemy as sa

    from balancer.backlog.ready import mark_ready
    from balancer.calls import runtime
    from balancer.storage.schema import tasks

    monkeypatch.setenv("BALANCER_BACKEND_URL", sim[0])
    runtime.reset()
    svc = runtime.services()
    svc.quotas.replace_all([MODEL.quota(), SimModel("n", 4, 600_000).quota()])
    svc.core.load_scripts()
    rows, errors = parse_tasks("".join(json.dumps({"prompt": f"p{i}", "model": "m"}) + "\n" for i in range(4)),
                               models={"m": MODEL.quota().burst, "n": MODEL.quota().burst})
    assert not errors
    with svc.engine.begin() as conn:
        ids = insert_tasks(conn, rows)
    sent: list[Assignment] = []
    dispatch(svc, sent.extend, max_rounds=1, window=1)
    assert [a.task_id for a in sent] == ids[:1]
    ready = [("m", task_id, row.estimated_tokens, f"r{task_id}") for task_id, row in zip(ids[1:], rows[1:], strict=True)]
    with svc.engine.begin() as conn:
        mark_ready(conn, [(task_id, "m", lid) for _, task_id, _, lid in ready], 60)
    assert svc.core.stock(ready, 60_000) == [True] * 3
    from balancer.backlog.transitions import mark_solved_many

    statements: list[int] = []  # the answer writer's: one per batch of answers

    def counted(engine, answers_, usage=()):  # noqa: ANN001, ANN202
        statements.append(len(answers_))
        return mark_solved_many(engine, answers_, usage)

    monkeypatch.setattr(answers, "mark_solved_many", counted)
    # The on-time path is what is counted: a start that a loaded machine delays past LATE_START_S
    # re-checks its lease first, one Redis script more (test_call.py's late starts test that path).
    monkeypatch.setattr(call_module, "LATE_START_S", svc.settings.heartbeat_seconds)
    writer = AnswerWriter(svc.engine)  # made before counting: the writer's thread writes behind the calls
    counts = RoundTrips(monkeypatch, svc.engine)
    try:
        outcomes = chain(svc, make_backend(svc.settings), message(sent[0]), may_continue=lambda: True, writer=writer)
        assert outcomes == ["solved"] * 4
        got = counts.reset()
    finally:
        writer.close()
    # Redis: the first came from the dispatcher (renew + finish); the others were taken by
    # a finish, one script each. PostgreSQL: four starts (each taken task's right after the
    # finish that took it), and the answers' statements (one per batch, on the writer).
    assert sum(statements) == 4 and got == (2 + 1 + 1 + 1, 4 + len(statements))
    with svc.engine.connect() as conn:  # every answer written once, every start counted once
        rows_after = conn.execute(sa.select(tasks.c.status, tasks.c.attempts).where(tasks.c.id.in_(ids))).all()
    assert sorted(rows_after) == [("solved", 1)] * 4
    assert svc.core.counters()[0]["m"]["ready_taken"] == 3
    runtime.reset()


def test_a_chain_stops_taking_when_told(svc: Services) -> None:
    """``may_continue`` false: the finish frees the slot and takes nothing, so the
    ready task stays on its list for another slot or the dispatcher."""

    a = dispatch_one(svc, {"prompt": "p", "model": "m"})
    stock_ready(svc, ["q"], mark=False)
    assert chain(svc, make_backend(svc.settings), message(a), may_continue=lambda: False) == ["solved"]
    assert svc.core.live()["m"].ready == 1


def test_a_shutdown_during_a_call_takes_no_next_call(svc: Services) -> None:
    """The worker is told to stop (SIGTERM) while a call runs: the call's end
    takes no next call. The question is asked when the call ends; asked before
    the call (as it was), the chain took one more and called it after the signal."""

    class StopsDuringTheCall:
        def __init__(self, inner) -> None:  # noqa: ANN001
            self.inner, self.calls, self.stopping = inner, 0, False

        def complete(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            self.calls += 1
            try:
                return self.inner.complete(*args, **kwargs)
            finally:
                self.stopping = True  # the signal comes while the call runs

    a = dispatch_one(svc, {"prompt": "p", "model": "m"})
    stock_ready(svc, ["q"])
    backend = StopsDuringTheCall(make_backend(svc.settings))
    assert chain(svc, backend, message(a), may_continue=lambda: not backend.stopping) == ["solved"]
    assert backend.calls == 1
    assert svc.core.live()["m"].ready == 1


def test_a_chain_asks_for_a_dispatch_only_once_its_ready_list_runs_low(svc: Services) -> None:
    """While the model's ready list still holds an entry per slot after a take,
    the chain asks for no dispatch (the dispatcher would run after every call
    for nothing); below that, and when a slot frees with no next call, it does."""
    first = dispatch_one(svc, {"prompt": "first", "model": "m"})
    stock_ready(svc, [f"p{i}" for i in range(6)])
    left_when_asked: list[int] = []
    outcomes = chain(svc, make_backend(svc.settings), message(first), may_continue=lambda: True,
                           ask_for_dispatch=lambda: left_when_asked.append(svc.core.live()["m"].ready))
    assert outcomes == ["solved"] * 7
    # Four slots: takes that left 5 and 4 entries ask nothing; those that left 3, 2,
    # 1 and 0 ask, and so does the last call, which frees its slot with no next.
    # Each request runs on the answer writer once its answer is written, by when
    # the chain may have taken more: what it reads is at most what the take left.
    assert len(left_when_asked) == 5 and all(left <= 3 for left in left_when_asked)


def test_a_chain_writes_its_answers_behind_its_next_calls_and_returns_once_all_are_written(
    svc: Services, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the answer writer, each answer is written on the writer's thread:
    those whose slot took a next call while that call runs (and the dispatch
    request follows the write there), the last one waited for. The chain
    returns only when every answer is stored (its message is acknowledged
    after them), even when the writes are slower than the calls."""
    from balancer.backlog.transitions import mark_solved_many
    from balancer.calls.answers import AnswerWriter

    first = dispatch_one(svc, {"prompt": "first", "model": "m"})
    ids = stock_ready(svc, [f"p{i}" for i in range(3)])
    writes: list[tuple[list[int], str]] = []

    def slow_write(engine, answers, usage=()):  # noqa: ANN001, ANN202
        writes.append(([a.task_id for a in answers], threading.current_thread().name))
        time.sleep(0.3)  # a WAL flush on a busy disk
        return mark_solved_many(engine, answers, usage)

    monkeypatch.setattr(answers, "mark_solved_many", slow_write)
    asked: list[str] = []  # ask_for_dispatch: the worker's dispatch request
    writer = AnswerWriter(svc.engine)
    try:
        outcomes = chain(svc, make_backend(svc.settings), message(first), may_continue=lambda: True, writer=writer,
                               ask_for_dispatch=lambda: asked.append(threading.current_thread().name))
        assert outcomes == ["solved"] * 4
        statuses = [task_row(svc, task_id).status for task_id in (first.task_id, *ids)]
    finally:
        writer.close()
    assert statuses == ["solved"] * 4  # read before the writer was closed: the chain waited for it
    assert sorted(task_id for batch, _ in writes for task_id in batch) == [first.task_id, *ids]
    assert {thread for _, thread in writes} == {"balancer-answers"}
    assert asked == ["balancer-answers"] * 4  # each once its answer is written, the last one's too


def test_the_answer_writer_writes_what_waits_in_one_statement_each_under_its_guard(
    svc: Services, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers handed over while a write is under way go out together in the
    next statement; each keeps its own guard: a stale admission or an answer
    already written is not written (its outcome says so), a hedged task names
    its hedge, a task's second answer goes in the next statement, a failure
    reaches the solve waiting on it, and a closed writer takes nothing more."""
    import sqlalchemy as sa

    from balancer.backlog.ready import mark_ready
    from balancer.backlog.transitions import Answer, Written, mark_solved_many
    from balancer.calls.answers import AnswerWriter
    from balancer.storage.schema import tasks

    rows, _ = parse_tasks("".join(json.dumps({"prompt": f"p{i}", "model": "m"}) + "\n" for i in range(5)),
                          models={"m": MODEL.quota().burst})
    with svc.engine.begin() as conn:
        ids = insert_tasks(conn, rows)
        mark_ready(conn, [(task_id, "m", f"r{task_id}") for task_id in ids], 60)
        conn.execute(sa.update(tasks).where(tasks.c.id == ids[1]).values(hedge_admission_id="h1"))
    statements: list[int] = []
    writing, release = threading.Event(), threading.Event()

    def counted(engine, answers, usage=()):  # noqa: ANN001, ANN202
        statements.append(len(answers))
        writing.set()
        release.wait(10)  # the first write holds the thread while the others arrive
        return mark_solved_many(engine, answers, usage)

    monkeypatch.setattr(answers, "mark_solved_many", counted)
    writer = AnswerWriter(svc.engine)
    try:
        def named(written: Written | None) -> str:
            return "duplicate" if written is None else f"solved, cut off {written.other_call}"

        first = writer.submit(Answer(ids[0], f"r{ids[0]}", "a0", 5, 1), named)
        assert writing.wait(10)
        rest = [writer.submit(Answer(ids[1], f"r{ids[1]}", "a1", 5, 1), named),
                writer.submit(Answer(ids[2], "stale", "a2", 5, 1), named),
                writer.submit(Answer(ids[0], f"r{ids[0]}", "again", 5, 1), named),
                writer.submit(Answer(ids[3], f"r{ids[3]}", "a3", 5, 1), named),
                writer.submit(Answer(ids[3], f"r{ids[3]}", "a3 again", 5, 1), named)]
        release.set()
        assert first.result(10) == "solved, cut off None"
        assert [f.result(10) for f in rest] == ["solved, cut off h1", "duplicate", "duplicate", "solved, cut off None",
                                                "duplicate"]
        assert statements == [1, 4, 1]  # a task's second answer waits for the next statement
        broken = writer.submit(Answer(ids[4], f"r{ids[4]}", "a4", 5, 1), lambda _: 1 / 0)  # type: ignore[arg-type, return-value]
        with pytest.raises(ZeroDivisionError):
            broken.result(10)
    finally:
        writer.close()
    with svc.engine.connect() as conn:
        got = dict(conn.execute(sa.select(tasks.c.id, sa.func.concat(tasks.c.status, ":", tasks.c.answer))
                                .where(tasks.c.id.in_(ids))).all())
    assert got == {ids[0]: "solved:a0", ids[1]: "solved:a1", ids[2]: "ready:", ids[3]: "solved:a3", ids[4]: "solved:a4"}
    with pytest.raises(RuntimeError, match="closed"):  # never queued where no one would write it
        writer.submit(Answer(ids[4], f"r{ids[4]}", "late", 5, 1), named)


def test_a_next_call_that_cannot_start_frees_its_slot_and_the_answer_is_still_written(
    svc: Services, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next call's task is started before this call's answer is written: if
    that start fails for good, the answer is written all the same, the next
    call's slot is freed at once, and its task waits (``ready``) for the sweep."""
    from balancer.backlog.transitions import start_solve

    first = dispatch_one(svc, {"prompt": "first", "model": "m"})
    (other,) = stock_ready(svc, ["next"])

    def broken_for_the_next(engine, task_id, *args):  # noqa: ANN001, ANN002, ANN202
        if task_id == other:
            raise RuntimeError("a bug, not an outage: not retried")
        return start_solve(engine, task_id, *args)

    monkeypatch.setattr(solver, "start_solve", broken_for_the_next)
    assert chain(svc, make_backend(svc.settings), message(first), may_continue=lambda: True) == ["solved"]
    assert task_row(svc, first.task_id).status == "solved" and task_row(svc, other).status == "ready"
    assert svc.core.live()["m"].in_flight == 0 and svc.core.counters()[0]["m"]["ready_taken"] == 1


def test_a_start_does_not_wait_for_the_wal_flush_and_leaves_its_connection_as_it_was(svc: Services) -> None:
    """``start_solve`` turns ``synchronous_commit`` off for its own transaction
    only: a pooled connection used next for an answer commits durably."""
    from datetime import timedelta

    import sqlalchemy as sa

    from balancer.backlog.claims import mark_queued
    from balancer.backlog.transitions import _START_SOLVE, start_solve

    rows, _ = parse_tasks("".join(json.dumps({"prompt": f"p{i}", "model": "m"}) + "\n" for i in range(2)),
                          models={"m": MODEL.quota().burst})
    with svc.engine.begin() as conn:
        a, b = insert_tasks(conn, rows)
        mark_queued(conn, [(a, "m", "ra"), (b, "m", "rb")], 60)
    setting = sa.select(sa.func.current_setting("synchronous_commit"))
    with svc.engine.begin() as conn:  # inside one transaction, the statement's setting shows
        started = conn.execute(_START_SOLVE, {"b_task_id": a, "b_admission_id": "ra",
                                              "b_lease": timedelta(seconds=60)}).first()
        assert started is not None and conn.execute(setting).scalar_one() == "off"
    assert start_solve(svc.engine, b, "rb", 60) is not None
    with svc.engine.connect() as conn:  # the pool's connections: back to the server's default
        assert conn.execute(setting).scalar_one() == "on"


def test_an_answer_in_hand_waits_for_a_pooled_connection(database_url: str) -> None:
    """Every pooled connection busy: the write waits (pool checkout timeouts are
    retried) instead of raising and dropping the answer."""

    import sqlalchemy as sa

    from balancer.backlog.retry import with_db_retry
    from balancer.storage.db import make_engine

    engine = make_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=0.1)
    held = engine.connect()
    releaser = threading.Timer(0.6, held.close)  # the only connection comes back after 0.6 s
    releaser.start()
    attempts = []

    def write() -> int:
        attempts.append(1)
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT 1")).scalar_one()

    try:
        assert with_db_retry(write) == 1
        assert len(attempts) >= 2  # the first checkout timed out and was retried
    finally:
        releaser.cancel()
        held.close()
        engine.dispose()


def test_a_process_never_opens_more_than_its_pool_of_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """BALANCER_DB_POOL_SIZE connections per process, kept open, and no more: a
    thread that finds them all busy waits for one instead of opening (and, on
    return, closing) another. Overflow connections did that about 700 times in
    a 2,000-task overhead.toml run, each one a PostgreSQL server process forked
    and torn down."""
    import sqlalchemy as sa

    from balancer.calls import runtime

    monkeypatch.setenv("BALANCER_DB_POOL_SIZE", "2")
    runtime.reset()
    engine = runtime.services().engine
    opened: list[object] = []
    sa.event.listen(engine, "connect", lambda dbapi, record: opened.append(dbapi))
    held = [engine.connect() for _ in range(2)]
    got_one = threading.Event()

    def third() -> None:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
            got_one.set()

    waiter = threading.Thread(target=third, daemon=True)
    waiter.start()
    try:
        assert not got_one.wait(0.5)  # both connections are held: it waits, it does not open a third
        held.pop().close()
        assert got_one.wait(10)  # and takes the one given back
        waiter.join(10)
        assert len(opened) == 2 and engine.pool.checkedin() == 1  # the returned one stays open
    finally:
        for conn in held:
            conn.close()
        runtime.reset()


@pytest.mark.faults
def test_an_unexpected_error_in_a_solve_uses_an_attempt_so_max_attempts_ends_it(svc: Services, sim) -> None:
    """A client built with a NaN timeout (what BALANCER_BACKEND_TIMEOUT=nan did
    before settings refused it) raises a ValueError inside httpx on every call:
    not a backend error, a bug. Each one is an attempt, so the task fails
    after max_attempts (3) instead of going round for ever."""
    broken = make_backend(dataclasses.replace(svc.settings, backend_timeout=float("nan")))
    a = dispatch_one(svc, {"prompt": "p", "model": "m"})
    outcomes = [solve(svc, broken, message(a))]
    while outcomes[-1] == "retry":
        outcomes.append(solve(svc, broken, message(redispatch(svc, a.task_id, clear_backoff=True))))
    assert outcomes == ["retry", "retry", "failed"]
    row = task_row(svc, a.task_id)
    assert row.status == "failed" and row.attempts == 3 and "unexpected ValueError" in row.error
    assert svc.core.live()["m"].in_flight == 0


def test_a_redelivered_copy_of_a_running_call_does_not_call_again(svc: Services, sim) -> None:
    """The first delivery started the call (its task is running, its deadline ahead,
    kept so by the heartbeat); a copy of the message (kombu restoring unacked
    messages after a dropped connection) makes no call and leaves the live call's
    slot alone. Once the deadline has passed (the worker is gone), a copy takes over."""
    import sqlalchemy as sa

    from balancer.backlog.transitions import start_solve
    from balancer.storage.schema import tasks

    url, simulator = sim
    a = dispatch_one(svc, {"prompt": "hello world", "model": "m", "max_tokens": 100})
    assert start_solve(svc.engine, a.task_id, a.admission_id, 60) is not None  # the first delivery's start
    assert svc.core.renew(a.admission_id, a.model, a.estimated_tokens).__class__.__name__ == "Admitted"
    backend = make_backend(svc.settings)
    assert solve(svc, backend, message(a)) == "running_elsewhere"
    assert simulator.log == []  # no second call
    assert svc.core.live()["m"].in_flight == 1  # the live call keeps its slot
    assert task_row(svc, a.task_id).status == "running"

    with svc.engine.begin() as conn:  # the first worker died: no heartbeat moved the deadline
        conn.execute(sa.update(tasks).where(tasks.c.id == a.task_id).values(deadline=sa.func.now() - sa.text("interval '1 second'")))
    assert solve(svc, backend, message(a)) == "solved"
    assert len([e for e in simulator.log if e["status"] == 200]) == 1
    assert svc.core.live()["m"].in_flight == 0


def test_the_heartbeat_keeps_a_running_call_past_its_lease(svc: Services, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lease 2 s, heartbeat every 0.67 s: over three leases the slot stays held and
    the task is never returned by the sweep; once released it is no longer
    renewed and both expire."""
    import dataclasses

    from balancer.backlog.leases import return_expired
    from balancer.backlog.reads import overdue_count
    from balancer.backlog.transitions import start_solve
    from balancer.calls.heartbeat import Heartbeat

    short = dataclasses.replace(svc, settings=dataclasses.replace(svc.settings, lease_seconds=2))
    a = dispatch_one(svc, {"prompt": "hello world", "model": "m", "max_tokens": 100})
    assert start_solve(svc.engine, a.task_id, a.admission_id, 2) is not None
    svc.core.renew(a.admission_id, a.model, a.estimated_tokens, lease_ms=2000)
    heartbeat = Heartbeat(short)
    try:
        heartbeat.register(a.admission_id, until=time.monotonic() + 60)
        assert heartbeat.beat() == (1, 1)  # one slot, one task deadline
        started = time.monotonic()
        while time.monotonic() - started < 6:  # three leases
            assert return_expired(svc.engine) == 0
            assert svc.core.live()["m"].in_flight == 1
            time.sleep(0.25)
        heartbeat.release(a.admission_id)
        deadline = time.monotonic() + 10
        while svc.core.live()["m"].in_flight and time.monotonic() < deadline:
            time.sleep(0.1)
        assert svc.core.live()["m"].in_flight == 0  # no heartbeat: the lease ran out
        # Each beat renews the Redis slot first and the task's deadline just after it, so the
        # deadline can pass a few milliseconds after the slot expired: wait for it, bounded.
        while overdue_count(svc.engine) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert overdue_count(svc.engine) == 1  # what `balancer status` reports meanwhile
        assert return_expired(svc.engine) == 1  # and the task goes back to pending
        assert overdue_count(svc.engine) == 0
    finally:
        heartbeat.close()
