"""The end game and the latency model: pure rules on hand-made states, then the
real pipeline with one very slow model."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from balancer.admission.core import AdmissionCore
from balancer.admission.quota import Quota
from balancer.admission.values import Admitted, Candidate, Settlement
from balancer.dispatch.endgame import (
    CAUTIOUS,
    HEDGED,
    LAST_CALLS,
    Job,
    ModelOutlook,
    Running,
    hedge_allowance,
    in_end_game,
    pick_hedges,
    plan,
)
from balancer.dispatch.ready import backlog_to_stock
from balancer.estimates.latency import MIN_SAMPLES, LatencyEstimate, LatencySketch, bucket_of, record

FAST = LatencyEstimate(1_000, 2_000, 3_000, 100)
SLOW = LatencyEstimate(20_000, 60_000, 100_000, 100)


def outlook(name: str, latency: LatencyEstimate, cap: int = 2, free: int | None = None, **kw) -> ModelOutlook:
    in_flight = cap - (cap if free is None else free)
    return ModelOutlook(name, cap=cap, free_slots=cap if free is None else free, in_flight=in_flight, latency=latency, **kw)


# -- the decision rule ---------------------------------------------------------------


def test_last_three_tasks_wait_for_the_fast_model_rather_than_take_the_slow_one() -> None:
    models = [outlook("fast", FAST, cap=1), outlook("slow", SLOW, cap=1)]
    jobs = [Job(i, 100) for i in range(3)]
    assert in_end_game(3, 100, models)
    # The first starts on the fast model now; the other two would end sooner
    # after it (about 1.1 s + 2 s each) than on the idle slow model (60 s).
    assert plan(jobs, models) == ["fast", None, None]


def test_a_slow_model_still_gets_work_in_the_bulk_phase() -> None:
    models = [outlook("fast", FAST, cap=4), outlook("slow", SLOW, cap=4)]
    # 2,000 tasks take far longer than one slow call: keep every slot full.
    assert not in_end_game(2_000, 100, models)
    # And even a plan over that backlog uses the slow slots: the fast model's
    # queue is longer than a slow call.
    placed = plan([Job(i, 100) for i in range(2_000)], models)
    assert placed.count("slow") == 4 and placed.count("fast") == 4


def test_the_switch_follows_the_estimate_not_a_constant() -> None:
    fast, slow = outlook("fast", FAST, cap=10), outlook("slow", SLOW, cap=2)
    # Fluid rate: 10 / 1.133 s + 2 / 22.7 s, about 8.9 tasks/s; the slow p90 is 60 s.
    assert not in_end_game(600, 100, [fast, slow])  # about 67 s of backlog
    assert in_end_game(400, 100, [fast, slow])  # about 45 s
    # With a slow model that is only twice as slow, the end game starts later.
    medium = outlook("slow", LatencyEstimate(2_000, 4_000, 6_000, 100), cap=2)
    assert not in_end_game(40, 100, [fast, medium])
    assert in_end_game(30, 100, [fast, medium])


def test_with_hedging_a_slow_model_takes_work_its_mean_can_finish_in_time() -> None:
    """Without hedges a placement must fear the slow model's tail (p90 20 s);
    with them, a straggler is overtaken, so its mean (3.4 s) is what counts."""
    fast = outlook("fast", FAST, cap=1)
    slow = outlook("slow", LatencyEstimate(3_000, 20_000, 40_000, 100), cap=1)
    jobs = [Job(i, 100) for i in range(4)]
    assert "slow" not in plan(jobs, [fast, slow], latency_field=CAUTIOUS)
    assert "slow" in plan(jobs, [fast, slow], latency_field=HEDGED)
    # The switch moves the same way: 8 tasks drain in about 6.8 s, the end game
    # against a 20 s p90 but not against a 3.4 s mean.
    assert in_end_game(8, 100, [fast, slow], CAUTIOUS) and not in_end_game(8, 100, [fast, slow], HEDGED)


def test_a_hedge_waits_for_a_busy_fast_model_rather_than_take_a_free_slow_slot() -> None:
    """A task gets one hedge. A straggler on "slow" with only "mid" free now and
    "fast" full (its calls end every ~0.3 s) waits for fast: hedged to mid it
    would be a second heavy-tailed draw. Once fast has a slot, it goes there;
    with no fast model at all, mid is the best there is."""
    slow = ModelOutlook("slow", cap=4, free_slots=0, in_flight=4, latency=LatencyEstimate(12_000, 40_000, 100_000, 50))
    mid = ModelOutlook("mid", cap=4, free_slots=2, in_flight=2, latency=LatencyEstimate(4_000, 11_000, 20_000, 50))
    fast = ModelOutlook("fast", cap=6, free_slots=0, in_flight=6, latency=LatencyEstimate(1_000, 2_300, 4_500, 50))
    straggler = [Running(7, "slow", 60_000, 500)]
    assert pick_hedges(straggler, [slow, mid, fast], 10_000) == []
    fast_free = ModelOutlook("fast", cap=6, free_slots=1, in_flight=5, latency=fast.latency)
    assert pick_hedges(straggler, [slow, mid, fast_free], 10_000) == [(7, "fast")]
    assert pick_hedges(straggler, [slow, mid], 10_000) == [(7, "mid")]


def test_the_end_game_reads_a_learned_model_at_its_learned_rates() -> None:
    """learn.toml's rpm-10: a quota of 600 RPM and 40 slots, 60 RPM learned. Its request bucket
    refills at 60 a minute, so one 3 requests short (its start gate booked ahead) waits 3 s; read
    at the quota's 600 it looked free in 0.3 s, and the plan held the last tasks for it."""
    from balancer.admission.learned import Learned
    from balancer.admission.live import ModelLive
    from balancer.dispatch.placement import outlooks

    quota = Quota("rpm-10", 40, 2_000_000, max_requests_per_minute=600)
    live = ModelLive(quota, in_flight=2, tokens_available=1e6, requests_available=-2.0, deficit=0,
                     learned=Learned(lrpm=60, lcap=4))
    [rpm10] = outlooks({"rpm-10": live}, 30.0)
    assert rpm10.requests_per_ms == 60 / 60_000 and rpm10.cap == 4
    idle = outlook("idle", LatencyEstimate(2_000, 3_000, 4_000, 100), cap=4)
    assert plan([Job(1, 100)], [replace(rpm10, latency=FAST), idle]) == ["idle"]  # rpm-10 ends at 3 + 2 s (p90), idle at 3 s


