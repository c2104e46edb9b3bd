"""The chaos run (balancer.bench.chaos.run): its witness on hand-made cases, its schedule,
its stall proxy on real sockets, its operator commands against a real Redis that is
down and comes back, and a short run in CI (marked ``faults``)."""

from __future__ import annotations

import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from balancer.bench.chaos.plan import KINDS, draw_schedule
from balancer.bench.chaos.witness import (
    FaultWindow,
    TaskRow,
    WriteEvent,
    overlapping_calls,
    quota_breaches,
    recoveries,
    repeated_calls,
    witness,
)
from balancer.devtools.sim.audit import Limits
from balancer.devtools.tcpproxy import StallProxy


def call(start: float, end: float, key: str, model: str = "m", status: int = 200, **extra: object) -> dict:
    return {"start": start, "end": end, "model": model, "status": status, "prompt_key": key, "counted": 10, **extra}


# -- the witness ---------------------------------------------------------------------
def test_a_repeat_is_explained_only_by_a_kill_of_the_worker_running_the_first_call() -> None:
    calls = [call(0.0, 2.0, "a"), call(5.0, 6.0, "a"), call(0.0, 1.0, "b", model="n"), call(3.0, 4.0, "b")]
    repeats, orphans = repeated_calls(calls, {"a": 1, "b": 2}, kills=[("worker-m", 1.5), ("worker-m", 3.5)])
    by_task = {r.task_id: r for r in repeats}
    assert by_task[1].explained_by == "worker-m killed at 1.500"
    # b's first call ran on model n, whose worker nobody killed; a kill of worker-m after it explains nothing
    assert by_task[2].explained_by is None
    assert orphans == 0


def test_a_kill_before_the_answer_was_written_explains_a_repeat_and_one_after_it_does_not() -> None:
    """A call lives until its answer is durably written: the worker killed 0.04 s
    after the backend answered, its answer still in the writer, explains the
    repeat (seed 2026's three-minute run called this one unexplained); a kill
    after the answer was written, or after the repeat began, explains nothing."""
    calls = [call(0.0, 1.0, "a"), call(9.0, 10.0, "a"),  # killed at 1.04, answer never written: repeated at 9
             call(0.0, 1.0, "b"), call(9.0, 10.0, "b"),  # answer written at 1.02, killed at 1.04: a real repeat
             call(20.0, 21.0, "c"), call(22.0, 23.0, "c")]  # killed at 25, after the repeat began
    written = {1: [10.1], 2: [1.02, 10.1], 3: [23.1]}
    kills = [("worker-m", 1.04), ("worker-m", 25.0)]
    repeats, _ = repeated_calls(calls, {"a": 1, "b": 2, "c": 3}, kills, written)
    assert [(r.task_id, r.explained_by) for r in repeats] == [
        (1, "worker-m killed at 1.040, its answer not yet written"), (2, None), (3, None)]
    # without the write log, only a kill during the call explains
    assert [r.explained_by for r in repeated_calls(calls, {"a": 1, "b": 2, "c": 3}, kills)[0]] == [None] * 3


def test_two_calls_of_one_task_at_once_are_an_overlap_unless_its_worker_was_killed() -> None:
    calls = [call(0.0, 2.0, "a"), call(1.0, 3.0, "a", status=500), call(0.0, 2.0, "b"), call(1.5, 2.5, "b"),
             call(3.0, 4.0, "b", status=429)]
    overlaps = overlapping_calls(calls, {"a": 1, "b": 2}, kills=[("worker-m", 1.2)])
    # task 1's second call started before the kill: nothing explains it; task 2's started after it
    assert [(o.task_id, o.explained_by) for o in overlaps] == [(1, None), (2, "worker-m killed at 1.200")]
    assert overlapping_calls([call(0.0, 1.0, "a"), call(1.0, 2.0, "a")], {"a": 1}, kills=[]) == []


