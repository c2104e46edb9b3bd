"""Hypothesis drives the real CLI, in a subprocess, with hostile input.

Whatever the input: the exit code is 0, 2 or 3, no output holds a traceback
or a raw escape sequence, and an input refused as a whole (exit 2) leaves
PostgreSQL and Redis exactly as they were. ``CLI_FUZZ_EXAMPLES`` sets the
examples per target (each one is a process start, about a second).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer.admission import keys
from balancer.storage.schema import quota_changes, quotas, tasks

pytestmark = [pytest.mark.faults, pytest.mark.usefixtures("migrated")]

EXAMPLES = int(os.environ.get("CLI_FUZZ_EXAMPLES", "15"))
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

hostile_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60) | st.sampled_from(
    ["\x00", "\ud800", "\u2028", "\u2029", "\x85", "\ufeff", "\x1b[31m", "\r", "[" * 3000, "1e999", "NaN", "-0"]
)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | hostile_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_text, inner, max_size=3),
    max_leaves=8,
)
task_like = st.fixed_dictionaries(
    {"prompt": st.one_of(hostile_text, json_value)},
    optional={"model": json_value, "models": json_value, "priority": json_value, "max_tokens": json_value,
              "source": json_value},
)


def as_line(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


jsonl_line = st.one_of(task_like.map(as_line), json_value.map(as_line), st.binary(max_size=80),
                       hostile_text.map(lambda t: t.encode("utf-8", "surrogatepass")))


def cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "balancer", *argv], env={**os.environ, **env}, capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=120)


def snapshot(env: dict[str, str]) -> tuple:
    """Everything a command could change: the tables' rows and this namespace's Redis keys."""
    from balancer.storage.db import cached_engine

    engine = cached_engine(env["BALANCER_DATABASE_URL"])
    with engine.connect() as conn:
        rows = tuple(tuple(conn.execute(sa.select(t).order_by(*t.primary_key.columns)).all())
                     for t in (quotas, quota_changes, tasks))
    client = redis.Redis.from_url(env["BALANCER_REDIS_URL"])
    # The dispatch-request flags expire by themselves (an earlier accepted submit set them).
    expiring = {k.encode() for k in keys.dispatch_flags(env["BALANCER_NAMESPACE"])}
    stored = {}
    for pattern in keys.namespace_patterns(env["BALANCER_NAMESPACE"]):
        for key in client.scan_iter(match=pattern):
            if key not in expiring:
                stored[key] = client.dump(key)
    return rows, stored


def check(done: subprocess.CompletedProcess, before: tuple, env: dict[str, str], allowed: tuple[int, ...]) -> None:
    output = done.stdout + done.stderr
    assert done.returncode in allowed, output
    assert b"Traceback" not in output, output
    assert b"\x1b" not in output, output  # nothing hostile reaches the terminal raw
    if done.returncode == 2:
        assert snapshot(env) == before  # refused as a whole: nothing changed


@pytest.fixture
def with_model(migrated: dict[str, str]) -> dict[str, str]:
    assert cli({}, "quota", "set", "m", "--create", "--tpm", "600000", "--concurrency", "2").returncode == 0
    return migrated


@fuzz
@given(lines=st.lists(jsonl_line, min_size=1, max_size=6))
def test_submit_fuzz(with_model: dict[str, str], tmp_path_factory: pytest.TempPathFactory, lines: list[bytes]) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "tasks.jsonl"
    path.write_bytes(b"\n".join(lines))
    before = snapshot(with_model)
    check(cli({}, "submit", str(path)), before, with_model, (0, 2, 3))


quota_value = st.one_of(json_value, st.integers(-(10**12), 10**12), st.sampled_from(["reserve", "settle", "stop"]))
quota_table = st.dictionaries(
    st.sampled_from(["max_concurrent_requests", "max_tokens_per_minute", "weight", "burst_tokens", "enabled",
                     "token_accounting", "expected_latency_s", "on_disconnect", "colour"]),
    quota_value, max_size=5,
)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if value == value and abs(value) != float("inf") else "nan"
    return json.dumps(str(value))


@fuzz
@given(models=st.dictionaries(hostile_text, quota_table, max_size=3), raw=st.binary(max_size=60), use_raw=st.booleans())
def test_quota_import_fuzz(with_model: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
                           models: dict[str, dict], raw: bytes, use_raw: bool) -> None:
    text = "".join(f"[models.{json.dumps(name)}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in table.items())
                   for name, table in models.items())
    path = tmp_path_factory.mktemp("fuzz") / "quotas.toml"
    path.write_bytes(raw if use_raw else text.encode("utf-8", "surrogatepass"))
    before = snapshot(with_model)
    check(cli({}, "quota", "import", str(path)), before, with_model, (0, 2))


FUZZED_SETTINGS = ["BALANCER_BACKEND_TIMEOUT", "BALANCER_WRITE_GRACE", "BALANCER_LEASE_SECONDS",
                   "BALANCER_VISIBILITY_TIMEOUT", "BALANCER_DISPATCH_TICK", "BALANCER_SWEEP_TICK",
                   "BALANCER_INGEST_TICK", "BALANCER_MAX_ATTEMPTS", "BALANCER_DISPATCH_WINDOW", "BALANCER_HEDGE_BUDGET",
                   "BALANCER_END_GAME", "BALANCER_BACKEND_KIND", "BALANCER_BACKEND_URL", "BALANCER_BROKER_URL",
                   "BALANCER_EXPECTED_LATENCY_S", "BALANCER_MAX_HEDGES", "BALANCER_ROUTER_LEASE_SECONDS"]
setting_value = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1,
            max_size=30),
    st.floats().map(repr), st.integers().map(str),
    st.sampled_from(["nan", "inf", "-inf", "0", "1e-9", "1e309", "garbage://x", "http://", "redis://h/abc", "amqp://"]),
)


@fuzz
@given(values=st.dictionaries(st.sampled_from(FUZZED_SETTINGS), setting_value, min_size=1, max_size=3))
def test_settings_fuzz(with_model: dict[str, str], values: dict[str, str]) -> None:
    before = snapshot(with_model)
    check(cli(values, "quota", "list"), before, with_model, (0, 2))