def test_the_last_calls_keep_a_share_of_the_hedge_budget() -> None:
    """Issue 39's mix-2 runs at 0.62 and 0.397 of the bound: the many stragglers of the tail spent
    the 5 % hedge budget, and the last calls, which set the run's end, ran 11 and 34 s unhedged.
    Now hedges leave a reserve for the last LAST_CALLS calls while more could be hedged."""
    fast = outlook("fast", LatencyEstimate(1_000, 2_000, 4_000, 50), cap=40, free=40)
    slow = outlook("slow", LatencyEstimate(10_000, 30_000, 90_000, 50), cap=20, free=0)
    stragglers = [Running(i, "slow", 45_000, 1_000) for i in range(20)]
    budget = (LAST_CALLS + 1) * 1_000
    early = pick_hedges(stragglers, [slow, fast], hedge_allowance(budget, [c.estimated_tokens for c in stragglers]))
    assert len(early) == 1  # the whole budget would have bought five
    last = stragglers[-LAST_CALLS:]  # however many slots the hedged pairs' losers still hold
    late = pick_hedges(last, [slow, fast], hedge_allowance(budget - 1_000, [c.estimated_tokens for c in last]))
    assert len(late) == LAST_CALLS


def test_stragglers_queue_for_the_best_model_only_while_the_queue_is_short() -> None:
    """Each hedge waiting for "fast" (6 calls of 1 s median: a slot every ~167 ms)
    pushes the next one's start back; once waiting costs more than the 2.2 s a
    free "fast2" slot loses on p90, the rest go to fast2."""
    slow = ModelOutlook("slow", cap=20, free_slots=0, in_flight=20, latency=LatencyEstimate(12_000, 40_000, 100_000, 50))
    fast = ModelOutlook("fast", cap=6, free_slots=0, in_flight=6, latency=LatencyEstimate(1_000, 2_300, 4_500, 50))
    fast2 = ModelOutlook("fast2", cap=10, free_slots=10, in_flight=0, latency=LatencyEstimate(2_000, 4_500, 9_000, 50))
    stragglers = [Running(i, "slow", 60_000 + i, 100) for i in range(20)]
    picks = pick_hedges(stragglers, [slow, fast, fast2], 10_000)
    assert [model for _, model in picks] == ["fast2"] * 7  # 13 wait for fast: 14 x 167 ms > 2.2 s