def test_a_call_the_backend_logged_just_after_its_worker_was_killed_is_that_workers() -> None:
    """Seed 86's four-minute run (at 5d4cb66) called one repeat unexplained: worker-model-3 was
    killed at +43.606 s, the backend logged a call of model-3 starting at +43.612 s, its answer was
    never written, and the task was called again when its deadline had passed. The request was in
    the socket when the worker died (a dead process sends nothing; the model's next worker starts
    0.5 s later at the earliest). A call logged up to IN_SOCKET_S after its worker's kill is that
    worker's; one logged later is not."""
    calls = [call(43.612, 43.706, "a"), call(81.804, 81.976, "a"),  # in the socket at the kill
             call(44.0, 44.1, "b"), call(50.0, 50.1, "b")]  # started 0.4 s after the kill: another worker's
    kills = [("worker-m", 43.606)]
    repeats, _ = repeated_calls(calls, {"a": 1, "b": 2}, kills, {1: [82.015], 2: [44.15, 50.15]})
    assert [(r.task_id, r.explained_by) for r in repeats] == [(1, "worker-m killed at 43.606"), (2, None)]
    overlaps = overlapping_calls([call(1.25, 3.0, "c"), call(2.0, 2.5, "c")], {"c": 3}, kills=[("worker-m", 1.2)])
    assert [o.explained_by for o in overlaps] == ["worker-m killed at 1.200"]


def test_calls_of_no_task_are_counted_apart_and_429s_pay_nothing() -> None:
    calls = [call(0.0, 1.0, "a"), call(0.5, 0.5, "a", status=429), call(0.0, 1.0, "zz")]
    repeats, orphans = repeated_calls(calls, {"a": 1}, kills=[])
    assert repeats == [] and orphans == 1


def test_a_cap_lowered_binds_calls_started_after_the_slack() -> None:
    caps = {"m": [(0.0, 2), (10.0, 1)]}
    inside_slack = [call(9.0, 20.0, "a"), call(10.5, 20.0, "b")]  # 2 in flight, 0.5 s after the change
    assert quota_breaches(inside_slack, caps) == []
    late = [call(9.0, 20.0, "a"), call(12.0, 20.0, "b")]
    assert quota_breaches(late, caps) == ["m: 2 in flight > cap 1 at t=12.000"]
    removed = {"m": [(0.0, 2), (5.0, None)]}
    assert quota_breaches([call(7.0, 8.0, "a")], removed) == ["m: 1 in flight > cap 0 at t=7.000"]


def test_a_task_solved_twice_or_written_twice_or_never_ended_is_reported() -> None:
    tasks = [TaskRow(1, "a", "solved", None), TaskRow(2, "b", "running", None), TaskRow(3, "c", "failed", "")]
    writes = [
        WriteEvent(1, "running", "solved", True, 1.0),
        WriteEvent(1, "solved", "pending", False, 2.0),
        WriteEvent(1, "running", "solved", True, 3.0),
        WriteEvent(3, "running", "failed", False, 3.0),
    ]
    report = witness([], tasks, writes, expected_tasks=4, quota_caps={}, provider={}, faults=[], kills=[], deaths=[])
    assert report.ended_twice == [1]
    assert report.double_written == 1
    assert report.lost == 2  # task 2 never ended; a fourth task never reached PostgreSQL
    assert report.failed_without_reason == [3]
    assert not report.passed


def test_provider_limits_are_audited_and_a_death_fails_the_run() -> None:
    calls = [call(0.0, 1.0, "a"), call(0.5, 1.5, "b")]
    tasks = [TaskRow(1, "a", "solved", None), TaskRow(2, "b", "solved", None)]
    writes = [WriteEvent(1, "running", "solved", True, 1.1), WriteEvent(2, "running", "solved", True, 1.6)]
    provider = {"m": Limits(cap=1, tpm=6000, rpm=None, burst=1000)}
    report = witness(calls, tasks, writes, expected_tasks=2, quota_caps={}, provider=provider, faults=[], kills=[],
                     deaths=["beat exit 1 at +3.0s"])
    assert [v.split(" at ")[0] for v in report.provider_violations] == ["m: concurrency 2 > 1"]
    assert report.deaths and not report.passed


