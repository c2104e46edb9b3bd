"""Benchmark maths without servers: the capacity bound (hand-worked cases), scenarios, report."""

from __future__ import annotations

import doctest
import json
from collections import namedtuple
from dataclasses import fields
from pathlib import Path

import pytest

import balancer.bench.compare.report
import balancer.estimates.capacity
from balancer.bench.compare.report import (
    backlog_out,
    estimate_accuracy,
    last_solved,
    limit_utilization,
    percentile,
    refill_gaps,
    rolling_series,
)
from balancer.devtools.scenario import ScenarioError, Workload, parse_scenario
from balancer.devtools.sim.audit import Limits
from balancer.devtools.sim.config import SimModel
from balancer.estimates.capacity import ModelCapacity, makespan_bound, pinned_work_floor

ROOT = Path(__file__).parents[2]
UNLIMITED = dict(tpm=None, burst=0, rpm=None)


def bound(models, tasks: int, tokens: float = 100, pinned: dict[int, int] | None = None) -> float:
    pinned = pinned or {}
    return makespan_bound(models, tokens_per_task=tokens, any_model=tasks - sum(pinned.values()), pinned=pinned)


@pytest.mark.parametrize("module", [balancer.estimates.capacity, balancer.bench.compare.report])
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


def test_a_model_lost_part_way_counts_what_it_did_until_then_by_hand() -> None:
    # 10 + 5 tasks/s: 300 tasks in 20 s. The first lost at 4 s has done 40 by then; the second's
    # 5 a second do the rest: 40 + 5 T = 300 at T = 52 s.
    a, b = ModelCapacity(10, 1.0, **UNLIMITED), ModelCapacity(5, 1.0, **UNLIMITED)
    assert bound([a, b], 300) == pytest.approx(20.0, rel=1e-6)
    lost = makespan_bound([a, b], tokens_per_task=100, any_model=300, pinned={}, lost_at={0: 4.0})
    assert lost == pytest.approx(52.0, rel=1e-6)


def test_lines_bound_on_simulated_models_by_hand() -> None:
    """The bench's bound of task lines on simulated models, in real seconds: two models of fixed
    latency (1 s of scenario time, 0.5 s real at time scale 0.5) and no token or request limit."""
    from balancer.bench.compare.bounds import lines_bound
    from balancer.devtools.sim.config import Latency

    fixed = Latency(median=1.0, p99=1.0, low=1.0, high=1.0)
    models = [SimModel("a", 10, 10**9, latency=fixed), SimModel("b", 5, 10**9, latency=fixed)]
    lines = [{"prompt": "p" * 40, "max_tokens": 10}] * 300
    assert lines_bound(models, lines, seed=0, time_scale=0.5) == pytest.approx(10.0, rel=1e-6)  # 20 s of scenario time
    # "a" lost 2 real seconds (4 scenario seconds) in: 52 scenario seconds, as in the test above
    assert lines_bound(models, lines, seed=0, time_scale=0.5, lost_at_s={"a": 2.0}) == pytest.approx(26.0, rel=1e-6)
    # pinned lines stay on their model: 100 on "b" alone take 20 scenario seconds
    pinned = [{"prompt": "p", "max_tokens": 1, "model": "b"}] * 100
    assert lines_bound(models, pinned, seed=0, time_scale=1.0) == pytest.approx(20.0, rel=1e-6)


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
    for path in sorted((ROOT / "balancer" / "bench" / "scenarios").glob("*.toml")):
        scenario = parse_scenario(path.read_text(), path.name)
        assert scenario.models and scenario.workload.tasks >= 1
    short = parse_scenario((ROOT / "balancer" / "bench" / "scenarios" / "short.toml").read_text())
    lines = short.task_lines()
    assert lines == short.task_lines()  # same seed, same workload
    assert len(lines) == short.workload.tasks and len({x["prompt"] for x in lines}) == len(lines)
    pinned = sum(1 for x in lines if "model" in x) / len(lines)
    assert abs(pinned - short.workload.pinned_fraction) < 0.05
    scenario.check_pinned_fit()  # every bundled scenario's pinned tasks fit their model's burst