def test_a_model_still_on_the_prior_does_not_start_the_end_game() -> None:
    """Ten known fast models drain 400 tasks in about 7 s; an eleventh has answered too
    few calls to leave the global prior (30 s median, 57 s p90). Counted in the horizon,
    it made those 7 s an end game, in which it is never chosen, so it never answered the
    calls that would make its latency known (mix-5's gen-0 and gen-3: 2 calls a run each).
    Left out, the bulk phase goes on and every free slot, its own too, takes work."""
    fast = [outlook(f"fast{i}", FAST, cap=4) for i in range(10)]
    new = outlook("new", LatencyEstimate.prior(30.0), cap=4, latency_known=False)
    assert not in_end_game(400, 100, [*fast, new])
    assert in_end_game(400, 100, [*fast, outlook("slow", SLOW, cap=4)])  # a slow model that is known still does
    assert in_end_game(1, 100, [new])  # on the prior alone, the prior is all there is


def test_ready_lists_are_stocked_while_a_model_is_still_on_the_prior() -> None:
    """Likewise the stocking threshold: the backlog that outlasts the slowest model's call.
    With a model on the prior it was 57 s of the run's throughput, more than most runs'
    whole backlog, so no ready list was stocked."""
    fast = [outlook(f"fast{i}", FAST, cap=4, free=0) for i in range(10)]
    new = outlook("new", LatencyEstimate.prior(30.0), cap=4, free=0, latency_known=False)
    assert backlog_to_stock(100, [*fast, new], CAUTIOUS) < 100
    assert backlog_to_stock(100, [*fast, outlook("new", LatencyEstimate.prior(30.0), cap=4, free=0)], CAUTIOUS) > 1_000


def test_no_end_game_when_no_model_has_a_free_slot() -> None:
    assert not in_end_game(3, 100, [outlook("fast", FAST, free=0), outlook("slow", SLOW, free=0)])


def test_allowed_models_and_avoid_are_respected() -> None:
    models = [outlook("fast", FAST), outlook("slow", SLOW)]
    jobs = [Job(1, 100, ("slow",)), Job(2, 100, ("fast", "slow"), avoid="fast"), Job(3, 100, ("fast",), avoid="fast")]
    assert plan(jobs, models) == ["slow", "slow", "fast"]


def test_token_rate_delays_a_start_and_can_send_the_task_elsewhere() -> None:
    # "tpm" is fast but its bucket is empty and refills 1 token/ms: a 20,000-token task waits 20 s there.
    tpm = outlook("tpm", FAST, tokens_available=0, tokens_per_ms=1.0)
    medium = outlook("medium", LatencyEstimate(4_000, 8_000, 12_000, 100))
    assert plan([Job(1, 20_000)], [tpm, medium]) == ["medium"]
    assert plan([Job(1, 200)], [tpm, medium]) == ["tpm"]  # 0.2 s of refill, then 2 s


def test_a_paused_model_is_planned_after_its_pause() -> None:
    paused = outlook("paused", FAST, free=0, paused_ms=30_000)
    other = outlook("other", LatencyEstimate(5_000, 10_000, 15_000, 100))
    assert plan([Job(1, 100)], [paused, other]) == ["other"]


# -- the latency model ---------------------------------------------------------------


def sketch_of(latencies_ms: list[int]) -> LatencySketch:
    fields: dict[str, int] = {}
    for ms in latencies_ms:
        record(fields, bucket_of(ms), ms, 100, 50)
    return LatencySketch.from_fields(fields)


def test_the_prior_applies_until_enough_calls_are_measured() -> None:
    few = sketch_of([400] * (MIN_SAMPLES - 1))
    assert few.estimate(2.0) == LatencyEstimate.prior(2.0)
    enough = sketch_of([400] * (MIN_SAMPLES + 1)).estimate(2.0)  # decay takes a little off the older ones
    assert 400 <= enough.p50_ms < 480 and enough.samples == pytest.approx(MIN_SAMPLES + 1, rel=0.1)