def test_recovery_is_the_first_answer_and_the_return_to_the_rate_before() -> None:
    before = [float(t) for t in range(0, 30)]  # one answer a second before the fault
    after = [45.0 + i for i in range(40)]  # the fault ends at 40; answers resume at 45
    (rec,) = recoveries([FaultWindow("f", "pg_stall", 30.0, 40.0)], before + after, last_answer=84.0)
    assert rec.first_answer_s == 5.0
    assert rec.rate_back_s == 5.0  # from 45 on, 10 answers every 10 s: the rate before
    (never,) = recoveries([FaultWindow("f", "pg_stall", 30.0, 40.0)], before + [41.0, 60.0, 79.0], last_answer=79.0)
    assert never.rate_back_s == float("inf")
    # arrivals slowed after the fault: the rate stays low, but the backlog is back to its size at the fault's start
    opened = [float(t) for t in range(0, 36)]  # a task an s until 35, then none
    closed = before + [41.0, 50.0, 55.0, 60.0, 70.0, 79.0]
    (caught_up,) = recoveries([FaultWindow("f", "pg_stall", 30.0, 40.0)], closed, 79.0, opened, closed)
    assert caught_up.rate_back_s == 30.0  # at 70: 36 stored, 35 ended; 1 open, as at 30 (31 stored, 30 ended)
    # a fault after the last task ended has nothing to recover
    (idle,) = recoveries([FaultWindow("f", "kill_beat", 90.0, 95.0)], closed, 79.0, opened, closed)
    assert (idle.first_answer_s, idle.rate_back_s, idle.seconds) == (None, None, None)


def test_a_fault_ending_after_the_last_answer_is_judged_by_the_backlog_then() -> None:
    """Chaos seed 182203819: model-0 answered 500s until after the run's last answer,
    and its 29 tasks then ended failed (its quota removed with --force). No answer
    came after the fault, yet its backlog was no larger than at its start: back at once,
    not never. Tasks stored during it and ended later are waited for."""
    opened = [0.0] * 40  # a batch of 40 at 0
    answers = [float(t) for t in range(1, 36)]  # one a second until 35; 5 tasks left
    fault = FaultWindow("f", "backend_500", 30.0, 50.0)  # backlog 10 at its start
    closed = answers + [53.0] * 5  # the 5 end failed at 53
    (rec,) = recoveries([fault], answers, 35.0, opened, closed)
    assert (rec.first_answer_s, rec.rate_back_s, rec.seconds) == (None, 0.0, 0.0)
    (rec,) = recoveries([fault], answers, 35.0, opened + [40.0] * 10, closed + [53.0] * 10)
    assert rec.rate_back_s == 3.0  # 15 left at its end, none at 53


def test_the_last_answer_is_checked_even_when_tasks_end_after_it() -> None:
    """Answers at 21 and 23.5 after a fault from 10 to 20 clear its backlog at 23.5;
    a task stored at 23.7 fails at 30. Back at 23.5, not at the failure."""
    answers = [float(t) for t in range(10)] + [21.0, 23.5]
    opened = [float(t) for t in range(10)] + [12.0, 13.0, 23.7]
    (rec,) = recoveries([FaultWindow("f", "pg_stall", 10.0, 20.0)], answers, 23.5, opened, answers + [30.0])
    assert rec.rate_back_s == 3.5


def test_recovery_does_not_count_the_time_a_blocking_fault_made_progress_impossible() -> None:
    """A beat kill ends at 40; the workers' PostgreSQL then stalls from 41 to 80
    (no answer can be written anywhere): answers resume at 82. From its own end,
    42 s; less the 39 s of stall, 3 s. A fault of another kind (a quota lowered
    meanwhile) is not subtracted. Seed 2026's ten-minute run: 246.8 s from the
    Redis kill's own end, of which 222.6 s were outages and stalls after it."""
    before = [float(t) for t in range(0, 30)]
    after = [82.0 + i for i in range(40)]
    beat = FaultWindow("beat", "kill_beat", 30.0, 40.0)
    stall = FaultWindow("stall", "pg_stall", 41.0, 80.0)
    lowered = FaultWindow("quota", "quota_lower", 41.0, 80.0)
    (rec, _) = recoveries([beat, stall], before + after, last_answer=121.0)
    assert (rec.first_answer_s, rec.own_end_seconds, rec.blocked_s, rec.seconds) == (42.0, 42.0, 39.0, 3.0)
    (rec, _) = recoveries([beat, lowered], before + after, last_answer=121.0)
    assert (rec.blocked_s, rec.seconds) == (0.0, 42.0)


