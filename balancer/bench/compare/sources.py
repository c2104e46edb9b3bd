"""Sources: a backfill and a live trickle sharing the models, with the fair share on and off.

    balancer bench sources

One source (``backlog = N``) inserts its whole backlog at the start; the
other (``rate = R`` tasks/s) trickles in for ``trickle_seconds``. The same
pipeline runs twice in one go, with ``BALANCER_SOURCE_FAIRNESS=on`` and then
``off``, each with fresh services and simulator. Reported per side: the
trickling source's insert-to-answer time (p50, p95) against its calls' own
latency at p95 (target: within 2x), and the completions per second of each
source while the trickle lasts, against the scenario's capacity bound (the
backfill should use the rest)::

    [[sources]]
    name = "A"
    backlog = 20000
    weight = 1            # optional, default 1

    [[sources]]
    name = "B"
    rate = 5.0
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from rich.console import Console

from balancer.devtools.runner import IsolatedServices, ask_for_dispatch, wait_until_consuming
from balancer.devtools.scenario import Scenario, ScenarioError
from balancer.estimates.stats import percentile


@dataclass(frozen=True)
class SourceSpec:
    name: str
    weight: int = 1
    backlog: int = 0  # tasks inserted at the start
    rate: float = 0.0  # tasks per second while the trickle lasts


def source_specs(scenario: Scenario) -> list[SourceSpec]:
    """The scenario's ``[[sources]]``: one backfill (``backlog``) and one trickle (``rate``)."""
    raw = scenario.extra.get("sources")
    if not isinstance(raw, list) or not raw:
        raise ScenarioError("a sources scenario needs [[sources]] tables")
    specs = []
    for i, table in enumerate(raw):
        if not isinstance(table, dict) or not isinstance(table.get("name"), str):
            raise ScenarioError(f"sources[{i}]: needs a name")
        spec = SourceSpec(table["name"], int(table.get("weight", 1)), int(table.get("backlog", 0)),
                          float(table.get("rate", 0.0)))
        if spec.weight < 1 or spec.backlog < 0 or spec.rate < 0 or (spec.backlog > 0) == (spec.rate > 0):
            raise ScenarioError(f"sources[{i}]: give either backlog > 0 or rate > 0, and a weight >= 1")
        specs.append(spec)
    return specs


