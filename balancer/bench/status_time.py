"""How long ``balancer status --json`` takes, start to exit, as a user runs it.

    python -m balancer.bench.status_time [--tasks 20000] [--models 10] [--repeat 15]

Loads ``--tasks`` pending tasks and ``--models`` priced quotas into a schema
and namespace of its own (:class:`~balancer.devtools.runner.IsolatedServices`),
then runs ``python -m balancer status --json`` (and ``--help``, which reads
nothing) ``--repeat`` times each as child processes. Prints, per command, the
median and slowest wall time and the median CPU time (user + system) of the
child: on a shared machine the CPU time says what the command costs, the wall
time what a user waited. Also prints the modules ``status --json`` imported
that it should not need (Celery, kombu, FastAPI, Starlette, matplotlib).

Uses BALANCER_REDIS_URL / BALANCER_DATABASE_URL when set, else an embedded
stack; drops its own schema and keys afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from balancer.devtools.runner import IsolatedServices
from balancer.domain.quota import Quota

TARGET_MS = 300.0
#: Heavy modules ``status`` has no use for.
UNWANTED = ("celery", "kombu", "fastapi", "starlette", "matplotlib", "uvicorn", "jinja2", "httpx")

PROBE = ("import runpy, sys, json; sys.argv = ['balancer', 'status', '--json'];\n"
         "try:\n    runpy.run_module('balancer', run_name='__main__')\n"
         "except SystemExit:\n    pass\n"
         "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr)")


def timed(argv: list[str]) -> tuple[float, float, str, str]:
    """(wall ms, child CPU ms, stdout, stderr) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy(), check=False)
    wall = (time.perf_counter() - began) * 1000
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return wall, cpu, done.stdout, done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    console = Console()
    with IsolatedServices(console, "status", keep_workdir=False) as iso:
        svc = iso.services
        svc.quotas.replace_all([Quota(f"model-{i}", max_concurrent_requests=8, max_tokens_per_minute=1_000_000,
                                      price_per_million_input=1.0, price_per_million_output=4.0, currency="USD")
                                for i in range(args.models)], by="bench")
        iso.insert("".join(json.dumps({"prompt": f"prompt {i} " + "word " * 50, "max_tokens": 200}) + "\n"
                           for i in range(args.tasks)))
        commands = {"status --json": [sys.executable, "-m", "balancer", "status", "--json"],
                    "--help": [sys.executable, "-m", "balancer", "--help"]}
        table = Table(title=f"balancer commands, {args.tasks:,} pending tasks, {args.models} models "
                            f"({args.repeat} runs each)")
        for col in ("command", "median wall ms", "slowest wall ms", "median CPU ms"):
            table.add_column(col, justify="left" if col == "command" else "right")
        medians = {}
        for name, argv in commands.items():
            timed(argv)  # warm the page cache
            runs = [timed(argv)[:2] for _ in range(args.repeat)]
            walls, cpus = [w for w, _ in runs], [c for _, c in runs]
            medians[name] = (statistics.median(walls), statistics.median(cpus))
            table.add_row(name, f"{medians[name][0]:.0f}", f"{max(walls):.0f}", f"{medians[name][1]:.0f}")
        console.print(table)
        _, _, _, stderr = timed([sys.executable, "-c", PROBE])
        loaded = set(json.loads(stderr.strip().splitlines()[-1]))
        console.print(f"heavy modules `status --json` imported: {sorted(loaded & set(UNWANTED)) or 'none'}")
        wall, cpu = medians["status --json"]
        console.print(f"target: status --json < {TARGET_MS:.0f} ms; median wall {wall:.0f} ms, CPU {cpu:.0f} ms "
                      f"(os.getloadavg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): "
                      f"{'met' if wall < TARGET_MS else 'MISSED'}")


if __name__ == "__main__":
    main()
