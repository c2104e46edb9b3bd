"""The admission core's promises, each a test that fails if the promise breaks.

They run on the real Lua in Redis through ``Twin``, which also holds the
reference model to the same answers.
"""

from __future__ import annotations

import copy
import multiprocessing
import random

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer.admission.core import AdmissionCore
from balancer.admission.quota import MAX_CONCURRENCY, Quota
from balancer.admission.values import UNITS, Admitted, Candidate, NotNow, Rejected, token_cap
from tests.twin import Twin

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def in_flight(twin: Twin, model: str) -> int:
    """Leases still live at the twin's clock (expired ones are purged lazily)."""
    return twin.core.live(twin.now)[model].in_flight


def admit_and_start(twin: Twin, batch: list[Candidate]) -> list:
    """Admit, then renew every admitted lease as a worker starting its call does."""
    decisions = twin.admit(batch)
    for cand, decision in zip(batch, decisions):
        if isinstance(decision, Admitted):
            twin.renew(decision.admission_id, decision.model, cand.estimated_tokens)
    return decisions


# -- caps hold -------------------------------------------------------------------

limits = st.builds(
    Quota,
    name=st.just("m"),
    max_concurrent_requests=st.integers(1, 5),
    max_tokens_per_minute=st.integers(600, 20_000),
    max_requests_per_minute=st.none() | st.integers(1, 40),
    burst_tokens=st.none() | st.integers(2_000, 20_000),
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.lists(st.integers(1, 2_000), min_size=1, max_size=5)),
        st.tuples(st.just("release"), st.integers(0, 100)),
        st.tuples(st.just("advance"), st.integers(0, 20_000)),
        st.tuples(st.just("renew"), st.integers(0, 100)),
    ),
    max_size=60,
)


@SETTINGS
@given(quota=limits, plan=steps)
def test_caps_hold(new_twin, quota: Quota, plan: list[tuple]) -> None:
    """In-flight <= cap always; tokens (and requests) charged in any interval of
    length T <= burst + rate * T/60. Every admission is started at once, as a
    worker would, so no refund muddies the count."""
    twin = new_twin()
    twin.set_quota(quota)
    charges: list[tuple[int, int]] = []  # (time ms, tokens) of every call that may reach the backend
    live: list[tuple[str, int]] = []
    for step in plan:
        if step[0] == "admit":
            for est, decision in zip(step[1], twin.admit([Candidate(e) for e in step[1]])):
                if isinstance(decision, Admitted):
                    renewed = twin.renew(decision.admission_id, "m", est)
                    assert isinstance(renewed, Admitted) and renewed.admission_id == decision.admission_id
                    charges.append((twin.now, est))
                    live.append((decision.admission_id, est))
        elif step[0] == "release" and live:
            twin.release(live.pop(step[1] % len(live))[0])
        elif step[0] == "renew" and live:
            lid, est = live[step[1] % len(live)]
            state_before = twin.core.raw_state()["models"]["m"]["inflight"]
            if isinstance(twin.renew(lid, "m", est), Admitted) and all(lid != i for _, i in state_before):
                charges.append((twin.now, est))  # an expired lease re-acquired: a new call
        else:
            twin.advance(step[1])
        assert in_flight(twin, "m") <= quota.max_concurrent_requests
    for i, (start, _) in enumerate(charges):
        window_tokens = window_requests = 0
        for end, tokens in charges[i:]:
            window_tokens += tokens
            window_requests += 1
            span = end - start
            assert window_tokens <= quota.burst + quota.max_tokens_per_minute * span / 60_000
            if quota.max_requests_per_minute:
                rpm = quota.max_requests_per_minute
                assert window_requests <= rpm + rpm * span / 60_000


# -- shares follow weights ---------------------------------------------------------


@pytest.mark.smoke
def test_shares_follow_weights(twin: Twin) -> None:
    weights = {"w1": 1, "w2": 2, "w3": 3, "w4": 4}
    for name, weight in weights.items():
        twin.set_quota(Quota(name, MAX_CONCURRENCY, 10**9, weight=weight, slow_start=False))
    rng = random.Random(7)
    tokens = dict.fromkeys(weights, 0)
    for _ in range(20):  # 20 batches of 100 = 2,000 admissions
        batch = [Candidate(rng.randint(100, 3_000)) for _ in range(100)]
        for cand, decision in zip(batch, twin.core.admit(batch)):
            assert isinstance(decision, Admitted)
            tokens[decision.model] += cand.estimated_tokens
            twin.core.release(decision.admission_id)
    total = sum(tokens.values())
    for name, weight in weights.items():
        expected = weight / sum(weights.values())
        assert abs(tokens[name] / total - expected) <= 0.05 * expected, (name, tokens)