def lines_for(scenario: Scenario, source: str, count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    wl = scenario.workload
    out = []
    for i in range(count):
        tokens = wl.prompt_tokens.sample(rng)
        out.append({"prompt": (f"{source}#{i} " + "lorem ipsum dolor sit amet " * (tokens * 4 // 27 + 1))[: tokens * 4],
                    "max_tokens": max(1, wl.output_tokens.sample(rng)), "source": source})
    return out


def bound_per_s(scenario: Scenario) -> float:
    """Completions per second at the models' concurrency caps (the sources scenario's models
    have TPM to spare): sum of cap / mean latency."""
    return sum(m.max_concurrent_requests / (m.latency.mean(seed=scenario.seed) * scenario.time_scale)
               for m in scenario.models)


def run_side(scenario: Scenario, path: Path, specs: list[SourceSpec], fairness: str, console: Console) -> dict[str, Any]:
    from balancer.sources.weights import set_weight

    seconds = float(scenario.extra.get("trickle_seconds", 60))
    # The processes started inside inherit the switch; the environment is restored after.
    with mock.patch.dict(os.environ, {"BALANCER_SOURCE_FAIRNESS": fairness}), IsolatedServices(console, f"sources-{fairness}") as iso:
        svc = iso.services
        svc.quotas.replace_all(scenario.quotas(), by="bench")
        with svc.engine.begin() as conn:
            for spec in specs:
                set_weight(conn, spec.name, spec.weight, by="bench")
        supervisor = iso.supervisor()
        iso.start_sim(supervisor, ["--scenario", str(path), "--grace", "0"])
        supervisor.start("dispatcher", ["dispatcher", "--loglevel", "WARNING"])
        supervisor.start("workers", ["worker", "--all-models", "--loglevel", "WARNING"])
        supervisor.start("beat", ["beat", "--loglevel", "WARNING"], {"BALANCER_HOME": str(iso.workdir)})
        wait_until_consuming(supervisor, nodes=2)
        backfills = [s for s in specs if s.backlog]
        trickles = [s for s in specs if s.rate]
        for n, spec in enumerate(backfills):
            iso.insert("".join(json.dumps(x) + "\n" for x in lines_for(scenario, spec.name, spec.backlog, scenario.seed + n)))
        ask_for_dispatch(svc)
        console.print(f"fairness {fairness}: backfill of {sum(s.backlog for s in backfills):,} in; trickling for {seconds:.0f} s ...")
        time.sleep(min(5.0, seconds / 4))  # the backfill fills every slot before the trickle starts
        pending = {s.name: lines_for(scenario, s.name, int(s.rate * seconds) + 1, scenario.seed + 100 + n)
                   for n, s in enumerate(trickles)}
        began = time.time()
        sent = dict.fromkeys(pending, 0)
        while time.time() - began < seconds:
            supervisor.check_alive()
            elapsed = time.time() - began
            for spec in trickles:
                due = min(len(pending[spec.name]), int(elapsed * spec.rate) + 1)
                if due > sent[spec.name]:
                    iso.insert("".join(json.dumps(x) + "\n" for x in pending[spec.name][sent[spec.name]:due]))
                    sent[spec.name] = due
            time.sleep(0.02)
        ended = time.time()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every trickled task answered (or 30 s: behind a backfill they are not)
            supervisor.check_alive()
            rows = iso.task_rows()
            if all(r.status in ("solved", "failed") for r in rows if r.source in pending):
                break
            time.sleep(0.5)
        rows = iso.task_rows()
        until = time.time()
    return side_figures(rows, {s.name for s in trickles}, began, ended, until, fairness)


def side_figures(rows: list[Any], trickled: set[str], began: float, ended: float, until: float,
                 fairness: str) -> dict[str, Any]:
    """Insert-to-answer of the trickled sources, and each source's completions/s in the window.

    A trickled task still unanswered at ``until`` counts with the time it had
    waited by then (so its figure is a lower bound; ``unanswered`` says how many)."""
    mine = [r for r in rows if r.source in trickled]
    live = [r for r in mine if r.status == "solved"]
    wait = [((r.solved_at.timestamp() if r.status == "solved" else until) - r.created_at.timestamp()) for r in mine]
    call = [(r.solved_at - r.started_at).total_seconds() for r in live if r.started_at]
    p95_wait, p95_call = percentile(wait, 95), percentile(call, 95)
    window = ended - began
    rates: dict[str, float] = {}
    for r in rows:
        if r.status == "solved" and r.solved_at and began <= r.solved_at.timestamp() <= ended:
            rates[r.source] = rates.get(r.source, 0) + 1 / window
    return {
        "fairness": fairness,
        "trickled": len(mine),
        "unanswered": len(mine) - len(live),
        "insert_to_answer_s": {"p50": _r(percentile(wait, 50)), "p95": _r(p95_wait), "max": _r(max(wait, default=None))},
        "call_latency_p95_s": _r(p95_call),
        # where the trickled tasks' time went: insert -> queued (the dispatcher) -> started (a ready list or a queue)
        "insert_to_queued_s": _quantiles([(r.queued_at - r.created_at).total_seconds() for r in live if r.queued_at]),
        "queued_to_started_s": _quantiles([(r.started_at - r.queued_at).total_seconds()
                                           for r in live if r.queued_at and r.started_at]),
        "ratio_p95": _r(p95_wait / p95_call if p95_wait is not None and p95_call else None),
        "completions_per_s": {k: round(v, 2) for k, v in sorted(rates.items())},
    }


def _quantiles(values: list[float]) -> dict[str, float | None]:
    return {"p50": _r(percentile(values, 50)), "p95": _r(percentile(values, 95))}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main(scenario: Scenario, path: Path, out: Path, console: Console) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    specs = source_specs(scenario)
    report: dict[str, Any] = {"scenario": scenario.name, "bound_per_s": round(bound_per_s(scenario), 2),
                              "sides": [run_side(scenario, path, specs, mode, console) for mode in ("on", "off")]}
    for side in report["sides"]:
        ratio = side["ratio_p95"]
        side["met"] = ratio is not None and ratio <= 2.0 and side["unanswered"] == 0
        total = sum(side["completions_per_s"].values())
        side["utilization"] = round(total / report["bound_per_s"], 3)
        console.print(f"fairness {side['fairness']}: trickle insert-to-answer p50 {side['insert_to_answer_s']['p50']} s, "
                      f"p95 {side['insert_to_answer_s']['p95']} s = {ratio}x its calls' p95 "
                      f"({'met' if side['met'] else 'MISSED'}); {side['unanswered']} of {side['trickled']} unanswered; "
                      f"completions/s {side['completions_per_s']} "
                      f"({side['utilization']:.2f} of the bound {report['bound_per_s']})")
    (out / "sources.json").write_text(json.dumps(report, indent=2, default=str))
    return report
