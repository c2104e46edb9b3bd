"""Token accounting as providers count it, header sync, and 429 pauses.

Each test runs on both the Lua core and the reference model (``Twin``), on an
injected clock, with hand-made numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from balancer.admission import keys
from balancer.admission.quota import Quota
from balancer.admission.values import GATE_HOP_MS, OUTSIDE_MARGIN_MS, SYNC_LAG_MS, UNITS, Admitted, Candidate, NotNow, Settlement
from balancer.errors import QuotaError
from tests.twin import Twin


def tokens(twin: Twin, model: str = "a") -> float:
    return twin.core.live(twin.now)[model].tokens_available


def test_reserve_is_the_default_and_a_bad_mode_is_refused() -> None:
    assert Quota("a", 1, 100).token_accounting == "reserve"
    with pytest.raises(QuotaError, match="token_accounting must be one of reserve, settle"):
        Quota("a", 1, 100, token_accounting="refund")


def test_reserve_keeps_what_it_charged(twin: Twin) -> None:
    """A `reserve` provider (OpenAI, Azure) keeps prompt + max_tokens: no credit back."""
    twin.set_quota(Quota("a", 2, 60, burst_tokens=6_000))  # 1 token/s: refill is negligible
    full = tokens(twin)
    lease = twin.admit([Candidate(1_000)])[0]
    assert isinstance(lease, Admitted) and tokens(twin) == full - 1_000
    assert twin.finish(lease.admission_id, Settlement(used_tokens=300, reserved_tokens=1_000))[0] is True
    assert tokens(twin) == full - 1_000  # the 700 unused tokens stay spent, as at the provider


def test_reserve_debits_a_reservation_above_the_estimate(twin: Twin) -> None:
    """The provider counted more prompt tokens than our estimate: the difference is debited."""
    twin.set_quota(Quota("a", 2, 60, burst_tokens=6_000))
    full = tokens(twin)
    lease = twin.admit([Candidate(1_000)])[0]
    twin.finish(lease.admission_id, Settlement(used_tokens=900, reserved_tokens=1_250))
    assert tokens(twin) == full - 1_250


def test_settle_credits_the_surplus(twin: Twin) -> None:
    """A `settle` provider (Anthropic, self-hosted) corrects to actual use."""
    twin.set_quota(Quota("a", 2, 60, burst_tokens=6_000, token_accounting="settle"))
    full = tokens(twin)
    lease = twin.admit([Candidate(1_000)])[0]
    assert twin.finish(lease.admission_id, Settlement(used_tokens=300, reserved_tokens=1_000))[0] is True
    assert tokens(twin) == full - 300
    assert twin.finish(lease.admission_id, Settlement(used_tokens=300))[0] is False  # once per lease
    assert tokens(twin) == full - 300


def test_header_sync_lowers_a_bucket_and_never_raises_it(twin: Twin) -> None:
    twin.set_quota(Quota("a", 3, 60, burst_tokens=6_000, max_requests_per_minute=60))
    first, second = twin.admit([Candidate(1_000), Candidate(1_000)])
    assert isinstance(first, Admitted) and isinstance(second, Admitted)
    # Another application used the same key: the provider says 2,500 tokens and 3 requests are left.
    # `second` is charged here and has not reached the provider: it will take 1,000 of the tokens.
    # (The request bucket goes to the count itself: the start gate holds `second` back.)
    twin.finish(first.admission_id, Settlement(used_tokens=1_000, reserved_tokens=1_000,
                                                  remaining_tokens=2_500, remaining_requests=3))
    live = twin.core.live(twin.now)["a"]
    assert live.tokens_available == 1_500 and live.requests_available == 3
    # A header that says more is left than we think never raises the bucket.
    twin.finish(second.admission_id, Settlement(used_tokens=1_000, reserved_tokens=1_000,
                                                   remaining_tokens=5_900, remaining_requests=59))
    live = twin.core.live(twin.now)["a"]
    assert live.tokens_available == 1_500 and live.requests_available == 3


def test_header_sync_leaves_room_for_a_call_on_its_way(twin: Twin) -> None:
    """A call started less than SYNC_LAG_MS ago may not have reached the provider
    when it sent the headers synced now: they leave room for it."""
    twin.set_quota(Quota("a", 4, 60_000, burst_tokens=1_200))  # 1,000 tokens/s; bucket 950 (the transit allowance)
    first = twin.admit([Candidate(500)])[0]
    twin.advance(1_000)
    second = twin.admit([Candidate(300)])[0]
    assert isinstance(first, Admitted) and isinstance(second, Admitted)
    assert twin.renew(first.admission_id, "a", 500).start_delay_ms == 0
    twin.advance(200)
    assert twin.renew(second.admission_id, "a", 300).start_delay_ms == 0    # on its way now
    twin.advance(SYNC_LAG_MS // 2)
    twin.finish(first.admission_id, Settlement(used_tokens=500, reserved_tokens=500, remaining_tokens=600))
    assert twin.core.live(twin.now)["a"].tokens_available == 300           # 600 left, 300 of them second's
    assert isinstance(twin.admit([Candidate(320)])[0], NotNow)


def test_concurrent_429s_pause_the_model_once(twin: Twin) -> None:
    """N 429s inside one Retry-After window pause the model once, not N times as long."""
    twin.set_quota(Quota("a", 8, 600_000))
    assert twin.penalize("a", 2_000) is True
    for _ in range(7):
        twin.advance(100)
        assert twin.penalize("a", 2_000) is False  # already paused: no extension
    decision = twin.admit([Candidate(10)])[0]
    assert isinstance(decision, NotNow) and decision.wait_ms == 2_000 - 700
    twin.advance(1_300)
    assert isinstance(twin.admit([Candidate(10)])[0], Admitted)
    assert twin.penalize("a", 2_000) is True  # a 429 after the window starts a new pause


def test_a_pause_holds_a_model_whatever_limit_caused_it(twin: Twin) -> None:
    """A 429 from an RPM or concurrency limit pauses the model too: no token debit
    that an RPM-bound model would not notice."""
    twin.set_quota(Quota("a", 8, 1_000_000, max_requests_per_minute=600))
    twin.penalize("a", 1_000)
    assert isinstance(twin.admit([Candidate(1)])[0], NotNow)
    assert twin.core.live(twin.now)["a"].paused_ms == 1_000


def test_request_burst_paces_below_a_minute(twin: Twin) -> None:
    """600 RPM checked over 1 s (Azure): burst_requests = 10 admits 10 at once, then 10 per second."""
    twin.set_quota(Quota("a", 100, 10_000_000, max_requests_per_minute=600, burst_requests=10, slow_start=False))
    decisions = twin.admit([Candidate(1) for _ in range(12)])
    assert sum(isinstance(d, Admitted) for d in decisions) == 10
    twin.advance(100)  # 600 RPM = one request per 100 ms
    assert sum(isinstance(d, Admitted) for d in twin.admit([Candidate(1) for _ in range(3)])) == 1


def test_a_retry_avoids_the_model_that_just_failed(twin: Twin) -> None:
    twin.set_quota(Quota("a", 4, 600_000, slow_start=False))
    twin.set_quota(Quota("b", 4, 600_000, slow_start=False))
    for _ in range(4):
        decision = twin.admit([Candidate(100, avoid="a")])[0]
        assert isinstance(decision, Admitted) and decision.model == "b"
    # b is full: the avoided model is still better than waiting.
    decision = twin.admit([Candidate(100, avoid="a")])[0]
    assert isinstance(decision, Admitted) and decision.model == "a"


def test_the_start_gate_spaces_call_starts_at_the_provider_rate(twin: Twin) -> None:
    """Calls admitted together may reach the worker together; renew, just before
    the call, spaces their starts: one per 60,000 / RPM ms, with burst_requests
    of tolerance less GATE_HOP_MS (at most half an interval) kept for the last hop's jitter."""
    twin.set_quota(Quota("a", 10, 10_000_000, max_requests_per_minute=600, burst_requests=2, slow_start=False))
    admitted = twin.admit([Candidate(1), Candidate(1)])
    twin.advance(200)  # the bucket refills 2 requests while the messages travel
    admitted += twin.admit([Candidate(1), Candidate(1)])
    assert all(isinstance(d, Admitted) for d in admitted)
    delays = [twin.renew(d.admission_id, "a", 1).start_delay_ms for d in admitted]  # all four arrive at once
    hop = min(50, GATE_HOP_MS)  # an interval of 100 ms
    assert delays == [0, hop, 100 + hop, 200 + hop]


