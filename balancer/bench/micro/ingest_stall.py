"""Does a large inbox file stall dispatching? Call starts while one is ingested.

    python -m balancer.bench.micro.ingest_stall [--lines 250000] [--tasks 3000]

A real dispatcher, beat and worker over an in-process simulator (two models,
four slots each, every call 0.3 s). Ready lists are off, so every freed slot
waits for a dispatcher round: the case ingestion could starve. ``--tasks``
are pending and being called when a file of ``--lines`` lines lands in the
inbox. Reported, from the simulator's own log: how long the file took to
reach ``done/``, the longest gap between two call starts while it was being
ingested, and the call rate before and during.

Uses BALANCER_REDIS_URL / BALANCER_DATABASE_URL if set, else an embedded
stack; works in its own schema and namespace and removes them afterwards.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from rich.console import Console
from rich.table import Table

from balancer.devtools.embedded import free_port
from balancer.devtools.runner import IsolatedServices, environment
from balancer.devtools.sim.config import Latency, SimModel
from balancer.devtools.sim.provider import Simulator
from balancer.devtools.sim.server import create_app
from balancer.supervisor import Supervisor

LATENCY = Latency(median=0.3, p99=0.3, low=0.3, high=0.3)
SETTINGS = {"BALANCER_READY_PER_SLOT": "0", "BALANCER_INGEST_TICK": "0.5", "BALANCER_HEDGE_BUDGET": "0"}


def write_file(path: Path, lines: int) -> None:
    staged = path.with_suffix(".tmp")
    with staged.open("w") as fh:
        for i in range(lines):
            fh.write(json.dumps({"prompt": f"inbox {i}: " + "summarise this sentence please " * 7, "max_tokens": 64}) + "\n")
    staged.rename(path)


def longest_gap(starts: list[float], since: float, until: float) -> float:
    """The longest time between two call starts in [since, until], edges included."""
    points = [since, *sorted(s for s in starts if since <= s <= until), until]
    return max(b - a for a, b in zip(points, points[1:], strict=False))


@contextmanager
def simulated_services(console: Console, label: str) -> Iterator[tuple[IsolatedServices, Simulator]]:
    """Two models served by an in-process simulator (four slots each, every call 0.3 s), and
    services of their own holding those quotas, with SETTINGS and the simulator's URL in the
    environment of the processes started inside."""
    models = [SimModel(f"{label}-{i}", 4, 10**8, latency=LATENCY) for i in range(2)]
    simulator = Simulator(models, time_scale=1.0)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(simulator), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with IsolatedServices(console, label) as iso, \
                environment({**SETTINGS, "BALANCER_BACKEND_URL": f"http://127.0.0.1:{port}"}):
            iso.services.quotas.replace_all([m.quota() for m in models], by="bench")
            yield iso, simulator
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_for(sup: Supervisor, done: Callable[[], bool], seconds: float, failure: str, every: float = 0.1) -> None:
    """Poll ``done`` until it holds, while every process stays alive; ``failure`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done():
        sup.check_alive()
        if time.monotonic() > deadline:
            raise SystemExit(failure)
        time.sleep(every)


def start_calling(iso: IsolatedServices, simulator: Simulator, tasks: int,
                  ready: Callable[[], bool] = lambda: True) -> Supervisor:
    """A dispatcher, beat and worker calling ``tasks`` pending JSONL tasks: returned once 50 calls
    have started (and ``ready()`` holds)."""
    sup = iso.supervisor()
    sup.start("dispatcher", ["dispatcher", "--loglevel", "WARNING"])
    sup.start("beat", ["beat", "--loglevel", "WARNING"], {"BALANCER_HOME": str(iso.workdir)})
    sup.start("worker", ["worker", "--all-models", "--loglevel", "WARNING"])
    iso.insert("\n".join(json.dumps({"prompt": f"p{i} " + "w " * 50, "max_tokens": 64}) for i in range(tasks)))
    wait_for(sup, lambda: len(simulator.log) >= 50 and ready(), 60, "calls never got going", every=0.2)
    return sup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=250_000)
    parser.add_argument("--tasks", type=int, default=3000)
    args = parser.parse_args()
    console = Console()
    with simulated_services(console, "stall") as (iso, simulator):
        inbox = iso.workdir / "inbox"
        inbox.mkdir()
        with environment({"BALANCER_INBOX": str(inbox)}):
            sup = start_calling(iso, simulator, args.tasks)
            console.print(f"writing {args.lines:,} lines into the inbox ...")
            write_file(iso.workdir / "big.jsonl", args.lines)
            dropped = time.time()
            (iso.workdir / "big.jsonl").rename(inbox / "big.jsonl")

            def ingested() -> bool:
                if (inbox / "rejected").exists():
                    raise SystemExit("the file was rejected")
                return (inbox / "done" / "big.jsonl").exists()

            wait_for(sup, ingested, 600, "the file was not ingested")
            done = time.time()
            time.sleep(1.5)  # the calls running at ``done`` end and are logged
            starts = [e["start"] for e in list(simulator.log) if e["status"] == 200]
    window = done - dropped
    before = [s for s in starts if dropped - 10 <= s < dropped]
    during = [s for s in starts if dropped <= s <= done]
    table = Table(title=f"call starts while a {args.lines:,}-line file is ingested ({args.tasks:,} tasks pending)")
    for col in ("ingestion s", "longest gap between call starts s", "calls/s in the 10 s before", "calls/s during"):
        table.add_column(col, justify="right")
    table.add_row(f"{window:.1f}", f"{longest_gap(starts, dropped, done):.2f}", f"{len(before) / 10:.1f}",
                  f"{len(during) / max(window, 1e-9):.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