# -- work-conserving ---------------------------------------------------------------

world = st.lists(
    st.builds(
        Quota,
        name=st.sampled_from(["a", "b", "c"]),
        max_concurrent_requests=st.integers(1, 3),
        max_tokens_per_minute=st.integers(100, 10_000),
        max_requests_per_minute=st.none() | st.integers(1, 10),
        enabled=st.booleans(),
    ),
    min_size=1,
    max_size=3,
    unique_by=lambda q: q.name,
)


@SETTINGS
@given(
    quotas=world,
    warmup=st.lists(st.integers(1, 3_000), max_size=12),
    probe=st.builds(Candidate, st.integers(1, 3_000), st.none() | st.lists(st.sampled_from("abc"), min_size=1).map(tuple)),
    wait=st.integers(0, 30_000),
)
def test_work_conserving(new_twin, quotas: list[Quota], warmup: list[int], probe: Candidate, wait: int) -> None:
    """A lone candidate is refused only if no allowed model has a free slot,
    the tokens and a request for it."""
    twin = new_twin()
    for quota in quotas:
        twin.set_quota(quota)
    twin.admit([Candidate(e) for e in warmup]) if warmup else None
    twin.advance(wait)
    before = copy.deepcopy(twin.ref)
    decision = twin.admit([probe])[0]
    if isinstance(decision, NotNow):
        for name in before.models:
            if probe.allowed and name not in probe.allowed:
                continue
            before._refill(name, twin.now)
            before._purge(name, twin.now)
            state = before.models[name]
            could = (
                state.quota.enabled
                and probe.estimated_tokens <= state.quota.burst
                and before._has_capacity(name, probe.estimated_tokens, twin.now)
            )
            assert not could, f"{name} could take {probe} but it was refused"


def test_not_now_says_when(twin: Twin) -> None:
    """The refusal carries the earliest time a model could take it: here, token refill."""
    twin.set_quota(Quota("a", 5, 6_000))  # 100 tokens/s; bucket 6,000 less 250 ms of transit allowance
    assert isinstance(admit_and_start(twin, [Candidate(6_000)])[0], Admitted)  # a full bucket: 5,975, now -25
    decision = twin.admit([Candidate(1_000)])[0]
    assert isinstance(decision, NotNow) and decision.wait_ms == 10_250
    twin.advance(10_249)
    assert isinstance(twin.admit([Candidate(1_000)])[0], NotNow)
    twin.advance(1)
    assert isinstance(twin.admit([Candidate(1_000)])[0], Admitted)


# -- no starvation -----------------------------------------------------------------


@pytest.mark.smoke
def test_large_task_is_not_starved_by_small_ones(twin: Twin) -> None:
    """A task of burst_tokens behind a stream of small tasks that would eat
    every refill is admitted within burst/TPM minutes (here 60 s)."""
    twin.set_quota(Quota("m", MAX_CONCURRENCY, 6_000))  # 100 tokens/s, burst 6,000
    assert isinstance(admit_and_start(twin, [Candidate(5_000)])[0], Admitted)  # drain most of the bucket
    waited = 0
    while True:
        # 5 x 10 tokens per 100 ms: more than the 10 tokens that refill meanwhile.
        decisions = admit_and_start(twin, [Candidate(6_000)] + [Candidate(10)] * 5)
        if isinstance(decisions[0], Admitted):
            break
        twin.advance(100)
        waited += 100
        assert waited <= 60_000, "the large task starved"
    assert waited <= 60_000


def test_hold_does_not_block_other_models(twin: Twin) -> None:
    """While a big task waits for model m's tokens, small tasks still flow to other models."""
    twin.set_quota(Quota("m", 10, 6_000))
    twin.set_quota(Quota("n", 10, 6_000))
    admit_and_start(twin, [Candidate(5_000, ("m",))])
    decisions = twin.admit([Candidate(6_000, ("m",)), Candidate(10), Candidate(10, ("n",))])
    assert isinstance(decisions[0], NotNow)
    assert decisions[1] == Admitted("n", decisions[1].admission_id)
    assert isinstance(decisions[2], Admitted)


