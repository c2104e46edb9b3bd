"""Write-back lag: how long after a task is solved its answer is in the team's row.

    python -m balancer.bench.micro.writeback_lag [--scenario fast] [--tasks N] [--refused PERCENT]

The scenario's models and simulator (``fast.toml``: about 130 answers per
second at the bound), but the backlog is a source table in an isolated schema:
``prompts`` with the scenario's prompts as rows, declared as a source (balancer's
own database), ingested by beat's ingest tick and written back by the
dispatcher's write-back loop (``BALANCER_WRITEBACK_TICK``, 0.2 s when idle). A
trigger on ``prompts`` stamps each write with ``clock_timestamp()``. With
``--refused PERCENT``, a CHECK refuses the answer of that share of the rows
(every row whose id is a multiple of 100 / PERCENT): each fails alone and ends
``unwritable`` after ``BALANCER_WRITEBACK_ATTEMPTS`` refusals, while the others
are written. Reported: the lag from ``tasks.solved_at`` to that stamp (one
server clock) over the rows written, p50 / p99 / max (target: p99 under 2 s,
also with 1 % refused), how many rows were written more than once (0), and how
many refused rows ended unwritable, how long after the last writable row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console

from balancer.bench.scenarios import locate
from balancer.devtools.runner import IsolatedServices, wait_until_consuming
from balancer.devtools.scenario import parse_scenario
from balancer.sources.definition import parse_source_file
from balancer.sources.store import import_sources

TEAM_TABLE = """
CREATE TABLE prompts (id bigint PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT 'unsolved',
                      answer text, solved_by text, refuse boolean NOT NULL DEFAULT false,
                      CONSTRAINT refused CHECK (NOT refuse OR answer IS NULL));
CREATE TABLE writes (row_id bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION count_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN EXECUTE format('INSERT INTO %I.writes (row_id) VALUES ($1)', TG_TABLE_SCHEMA) USING NEW.id; RETURN NEW; END $$;
CREATE TRIGGER prompts_written AFTER UPDATE ON prompts FOR EACH ROW EXECUTE FUNCTION count_write();
"""

LAG = """
SELECT count(*) AS written, count(DISTINCT w.row_id) AS rows,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM w.at - t.solved_at)) AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM w.at - t.solved_at)) AS p99,
       max(extract(epoch FROM w.at - t.solved_at)) AS worst
FROM writes w JOIN tasks t ON t.source = 'team' AND t.key = CAST(w.row_id AS text)
"""


UNWRITABLE = "SELECT count(*) FROM source_outbox WHERE source = 'team' AND state = 'unwritable'"


def sim_scenario(spec: str) -> str:
    """The simulator's --scenario for ``spec``: a bundled name as it is, a file by its absolute
    path (the simulator runs from the code's tree: runner.code_tree)."""
    return str(Path(spec).resolve()) if Path(spec).is_file() else spec


def run(scenario_name: str, tasks: int | None, console: Console, refused_pct: float = 0.0) -> dict[str, float]:
    name, text = locate(scenario_name)
    scenario = parse_scenario(text, name)
    lines = scenario.task_lines()[: tasks or None]
    with IsolatedServices(console, "writeback") as iso:
        svc = iso.services
        svc.quotas.replace_all(scenario.quotas(), by="bench")
        with svc.engine.begin() as conn:
            conn.connection.cursor().execute(TEAM_TABLE)  # no parameters: the trigger's '%I' stays as it is
            ids = list(range(1, len(lines) + 1))
            every = round(100 / refused_pct) if refused_pct > 0 else 0
            refuse = [bool(every) and i % every == 0 for i in ids]
            conn.exec_driver_sql("INSERT INTO prompts (id, body, refuse) SELECT * FROM unnest(%s, %s, %s)",
                                 (ids, [line["prompt"] for line in lines], refuse))
        [definition] = parse_source_file(
            f'[sources.team]\ntable = "{iso.schema}.prompts"\nkey = "id"\nprompt = "body"\n'
            "where = \"status = 'unsolved'\"\nanswer = \"answer\"\nstatus = \"status\"\nmodel = \"solved_by\"\n"
            "max_tokens = 100\npoll_seconds = 0.5\nbatch = 1000\n")
        supervisor = iso.supervisor()
        iso.start_sim(supervisor, ["--scenario", sim_scenario(scenario_name),
                                   "--seed", str(scenario.seed)])
        supervisor.start("dispatcher", ["dispatcher", "--loglevel", "WARNING"])
        supervisor.start("workers", ["worker", "--all-models", "--loglevel", "WARNING"])
        supervisor.start("beat", ["beat", "--loglevel", "WARNING"], {"BALANCER_HOME": str(iso.workdir)})
        wait_until_consuming(supervisor, nodes=2)
        started = time.monotonic()
        import_sources(svc.engine, [definition], by="bench", replace=False, dry_run=False)
        console.print(f"{len(lines)} rows declared as a source; draining ...")
        while True:
            supervisor.check_alive()
            with svc.engine.connect() as conn:
                left = conn.exec_driver_sql("SELECT count(*) FROM prompts WHERE status = 'unsolved' "
                                            "AND NOT refuse").scalar_one()
            if left == 0:
                break
            if time.monotonic() - started > 1800:
                raise RuntimeError(f"{left} rows not written back after 30 min; logs in {iso.workdir}")
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        time.sleep(2)  # a second write of any row would land within a few ticks
        with svc.engine.connect() as conn:
            row = conn.exec_driver_sql(LAG).one()
        refused = sum(refuse)
        while True:  # the refused rows: tried again after their back-offs, then unwritable
            with svc.engine.connect() as conn:
                unwritable = int(conn.exec_driver_sql(UNWRITABLE).scalar_one())
            if unwritable >= refused or time.monotonic() - started - elapsed > 300:
                break
            supervisor.check_alive()
            time.sleep(0.5)
        settled = time.monotonic() - started - elapsed
    return {"rows": len(lines), "seconds": round(elapsed, 1), "written": int(row.written), "distinct_rows": int(row.rows),
            "lag_p50_s": round(float(row.p50), 3), "lag_p99_s": round(float(row.p99), 3),
            "lag_max_s": round(float(row.worst), 3), "refused": refused, "unwritable": unwritable,
            "unwritable_after_s": round(settled, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="fast")
    parser.add_argument("--tasks", type=int, help="only the first N of the scenario's tasks")
    parser.add_argument("--refused", type=float, default=0.0, metavar="PERCENT",
                        help="the share of rows whose answer a CHECK refuses (0 to 50)")
    args = parser.parse_args()
    if not 0 <= args.refused <= 50:
        parser.error("--refused must be from 0 to 50")
    console = Console(stderr=True)
    result = run(args.scenario, args.tasks, console, args.refused)
    console.print(f"{result['rows']} rows in {result['seconds']} s; write-back lag p50 {result['lag_p50_s']} s, "
                  f"p99 {result['lag_p99_s']} s, max {result['lag_max_s']} s; "
                  f"{result['written'] - result['distinct_rows']} row(s) written twice; "
                  f"{result['unwritable']} of {result['refused']} refused row(s) unwritable "
                  f"{result['unwritable_after_s']} s after the last written")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
