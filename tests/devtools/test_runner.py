"""The isolated runner the demo, the benchmarks and the chaos run use
(balancer/devtools/runner.py): what it creates, it removes, and its clean-up
never hides the run's own result."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import sqlalchemy as sa
from rich.console import Console

from balancer.devtools.embedded import start_redis
from balancer.devtools.runner import IsolatedServices
from balancer.urls import normalize_database_url


def test_a_run_that_killed_its_own_redis_still_drops_its_schema_and_exits_cleanly(
        service_urls: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chaos run kills and restarts a Redis of its own; when that Redis is
    gone at the end, the runner's clean-up says so in one line instead of raising
    over the run's result, and still drops the schema it created."""
    redis = start_redis(tmp_path / "redis")
    monkeypatch.setenv("BALANCER_REDIS_URL", redis.url)
    monkeypatch.setenv("BALANCER_DATABASE_URL", service_urls[1])
    out = io.StringIO()
    try:
        with IsolatedServices(Console(file=out, width=200), "runnertest", keep_workdir=False) as iso:
            schema = iso.schema
            redis.stop()
    finally:
        redis.stop()
    assert "could not delete namespace" in out.getvalue()
    admin = sa.create_engine(normalize_database_url(service_urls[1]))
    with admin.connect() as conn:
        left = conn.execute(sa.text("SELECT 1 FROM information_schema.schemata WHERE schema_name = :s"),
                            {"s": schema}).first()
    admin.dispose()
    assert left is None


def test_its_children_run_the_code_of_the_run_that_started_them_whatever_the_working_directory(
        service_urls: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m balancer`` puts the working directory first on sys.path: a benchmark started
    from another checkout ran that checkout's pipeline whatever PYTHONPATH said. The children
    start from the tree this process's ``balancer`` came from."""
    other = tmp_path / "other-checkout"
    (other / "balancer").mkdir(parents=True)
    (other / "balancer" / "__init__.py").write_text("")
    (other / "balancer" / "__main__.py").write_text("print('the other checkout')\n")
    monkeypatch.chdir(other)
    monkeypatch.setenv("BALANCER_REDIS_URL", service_urls[0])
    monkeypatch.setenv("BALANCER_DATABASE_URL", service_urls[1])
    with IsolatedServices(Console(file=io.StringIO()), "runnertest", keep_workdir=False) as iso:
        child = iso.supervisor().start("help", ["--help"])
        assert child.process.wait(timeout=60) == 0
        out = child.log.read_text()
    assert "the other checkout" not in out
    assert "Usage" in out
