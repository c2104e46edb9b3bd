"""``balancer bench SCENARIO``: the pipeline vs today's Airflow pattern vs the capacity bound.

Runs, in one go and against the same simulator settings and services:
(a) the pipeline, (b) the baseline (:mod:`balancer.bench.baseline`), (c) the
capacity bound (:mod:`balancer.domain.capacity`). Each run gets a fresh simulator (fresh limits,
fresh log) and its own schema and namespace. Writes report.json, report.md
and PNG plots under --out.

Scenarios of kind "overhead" and "backlog" go to :mod:`balancer.bench.overhead`
and :mod:`balancer.bench.backlog`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from balancer.bench.report import (
    backlog_out,
    calls_by_model,
    calls_cut_off,
    estimate_accuracy,
    eta_errors,
    hedge_figures,
    last_solved,
    last_task_start,
    limit_utilization,
    observed_latency,
    percentile,
    polled_eta_errors,
    projection_error,
    refill_gaps,
    rolling_series,
    size_dependence,
)
from balancer.bench.scenarios import locate
from balancer.devtools.runner import IsolatedServices, RunResult, run_pipeline
from balancer.devtools.scenario import Scenario, parse_scenario
from balancer.devtools.sim.audit import Limits, audit, calls_from_log, limits_for
from balancer.domain.capacity import ModelCapacity, makespan_bound, pinned_work_floor

GRACE = 0.0  # the simulator is as strict as the providers: no refill above the buckets


def capacity_bound(scenario: Scenario) -> float:
    """The bound in real seconds for this scenario's generated workload."""
    lines = scenario.task_lines()
    # What a provider counts per task: the expected usage if it settles (the
    # simulator answers with 30-100 % of max_tokens, 65 % on average), the
    # reservation prompt + max_tokens if it reserves.
    mean_tokens = sum(len(x["prompt"]) / 4 + 0.65 * x["max_tokens"] for x in lines) / len(lines)
    mean_reserved = sum(len(x["prompt"]) / 4 + x["max_tokens"] for x in lines) / len(lines)
    names = [m.name for m in scenario.models]
    pinned: dict[int, int] = {}
    for line in lines:
        if "model" in line:
            i = names.index(line["model"])
            pinned[i] = pinned.get(i, 0) + 1
    any_model = len(lines) - sum(pinned.values())
    models = [
        ModelCapacity(
            concurrency=real.max_concurrent_requests,
            mean_latency=m.latency.mean(seed=scenario.seed),
            # another client's share is not ours; real_* shares: what the provider really allows
            tpm=m.max_tokens_per_minute * m.real_tokens * (1 - m.foreign_share),
            burst=real.burst,
            rpm=None if m.max_requests_per_minute is None
            else m.max_requests_per_minute * m.real_requests * (1 - m.foreign_share),
            request_burst=real.burst_requests,
            tokens_per_task=mean_tokens if m.accounting == "settle" else mean_reserved,
        )
        for m, real in zip(scenario.models, (m.real_quota() for m in scenario.models), strict=True)
    ]
    return makespan_bound(models, tokens_per_task=mean_tokens, any_model=any_model, pinned=pinned) * scenario.time_scale


def pinned_floor(scenario: Scenario) -> float:
    """The realized pinned-work floor (balancer/capacity.py) for this scenario's
    workload, with the latencies the simulator will draw for it."""
    from balancer.devtools.sim.server import Simulator

    sim = Simulator(list(scenario.models), time_scale=scenario.time_scale, seed=scenario.seed)
    latencies: dict[str, list[float]] = {}
    for line in scenario.task_lines():
        if "model" in line:
            latency, _ = sim.draw(line["model"], line["prompt"], line["max_tokens"])
            latencies.setdefault(line["model"], []).append(latency)
    return pinned_work_floor(latencies, {m.name: m.max_concurrent_requests for m in scenario.models})


def limits(scenario: Scenario) -> dict[str, Limits]:
    """The providers' real limits (the audit and the utilization are measured against them)."""
    return limits_for(scenario.real_quotas(), GRACE)


#: The pipeline as it was before the end game: greedy to the last task, no hedges.
GREEDY_ENV = {"BALANCER_END_GAME": "off", "BALANCER_HEDGE_BUDGET": "0"}