def test_a_pinned_task_over_its_models_burst_stops_the_bench_before_it_starts(tmp_path: Path) -> None:
    # Seed 9001's gen-1 in miniature: a task pinned to a model whose burst_tokens is below its estimate.
    from balancer.bench.compare.run import prepare

    text = ("name='tight'\n[[models]]\nname='a'\nmax_concurrent_requests=1\nmax_tokens_per_minute=60000\n"
            "burst_tokens={burst}\n[workload]\ntasks=3\npinned_fraction=1.0\n"
            "prompt_tokens={{median=100,p99=100,min=100,max=100}}\noutput_tokens={{median=50,p99=50,min=50,max=50}}\n")
    parse_scenario(text.format(burst=150), "fits").check_pinned_fit()  # 100 + 50 = 150 tokens: fits exactly
    (tmp_path / "tight.toml").write_text(text.format(burst=149))
    with pytest.raises(ScenarioError, match=r"3 task\(s\) pinned .* needs 150 tokens on a \(burst_tokens 149\)"):
        prepare(str(tmp_path / "tight.toml"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written, nothing started


#: One value per SimModel / Workload field, each unlike its default: a field added to either
#: dataclass fails the test below until parse_scenario reads it (a key it accepts, since the
#: accepted keys are the fields, but never read would be the silent drop it refuses).
EVERY_MODEL_KEY = {
    "name": "'m'", "max_concurrent_requests": "3", "max_tokens_per_minute": "6000", "max_requests_per_minute": "60",
    "burst_tokens": "500", "latency": "{median=2.0,p99=3.0,min=1.0,max=4.0}", "error_rate": "0.1", "weight": "2",
    "accounting": "'settle'", "rpm_window": "10", "headers": "false", "foreign_share": "0.2", "on_disconnect": "'stop'",
    "real_tokens": "0.5", "real_requests": "0.5", "real_concurrency": "0.5", "limit_changes": "[[1, 0.5]]",
    "limit_headers": "false",
    "headers_at": "\"response\"",
}
EVERY_WORKLOAD_KEY = {
    "tasks": "2", "prompt_tokens": "{median=9,p99=9,min=9,max=9}", "output_tokens": "{median=8,p99=8,min=8,max=8}",
    "pinned_fraction": "0.5", "priorities": "[1]", "sources": "['s']",
}


def test_every_field_of_a_model_and_the_workload_is_read_from_its_key() -> None:
    assert set(EVERY_MODEL_KEY) == {f.name for f in fields(SimModel)}
    assert set(EVERY_WORKLOAD_KEY) == {f.name for f in fields(Workload)}
    text = "\n".join(["[[models]]", *(f"{k} = {v}" for k, v in EVERY_MODEL_KEY.items()),
                      "[workload]", *(f"{k} = {v}" for k, v in EVERY_WORKLOAD_KEY.items())])
    scenario = parse_scenario(text)
    for parsed, kind in ((scenario.models[0], SimModel), (scenario.workload, Workload)):
        defaults = {f.name: f.default for f in fields(kind)}
        assert [k for k, v in defaults.items() if getattr(parsed, k) == v] == [], f"{kind.__name__} fields left at their default"


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
        ("[[models]]\nname='a'\nmax_concurrent_requests=1\nmax_tokens_per_minute=5\nlearn=false\n", "models[0]: unknown key: learn"),
        ("[[models]]\nname='a'\nmax_concurrent_requests=1\nmax_tokens_per_minute=5\n[workload]\ntask=1\n", "workload: unknown key: task "),
        ("[[models]]\nname='a'\nmax_concurrent_requests=1\nmax_tokens_per_minute=5\nlatency={median=1,p99=1,min=1,max=1,mean=1}",
         "models[0].latency: unknown key: mean"),
        ("models = [1]", "models[0]: expected a table, got 1"),
        ("models = 'abc'", "models: expected [[models]] tables"),
        ("workload = 3\n[[models]]\nname='a'\nmax_concurrent_requests=1\nmax_tokens_per_minute=5", "workload: expected a table"),
    ],
)
def test_bad_scenarios_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message.replace("[", r"\[")):
        parse_scenario(text)


