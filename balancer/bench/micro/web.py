"""The web console's page times on a large backlog.

    python -m balancer.bench.micro.web [--tasks 1000000] [--models 10] [--repeat 20]

Loads ``--tasks`` tasks into a schema of its own (one in a hundred failed,
with five kinds of error; one in a hundred solved; the rest pending; five
sources; one in ten pinned to a model), VACUUM ANALYZEs them, then serves the
console in this process (Starlette's test client: the ASGI app without
uvicorn's socket) with its sampler running, as ``balancer web`` does, and
times every page ``--repeat`` times. Prints the median and the slowest per
page, the sampler's own read (in its thread, off the pages' path), and
whether every page's median met the target (< 200 ms).

Uses BALANCER_REDIS_URL / BALANCER_DATABASE_URL when set, else an embedded
stack; drops its own schema and keys afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from balancer.admission.quota import Quota
from balancer.devtools.runner import IsolatedServices
from balancer.web.app import create_app
from balancer.web.sampler import take_sample

TARGET_MS = 200.0

LOAD = """
INSERT INTO tasks (source, prompt, status, priority, allowed_models, max_tokens, estimated_tokens, error, model,
                   attempts, prompt_tokens, completion_tokens, answer, solved_at)
SELECT 'source-' || (i % 5),
       'prompt ' || i || ' ' || repeat('word ', 20),
       CASE WHEN i % 100 = 0 THEN 'failed' WHEN i % 100 = 1 THEN 'solved' ELSE 'pending' END,
       0,
       CASE WHEN i % 10 = 3 THEN ARRAY['model-' || ((i / 10) % :models)] END,
       256, 400,
       CASE WHEN i % 100 = 0 THEN 'HTTP ' || (400 + (i / 100) % 5) || ' from the backend: task ' || i END,
       CASE WHEN i % 100 IN (0, 1) THEN 'model-' || ((i / 100) % :models) END,
       CASE WHEN i % 100 = 0 THEN 5 WHEN i % 100 = 1 THEN 1 ELSE 0 END,
       CASE WHEN i % 100 = 1 THEN 120 END, CASE WHEN i % 100 = 1 THEN 200 END,
       CASE WHEN i % 100 = 1 THEN 'answer ' || i END,
       CASE WHEN i % 100 = 1 THEN now() END
FROM generate_series(1, :tasks) AS i
"""


def load(iso: IsolatedServices, tasks: int, models: int, console: Console) -> float:
    began = time.perf_counter()
    with iso.services.engine.begin() as conn:
        conn.execute(sa.text(LOAD), {"tasks": tasks, "models": models})
    with iso.services.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE tasks"))
    seconds = time.perf_counter() - began
    console.print(f"loaded {tasks:,} tasks in {seconds:.1f} s (INSERT ... SELECT, then VACUUM ANALYZE)")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    console = Console()
    with IsolatedServices(console, "web", keep_workdir=False) as iso:
        svc = iso.services
        svc.quotas.replace_all([Quota(f"model-{i}", max_concurrent_requests=8, max_tokens_per_minute=1_000_000)
                                for i in range(args.models)], by="bench")
        load(iso, args.tasks, args.models, console)
        sampled = []
        for _ in range(5):
            began = time.perf_counter()
            take_sample(svc)
            sampled.append((time.perf_counter() - began) * 1000)
        with svc.engine.connect() as conn:
            failed_id = conn.execute(sa.text("SELECT max(id) FROM tasks WHERE status = 'failed'")).scalar()
        pages = ["/models", "/fragments/models", "/drain", "/sources", "/quotas", "/api/summary",
                 "/tasks", "/tasks?status=failed", "/tasks?status=pending&model=model-3", "/tasks?source=source-3",
                 f"/tasks?task_id={failed_id}", f"/tasks/{failed_id}", f"/tasks/retry?task_id={failed_id}",
                 "/tasks?created_after=2000-01-01T00:00&status=solved",
                 "/tasks?source=no-such-source", "/tasks?model=no-such-model", "/tasks?status=failed&source=source-1"]
        with warnings.catch_warnings():  # Starlette 1.x would rather use httpx2 for its test client
            warnings.simplefilter("ignore")
            from starlette.testclient import TestClient
        app, _ = create_app(svc, sample_interval=2.0)
        table = Table(title=f"web console pages, {args.tasks:,} tasks, {args.models} models ({args.repeat} requests each)")
        for col in ("page", "median ms", "slowest ms", "status"):
            table.add_column(col, justify="left" if col == "page" else "right")
        medians = {}
        with TestClient(app) as client:
            client.get("/models")  # the first sample, and warm caches
            for page in pages:
                times, status = [], 0
                for _ in range(args.repeat):
                    began = time.perf_counter()
                    status = client.get(page).status_code
                    times.append((time.perf_counter() - began) * 1000)
                medians[page] = statistics.median(times)
                table.add_row(page, f"{medians[page]:.1f}", f"{max(times):.1f}", str(status))
        console.print(table)
        console.print(f"sampler read (counts, summary, sources, spend; in its thread every --sample-interval): "
                      f"median {statistics.median(sampled):.0f} ms, slowest {max(sampled):.0f} ms")
        worst = max(medians, key=lambda p: medians[p])
        verdict = "met" if medians[worst] < TARGET_MS else "MISSED"
        console.print(f"target: every page < {TARGET_MS:.0f} ms; slowest median {medians[worst]:.1f} ms ({worst}): {verdict}")


if __name__ == "__main__":
    main()