def test_the_remaining_requests_header_holds_back_calls_admitted_but_not_started(twin: Twin) -> None:
    """The provider's x-ratelimit-remaining-requests counts the calls that reached it;
    calls admitted but not started yet are charged to our bucket and unknown to it.
    The header sync tells the start gate too: only that many more start now, the
    next one interval after another (60 RPM: 1,000 ms), not the burst's worth."""
    # (learn=False: a model that learns reads the first bucket spent this early as a rate of
    # 1 RPM: test_differential.py, test_requests_spent_early_lower_the_rpm_before_a_429)
    twin.set_quota(Quota("a", 10, 10_000_000, max_requests_per_minute=60, slow_start=False, learn=False))
    first, *waiting = twin.admit([Candidate(1) for _ in range(4)])
    assert twin.renew(first.admission_id, "a", 1).start_delay_ms == 0
    twin.finish(first.admission_id, Settlement(used_tokens=1, reserved_tokens=1, remaining_requests=1))
    delays = [twin.renew(d.admission_id, "a", 1).start_delay_ms for d in waiting]  # all three start now
    assert delays == [0, 1_000, 2_000]   # one left at the provider: the others wait for its refill


def test_no_call_is_admitted_to_wait_at_a_start_gate_booked_ahead(twin: Twin) -> None:
    """learn.toml's rpm-10 (60 RPM real, 40 slots): its provider's remaining count of 0-1 booked the
    start gate ahead, and admission, reading only the request bucket, kept 36 calls waiting there,
    one start a second, bound to it: the run's last 40 s were rpm-10's alone while four models
    stood idle. The request bucket now holds no more than the gate starts within one interval:
    a task only rpm-10 may run waits pending; one another model may run goes there. (Checked at
    admission alone, the end game still planned the last tasks on rpm-10, its live view showing
    requests, and held them pending while the others stood idle: 127-139 s of one run.)"""
    twin.set_quota(Quota("rpm", 40, 10_000_000, max_requests_per_minute=60, slow_start=False, learn=False))
    twin.set_quota(Quota("idle", 4, 10_000_000, slow_start=False))
    first, *waiting = twin.admit([Candidate(1, ("rpm",)) for _ in range(5)])
    assert twin.renew(first.admission_id, "rpm", 1).start_delay_ms == 0
    twin.finish(first.admission_id, Settlement(used_tokens=1, reserved_tokens=1, remaining_requests=1))
    assert [twin.renew(d.admission_id, "rpm", 1).start_delay_ms for d in waiting] == [0, 1_000, 2_000, 3_000]
    held = twin.admit([Candidate(1, ("rpm",))])[0]   # the provider left a request; the gate starts the next in 4 s
    assert isinstance(held, NotNow) and held.wait_ms == 3_000
    # What plans with the live view (the end game, the free slots) reads the same wait: 3 requests short.
    assert twin.core.live(twin.now)["rpm"].requests_available == 1 - 3
    moved = twin.admit([Candidate(1, ("rpm", "idle"))])[0]
    assert isinstance(moved, Admitted) and moved.model == "idle"
    twin.advance(3_000)
    assert isinstance(twin.admit([Candidate(1, ("rpm",))])[0], Admitted)