# -- impossible tasks ----------------------------------------------------------------


def test_impossible_task_rejected_with_reason(twin: Twin) -> None:
    twin.set_quota(Quota("small", 4, 1_000))
    twin.set_quota(Quota("big", 4, 1_000, burst_tokens=5_000))
    too_big, pinned, unknown = twin.admit(
        [Candidate(6_000), Candidate(2_000, ("small",)), Candidate(10, ("ghost",))]
    )
    assert isinstance(too_big, Rejected) and "burst_tokens (5000)" in too_big.reason
    assert isinstance(pinned, Rejected) and "burst_tokens (1000)" in pinned.reason
    assert isinstance(unknown, Rejected) and "ghost" in unknown.reason


def test_disabled_model_means_wait_without_time(twin: Twin) -> None:
    twin.set_quota(Quota("a", 4, 1_000, enabled=False))
    decision = twin.admit([Candidate(10)])[0]
    assert decision == NotNow(None, twin.now)


# -- leases --------------------------------------------------------------------------


def test_dead_workers_slot_frees_itself(twin: Twin) -> None:
    twin.set_quota(Quota("a", 1, 60_000))
    first = twin.admit([Candidate(10)])[0]
    assert isinstance(first, Admitted)
    twin.renew(first.admission_id, "a", 10)  # the worker started, then died
    assert isinstance(twin.admit([Candidate(10)])[0], NotNow)
    twin.advance(5_001)  # past the lease
    assert isinstance(twin.admit([Candidate(10)])[0], Admitted)


def test_unstarted_expired_lease_returns_its_tokens(twin: Twin) -> None:
    """A dispatcher that died between admitting and publishing loses nothing."""
    twin.set_quota(Quota("a", 1, 600, burst_tokens=6_000))  # refills 10 tokens/s
    assert isinstance(twin.admit([Candidate(6_000)])[0], Admitted)
    twin.advance(5_001)
    # The next admission purges the expired lease and refunds it: the whole
    # bucket is back (refill alone would have given only ~50 tokens).
    assert isinstance(twin.admit([Candidate(6_000)])[0], Admitted)


def test_release_is_idempotent_and_frees_at_once(twin: Twin) -> None:
    twin.set_quota(Quota("a", 1, 60_000))
    lease = twin.admit([Candidate(10)])[0]
    assert twin.release(lease.admission_id) is True
    assert twin.release(lease.admission_id) is False
    assert isinstance(twin.admit([Candidate(10)])[0], Admitted)


def test_a_call_is_settled_once(twin: Twin) -> None:
    twin.set_quota(Quota("a", 2, 600, burst_tokens=6_000))
    full = twin.core.live(twin.now)["a"].tokens_available  # 6,000 less 2.5 tokens of transit allowance
    lease = twin.admit([Candidate(1_000)])[0]
    assert twin.finish(lease.admission_id, 3_000)[0] is True
    assert twin.finish(lease.admission_id, 3_000)[0] is False  # no double count
    assert twin.core.live(twin.now)["a"].tokens_available == full - 3_000


def test_renew_reasserts_expired_slot_only_if_room(twin: Twin) -> None:
    twin.set_quota(Quota("a", 1, 60_000))
    old = twin.admit([Candidate(10)])[0]
    twin.renew(old.admission_id, "a", 10)
    twin.advance(5_001)  # old lease expired (worker presumed dead)
    newer = twin.admit([Candidate(10)])[0]
    assert isinstance(newer, Admitted)
    # The old message is redelivered: the only slot is taken, so it must not call.
    assert isinstance(twin.renew(old.admission_id, "a", 10), NotNow)
    twin.release(newer.admission_id)
    assert twin.renew(old.admission_id, "a", 10) == Admitted("a", old.admission_id)
    assert in_flight(twin, "a") == 1


# -- live changes apply to the next admission ----------------------------------------


def test_quota_change_applies_to_next_admission(twin: Twin) -> None:
    twin.set_quota(Quota("a", 3, 60_000))
    assert isinstance(twin.admit([Candidate(10)])[0], Admitted)
    twin.set_quota(Quota("a", 1, 60_000))
    assert isinstance(twin.admit([Candidate(10)])[0], NotNow)
    twin.set_quota(Quota("a", 2, 60_000, burst_tokens=5))
    assert isinstance(twin.admit([Candidate(10)])[0], Rejected)
    twin.set_quota(Quota("a", 2, 60_000, enabled=False))
    assert twin.admit([Candidate(1)])[0] == NotNow(None, twin.now)


