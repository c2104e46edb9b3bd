"""Redis through Sentinel: one URL form for the admission Redis and the broker,
checked at start, and a failover followed by every process without a restart.

The failover tests start their own master, replica and three Sentinels
(tests/sentinels.py) on ports of their own, and kill the master with SIGKILL.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from balancer.errors import ConfigError
from balancer.settings import Settings
from tests.sentinels import MASTER_NAME, RedisGroup, wait_until


def balancer(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "balancer", *argv], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("setting", ["BALANCER_REDIS_URL", "BALANCER_BROKER_URL"])
def test_the_sentinel_form_is_accepted_for_redis_and_the_broker(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    url = "sentinel://:pw@10.0.0.1:26379,10.0.0.2:26380,s3/mymaster/2"
    monkeypatch.setenv(setting, url)
    settings = Settings.from_env()
    assert getattr(settings, setting.removeprefix("BALANCER_").lower()) == url


@pytest.mark.parametrize(("url", "says"), [
    ("sentinel://h1:26379;sentinel://h2:26379", "in one URL"),  # kombu's own form: no master's name
    ("sentinel://h1:26379", "master's name is missing"),
    ("sentinel://h1:26379/mymaster/x", "database number"),
    ("sentinel://h1:26379/mymaster/0?master_name=m", "no query options"),
    ("sentinel://h1:notaport/mymaster", "is not host[:port]"),
])
@pytest.mark.parametrize("setting", ["BALANCER_REDIS_URL", "BALANCER_BROKER_URL"])
def test_a_sentinel_url_without_what_failover_needs_is_one_line_and_exit_2(setting: str, url: str, says: str) -> None:
    """Before: the broker took ``sentinel://h1;sentinel://h2`` and every process then exited
    every 3 s ("'master_name' transport option must be specified"); the admission Redis
    refused sentinel:// outright."""
    proc = balancer({setting: url}, "quota", "list")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and setting in lines[0] and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    with pytest.raises(ConfigError, match=setting):
        os.environ[setting] = url
        try:
            Settings.from_env()
        finally:
            del os.environ[setting]


@pytest.fixture
def sentinel_group(tmp_path: Path):  # noqa: ANN201
    group = RedisGroup.on_loopback(tmp_path / "redis")
    try:
        yield group.start()
    finally:
        group.stop()


def test_a_client_follows_the_promoted_replica_without_a_new_client(sentinel_group: RedisGroup) -> None:
    """The admission Redis's client (the one every process makes) writes to the master
    the Sentinels name: after the master is killed, the same client object writes to
    the promoted replica, once the Sentinels have agreed."""
    from balancer.snapshot import redis_client

    client = redis_client(sentinel_group.url(db=3))
    client.set("probe", "before")
    sentinel_group.kill_master()
    sentinel_group.wait_failover()

    def written_after() -> bool:
        return bool(client.set("probe", "after"))

    wait_until(written_after, 30, "a write through the same client after the failover")
    promoted = redis.Redis(sentinel_group.replica.host, sentinel_group.replica.port, db=3)
    assert promoted.get("probe") == b"after"


def test_an_unreachable_sentinel_group_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from balancer.devtools.embedded import free_port

    url = f"sentinel://127.0.0.1:{free_port()}/{MASTER_NAME}/0"
    proc = balancer({"BALANCER_REDIS_URL": url, "BALANCER_START_WAIT": "0"}, "quota", "list")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "BALANCER_REDIS_URL" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_pipeline_finishes_its_work_through_a_master_failover(pipeline, migrated: dict[str, str],
                                                                   sentinel_group: RedisGroup) -> None:
    """Admission and broker both through Sentinel: the master is killed mid-run, and the
    same dispatcher, beat and workers (none restarted, none exited) finish every task,
    each answered once, no call over a cap and no 429 at the simulator."""
    from tests.pipeline_harness import prompt_lines

    p = pipeline(time_scale=0.05, extra_env={"BALANCER_REDIS_URL": sentinel_group.url(),
                                             "BALANCER_LEASE_SECONDS": "6"}).start()
    pids = [c.process.pid for c in p.supervisor.children]
    ids = p.submit(prompt_lines(240, [m.name for m in p.models], pinned_every=0))
    wait_until(lambda: p.counts()["solved"] >= 40, 60, "40 tasks solved before the fault")
    sentinel_group.kill_master()
    killed_with = p.counts()["solved"]
    sentinel_group.wait_failover()
    counts = p.wait_done(len(ids), timeout=150)
    assert killed_with < len(ids), "the run ended before the fault: nothing was tested"
    assert counts["solved"] == len(ids) and counts["failed"] == 0, counts
    assert [c.process.pid for c in p.supervisor.children] == pids  # the same processes, none restarted
    p.supervisor.check_alive()
    entries = p.sim_log()
    assert [e for e in entries if e["status"] == 429] == []
    assert p.violations() == []
    assert all(row.status == "solved" and row.answer for row in p.rows())
    ok_calls = [e for e in entries if e["status"] == 200]
    assert len(ids) <= len(ok_calls) <= len(ids) + sum(row.hedges for row in p.rows())
    # The run's admission state lives on the promoted replica now.
    assert sentinel_group.master_address() == (sentinel_group.replica.host, sentinel_group.replica.port)
