"""Today's Airflow pattern, exactly as the users run it (a benchmark baseline, not product code).

Each DAG run:

1. fetches every unsolved task and splits them into 20 equal parts;
2. 20 workers each take 10 tasks at a time from their part and ``POST /batch``
   them *without* a model, so the backend spreads them round-robin over the
   models, unaware of quotas;
3. each worker waits for the whole batch, writes the answers and ``solved``,
   and repeats;
4. a worker stops after 30 (scaled) minutes; a batch still out at that moment
   is abandoned, its calls still running at the backend;
5. when every worker has stopped or finished, the DAG restarts. Prompts that
   got a 429 or an error stay unsolved until a later run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.storage.schema import tasks

WORKERS = 20
BATCH = 10
TIMEOUT_MINUTES = 30


def unsolved(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(
            sa.select(tasks.c.id, tasks.c.prompt).where(tasks.c.status != "solved").order_by(tasks.c.id)
        ).all())


def write_answers(engine: Engine, done: list[tuple[int, dict[str, Any]]]) -> None:
    if not done:
        return
    with engine.begin() as conn:
        for task_id, result in done:
            usage = result.get("usage") or {}
            conn.execute(
                sa.update(tasks).where(tasks.c.id == task_id, tasks.c.status != "solved").values(
                    status="solved", answer=result.get("answer"), model=result.get("model"),
                    prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
                    started_at=sa.func.now(), solved_at=sa.func.now(), updated_at=sa.func.now(),
                )
            )


def run_worker(engine: Engine, backend_url: str, part: list[Any], deadline: float, call_timeout: float) -> None:
    with httpx.Client(base_url=backend_url, timeout=call_timeout) as client:
        for i in range(0, len(part), BATCH):
            if time.time() >= deadline:
                return
            chunk = part[i : i + BATCH]
            try:
                # The worker is killed at its deadline: the batch is abandoned mid-flight.
                left = min(call_timeout, deadline - time.time())
                reply = client.post("/batch", json={"prompts": [row.prompt for row in chunk]}, timeout=max(0.1, left))
                results = reply.json().get("results", [])
            except (httpx.HTTPError, ValueError):
                continue  # the whole batch stays unsolved until a later DAG run
            if time.time() >= deadline:
                return  # timed out while waiting: the answers are abandoned
            write_answers(engine, [(row.id, r) for row, r in zip(chunk, results, strict=True) if r.get("status") == 200])


def run_baseline(
    engine: Engine, backend_url: str, *, time_scale: float, on_progress: Callable[[int], None] | None = None,
    max_seconds: float = 3600.0, call_timeout: float = 600.0,
) -> dict[str, Any]:
    """Run DAG cycles until everything is solved (or ``max_seconds``); returns timings."""
    started = time.time()
    cycles = 0
    total = len(unsolved(engine))
    while True:
        todo = unsolved(engine)
        if on_progress:
            on_progress(total - len(todo))
        if not todo or time.time() - started > max_seconds:
            break
        cycles += 1
        parts = [todo[i::WORKERS] for i in range(WORKERS)]
        deadline = time.time() + TIMEOUT_MINUTES * 60 * time_scale
        threads = [threading.Thread(target=run_worker, args=(engine, backend_url, part, deadline, call_timeout))
                   for part in parts if part]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            for thread in threads:
                thread.join(timeout=0.5)
            if on_progress:
                on_progress(total - len(unsolved(engine)))
    finished = time.time()
    remaining = len(unsolved(engine))
    return {"started": started, "finished": finished, "cycles": cycles, "unsolved": remaining}
