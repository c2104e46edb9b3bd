"""The web console's sampler memory and its Sources page with many sources.

    python -m balancer.bench.micro.sampler_memory [--sources 50000] [--samples 20]

Loads one task per source (``--sources`` of them; one in three solved, each
solved task with its ledger row, so the spend has every source too, one in
three running, the rest pending) into a schema of its own, then takes
``--samples`` samples into a console's :class:`~balancer.web.sampler.Sampler`
as its thread does, measuring with tracemalloc what the buffer holds. The
buffer keeps 15 minutes of samples (451 at the default 2 s interval): the
projection is the bytes per sample times that. Then serves ``/sources`` and
``/fragments/sources`` (Starlette's test client) and times them and their size.

Uses BALANCER_REDIS_URL / BALANCER_DATABASE_URL when set, else an embedded
stack; drops its own schema and keys afterwards.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
import warnings

import sqlalchemy as sa
from rich.console import Console

from balancer.admission.quota import Quota
from balancer.devtools.runner import IsolatedServices
from balancer.web.app import create_app
from balancer.web.sampler import HISTORY_S, Sampler

LOAD = """
INSERT INTO tasks (source, prompt, status, priority, max_tokens, estimated_tokens, model, prompt_tokens,
                   completion_tokens, answer, solved_at)
SELECT 'source-' || i, 'prompt ' || i, CASE i % 3 WHEN 0 THEN 'solved' WHEN 1 THEN 'running' ELSE 'pending' END,
       0, 256, 400, CASE WHEN i % 3 < 2 THEN 'model-0' END, CASE WHEN i % 3 = 0 THEN 100 END,
       CASE WHEN i % 3 = 0 THEN 100 END, CASE WHEN i % 3 = 0 THEN 'answer' END, CASE WHEN i % 3 = 0 THEN now() END
FROM generate_series(1, :sources) AS i
"""
LEDGER = """
INSERT INTO call_usage (call_id, task_id, source, model, admission_id, prompt_tokens, completion_tokens, answered,
                        hedge, ended_at)
SELECT 'c' || id, id, source, 'model-0', 'a' || id, 100, 100, true, false, now() FROM tasks WHERE status = 'solved'
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=int, default=50_000)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--interval", type=float, default=2.0, help="The console's --sample-interval, for the projection.")
    args = parser.parse_args()
    console = Console()
    with IsolatedServices(console, "sampler", keep_workdir=False) as iso:
        svc = iso.services
        svc.quotas.replace_all([Quota("model-0", 8, 1_000_000, price_per_million_input=1.0,
                                      price_per_million_output=2.0, currency="USD")], by="bench")
        with svc.engine.begin() as conn:
            conn.execute(sa.text(LOAD), {"sources": args.sources})
            conn.execute(sa.text(LEDGER))
        sampler = Sampler(svc, interval=args.interval)
        sampler.sample_now()  # warm: imports, connections, caches
        gc.collect()
        tracemalloc.start()
        before, _ = tracemalloc.get_traced_memory()
        took = []
        for _ in range(args.samples):
            began = time.perf_counter()
            sampler.sample_now()
            took.append(time.perf_counter() - began)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        per_sample = (after - before) / args.samples
        kept = int(HISTORY_S / args.interval) + 1
        console.print(f"{args.sources:,} sources: {per_sample / 1e6:.3f} MB per sample held; the 15-minute buffer "
                      f"({kept} samples at {args.interval:g} s) holds {per_sample * kept / 1e6:,.0f} MB; "
                      f"a sample takes {statistics.median(took) * 1000:.0f} ms (median)")
        with warnings.catch_warnings():  # Starlette 1.x would rather use httpx2 for its test client
            warnings.simplefilter("ignore")
            from starlette.testclient import TestClient
        app, _ = create_app(svc, sample_interval=args.interval)
        with TestClient(app) as client:
            for page in ("/sources", "/fragments/sources"):
                client.get(page)
                times, size = [], 0
                for _ in range(5):
                    began = time.perf_counter()
                    size = len(client.get(page).content)
                    times.append((time.perf_counter() - began) * 1000)
                console.print(f"{page}: {size / 1e3:,.1f} kB, median {statistics.median(times):.0f} ms, "
                              f"slowest {max(times):.0f} ms")


if __name__ == "__main__":
    main()
