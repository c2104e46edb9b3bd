"""What the ``tasks_finished`` trigger (created by migration 0013) costs the solve path.

    python -m balancer.bench.micro.finish_trigger [--tasks 12000] [--batch 50]

In an isolated schema: running tasks are marked solved with
``backlog.transitions.mark_solved_many`` in batches of ``--batch`` (the answer
writer's statement), in rounds alternating three ways: the trigger disabled
(``ALTER TABLE tasks DISABLE TRIGGER``, as before migration 0013), enabled
for tasks of no declared source (it stamps ``finished_xid`` only), and
enabled for keyed tasks of a declared source (it also queues a write-back).
Reported: microseconds of wall time per task, each way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rich.console import Console

from balancer.backlog.transitions import Answer, mark_solved_many
from balancer.devtools.runner import IsolatedServices
from balancer.sources.definition import parse_source_file
from balancer.sources.store import import_sources

MODES = ("trigger off", "trigger on, no source", "trigger on, source table")


def run(count: int, batch: int, console: Console) -> dict[str, float]:
    with IsolatedServices(console, "trigger", keep_workdir=False) as iso:
        engine = iso.services.engine
        [definition] = parse_source_file('[sources.legacy]\ntable = "t"\nkey = "id"\nprompt = "p"\nanswer = "a"\n'
                                         'where = "a IS NULL"\n')
        import_sources(engine, [definition], by="bench", replace=False, dry_run=False)
        per_round = count // (len(MODES) * 4)
        timings: dict[str, list[float]] = {mode: [] for mode in MODES}
        for round_no in range(4):
            for mode in MODES:
                with engine.begin() as conn:
                    source = "legacy" if mode == MODES[2] else "submit"
                    ids = [r[0] for r in conn.exec_driver_sql(
                        "INSERT INTO tasks (source, key, prompt, max_tokens, estimated_tokens, status, admission_id, "
                        "from_table) SELECT %s, %s || '-' || g, 'prompt ' || g, 10, 20, 'running', 'a' || g, %s "
                        "FROM generate_series(1, %s) g RETURNING id",
                        (source, f"{round_no}{mode}", source == "legacy", per_round))]
                    conn.exec_driver_sql("UPDATE tasks SET admission_id = 'a' || id WHERE admission_id IS NOT NULL "
                                         "AND status = 'running'")
                    conn.exec_driver_sql(f"ALTER TABLE tasks {'DISABLE' if mode == MODES[0] else 'ENABLE'} "
                                         "TRIGGER tasks_finished")
                started = time.perf_counter()
                for i in range(0, len(ids), batch):
                    mark_solved_many(engine, [Answer(t, f"a{t}", "answer", 10, 5) for t in ids[i:i + batch]])
                timings[mode].append((time.perf_counter() - started) / len(ids) * 1e6)
        with engine.connect() as conn:
            queued = conn.exec_driver_sql("SELECT count(*) FROM source_outbox").scalar_one()
    result = {mode: round(statistics.median(values), 1) for mode, values in timings.items()}
    return {**result, "tasks_per_mode": per_round * 4, "batch": batch, "write_backs_queued": queued}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=12_000)
    parser.add_argument("--batch", type=int, default=50)
    args = parser.parse_args()
    console = Console(stderr=True)
    result = run(args.tasks, args.batch, console)
    for mode in MODES:
        console.print(f"{mode}: {result[mode]} µs per solved task (median of 4 rounds)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