def test_a_refund_gives_back_no_request_past_the_start_gates_room(twin: Twin) -> None:
    """The request bucket holds no more than the start gate starts within one interval, and a
    refill keeps it so; a refund did not. A lease admitted and never started (its worker gone)
    expires while the gate is booked 500 ms ahead: its request came back on top of the gate's
    room, and the admission in the same script bound a task to wait at the gate. Now the refund
    stops at the room, as a refill does, and the task stays pending until the gate frees."""
    twin.set_quota(Quota("rpm", 40, 10_000_000, max_requests_per_minute=60, slow_start=False, learn=False))
    first, *waiting, never_started = twin.admit([Candidate(1, ("rpm",)) for _ in range(9)])
    assert twin.renew(first.admission_id, "rpm", 1).start_delay_ms == 0
    twin.finish(first.admission_id, Settlement(used_tokens=1, reserved_tokens=1, remaining_requests=1))
    assert [twin.renew(d.admission_id, "rpm", 1).start_delay_ms for d in waiting] == list(range(0, 7_000, 1_000))
    twin.advance(5_500)  # never_started's lease (5 s) has expired; the gate's next start is in 500 ms
    assert twin.core.live(twin.now)["rpm"].requests_available == 0.5
    held = twin.admit([Candidate(1, ("rpm",))])[0]
    assert isinstance(held, NotNow) and held.wait_ms == 500
    twin.advance(500)
    assert isinstance(twin.admit([Candidate(1, ("rpm",))])[0], Admitted)


