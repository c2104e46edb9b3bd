"""The drain ETA on hand-made states (balancer.views.eta), and as `status` reads it live."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from balancer.estimates.capacity import ModelCapacity
from balancer.estimates.latency import PRIOR_DISPERSION, PRIOR_MEAN
from balancer.views.eta import drain_eta

if TYPE_CHECKING:
    from balancer.services import Services

FAST = ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0)  # 5 tasks/s
SLOW = ModelCapacity(concurrency=1, mean_latency=10.0, tpm=None, burst=0)  # 0.1 tasks/s


def eta(models: dict[str, ModelCapacity], groups: list, in_flight: dict | None = None, tokens: float = 500) -> float | None:
    return drain_eta(models, groups, in_flight=in_flight or {}, tokens_per_task=tokens)


def test_free_work_spreads_over_every_model() -> None:
    both = eta({"fast": FAST, "slow": SLOW}, [(None, 102)])
    alone = eta({"fast": FAST}, [(None, 102)])
    assert both is not None and alone is not None
    # 5.1 tasks/s together, plus half a call at the mean latency over the 11 slots
    assert both == pytest.approx(102 / 5.1 + (10 * 2.0 + 1 * 10.0) / 11 / 2)
    assert both < alone


def test_the_last_calls_take_what_a_running_call_has_left_which_grows_with_the_spread() -> None:
    """When the backlog runs out, each slot holds a call caught running: a long one more
    often than not. With latencies of mean 2 s spread as a lognormal of sigma 1 (E[L²]/E[L]²
    = e), such a call has e × 2 / 2 = 2.7 s left on average, not half a call (1 s), and the
    sketch of those latencies says so."""
    import random

    from balancer.estimates.latency import LatencySketch
    from balancer.views.eta import end_tail

    rng = random.Random(7)
    latencies_ms = [2_000 * math.exp(rng.gauss(0, 1) - 0.5) for _ in range(5_000)]  # mean 2 s
    spread = LatencySketch.from_samples(latencies_ms).dispersion()
    assert spread == pytest.approx(math.e, rel=0.15)
    fixed = end_tail({"fast": FAST})
    assert fixed == pytest.approx(1.0)
    assert end_tail({"fast": replace(FAST, latency_dispersion=spread)}) == pytest.approx(spread * fixed)
    # the ETA carries it: the same work, a longer end
    calm = eta({"fast": FAST}, [(None, 100)])
    heavy = eta({"fast": replace(FAST, latency_dispersion=spread)}, [(None, 100)])
    assert calm is not None and heavy is not None and heavy - calm == pytest.approx(spread - 1.0)


def test_pinned_work_on_a_slow_model_sets_the_finish() -> None:
    """30 tasks pinned to a model that does 0.1 a second: 300 s, whatever the fast model does."""
    value = eta({"fast": FAST, "slow": SLOW}, [(None, 10), (["slow"], 30)])
    assert value is not None and value >= 300


def test_a_token_bound_model_runs_at_its_refill() -> None:
    """TPM 60,000 and 1,000 tokens a task: one task a second once the burst (5 tasks) is spent."""
    bucket = ModelCapacity(concurrency=100, mean_latency=1.0, tpm=60_000, burst=5_000)
    value = eta({"m": bucket}, [(None, 105)], tokens=1_000)
    assert value == pytest.approx(100 + 0.5, rel=1e-3)


def test_calls_in_flight_are_work_still_to_do() -> None:
    assert eta({"slow": SLOW}, [], in_flight={"slow": 1}) == pytest.approx(10.0 + 5.0)
    assert eta({"slow": SLOW}, []) == 0.0


def test_the_eta_shrinks_as_the_backlog_does() -> None:
    values = [eta({"fast": FAST, "slow": SLOW}, [(None, n), (["slow"], 2)]) for n in (400, 200, 100, 10)]
    assert values == sorted(values, reverse=True)


def test_work_no_configured_model_may_run_has_no_eta() -> None:
    assert eta({"fast": FAST}, [(["gone"], 3)]) is None


#: The latency prior of the live backlogs' model (s a call).
PRIOR_S = 3.0


def live_backlog(slots: int) -> Services:
    """60 pending tasks on one model "m" of ``slots`` slots whose prior says PRIOR_S a call."""
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks
    from balancer.services import Services
    from balancer.settings import Settings

    svc = Services.connect(Settings.from_env())
    svc.quotas.set("m", {"max_concurrent_requests": slots, "max_tokens_per_minute": 10_000_000,
                         "expected_latency_s": PRIOR_S}, create=True, by="test")
    rows, _ = parse_tasks("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(60)), models={"m": 10_000_000})
    with svc.engine.begin() as conn:
        insert_tasks(conn, rows)
    return svc


@pytest.mark.usefixtures("migrated")
def test_status_reports_the_eta_of_a_live_backlog(capsys: pytest.CaptureFixture[str]) -> None:
    """60 tasks on one model of 2 slots whose prior says 3 s a call: 90 s of work
    plus what a running call has left at the prior's spread, which `status --json`
    and `status` report."""
    from balancer.cli import main

    live_backlog(slots=2)
    assert main(["status", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    mean = PRIOR_S * PRIOR_MEAN
    assert report["eta_s"] == pytest.approx(60 / 2 * mean + mean * PRIOR_DISPERSION / 2, abs=0.1)
    assert report["eta_low_s"] < report["eta_s"] < report["eta_high_s"]  # its band
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "eta: 1 min" in out and " to " in out


@pytest.mark.usefixtures("migrated")
def test_a_model_that_learned_a_lower_limit_drains_at_that_limit() -> None:
    """40 slots in the quota, 4 learned from the provider's 429s: the 60 tasks take
    15 calls' time on the 4 slots, not 1.5 on the quota's 40 (learn.toml's ETA read
    the quotas and was 39 to 72 % short at 25 % done)."""
    from balancer.admission.learned import Learned
    from balancer.views.summary import estimate_drain

    svc = live_backlog(slots=40)
    view = svc.core.live()
    learned = {"m": replace(view["m"], learned=Learned(lcap=4, pcap=6, lowered_at=int(time.time() * 1000)))}
    mean = PRIOR_S * PRIOR_MEAN
    last = mean * PRIOR_DISPERSION / 2  # what a running call has left (views.eta.end_tail)
    assert estimate_drain(svc, view) == pytest.approx(60 / 40 * mean + last, abs=0.1)
    assert estimate_drain(svc, learned) == pytest.approx(60 / 4 * mean + last, abs=0.1)


def test_the_pace_of_the_last_minute_scales_the_bound() -> None:
    """A run at 80 % of its bound lately: the work left takes 1/0.8 of its bound.
    No run beats its bound, so a pace above 1 (here a prior twice too slow) reads as 1."""
    from balancer.estimates.capacity import ModelCapacity
    from balancer.views.eta import drain_eta, efficiency

    true = {"m": ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0)}
    slow_prior = {"m": ModelCapacity(concurrency=10, mean_latency=4.0, tpm=None, burst=0)}
    # 240 solved in 60 s at 5 tasks/s capacity: 48 s of bound, a pace of (48 + 1) / (60 + 1) (it starts
    # from PACE_PRIOR_S at the bound); the 100 left take 20 s over it, plus 1 s of tail.
    pace = efficiency(true, [(None, 240)], in_flight={}, window_s=60, tokens_per_task=100)
    assert pace == pytest.approx(49 / 61)
    assert drain_eta(true, [(None, 100)], in_flight={}, tokens_per_task=100, pace=pace) == pytest.approx(20 * 61 / 49 + 1)
    pace_slow = efficiency(slow_prior, [(None, 240)], in_flight={}, window_s=60, tokens_per_task=100)
    assert pace_slow == 1.0  # 1.6 measured
    assert round(drain_eta(slow_prior, [(None, 100)], in_flight={}, tokens_per_task=100, pace=pace_slow), 3) == 42.0
    # Work held to one model runs at that model's pace: the run's pace applies to free work only,
    # and the model's own finish (20 s, plus the spread of its last 10 calls) is the ETA.
    assert round(drain_eta(true, [(["m"], 100)], in_flight={}, tokens_per_task=100, pace=0.8), 3) == round(
        20 + 2 * sum(1 / i for i in range(2, 11)), 3)
    assert round(drain_eta(true, [(["m"], 50), (None, 50)], in_flight={}, tokens_per_task=100, pace=0.8), 3) == round(
        20 / 0.9 + 1, 3)
    # A run's first seconds tell already (issue 39): 30 solved in 10 s, 6 s of bound.
    assert efficiency(true, [(None, 30)], in_flight={}, window_s=10, tokens_per_task=100) == pytest.approx(7 / 11)
    # Calls in flight count as half done; a stall cannot claim more than twice the bound, a burst no less.
    assert efficiency(true, [(None, 200)], in_flight={"m": 40}, window_s=60, tokens_per_task=100) == pytest.approx(45 / 61)
    assert efficiency(true, [(None, 2_000)], in_flight={}, window_s=60, tokens_per_task=100) == 1.0
    assert efficiency(true, [(None, 30)], in_flight={}, window_s=60, tokens_per_task=100) == 0.5
    # Pinned work solved on its own model: the bound of the window holds it there.
    two = {**true, "n": ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0)}
    assert round(efficiency(two, [(["m"], 300)], in_flight={}, window_s=60, tokens_per_task=100), 6) == 1.0


def test_pinned_work_left_on_a_slow_model_is_not_shortened_by_the_run_s_pace() -> None:
    """Late in a run whose fast models beat their bound (a pace of 1.2, were it not
    capped), the finish is the slow model's own: 11 pinned + 3 in flight on 3 slots of 25 s is 116.7 s,
    and the last three calls end about (1/2 + 1/3) × 25 s after their mean."""
    from balancer.views.eta import pinned_finish

    fast = ModelCapacity(concurrency=100, mean_latency=5.0, tpm=None, burst=0)
    slow = ModelCapacity(concurrency=3, mean_latency=25.0, tpm=None, burst=0)
    models = {"fast": fast, "slow": slow}
    groups = [(["slow"], 11), (None, 400)]
    own = pinned_finish(slow, 14, tokens_per_task=500)
    assert own == pytest.approx(14 * 25 / 3 + (1 / 2 + 1 / 3) * 25)
    value = drain_eta(models, groups, in_flight={"slow": 3}, tokens_per_task=500, pace=1.2)
    assert value == pytest.approx(own)
    # While the slow model is still on its prior, a pace measured on the other models says nothing
    # about it: its own finish is not divided by that pace (it put default.toml's ETA 22 % short
    # when the pace was above 1). At a pace of 0.5 the ETA is the bound of all the work over the
    # pace where free (14 × 25 / 3 s, over 1 − 0.5 × 40/54), plus the tail, not own / 0.5.
    from balancer.views.eta import DrainState, end_tail, forecast

    state = DrainState(models, [(["slow"], 11), (None, 40)], in_flight={"slow": 3}, tokens_per_task=500,
                       solved=[(None, 20)], window_s=60.0, on_prior=["slow"], unfinished=54)
    on_prior = forecast(state).eta
    assert on_prior == pytest.approx(14 * 25 / 3 / (1 - 0.5 * 40 / 54) + end_tail(models), rel=1e-6)
    assert on_prior < own / 0.5
    # Free work left on the fast models is shared; the slow model's calls in flight alone set no floor.
    assert drain_eta(models, [(None, 400)], in_flight={"slow": 3}, tokens_per_task=500, pace=1.2) < own


def test_one_pinned_call_takes_its_latency_and_many_spread_at_the_end() -> None:
    from balancer.views.eta import pinned_finish

    slots = ModelCapacity(concurrency=4, mean_latency=10.0, tpm=None, burst=0)
    assert pinned_finish(slots, 1, tokens_per_task=500) == pytest.approx(10.0)
    assert pinned_finish(slots, 2, tokens_per_task=500) == pytest.approx(10.0 + 10.0 / 2)
    # 40 calls on 4 slots: 100 s of work, and the last four end (1/2 + 1/3 + 1/4) × 10 s after their mean.
    assert pinned_finish(slots, 40, tokens_per_task=500) == pytest.approx(100 + 10 * (1 / 2 + 1 / 3 + 1 / 4))
    # A token-bound model: TPM 6,000 at 1,000 tokens a task is 6 tasks a minute once its burst is spent.
    bucket = ModelCapacity(concurrency=4, mean_latency=10.0, tpm=6_000, burst=0)
    assert pinned_finish(bucket, 12, tokens_per_task=1_000) == pytest.approx(120 + 10 * (1 / 2 + 1 / 3 + 1 / 4))


def test_nothing_left_is_zero_whatever_calls_are_still_running() -> None:
    """The issue saw 9 s after the last task was solved: a hedge's loser, still
    running on a slow model, counted as work. No task left: 0, band included."""
    from balancer.views.eta import DrainState, forecast

    slow = {"slow": SLOW}
    done = forecast(DrainState(slow, [], in_flight={"slow": 2}, tokens_per_task=500, unfinished=0))
    assert (done.eta, done.low, done.high) == (0.0, 0.0, 0.0)
    # One task still running but two calls in flight (it was hedged): one call of work, not two.
    hedged = forecast(DrainState(slow, [], in_flight={"slow": 2}, tokens_per_task=500, unfinished=1))
    assert hedged.eta == pytest.approx(10.0 + 5.0)
    assert eta(slow, [], in_flight={"slow": 2}) == pytest.approx(2 * 10.0 + 5.0)  # without the task count: both


def test_tasks_waiting_on_a_budget_are_left_out_of_the_eta_and_counted_apart() -> None:
    """A source over its budget per day has its pending tasks claimed by no
    dispatch: counted as work, they made the ETA promise a drain that cannot
    happen (and, with only they left, a time for them). They are left out and
    counted in ``waiting``."""
    from balancer.views.eta import DrainState, forecast

    fast = {"fast": FAST}
    # 100 pending, 60 of them a held source's, 20 pinned ones among them; 10 calls running.
    groups = [(None, 80), (["fast"], 20)]
    waiting = [(None, 40), (["fast"], 20)]
    held = forecast(DrainState(fast, groups, in_flight={"fast": 10}, tokens_per_task=500, unfinished=110,
                               waiting=waiting))
    rest = forecast(DrainState(fast, [(None, 40)], in_flight={"fast": 10}, tokens_per_task=500, unfinished=50))
    assert held.waiting == 60 and rest.waiting == 0
    assert (held.eta, held.low, held.high) == (rest.eta, rest.low, rest.high)
    assert held.eta == pytest.approx(50 / 5 + 1.0)  # the 40 free tasks and the 10 calls: 50 calls at 5 a second
    # Only the held source's tasks left: nothing the drain can do, and they are said to wait.
    only = forecast(DrainState(fast, [(None, 30)], in_flight={}, tokens_per_task=500, unfinished=30,
                               waiting=[(None, 30)]))
    assert (only.eta, only.waiting) == (0.0, 30)


def test_little_s_law_lengthens_a_latency_learned_from_the_short_calls_only() -> None:
    """Early in a heavy-tailed run the sketch has seen the calls that ended: the
    short ones. A model that keeps 16 calls in flight and answered 32 in the
    last minute takes 30 s a call by Little's law, not the 10 s its sketch says;
    its 32 answers weigh against 10 for the sketch: 10 + 20 x 32 / 42 s."""
    from balancer.views.eta import DrainState, forecast

    learned = {"m": ModelCapacity(concurrency=16, mean_latency=10.0, tpm=None, burst=0)}
    state = DrainState(learned, [(None, 160)], in_flight={"m": 16}, tokens_per_task=500, window_s=60.0,
                       solved=[(None, 32)], solved_by_model={"m": 32}, unfinished=176)
    value = forecast(state).eta
    # 176 calls of that on 16 slots, plus half a call (the pace, 32 solved + 8 half-done in flight
    # on that bound over 60 s, is above the bound, so 1).
    call_s = 10 + 20 * 32 / 42
    assert value == pytest.approx(176 * call_s / 16 + call_s / 2, rel=1e-3)
    # The sketch alone would have said a third of that.
    alone = forecast(DrainState(learned, [(None, 160)], in_flight={"m": 16}, tokens_per_task=500, unfinished=176))
    assert alone.eta is not None and alone.eta < value / 2


def test_ready_tasks_of_a_measured_model_are_its_work_but_set_no_finish_of_their_own() -> None:
    """Eight tasks on a slow model's ready list: work it will do (the bound holds
    them there), but free tasks the end game may hedge, not pinned ones: no
    spread of its last calls is added for them."""
    from balancer.views.eta import DrainState, forecast, pinned_finish

    models = {"fast": FAST, "slow": ModelCapacity(concurrency=4, mean_latency=20.0, tpm=None, burst=0)}
    ready = forecast(DrainState(models, [(None, 10)], in_flight={}, tokens_per_task=500, ready={"slow": 8},
                                unfinished=18)).eta
    pinned = forecast(DrainState(models, [(None, 10), (["slow"], 8)], in_flight={}, tokens_per_task=500,
                                 unfinished=18)).eta
    assert ready is not None and pinned is not None
    assert pinned == pytest.approx(pinned_finish(models["slow"], 8, tokens_per_task=500))
    assert ready == pytest.approx(40.0 + (10 * 2.0 + 4 * 20.0) / 14 / 2)  # 8 calls on 4 slots of 20 s, and the tail
    assert ready < pinned


def test_the_band_holds_the_eta_and_narrows_once_the_pace_is_measured() -> None:
    from balancer.views.eta import BAND, EARLY_WIDENING, DrainState, forecast

    early = forecast(DrainState({"fast": FAST}, [(None, 100)], in_flight={}, tokens_per_task=500, unfinished=100))
    late = forecast(DrainState({"fast": FAST}, [(None, 100)], in_flight={}, tokens_per_task=500, unfinished=100,
                               solved=[(None, 300)], window_s=60.0))
    for f in (early, late):
        assert f.eta is not None and f.low is not None and f.high is not None
        assert f.low < f.eta < f.high
    assert late.high / late.eta == pytest.approx(1 + BAND[1])
    assert early.high / early.eta == pytest.approx(1 + BAND[1] + EARLY_WIDENING)
    assert early.low / early.eta == pytest.approx(1 - BAND[0] - EARLY_WIDENING)


def test_a_window_that_starts_with_the_run_counts_the_full_buckets_as_capacity() -> None:
    """A TPM-bound model (60,000 TPM, 1,000 tokens a task: 1 task/s at steady
    state) solved 36 tasks in the run's first 30 s, 10 of them from its full
    bucket of 10,000 tokens. Read at steady state that is 36 s of bound in 30 s
    (a burst read as speed: capped to 1); with the bucket it started with, the
    bound is 26 s: the run went at 26/30 of it."""
    from balancer.views.eta import efficiency

    bucket = {"m": ModelCapacity(concurrency=100, mean_latency=1.0, tpm=60_000, burst=0)}
    steady = efficiency(bucket, [(None, 36)], in_flight={}, window_s=30, tokens_per_task=1_000)
    started = efficiency(bucket, [(None, 36)], in_flight={}, window_s=30, tokens_per_task=1_000,
                         start_buckets={"m": (10_000.0, None)})
    assert steady == 1.0
    assert started == pytest.approx(27 / 31, rel=1e-6)   # 26 s of bound in 30, from 1 s at the bound


def test_a_model_on_its_prior_reads_the_calls_it_answered_and_has_running() -> None:
    # default.toml at 25 % done (9fb4de4): model-7 holds 16 pinned tasks and 3 calls in flight,
    # on its 34 s prior; 2 calls answered (48.4 s in all), the 3 running for 56.2 s in all so far.
    # Its pinned finish must be read at (5 × 34 + 48.4 + 56.2) / 10 = 27.46 s a call, not at 34 s.
    from balancer.estimates.latency import early_mean_s
    from balancer.views.eta import DrainState, forecast, pinned_finish

    slow = ModelCapacity(concurrency=3, mean_latency=34.0, tpm=None, burst=0)
    fast = ModelCapacity(concurrency=40, mean_latency=5.0, tpm=None, burst=0)
    base = DrainState({"slow": slow, "fast": fast}, [(["slow"], 16), (None, 40)], in_flight={"slow": 3, "fast": 40},
                      tokens_per_task=500, on_prior=["slow"], unfinished=99)
    seen = replace(base, early_calls={"slow": (2, 48.4, 3, 56.2)})
    early = early_mean_s(34.0, 2, 48.4, 3, 56.2)
    assert early == pytest.approx(27.46)
    assert forecast(seen).eta == pytest.approx(pinned_finish(replace(slow, mean_latency=early), 19, 500))
    assert forecast(base).eta == pytest.approx(pinned_finish(slow, 19, 500))  # nothing seen: the prior
    # A model measured (not on its prior) keeps its sketch's mean whatever early_calls says.
    assert forecast(replace(seen, on_prior=[])).eta == forecast(replace(base, on_prior=[])).eta


def test_the_early_mean_moves_from_the_prior_to_what_was_seen() -> None:
    from balancer.estimates.latency import MIN_SAMPLES, early_mean_s

    assert early_mean_s(30.0, 0, 0.0) == 30.0
    assert early_mean_s(30.0, MIN_SAMPLES, MIN_SAMPLES * 10.0) == pytest.approx(20.0)  # half way with as many calls
    # A call running longer than the prior pulls the mean up though nothing ended: a slow model shows early.
    assert early_mean_s(30.0, 0, 0.0, running=3, running_s=3 * 90.0) > 30.0
    # Running calls weigh as calls at their age so far: young ones pull it down no more than answered ones would.
    assert early_mean_s(30.0, 0, 0.0, running=5, running_s=5 * 10.0) == early_mean_s(30.0, 5, 50.0)


@pytest.mark.usefixtures("migrated")
def test_running_calls_are_read_by_model_with_the_time_they_have_run() -> None:
    """What the early latency reads live: tasks running by model, and the seconds they have run."""
    from datetime import timedelta

    import sqlalchemy as sa

    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks
    from balancer.backlog.reads import running_calls
    from balancer.services import Services
    from balancer.settings import Settings
    from balancer.storage.schema import tasks

    svc = Services.connect(Settings.from_env())
    rows, _ = parse_tasks("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(5)), models={"m": 10_000_000})
    with svc.engine.begin() as conn:
        insert_tasks(conn, rows)
        ids = sorted(conn.execute(sa.select(tasks.c.id)).scalars())
        for task_id, model, ran in zip(ids, ["a", "a", "b", None], [10, 20, 5, 7], strict=False):
            conn.execute(sa.update(tasks).where(tasks.c.id == task_id).values(
                status="running", model=model, started_at=sa.func.now() - timedelta(seconds=ran)))
    running = running_calls(svc.engine)
    assert sorted(running) == ["a", "b"]  # a running task with no model yet is no model's call; pending ones none
    assert running["a"][0] == 2 and running["a"][1] == pytest.approx(30.0, abs=0.5)
    assert running["b"][0] == 1 and running["b"][1] == pytest.approx(5.0, abs=0.5)


def test_little_s_law_leaves_a_model_whose_token_rate_binds_at_its_learned_latency() -> None:
    """40 slots, 35 calls held (most waiting at the token gate), 15 answered in 23 s: Little's law
    would read 53.7 s a call. The model's 30,000 TPM (1.25 calls/s at 400 tokens) binds, not its
    slots, so it keeps its learned 2.5 s; a concurrency-bound model is still corrected."""
    from balancer.views.eta import DrainState, with_observed_latency

    gated = ModelCapacity(concurrency=40, mean_latency=2.5, tpm=30_000, burst=0)
    slots = ModelCapacity(concurrency=40, mean_latency=2.5, tpm=None, burst=0)
    state = DrainState({"gated": gated, "slots": slots}, [(None, 500)], in_flight={"gated": 35, "slots": 35},
                       tokens_per_task=400, window_s=23.0, solved_by_model={"gated": 15, "slots": 15})
    observed = with_observed_latency(state)
    assert observed["gated"].mean_latency == 2.5
    assert observed["slots"].mean_latency == pytest.approx(2.5 + (35 * 23 / 15 - 2.5) * 15 / (15 + 10))


def test_little_s_law_corrects_a_heavy_tail_from_a_run_s_first_seconds() -> None:
    """mix-2's gen-1 at 6.3 s into a run: its sketch read 2.7 s a call (the calls that had ended,
    the short ones), Little's law 4.8 s (10 slots held, 13 answered), its true mean 5.6 s. The
    ETA read the sketch alone for a run's first 20 s, and was short at 25 % done in every mix-2
    run (-4.7 to -14.7 % over 8); it now moves toward Little's law by 13 / (13 + 10)."""
    from balancer.views.eta import DrainState, with_observed_latency

    slots = ModelCapacity(concurrency=10, mean_latency=2.7, tpm=None, burst=0)
    state = DrainState({"gen-1": slots}, [(None, 500)], in_flight={"gen-1": 10}, tokens_per_task=900,
                       window_s=6.3, solved_by_model={"gen-1": 13})
    little = 10 * 6.3 / 13
    assert with_observed_latency(state)["gen-1"].mean_latency == pytest.approx(2.7 + (little - 2.7) * 13 / 23)