def test_lowered_quota_is_not_refilled_by_calls_charged_before_it(twin: Twin) -> None:
    """Calls in flight when TPM drops finish later with a surplus (estimate above
    actual), or never start. Crediting either to the new, small bucket would let
    traffic after the change exceed the new quota, so both are forfeited."""
    twin.set_quota(Quota("a", 4, 600_000, burst_tokens=12_000, token_accounting="settle", slow_start=False))  # 9,500 after transit
    started, unstarted = (twin.admit([Candidate(4_000)])[0] for _ in range(2))
    twin.renew(started.admission_id, "a", 4_000)
    twin.set_quota(Quota("a", 4, 600, burst_tokens=1_000, token_accounting="settle", slow_start=False))  # 10 tokens/s, clipped to 1,000
    spend = twin.admit([Candidate(1_000)])[0]
    assert isinstance(spend, Admitted)  # the new bucket is now empty
    twin.renew(spend.admission_id, "a", 1_000)
    assert twin.finish(started.admission_id, 100)[0] is True  # surplus 3,900: forfeited
    assert isinstance(twin.admit([Candidate(500)])[0], NotNow)
    twin.advance(5_001)  # the unstarted lease expires: its 4,000 are forfeited too
    assert isinstance(twin.admit([Candidate(500)])[0], NotNow)  # only 50 tokens of refill
    # Within one generation, surpluses are still credited.
    small = twin.admit([Candidate(40)])[0]
    assert isinstance(small, Admitted)
    level = twin.core.live(twin.now)["a"].tokens_available
    assert twin.finish(small.admission_id, 0)[0] is True
    assert twin.core.live(twin.now)["a"].tokens_available == level + 40
    assert unstarted.admission_id not in twin.core.raw_state()["leases"]


# -- safe under concurrency ----------------------------------------------------------


def _hammer(url: str, namespace: str, queue: multiprocessing.Queue) -> None:
    core = AdmissionCore(redis.Redis.from_url(url), namespace, lease_ms=300_000)
    admitted: dict[str, int] = {"capped": 0, "rated": 0}
    tokens = 0
    start = core.redis.time()
    for _ in range(40):
        batch = [Candidate(100, ("capped",))] * 5 + [Candidate(100, ("rated",))] * 5
        for cand, decision in zip(batch, core.admit(batch)):
            if isinstance(decision, Admitted):
                admitted[decision.model] += 1
                if decision.model == "rated":
                    tokens += cand.estimated_tokens
    end = core.redis.time()
    queue.put((admitted, tokens, start, end))


@pytest.mark.smoke
def test_eight_processes_never_over_admit(redis_url: str, redis_client: redis.Redis, namespace: str) -> None:
    """8 OS processes race on one Redis with the real clock (Redis TIME)."""
    core = AdmissionCore(redis_client, namespace, lease_ms=300_000)
    core.restore([])  # an empty live state; models created below start with full buckets
    core.set_quota(Quota("capped", 37, 10**9, slow_start=False))
    rated = Quota("rated", MAX_CONCURRENCY, 60_000, burst_tokens=20_000, slow_start=False)
    core.set_quota(rated)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(redis_url, namespace, queue)) for _ in range(8)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    capped = sum(r[0]["capped"] for r in results)
    rated_tokens = sum(r[1] for r in results)
    t0 = min(s * 1000 + us // 1000 for _, _, (s, us), _ in results)
    t1 = max(s * 1000 + us // 1000 for _, _, _, (s, us) in results)
    assert capped == 37  # exactly the cap: never more, and no slot left idle
    # burst refills at 1,000 tokens/s; allow the measured span plus the burst.
    assert rated_tokens <= 20_000 + 60_000 * (t1 - t0 + 1) / 60_000
    # and the bucket was used to its cap: the burst less the transit allowance.
    # Candidates are 100 tokens each, so the cap is reached to the last whole 100.
    assert rated_tokens >= token_cap(rated) // UNITS // 100 * 100
    raw = core.raw_state()["models"]["capped"]
    assert len(raw["inflight"]) == 37
