"""``balancer demo`` as a user runs it: a subprocess, JSON summary, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from balancer.urls import normalize_database_url

pytestmark = pytest.mark.e2e

KEYS = {"tasks", "solved", "failed", "makespan_s", "rate_limited", "violations", "models"}


#: Every process a demo in this test run starts inherits this variable; the
#: tests look for it, not at the machine's process list.
MARK = f"BALANCER_TEST_RUN={uuid.uuid4().hex}".encode()


def pipeline_pids() -> set[int]:
    """Live processes started by this test run's demos (the demo itself included)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or not ours to read
            continue
        if state != "Z" and MARK in environ.split(b"\0"):
            pids.add(int(entry.name))
    return pids


def demo_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALANCER_")}
    name, value = MARK.decode().split("=", 1)
    return {**env, name: value, **extra}


def check_summary(stdout: str, tasks: int) -> dict:
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert KEYS <= set(summary)
    assert summary["tasks"] == summary["solved"] == tasks and summary["failed"] == 0
    assert summary["violations"] == 0 and summary["rate_limited"] == 0
    assert len(summary["models"]) == 10
    for model in summary["models"].values():
        assert {"peak_in_flight", "max_concurrent_requests", "peak_tokens_60s", "limit_tokens_60s"} <= set(model)
        assert model["peak_in_flight"] <= model["max_concurrent_requests"]
        assert model["peak_tokens_60s"] <= model["limit_tokens_60s"]
    return summary


def test_demo_on_embedded_services() -> None:
    """The README's main command on a machine with no services configured."""
    before = pipeline_pids()
    proc = subprocess.run([sys.executable, "-m", "balancer", "demo", "--tasks", "60", "--json"],
                          env=demo_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_summary(proc.stdout, 60)
    assert pipeline_pids() <= before


def test_embedded_env_prints_the_urls_and_stop_stops_what_only_the_dead_held(tmp_path: Path) -> None:
    """`balancer embedded env` starts the embedded stack if it is not running and prints its URLs as
    shell exports (a source's table on the embedded PostgreSQL needs its URL). `embedded stop` stops
    it though a process killed before its exit handlers ran is still listed as holding it (before:
    "stopped redis, postgresql", and the PostgreSQL ran on); a live holder is named, not stopped under."""
    import json
    import shlex

    home = tmp_path / "home"
    env = demo_env(BALANCER_HOME=str(home))

    def balancer(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "balancer", *argv], env=env, capture_output=True, text=True,
                              timeout=120)

    def hold(pid: int) -> None:  # as pgserver lists a process that holds its server
        handles = home / "pg" / ".handle_pids.json"
        handles.write_text(json.dumps([*json.loads(handles.read_text()), pid]))

    proc = balancer("embedded", "env")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert proc.returncode == 0, proc.stderr
        # Said once, when they start (a new user's `db upgrade` left them running unannounced), on stderr
        started = f"started an embedded Redis and PostgreSQL in {home}: they stay up"
        assert started in proc.stderr and started not in balancer("embedded", "env").stderr, proc.stderr
        exports = dict(shlex.split(line)[1].split("=", 1) for line in proc.stdout.splitlines())
        assert sorted(exports) == ["BALANCER_DATABASE_URL", "BALANCER_REDIS_URL"]
        assert redis.Redis.from_url(exports["BALANCER_REDIS_URL"]).ping()
        engine = sa.create_engine(normalize_database_url(exports["BALANCER_DATABASE_URL"]))
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
        engine.dispose()
        hold(holder.pid)
        kept = balancer("embedded", "stop")
        assert kept.returncode == 2 and f"process(es) {holder.pid} still use it" in kept.stderr, kept.stderr
        assert (home / "pg" / "postmaster.pid").exists()
    finally:
        holder.kill()
        holder.wait()
    stopped = balancer("embedded", "stop")  # the holder is dead now, and still listed
    assert stopped.returncode == 0 and stopped.stdout.strip() == "stopped postgresql", stopped.stderr
    assert not (home / "pg" / "postmaster.pid").exists()


