"""``balancer bench SCENARIO --compare-hedging``: what hedging costs, in tokens and money.

The same scenario and seed twice in one command, each with a fresh simulator
and its own schema: first with hedging off (``BALANCER_HEDGE_BUDGET=0``; the
end game's placement still on), then as configured. Each side's drain time,
and its tokens three ways, priced by the scenario's ``[prices]`` table:

- **ledger**: what spend says (``call_usage``: every call, a hedge that lost
  included), read once every call still running at the drain (a loser runs to
  its end) has ended and been written, or after :data:`SETTLE_S`;
- **backend**: what the simulated provider worked on, from its own call log
  (:func:`balancer.bench.compare.report.backend_usage`): the reference the ledger
  should match;
- **answered only**: each solved task's answering call, what spend counted
  before the ledger.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from balancer.bench.compare.report import answered_usage, backend_usage, hedge_figures
from balancer.bench.compare.run import prepare
from balancer.bench.compare.sides import priced, run_side_pipeline
from balancer.costs.cost import Price, charge, price_list, spend
from balancer.devtools.runner import RunResult

#: The two sides, in the order they run: (name, environment).
SIDES: tuple[tuple[str, dict[str, str]], ...] = (("unhedged", {"BALANCER_HEDGE_BUDGET": "0"}), ("hedged", {}))
#: How long a side waits after its drain for the calls still running to end (the backend timeout).
SETTLE_S = 150.0


def tokens_and_cost(usage: list[tuple[str, str, int, int]], prices: dict[str, Price | None],
                    currency: str | None) -> dict[str, Any]:
    """Prompt, completion and total tokens of ``usage`` rows, and what they cost.

    >>> tokens_and_cost([("s", "a", 1_000_000, 100_000)], {"a": Price(1.0, 10.0)}, "USD")
    {'prompt': 1000000, 'completion': 100000, 'total': 1100000, 'cost': 2.0, 'unpriced_tokens': 0}
    """
    priced_ = spend(charge(usage, prices, currency), currency)
    prompt, completion = sum(u[2] for u in usage), sum(u[3] for u in usage)
    return {"prompt": prompt, "completion": completion, "total": prompt + completion, "cost": round(priced_.total, 6),
            "unpriced_tokens": sum(priced_.unpriced_tokens.values())}


def side_figures(result: RunResult, prices: dict[str, Price | None], currency: str | None) -> dict[str, Any]:
    return {
        "drain_s": round(result.makespan, 2),
        "calls": len(result.entries),
        "rate_limited": sum(1 for e in result.entries if e["status"] == 429),
        "hedges": hedge_figures(result.rows),
        "settled": result.settled,
        "ledger": tokens_and_cost(result.ledger, prices, currency),
        "backend": tokens_and_cost(backend_usage(result.entries), prices, currency),
        "answered_only": tokens_and_cost(answered_usage(result.rows), prices, currency),
    }


def write_markdown(report: dict[str, Any], out: Path) -> None:
    u, h, cur = report["unhedged"], report["hedged"], report["currency"] or ""

    def row(label: str, key: str, field: str, money: bool = False) -> str:
        a, b = u[key][field], h[key][field]
        fmt = (lambda v: f"{v:.4f} {cur}") if money else (lambda v: f"{v:,}")
        share = f" ({(b - a) / a:+.1%})" if a else ""
        return f"| {label} | {fmt(a)} | {fmt(b)} | {fmt(b - a)}{share} |"

    lines = [
        f"# What hedging cost: {report['scenario']}",
        "",
        f"Command: `balancer bench {report['scenario_file']} --compare-hedging"
        + (f" --worker-layout {report['worker_layout']}" if report["worker_layout"] else "")
        + f"` ({report['tasks']} tasks, seed "
        f"{report['seed']}); the unhedged side runs with BALANCER_HEDGE_BUDGET=0.",
        "",
        "| | hedging off | hedging on | on − off |",
        "|---|---:|---:|---:|",
        f"| drain time (s) | {u['drain_s']} | {h['drain_s']} | {h['drain_s'] - u['drain_s']:+.2f} |",
        f"| calls the backend saw | {u['calls']:,} | {h['calls']:,} | {h['calls'] - u['calls']:+,} |",
        f"| hedges sent / won | {u['hedges']['sent']} / {u['hedges']['won']} | {h['hedges']['sent']} / "
        f"{h['hedges']['won']} | |",
        row("tokens, ledger (spend)", "ledger", "total"),
        row("cost, ledger (spend)", "ledger", "cost", money=True),
        row("tokens, backend's log", "backend", "total"),
        row("cost, backend's log", "backend", "cost", money=True),
        row("tokens, answering calls only (spend before the ledger)", "answered_only", "total"),
        row("cost, answering calls only", "answered_only", "cost", money=True),
        "",
        "Within each side, the calls that did not give their task's answer (ledger − answering calls: a "
        "hedge's loser, either call of the two, or a retried call): "
        + "; ".join(f"{name} {s['ledger']['total'] - s['answered_only']['total']:,} tokens, "
                    f"{s['ledger']['cost'] - s['answered_only']['cost']:.4f} {cur}" for name, s in (("off", u), ("on", h)))
        + ".",
        "",
        f"Every call ended and was in the ledger when it was read: off {u['settled']}, on {h['settled']}. "
        f"429s: off {u['rate_limited']}, on {h['rate_limited']}.",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


def main(spec: str, out: Path, worker_layout: str | None = None) -> dict[str, Any]:
    """Run both sides of the scenario ``spec`` names; write report.json and report.md under ``out``."""
    console = Console()
    scenario, path = prepare(spec, out)
    quotas = priced(scenario)
    prices, currency = price_list(quotas)
    report: dict[str, Any] = {"scenario": scenario.name, "scenario_file": spec, "tasks": scenario.workload.tasks,
                              "seed": scenario.seed, "currency": currency, "worker_layout": worker_layout}
    for side, env in SIDES:
        console.print(f"{side} side ({env or 'as configured'}) ...")
        result = run_side_pipeline(scenario, path, console, None, worker_layout, env, settle_s=SETTLE_S)
        report[side] = side_figures(result, prices, currency)
        with (out / f"{side}-calls.jsonl").open("w") as fh:  # the backend's whole call log
            fh.writelines(json.dumps(e) + "\n" for e in result.entries)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    write_markdown(report, out)
    console.print((out / "report.md").read_text())
    return report
