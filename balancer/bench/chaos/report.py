"""The chaos run's report, in Markdown: the witness's figures against the targets, then the details."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from balancer.bench.chaos.plan import Fault
from balancer.bench.chaos.witness import WitnessReport


@dataclass
class ChaosResult:
    seed: int
    command: str
    minutes: float
    models: int
    schedule: list[Fault]
    report: WitnessReport
    beliefs: list[str]
    actions: list[str]
    elapsed_s: float
    drained: bool
    extra: dict[str, Any] = field(default_factory=dict)


def _mark(ok: bool) -> str:
    return "ok" if ok else "**MISSED**"


def render(result: ChaosResult) -> str:
    r = result.report
    p99, own_p99 = r.recovery_p99, r.own_end_recovery_p99
    unexplained = r.unexplained_repeats
    rows = [
        ("tasks (submitted + inbox, less the inbox lines refused at intake with a reason)",
         f"{r.tasks} of {r.expected_tasks}", r.tasks == r.expected_tasks),
        ("ended", ", ".join(f"{k} {v}" for k, v in sorted(r.ended.items())), True),
        ("lost or stuck", str(r.lost), r.lost == 0),
        ("ended twice", str(len(r.ended_twice)), not r.ended_twice),
        ("failed without a reason", str(len(r.failed_without_reason)), not r.failed_without_reason),
        ("answers written twice", str(r.double_written), r.double_written == 0),
        ("limit exceeded at the backend (accepted calls over the provider's limits)",
         str(len(r.provider_violations)), not r.provider_violations),
        ("calls started over the concurrency quota in force", str(len(r.quota_breaches)), not r.quota_breaches),
        ("answered calls repeated", f"{len(r.repeats)} ({len(r.repeats) - len(unexplained)} explained by a kill)", True),
        ("unexplained repeated calls", str(len(unexplained)), not unexplained),
        ("one task's calls overlapping (unexplained)",
         f"{len(r.overlaps)} ({len(r.unexplained_overlaps)})", not r.unexplained_overlaps),
        ("429s", ", ".join(f"{k} {v}" for k, v in sorted(r.rate_limited.items())) or "0", True),
        ("recovery after a fault's end, less the time blocking faults (workers' PostgreSQL stalled, backend out,"
         " Redis down) made progress impossible, p99 (s)", "none" if p99 is None else f"{p99:.1f}",
         p99 is None or p99 <= 60),
        ("the same from each fault's own end, blocking faults included, p99 (s; for information)",
         "none" if own_p99 is None else f"{own_p99:.1f}", True),
        ("processes that died on their own", ", ".join(r.deaths) or "none", not r.deaths),
        ("drained before the deadline", "yes" if result.drained else "no", result.drained),
    ]
    lines = [
        f"Command: `{result.command}`",
        "",
        f"Seed {result.seed}; {result.models} models (one worker process each); fault window {result.minutes:g} min;"
        f" run {result.elapsed_s:.0f} s; {result.extra.get('calls', 0)} backend calls;"
        f" faults: {sum(result.extra.get('faults', {}).values())}"
        f" ({', '.join(f'{k} {v}' for k, v in sorted(result.extra.get('faults', {}).items()))});"
        f" router callers: {result.extra.get('router_answered', 0)} calls answered,"
        f" {result.extra.get('router_failed', 0)} failed (their calls count in the limits, not as tasks).",
        f"Verdict: {'PASSED' if r.passed and result.drained else 'FAILED'}.",
        "",
        "| figure | value | target |",
        "|---|---|---|",
        *[f"| {name} | {value} | {_mark(ok)} |" for name, value, ok in rows],
        "",
        "Recovery per fault (s from its end: the first answer written after it, and until the pipeline was back:",
        "the answer rate over 10 s at 80% of the 30 s before the fault, or the backlog no larger than at its start;",
        "then the part of that when a blocking fault was under way, and the recovery without it):",
        "",
        "| fault | first answer | rate back | of which blocked | recovery |",
        "|---|---|---|---|---|",
    ]
    for rec in r.recoveries:
        def fmt(v: float | None) -> str:
            return "-" if v is None else ("never" if v == float("inf") else f"{v:.1f}")
        lines.append(f"| {rec.fault} | {fmt(rec.first_answer_s)} | {fmt(rec.rate_back_s)} | {fmt(rec.blocked_s)}"
                     f" | {fmt(rec.seconds)} |")
    lines += ["", "Repeated answered calls:" if r.repeats else "Repeated answered calls: none.", ""]
    for rep in r.repeats:
        lines.append(f"- task {rep.task_id}: first on {rep.model} {rep.first_call[0]:.3f}–{rep.first_call[1]:.3f},"
                     f" again at {rep.repeat_at:.3f}: {rep.explained_by or 'UNEXPLAINED'}")
    overlaps = [f"task {o.task_id}: {o.first[0]:.3f}–{o.first[1]:.3f} on {o.model} and {o.second[0]:.3f}–{o.second[1]:.3f}:"
                f" {o.explained_by or 'UNEXPLAINED'}" for o in r.overlaps]
    for title, items in (("Limit breaches", r.provider_violations + r.quota_breaches),
                         ("Overlapping calls of one task", overlaps),
                         ("Tasks ended twice", [str(t) for t in r.ended_twice[:50]]),
                         ("Inbox lines refused at intake (reported in the inbox's .errors; no task)",
                          result.extra.get("inbox_refused", [])),
                         ("What the parts believed after each fault (leases in Redis, running rows in PostgreSQL,"
                          " calls in flight at the backend; only disagreements are listed)", result.beliefs),
                         ("What the injector did (kills, restarts, operator commands and their exits)",
                          result.actions)):
        lines += ["", f"{title}:" if items else f"{title}: none.", ""]
        lines += [f"- {item}" for item in items]
    lines += ["", "Schedule:", "", "```", *[f.describe() for f in result.schedule], "```"]
    return "\n".join(lines) + "\n"
