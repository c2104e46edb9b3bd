"""Overhead: pipeline tasks/s at zero latency against a bare Celery no-op on the same broker.

    balancer bench bench/scenarios/overhead.toml

Both run in this process's run, on the same Redis broker, with thread pools of
the same width. The no-op is the ceiling for "one Celery task per prompt"; the
ratio says what admission, PostgreSQL writes and the HTTP call cost on top.
Target: ratio >= 0.5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from balancer.devtools.runner import IsolatedServices, run_pipeline
from balancer.devtools.scenario import Scenario, ScenarioError


def noop_rate(redis_url: str, tasks: int, concurrency: int, console: Console) -> float:
    run = uuid.uuid4().hex[:8]
    env = {**os.environ, "NOOP_BROKER_URL": redis_url, "NOOP_COUNTER_URL": redis_url,
           "NOOP_QUEUE": f"noop-{run}", "NOOP_PREFIX": f"noop-{run}:"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "balancer.bench.compare.noop_app", "worker", "-P", "threads",
         "-c", str(concurrency), "-n", f"noop-{run}@%h", "--without-gossip", "--without-mingle", "-l", "WARNING"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    client = redis.Redis.from_url(redis_url)
    key = f"noop-{run}:count"
    try:
        os.environ.update({k: env[k] for k in ("NOOP_BROKER_URL", "NOOP_COUNTER_URL", "NOOP_QUEUE", "NOOP_PREFIX")})
        from balancer.bench.compare import noop_app

        noop_app.noop.delay(key)  # warm-up: wait until the worker is consuming
        deadline = time.time() + 60
        while client.get(key) != b"1":
            assert time.time() < deadline, "no-op worker never started"
            time.sleep(0.05)
        client.delete(key)
        started = time.time()
        with noop_app.app.producer_or_acquire() as producer:
            for _ in range(tasks):
                noop_app.noop.apply_async(args=[key], producer=producer)
        while int(client.get(key) or 0) < tasks:
            assert time.time() - started < 600, "no-op run did not finish"
            time.sleep(0.01)
        elapsed = time.time() - started
        console.print(f"bare Celery no-op: {tasks} tasks in {elapsed:.2f} s")
        return tasks / elapsed
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(timeout=30)
        for k in client.scan_iter(match=f"noop-{run}*"):
            client.delete(k)


def main(scenario: Scenario, path: Path, out: Path, console: Console) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    concurrency = sum(m.max_concurrent_requests for m in scenario.models)
    with IsolatedServices(console, "overhead") as iso:
        layout = str(scenario.extra.get("worker_layout", "one"))
        if layout not in ("one", "per-model"):
            raise ScenarioError(f"{path}: worker_layout must be \"one\" or \"per-model\", not {layout!r}")
        result = run_pipeline(iso, quotas=scenario.quotas(), sim_args=["--scenario", str(path)],
                              backlog_jsonl=scenario.backlog_jsonl(), console=console, worker_layout=layout)
        pipeline = scenario.workload.tasks / result.makespan
        console.print(f"pipeline: {scenario.workload.tasks} tasks in {result.makespan:.2f} s")
        noop = noop_rate(iso.redis_url, int(scenario.extra.get("noop_tasks", 3000)), concurrency, console)
    report = {
        "scenario": scenario.name,
        "pipeline_tasks_per_s": round(pipeline, 1),
        "noop_tasks_per_s": round(noop, 1),
        "ratio": round(pipeline / noop, 3),
        "target": 0.5,
        "met": pipeline / noop >= 0.5,
        "pool_threads": concurrency,
        "worker_layout": layout,
    }
    (out / "overhead.json").write_text(json.dumps(report, indent=2))
    verdict = "met" if report["met"] else "MISSED"
    console.print(f"pipeline {report['pipeline_tasks_per_s']} tasks/s, bare no-op {report['noop_tasks_per_s']} tasks/s: "
                  f"ratio {report['ratio']} (target >= 0.5: {verdict})")
    return report
