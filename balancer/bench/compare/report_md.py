"""report.md of a ``balancer bench`` run, from its report.json figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
            *(eta_row(e) for e in p.get("eta", [])),
            "",
            "The ETA polled every few seconds through the run (`<side>-eta.jsonl` holds every poll and its inputs), "
            "at the first poll past each mark, and whether the time actually left fell inside its band:",
            "",
            "| done | at (s) | ETA (s) | band (s) | finish error | remaining-time error | in band |",
            "|---:|---:|---:|---|---:|---:|---|",
            *(eta_row(e, band=True) for e in p.get("eta_polled", [])),
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
            "| task | answered by | hedges | hedged to | first call started | solved "
            "| its calls: model, start + length (+: still running at the end) |",
            "|---:|---|---:|---|---:|---:|---|",
            *[f"| {t['task']} | {t['model']} | {t['hedges']} | {t['hedged_to'] or '-'} | {t['started_s']} | {t['solved_s']} | "
              + ", ".join(f"{m} {start} + {length}" for m, start, length in t.get("calls", [])) + " |"
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
            lines.append(table_row(name, *cells))
    lines += ["", *[f"![{f}]({f})" for f in report.get("plots", [])], ""]
    (out / "report.md").write_text("\n".join(lines))


def table_row(*cells: object) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def signed(share: float | None) -> str:
    """A signed share (``+1.2%``), or ``-`` where there is none."""
    return "-" if share is None else f"{share:+.1%}"


def eta_row(e: dict[str, Any], band: bool = False) -> str:
    """An ETA table's row: when the ETA was made, what it said and its errors; with
    ``band``, also the band it gave and whether the time actually left fell inside it."""
    cells: list[object] = [f"{e['done']:.0%}", e["at_s"], e["eta_s"]]
    if band:
        cells.append("-" if e["low_s"] is None else f"{e['low_s']:.1f}–{e['high_s']:.1f}")
    cells += [signed(e["finish_error"]), signed(e["remaining_error"])]
    if band:
        cells.append("yes" if e["in_band"] else "no")
    return table_row(*cells)
