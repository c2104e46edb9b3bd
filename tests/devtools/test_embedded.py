"""The persistent embedded stack (``BALANCER_HOME``) as the tests meet it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_command_run_with_no_urls_starts_its_stack_in_the_sessions_home_not_the_checkout(balancer_home: Path) -> None:
    """A ``balancer`` command a test runs with no ``BALANCER_*_URL`` and no home of its own, from the
    checkout, starts its embedded Redis and PostgreSQL under the session's BALANCER_HOME (stopped at
    the session's end), not in the checkout's ``.balancer``, where three runs left them running."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_URL") or not k.startswith("BALANCER_")}
    had_checkout_stack = (ROOT / ".balancer").exists()
    done = subprocess.run([sys.executable, "-m", "balancer", "quota", "list"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode in (0, 2), done.stderr[-2000:]  # 2: "database schema is at revision none"
    assert (balancer_home / "redis" / "redis.pid").exists(), done.stderr[-2000:]
    assert had_checkout_stack or not (ROOT / ".balancer").exists()


def test_a_stopped_redis_server_is_gone_not_left_a_zombie(tmp_path: Path) -> None:
    """stop() on a server this process started reaps it. It used to wait for ``kill(pid, 0)`` to fail,
    which a zombie never makes fail: every stop then waited its full 5 s (at the end of every test
    session, and once per Redis server a chaos run started) and left the zombie behind."""
    from balancer.devtools.embedded import start_redis

    server = start_redis(tmp_path / "redis")
    server.stop()
    status = Path(f"/proc/{server.pid}/status")
    state = [line for line in status.read_text().splitlines() if line.startswith("State:")] if status.exists() else []
    assert state == [], f"redis-server {server.pid} after stop(): {state}"