@contextlib.contextmanager
def environment(overrides: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the processes started inside, then restore them."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_side_pipeline(scenario: Scenario, path: Path, console: Console, quota_accounting: str | None = None,
                      worker_layout: str | None = None, env: dict[str, str] | None = None,
                      settle_s: float = 0.0) -> RunResult:
    """The pipeline against the scenario's simulator. ``quota_accounting`` overrides
    every balancer quota's token_accounting (not the simulator's): the ablation
    that shows what crediting back usage costs against a provider that reserves.
    ``worker_layout`` is "one" (every pool in one worker process, the default)
    or "per-model" (one process per model, as docker-compose.yml deploys)."""
    quotas = priced(scenario)
    if scenario.extra.get("learn") is False:  # the "before" side of limits that learn: the quotas, exactly
        quotas = [q.replace(learn=False) for q in quotas]
    if quota_accounting is not None:
        quotas = [q.replace(token_accounting=quota_accounting) for q in quotas]
    with environment(env or {}), IsolatedServices(console, "bench") as iso:
        return run_pipeline(iso, quotas=quotas, sim_args=["--scenario", str(path), "--seed", str(scenario.seed),
                            "--grace", str(GRACE)], backlog_jsonl=scenario.backlog_jsonl(), console=console,
                            worker_layout=worker_layout or scenario.extra.get("worker_layout", "one"),
                            settle_s=settle_s)


def priced(scenario: Scenario) -> list[Any]:
    """The scenario's quotas with the prices of its optional ``[prices]`` table
    (``currency = "USD"``, ``<model> = [input, output]`` per million tokens)."""
    table = scenario.extra.get("prices", {})
    currency = table.get("currency")
    out = []
    for q in scenario.quotas():
        price = table.get(q.name)
        out.append(q if price is None else q.replace(price_per_million_input=float(price[0]),
                                                     price_per_million_output=float(price[1]), currency=currency))
    return out


def run_side_baseline(scenario: Scenario, path: Path, console: Console) -> RunResult:
    from balancer.bench import baseline
    from balancer.devtools.runner import fetch_log
    from balancer.storage.reads import status_counts

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
    caps = {name: limit.cap for name, limit in lim.items()}
    delays = [(r.started_at - r.created_at).total_seconds() for r in result.rows if r.started_at and r.created_at]
    violations = audit(calls_from_log(result.entries), lim)
    out_at = last_task_start(result.rows) or backlog_out(result.entries)
    bulk_s = (out_at - result.started) if out_at is not None else result.makespan
    gaps = refill_gaps(result.entries, caps, until=out_at)
    # How much of what each provider allows the run used while it still had work for every model.
    use = limit_utilization(result.entries, lim, result.started, result.started + bulk_s) if bulk_s > 0 else {}
    return {
        "makespan_s": round(result.makespan, 2),
        "counts": result.counts,
        "calls": sum(1 for e in result.entries if e["status"] != 429),
        "rate_limited": sum(1 for e in result.entries if e["status"] == 429),
        "by_model": calls_by_model(result.entries),
        "violations": len(violations),
        "violation_details": [str(v) for v in violations[:10]],
        "queueing_delay_s": {"p50": percentile(delays, 50), "p99": percentile(delays, 99)},
        "refill_gap_s": {"p50": percentile(gaps, 50), "p90": percentile(gaps, 90), "p99": percentile(gaps, 99),
                         "samples": len(gaps)},
        "completions_per_s_bulk": round(sum(1 for e in result.entries if e["status"] == 200 and e["end"] <= result.started
                                            + bulk_s) / bulk_s, 1) if bulk_s > 0 else None,
        "tokens": estimate_accuracy(result.rows),
        "backlog_out_s": round(bulk_s, 2),
        "tail_s": round(result.makespan - bulk_s, 2),
        "limit_utilization_bulk": {"mean": round(sum(use.values()) / len(use), 3) if use else None, "by_model": use},
        "latency_s": latency_table(result),
        "hedges": {**hedge_figures(result.rows), "cut_off": calls_cut_off(result.entries)},
        "eta": eta_errors(result.etas, result.makespan),
        "eta_polled": polled_eta_errors(result.eta_samples, result.makespan, scenario.workload.tasks),
        "eta_after_end_s": result.eta_samples[-1]["eta_s"] if result.eta_samples else None,
        "cost_projection": projection_error(result.eta_samples, scenario.workload.tasks,
                                            result.eta_samples[-1]["spent"] if result.eta_samples else 0.0),
        "last_solved": last_solved(result.rows, result.started),
    }