def test_the_injector_runs_an_operator_command_again_only_while_a_service_may_come_back(
        migrated: dict[str, str], tmp_path: Path) -> None:
    """Chaos seed 1515597019: model-0's quota was to be created again while Redis was
    down; `quota set` said "cannot reach Redis", exited 2, and 9 tasks that only model-0
    may take waited for it past the drain. The injector, as an operator, runs such a
    command again each second until Redis is back; a command refused for another
    reason runs once."""
    import time

    from balancer.bench.chaos.faults import Injector
    from balancer.devtools.embedded import start_redis

    def injector(env: dict[str, str]) -> Injector:
        unused: Any = None  # the operator commands need none of the injector's other parts
        return Injector(unused, [], 0, unused, unused, "", {}, unused, {**os.environ, **env}, unused)

    with socket.socket() as held:  # bound, never listening: a connection to it is refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        redis_down = injector({**migrated, "BALANCER_REDIS_URL": f"redis://127.0.0.1:{port}/0"})
        redis_down._cli(["quota", "list"])
        deadline = time.monotonic() + 60
        while len(redis_down.actions) < 2:  # refused twice: run again
            assert time.monotonic() < deadline, redis_down.actions
            time.sleep(0.05)
    back = start_redis(tmp_path / "redis", port=port)  # Redis comes back on its port
    try:
        redis_down.settle()
    finally:
        back.stop()
    *refused, answered = redis_down.actions
    assert all("exit 2" in a and "cannot reach Redis" in a for a in refused), redis_down.actions
    assert "exit 0" in answered, redis_down.actions

    unknown = injector(migrated)
    unknown._cli(["quota", "set", "no-such-model", "--tpm", "5"])
    unknown.settle()
    assert len(unknown.actions) == 1 and "unknown model" in unknown.actions[0], unknown.actions


def test_a_quota_removed_while_lowered_is_created_again_whichever_fault_ends_last(migrated: dict[str, str]) -> None:
    """Chaos seed 438828233: model-0's quota was removed, then lowered (refused: unknown
    model), and the lowering ended after the removal. Its end restored the quota with a plain
    `quota set`, refused again, and 6 tasks only model-0 could take waited past the drain. The
    last fault to end creates the quota again if any of them removed it."""
    from balancer.admission.quota import Quota
    from balancer.bench.chaos.faults import Injector
    from balancer.bench.chaos.plan import Fault
    from balancer.services import Services
    from balancer.settings import Settings

    services = Services.connect(Settings.from_env())
    original = Quota("model-0", 8, 2_000_000, burst_tokens=10_000)
    services.quotas.replace_all([original], by="test")
    unused: Any = None  # the quota faults need none of the injector's other parts
    injector = Injector(unused, [], 0, unused, unused, "", {"model-0": original}, unused,
                        {**os.environ, **migrated}, unused)
    removal, lowering = Fault(0, "quota_remove", 17, "model-0"), Fault(6, "quota_lower", 11, "model-0", share=0.27)
    injector.begin(removal)  # one operator: its commands run one after the other, in this order
    injector.begin(lowering)
    injector.end(removal)  # the lowering still runs: nothing restored yet
    injector.end(lowering)
    injector.settle()
    assert services.quotas.get("model-0") == original, injector.actions


def test_a_bad_option_is_one_line_and_exit_2() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "balancer.bench.chaos.run", "--minutes", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: Invalid value for '--minutes': 0.0 is not in the range 0.5<=x<=180."]


# -- the schedule ----------------------------------------------------------------------
def test_the_schedule_replays_from_its_seed_and_covers_every_kind() -> None:
    one = draw_schedule(seed=99, window_s=600, models=["a", "b", "c"])
    assert one == draw_schedule(seed=99, window_s=600, models=["a", "b", "c"])
    assert one != draw_schedule(seed=100, window_s=600, models=["a", "b", "c"])
    assert len(one) >= 40 and {f.kind for f in one} == set(KINDS)
    assert all(0 <= f.at <= 0.85 * 600 and f.duration <= 200 for f in one)
    assert all(f.model in ("a", "b", "c") for f in one if f.kind in ("kill_worker", "quota_remove"))


