"""``balancer flower``: Flower started for real on the pipeline's broker and app, read through its API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from balancer.admission import keys
from balancer.backlog.reads import status_counts
from balancer.devtools.embedded import free_port
from balancer.devtools.sim.config import default_models
from balancer.services import Services
from balancer.settings import Settings
from balancer.supervisor import Supervisor, pipeline_plan, wait_for_http

pytestmark = pytest.mark.timeout(300)
AUTH = ("ops", "secret")


def submit(env: dict[str, str], prompts: list[tuple[str, str]]) -> None:
    """Submit (prompt, model) pairs: each pinned, so that every model gets work whatever
    placement would prefer (unpinned, a faster model can take nearly all of them)."""
    done = subprocess.run([sys.executable, "-m", "balancer", "submit", "-"],
                          input="".join(json.dumps({"prompt": p, "model": m}) + "\n" for p, m in prompts),
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr


def test_flower_lists_every_model_queue_names_solves_by_model_and_leaves_the_ticks_out(
        migrated: dict[str, str], tmp_path: Path) -> None:
    models = default_models(2)
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([m.quota(time_scale=0.02) for m in models], by="test")
    sim_port, flower_port = free_port(), free_port()
    env = {**os.environ, "BALANCER_BACKEND_URL": f"http://127.0.0.1:{sim_port}", "BALANCER_DISPATCH_TICK": "0.5",
           "BALANCER_HOME": str(tmp_path)}
    api = f"http://127.0.0.1:{flower_port}/api"
    with Supervisor(tmp_path / "logs", env=env) as supervisor:
        sim = supervisor.start("sim", ["sim", "--port", str(sim_port), "--models", "2", "--time-scale", "0.02"])
        wait_for_http(f"http://127.0.0.1:{sim_port}/models", child=sim)
        # One process per model: a model whose worker is stopped still has its queue listed.
        supervisor.start_plan(pipeline_plan([m.name for m in models]))
        flower = supervisor.start("flower", ["flower", "--port", str(flower_port), f"--basic-auth={AUTH[0]}:{AUTH[1]}"])
        wait_for_http(f"http://127.0.0.1:{flower_port}/healthcheck", timeout=60, child=flower)

        def workers_seen() -> bool:  # Flower has inspected the dispatcher and both workers
            supervisor.check_alive()
            return len(httpx.get(f"{api}/workers", auth=AUTH, params={"refresh": "1"}, timeout=30).json()) >= 3

        deadline = time.monotonic() + 90
        while not workers_seen():
            assert time.monotonic() < deadline, "Flower did not list the pipeline's three Celery processes"
            time.sleep(1)
        solves: list[dict] = []
        deadline, sent = time.monotonic() + 120, 0
        while len({t["name"] for t in solves}) < 2:  # events on (Flower turns them on): tasks of both models
            assert time.monotonic() < deadline, f"Flower's task list: {solves}"
            submit(env, [(f"question {sent + i}", models[i % 2].name) for i in range(10)])
            sent += 10
            time.sleep(2)
            tasks = httpx.get(f"{api}/tasks", auth=AUTH, timeout=30).json()
            solves = [t for t in tasks.values() if t["name"] and t["name"].startswith(keys.SOLVE_TASK)]
        assert {t["name"] for t in solves} == {keys.solve_shown(m.name) for m in models}
        names = {t["name"] for t in httpx.get(f"{api}/tasks", auth=AUTH, timeout=30).json().values()}
        assert not names & set(keys.TICK_TASKS), names  # the ticks ran all along, but are not listed
        deadline = time.monotonic() + 120
        while status_counts(svc.engine)["solved"] < sent:
            assert time.monotonic() < deadline, status_counts(svc.engine)
            time.sleep(0.5)
        supervisor.stop(next(c for c in supervisor.children if c.name == f"worker-{models[1].name}"))
        queues = httpx.get(f"{api}/queues/length", auth=AUTH, timeout=30).json()["active_queues"]
        assert {q["name"] for q in queues} == {"control", *(keys.model_queue(m.name) for m in models)}