def test_report_helpers() -> None:
    assert percentile([5, 1, 3], 50) == 3
    log = [dict(start=0.0, end=1.0, model="m", status=200, prompt_tokens=10, completion_tokens=5, counted=15),
           dict(start=0.5, end=2.0, model="m", status=200, prompt_tokens=1, completion_tokens=1, counted=2),
           dict(start=1.0, end=1.0, model="m", status=429)]
    series = rolling_series(log, "m", t0=0.0, t1=1.0, window=1.0, points=3)
    assert series["tokens"] == [15.0, 17.0, 2.0] and series["in_flight"] == [1.0, 2.0, 1.0]
    assert refill_gaps(log, {"m": 1}) == []  # never saturated at an end
    assert backlog_out(log) == 1.0
    # Concurrency-bound over [0, 2]: 2.5 call-seconds on 2 slots; tokens 17 of 100 + 60·2/60.
    assert limit_utilization(log, {"m": Limits(cap=2, tpm=60, rpm=None, burst=100)}, 0.0, 2.0) == {"m": 0.625}
    # TPM-bound: 17 tokens counted against a burst of 10 + 2 s of 3 tokens/s (17 / 16, rounded half to even).
    assert limit_utilization(log, {"m": Limits(cap=8, tpm=180, rpm=None, burst=10)}, 0.0, 2.0) == {"m": 1.062}
    Row = namedtuple("Row", "model prompt_tokens completion_tokens estimated_tokens")
    acc = estimate_accuracy([Row("m", 10, 5, 20), Row("m", 1, 1, 4), Row(None, None, None, 9)])
    assert acc == {"m": {"tasks": 2, "estimated": 24, "actual": 17}}


def test_the_tasks_solved_last_list_their_calls_from_the_backends_log() -> None:
    """Issue 39's tail was read from each run's call log by hand, session after session: which
    call set the end, and when its hedge went out. The report now lists them per task, matched
    by the prompt's key, in the order they started (the log is in the order they ended); a 429 is
    not a call that ran."""
    from datetime import UTC, datetime

    from balancer.bench.compare.side_stats import calls_of_task
    from balancer.devtools.sim.provider import prompt_key

    def at(s: float) -> datetime:
        return datetime.fromtimestamp(100 + s, UTC)

    Row = namedtuple("Row", "id status model hedges hedge_model started_at solved_at prompt")
    rows = [Row(7, "solved", "fast", 1, "fast", at(10), at(24.5), "the straggler"),
            Row(8, "solved", "fast", 0, None, at(20), at(21), "a quick one")]
    log = [dict(prompt_key=prompt_key("a quick one"), model="fast", start=120.0, end=121.0, status=200),
           dict(prompt_key=prompt_key("the straggler"), model="fast", start=121.0, end=121.0, status=429),
           dict(prompt_key=prompt_key("the straggler"), model="fast", start=122.0, end=124.5, status=200),
           dict(model="fast", start=123.0, end=124.0, status=200),  # a log entry with no prompt key: no task's
           dict(prompt_key=prompt_key("the straggler"), model="slow", start=110.0, end=131.0, status=200)]
    tail = last_solved(rows, started=100.0, calls_of=calls_of_task(log))
    assert [t["task"] for t in tail] == [7, 8]
    assert tail[0]["calls"] == [["slow", 10.0, 21.0], ["fast", 22.0, 2.5]]
    assert tail[1]["calls"] == [["fast", 20.0, 1.0]]


def test_the_shipped_grafana_dashboard_is_the_panels_definition() -> None:
    """docs/grafana-dashboard.json is generated from PANELS (`python -m
    balancer.bench.compare.dashboard --json-only`): editing one without the other fails."""
    import json
    from pathlib import Path

    from balancer.bench.compare.dashboard import PANELS, grafana_json
    from balancer.views.metrics import BalancerCollector

    shipped = json.loads((Path(__file__).parents[2] / "docs" / "grafana-dashboard.json").read_text())
    assert shipped == grafana_json()
    exported = {m.name for m in BalancerCollector(None).describe()}
    for panel in PANELS:  # every panel queries a metric the exporter has
        for query in panel.queries:
            base = query.metric.removesuffix("_total")
            assert base in exported, query.metric


