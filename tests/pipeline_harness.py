"""Run the real pipeline for a test: simulator, dispatcher, workers, beat.

Real subprocesses, real broker, the test's own Redis namespace and
PostgreSQL schema. Quotas are the simulator's default models at the test's
time scale.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import parse_tasks
from balancer.backlog.reads import status_counts
from balancer.devtools.embedded import free_port
from balancer.devtools.runner import control_app
from balancer.devtools.scenario import parse_scenario
from balancer.devtools.sim.audit import Call, Limits, audit, calls_from_log, limits_for
from balancer.devtools.sim.config import SimModel, default_models
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import tasks
from balancer.supervisor import Supervisor, wait_for_http


@dataclass
class Pipeline:
    log_dir: Path
    time_scale: float = 0.02
    model_count: int = 10
    broker_url: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    grace: float = 0.0
    accounting: str = "reserve"  # how the simulated provider counts; the quotas match it
    #: A scenario TOML file: its models and time scale replace the default models.
    scenario: Path | None = None

    def __post_init__(self) -> None:
        self.port = free_port()
        self.backend_url = f"http://127.0.0.1:{self.port}"
        self.models: list[SimModel] = [replace(m, accounting=self.accounting)
                                       for m in default_models(self.model_count)]
        if self.scenario is not None:
            spec = parse_scenario(self.scenario.read_text(), self.scenario.name)
            self.models, self.time_scale = list(spec.models), spec.time_scale
        env = {"BALANCER_BACKEND_URL": self.backend_url, "BALANCER_DISPATCH_TICK": "0.5", **self.extra_env}
        if self.broker_url:
            env["BALANCER_BROKER_URL"] = self.broker_url
        self._saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        self.env = {**os.environ}
        self.supervisor = Supervisor(self.log_dir, env=self.env).__enter__()
        self.services = Services.connect(Settings.from_env())

    def start(self, *, workers: list[list[str]] | None = None, beat: bool = True,
              worker_env: dict[str, str] | None = None) -> Pipeline:
        """Start the simulator, dispatcher, workers and beat; ``worker_env`` is the
        workers' own (e.g. a database URL through a proxy only they use)."""
        self.services.quotas.replace_all([m.quota(time_scale=self.time_scale) for m in self.models], by="test")
        source = ["--scenario", str(self.scenario)] if self.scenario else [
            "--models", str(self.model_count), "--time-scale", str(self.time_scale), "--accounting", self.accounting]
        self.sim = self.supervisor.start("sim", ["sim", "--port", str(self.port), "--grace", str(self.grace), *source])
        wait_for_http(f"{self.backend_url}/models", child=self.sim)
        self.supervisor.start("dispatcher", ["dispatcher", "--loglevel", "INFO"])
        for i, argv in enumerate(workers or [["--all-models"]]):
            self.supervisor.start(f"worker-{i}", ["worker", *argv, "--loglevel", "INFO"], worker_env)
        if beat:
            self.supervisor.start("beat", ["beat", "--loglevel", "INFO"], {"BALANCER_HOME": str(self.log_dir)})
        return self

    def stop(self) -> None:
        # As Supervisor.stop_all (SIGTERM, 5 s, then SIGKILL), but for every process at
        # once rather than one after another; stop_all then reaps them and their groups.
        running = [c for c in self.supervisor.children if c.process.poll() is None]
        for child in running:
            self.supervisor.kill(child, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for child in running:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.supervisor.kill(child, signal.SIGKILL)
        self.supervisor.stop_all()
        for key, value in self._saved_env.items():  # later tests must not inherit this run's broker etc.
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def control_app(self):  # noqa: ANN201
        """A Celery app configured from *this* pipeline's environment."""
        return control_app("balancer-test-control")

    # -- work ------------------------------------------------------------------------
    def submit(self, lines: list[dict[str, Any]]) -> list[int]:
        import json

        text = "\n".join(json.dumps(line) for line in lines)
        rows, errors = parse_tasks(text, models={q.name: q.burst for q in self.services.quotas.all()})
        assert not errors, errors
        with self.services.engine.begin() as conn:
            return insert_tasks(conn, rows)

    def counts(self) -> dict[str, int]:
        return status_counts(self.services.engine)

    def wait_done(self, total: int, timeout: float = 120.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        while True:
            self.supervisor.check_alive()
            counts = self.counts()
            if counts["solved"] + counts["failed"] >= total:
                return counts
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {timeout}s: {counts}; logs in {self.log_dir}")
            time.sleep(0.25)

    def rows(self) -> list[Any]:
        with self.services.engine.connect() as conn:
            return conn.execute(sa.select(tasks).order_by(tasks.c.id)).all()

    # -- the simulator's view ----------------------------------------------------------
    def sim_log(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.backend_url}/log", timeout=10).json()["entries"]

    def limits(self) -> dict[str, Limits]:
        return limits_for((m.quota(time_scale=self.time_scale) for m in self.models), self.grace)

    @staticmethod
    def calls(entries: list[dict[str, Any]]) -> list[Call]:
        return calls_from_log(entries)

    def violations(self) -> list:
        return audit(self.calls(self.sim_log()), self.limits())


def prompt_lines(count: int, models: list[str], pinned_every: int = 10, seed: int = 3) -> list[dict[str, Any]]:
    import random

    rng = random.Random(seed)
    lines = []
    for i in range(count):
        line: dict[str, Any] = {"prompt": f"task-{i} " + "word " * rng.randint(20, 400), "max_tokens": rng.choice([64, 128, 256])}
        if pinned_every and i % pinned_every == 0:
            line["model"] = models[i % len(models)]
        lines.append(line)
    return lines


def scenario_file(path: Path, models: list[dict[str, Any]], time_scale: float = 1.0) -> Path:
    """A scenario TOML at ``path`` for :class:`Pipeline`, of ``models`` (each a simulated model's
    fields, as in docs/scenarios.md). A pipeline takes only the models and the time scale from it
    (the test submits its own tasks; the simulator draws with ``sim --seed``), so its workload is
    a placeholder."""
    import tomli_w

    placeholder = {"median": 50, "p99": 50, "min": 50, "max": 50}
    workload = {"tasks": 1, "prompt_tokens": placeholder, "output_tokens": placeholder}
    path.write_text(tomli_w.dumps({"name": path.stem, "time_scale": time_scale, "workload": workload, "models": models}))
    return path
