"""Issue 26, 3: a long-running process started while Redis or PostgreSQL is
down waits for it (``BALANCER_START_WAIT``) instead of exiting 2 and
crash-looping; a bad URL still exits 2 at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from balancer.devtools.tcpproxy import StallProxy

pytestmark = [pytest.mark.faults, pytest.mark.usefixtures("migrated")]


def free_port() -> int:
    with socket.socket() as s:  # nothing listens here once closed: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(env: dict[str, str], log: Path, *argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "balancer", *argv], env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


def wait_for(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_dispatcher_started_while_postgresql_refuses_waits_and_then_runs(env: dict[str, str], tmp_path: Path) -> None:
    """PostgreSQL's port refuses connections when the dispatcher starts: it logs
    one line per attempt and keeps trying; once the port forwards to
    PostgreSQL, it starts and consumes its queue."""
    proxy = StallProxy.for_database(env["BALANCER_DATABASE_URL"], port=free_port())
    log = tmp_path / "dispatcher.log"
    proc = start({"BALANCER_DATABASE_URL": proxy.database_url(env["BALANCER_DATABASE_URL"]),
                  "BALANCER_START_WAIT": "120"}, log, "dispatcher", "--loglevel", "INFO")
    try:
        wait_for(lambda: log.read_text().count("waiting for a service") >= 2, 60, "two waiting lines")
        assert proc.poll() is None, log.read_text()
        assert "cannot reach PostgreSQL" in log.read_text() and "Traceback" not in log.read_text()
        proxy.start()
        wait_for(lambda: "ready." in log.read_text() or proc.poll() is not None, 90, "the dispatcher's start")
        assert proc.poll() is None and "ready." in log.read_text(), log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
        proxy.close()


def test_an_unreachable_service_past_the_start_wait_exits_2(env: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    started = time.monotonic()
    proc = start({"BALANCER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "BALANCER_START_WAIT": "2"}, log,
                 "worker", "--all-models")
    assert proc.wait(60) == 2
    lines = log.read_text().strip().splitlines()
    assert "Traceback" not in log.read_text()
    assert lines[-1].startswith("error: cannot reach Redis") and any("waiting for a service" in x for x in lines)
    assert 2 <= time.monotonic() - started < 30


def test_the_start_wait_counts_from_after_the_imports(env: dict[str, str]) -> None:
    """The first attempt imported the services' modules inside the wait: seconds on a loaded
    machine, so a 2 s ``BALANCER_START_WAIT`` could be spent before the first refusal and the
    process exited 2 without waiting once. The modules are imported before the clock starts."""
    probe = ("import sys\n"
             "from balancer.cli import startwait\n"
             "def clock_starts(start, wait, **kw):\n"
             "    sys.exit(0 if 'balancer.services' in sys.modules else 3)\n"
             "startwait.start_when_ready = clock_starts\n"
             "startwait.migrated(wait=True)\n")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"balancer.services not imported when the start wait began: {done.stderr}"


def test_a_bad_url_exits_2_at_once_without_waiting(env: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "dispatcher.log"
    proc = start({"BALANCER_DATABASE_URL": "mysql://root:hunter2@db/x", "BALANCER_START_WAIT": "120"}, log,
                 "dispatcher")
    assert proc.wait(30) == 2
    text = log.read_text()
    assert "waiting for a service" not in text and text.strip().startswith("error: ") and "hunter2" not in text


def quota(env: dict[str, str], *argv: str) -> None:
    subprocess.run([sys.executable, "-m", "balancer", "quota", *argv], env={**os.environ, **env}, check=True,
                   capture_output=True)


def test_a_worker_for_a_removed_quota_waits_for_it_and_a_typo_exits_2_at_once(env: dict[str, str],
                                                                               tmp_path: Path) -> None:
    """A worker restarted while its model's quota is removed and created again
    (the chaos run's seed 454089574) waits for the quota, one line per attempt,
    instead of exiting 2 every half second under its supervisor; a name that
    never had a quota is still an error at once."""
    none = start({**env, "BALANCER_START_WAIT": "120"}, tmp_path / "none.log", "worker", "--all-models")
    assert none.wait(60) == 2
    # Its last line (a first line may warn that the backend refuses connections: tests/cli/test_run.py).
    assert (tmp_path / "none.log").read_text().strip().splitlines()[-1].startswith("error: no model has a quota")

    quota(env, "set", "m", "--create", "--tpm", "60000", "--concurrency", "2")
    quota(env, "remove", "m")
    typo = start({**env, "BALANCER_START_WAIT": "120"}, tmp_path / "typo.log", "worker", "--model", "m", "--model", "nope")
    assert typo.wait(60) == 2
    assert (tmp_path / "typo.log").read_text().strip().splitlines()[-1] == "error: unknown model(s): nope"

    log = tmp_path / "worker.log"
    proc = start({**env, "BALANCER_START_WAIT": "120"}, log, "worker", "--model", "m")
    try:
        wait_for(lambda: log.read_text().count("waiting for a removed quota to come back") >= 2 or proc.poll() is not None,
                 60, "two waiting lines")
        assert proc.poll() is None and "no quota for m: removed at " in log.read_text(), log.read_text()
        every = start({**env, "BALANCER_START_WAIT": "120"}, tmp_path / "every.log", "worker", "--all-models")
        try:  # every quota removed: --all-models waits too (none ever: the error above)
            wait_for(lambda: "the last was removed at" in (tmp_path / "every.log").read_text() or every.poll() is not None,
                     60, "the --all-models worker's waiting line")
            assert every.poll() is None, (tmp_path / "every.log").read_text()
        finally:
            every.terminate()
            every.wait(30)
        quota(env, "set", "m", "--create", "--tpm", "60000", "--concurrency", "2")
        wait_for(lambda: "ready." in log.read_text() or proc.poll() is not None, 90, "the worker's start")
        assert proc.poll() is None and "ready." in log.read_text(), log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