def test_dashboard_quantiles_and_rates_on_hand_made_scrapes() -> None:
    import math

    from balancer.bench.compare.dashboard import Query, evaluate

    def scrape(a_le1: float, a_inf: float, calls: float) -> dict:
        return {
            ("lat_bucket", (("le", "1.0"), ("model", "a"))): a_le1,
            ("lat_bucket", (("le", "+Inf"), ("model", "a"))): a_inf,
            ("calls_total", (("model", "a"), ("outcome", "solved"))): calls,
        }

    history = [(0.0, scrape(0, 0, 100)), (30.0, scrape(30, 40, 160)), (60.0, scrape(35, 60, 10))]
    p50 = evaluate(Query("lat", "quantile", q=0.5), history)["a"]
    assert [t for t, _ in p50] == [30.0, 60.0]
    assert math.isclose(p50[0][1], 20 / 30)  # rank 20 of 40, 30 of them at or below 1 s
    assert math.isclose(p50[1][1], 1.0)  # rank 10 of 20, only 5 at or below 1 s: the highest finite edge
    rates = evaluate(Query("calls_total", "rate", {"outcome": "solved"}), history)["a"]
    assert rates == [(30.0, 2.0), (60.0, 10 / 30)]  # the drop to 10 is a counter reset: its increase is 10


