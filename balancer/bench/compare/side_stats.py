"""One side's figures for the report: makespan, calls and 429s, limit violations,
queueing delay, refill gaps, limit utilization, latency, hedges, ETA and cost projection
(the maths in :mod:`balancer.bench.compare.report`, the audit in :mod:`balancer.devtools.sim.audit`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from balancer.bench.compare.bounds import limits
from balancer.bench.compare.report import (
    backlog_out,
    calls_by_model,
    calls_cut_off,
    estimate_accuracy,
    eta_errors,
    hedge_figures,
    last_solved,
    last_task_start,
    limit_utilization,
    logged_latency_percentiles,
    percentile,
    polled_eta_errors,
    projection_error,
    refill_gaps,
    size_dependence,
)
from balancer.devtools.runner import RunResult
from balancer.devtools.scenario import Scenario
from balancer.devtools.sim.audit import audit, calls_from_log
from balancer.devtools.sim.provider import prompt_key


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
        "last_solved": last_solved(result.rows, result.started, calls_of=calls_of_task(result.entries)),
    }


def calls_of_task(entries: Iterable[dict[str, Any]]) -> Callable[[Any], list[dict[str, Any]]]:
    """A task row: the backend's log entries of its calls, found by its prompt's key (the bench's
    prompts are distinct; tasks that shared a prompt would share its calls)."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        if "prompt_key" in e:
            by_key.setdefault(e["prompt_key"], []).append(e)
    return lambda row: by_key.get(prompt_key(row.prompt), [])


def latency_table(result: RunResult) -> dict[str, Any]:
    """Per model: the p50/p90/p99 the pipeline learned (its Redis sketch, read at
    the end) beside those the backend logged."""
    observed = logged_latency_percentiles(result.entries)
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
