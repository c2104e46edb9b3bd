"""``balancer run``: the dispatcher, workers and beat started, supervised, restarted and
stopped together, against a real simulator, Redis and PostgreSQL; and the first line a
process prints when the backend's address refuses connections."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from balancer.backlog.reads import status_counts
from balancer.devtools.embedded import free_port
from balancer.devtools.sim.config import default_models
from balancer.services import Services
from balancer.settings import Settings
from balancer.supervisor import Supervisor, wait_for_http
from tests.scenario_text import scenario_text

pytestmark = pytest.mark.timeout(240)

TIME_SCALE = 0.02


def refused_url() -> str:
    """A loopback address nothing listens on (bound, never listening, so nobody else takes it meanwhile)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    refused_url.keep = sock  # type: ignore[attr-defined]  # held until the next call
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def lines_of(stream) -> queue.Queue[str]:  # noqa: ANN001
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            out.put(line.rstrip("\n"))
        out.put("")  # closed

    threading.Thread(target=pump, daemon=True).start()
    return out


def wait_for_line(lines: queue.Queue[str], pattern: str, seen: list[str], timeout: float = 60.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f}s; saw:\n" + "\n".join(seen))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def poll(check, timeout: float, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def submit(env: dict[str, str], tasks: list[tuple[str, str]]) -> None:
    """``balancer submit`` these (prompt, model) pairs, as a user would."""
    done = subprocess.run([sys.executable, "-m", "balancer", "submit", "-"], capture_output=True, text=True, env=env,
                          timeout=60, input="".join(json.dumps({"prompt": p, "model": m}) + "\n" for p, m in tasks))
    assert done.returncode == 0, done.stderr


def test_a_worker_says_on_its_first_line_that_the_backend_refuses_connections(migrated: dict[str, str]) -> None:
    url = refused_url()
    done = subprocess.run([sys.executable, "-m", "balancer", "worker", "--all-models"], capture_output=True, text=True,
                          env={**os.environ, "BALANCER_BACKEND_URL": url}, timeout=60)
    first = done.stderr.splitlines()[0]
    assert first.startswith("warning: the Models Backend at ") and url in first and "refuses connections" in first, first
    assert done.returncode == 2 and "no model has a quota" in done.stderr  # and then its own error, one line


def test_a_backend_that_starts_listening_within_the_grace_is_not_warned_of(monkeypatch: pytest.MonkeyPatch) -> None:
    """`balancer sim &` then `balancer run`: the run probed the port before the simulator bound it,
    and warned of a backend that answered every call. A port that refuses is tried again for
    the grace: one that starts listening meanwhile is no warning; one that never does still is."""
    from balancer.backends import probe

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    tries: list[float] = []
    connect = socket.create_connection

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        tries.append(time.monotonic())
        return connect(*args, **kwargs)

    monkeypatch.setattr(probe.socket, "create_connection", counted)
    try:
        assert "refuses connections" in (probe.refusal(url) or "")  # no grace: one try, refused
        assert len(tries) == 1

        def listen_after_a_refusal() -> None:
            while len(tries) < 2:  # the probe under test has been refused once
                time.sleep(0.01)
            sock.listen()

        opener = threading.Thread(target=listen_after_a_refusal, daemon=True)
        opener.start()
        assert probe.refusal(url, grace=10.0) is None
        assert len(tries) >= 3  # refused, then tried again until it opened
    finally:
        sock.close()


def test_run_without_quotas_is_one_line_after_the_refusal(migrated: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "balancer", "run"], capture_output=True, text=True,
                          env={**os.environ, "BALANCER_BACKEND_URL": refused_url()}, timeout=60)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 2, done.stderr
    assert "refuses connections" in lines[0] and lines[1].startswith("error: no model has a quota")


