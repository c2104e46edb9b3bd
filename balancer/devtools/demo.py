"""``balancer demo``: the whole pipeline on one machine, watched live.

Submits N prompts to the pipeline (see :mod:`balancer.devtools.runner`) against the
simulated Models Backend with its ten default models, shows progress and
per-model usage against the limits, and prints a summary read from the
simulator's own call log.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from balancer.devtools.runner import IsolatedServices, run_pipeline
from balancer.devtools.scenario import Distribution, Scenario, Workload
from balancer.devtools.sim.audit import Limits, audit, calls_from_log, limits_for, peaks
from balancer.devtools.sim.config import SimModel, default_models

#: The demo's backlog, generated like a benchmark scenario's (balancer/devtools/scenario.py).
DEMO_PROMPT_TOKENS = Distribution(median=400, p99=1500, min=40, max=2000)
DEMO_OUTPUT_TOKENS = Distribution(median=200, p99=512, min=64, max=512)


def demo_scenario(tasks: int, models: list[SimModel], time_scale: float, seed: int) -> Scenario:
    """The demo as a scenario: the default models, 10 % of tasks pinned, a few priorities."""
    workload = Workload(tasks, DEMO_PROMPT_TOKENS, DEMO_OUTPUT_TOKENS, pinned_fraction=0.1,
                        priorities=(0, 0, 0, 1, 2), sources=("demo",))
    return Scenario("demo", tuple(models), workload, time_scale=time_scale, seed=seed)


def summarize(entries: list[dict[str, Any]], models: list[SimModel], time_scale: float, grace: float,
              counts: dict[str, int], tasks: int, makespan: float) -> dict[str, Any]:
    calls = calls_from_log(entries)
    limits = limits_for((m.quota(time_scale=time_scale) for m in models), grace)
    violations = audit(calls, limits)
    model_peaks = peaks(calls, window=60.0)
    per_model = {}
    for m in models:
        lim = limits[m.name]
        p = model_peaks.get(m.name)
        per_model[m.name] = {
            "peak_in_flight": p.in_flight if p else 0,
            "max_concurrent_requests": lim.cap,
            "peak_tokens_60s": p.tokens_per_60s if p else 0,
            "limit_tokens_60s": int(lim.burst + lim.tpm),
            "tpm": int(lim.tpm),
            "calls": sum(1 for c in calls if c.model == m.name),
        }
    return {
        "tasks": tasks,
        "solved": counts["solved"],
        "failed": counts["failed"],
        "makespan_s": round(makespan, 2),
        "tasks_per_s": round(counts["solved"] / makespan, 2) if makespan else 0.0,
        "rate_limited": sum(1 for e in entries if e["status"] == 429),
        "violations": len(violations),
        "violation_details": [str(v) for v in violations[:20]],
        "time_scale": time_scale,
        "models": per_model,
    }


def live_table(limits: dict[str, Limits]):  # noqa: ANN201
    def make(core_live: dict, recent: dict[str, int]) -> Table:
        table = Table(title="per model: in flight vs cap, tokens in the last 60 s vs burst + TPM", expand=False)
        for col in ("model", "in flight", "tokens / 60 s", "limit"):
            table.add_column(col, justify="left" if col == "model" else "right")
        for name in sorted(limits):
            lim = limits[name]
            state = core_live.get(name)
            table.add_row(name, f"{state.in_flight if state else 0}/{lim.cap}", f"{recent.get(name, 0):,}",
                          f"{int(lim.burst + lim.tpm):,}")
        return table

    return make


def run_demo(*, tasks: int = 500, model_count: int = 10, time_scale: float = 0.1, seed: int = 1, quiet: bool = False,
             timeout: float = 1800.0) -> dict[str, Any]:
    console = Console(stderr=quiet, quiet=quiet)
    models = default_models(model_count)
    grace = 0.0
    limits = limits_for((m.quota(time_scale=time_scale) for m in models), grace)
    scenario = demo_scenario(tasks, models, time_scale, seed)
    with IsolatedServices(console, "demo", keep_workdir=False) as iso:
        result = run_pipeline(
            iso,
            quotas=scenario.quotas(),
            sim_args=["--models", str(model_count), "--time-scale", str(time_scale), "--seed", str(seed), "--grace", str(grace)],
            backlog_jsonl=scenario.backlog_jsonl(),
            console=console,
            table=live_table(limits),
            timeout=timeout,
        )
    summary = summarize(result.entries, models, time_scale, grace, result.counts, tasks, result.makespan)
    print_summary(console, summary)
    return summary


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    console.print(
        f"\n[bold]{summary['solved']}/{summary['tasks']} solved[/bold], {summary['failed']} failed, "
        f"makespan {summary['makespan_s']} s ({summary['tasks_per_s']} tasks/s), "
        f"429s: {summary['rate_limited']}, limit violations: {summary['violations']}"
    )
    table = Table(title="peak usage against limits (from the simulator's call log)")
    for col in ("model", "calls", "peak in flight", "cap", "peak tokens / 60 s", "burst + TPM"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, m in summary["models"].items():
        table.add_row(name, str(m["calls"]), str(m["peak_in_flight"]), str(m["max_concurrent_requests"]),
                      f"{m['peak_tokens_60s']:,}", f"{m['limit_tokens_60s']:,}")
    console.print(table)
