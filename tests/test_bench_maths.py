"""Benchmark maths without servers: the capacity bound (hand-worked cases), scenarios, report."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

import balancer.capacity
import balancer.report
from balancer.capacity import ModelCapacity, makespan_bound, pinned_work_floor
from balancer.report import estimate_accuracy, percentile, refill_gaps, rolling_series
from balancer.scenario import ScenarioError, parse_scenario

ROOT = Path(__file__).parent.parent
UNLIMITED = dict(tpm=None, burst=0, rpm=None)


def bound(models, tasks: int, tokens: float = 100, pinned: dict[int, int] | None = None) -> float:
    pinned = pinned or {}
    return makespan_bound(models, tokens_per_task=tokens, any_model=tasks - sum(pinned.values()), pinned=pinned)


@pytest.mark.parametrize("module", [balancer.capacity, balancer.report])
def test_doctests(module) -> None:
    assert doctest.testmod(module).failed == 0


def test_concurrency_bound_by_hand() -> None:
    # 10 slots, 2 s per call: 5 tasks/s; 100 tasks take 20 s.
    assert bound([ModelCapacity(10, 2.0, **UNLIMITED)], 100) == pytest.approx(20.0, rel=1e-6)


def test_tpm_bound_with_burst_by_hand() -> None:
    # 6,000 TPM = 100 tokens/s = 1 task/s of 100 tokens, plus a 1,000-token burst = 10 tasks at t=0:
    # 30 tasks need 20 s.
    m = ModelCapacity(10**6, 0.001, tpm=6_000, burst=1_000)
    assert bound([m], 30) == pytest.approx(20.0, rel=1e-6)
    assert m.rate(100) == pytest.approx(1.0)


def test_rpm_bound_by_hand() -> None:
    # 60 RPM: 1 request/s plus a minute's burst of 60: 100 tasks need 40 s.
    assert bound([ModelCapacity(10**6, 0.001, tpm=None, burst=0, rpm=60)], 100) == pytest.approx(40.0, rel=1e-6)


def test_models_add_up_by_hand() -> None:
    # 5 tasks/s (concurrency) + 10 tasks/s (60,000 TPM of 100-token tasks) = 15/s: 150 tasks in 10 s.
    a = ModelCapacity(10, 2.0, **UNLIMITED)
    b = ModelCapacity(10**6, 0.001, tpm=60_000, burst=0)
    assert bound([a, b], 150) == pytest.approx(10.0, rel=1e-6)


def test_pinned_tasks_by_hand() -> None:
    # Together 10 tasks/s would do 100 tasks in 10 s, but 50 are pinned to a model doing 1/s: 50 s.
    slow = ModelCapacity(1, 1.0, **UNLIMITED)
    fast = ModelCapacity(9, 1.0, **UNLIMITED)
    assert bound([slow, fast], 100, pinned={0: 50}) == pytest.approx(50.0, rel=1e-6)
    assert bound([slow, fast], 100, pinned={1: 50}) == pytest.approx(10.0, rel=1e-6)


def test_pinned_work_floor_by_hand() -> None:
    # 3 slots, pinned latencies summing to 90 s: at least 30 s; a single 40 s task: at least 40 s.
    assert pinned_work_floor({"m": [10, 20, 30, 30]}, {"m": 3}) == pytest.approx(30.0)
    assert pinned_work_floor({"m": [10, 20, 30, 30], "n": [40]}, {"m": 3, "n": 8}) == pytest.approx(40.0)
    assert pinned_work_floor({}, {"m": 3}) == 0.0


def test_scenarios_parse_and_generate_reproducibly() -> None:
    for path in sorted((ROOT / "bench" / "scenarios").glob("*.toml")):
        scenario = parse_scenario(path.read_text(), path.name)
        assert scenario.models and scenario.workload.tasks >= 1
    short = parse_scenario((ROOT / "bench" / "scenarios" / "short.toml").read_text())
    lines = short.task_lines()
    assert lines == short.task_lines()  # same seed, same workload
    assert len(lines) == short.workload.tasks and len({x["prompt"] for x in lines}) == len(lines)
    pinned = sum(1 for x in lines if "model" in x) / len(lines)
    assert abs(pinned - short.workload.pinned_fraction) < 0.05


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "at least one [[models]]"),
        ("[[models]]\nname='a'\nmax_concurrent_requests=1\n", "max_tokens_per_minute"),
        ("[[models]]\nname='a'\nmax_concurrent_requests=0\nmax_tokens_per_minute=5\n[workload]\ntasks=1\n"
         "prompt_tokens={median=1,p99=1,min=1,max=1}\noutput_tokens={median=1,p99=1,min=1,max=1}", ">= 1"),
        ("kind='fast'\n[[models]]\nname='a'\nmax_concurrent_requests=1\nmax_tokens_per_minute=5\n[workload]\ntasks=1\n"
         "prompt_tokens={median=1,p99=1,min=1,max=1}\noutput_tokens={median=1,p99=1,min=1,max=1}", "kind"),
        ("[[models]]\nname='a'\nmax_concurrent_requests=1\nmax_tokens_per_minute=5\nlatency={median=5,p99=1,min=1,max=9}", "p99"),
        ("not toml = = 1", "invalid TOML"),
    ],
)
def test_bad_scenarios_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message.replace("[", r"\[")):
        parse_scenario(text)


def test_report_helpers() -> None:
    assert percentile([5, 1, 3], 50) == 3
    log = [dict(start=0.0, end=1.0, model="m", status=200, prompt_tokens=10, completion_tokens=5),
           dict(start=0.5, end=2.0, model="m", status=200, prompt_tokens=1, completion_tokens=1),
           dict(start=1.0, end=1.0, model="m", status=429)]
    series = rolling_series(log, "m", t0=0.0, t1=1.0, window=1.0, points=3)
    assert series["tokens"] == [15.0, 17.0, 2.0] and series["in_flight"] == [1.0, 2.0, 1.0]
    assert refill_gaps(log, {"m": 1}) == []  # never saturated at an end
    Row = namedtuple("Row", "model prompt_tokens completion_tokens estimated_tokens")
    acc = estimate_accuracy([Row("m", 10, 5, 20), Row("m", 1, 1, 4), Row(None, None, None, 9)])
    assert acc == {"m": {"tasks": 2, "estimated": 24, "actual": 17}}


@pytest.mark.e2e
def test_bench_short_end_to_end(tmp_path: Path, service_urls: tuple[str, str]) -> None:
    """What CI runs: short.toml, both sides, a complete report with zero violations."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("BALANCER_")}
    env.update(BALANCER_REDIS_URL=service_urls[0], BALANCER_DATABASE_URL=service_urls[1])
    proc = subprocess.run([sys.executable, "-m", "balancer", "bench", str(ROOT / "bench/scenarios/short.toml"),
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"makespan_s", "speedup", "utilization", "rate_limited", "violations"} <= set(report)
    assert set(report["makespan_s"]) == {"pipeline", "baseline", "bound", "pinned_floor"}
    assert report["violations"] == 0 and report["rate_limited"] == 0
    assert 0 < report["utilization"] <= report["utilization_vs_floor"] <= 1
    # No run can beat the realized floor: it is what the simulator will charge the pinned tasks.
    assert report["makespan_s"]["pipeline"] >= report["makespan_s"]["pinned_floor"]
    assert report["pipeline"]["counts"]["solved"] == report["tasks"]
    assert report["baseline"]["counts"]["unsolved"] == 0
    for name in ("tokens.png", "requests.png", "in_flight.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / name).stat().st_size > 5000
    markdown = (tmp_path / "report.md").read_text()
    assert "| makespan (s) |" in markdown and "Speedup" in markdown and "![tokens.png]" in markdown
