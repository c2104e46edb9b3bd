"""The work of the example DAG, as plain functions (no Airflow import), so a test
can run them against a live router and the simulator.

Two roads to the same Models Backend:

- :func:`solve_with_router`: the DAG keeps calling the backend itself, one
  prompt per call, and asks the router for each call's model (the seed's
  flow: schedule, sleep ``wait_for_ms`` or call, complete). It needs only
  ``httpx`` and ``balancer.client``.
- :func:`hand_to_pipeline`: the DAG writes the prompts as JSONL and submits
  them; the Celery pipeline solves them (the faster, complete road).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from balancer.client import RouterClient

#: A rough size proxy for /schedule when the caller has no tokenizer: ~4 characters per token.
CHARS_PER_TOKEN = 4


def estimate_tokens(prompt: str, max_tokens: int) -> int:
    """Prompt tokens (roughly) plus the most the answer may use."""
    return max(1, len(prompt) // CHARS_PER_TOKEN) + max_tokens


def solve_one(router: RouterClient, backend: httpx.Client, prompt: str, max_tokens: int = 256,
              models: Sequence[str] | None = None) -> dict[str, Any]:
    """One prompt through the router's slot and the Models Backend's ``/single``."""
    with router.slot(estimate_tokens(prompt, max_tokens), models=models) as slot:
        reply = backend.post("/single", json={"model": slot.model, "prompt": prompt, "max_tokens": max_tokens})
        reply.raise_for_status()
        data = reply.json()
        usage = data["usage"]
        slot.actual_tokens = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"prompt": prompt, "model": slot.model, "answer": data["answer"], "tokens": slot.actual_tokens}


def solve_with_router(prompts: Sequence[str], router_url: str, backend_url: str, *, token: str | None = None,
                      parallelism: int | None = None, max_tokens: int = 256) -> list[dict[str, Any]]:
    """Solve ``prompts`` with ``parallelism`` calls at once (default: the router's advice).

    Each prompt is its own call, so one slow answer holds up nothing else (the
    batch endpoint's tail is what the seed set out to remove)."""
    with RouterClient(router_url, token=token) as router, httpx.Client(base_url=backend_url, timeout=180) as backend:
        workers = parallelism or max(1, router.advice()["suggested_parallelism"])
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda p: solve_one(router, backend, p, max_tokens), prompts))


def hand_to_pipeline(prompts: Sequence[str], *, source: str = "airflow", max_tokens: int = 256) -> str:
    """The other road: submit the prompts to the Celery pipeline (``balancer submit``).

    Returns the command's summary line. The pipeline must be running
    (``balancer dispatcher``, ``balancer worker``, ``balancer beat``)."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "source": source}) + "\n")
    done = subprocess.run(["balancer", "submit", f.name], capture_output=True, text=True, check=True)  # noqa: S603, S607
    return (done.stdout or done.stderr).strip()
