"""The seed's wait rules and advice formula, as pure functions (balancer/router/backpressure.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from balancer.router.backpressure import (
    MAX_BASE_WAIT_MS,
    MIN_PARALLELISM,
    MIN_WAIT_MS,
    TICK_MS,
    UNKNOWN_WAIT_MS,
    OutcomeWindow,
    advise,
    ceil_to_tick,
    wait_for_ms,
)


@given(earliest=st.integers(0, 600_000), seed=st.integers(0, 2**32))
def test_a_wait_is_the_base_jittered_then_rounded_up_to_a_tick_and_floored(earliest: int, seed: int) -> None:
    wait = wait_for_ms(earliest, random.Random(seed))
    base = min(earliest, MAX_BASE_WAIT_MS)
    assert wait >= MIN_WAIT_MS
    assert wait == MIN_WAIT_MS or wait % TICK_MS == 0
    assert wait >= base * 0.9 and wait <= max(MIN_WAIT_MS, ceil_to_tick(base * 1.1))


def test_a_full_models_lease_deadline_is_not_a_wait() -> None:
    """At its cap the core's earliest time is the first lease deadline (300 s for a
    pipeline call): the caller asks again within about a second instead."""
    assert {wait_for_ms(300_000, random.Random(s)) for s in range(50)} <= {1000, 1100}


def test_the_jitter_spreads_callers_over_more_than_one_tick() -> None:
    """Without jitter every caller told 1,000 ms would come back on the same tick."""
    rng = random.Random(3)
    waits = [wait_for_ms(1000, rng) for _ in range(400)]
    assert set(waits) == {1000, 1100}
    assert 0.3 < waits.count(1100) / len(waits) < 0.7  # the +10 % half: about half the callers


@pytest.mark.parametrize(("base", "expected"), [(0, 50), (1, 100), (40, 100), (100, 100)])
def test_tick_alignment_and_the_floor_on_small_waits(base: int, expected: int) -> None:
    """Jitter of at most ±10 % cannot move these across a tick boundary."""
    assert {wait_for_ms(base, random.Random(s)) for s in range(50)} <= {expected, ceil_to_tick(base * 1.1)}
    assert wait_for_ms(base, random.Random(0)) >= MIN_WAIT_MS


def test_no_known_time_waits_a_second() -> None:
    assert wait_for_ms(None, random.Random(1)) == UNKNOWN_WAIT_MS


def test_advice_without_pressure_offers_every_free_slot() -> None:
    advice = advise([25, 25], schedules=10, admits=10, in_flight=6, total_cap=20)
    assert (advice.backpressure_score, advice.suggested_parallelism) == (0.0, 20)


def test_advice_under_full_pressure_holds_what_is_in_flight() -> None:
    advice = advise([5000] * 20, schedules=20, admits=0, in_flight=12, total_cap=20)
    assert (advice.backpressure_score, advice.suggested_parallelism) == (1.0, 12)


def test_advice_mixes_waits_and_refusals_equally() -> None:
    # p95 wait 512.5 ms is halfway between 25 and 1000 ms: 0.25; a quarter refused: 0.125.
    advice = advise([512] * 19 + [513], schedules=80, admits=60, in_flight=0, total_cap=100)
    assert advice.backpressure_score == pytest.approx(0.375, abs=1e-3)
    assert advice.suggested_parallelism == round(100 * (1 - advice.backpressure_score))


def test_advice_floor_and_ceiling() -> None:
    assert advise([], 0, 0, in_flight=0, total_cap=50).suggested_parallelism == 50
    assert advise([2000], 1, 0, in_flight=0, total_cap=50).suggested_parallelism == MIN_PARALLELISM
    assert advise([2000], 1, 0, in_flight=0, total_cap=0).suggested_parallelism == 0  # no model enabled


def test_the_window_forgets_outcomes_older_than_a_minute() -> None:
    window = OutcomeWindow()
    for t in range(0, 120, 10):
        window.admitted(float(t))
        window.waited(float(t) + 0.5, 200)
    waits, schedules, admits = window.snapshot(125.0)
    assert (len(waits), schedules, admits) == (5, 10, 5)  # after 125 - 60 = 65 s: t = 70 ... 110.5 remain