def demo_leftovers(redis_url: str, database_url: str) -> tuple[set[str], set[bytes]]:
    """The demo schemas and Redis keys on these services now (other runs' included)."""
    engine = sa.create_engine(normalize_database_url(database_url))
    with engine.connect() as conn:
        schemas = set(conn.execute(sa.text("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'balancer_demo_%'")).scalars())
    engine.dispose()
    client = redis.Redis.from_url(redis_url)
    keys = set(client.scan_iter(match="{demo-*")) | set(client.scan_iter(match="demo-*"))
    client.close()
    return schemas, keys


def test_demo_on_existing_services_cleans_up(service_urls: tuple[str, str], tmp_path: Path) -> None:
    """The demo leaves nothing behind: no process, work directory, schema or Redis key
    of its own (what other runs on the same services left is not this run's)."""
    redis_url, database_url = service_urls
    before = pipeline_pids()
    schemas_before, keys_before = demo_leftovers(redis_url, database_url)
    temp = tmp_path / "tmp"  # the demo's TMPDIR: its work directory must not outlive it
    temp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "balancer", "demo", "--tasks", "80", "--json"],
                          env=demo_env(BALANCER_REDIS_URL=redis_url, BALANCER_DATABASE_URL=database_url, TMPDIR=str(temp)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_summary(proc.stdout, 80)
    assert pipeline_pids() <= before
    assert [p.name for p in temp.iterdir() if p.name.startswith("balancer-demo-")] == []
    schemas_after, keys_after = demo_leftovers(redis_url, database_url)
    assert schemas_after - schemas_before == set()
    assert keys_after - keys_before == set()


def test_ctrl_c_stops_everything(service_urls: tuple[str, str]) -> None:
    redis_url, database_url = service_urls
    before = pipeline_pids()
    # SIGINT at its default in the demo: a test run started in the background of a shell inherits
    # it ignored, and so would the demo, which then never saw this test's Ctrl-C (it ran to its end).
    proc = subprocess.Popen([sys.executable, "-m", "balancer", "demo", "--tasks", "5000", "--time-scale", "1"],
                            env=demo_env(BALANCER_REDIS_URL=redis_url, BALANCER_DATABASE_URL=database_url),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while len(pipeline_pids() - before - {proc.pid}) < 4:  # sim, dispatcher, worker, beat
            assert time.monotonic() < deadline and proc.poll() is None, "demo never started its processes"
            time.sleep(0.5)
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "Traceback" not in out
    deadline = time.monotonic() + 20
    while pipeline_pids() - before:
        assert time.monotonic() < deadline, f"left running: {pipeline_pids() - before}"
        time.sleep(0.5)


def test_db_upgrade_says_once_that_it_started_the_embedded_servers_and_an_error_stays_one_line(tmp_path: Path) -> None:
    """A new user's `db upgrade` on a fresh directory printed only its revision, and left an
    embedded Redis and PostgreSQL running unannounced. It now says so the time it starts them;
    a command that fails after starting them still prints its one-line error alone."""
    from balancer.devtools.embedded import stop_stack

    home = tmp_path / "home"
    env = demo_env(BALANCER_HOME=str(home))

    def balancer(*argv: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "balancer", *argv], env={**env, **extra}, capture_output=True,
                              text=True, timeout=120)

    try:
        failed = balancer("quota", "list", BALANCER_REDIS_URL="redis://127.0.0.1:1/0", BALANCER_START_WAIT="0")
        assert failed.returncode == 2 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
        stop_stack(home)  # that one started the embedded PostgreSQL for its database
        first, again = balancer("db", "upgrade"), balancer("db", "upgrade")
        assert first.returncode == again.returncode == 0, first.stderr + again.stderr
        note = f"started an embedded Redis and PostgreSQL in {home}: they stay up"
        assert note in first.stdout and note not in again.stdout, first.stdout
        assert first.stdout.startswith("database at revision ")
    finally:
        stop_stack(home)
