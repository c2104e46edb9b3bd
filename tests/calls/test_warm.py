"""A worker process makes its backend client before it says it consumes a model's queue,
not at its first message (balancer.calls.runtime.warm)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.pipeline_harness import Pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("migrated")]


def test_a_worker_has_its_backend_client_before_its_model_is_consumed(tmp_path: Path) -> None:
    """Made lazily, the client (its module's import, its TLS context) was built by the
    first solve, with every worker process starting at once: each model's first calls
    waited for it. The worker's log says when the client is ready; by the time the
    model's consumer record is in Redis (the dispatcher admits nothing before it),
    that line is there, and no message has been taken yet."""
    p = Pipeline(tmp_path / "logs", model_count=1)
    try:
        p.start(workers=[["--model", p.models[0].name]], beat=False)
        name, deadline = p.models[0].name, time.monotonic() + 60
        while not getattr(p.services.core.live().get(name), "consumers", 0):
            assert time.monotonic() < deadline, f"no consumer record for {name}; logs in {p.log_dir}"
            time.sleep(0.05)
        log = (p.log_dir / "worker-0.log").read_text()
        assert f"backend client ready: models-backend at {p.backend_url}" in log, log[-2000:]
        assert p.sim_log() == []  # nothing was called: the client was made before any message
    finally:
        p.stop()