def test_quantiles_are_within_one_bucket_of_the_truth() -> None:
    rng = random.Random(1)
    draws = sorted(int(3_000 * rng.lognormvariate(0, 0.8)) for _ in range(400))
    est = LatencySketch.from_samples(draws).estimate(30.0)
    for q, got in ((0.5, est.p50_ms), (0.9, est.p90_ms), (0.99, est.p99_ms)):
        true = draws[int(q * len(draws)) - 1]
        assert true <= got <= true * 2 ** 0.25 * 1.001, (q, true, got)


def test_the_sketch_follows_a_model_that_slows_down() -> None:
    before = [1_000] * 200
    after = [10_000] * 100
    est = sketch_of(before + after).estimate(30.0)
    # 100 calls at the new latency outweigh 200 older ones: memory halves every ~44 calls.
    assert est.p50_ms > 9_000
    assert sketch_of(before).estimate(30.0).p50_ms < 1_200


def test_finish_records_the_latency_in_the_same_call(redis_client, namespace: str) -> None:
    core = AdmissionCore(redis_client, namespace, lease_ms=300_000)
    core.restore([])
    core.set_quota(Quota("m", 4, 10**6, expected_latency_s=7.5))
    assert core.live()["m"].quota.expected_latency_s == 7.5
    for ms in [800] * (MIN_SAMPLES + 1):
        admitted = core.admit([Candidate(100)])[0]
        assert isinstance(admitted, Admitted)
        core.finish(admitted.admission_id, Settlement(used_tokens=120, latency_ms=ms, completion_tokens=20))
    live = core.live()["m"]
    est = live.latency.estimate(30.0)
    assert 800 <= est.p50_ms < 800 * 1.2 and est.samples > MIN_SAMPLES
    assert live.latency.prompt_tokens_sum > 0 and live.latency.completion_tokens_sum > 0
    # A call with no answer (no latency) adds nothing; removing the model drops its sketch.
    admitted = core.admit([Candidate(100)])[0]
    assert isinstance(admitted, Admitted)
    core.finish(admitted.admission_id)
    assert core.live()["m"].latency == live.latency
    core.remove_quota("m")
    core.set_quota(Quota("m", 4, 10**6))
    assert core.live()["m"].latency.samples == 0


# -- end to end ------------------------------------------------------------------------

def two_models(slow: tuple[str, int, float], fast: tuple[str, int, float]) -> list[dict]:
    """Two models of constant latency, for :func:`tests.pipeline_harness.scenario_file`: (name, cap, seconds) each."""
    return [{"name": name, "max_concurrent_requests": cap, "max_tokens_per_minute": 2000000,
             "latency": {"median": s, "p99": s, "min": s, "max": s}} for name, cap, s in (slow, fast)]



@pytest.mark.e2e
@pytest.mark.usefixtures("migrated")
@pytest.mark.parametrize("end_game", ["on", "off"])
def test_with_one_very_slow_model_the_last_tasks_go_to_the_fast_one(tmp_path: Path, end_game: str) -> None:
    """24 tasks: the fast model alone solves them in about 2 s; a slow call takes 6 s.
    With the end game on, the slow model gets nothing; off (greedy), it takes
    three tasks at once and the run lasts 6 s: the contrast shows the test can fail."""
    from tests.pipeline_harness import Pipeline, prompt_lines, scenario_file

    scenario_file(tmp_path / "one-slow.toml", two_models(("slow", 3, 6.0), ("fast", 3, 0.2)))
    p = Pipeline(tmp_path / "logs", scenario=tmp_path / "one-slow.toml", extra_env={"BALANCER_END_GAME": end_game})
    try:
        p.start()
        p.services.quotas.set("fast", {"expected_latency_s": 0.2}, by="test")
        p.services.quotas.set("slow", {"expected_latency_s": 6.0}, by="test")
        ids = p.submit(prompt_lines(24, ["fast", "slow"], pinned_every=0))
        counts = p.wait_done(len(ids), timeout=120)
        assert counts["solved"] == 24
        entries = [e for e in p.sim_log() if e["status"] == 200]
        on_slow = [e for e in entries if e["model"] == "slow"]
        if end_game == "on":
            assert on_slow == []
        else:
            assert len(on_slow) >= 1
        assert [e for e in p.sim_log() if e["status"] == 429] == []
        assert p.violations() == []
    finally:
        p.stop()