def test_the_start_gate_is_open_without_an_rpm_limit(twin: Twin) -> None:
    twin.set_quota(Quota("a", 10, 10_000_000, slow_start=False))
    admitted = twin.admit([Candidate(1) for _ in range(5)])
    assert [twin.renew(d.admission_id, "a", 1).start_delay_ms for d in admitted] == [0] * 5


def test_the_bucket_keeps_a_transit_allowance_below_the_providers_burst(twin: Twin) -> None:
    """A call reaches the provider up to 250 ms after admission; while the provider's
    bucket is full it wastes that refill, so ours holds 250 ms of refill less."""
    twin.set_quota(Quota("a", 10, 60_000, burst_tokens=10_000))  # 1,000 tokens/s
    assert tokens(twin) == 9_750
    twin.advance(60_000)
    assert tokens(twin) == 9_750  # refill never fills past it
    # A task as large as the burst is not starved: it needs a full (capped) bucket.
    assert isinstance(twin.admit([Candidate(10_000)])[0], Admitted)


def test_a_429_lowers_the_buckets_to_its_headers(twin: Twin) -> None:
    """Another client spent the quota: the 429's remaining counts lower ours, or the
    model would draw the same 429 again as soon as the pause ends."""
    twin.set_quota(Quota("a", 8, 600, burst_tokens=6_000, max_requests_per_minute=60))
    assert twin.penalize("a", 1_000, remaining_tokens=120, remaining_requests=2) is True
    live = twin.core.live(twin.now)["a"]
    assert live.tokens_available == 120 and live.requests_available == 2
    # A second 429 inside the window adds no pause, but its headers still count.
    assert twin.penalize("a", 1_000, remaining_tokens=50) is False
    assert twin.core.live(twin.now)["a"].tokens_available == 50


