"""Plumbing of the admission core: script loading, keys, clock."""

from __future__ import annotations

import uuid

import pytest
import redis

from balancer.admission import keys as keys_module
from balancer.admission.core import _SCRIPTS, AdmissionCore
from balancer.admission.quota import Quota
from balancer.admission.values import Admitted, Candidate, NotNow
from tests.twin import delete_keys


@pytest.fixture
def core(redis_client: redis.Redis, namespace: str) -> AdmissionCore:
    core = AdmissionCore(redis_client, namespace, lease_ms=60_000)
    core.restore([])
    core.set_quota(Quota("a", 2, 60_000))
    return core


@pytest.mark.smoke
def test_admits_with_redis_clock(core: AdmissionCore, redis_client: redis.Redis) -> None:
    first, second, third = core.admit([Candidate(100)] * 3)
    assert isinstance(first, Admitted) and isinstance(second, Admitted)
    assert isinstance(third, NotNow)
    seconds, micros = redis_client.time()
    redis_now = seconds * 1000 + micros // 1000
    assert abs(third.now_ms - redis_now) < 2_000  # the script read Redis TIME
    assert third.retry_at_ms == third.now_ms + 60_000  # the earliest lease deadline frees a slot


def test_every_key_shares_the_hash_tag(core: AdmissionCore, redis_client: redis.Redis, namespace: str) -> None:
    core.admit([Candidate(100)])
    keys = [k.decode() for k in redis_client.scan_iter(match=f"*{namespace}*")]
    assert len(keys) >= 5  # meta, models, leases, model:a, inflight:a
    assert all(k.startswith(keys_module.tag(namespace) + ":") for k in keys)


def test_noscript_falls_back_to_reload(redis_client: redis.Redis, namespace: str) -> None:
    """A server that never saw the script (or flushed it) gets it loaded on demand.
    We use a uniquely-commented copy so nothing shared is flushed."""
    core = AdmissionCore(redis_client, namespace, lease_ms=300_000)
    marker = f"-- {uuid.uuid4()}\n"
    script = redis_client.register_script(marker + _SCRIPTS["restore"])
    assert redis_client.script_exists(script.sha) == [False]
    core._scripts["restore"] = script
    assert core.restore([Quota("a", 1, 5)]) is True
    assert redis_client.script_exists(script.sha) == [True]


def test_two_deployments_share_one_redis(redis_client: redis.Redis) -> None:
    one, two = "n" + uuid.uuid4().hex[:10], "n" + uuid.uuid4().hex[:10]
    try:
        a = AdmissionCore(redis_client, one, lease_ms=300_000)
        b = AdmissionCore(redis_client, two, lease_ms=300_000)
        a.restore([]), b.restore([])
        a.set_quota(Quota("m", 1, 60_000))
        b.set_quota(Quota("m", 1, 60_000))
        assert isinstance(a.admit([Candidate(1)])[0], Admitted)
        assert isinstance(b.admit([Candidate(1)])[0], Admitted)  # separate slots
    finally:
        delete_keys(redis_client, one)
        delete_keys(redis_client, two)


def test_restored_leases_are_placed_on_the_redis_clock(redis_client: redis.Redis, namespace: str) -> None:
    """PostgreSQL's clock may be far from Redis's: a restored lease keeps its time
    left, counted from Redis TIME, not PostgreSQL's instant."""
    from balancer.admission.values import LeaseSeed

    core = AdmissionCore(redis_client, namespace, lease_ms=60_000)
    assert core.restore([Quota("a", 2, 60_000)], [LeaseSeed("old-1", "a", 10, remaining_ms=7_000)])
    seconds, micros = redis_client.time()
    redis_now = seconds * 1000 + micros // 1000
    deadline = redis_client.zscore(keys_module.inflight(namespace, "a"), "old-1")
    assert deadline is not None and abs(deadline - (redis_now + 7_000)) < 1_000
    assert core.live()["a"].in_flight == 1  # still counted against the cap


def test_a_restore_opens_slow_start_from_the_calls_still_running(redis_client: redis.Redis, namespace: str) -> None:
    """After Redis lost its data, a model's slow start opens from the calls PostgreSQL says
    are running (5 here), not from 2: from 2 it would admit nothing until most of them ended."""
    from balancer.admission.values import LeaseSeed

    core = AdmissionCore(redis_client, namespace, lease_ms=60_000)
    seeds = [LeaseSeed(f"old-{i}", "a", 10, remaining_ms=60_000) for i in range(5)]
    assert core.restore([Quota("a", 40, 600_000)], seeds)
    assert core.live()["a"].cap_now == 5
    assert core.live()["a"].limits_reason == ""  # said once a call starts under it (its steps begin)


def test_the_refill_gap_is_measured_from_a_full_models_freed_slot(redis_client: redis.Redis, namespace: str) -> None:
    """finish.lua marks a slot freed by a model at its cap; admit.lua counts the
    wait until the model's next admission (metrics only), on an injected clock."""
    from balancer.admission.values import Settlement
    from tests.twin import Twin

    def stats() -> dict[str, int]:
        return {k.decode(): int(v) for k, v in redis_client.hgetall(keys_module.stats(namespace, "a")).items()}

    twin = Twin(redis_client, namespace)
    twin.set_quota(Quota("a", 2, 600_000))
    first, second = twin.admit([Candidate(10), Candidate(10)])
    assert isinstance(first, Admitted) and isinstance(second, Admitted)
    twin.advance(100)
    twin.finish(first.admission_id, Settlement(used_tokens=10, reserved_tokens=10, latency_ms=100, completion_tokens=1))
    twin.advance(30)
    third = twin.admit([Candidate(10)])[0]
    assert isinstance(third, Admitted)
    assert (stats()["gap50"], stats()["gap_ms"], stats()["gaps"], stats()["freed_at"]) == (1, 30, 1, 0)
    twin.release(second.admission_id)  # full: the clock starts
    twin.advance(2_000)
    twin.release(third.admission_id)  # below the cap: it does not restart the clock
    twin.advance(1_000)
    assert isinstance(twin.admit([Candidate(10)])[0], Admitted)
    assert (stats()["gap5000"], stats()["gap_ms"], stats()["gaps"]) == (1, 3_030, 2)


def test_quota_changes_apply_in_one_transaction(redis_client: redis.Redis, namespace: str) -> None:
    """An import's changes go to Redis in one MULTI/EXEC: created, changed and
    removed together; a missing live state is rebuilt first."""
    core = AdmissionCore(redis_client, namespace, lease_ms=300_000)
    core.restore([Quota("old", 1, 5), Quota("kept", 1, 5)])
    core.apply_quotas([("new", Quota("new", 2, 60)), ("kept", Quota("kept", 3, 5)), ("old", None)])
    live = core.live()
    assert sorted(live) == ["kept", "new"] and live["kept"].quota.max_concurrent_requests == 3
    delete_keys(redis_client, namespace)  # Redis lost everything: restored (empty source), then applied
    core.apply_quotas([("again", Quota("again", 1, 5))])
    assert sorted(core.live()) == ["again"]
