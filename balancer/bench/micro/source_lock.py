"""Does a locked source table slow dispatching? Call starts per second with and without a lock.

    python -m balancer.bench.micro.source_lock [--lock-seconds 60] [--tasks 5000]

The set-up of :mod:`balancer.bench.micro.ingest_stall` (a real dispatcher, beat and
worker over an in-process simulator: two models, four slots each, every call
0.3 s, ready lists off, so every freed slot waits for a dispatcher round). A
source table (in the run's schema) is declared and read; ``--tasks`` unrelated
JSONL tasks are pending and being called. The call rate is measured for
``--lock-seconds`` as it is, then for as long again while another connection
holds ``LOCK TABLE ... IN ACCESS EXCLUSIVE MODE`` on the source's table (an
ordinary migration), with new rows waiting in it. Reported, from the
simulator's own log: call starts per second in each window, their ratio, the
longest gap between two call starts while locked, and how long the source's
new rows took to become tasks once the lock went.

Uses BALANCER_REDIS_URL / BALANCER_DATABASE_URL if set, else an embedded
stack; works in its own schema and namespace and removes them afterwards.
"""

from __future__ import annotations

import argparse
import time

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from balancer.bench.micro.ingest_stall import longest_gap, simulated_services, start_calling, wait_for
from balancer.sources.catalog import check_source, team_connection
from balancer.sources.definition import parse_source_file
from balancer.sources.store import import_sources

TEAM_TABLE = """
CREATE TABLE team_prompts (id bigserial PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT 'unsolved',
                           answer text);
INSERT INTO team_prompts (body) SELECT 'team prompt ' || g FROM generate_series(1, 20) g;
"""
SOURCE_FILE = """
[sources.team]
table = "team_prompts"
key = "id"
prompt = "body"
where = "status = 'unsolved'"
answer = "answer"
status = "status"
poll_seconds = 0.5
"""


def source_tasks(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT count(*) FROM tasks WHERE source = 'team'").scalar_one())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lock-seconds", type=float, default=60.0)
    parser.add_argument("--tasks", type=int, default=5000)
    args = parser.parse_args()
    console = Console()
    span = args.lock_seconds
    with simulated_services(console, "lock") as (iso, simulator):
        engine = iso.services.engine
        with engine.begin() as conn:
            conn.exec_driver_sql(TEAM_TABLE)
        definitions = parse_source_file(SOURCE_FILE)
        with team_connection(definitions[0], engine) as conn:
            check_source(conn, definitions[0])
        import_sources(engine, definitions, by="bench", replace=False, dry_run=False)
        sup = start_calling(iso, simulator, args.tasks, ready=lambda: source_tasks(engine) >= 20)
        console.print(f"{span:g} s as it is, then {span:g} s with the source's table locked ...")
        free_from = time.time()
        time.sleep(span)
        with engine.connect() as holder:
            holder.exec_driver_sql("INSERT INTO team_prompts (body) SELECT 'late ' || g "
                                   "FROM generate_series(1, 20) g")
            holder.exec_driver_sql("LOCK TABLE team_prompts IN ACCESS EXCLUSIVE MODE")
            locked_from = time.time()
            wait_for(sup, lambda: time.time() - locked_from >= span, span + 60, "the lock was not held", every=0.5)
            locked_until = time.time()
            holder.commit()
        wait_for(sup, lambda: source_tasks(engine) >= 40, 60, "the source's rows were not read after the lock", every=0.05)
        read_after = time.time() - locked_until
        starts = [e["start"] for e in list(simulator.log) if e["status"] == 200]
    free = len([s for s in starts if free_from <= s < locked_from]) / (locked_from - free_from)
    locked = len([s for s in starts if locked_from <= s < locked_until]) / (locked_until - locked_from)
    table = Table(title=f"call starts while a source table is locked for {span:g} s ({args.tasks:,} JSONL tasks)")
    for col in ("calls/s unlocked", "calls/s locked", "locked / unlocked", "longest gap while locked s",
                "source's rows read after the lock s"):
        table.add_column(col, justify="right")
    table.add_row(f"{free:.1f}", f"{locked:.1f}", f"{locked / max(free, 1e-9):.3f}",
                  f"{longest_gap(starts, locked_from, locked_until):.2f}", f"{read_after:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
