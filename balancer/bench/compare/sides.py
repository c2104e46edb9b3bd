"""The sides of a ``balancer bench`` run: the pipeline (:func:`run_side_pipeline`,
also with the end game off: :data:`GREEDY_ENV`) and the Airflow-pattern baseline
(:func:`run_side_baseline`, :mod:`balancer.bench.compare.baseline`), each against a fresh
simulator in a schema and namespace of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from balancer.bench.compare.bounds import GRACE
from balancer.devtools.runner import IsolatedServices, RunResult, environment, run_pipeline
from balancer.devtools.scenario import Scenario

#: The pipeline as it was before the end game: greedy to the last task, no hedges.
GREEDY_ENV = {"BALANCER_END_GAME": "off", "BALANCER_HEDGE_BUDGET": "0"}


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
    if scenario.extra.get("slow_start") is False:  # slow start's ablation: every quota's slots open at once
        quotas = [q.replace(slow_start=False) for q in quotas]
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
    from balancer.backlog.reads import status_counts
    from balancer.bench.compare import baseline
    from balancer.devtools.runner import fetch_log

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