def share_with_an_outsider(twin: Twin, outside_per_s: list[int], *, step_ms: int = 250, fresh: bool = True,
                           surplus: int = 0) -> None:
    """On a 60,000 TPM quota (1,000 tokens/s), every ``step_ms``: the outsider takes its
    share of the refill, we make a 100-token call, and the reply's header says
    what the provider has left. One entry of ``outside_per_s`` per step. ``fresh``:
    a new quota, its bucket far from full; ``surplus``: tokens the provider has
    beyond ours from the first step on (a credit we never saw)."""
    if fresh:
        twin.set_quota(Quota("a", 8, 60_000, burst_tokens=1_000_000))
        drain = twin.admit([Candidate(900_000)])[0]  # far from full, so neither bucket is capped
        twin.release(drain.admission_id)
    provider = tokens(twin) + surplus
    for outside in outside_per_s:
        twin.advance(step_ms)
        provider = min(provider + step_ms * (1_000 - outside) / 1_000, 1_000_000)
        lease = twin.admit([Candidate(100)])[0]
        provider -= 100
        twin.finish(lease.admission_id, Settlement(used_tokens=100, reserved_tokens=100, remaining_tokens=int(provider)))
    twin.check_same_state()


def test_a_steady_outside_user_is_learned_from_the_headers(twin: Twin) -> None:
    """Another client takes 20 % of the quota (200 tokens/s). Each sync shows the
    gap; the learned outside rate converges to it, and our bucket then refills
    at the 80 % that is left, instead of running into 429s."""
    share_with_an_outsider(twin, [200] * 80)
    learned = twin.core.live(twin.now)["a"].external_tpm
    assert 11_000 <= learned <= 13_000  # 12,000 tokens per minute, within the integer rounding
    before = tokens(twin)
    twin.advance(1_000)
    assert tokens(twin) - before == pytest.approx(800, abs=40)  # refills at what is left for us


def test_a_call_on_its_way_does_not_hide_an_outside_user(twin: Twin) -> None:
    """The same outsider, while one of our calls (1,000 tokens) stays admitted and not
    started: charged here, unknown to the provider. Measured against the counts
    alone, it made every sync's gap 1,000 tokens short, and the outsider went unseen."""
    twin.set_quota(Quota("a", 8, 60_000, burst_tokens=1_000_000))
    drain = twin.admit([Candidate(900_000)])[0]
    twin.release(drain.admission_id)
    held = twin.admit([Candidate(1_000)])[0]
    provider = tokens(twin) + 1_000
    for _ in range(80):
        twin.advance(250)
        assert twin.heartbeat(held.admission_id, 60_000)
        provider = min(provider + 250 * 800 / 1_000, 1_000_000)
        lease = twin.admit([Candidate(100)])[0]
        provider -= 100
        twin.finish(lease.admission_id, Settlement(used_tokens=100, reserved_tokens=100, remaining_tokens=int(provider)))
    assert 11_000 <= twin.core.live(twin.now)["a"].external_tpm <= 13_000


def test_a_model_others_use_keeps_a_second_of_their_use_in_hand(twin: Twin) -> None:
    """With the outsider learned (about 200 tokens/s), a call needs its estimate and
    OUTSIDE_MARGIN_MS of their use in the bucket: what they take between the count
    the provider sent and our call's arrival is steady only on average (providers-foreign's
    near misses of tens of tokens). Before the learning it needs its estimate alone."""
    share_with_an_outsider(twin, [200] * 80)
    margin = twin.core.live(twin.now)["a"].external_tpm * OUTSIDE_MARGIN_MS / UNITS
    assert 180 <= margin <= 220
    fits_alone = int(tokens(twin)) - 50  # fits the bucket, not with the margin
    waiting = twin.admit([Candidate(fits_alone)])[0]
    assert isinstance(waiting, NotNow) and waiting.wait_ms is not None
    assert waiting.wait_ms == pytest.approx((margin - 50) / 0.8, abs=15)  # at the 800 tokens/s left for us
    twin.advance(waiting.wait_ms)
    assert isinstance(twin.admit([Candidate(fits_alone)])[0], Admitted)