@pytest.mark.usefixtures("migrated")
def test_each_model_drains_at_the_tokens_of_the_tasks_it_answered() -> None:
    """A token-bound model is sent the small tasks (its bucket admits them sooner): on
    learn.toml the two TPM-bound models answered 383 and 395 tokens a task against the
    backlog's 536, and at the backlog's mean the ETA had them 27 % slower than they ran.
    Each model reads its own figure from the tasks it answered in the last minute, beside
    the backlog's mean (weighing as OWN_TOKENS_PRIOR tasks): their estimate for a `reserve`
    provider, and for a `settle` one the usage of the answers that reported it."""
    import sqlalchemy as sa

    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks
    from balancer.estimates.capacity import OWN_TOKENS_PRIOR
    from balancer.services import Services
    from balancer.settings import Settings
    from balancer.storage.schema import tasks
    from balancer.views.summary import drain_inputs

    svc = Services.connect(Settings.from_env())
    for name, accounting in (("res", "reserve"), ("set", "settle"), ("idle", "reserve")):
        svc.quotas.set(name, {"max_concurrent_requests": 10, "max_tokens_per_minute": 60_000,
                              "token_accounting": accounting}, create=True, by="test")
    prompts = "\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(100))
    rows, _ = parse_tasks(prompts, models=dict.fromkeys(("res", "set", "idle"), 60_000))
    with svc.engine.begin() as conn:
        insert_tasks(conn, rows)
        ids = sorted(conn.execute(sa.select(tasks.c.id)).scalars())
        answered = [("res", 300, 100, 60)] * 20 + [("set", 300, 100, 50)] * 15 + [("set", 300, None, None)] * 5
        for task_id, (model, estimated, prompt, completion) in zip(ids, answered, strict=False):
            conn.execute(sa.update(tasks).where(tasks.c.id == task_id).values(
                status="solved", model=model, estimated_tokens=estimated, prompt_tokens=prompt,
                completion_tokens=completion, updated_at=sa.func.now()))
    state = drain_inputs(svc)
    assert state is not None
    mean, k = state.tokens_per_task, OWN_TOKENS_PRIOR
    assert mean != 300
    assert state.models["res"].tokens_per_task == pytest.approx((k * mean + 20 * 300) / (k + 20))   # the estimates
    assert state.models["set"].tokens_per_task == pytest.approx((k * mean + 15 * 150) / (k + 15))   # the usage reported
    assert state.models["idle"].tokens_per_task == pytest.approx(mean)                              # nothing answered


