"""How long one dispatch round takes with a backlog no enabled model may take.

    python -m balancer.bench.micro.dispatch_round [--parked 100000] [--flexible 5000] [--rounds 200]

Two models: ``on`` (enabled) and ``off`` (disabled). ``--parked`` pending
tasks are pinned to ``off`` and were submitted first (the oldest, so they
lead the window's priority-then-age order); ``--flexible`` tasks any model
may take come after. Each round is one :func:`balancer.dispatch.dispatcher.dispatch`
call of one round that admits ``on``'s free slots (then its leases are
released, so the next round has slots again). Ready lists, the end game and
hedging are off, so the figure is the round's own queries. Reported: the
median and p90 round time, with and without the parked tasks.

Uses BALANCER_REDIS_URL / BALANCER_DATABASE_URL if set, else an embedded
stack; works in its own schema and namespace and removes them afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Sequence

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from balancer.admission.quota import Quota
from balancer.devtools.runner import IsolatedServices

SETTINGS = {"BALANCER_READY_PER_SLOT": "0", "BALANCER_END_GAME": "off", "BALANCER_HEDGE_BUDGET": "0"}


def insert(engine: sa.engine.Engine, count: int, allowed: list[str] | None) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO tasks (source, prompt, allowed_models, max_tokens, estimated_tokens) "
            "SELECT 'bench', 'prompt ' || g, CAST(:allowed AS text[]), 64, 100 FROM generate_series(1, :n) AS g"
        ), {"allowed": allowed, "n": count})
        conn.execute(sa.text("ANALYZE tasks"))


def measure(services, rounds: int) -> list[float]:  # noqa: ANN001
    from balancer.dispatch.dispatcher import Assignment, dispatch

    taken: list[Assignment] = []

    def publish(assignments: Sequence[Assignment]) -> None:
        taken.extend(assignments)

    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        dispatch(services, publish, max_rounds=1)
        times.append((time.perf_counter() - started) * 1000)
        for a in taken:
            services.core.release(a.admission_id)
        taken.clear()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parked", type=int, default=100_000)
    parser.add_argument("--flexible", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    os.environ.update(SETTINGS)
    console = Console()
    table = Table(title="one dispatch round (ms)")
    for col in ("pending pinned to the disabled model", "median", "p90", "admitted per round"):
        table.add_column(col)
    for parked in (0, args.parked):
        with IsolatedServices(console, "round") as run:
            svc = run.services
            svc.quotas.replace_all([Quota("on", 4, 10_000_000),
                                    dataclasses.replace(Quota("off", 4, 10_000_000), enabled=False)], by="bench")
            if parked:
                insert(svc.engine, parked, ["off"])
            insert(svc.engine, args.flexible, None)
            measure(svc, 10)  # warm up: connections, statement caches
            times = sorted(measure(svc, args.rounds))
            with svc.engine.connect() as conn:
                queued = conn.execute(sa.text("SELECT count(*) FROM tasks WHERE status = 'queued'")).scalar_one()
        table.add_row(f"{parked:,}", f"{statistics.median(times):.1f}", f"{times[int(len(times) * 0.9)]:.1f}",
                      f"{queued / (args.rounds + 10):.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