def test_a_gap_below_the_count_is_not_counted_again_at_each_sync(twin: Twin) -> None:
    """The provider has 50 tokens more than our bucket (a credit we never saw), and
    answers come every 10 ms. The bucket is never raised, so every sync finds that
    gap again: counted as a rate at each, it took the outside estimate to 0 within
    a few answers (providers-foreign: 0 from 2 s to 12 s in while the other client
    took 20 %, then 429s). It moves the estimate once, and the outsider's use brings
    it back."""
    share_with_an_outsider(twin, [200] * 80)
    share_with_an_outsider(twin, [200] * 10, step_ms=10, fresh=False, surplus=50)
    assert twin.core.live(twin.now)["a"].external_tpm >= 10_000  # once: 50 tokens over OUTSIDE_TAU_MS
    share_with_an_outsider(twin, [200] * 400, step_ms=10, fresh=False)
    assert 11_000 <= twin.core.live(twin.now)["a"].external_tpm <= 13_000


def test_answers_seconds_apart_do_not_swing_the_outside_estimate(twin: Twin) -> None:
    """Answers 10 s apart (long calls): each gap's growth over OUTSIDE_TAU_MS (2 s) alone
    would move the estimate five times what it saw, from clamp to clamp; over the 10 s
    it moves it by what it saw, and it settles on the outsider's 12,000 a minute."""
    share_with_an_outsider(twin, [200] * 6, step_ms=10_000)
    assert 11_000 <= twin.core.live(twin.now)["a"].external_tpm <= 13_000


def test_a_full_count_lowers_the_outside_estimate(twin: Twin) -> None:
    """The outsider learned, then gone, and the provider's bucket full: its count stays at
    the burst and ours at our cap, so every gap is the same and shows no change: without
    the rule the estimate stayed at what was learned. A full count cannot show outside
    use, so while it lasts the estimate falls by at least the time since the last sync
    over OUTSIDE_TAU_MS of itself: all of it after the half hour here."""
    share_with_an_outsider(twin, [200] * 80)
    twin.advance(2_000_000)  # both buckets refill to their caps
    share_with_an_outsider(twin, [0] * 4, fresh=False, surplus=250)  # ours is capped 250 tokens below the burst
    assert twin.ref.models["a"].external == 0  # the raw estimate, not only its part above 0


def answered_with_a_full_count(twin: Twin, calls: int) -> Iterator[int]:
    """A call of 100 tokens every 250 ms, each answered with the count of a provider whose
    bucket (2,000 tokens, 250 a quarter second) holds all but ours: yields each call's index
    once it is answered."""
    provider = 2_000
    for step in range(calls):
        twin.advance(250)
        provider = min(provider + 250, 2_000)
        lease = twin.admit([Candidate(100)])[0]
        provider -= 100
        twin.finish(lease.admission_id, Settlement(used_tokens=100, reserved_tokens=100, remaining_tokens=provider))
        yield step


def test_a_full_count_lowers_the_outside_estimate_an_eighth_each_quarter_second(twin: Twin) -> None:
    """The same, step by step: an estimate of 12,000 a minute (set by hand on both sides:
    a small bucket cannot learn it and also be full), both buckets at their caps, and an
    answer every 250 ms with a full count: the gap does not change, and each sync after
    the first (which sets the baseline) takes an eighth (250 ms over 2 s) of it."""
    twin.set_quota(Quota("a", 8, 60_000, burst_tokens=2_000))
    twin.client.hset(keys.model(twin.namespace, "a"), "ext", 12_000)
    twin.ref.models["a"].external = expected = 12_000
    twin.advance(5_000)  # ours refills to its cap (1,750 tokens), the provider's to its burst
    for step in answered_with_a_full_count(twin, 4):
        if step > 0:
            expected -= expected // 8
        assert twin.ref.models["a"].external == expected
    twin.check_same_state()


