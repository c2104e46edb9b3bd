"""Fair share, end to end: real workers on the simulator, a backfill and a live source."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.pipeline_harness import prompt_lines, scenario_file

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("migrated")]


#: Two concurrency-bound models with narrow latencies.
MODELS = [{"name": f"m-{i}", "max_concurrent_requests": 10, "max_tokens_per_minute": 5_000_000,
           "latency": {"median": 0.35, "p99": 0.5, "min": 0.2, "max": 1.0}} for i in range(2)]


def test_a_live_source_is_answered_before_half_the_backfill_drains(pipeline, tmp_path: Path) -> None:
    """1,400 tasks from one source, then 100 from another 3 s later, both at
    weight 1: the second source's last answer comes before half the backfill's
    drain time. By priority, then age (BALANCER_SOURCE_FAIRNESS=off) it would come last."""
    # Two concurrency-bound models with narrow latencies: about 55 calls/s, so the
    # backfill drains in about 25 s on any machine that keeps up, and the 3 s
    # and the live source's own calls stay small beside it.
    p = pipeline(scenario=scenario_file(tmp_path / "two-models.toml", MODELS)).start()
    names = [m.name for m in p.models]
    backfill = p.submit([{**line, "source": "backfill"} for line in prompt_lines(1_400, names, pinned_every=0)])
    began = time.monotonic()
    while time.monotonic() - began < 3:  # the live source arrives 3 s into the backfill's drain
        p.supervisor.check_alive()
        time.sleep(0.1)
    live = p.submit([{**line, "source": "live"} for line in prompt_lines(100, names, pinned_every=0, seed=4)])
    counts = p.wait_done(len(backfill) + len(live), timeout=300)
    assert counts["solved"] == len(backfill) + len(live)
    rows = {r.id: r for r in p.rows()}
    start = min(rows[i].created_at for i in backfill)
    drain = (max(rows[i].solved_at for i in backfill) - start).total_seconds()
    live_done = (max(rows[i].solved_at for i in live) - start).total_seconds()
    assert live_done < drain / 2, (live_done, drain)
