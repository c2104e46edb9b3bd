"""``balancer bench SCENARIO``: the pipeline vs today's Airflow pattern vs the capacity bound.

Runs, in one go and against the same simulator settings and services:
(a) the pipeline, (b) the baseline (bench/baseline.py), (c) the capacity
bound (balancer/capacity.py). Each run gets a fresh simulator (fresh limits,
fresh log) and its own schema and namespace. Writes report.json, report.md
and PNG plots under --out.

Scenarios of kind "overhead" and "backlog" go to bench/overhead.py and
bench/backlog.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from balancer.capacity import ModelCapacity, makespan_bound, pinned_work_floor
from balancer.report import estimate_accuracy, percentile, refill_gaps, rolling_series
from balancer.runner import IsolatedServices, RunResult, run_pipeline
from balancer.scenario import Scenario, parse_scenario
from balancer.sim.audit import Call, Limits, audit, limits_for

HERE = Path(__file__).resolve().parent
GRACE = 0.5


def load_sibling(name: str):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def capacity_bound(scenario: Scenario) -> float:
    """The bound in real seconds for this scenario's generated workload."""
    lines = scenario.task_lines()
    mean_tokens = sum(len(x["prompt"]) / 4 + 0.65 * x["max_tokens"] for x in lines) / len(lines)
    names = [m.name for m in scenario.models]
    pinned: dict[int, int] = {}
    for line in lines:
        if "model" in line:
            i = names.index(line["model"])
            pinned[i] = pinned.get(i, 0) + 1
    any_model = len(lines) - sum(pinned.values())
    models = [
        ModelCapacity(
            concurrency=m.max_concurrent_requests,
            mean_latency=m.latency.mean(seed=scenario.seed),
            tpm=m.max_tokens_per_minute,
            burst=m.burst,
            rpm=m.max_requests_per_minute,
        )
        for m in scenario.models
    ]
    return makespan_bound(models, tokens_per_task=mean_tokens, any_model=any_model, pinned=pinned) * scenario.time_scale


def pinned_floor(scenario: Scenario) -> float:
    """The realized pinned-work floor (balancer/capacity.py) for this scenario's
    workload, with the latencies the simulator will draw for it."""
    from balancer.sim.server import Simulator

    sim = Simulator(list(scenario.models), time_scale=scenario.time_scale, seed=scenario.seed)
    latencies: dict[str, list[float]] = {}
    for line in scenario.task_lines():
        if "model" in line:
            latency, _ = sim.draw(line["model"], line["prompt"], line["max_tokens"])
            latencies.setdefault(line["model"], []).append(latency)
    return pinned_work_floor(latencies, {m.name: m.max_concurrent_requests for m in scenario.models})


def limits(scenario: Scenario) -> dict[str, Limits]:
    return limits_for(scenario.quotas(), GRACE)


def calls(entries: list[dict[str, Any]]) -> list[Call]:
    return [Call(e["start"], e["end"], e["model"], e.get("prompt_tokens", 0) + e.get("completion_tokens", 0))
            for e in entries if e["status"] != 429]


def run_side_pipeline(scenario: Scenario, path: Path, console: Console) -> RunResult:
    with IsolatedServices(console, "bench") as iso:
        return run_pipeline(iso, quotas=scenario.quotas(), sim_args=["--scenario", str(path), "--seed", str(scenario.seed),
                            "--grace", str(GRACE)], backlog_jsonl=scenario.backlog_jsonl(), console=console)


def run_side_baseline(scenario: Scenario, path: Path, console: Console) -> RunResult:
    from balancer.runner import fetch_log
    from balancer.storage.tasks import status_counts

    baseline = load_sibling("baseline")
    with IsolatedServices(console, "baseline") as iso:
        iso.services.quotas.replace_all(scenario.quotas(), by="bench")
        total = iso.insert(scenario.backlog_jsonl())
        supervisor = iso.supervisor()
        url = iso.start_sim(supervisor, ["--scenario", str(path), "--seed", str(scenario.seed), "--grace", str(GRACE)])
        console.print(f"baseline: {baseline.WORKERS} workers x batches of {baseline.BATCH} on POST /batch ...")
        with Progress(TextColumn("baseline"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("baseline", total=total)
            timing = baseline.run_baseline(iso.services.engine, url, time_scale=scenario.time_scale,
                                           on_progress=lambda done: bar.update(task, completed=done),
                                           max_seconds=float(scenario.extra.get("baseline_max_seconds", 3600)))
        entries, _ = fetch_log(url, 0)
        result = RunResult(entries, timing["started"], timing["finished"], status_counts(iso.services.engine), iso.task_rows())
        result.counts["cycles"] = timing["cycles"]
        result.counts["unsolved"] = timing["unsolved"]
        return result


def side_stats(result: RunResult, scenario: Scenario) -> dict[str, Any]:
    lim = limits(scenario)
    caps = {name: l.cap for name, l in lim.items()}
    gaps = refill_gaps(result.entries, caps)
    delays = [(r.started_at - r.created_at).total_seconds() for r in result.rows if r.started_at and r.created_at]
    violations = audit(calls(result.entries), lim)
    return {
        "makespan_s": round(result.makespan, 2),
        "counts": result.counts,
        "calls": sum(1 for e in result.entries if e["status"] != 429),
        "rate_limited": sum(1 for e in result.entries if e["status"] == 429),
        "violations": len(violations),
        "violation_details": [str(v) for v in violations[:10]],
        "queueing_delay_s": {"p50": percentile(delays, 50), "p99": percentile(delays, 99)},
        "refill_gap_s": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99), "samples": len(gaps)},
        "tokens": estimate_accuracy(result.rows),
    }