@pytest.mark.usefixtures("migrated")
def test_a_start_gate_booked_ahead_is_no_negative_burst_in_the_eta() -> None:
    """A model whose start gate is booked ahead reads a request bucket below 0 (the calls waiting
    there: balancer.admission.values.gate_room). Those calls are in flight, counted there; as a
    burst of -36 requests they were counted a second time, and took capacity from the others."""
    from balancer.admission.learned import Learned
    from balancer.admission.live import ModelLive
    from balancer.admission.quota import Quota
    from balancer.services import Services
    from balancer.settings import Settings
    from balancer.views.summary import drain_inputs

    svc = Services.connect(Settings.from_env())
    booked = ModelLive(Quota("rpm", 40, 2_000_000, max_requests_per_minute=600), in_flight=38,
                       tokens_available=1e6, requests_available=-36.0, deficit=0, learned=Learned(lrpm=60))
    free = ModelLive(Quota("free", 4, 2_000_000), in_flight=0, tokens_available=1e6, requests_available=None, deficit=0)
    state = drain_inputs(svc, view={"rpm": booked, "free": free})
    assert state is not None
    assert state.models["rpm"].request_burst == 0.0 and state.models["rpm"].rpm == 60
    assert state.models["free"].request_burst is None


def test_a_ready_list_past_what_its_model_finishes_in_its_ttl_is_any_model_s_work() -> None:
    """providers-foreign: an RPM-bound model held 130 ready tasks, 32 s of its 4 a second.
    Its list's TTL is 5 s: it takes 20 of them, the rest go back to pending for any model.
    Counted as its own, they put the ETA 26 % long at 75 % done (−3.7 % with the TTL)."""
    from balancer.views.eta import DrainState, forecast

    rpm_bound = ModelCapacity(concurrency=40, mean_latency=1.5, tpm=None, burst=0, rpm=240, request_burst=0)
    state = DrainState(models={"rpm": rpm_bound, "fast": FAST}, groups=[], in_flight={}, tokens_per_task=500,
                       unfinished=130, ready={"rpm": 130})
    held = forecast(state).eta
    spread = forecast(replace(state, ready_ttl_s=5.0)).eta
    assert held is not None and spread is not None
    assert held > 130 / 4                   # every ready task on its model, at 4 a second
    assert spread < 130 / (4 + 5) + 3       # 20 there, 110 on either: about 14 s, and the last calls


