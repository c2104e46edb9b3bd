"""Source table ingest: a 1,000,000-row team table read into the backlog.

    python -m balancer.bench.micro.source_ingest [--rows 1000000] [--batch 10000]

In an isolated schema (dropped afterwards): a table ``prompts`` of ``--rows``
unsolved rows, loaded with ``INSERT ... SELECT generate_series``, declared as a
source, then read by :func:`balancer.sources.ingest.ingest_source` in
this process until caught up. Reported: rows per second (target: 20,000),
the longest single read of the team's table (the only time a lock is held on
it), and this process's RSS before and after (target: flat).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console

from balancer.admission.quota import Quota
from balancer.devtools.runner import IsolatedServices
from balancer.sources import ingest as source_ingest
from balancer.sources import window as sources_window
from balancer.sources.definition import parse_source_file
from balancer.sources.store import import_sources


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(rows: int, batch: int, console: Console) -> dict[str, float]:
    with IsolatedServices(console, "ingest", keep_workdir=False) as iso:
        svc = iso.services
        svc.quotas.replace_all([Quota("m", 64, 10_000_000)], by="bench")
        with svc.engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE prompts (id bigint PRIMARY KEY, body text NOT NULL, "
                                 "status text NOT NULL DEFAULT 'unsolved', answer text)")
            started = time.monotonic()
            conn.exec_driver_sql("INSERT INTO prompts (id, body) SELECT g, 'Summarise record ' || g || ' of the backfill' "
                                 "FROM generate_series(1, %s) g", (rows,))
            conn.exec_driver_sql("ANALYZE prompts")
        console.print(f"loaded {rows:,} rows in {time.monotonic() - started:.1f} s")
        [definition] = parse_source_file(
            f'[sources.bench]\ntable = "{iso.schema}.prompts"\nkey = "id"\nprompt = "body"\n'
            f"where = \"status = 'unsolved'\"\nanswer = \"answer\"\nstatus = \"status\"\nbatch = {batch}\n")
        import_sources(svc.engine, [definition], by="bench", replace=False, dry_run=False)
        reads: list[float] = []
        timed = sources_window.read_window

        def read_window(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the same call, timed
            began = time.monotonic()
            try:
                return timed(*args, **kwargs)
            finally:
                reads.append(time.monotonic() - began)

        source_ingest.read_window = read_window
        rss_before = rss_mb()
        models = {"m": 10_000_000}
        started = time.monotonic()
        created = 0
        while True:
            report = source_ingest.ingest_source(svc, definition, models, budget_s=3600)
            created += report.created
            if report.caught_up:
                break
        elapsed = time.monotonic() - started
        source_ingest.read_window = timed
        with svc.engine.connect() as conn:
            stored = conn.exec_driver_sql("SELECT count(*) FROM tasks WHERE source = 'bench'").scalar_one()
    result = {"rows": rows, "batch": batch, "created": created, "stored": stored, "seconds": round(elapsed, 2),
              "rows_per_s": round(created / elapsed), "longest_read_s": round(max(reads), 3),
              "rss_before_mb": round(rss_before), "rss_after_mb": round(rss_mb())}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000)
    args = parser.parse_args()
    console = Console(stderr=True)
    result = run(args.rows, args.batch, console)
    console.print(f"ingested {result['created']:,} rows in {result['seconds']} s: {result['rows_per_s']:,} rows/s; "
                  f"longest read {result['longest_read_s']} s; RSS {result['rss_before_mb']} -> {result['rss_after_mb']} MB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()