def latency_table(result: RunResult) -> dict[str, Any]:
    """Per model: the p50/p90/p99 the pipeline learned (its Redis sketch, read at
    the end) beside those the backend logged."""
    observed = observed_latency(result.entries)
    by_size = size_dependence(result.entries)
    out: dict[str, Any] = {}
    for name in sorted(set(observed) | set(result.learned_latency)):
        sketch = result.learned_latency.get(name)
        learned = None
        if sketch is not None and sketch.samples > 0:
            learned = {f"p{q}": round(sketch.quantile_ms(q / 100) / 1000, 2) for q in (50, 90, 99)}
            learned["samples"] = round(sketch.samples, 1)
        out[name] = {"learned": learned, "observed": observed.get(name),
                     "rank_correlation_with_completion_tokens": by_size.get(name)}
    return out


def plot(results: dict[str, RunResult], scenario: Scenario, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lim = limits(scenario)
    names = [m.name for m in scenario.models]
    window = 60 * scenario.time_scale  # one scenario minute
    files = []
    for metric, label, limit_of in (
        ("tokens", "tokens per (scaled) minute", lambda limit: limit.tpm * scenario.time_scale),
        ("requests", "requests per (scaled) minute", lambda limit: (limit.rpm or 0) * scenario.time_scale),
        ("in_flight", "calls in flight", lambda limit: limit.cap),
    ):
        fig, axes = plt.subplots(len(names), len(results), figsize=(6 * len(results), 1.6 * len(names)), squeeze=False, sharex="col")
        for col, (side, result) in enumerate(results.items()):
            for row, name in enumerate(names):
                series = rolling_series(result.entries, name, t0=result.started, t1=max(result.finished, result.started + 1),
                                        window=window)
                ax = axes[row][col]
                ax.plot(series["t"], series[metric], lw=1)
                out_at = last_task_start(result.rows) or backlog_out(result.entries)
                if metric == "in_flight" and out_at is not None:  # the backlog ran out: the tail starts
                    ax.axvline(out_at - result.started, color="grey", lw=0.8, ls=":")
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
        f"Command: `balancer bench {report['scenario_file']}` ({report['tasks']} tasks, "
        f"{len(report['models'])} models, time scale {report['time_scale']})",
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
    g, p = report.get("greedy"), report.get("pipeline")
    if g and p:
        lines += [
            "Before and after the end game, same seed, one run (the greedy side runs with BALANCER_END_GAME=off "
            "and BALANCER_HEDGE_BUDGET=0):",
            "",
            "| | greedy (before) | end game + hedging (after) |",
            "|---|---:|---:|",
            f"| makespan (s) | {g['makespan_s']} | {p['makespan_s']} |",
            f"| utilization (bound / makespan) | {report['utilization_greedy']} | {report['utilization']} |",
            f"| backlog ran out at (s) | {g['backlog_out_s']} | {p['backlog_out_s']} |",
            f"| tail (s) | {g['tail_s']} | {p['tail_s']} |",
            f"| hedges sent / won | - | {p['hedges']['sent']} / {p['hedges']['won']} |",
            f"| hedge tokens (share of the run's) | - | {p['hedges']['tokens']:,} ({p['hedges']['token_share']:.1%}) |",
            f"| 429s | {g['rate_limited']} | {p['rate_limited']} |",
            f"| limit violations | {g['violations']} | {p['violations']} |",
            "",
        ]
    if p:
        lines += [
            f"Hedges: {p['hedges']['sent']} sent, {p['hedges']['won']} won, {p['hedges']['tokens']:,} tokens "
            f"({p['hedges']['token_share']:.1%} of the run's); {p['hedges']['cut_off']} calls cut off (the backend "
            "saw the client go: cancelled losers, or calls past the backend timeout; logged when they ended).",
            f"Pipeline queueing delay (submitted → started): p50 {p['queueing_delay_s']['p50']} s, p99 {p['queueing_delay_s']['p99']} s.",
            f"Refill gap at the backend (a call's end on a model at its cap → the next call's arrival there, while "
            f"tasks were pending): p50 {p['refill_gap_s']['p50']} s, p90 {p['refill_gap_s']['p90']} s, "
            f"p99 {p['refill_gap_s']['p99']} s over {p['refill_gap_s']['samples']} samples, at "
            f"{p['completions_per_s_bulk']} completions/s.",
            *([f"Calls a finishing call took straight from its model's ready list (no dispatcher between the two "
               f"calls): {p['counts']['ready_taken']:,} of {p['calls']:,}."] if "ready_taken" in p["counts"] else []),
            "",
            "Drain ETA (`balancer status`), made when this share of the tasks was done, against the actual finish "
            "(target, issue 28: finish error within ±15 % at 25 % and 50 % done, ±25 % at 75 %):",
            "",
            "| done | at (s) | ETA (s) | finish error | remaining-time error |",
            "|---:|---:|---:|---:|---:|",
            *(f"| {e['done']:.0%} | {e['at_s']} | {e['eta_s']} | "
              + (f"{e['finish_error']:+.1%} | " if e['finish_error'] is not None else "- | ")
              + (f"{e['remaining_error']:+.1%} |" if e['remaining_error'] is not None else "- |")
              for e in p.get("eta", [])),
            "",
            "The ETA polled every few seconds through the run (`<side>-eta.jsonl` holds every poll and its inputs), "
            "at the first poll past each mark, and whether the time actually left fell inside its band:",
            "",
            "| done | at (s) | ETA (s) | band (s) | finish error | remaining-time error | in band |",
            "|---:|---:|---:|---|---:|---:|---|",
            *(f"| {e['done']:.0%} | {e['at_s']} | {e['eta_s']} | "
              + (f"{e['low_s']:.1f}–{e['high_s']:.1f}" if e['low_s'] is not None else "-")
              + (f" | {e['finish_error']:+.1%}" if e['finish_error'] is not None else " | -")
              + (f" | {e['remaining_error']:+.1%}" if e['remaining_error'] is not None else " | -")
              + f" | {'yes' if e['in_band'] else 'no'} |" for e in p.get("eta_polled", [])),
            "",
            f"ETA once every task was finished: {p.get('eta_after_end_s')} s.",
            *([f"Cost at {c['done']:.0%} done ({c['at_s']} s): spent {c['spent']:.4f} + projected {c['projected']:.4f} "
               f"against the run's final spend {c['final_spend']:.4f}: error {c['error']:+.1%}."]
              if (c := p.get("cost_projection")) else []),
            "",
            f"The backlog ran out (last call started) at {p['backlog_out_s']} s; the tail (calls still running) took "
            f"{p['tail_s']} s more (grey dotted line in in_flight.png). While the backlog lasted, each model used this "
            f"share of what its provider allows, at its binding limit (mean **{p['limit_utilization_bulk']['mean']}**):",
            "",
            "| model | accepted calls | 429s | limit utilization (bulk) |",
            "|---|---:|---:|---:|",
            *[f"| {name} | {c['calls']} | {c['rate_limited']} | {p['limit_utilization_bulk']['by_model'].get(name)} |"
              for name, c in p["by_model"].items()],
            "",
            "The tasks solved last (what the tail was made of; times in s since submit):",
            "",
            "| task | answered by | hedges | hedged to | first call started | solved |",
            "|---:|---|---:|---|---:|---:|",
            *[f"| {t['task']} | {t['model']} | {t['hedges']} | {t['hedged_to'] or '-'} | {t['started_s']} | {t['solved_s']} |"
              for t in p.get("last_solved", [])],
            "",
            "| model | tasks | tokens estimated | tokens used | used / estimated |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, t in sorted(p["tokens"].items()):
            lines.append(f"| {name} | {t['tasks']} | {t['estimated']:,} | {t['actual']:,} | {t['actual'] / max(1, t['estimated']):.2f} |")
        lines += [
            "",
            "Latency per model, learned by the pipeline (its decayed sketch; recent calls weigh most) "
            "and logged by the backend (every call), in seconds:",
            "",
            "| model | learned p50 | p90 | p99 | logged p50 | p90 | p99 | rank corr. latency ~ completion tokens |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, lat in p.get("latency_s", {}).items():
            learned, logged = lat["learned"] or {}, lat["observed"] or {}
            cells = [learned.get(k, "-") for k in ("p50", "p90", "p99")] + [
                "-" if logged.get(k) is None else round(logged[k], 2) for k in ("p50", "p90", "p99")] + [
                lat.get("rank_correlation_with_completion_tokens")]
            lines.append(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", *[f"![{f}]({f})" for f in report.get("plots", [])], ""]
    (out / "report.md").write_text("\n".join(lines))


def prepare(spec: str, out: Path) -> tuple[Scenario, Path]:
    """The scenario named (bundled) or given as a path by ``spec``, and its copy in ``out``:
    the simulator reads it from there, and the report stays reproducible after the package changes."""
    name, text = locate(spec)
    scenario = parse_scenario(text, name)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(text, encoding="utf-8")
    return scenario, path


def main(spec: str, out: Path, only: str | None, quota_accounting: str | None = None,
         worker_layout: str | None = None, compare_greedy: bool = False) -> dict[str, Any]:
    """Run the scenario named (bundled) or given as a path by ``spec``; write the report under ``out``."""
    console = Console()
    scenario, path = prepare(spec, out)
    if scenario.kind == "sources":
        from balancer.bench import sources

        return sources.main(scenario, path, out, console)
    if scenario.kind in ("overhead", "backlog"):
        from balancer.bench import backlog, overhead

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