def test_a_run_below_its_bound_is_promised_its_own_pace_from_its_first_seconds() -> None:
    """Issue 39 deliverable 3: the ETA assumed the run went at its bound until 20 s had passed,
    so a run of about 20 s at 0.85 of its bound was promised its bound, 20 to 45 % short. The
    pace achieved against the bound counts from the first seconds: 8.5 s of bound done in 10 s."""
    from balancer.views.eta import PACE_PRIOR_S, DrainState, achieved_pace, forecast

    assert achieved_pace(8.5, 10.0) == pytest.approx((8.5 + PACE_PRIOR_S) / (10.0 + PACE_PRIOR_S))
    assert achieved_pace(0.0, 0.0) == 1.0                       # nothing run yet: the bound
    assert achieved_pace(17.0, 20.0) == pytest.approx(18 / 21)  # 0.85 read as 0.857, not 0.95
    assert achieved_pace(25.0, 20.0) == 1.0                     # no run beats its bound
    assert achieved_pace(1.0, 30.0) == 0.5                      # a stall: at most twice as long
    # FAST: 10 slots of 2 s, 5 tasks/s. 42 solved in 10 s (8.4 s of bound, 1 call in flight: 8.5 s).
    state = DrainState({"fast": FAST}, [(None, 100)], in_flight={"fast": 1}, tokens_per_task=500, unfinished=101,
                       solved=[(None, 42)], window_s=10.0)
    paced = forecast(state).eta
    at_bound = forecast(replace(state, solved=[], window_s=0.0)).eta
    assert paced is not None and at_bound is not None
    scaled = 1 + (9.5 / 11 - 1) * 100 / 101   # the pace, on the work left free to run (the call in flight is not)
    assert paced - 1.0 == pytest.approx((at_bound - 1.0) / scaled)   # the bound left, over it; 1 s of tail
