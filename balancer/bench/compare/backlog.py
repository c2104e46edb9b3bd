"""Backlog: bulk-load 1,000,000 pending tasks, then dispatch at 10,000 and at 1,000,000 pending.

    balancer bench bench/scenarios/backlog.toml

Loads with PostgreSQL COPY (benchmark code, outside the package). Dispatch
runs in this process with a publisher that only counts, so the figure is the
dispatcher's own rate: window query + admission + status update. Reported:
load rate, dispatch rate at each backlog size (target: within 20 %), this
process's RSS and Redis used_memory around each phase (target: flat).
"""

from __future__ import annotations

import io
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from rich.console import Console
from rich.progress import Progress

from balancer.admission import keys
from balancer.devtools.runner import IsolatedServices
from balancer.devtools.scenario import Scenario
from balancer.dispatch.dispatcher import dispatch


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def copy_load(engine: sa.engine.Engine, scenario: Scenario, start: int, count: int, console: Console) -> float:
    """COPY ``count`` pending tasks; returns rows per second."""
    rng = random.Random(scenario.seed + start)
    names = [m.name for m in scenario.models]
    wl = scenario.workload
    began = time.time()
    chunk = 100_000
    with Progress(console=console) as bar:
        task = bar.add_task(f"COPY {count:,} tasks", total=count)
        for offset in range(0, count, chunk):
            buf = io.StringIO()
            for i in range(start + offset, start + min(offset + chunk, count)):
                out = wl.output_tokens.sample(rng)
                est = wl.prompt_tokens.sample(rng) + out
                pinned = "{" + rng.choice(names) + "}" if rng.random() < wl.pinned_fraction else ""
                buf.write(f"backlog\tp{i}\tpending\t{rng.choice(wl.priorities)}\t{pinned or chr(92) + 'N'}\t{out}\t{est}\n")
            buf.seek(0)
            raw = engine.raw_connection()
            try:
                with raw.cursor() as cur:  # type: ignore[attr-defined]  # psycopg2's cursor is a context manager
                    cur.copy_expert(
                        "COPY tasks (source, prompt, status, priority, allowed_models, max_tokens, estimated_tokens) FROM STDIN",
                        buf,
                    )
                raw.commit()
            finally:
                raw.close()
            bar.update(task, advance=min(chunk, count - offset))
    with engine.begin() as conn:
        conn.execute(sa.text("ANALYZE tasks"))
    return count / (time.time() - began)


def dispatch_rate(iso: IsolatedServices, seconds: float, limit: int) -> tuple[float, int]:
    """Dispatch for ``seconds`` or until ``limit`` tasks went out (so a small
    backlog is never drained, which would count idle rounds)."""
    sent = 0

    def count(assignments: Sequence[Any]) -> None:
        nonlocal sent
        sent += len(assignments)

    dispatch(iso.services, lambda _: None, max_rounds=1)  # warm-up (connections, scripts), untimed
    started = time.time()
    while time.time() - started < seconds and sent < limit:
        dispatch(iso.services, count)
    return sent / (time.time() - started), sent


def main(scenario: Scenario, path: Path, out: Path, console: Console) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    seconds = float(scenario.extra.get("dispatch_seconds", 5))
    small = int(scenario.extra.get("small_backlog", 10_000))
    with IsolatedServices(console, "backlog") as iso:
        iso.services.quotas.replace_all(scenario.quotas(), by="bench")
        client = redis.Redis.from_url(iso.redis_url)
        engine = iso.services.engine
        report: dict[str, Any] = {"scenario": scenario.name}
        report["load_rows_per_s_small"] = round(copy_load(engine, scenario, 0, small, console))
        phases = []
        for label, extra in (("small", 0), ("large", scenario.workload.tasks - small)):
            if extra:
                report["load_rows_per_s"] = round(copy_load(engine, scenario, small, extra, console))
            with engine.connect() as conn:
                pending = conn.execute(sa.text("SELECT count(*) FROM tasks WHERE status = 'pending'")).scalar_one()
            before = (rss_mb(), client.info("memory")["used_memory"])
            # The same amount of work in both phases, so they are comparable.
            rate, sent = dispatch_rate(iso, seconds, limit=min(small // 2, pending // 2))
            after = (rss_mb(), client.info("memory")["used_memory"])
            # Leases of the tasks just dispatched are in-flight state, not backlog: free them
            # so both phases start from the same admission state.
            for name in [m.name for m in scenario.models]:
                client.delete(keys.inflight(iso.namespace, name))
            client.delete(keys.script_keys(iso.namespace)[2])
            phases.append({
                "phase": label, "pending": pending, "dispatched": sent, "dispatch_per_s": round(rate),
                "rss_mb_before": round(before[0], 1), "rss_mb_after": round(after[0], 1),
                "redis_used_mb_before": round(before[1] / 2**20, 1), "redis_used_mb_after": round(after[1] / 2**20, 1),
            })
            console.print(f"{label}: {pending:,} pending -> {rate:,.0f} dispatched/s; RSS {after[0]:.0f} MB; "
                          f"Redis {after[1] / 2**20:.1f} MB")
        report["phases"] = phases
        ratio = phases[1]["dispatch_per_s"] / max(1, phases[0]["dispatch_per_s"])
        report["rate_ratio_large_over_small"] = round(ratio, 3)
        report["within_20_percent"] = abs(1 - ratio) <= 0.2
    (out / "backlog.json").write_text(json.dumps(report, indent=2))
    console.print(f"load {report.get('load_rows_per_s', 0):,} rows/s; dispatch rate at {phases[1]['pending']:,} pending is "
                  f"{ratio:.2f}x the rate at {phases[0]['pending']:,} ({'met' if report['within_20_percent'] else 'MISSED'})")
    return report