def test_a_quota_change_learns_the_outside_use_again_from_a_new_baseline(twin: Twin) -> None:
    """A quota change resets the estimate (kept, an estimate from a larger quota, cut to
    9/10 of a smaller one, left it a tenth of its TPM: an end-to-end run's throttled model
    made no call for 5 s), and its next sync sets a new baseline: the buckets it clipped
    are no one's use (read as a gap that shrank, the first sync took the estimate below 0)."""
    share_with_an_outsider(twin, [200] * 80)
    twin.set_quota(Quota("a", 8, 60_000, burst_tokens=2_000))
    assert twin.ref.models["a"].external == 0
    twin.advance(5_000)  # both buckets at their caps, 250 tokens apart
    for _ in answered_with_a_full_count(twin, 4):
        pass
    assert twin.ref.models["a"].external == 0
    twin.check_same_state()


def test_the_outside_rate_decays_when_the_outsider_stops(twin: Twin) -> None:
    share_with_an_outsider(twin, [200] * 80 + [0] * 80)
    # The provider's bucket is ahead of ours after the outsider stops (we never raise ours),
    # so the error turns negative and the learned rate falls back.
    assert twin.core.live(twin.now)["a"].external_tpm < 3_000


def test_a_count_that_catches_up_from_above_is_not_read_as_outside_use(twin: Twin) -> None:
    """No one else uses the quota. The provider's count starts 3,000 tokens above our bucket
    and comes down to it over 3 s, as when its counts, taken as it admitted each call, get
    younger: every sync shows a gap below 0 that grows toward 0. Counted as use, that growth
    made an estimate of 54,000 of the 60,000 TPM (its ceiling), and the bucket refilled at a
    tenth of it; below 0 no call of ours can meet a 429, so the estimate stays at 0 or under."""
    twin.set_quota(Quota("a", 8, 60_000, burst_tokens=1_000_000))
    drain = twin.admit([Candidate(900_000)])[0]  # far from full, so neither bucket is capped
    twin.release(drain.admission_id)
    for step in range(13):
        twin.advance(250)
        lease = twin.admit([Candidate(100)])[0]
        surplus = 3_000 - 250 * step
        twin.finish(lease.admission_id, Settlement(used_tokens=100, reserved_tokens=100,
                                                    remaining_tokens=int(tokens(twin)) + surplus))
    twin.check_same_state()
    assert twin.ref.models["a"].external <= 0
    before = tokens(twin)
    twin.advance(1_000)
    assert tokens(twin) - before == pytest.approx(1_000, abs=20)  # the whole TPM refills ours


def test_the_token_gate_holds_back_calls_that_start_in_a_bunch(twin: Twin) -> None:
    """Admitted one by one as the bucket refilled, but started together (they waited
    in the broker): the provider, charging on arrival, would refuse the bunch. The
    token gate at renew spaces the starts so the provider has the tokens for each."""
    twin.set_quota(Quota("a", 10, 60_000, burst_tokens=1_250, slow_start=False))  # 1,000 tokens/s; bucket 1,000 after transit
    admitted = [twin.admit([Candidate(1_000)])[0]]
    for _ in range(2):
        twin.advance(1_000)  # the admission bucket refills: one more 1,000-token call each second
        admitted.append(twin.admit([Candidate(1_000)])[0])
    assert all(isinstance(d, Admitted) for d in admitted)
    # All three messages reach workers only now, at once.
    delays = [twin.renew(d.admission_id, "a", 1_000).start_delay_ms for d in admitted]
    assert delays == [0, 1_000, 2_000]


def test_a_redelivered_call_is_not_charged_twice_at_the_token_gate(twin: Twin) -> None:
    twin.set_quota(Quota("a", 10, 60_000, burst_tokens=1_250))
    lease = twin.admit([Candidate(1_000)])[0]
    assert twin.renew(lease.admission_id, "a", 1_000).start_delay_ms == 0
    assert twin.renew(lease.admission_id, "a", 1_000).start_delay_ms == 0  # the same call, renewed again
