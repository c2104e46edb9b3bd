"""``balancer bench SCENARIO``: the pipeline vs today's Airflow pattern vs the capacity bound.

Runs, in one go and against the same simulator settings and services:
(a) the pipeline, (b) the baseline (:mod:`balancer.bench.compare.baseline`), each a side
of :mod:`balancer.bench.compare.sides`, and (c) the capacity bound (:mod:`balancer.bench.compare.bounds`).
Each run gets a fresh simulator (fresh limits, fresh log) and its own schema and
namespace. Writes report.json (each side's figures: :mod:`balancer.bench.compare.side_stats`),
report.md (:mod:`balancer.bench.compare.report_md`) and PNG plots (:mod:`balancer.bench.compare.plots`)
under --out; this module is the glue between them.

Scenarios of kind "sources", "overhead" and "backlog" go to :mod:`balancer.bench.compare.sources`,
:mod:`balancer.bench.compare.overhead` and :mod:`balancer.bench.compare.backlog`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from balancer.bench.compare.bounds import capacity_bound, pinned_floor
from balancer.bench.compare.plots import plot
from balancer.bench.compare.report_md import write_markdown
from balancer.bench.compare.side_stats import side_stats
from balancer.bench.compare.sides import GREEDY_ENV, run_side_baseline, run_side_pipeline
from balancer.bench.scenarios import locate
from balancer.devtools.runner import RunResult
from balancer.devtools.scenario import Scenario, parse_scenario


def prepare(spec: str, out: Path) -> tuple[Scenario, Path]:
    """The scenario named (bundled) or given as a path by ``spec``, and its copy in ``out``:
    the simulator reads it from there, and the report stays reproducible after the package changes."""
    name, text = locate(spec)
    scenario = parse_scenario(text, name)
    scenario.check_pinned_fit()  # before anything starts: such a task could never be admitted
    out.mkdir(parents=True, exist_ok=True)
    path = (out / name).resolve()  # the simulator runs from the code's tree (runner.code_tree)
    path.write_text(text, encoding="utf-8")
    return scenario, path


def main(spec: str, out: Path, only: str | None, quota_accounting: str | None = None,
         worker_layout: str | None = None, compare_greedy: bool = False) -> dict[str, Any]:
    """Run the scenario named (bundled) or given as a path by ``spec``; write the report under ``out``."""
    console = Console()
    scenario, path = prepare(spec, out)
    if scenario.kind == "sources":
        from balancer.bench.compare import sources

        return sources.main(scenario, path, out, console)
    if scenario.kind in ("overhead", "backlog"):
        from balancer.bench.compare import backlog, overhead

        runner = overhead if scenario.kind == "overhead" else backlog
        return runner.main(scenario, path, out, console)
    out.mkdir(parents=True, exist_ok=True)
    bound, floor = capacity_bound(scenario), pinned_floor(scenario)
    console.print(f"[bold]{scenario.name}[/bold]: {scenario.workload.tasks} tasks, {len(scenario.models)} models, "
                  f"time scale {scenario.time_scale}; capacity bound {bound:.1f} s; pinned-work floor {floor:.1f} s")
    results: dict[str, RunResult] = {}
    if compare_greedy and only != "baseline":
        console.print("greedy side: the pipeline with the end game and hedging off (BALANCER_END_GAME=off, BALANCER_HEDGE_BUDGET=0)")
        results["greedy"] = run_side_pipeline(scenario, path, console, quota_accounting, worker_layout, GREEDY_ENV)
    if only != "baseline":
        results["pipeline"] = run_side_pipeline(scenario, path, console, quota_accounting, worker_layout)
    if only != "pipeline":
        results["baseline"] = run_side_baseline(scenario, path, console)
    report: dict[str, Any] = {
        "scenario": scenario.name,
        "scenario_file": spec,
        "tasks": scenario.workload.tasks,
        "time_scale": scenario.time_scale,
        "models": [m.name for m in scenario.models],
        "quota_accounting_override": quota_accounting,
        "worker_layout": worker_layout or scenario.extra.get("worker_layout", "one"),
        "makespan_s": {"bound": round(bound, 2), "pinned_floor": round(floor, 2)},
    }
    for side, result in results.items():
        report[side] = side_stats(result, scenario)
        # The simulator's whole call log, for any question the report does not answer.
        with (out / f"{side}-calls.jsonl").open("w") as fh:
            fh.writelines(json.dumps(e) + "\n" for e in result.entries)
        with (out / f"{side}-eta.jsonl").open("w") as fh:  # the ETA polled through the run, with its inputs
            fh.writelines(json.dumps({**e, "makespan_s": result.makespan}, default=str) + "\n" for e in result.eta_samples)
        report["makespan_s"][side] = report[side]["makespan_s"]
    if "pipeline" in results:
        report["rate_limited"] = report["pipeline"]["rate_limited"]
        report["violations"] = report["pipeline"]["violations"]
        report["utilization"] = round(bound / report["makespan_s"]["pipeline"], 3)
        report["utilization_vs_floor"] = round(max(bound, floor) / report["makespan_s"]["pipeline"], 3)
    if "greedy" in results:
        report["utilization_greedy"] = round(bound / report["makespan_s"]["greedy"], 3)
        report["utilization_vs_floor_greedy"] = round(max(bound, floor) / report["makespan_s"]["greedy"], 3)
    if "baseline" in results and "pipeline" in results:
        report["speedup"] = round(report["makespan_s"]["baseline"] / report["makespan_s"]["pipeline"], 2)
    report["plots"] = plot(results, scenario, out)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    write_markdown(report, out)
    console.print(f"makespan: {report['makespan_s']}  speedup: {report.get('speedup')}  utilization: "
                  f"{report.get('utilization')}  429s: {report.get('rate_limited')}  violations: {report.get('violations')}")
    if "greedy" in report:
        g, p = report["greedy"], report["pipeline"]
        console.print(f"greedy → end game: utilization {report['utilization_greedy']} → {report['utilization']}; "
                      f"backlog out {g['backlog_out_s']} → {p['backlog_out_s']} s; tail {g['tail_s']} → {p['tail_s']} s; "
                      f"hedges {p['hedges']['sent']} sent, {p['hedges']['won']} won, "
                      f"{p['hedges']['token_share']:.1%} of the run's tokens; 429s {g['rate_limited']} / {p['rate_limited']}; "
                      f"violations {g['violations']} / {p['violations']}")
    console.print(f"report: {out / 'report.md'}")
    return report