@pytest.mark.e2e
@pytest.mark.usefixtures("migrated")
@pytest.mark.parametrize("on_disconnect", ["continue", "stop"])
def test_a_hung_call_is_answered_by_a_hedge_on_another_model(tmp_path: Path, on_disconnect: str) -> None:
    """The prior says "stuck" answers in 0.1 s, so the end game sends the task
    there; the call hangs. Once it has run past stuck's p90 and longer than a
    fresh call on "fast" would take, the dispatcher hedges it to "fast". The
    hedge's answer is written once. The hung call then follows the backend's
    on_disconnect. With "stop" it hangs 60 s and is cancelled (its HTTP
    request closed, status 499 at the provider) seconds before the 10 s
    backend timeout would have ended it. With "continue" (the default) cutting
    it off would free nothing the provider counts: it hangs 6 s, runs to its
    end, its answer is dropped, and its slot is freed by that answer, not
    held to the backend timeout."""
    import time

    from tests.pipeline_harness import Pipeline, scenario_file

    hang_s = 60.0 if on_disconnect == "stop" else 6.0
    stuck, fast = two_models(("stuck", 1, hang_s), ("fast", 1, 0.2))
    scenario_file(tmp_path / "hung.toml", [{**stuck, "on_disconnect": on_disconnect}, fast])
    timeout_s = 10
    env = {"BALANCER_BACKEND_TIMEOUT": str(timeout_s), "BALANCER_HEDGE_BUDGET": "1"}  # 5 % of one task buys no hedge
    p = Pipeline(tmp_path / "logs", scenario=tmp_path / "hung.toml", extra_env=env)
    try:
        p.start()
        assert p.services.quotas.get("stuck").on_disconnect == on_disconnect
        p.services.quotas.set("stuck", {"expected_latency_s": 0.1}, by="test")
        p.services.quotas.set("fast", {"expected_latency_s": 1.0}, by="test")
        [task_id] = p.submit([{"prompt": "hello " * 40, "max_tokens": 20, "models": ["stuck", "fast"]}])
        counts = p.wait_done(1, timeout=60)
        assert counts["solved"] == 1
        [row] = p.rows()
        assert (row.id, row.model, row.hedges, row.hedge_model) == (task_id, "fast", 1, "fast")
        answered = [e for e in p.sim_log() if e["status"] == 200]
        assert [e["model"] for e in answered] == ["fast"]  # the hedge's answer came first

        def stuck_lease_ms_left() -> int | None:
            inflight = p.services.core.raw_state()["models"]["stuck"]["inflight"]
            seconds, micros = p.services.redis.time()
            return None if not inflight else int(inflight[0][0]) - (seconds * 1000 + micros // 1000)

        deadline = time.monotonic() + 30
        if on_disconnect == "stop":
            # The provider stopped the call when its client went: a 499, well before the timeout.
            while not [e for e in p.sim_log() if e["status"] == 499] and time.monotonic() < deadline:
                time.sleep(0.2)
            [cut] = [e for e in p.sim_log() if e["model"] == "stuck"]
            assert cut["status"] == 499 and cut["client_gone"] and cut["end"] - cut["start"] < timeout_s - 2
        else:
            # Not cut off: still under its lease (300 s), not a hold (at most the 10 s timeout)...
            left = stuck_lease_ms_left()
            assert left is not None and left > timeout_s * 1000
            while not [e for e in p.sim_log() if e["model"] == "stuck"] and time.monotonic() < deadline:
                time.sleep(0.2)
            [ended] = [e for e in p.sim_log() if e["model"] == "stuck"]
            assert ended["status"] == 200 and not ended.get("client_gone")
            # ... and its own answer frees the slot, seconds before the backend timeout would.
            deadline = time.monotonic() + 3
        while p.services.core.live()["stuck"].in_flight and time.monotonic() < deadline:
            time.sleep(0.2)
        assert p.services.core.live()["stuck"].in_flight == 0
        assert [r.status for r in p.rows()] == ["solved"] and p.rows()[0].answer == row.answer  # written once
        assert [e for e in p.sim_log() if e["status"] == 429] == []
        assert p.violations() == []
    finally:
        p.stop()