def test_eta_replay_reproduces_the_recorded_eta_and_replays_the_early_latency(tmp_path) -> None:  # noqa: ANN001
    """A recorded run of one model on its prior (10 s a call): replayed with the prior, each
    mark reads the ETA the run recorded; with the early latency, the calls the log shows
    answered in 2 s pull the model's mean down, so the ETA is shorter."""
    from dataclasses import asdict

    from balancer.bench.compare.eta_replay import VARIANTS, replay
    from balancer.estimates.capacity import ModelCapacity
    from balancer.views import eta

    polls = []
    for at, done in [(1.0, 1), (3.0, 3), (5.0, 5), (8.0, 8)]:
        state = eta.DrainState({"m": ModelCapacity(1, 10.0, None, 1e9)}, [(None, 10 - done)], {"m": 0}, 100.0,
                               on_prior=["m"], unfinished=10 - done)
        forecast = eta.forecast(state)
        polls.append({"at_s": at, "done": done, "makespan_s": 20.0, "eta_s": forecast.eta, "low_s": forecast.low,
                      "high_s": forecast.high, "state": {**asdict(state), "on_prior": ["m"],
                                                         "models": {"m": asdict(state.models["m"])}}})
    calls = [{"model": "m", "status": 200, "start": 100.0 + 2 * i, "end": 102.0 + 2 * i} for i in range(10)]
    (tmp_path / "pipeline-eta.jsonl").write_text("".join(json.dumps(p) + "\n" for p in polls))
    (tmp_path / "pipeline-calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    as_recorded = replay(tmp_path, VARIANTS["prior"])
    assert [r["eta_s"] for r in as_recorded] == pytest.approx([p["eta_s"] for p in polls])
    early = replay(tmp_path, VARIANTS["current"])
    assert all(e["eta_s"] < r["eta_s"] for e, r in zip(early[1:], as_recorded[1:], strict=True))


def test_eta_replay_reads_the_recorded_latency_spread_or_replays_it_fixed(tmp_path) -> None:  # noqa: ANN001
    """A run recorded with its model's latency spread (E[L²]/E[L]² = 3): replayed as recorded,
    its end tail is 3 x 10 / 2 s; with ``spread`` off, half a call (5 s), 10 s shorter at every mark."""
    from dataclasses import asdict

    from balancer.bench.compare.eta_replay import VARIANTS, replay
    from balancer.estimates.capacity import ModelCapacity
    from balancer.views import eta

    polls = []
    for at, done in [(1.0, 1), (3.0, 3), (5.0, 5), (8.0, 8)]:
        state = eta.DrainState({"m": ModelCapacity(1, 10.0, None, 1e9, latency_dispersion=3.0)}, [(None, 10 - done)],
                               {"m": 0}, 100.0, unfinished=10 - done)
        forecast = eta.forecast(state)
        polls.append({"at_s": at, "done": done, "makespan_s": 120.0, "eta_s": forecast.eta, "low_s": forecast.low,
                      "high_s": forecast.high, "state": {**asdict(state), "on_prior": [],
                                                         "models": {"m": asdict(state.models["m"])}}})
    (tmp_path / "pipeline-eta.jsonl").write_text("".join(json.dumps(p) + "\n" for p in polls))
    (tmp_path / "pipeline-calls.jsonl").write_text(json.dumps({"model": "m", "status": 200, "start": 0.0, "end": 120.0}))
    read = replay(tmp_path, VARIANTS["current"])
    assert [r["eta_s"] for r in read] == pytest.approx([p["eta_s"] for p in polls])
    fixed = replay(tmp_path, VARIANTS["current"], spread=False)
    assert [r["eta_s"] - f["eta_s"] for r, f in zip(read, fixed, strict=True)] == pytest.approx([10.0] * len(read))


def test_tail_ceiling_hedges_what_was_unanswered_at_the_backlogs_end_on_the_simulators_own_draws(tmp_path) -> None:  # noqa: ANN001
    """A run of three tasks on "slow", submitted at 100.0 s, its first call at 100.3 s: two answered
    by 4.3 s, the third at 30.3 s (its makespan). Hedged at the backlog's end (5 s, +0.05) on
    "fast", the third ends at 5.05 + what the simulator draws for it there; a run with nothing
    unanswered then keeps its own utilization (the log read on the report's clock)."""
    from click.testing import CliRunner

    from balancer.bench.compare.tail_ceiling import ceilings, main
    from balancer.devtools.sim.provider import Simulator, prompt_key
    from tests.scenario_text import scenario_text

    text = scenario_text("tiny", """[[models]]
name = "slow"
max_concurrent_requests = 4
max_tokens_per_minute = 1000000
latency = { median = 8.0, p99 = 60.0, min = 1.0, max = 120.0 }
[[models]]
name = "fast"
max_concurrent_requests = 4
max_tokens_per_minute = 1000000
latency = { median = 0.5, p99 = 2.0, min = 0.1, max = 120.0 }
""", seed=3, tasks=3)
    scenario = parse_scenario(text, "tiny")
    keys = [prompt_key(line["prompt"]) for line in scenario.task_lines()]

    def record(ends: list[float]) -> float:
        calls = [dict(model="slow", status=200, start=100.3 + i, end=100.0 + end, prompt_key=key, client_gone=False)
                 for i, (key, end) in enumerate(zip(keys, ends, strict=True))]
        (tmp_path / "pipeline-calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
        utilization = round(12.0 / max(ends), 3)
        (tmp_path / "report.json").write_text(json.dumps({
            "utilization": utilization, "makespan_s": {"bound": 12.0, "pipeline": max(ends)},
            "pipeline": {"backlog_out_s": 5.0}}))
        return utilization

    (tmp_path / "tiny.toml").write_text(text)
    utilization = record([3.3, 4.3, 30.3])
    last = scenario.task_lines()[2]
    draw = Simulator(list(scenario.models), time_scale=1.0, seed=3).draw("fast", last["prompt"], last["max_tokens"])[0]
    out = ceilings(tmp_path, ["fast"], 0.05)
    assert out["open_at_out"] == 1
    assert out["one"] == out["all_on"] == round(12.0 / (5.05 + draw), 3) > utilization
    cli = CliRunner().invoke(main, [str(tmp_path), "--on", "fast", "--on", "slow"])
    assert cli.exit_code == 0 and f"| {tmp_path.name} | {utilization} | 5.0 | 1 | {out['one']} |" in cli.output, cli.output
    utilization = record([3.3, 4.3, 4.8])  # all answered before the backlog's end: nothing to hedge
    assert ceilings(tmp_path, ["fast"], 0.05)["every_model"] == utilization
