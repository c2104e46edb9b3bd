"""Limits that learn, end to end: the real pipeline against a simulator whose
real limits are a tenth of the quota balancer is given, and header discovery.

The rule itself (429s lower, clean windows raise, headers adopted) is held
equal in Lua and the reference by hand-made sequences in tests/admission/test_differential.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.pipeline_harness import Pipeline, prompt_lines

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("migrated")]

SCENARIO = """
name = "learn-ci"
seed = 5
time_scale = 0.1

[workload]
tasks = 1
prompt_tokens = { median = 100, p99 = 200, min = 20, max = 400 }
output_tokens = { median = 64, p99 = 128, min = 16, max = 256 }

[[models]]   # the provider allows a tenth of our RPM and of our cap; it names neither limit
# Slow enough that its 4 slots send under 1.5 times its RPM, so its first 429 for requests
# comes past the first bucket (12 s here): the recent window's reading (admission/shown.py).
name = "strict"
max_concurrent_requests = 40
max_tokens_per_minute = 4000000
max_requests_per_minute = 600
real_requests = 0.1
real_concurrency = 0.1
limit_headers = false
latency = { median = 2.5, p99 = 4.0, min = 1.5, max = 5.0 }

[[models]]   # its quota sets no RPM (the test removes it); the provider sends x-ratelimit-limit-requests
name = "open-rpm"
max_concurrent_requests = 8
max_tokens_per_minute = 4000000
max_requests_per_minute = 300
latency = { median = 1.0, p99 = 3.0, min = 0.5, max = 5.0 }
"""


@pytest.fixture
def pipeline(tmp_path: Path):  # noqa: ANN201
    scenario = tmp_path / "learn-ci.toml"
    scenario.write_text(SCENARIO)
    p = Pipeline(tmp_path / "logs", scenario=scenario)
    yield p
    p.stop()


def test_limits_learn_a_provider_ten_times_stricter_and_discover_an_unset_rpm(pipeline: Pipeline) -> None:
    p = pipeline.start()
    p.services.quotas.set("open-rpm", {"max_requests_per_minute": None}, by="test")
    lines = [{**line, "model": "strict"} for line in prompt_lines(400, ["strict"], pinned_every=0)]
    lines += [{**line, "model": "open-rpm"} for line in prompt_lines(40, ["open-rpm"], pinned_every=0, seed=4)]
    ids = p.submit(lines)
    counts = p.wait_done(len(ids), timeout=240)
    assert counts["solved"] == len(ids) and counts["failed"] == 0

    calls = sorted((e for e in p.sim_log() if e["model"] == "strict"), key=lambda e: e["start"])
    half = calls[len(calls) // 2:]
    late_429s = sum(1 for e in half if e["status"] == 429)
    all_429s = sum(1 for e in calls if e["status"] == 429)
    # Learning takes a 429 or two early on; the second half of the run and the whole run are each
    # under issue 27's 1 % of calls: one for concurrency in the first second, one for requests
    # about 19 s in. Read from the quota's level, not our recent rate, requests came down by 7/10
    # a 429 at a time: 6 or 7 429s of ~406 calls. Without learning: 78 % of calls.
    kinds = Counter((round(e["start"] - calls[0]["start"]), e.get("limit")) for e in calls if e["status"] == 429)
    # Slow start: the quota's 40 slots open from 2, one at a time, twice as many every 250 ms, so
    # the first call past the provider's 4 is refused before many more slots open. Without it 40
    # calls went out before the first 429 came back: 6 and 24 429s in the first second in two runs.
    first_second = sum(1 for e in calls if e["status"] == 429 and e["start"] - calls[0]["start"] < 1.0)
    live = p.services.core.live()
    strict = live["strict"]
    # What the model learned, and the pace of its calls by second: a failure says why its 429s came.
    per_second = Counter(round(e["start"] - calls[0]["start"]) for e in calls)
    story = f"{kinds}; calls a second {[per_second[s] for s in range(max(per_second) + 1)]}; learned {strict.learned}"
    assert first_second <= 4, f"{first_second} 429s in the first second ({story})"
    assert all_429s <= 0.01 * len(calls), f"{all_429s} of {len(calls)} calls were 429s ({story})"
    assert late_429s <= 0.01 * len(half), f"{late_429s} of the last {len(half)} calls were 429s ({all_429s} in all: {story})"
    assert strict.limits.max_concurrent_requests < 40 or (strict.limits.max_requests_per_minute or 600) < 600
    assert strict.limits_reason

    # Discovery: the quota sets no RPM; the simulator's header says 300 per scenario minute (x 1 / 0.1 real).
    discovered = live["open-rpm"]
    assert p.services.quotas.get("open-rpm").max_requests_per_minute is None  # type: ignore[union-attr]
    assert discovered.limits.max_requests_per_minute == 3000
    assert "discovered" in discovered.limits_reason


def test_the_audit_records_a_learned_change_once_it_has_stood_a_minute(migrated: dict[str, str]) -> None:
    from balancer.admission.learned import Learned
    from balancer.admission.live import ModelLive
    from balancer.admission.quota import Quota
    from balancer.quotas.learned_audit import STEADY_MS, record_learned
    from balancer.quotas.store import QuotaStore
    from balancer.storage.db import cached_engine

    engine = cached_engine(migrated["BALANCER_DATABASE_URL"])
    quota = Quota("m", 40, 600_000, max_requests_per_minute=600)
    lowered = ModelLive(quota, 0, 0.0, 0.0, 0, learned=Learned(lrpm=420, prpm=600, lowered_at=1_000_000))
    assert record_learned(engine, {"m": lowered}, 1_000_000 + STEADY_MS - 1) == []       # not a minute yet
    assert record_learned(engine, {"m": lowered}, 1_000_000 + STEADY_MS) == ["m"]
    assert record_learned(engine, {"m": lowered}, 1_000_000 + 2 * STEADY_MS) == []       # audited once
    [row] = [r for r in QuotaStore(engine).history("m") if r["changed_by"] == "learned"]
    assert row["old_value"]["max_requests_per_minute"] == 600
    assert row["new_value"]["max_requests_per_minute"] == 420 and "lowered by 429s" in row["new_value"]["reason"]


def test_an_operators_quota_change_after_a_learned_row_is_not_audited_as_learned(migrated: dict[str, str]) -> None:
    """Issue 38 finding 13: after a learned row, an operator's `quota set` (which clears what was
    learned) moved the limits in force away from that row, and the next sweep wrote a second
    ``learned`` row for the operator's change. The operator's row is the new baseline."""
    import sqlalchemy as sa

    from balancer.admission.learned import Learned
    from balancer.admission.live import ModelLive
    from balancer.admission.quota import Quota
    from balancer.quotas.learned_audit import STEADY_MS, record_learned
    from balancer.quotas.store import QuotaStore
    from balancer.storage.db import cached_engine
    from balancer.storage.schema import quota_changes

    engine = cached_engine(migrated["BALANCER_DATABASE_URL"])
    quota = Quota("m", 40, 600_000, max_requests_per_minute=600)
    lowered = ModelLive(quota, 0, 0.0, 0.0, 0, learned=Learned(lrpm=420, prpm=600, lowered_at=1_000_000))
    assert record_learned(engine, {"m": lowered}, 1_000_000 + STEADY_MS) == ["m"]
    changed = Quota("m", 40, 900_000, max_requests_per_minute=500)
    with engine.begin() as conn:
        conn.execute(sa.insert(quota_changes).values(model="m", changed_by="ops", action="update",
                                                     old_value=quota.as_dict(), new_value=changed.as_dict()))
    after_set = ModelLive(changed, 0, 0.0, 0.0, 0, learned=Learned())
    assert record_learned(engine, {"m": after_set}, 1_000_000 + 3 * STEADY_MS) == []
    assert [r["changed_by"] for r in QuotaStore(engine).history("m")] == ["learned", "ops"]  # oldest first
    # A limit learned after the operator's change is audited against the operator's values.
    relowered = ModelLive(changed, 0, 0.0, 0.0, 0, learned=Learned(lrpm=300, prpm=500, lowered_at=2_000_000))
    assert record_learned(engine, {"m": relowered}, 2_000_000 + STEADY_MS) == ["m"]
    row = QuotaStore(engine).history("m")[-1]
    assert row["changed_by"] == "learned" and row["old_value"]["max_requests_per_minute"] == 500