def plot(results: dict[str, RunResult], scenario: Scenario, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lim = limits(scenario)
    names = [m.name for m in scenario.models]
    window = 60 * scenario.time_scale  # one scenario minute
    files = []
    for metric, label, limit_of in (
        ("tokens", "tokens per (scaled) minute", lambda l: l.tpm * scenario.time_scale),
        ("requests", "requests per (scaled) minute", lambda l: (l.rpm or 0) * scenario.time_scale),
        ("in_flight", "calls in flight", lambda l: l.cap),
    ):
        fig, axes = plt.subplots(len(names), len(results), figsize=(6 * len(results), 1.6 * len(names)), squeeze=False, sharex="col")
        for col, (side, result) in enumerate(results.items()):
            for row, name in enumerate(names):
                series = rolling_series(result.entries, name, t0=result.started, t1=max(result.finished, result.started + 1),
                                        window=window)
                ax = axes[row][col]
                ax.plot(series["t"], series[metric], lw=1)
                cap = limit_of(lim[name])
                if cap:
                    ax.axhline(cap, color="red", lw=0.8, ls="--")
                ax.set_ylabel(name, fontsize=7)
                ax.tick_params(labelsize=6)
                if row == 0:
                    ax.set_title(f"{side}: {label} (red: limit)", fontsize=8)
            axes[-1][col].set_xlabel("seconds since submit", fontsize=7)
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        files.append(path.name)
    return files


def write_markdown(report: dict[str, Any], out: Path) -> None:
    ms = report["makespan_s"]
    lines = [
        f"# Benchmark: {report['scenario']}",
        "",
        f"Command: `balancer bench {report['scenario_file']}` ({report['tasks']} tasks, {len(report['models'])} models, time scale {report['time_scale']})",
        "",
        "| | pipeline | baseline (Airflow pattern) | capacity bound |",
        "|---|---:|---:|---:|",
        f"| makespan (s) | {ms.get('pipeline')} | {ms.get('baseline')} | {ms['bound']} |",
        f"| 429s | {report.get('rate_limited')} | {report.get('baseline', {}).get('rate_limited')} | |",
        f"| limit violations | {report.get('violations')} | {report.get('baseline', {}).get('violations')} | |",
        "",
        f"Speedup (baseline / pipeline): **{report.get('speedup')}**. Utilization (bound / pipeline): **{report.get('utilization')}**.",
        "",
        f"Pinned-work floor for this workload's drawn latencies: {ms['pinned_floor']} s (no scheduler can finish "
        f"sooner; see docs/scenarios.md). Against max(bound, floor), utilization is **{report.get('utilization_vs_floor')}**.",
        "",
    ]
    p = report.get("pipeline")
    if p:
        lines += [
            f"Pipeline queueing delay (submitted → started): p50 {p['queueing_delay_s']['p50']} s, p99 {p['queueing_delay_s']['p99']} s.",
            f"Refill gap (slot freed at a saturated model → next call sent): p50 {p['refill_gap_s']['p50']} s, "
            f"p99 {p['refill_gap_s']['p99']} s over {p['refill_gap_s']['samples']} samples.",
            "",
            "| model | tasks | tokens estimated | tokens used | used / estimated |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, t in sorted(p["tokens"].items()):
            lines.append(f"| {name} | {t['tasks']} | {t['estimated']:,} | {t['actual']:,} | {t['actual'] / max(1, t['estimated']):.2f} |")
    lines += ["", *[f"![{f}]({f})" for f in report.get("plots", [])], ""]
    (out / "report.md").write_text("\n".join(lines))


def main(path: Path, out: Path, only: str | None) -> dict[str, Any]:
    console = Console()
    scenario = parse_scenario(path.read_text(), path.name)
    if scenario.kind in ("overhead", "backlog"):
        return load_sibling(scenario.kind).main(scenario, path, out, console)
    out.mkdir(parents=True, exist_ok=True)
    bound, floor = capacity_bound(scenario), pinned_floor(scenario)
    console.print(f"[bold]{scenario.name}[/bold]: {scenario.workload.tasks} tasks, {len(scenario.models)} models, "
                  f"time scale {scenario.time_scale}; capacity bound {bound:.1f} s; pinned-work floor {floor:.1f} s")
    results: dict[str, RunResult] = {}
    if only != "baseline":
        results["pipeline"] = run_side_pipeline(scenario, path, console)
    if only != "pipeline":
        results["baseline"] = run_side_baseline(scenario, path, console)
    report: dict[str, Any] = {
        "scenario": scenario.name,
        "scenario_file": str(path),
        "tasks": scenario.workload.tasks,
        "time_scale": scenario.time_scale,
        "models": [m.name for m in scenario.models],
        "makespan_s": {"bound": round(bound, 2), "pinned_floor": round(floor, 2)},
    }
    for side, result in results.items():
        report[side] = side_stats(result, scenario)
        report["makespan_s"][side] = report[side]["makespan_s"]
    if "pipeline" in results:
        report["rate_limited"] = report["pipeline"]["rate_limited"]
        report["violations"] = report["pipeline"]["violations"]
        report["utilization"] = round(bound / report["makespan_s"]["pipeline"], 3)
        report["utilization_vs_floor"] = round(max(bound, floor) / report["makespan_s"]["pipeline"], 3)
    if len(results) == 2:
        report["speedup"] = round(report["makespan_s"]["baseline"] / report["makespan_s"]["pipeline"], 2)
    report["plots"] = plot(results, scenario, out)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    write_markdown(report, out)
    console.print(f"makespan: {report['makespan_s']}  speedup: {report.get('speedup')}  utilization: "
                  f"{report.get('utilization')}  429s: {report.get('rate_limited')}  violations: {report.get('violations')}")
    console.print(f"report: {out / 'report.md'}")
    return report


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2] if len(sys.argv) > 2 else "bench/out"), None)
