"""How long ``balancer status --json`` and ``balancer --help`` take, start to exit, as a user runs them.

    python -m balancer.bench.micro.status_time [--tasks 20000] [--models 10] [--repeat 15] [--compare DIR]

Loads ``--tasks`` pending tasks and ``--models`` priced quotas into a schema
and namespace of its own (:class:`~balancer.devtools.runner.IsolatedServices`),
analyses the table (as autovacuum would within a minute), then runs
``python -m balancer status --json`` and ``--help`` (which reads nothing)
``--repeat`` times each as child processes. Prints, per command, the
median and 90th percentile wall time and the median CPU time (user + system)
of the child: on a shared machine the CPU time says what the command costs,
the wall time what a user waited. Also prints the modules ``status --json``
imported that it should not need (Celery, kombu, Alembic, FastAPI, SQLAlchemy, ...), and
times a child that only imports the libraries ``status`` needs (:data:`FLOOR`):
what is left above that is balancer's own imports and the reads.

``--compare DIR``: DIR is another source tree of balancer (``git worktree add
DIR <commit>``, or ``git archive <commit> | tar -x -C DIR``); each command
runs from both trees against the same backlog, the two trees' runs taking
turns, so a change in the machine's load falls on both sides alike.

Each tree's bytecode is compiled first, as ``pip install`` does: a source
tree run with ``PYTHONDONTWRITEBYTECODE=1`` (set on the team's machines)
would compile balancer's modules from source on every run, which is not what
an installed ``balancer`` costs.

Uses BALANCER_REDIS_URL / BALANCER_DATABASE_URL when set, else an embedded
stack; drops its own schema and keys afterwards.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

import balancer
from balancer.admission.quota import Quota
from balancer.devtools.runner import IsolatedServices

TARGET_MS = 300.0
#: Heavy modules ``status --json`` has no use for (SQLAlchemy: it reads through psycopg2, :mod:`balancer.snapshot`).
UNWANTED = ("celery", "kombu", "alembic", "fastapi", "starlette", "matplotlib", "uvicorn", "jinja2", "httpx", "rich",
            "sqlalchemy")
#: The commands timed, as arguments to ``python -m balancer``.
COMMANDS = {"status --json": ["status", "--json"], "--help": ["--help"]}
#: The libraries ``status --json`` cannot do without, imported and nothing else: the floor of its cost.
FLOOR = "import click, redis, psycopg2"
#: This tree: the directory holding the ``balancer`` package that runs this benchmark.
HERE = Path(balancer.__file__).resolve().parents[1]


def probe(args: list[str]) -> str:
    """Python code that runs ``balancer ARGS`` and prints, as its last line on stderr, every module it imported."""
    return (f"import runpy, sys, json; sys.argv = ['balancer', *{args!r}]\n"
            "try:\n    runpy.run_module('balancer', run_name='__main__')\n"
            "except SystemExit as exc:\n    code = exc.code\n"
            "print(json.dumps({'exit': code, 'modules': sorted(sys.modules)}), file=sys.stderr)")


def imported_by(args: list[str], env: dict[str, str], tree: Path = HERE) -> tuple[int, set[str]]:
    """(exit code, every module imported) of ``balancer ARGS`` from ``tree``, run in a child process with ``env``."""
    done = subprocess.run([sys.executable, "-c", probe(args)], capture_output=True, text=True, env=env, cwd=tree,
                          check=False)
    out = json.loads(done.stderr.strip().splitlines()[-1])
    return out["exit"], set(out["modules"])


def timed(argv: list[str], tree: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall ms, child CPU ms) of one child process run in ``tree`` (``python -m`` and ``-c`` put the
    working directory first on the path, ahead of ``PYTHONPATH``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tree, check=False)
    wall = (time.perf_counter() - began) * 1000
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return wall, cpu


def p90(values: list[float]) -> float:
    """The 90th percentile (inclusive method: never past the slowest run)."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def tree_env(tree: Path) -> dict[str, str]:
    """This process's environment with ``tree`` first on the child's path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--compare", type=Path, metavar="DIR", help="Another balancer source tree, timed alongside.")
    args = parser.parse_args()
    if args.compare is not None and not (args.compare / "balancer" / "__init__.py").is_file():
        parser.error(f"--compare {args.compare}: no balancer package there")
    trees = {"this tree": HERE, **({f"{args.compare}": args.compare.resolve()} if args.compare else {})}
    console = Console(width=max(Console().width, 110))
    with IsolatedServices(console, "status", keep_workdir=False) as iso:
        svc = iso.services
        svc.quotas.replace_all([Quota(f"model-{i}", max_concurrent_requests=8, max_tokens_per_minute=1_000_000,
                                      price_per_million_input=1.0, price_per_million_output=4.0, currency="USD")
                                for i in range(args.models)], by="bench")
        iso.insert("".join(json.dumps({"prompt": f"prompt {i} " + "word " * 50, "max_tokens": 200}) + "\n"
                           for i in range(args.tasks)))
        with svc.engine.begin() as conn:  # the planner's statistics, as autovacuum keeps them on a live database
            conn.execute(sa.text("ANALYZE tasks"))
        envs = {name: tree_env(tree) for name, tree in trees.items()}
        for tree in trees.values():
            compileall.compile_dir(tree / "balancer", quiet=1)
        load_before = os.getloadavg()
        jobs = {(tree, command): ([sys.executable, "-m", "balancer", *cargs], trees[tree], env)
                for command, cargs in COMMANDS.items() for tree, env in envs.items()}
        jobs["-", "libraries only"] = ([sys.executable, "-c", FLOOR], HERE, envs["this tree"])
        for job in jobs.values():
            timed(*job)  # warm the page cache
        runs: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in jobs}
        for _ in range(args.repeat):
            for key, job in jobs.items():  # every job takes its turn in each round: a change of load falls on all
                runs[key].append(timed(*job))
        load_after = os.getloadavg()
        table = Table(title=f"balancer commands, {args.tasks:,} pending tasks, {args.models} models "
                            f"({args.repeat} runs each)")
        for col in ("tree", "command", "median wall ms", "p90 wall ms", "median CPU ms"):
            table.add_column(col, justify="left" if col in ("tree", "command") else "right", no_wrap=True)
        for (tree, command), timings in runs.items():
            walls, cpus = [w for w, _ in timings], [c for _, c in timings]
            table.add_row(tree, command, f"{statistics.median(walls):.0f}", f"{p90(walls):.0f}",
                          f"{statistics.median(cpus):.0f}")
        console.print(table)
        console.print(f"libraries only: python -c {FLOOR!r}")
        for tree, env in envs.items():
            _, loaded = imported_by(COMMANDS["status --json"], env, trees[tree])
            heavy = sorted({m.split(".")[0] for m in loaded} & set(UNWANTED))
            console.print(f"{tree}: heavy modules `status --json` imported: {heavy or 'none'}")
        console.print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} CPUs")
        for command in COMMANDS:
            wall = statistics.median(w for w, _ in runs["this tree", command])
            console.print(f"target: {command} < {TARGET_MS:.0f} ms; this tree's median wall {wall:.0f} ms: "
                          f"{'met' if wall < TARGET_MS else 'MISSED'}")

if __name__ == "__main__":
    main()
