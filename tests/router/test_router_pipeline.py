"""The router and the pipeline on one model: one budget, checked in the simulator's log.

Real processes: the simulator, the dispatcher, a worker, beat and
``balancer router``; router callers are the Airflow example's own task
function (``examples/airflow/router_tasks.py``), run here without Airflow.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

from balancer.devtools.embedded import free_port
from balancer.supervisor import wait_for_http
from tests.pipeline_harness import Pipeline, scenario_file

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "airflow" / "router_tasks.py"

# One strict model, bound by concurrency (3), TPM and RPM at once.
SHARED = {"name": "shared", "max_concurrent_requests": 3, "max_tokens_per_minute": 24000, "max_requests_per_minute": 150,
          "rpm_window": 10, "latency": {"median": 0.3, "p99": 0.6, "min": 0.2, "max": 0.8}}


def start_with_router(p: Pipeline) -> str:
    """Start the pipeline and ``balancer router`` beside it; the router's URL once it answers."""
    p.start()
    port = free_port()
    router = p.supervisor.start("router", ["router", "--port", str(port)])
    router_url = f"http://127.0.0.1:{port}"
    wait_for_http(f"{router_url}/healthz", child=router)
    return router_url


def example_tasks():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("router_tasks", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
@pytest.mark.usefixtures("migrated")
def test_router_callers_and_pipeline_workers_share_one_budget(tmp_path: Path) -> None:
    scenario = scenario_file(tmp_path / "shared.toml", [SHARED])
    p = Pipeline(tmp_path / "logs", scenario=scenario, extra_env={"BALANCER_ROUTER_LEASE_SECONDS": "5"})
    try:
        router_url = start_with_router(p)

        p.submit([{"prompt": f"pipeline prompt {i} " * 8, "max_tokens": 20} for i in range(30)])
        tasks = example_tasks()
        answers: list[list[dict]] = []

        def airflow_worker(n: int) -> None:
            prompts = [f"airflow worker {n} prompt {i} " * 6 for i in range(10)]
            answers.append(tasks.solve_with_router(prompts, router_url, p.backend_url, parallelism=2, max_tokens=20))

        callers = [threading.Thread(target=airflow_worker, args=(n,)) for n in range(3)]
        for t in callers:
            t.start()
        counts = p.wait_done(30, timeout=120)
        for t in callers:
            t.join(timeout=120)
        assert counts["solved"] == 30
        assert sorted(len(a) for a in answers) == [10, 10, 10]
        assert all(r["model"] == "shared" and r["answer"] for batch in answers for r in batch)

        log = p.sim_log()
        answered = [e for e in log if e["status"] == 200]
        assert len(answered) == 60  # 30 pipeline calls and 30 router calls, each answered once
        assert [e for e in log if e["status"] == 429] == []
        assert p.violations() == []  # cap, TPM and RPM held over both kinds of caller together
        peak = max(sum(1 for o in answered if o["start"] <= e["start"] < o["end"]) for e in answered)
        assert peak == 3  # the cap was reached: the two kinds of caller really overlapped
    finally:
        p.stop()


# One strict model bound by concurrency alone, for the hostile caller below.
CAPPED = {"name": "capped", "max_concurrent_requests": 4, "max_tokens_per_minute": 10000000,
          "latency": {"median": 0.4, "p99": 0.8, "min": 0.3, "max": 0.9}}


@pytest.mark.e2e
@pytest.mark.usefixtures("migrated")
def test_a_router_caller_cannot_free_or_keep_a_pipeline_calls_slot(tmp_path: Path) -> None:
    """R5: a caller sends /complete and /heartbeat with the admission ids of the
    pipeline's calls in flight, read from Redis as they run. Every one is refused,
    and the model's cap holds at the simulator (no concurrency 429)."""
    import httpx

    p = Pipeline(tmp_path / "logs", scenario=scenario_file(tmp_path / "capped.toml", [CAPPED]))
    try:
        router_url = start_with_router(p)
        p.submit([{"prompt": f"pipeline prompt {i} " * 8, "max_tokens": 20} for i in range(60)])
        replies: list[tuple[str, int, str]] = []
        stop = threading.Event()

        def hostile() -> None:
            with httpx.Client(base_url=router_url, timeout=10) as client:
                while not stop.is_set():
                    ids = [lid for _, lid in p.services.core.raw_state()["models"].get("capped", {}).get("inflight", [])]
                    for lid in ids:
                        for path in ("/complete", "/heartbeat"):
                            reply = client.post(path, json={"admission_id": lid})
                            replies.append((path, reply.status_code, reply.text))

        caller = threading.Thread(target=hostile)
        caller.start()
        try:
            counts = p.wait_done(60, timeout=120)
        finally:
            stop.set()
            caller.join(timeout=30)
        assert counts["solved"] == 60
        assert len(replies) > 100  # it really tried, while the pipeline ran
        assert {status for _, status, _ in replies} == {422}, replies[:3]
        log = p.sim_log()
        answered = [e for e in log if e["status"] == 200]
        assert len(answered) == 60  # each prompt answered once
        assert [e for e in log if e["status"] == 429] == []
        assert p.violations() == []  # the cap of 4 held
        peak = max(sum(1 for o in answered if o["start"] <= e["start"] < o["end"]) for e in answered)
        assert peak == 4
    finally:
        p.stop()