def test_run_starts_restarts_and_stops_the_pipeline(migrated: dict[str, str], tmp_path: Path) -> None:
    models = default_models(2)
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([m.quota(time_scale=TIME_SCALE) for m in models], by="test")
    port = free_port()
    env = {**os.environ, "BALANCER_BACKEND_URL": f"http://127.0.0.1:{port}", "BALANCER_DISPATCH_TICK": "0.5",
           "BALANCER_HOME": str(tmp_path)}
    with Supervisor(tmp_path / "sim", env=env) as sims:
        sim = sims.start("sim", ["sim", "--port", str(port), "--models", "2", "--time-scale", str(TIME_SCALE)])
        wait_for_http(f"http://127.0.0.1:{port}/models", child=sim)
        run = subprocess.Popen([sys.executable, "-m", "balancer", "run", "--per-model", "--log-dir", str(tmp_path / "logs")],
                               env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        try:
            lines, seen = lines_of(run.stderr), []
            pids = {}
            for name in ("dispatcher", "worker-model-0", "worker-model-1", "beat"):
                found = wait_for_line(lines, rf"^{name}: pid (\d+), log (\S+)$", seen)
                pids[name] = int(found[1])
                assert Path(found[2]) == tmp_path / "logs" / f"{name}.log"
            wait_for_line(lines, r"^running 4 processes for 2 model\(s\)", seen)

            submit(env, [(f"question {i}", f"model-{i % 2}") for i in range(20)])
            poll(lambda: status_counts(svc.engine)["solved"] == 20, 120, "20 tasks solved")

            os.kill(pids["worker-model-1"], signal.SIGKILL)  # a worker dies: it is started again, and works
            wait_for_line(lines, r"^worker-model-1 exited \(code -9\); restarting it (now|in 1 s)", seen)  # it died young: a pause
            again = int(wait_for_line(lines, r"^worker-model-1 started again \(pid (\d+)\)", seen)[1])
            assert again != pids["worker-model-1"]
            pids["worker-model-1 again"] = again
            submit(env, [(f"more {i}", "model-1") for i in range(5)])
            poll(lambda: status_counts(svc.engine)["solved"] == 25, 120, "the restarted worker's 5 tasks solved")

            run.send_signal(signal.SIGTERM)  # stops them all together
            assert run.wait(timeout=60) == 0
            wait_for_line(lines, r"^stopped$", seen)
            still = [name for name, pid in pids.items() if name != "worker-model-1" and alive(pid)]
            assert not still, f"left running: {still}"
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()


#: One model whose every call takes exactly 10 s: longer than the 5 s `run` gave its children.
SLOW_MODEL = scenario_text("slow", """[[models]]
name = "slow-0"
max_concurrent_requests = 4
max_tokens_per_minute = 1000000
latency = { median = 10.0, p99 = 10.01, min = 10.0, max = 10.0 }
""")


def test_ctrl_c_lets_the_calls_in_flight_end_and_a_second_ctrl_c_stops_them_now(
        migrated: dict[str, str], tmp_path: Path) -> None:
    """A new user stopped `balancer run` with Ctrl-C and `status` showed a task running for good:
    its worker was killed 5 s after the SIGTERM, in the middle of its call. Now the workers
    finish their calls in flight (their answers written) before `run` exits; a second Ctrl-C
    stops them at once, and says which were cut short."""
    from balancer.devtools.scenario import parse_scenario

    (tmp_path / "slow.toml").write_text(SLOW_MODEL)
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([m.quota(time_scale=1.0) for m in parse_scenario(SLOW_MODEL, "slow").models], by="test")
    port = free_port()
    env = {**os.environ, "BALANCER_BACKEND_URL": f"http://127.0.0.1:{port}", "BALANCER_DISPATCH_TICK": "0.5",
           "BALANCER_HOME": str(tmp_path), "BALANCER_HEDGE_BUDGET": "0"}
    with Supervisor(tmp_path / "sim", env=env) as sims:
        sim = sims.start("sim", ["sim", "--port", str(port), "--scenario", str(tmp_path / "slow.toml")])
        wait_for_http(f"http://127.0.0.1:{port}/models", child=sim)
        for presses in (1, 2):
            run = subprocess.Popen([sys.executable, "-m", "balancer", "run", "--log-dir", str(tmp_path / "logs")],
                                   env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
            try:
                lines, seen = lines_of(run.stderr), []
                wait_for_line(lines, r"^running 3 processes for 1 model", seen)
                submit(env, [(f"press {presses}, question {i}", "slow-0") for i in range(2)])
                poll(lambda: status_counts(svc.engine)["running"] == 2, 60, "two calls in flight")
                run.send_signal(signal.SIGINT)
                wait_for_line(lines, r"^stopping: the workers finish their calls in flight first", seen)
                if presses == 2:
                    run.send_signal(signal.SIGINT)
                    assert wait_for_line(lines, r"^stopped before their calls in flight ended: (\S+) ", seen)[1] == "workers"
                assert run.wait(timeout=60) == 0
                wait_for_line(lines, r"^stopped$", seen)
                counts = status_counts(svc.engine)
                # Once: both answered before `run` returned. Twice: cut short, their tasks still running.
                assert (counts["solved"], counts["running"]) == ((2, 0) if presses == 1 else (2, 2)), counts
            finally:
                if run.poll() is None:
                    run.kill()
                    run.wait()


def test_the_ticks_are_logged_at_debug_not_info(migrated: dict[str, str], tmp_path: Path, redis_client) -> None:  # noqa: ANN001
    """A dispatcher at INFO logs no tick it receives or ends; beat at DEBUG still logs each tick it sends."""
    from balancer.admission import keys

    env = {**os.environ, "BALANCER_DISPATCH_TICK": "0.2", "BALANCER_HOME": str(tmp_path)}
    with Supervisor(tmp_path / "logs", env=env) as supervisor:
        dispatcher = supervisor.start("dispatcher", ["dispatcher", "--loglevel", "INFO"])
        beat = supervisor.start("beat", ["beat", "--loglevel", "DEBUG"])
        seen: set[bytes] = set()

        def ticked() -> bool:  # beat's dispatch tick ran in the dispatcher, five times
            supervisor.check_alive()
            value = redis_client.get(keys.beat_seen(migrated["BALANCER_NAMESPACE"]))
            if value:
                seen.add(value)
            return len(seen) >= 5

        poll(ticked, 90, "five dispatch ticks from beat")
    worker_log, beat_log = dispatcher.log.read_text(), beat.log.read_text()
    assert "ready." in worker_log  # it did log at INFO
    assert f"{keys.DISPATCH_TASK}[" not in worker_log, worker_log[-2000:]  # "Task balancer.dispatch[id] received"
    assert f"Sending due task dispatch ({keys.DISPATCH_TASK})" in beat_log, beat_log[-2000:]