# -- the stall proxy -----------------------------------------------------------------
@pytest.fixture
def echo_server() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    server.close()


def test_a_stalled_proxy_holds_the_bytes_with_the_socket_open_and_delivers_them_on_resume(echo_server: int) -> None:
    proxy = StallProxy(("127.0.0.1", echo_server)).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as client:
            client.sendall(b"before")
            assert client.recv(100) == b"before"
            proxy.stall()
            client.sendall(b"during")
            client.settimeout(0.5)
            with pytest.raises(TimeoutError):  # held back, and the connection is not closed either
                client.recv(100)
            proxy.resume()
            client.settimeout(5)
            assert client.recv(100) == b"during"
    finally:
        proxy.close()


# -- the short chaos run (CI) -------------------------------------------------------------
#: CI's chaos run: a two-minute fault window per seed (about 3 min each with start-up and
#: drain), one fixed seed and one new seed per run (BALANCER_CHAOS_SEED replays a failure).
CI_WINDOW_MIN, CI_TASKS, FIXED_SEED = 2.0, 1200, 2026


@pytest.mark.faults
@pytest.mark.timeout(900)  # a two-minute window, the start-up and the drain (up to 240 s) under CI's load
@pytest.mark.parametrize("which", ["fixed", "fresh"])
def test_a_short_chaos_run_holds_every_target(which: str, service_urls: tuple[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from balancer.bench.chaos.report import render
    from balancer.bench.chaos.run import run_chaos

    seed = FIXED_SEED if which == "fixed" else int(os.environ.get("BALANCER_CHAOS_SEED") or random.randrange(1, 2**31))
    print(f"chaos seed {seed}; replay: BALANCER_CHAOS_SEED={seed} pytest -m faults tests/bench/test_chaos.py, or"
          f" python -m balancer.bench.chaos.run --minutes {CI_WINDOW_MIN} --tasks {CI_TASKS} --models 3 --seed {seed}")
    monkeypatch.setenv("BALANCER_DATABASE_URL", service_urls[1])
    result = run_chaos(CI_WINDOW_MIN, CI_TASKS, seed, model_count=3, time_scale=0.02, console=Console(),
                       drain_timeout=240)
    text = render(result)
    print(text)
    assert result.drained, text
    report = result.report
    assert report.tasks == report.expected_tasks and report.lost == 0 and not report.failed_without_reason, text
    assert report.double_written == 0 and not report.ended_twice, text
    assert report.provider_violations == [] and report.quota_breaches == [], text
    assert report.unexplained_overlaps == [], text
    assert not report.deaths, text  # a restart during an outage waits for it (BALANCER_START_WAIT)
    assert report.unexplained_repeats == [], text
    assert report.recovery_p99 is None or report.recovery_p99 <= 60, text
    assert report.passed, text


def test_inbox_lines_refused_at_intake_are_counted_with_their_reason_not_as_lost(tmp_path: Path) -> None:
    """A chaos inbox file whose line was pinned to a model a `quota remove` had taken away:
    intake refused that line (its reason in the .errors beside the file), so the run expects
    one task fewer; a whole file rejected counts every line; other files' reports do not count."""
    from balancer.bench.chaos.faults import refused_inbox_lines

    (tmp_path / "done").mkdir()
    (tmp_path / "rejected").mkdir()
    (tmp_path / "done" / "chaos-1.jsonl").write_text("{}\n{}\n{}\n")
    (tmp_path / "done" / "chaos-1.jsonl.errors").write_text("line 1: unknown model 'model-0'\n")
    (tmp_path / "done" / "other.jsonl.errors").write_text("line 3: not ours\n")
    (tmp_path / "rejected" / "chaos-2.jsonl").write_text("{}\n{}\n")
    (tmp_path / "rejected" / "chaos-2.jsonl.errors").write_text("not ingested: OperationalError\n")
    assert refused_inbox_lines(tmp_path) == ["chaos-1.jsonl: line 1: unknown model 'model-0'",
                                             "chaos-2.jsonl: not ingested: OperationalError",
                                             "chaos-2.jsonl: not ingested: OperationalError"]
