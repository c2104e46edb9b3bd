"""RSS of the pipeline with 1,000 requests in flight across 10 models.

    python -m balancer.bench.micro.memory [--in-flight 1000] [--layout one|per-model|both]

Ten models with max_concurrent_requests summing to --in-flight; the
simulated backend (run in this process, not counted) holds every call for
40 s, so the pipeline sits at full concurrency while RSS is read from /proc
for the dispatcher, beat and the worker processes. Layouts: one worker
process holding every model's pool, or one process per model.

Target (issue 3): 1,000 in flight under 2 GB RSS in total.
Uses BALANCER_REDIS_URL / BALANCER_DATABASE_URL if set, else an embedded
stack; works in its own schema and namespace and removes them afterwards.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import uvicorn
from rich.console import Console
from rich.table import Table

from balancer.devtools.embedded import free_port
from balancer.devtools.runner import IsolatedServices, environment
from balancer.devtools.sim.config import Latency, SimModel
from balancer.devtools.sim.provider import Simulator
from balancer.devtools.sim.server import create_app

LATENCY = Latency(median=40.0, p99=40.0, low=40.0, high=40.0)


def rss_mb(pid: int) -> float:
    """RSS of a process and its children, in MB (from /proc)."""
    total = 0.0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def run_layout(layout: str, in_flight: int, console: Console) -> dict:
    """One layout in its own schema and namespace (balancer.devtools.runner.IsolatedServices)."""
    per_model = in_flight // 10
    models = [SimModel(f"mem-{i}", per_model, 10**8, latency=LATENCY) for i in range(10)]
    simulator = Simulator(models, time_scale=1.0)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(simulator), host="127.0.0.1", port=port, log_level="warning", backlog=4096))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    result: dict = {"layout": layout}
    try:
        with IsolatedServices(console, "benchmem") as iso, \
                environment({"BALANCER_BACKEND_URL": f"http://127.0.0.1:{port}"}):  # before the supervisor copies the env
            svc = iso.services
            svc.quotas.replace_all([m.quota() for m in models], by="bench")
            sup = iso.supervisor()
            sup.start("dispatcher", ["dispatcher", "--loglevel", "WARNING"])
            sup.start("beat", ["beat", "--loglevel", "WARNING"], {"BALANCER_HOME": str(iso.workdir)})
            if layout == "one":
                sup.start("workers", ["worker", "--all-models", "--loglevel", "WARNING"])
            else:
                for m in models:
                    sup.start(f"worker-{m.name}", ["worker", "--model", m.name, "--loglevel", "WARNING"])
            iso.insert("\n".join(json.dumps({"prompt": f"m{i} " + "w " * 200, "max_tokens": 64}) for i in range(in_flight + 100)))
            deadline = time.monotonic() + 35
            while time.monotonic() < deadline:
                sup.check_alive()
                if sum(lim.in_flight for lim in simulator.limiters.values()) >= in_flight:
                    break
                time.sleep(0.5)
            time.sleep(1.0)
            result["in_flight_at_backend"] = sum(lim.in_flight for lim in simulator.limiters.values())
            result["processes"] = {c.name: round(rss_mb(c.process.pid), 1) for c in sup.children}
            result["total_mb"] = round(sum(result["processes"].values()), 1)
            console.print(f"{layout}: {result['in_flight_at_backend']} calls open at the backend, {result['total_mb']} MB RSS")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", type=int, default=1000)
    parser.add_argument("--layout", choices=["one", "per-model", "both"], default="both")
    args = parser.parse_args()
    console = Console()
    layouts = ["one", "per-model"] if args.layout == "both" else [args.layout]
    results = [run_layout(layout, args.in_flight, console) for layout in layouts]
    table = Table(title=f"RSS with {args.in_flight} requests in flight (target < 2,048 MB)")
    for col in ("layout", "calls open at backend", "processes", "total MB", "MB per call", "verdict"):
        table.add_column(col, justify="right")
    for r in results:
        ok = r["total_mb"] < 2048 and r["in_flight_at_backend"] >= args.in_flight
        table.add_row(r["layout"], str(r["in_flight_at_backend"]), str(len(r["processes"])), f"{r['total_mb']:,.0f}",
                      f"{r['total_mb'] / max(1, r['in_flight_at_backend']):.2f}", "met" if ok else "MISSED")
    console.print(table)


if __name__ == "__main__":
    main()
