"""Peak RSS of ingesting one large inbox file, and of ``balancer submit`` on it.

    python -m balancer.bench.micro.ingest_memory [--lines 250000] [--code DIR]

Writes a JSONL file of ``--lines`` tasks (about 240 bytes a line: 250,000
lines are about 60 MB), then runs, each in a fresh child process, (1) one
inbox poll over it (:func:`balancer.sources.inbox.ingest_inbox`) and (2)
``balancer submit`` of it, and reports each child's own peak RSS
(``getrusage``'s ``ru_maxrss`` at exit), with a child that only imports and
connects for the baseline.
``--code DIR`` runs the children on another checkout of the package (e.g. the
commit before a change), for a side-by-side figure.

Uses BALANCER_REDIS_URL / BALANCER_DATABASE_URL if set, else an embedded
stack; works in its own schema and namespace and removes them afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from balancer.admission.quota import Quota
from balancer.devtools.runner import IsolatedServices

INGEST = """
import sys
from pathlib import Path
from balancer.services import Services
from balancer.settings import Settings
svc = Services.connect(Settings.from_env())
if sys.argv[1] != "-":
    from balancer.sources.inbox import ingest_inbox
    files = ingest_inbox(svc, Path(sys.argv[1]), min_age_seconds=0)
    print(sum(f.tasks for f in files))
"""


def write_file(path: Path, lines: int) -> int:
    with path.open("w") as fh:
        for i in range(lines):
            fh.write(json.dumps({"prompt": f"task {i}: " + "summarise this sentence please " * 7,
                                 "priority": i % 5, "max_tokens": 128}) + "\n")
    return path.stat().st_size


#: Runs a module as ``python -m`` would and reports its own peak RSS (kB) on stderr at exit.
MEASURED = """
import atexit, resource, runpy, sys
atexit.register(lambda: print("peak-rss-kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr))
sys.argv = sys.argv[1:]
if sys.argv[0] == "-c":
    sys.argv = sys.argv[1:]
    exec(compile(sys.argv[0], "<bench>", "exec"), {"__name__": "__main__"})
else:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def peak_rss_mb(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(peak RSS in MB, seconds, stdout's last line) of one child process running
    ``argv`` (a module and its arguments, or ``-c CODE ARGS``)."""
    started = time.monotonic()
    # In the code's own directory: ``-c`` puts the working directory first on sys.path.
    child = subprocess.run([sys.executable, "-c", MEASURED, *argv], env=env, capture_output=True, text=True,
                           cwd=env["PYTHONPATH"])
    if child.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(argv[:3])[:80]} failed ({child.returncode}): {child.stderr.strip()[-500:]}")
    kb = next(int(line.split()[1]) for line in child.stderr.splitlines() if line.startswith("peak-rss-kb"))
    return kb / 1024, time.monotonic() - started, (child.stdout.strip().splitlines() or [""])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=250_000)
    parser.add_argument("--code", type=Path, help="run the children on this checkout of the package")
    args = parser.parse_args()
    console = Console()
    rows = []
    with IsolatedServices(console, "ingestmem") as run:
        run.services.quotas.replace_all([Quota("m", 8, 1_000_000)], by="bench")
        env = {**os.environ, "PYTHONPATH": str((args.code or Path(__file__).parents[3]).resolve())}
        inbox = run.workdir / "inbox"
        inbox.mkdir()
        size = write_file(inbox / "big.jsonl", args.lines)
        console.print(f"{args.lines:,} lines, {size / 1e6:.1f} MB; children run {env['PYTHONPATH']}")
        for label, argv in (
            ("import and connect", ["-c", INGEST, "-"]),
            ("inbox poll (ingest_inbox)", ["-c", INGEST, str(inbox)]),
        ):
            rss, took, out = peak_rss_mb(argv, env)
            rows.append((label, rss, took, out))
        submitted = run.workdir / "submit.jsonl"
        write_file(submitted, args.lines)
        rss, took, out = peak_rss_mb(["balancer", "submit", str(submitted)], env)
        rows.append(("balancer submit", rss, took, out))
    table = Table(title=f"peak RSS, {args.lines:,} lines ({size / 1e6:.0f} MB)")
    for col in ("what", "peak RSS MB", "seconds", "output"):
        table.add_column(col)
    for label, rss, took, out in rows:
        table.add_row(label, f"{rss:.0f}", f"{took:.1f}", out[:60])
    console.print(table)


if __name__ == "__main__":
    main()
