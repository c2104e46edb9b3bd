"""Issue 41 deliverable 3: a quota's window cap. With ``window_cap`` no 60 s window admits more
than the quota's TPM tokens or RPM requests (the bucket alone allows its burst on top).

The property and the hand-made cases run through ``Twin``: the Lua in a real Redis and the
reference model, held to the same answers.
"""

from __future__ import annotations

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer.admission.core import AdmissionCore
from balancer.admission.quota import Quota
from balancer.admission.values import Admitted, Candidate, NotNow
from balancer.admission.window import WINDOW_MS
from balancer.errors import QuotaError
from tests.twin import LEASE_MS, Twin


def most_in_a_window(charges: list[tuple[int, int]], window_ms: int = 60_000) -> tuple[int, int]:
    """The most tokens and admissions any 60 s window ([s, s + 60,000 ms)) holds."""
    most_tokens = most_calls = 0
    for start, _ in charges:
        inside = [tokens for at, tokens in charges if start <= at < start + window_ms]
        most_tokens, most_calls = max(most_tokens, sum(inside)), max(most_calls, len(inside))
    return most_tokens, most_calls


capped_quotas = st.builds(
    Quota,
    name=st.just("m"),
    max_concurrent_requests=st.integers(1, 8),
    max_tokens_per_minute=st.integers(600, 20_000),
    max_requests_per_minute=st.none() | st.integers(1, 40),
    burst_tokens=st.none() | st.integers(1, 600),
    learn=st.booleans(),
    window_cap=st.just(True),
)
plans = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.lists(st.integers(1, 2_000), min_size=1, max_size=6)),
        st.tuples(st.just("release"), st.integers(0, 100)),
        st.tuples(st.just("renew"), st.integers(0, 100)),
        st.tuples(st.just("finish"), st.integers(0, 100)),
        st.tuples(st.just("advance"), st.integers(0, 5_000)),
        st.tuples(st.just("advance"), st.integers(0, 40_000)),
        st.tuples(st.just("advance"), st.just(LEASE_MS + 1)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(quota=capped_quotas, plan=plans)
def test_no_window_admits_above_the_cap(new_twin, quota: Quota, plan: list[tuple]) -> None:  # noqa: ANN001
    """Issue 41 deliverable 3: for any admission sequence (refunds of unstarted leases, expired
    leases re-acquired by renew, calls finished), no 60 s window admits more than TPM tokens,
    nor more than RPM requests, when the cap is on; nor does any window of a minute and the hop."""
    twin: Twin = new_twin()
    twin.set_quota(quota)
    charges: list[tuple[int, int]] = []  # (ms, tokens) of every admission, refunded or not
    issued: list[tuple[str, int]] = []
    for step in plan:
        if step[0] == "admit":
            for est, decision in zip(step[1], twin.admit([Candidate(e) for e in step[1]])):
                if isinstance(decision, Admitted):
                    charges.append((twin.now, est))
                    issued.append((decision.admission_id, est))
        elif step[0] == "advance":
            twin.advance(step[1])
        elif issued:
            lid, est = issued[step[1] % len(issued)]
            if step[0] == "release":
                twin.release(lid)
            elif step[0] == "finish":
                twin.finish(lid, est)
            else:
                before = {i for _, i in twin.core.raw_state()["models"]["m"]["inflight"]}
                if isinstance(twin.renew(lid, "m", est), Admitted) and lid not in before:
                    charges.append((twin.now, est))  # an expired or released lease re-acquired: charged again
    tokens, calls = most_in_a_window(charges, WINDOW_MS)  # a minute and the hop (window.HOP_MS)
    assert tokens <= quota.max_tokens_per_minute
    if quota.max_requests_per_minute:
        assert calls <= quota.max_requests_per_minute


def steady_demand(client: redis.Redis, namespace: str, quota: Quota, minutes: int) -> list[tuple[int, int]]:
    """A backlog of 1,000-token tasks offered every 250 ms for ``minutes`` to the real Lua core in a real
    Redis; each admitted call is started and answered a second later. Returns (ms, tokens) admitted."""
    clock = [1_700_000_000_000]
    core = AdmissionCore(client, namespace, lease_ms=30_000, clock=lambda: clock[0], restore=lambda: ([], []))
    core.set_quota(quota)
    admitted: list[tuple[int, int]] = []
    running: list[tuple[int, str]] = []
    end = clock[0] + minutes * 60_000
    while clock[0] < end:
        for decision in core.admit([Candidate(1_000) for _ in range(4)]):
            if isinstance(decision, Admitted):
                core.renew(decision.admission_id, decision.model, 1_000)
                admitted.append((clock[0], 1_000))
                running.append((clock[0] + 1_000, decision.admission_id))
        clock[0] += 250
        for done in [r for r in running if r[0] <= clock[0]]:
            core.release(done[1])
            running.remove(done)
    return admitted


def test_a_window_cap_holds_every_minute_on_real_redis(redis_client: redis.Redis, namespace: str) -> None:
    """Issue 41 deliverable 3: three minutes of a backlog far above the quota on the real scripts.
    Without the cap, the worst 60 s admits the TPM plus its burst (the bucket's full start, then
    the refill); with it, never above the TPM or the RPM, and still the whole TPM each minute."""
    plain = Quota("m", 50, 30_000, max_requests_per_minute=60, slow_start=False)
    tokens, _ = most_in_a_window(steady_demand(redis_client, namespace + "p", plain, 3))
    assert tokens > 30_000 * 1.5  # the burst on top: what `top` shows as 46,531 / 30,000
    admitted = steady_demand(redis_client, namespace + "c", plain.replace(window_cap=True), 3)
    tokens, calls = most_in_a_window(admitted, WINDOW_MS)
    assert tokens <= 30_000 and calls <= 60
    assert sum(t for at, t in admitted if at >= admitted[0][0] + 120_000) >= 30_000 * 0.9  # the last minute


def test_the_window_ends_on_the_ms(twin: Twin) -> None:
    """Issue 41 deliverable 3: an admission leaves the window exactly WINDOW_MS (a minute and the hop) after it,
    and the not-now says when."""
    twin.set_quota(Quota("m", 8, 1_000, window_cap=True, slow_start=False))
    t0 = twin.now
    assert isinstance(twin.admit([Candidate(1_000)])[0], Admitted)
    twin.advance(WINDOW_MS - 1)
    decision = twin.admit([Candidate(1)])[0]
    assert isinstance(decision, NotNow) and decision.retry_at_ms == t0 + WINDOW_MS  # the bucket has refilled
    twin.advance(1)
    assert isinstance(twin.admit([Candidate(1_000)])[0], Admitted)


def test_a_large_task_waiting_on_the_window_holds_it(twin: Twin) -> None:
    """Issue 41 deliverable 3: small tasks behind a large one that waits for the window's tokens do not
    take them first (the rule that holds a bucket for it holds the window too)."""
    twin.set_quota(Quota("m", 8, 3_000, window_cap=True, slow_start=False))
    assert isinstance(twin.admit([Candidate(2_500)])[0], Admitted)
    twin.advance(30_000)  # the bucket has 1,500 more; the window has 500 left
    large, small = twin.admit([Candidate(1_000), Candidate(100)])
    assert isinstance(large, NotNow) and isinstance(small, NotNow)
    assert isinstance(twin.admit([Candidate(100)])[0], Admitted)  # a batch later, with nothing larger ahead


def test_requests_are_capped_over_the_window(twin: Twin) -> None:
    """Issue 41 deliverable 3: RPM 2 under a window cap admits two calls a minute, whatever the bucket holds."""
    twin.set_quota(Quota("m", 8, 100_000, max_requests_per_minute=2, window_cap=True, slow_start=False))
    assert [type(d) for d in twin.admit([Candidate(10)] * 3)] == [Admitted, Admitted, NotNow]
    twin.advance(45_000)  # the request bucket has refilled 1.5 requests
    assert isinstance(twin.admit([Candidate(10)])[0], NotNow)


def test_a_cap_set_off_forgets_its_window_and_on_starts_one(twin: Twin) -> None:
    """Issue 41 deliverable 3: the window exists only while the cap is on (the twin compares Redis's list)."""
    quota = Quota("m", 8, 2_000, window_cap=True, slow_start=False)
    twin.set_quota(quota)
    twin.admit([Candidate(1_500)])
    assert twin.core.raw_state()["models"]["m"]["window"] == [f"{twin.now}:1500"]
    twin.set_quota(quota.replace(window_cap=False))
    assert twin.core.raw_state()["models"]["m"]["window"] == []
    assert isinstance(twin.admit([Candidate(400)])[0], Admitted)  # the bucket alone
    twin.set_quota(quota)
    twin.advance(1_000)
    assert isinstance(twin.admit([Candidate(10)])[0], Admitted)
    assert twin.core.raw_state()["models"]["m"]["window"] == [f"{twin.now}:10"]  # the earlier admissions not in it


@pytest.mark.parametrize("changes", [{"burst_tokens": 60_001}, {"max_requests_per_minute": 10, "burst_requests": 11}])
def test_a_cap_refuses_a_burst_above_its_rate(changes: dict) -> None:
    """Issue 41 deliverable 3: a burst above the rate could never be spent under a window cap: an error."""
    with pytest.raises(QuotaError, match="window_cap"):
        Quota("m", 4, 60_000, window_cap=True, **changes)
