"""The drain ETA: how long until the current backlog is solved (pure).

It is the capacity bound (:mod:`balancer.estimates.capacity`) applied to the
work left, from now, on the live limits (each model's effective ones, learned
or not): each model's concurrency over its mean latency, its token and
request buckets as they are now plus their refill, pinned tasks held to
their model. :func:`forecast` turns that fluid
bound into a forecast with a band; its corrections, each measured in
docs/benchmark-history.md ("The drain ETA"):

* nothing left is 0: no task pending, queued or running, whatever calls still
  run (a hedge's loser); calls in flight beyond the tasks running shrink in
  proportion (:func:`held_in_flight`);
* the pending tasks of a source over its budget per day wait, claimed by no
  dispatch until the budget is raised or the day turns, and those no enabled model
  may take wait for one: they are no work the drain can do, so they are left out
  and counted apart (``Forecast.waiting``, ``Forecast.unplaced``);
* calls in flight, and tasks on a measured model's ready list up to what it
  finishes within the list's TTL (the rest go back to pending: any model's,
  :func:`balancer.dispatch.ready.ready_on_model`), count as work still to do on
  their model (a whole call each: about half a call too many, the safe side);
* each model's latency is its learned mean raised toward its Little's-law latency when that is
  longer, as far as its answers in the window allow (:func:`observed_latency`: the sketch learns
  from the calls that ended, early in a heavy-tailed run the short ones), from the run's first
  answers, unless its token or request rate binds (:func:`rate_bound`);
* the last calls run on after the fluid bound says the work is "done" (:func:`end_tail`);
* the run does not reach the bound: the :func:`efficiency` of the last minute (or less: since a
  learned limit changed, or the run started), the bound of the work solved in it over its time
  (full buckets counted while it starts with the run), never above 1, divides the bound of the
  work left free to run, from the run's first seconds (:func:`achieved_pace`);
* work held to one model cannot move to a faster one, so the end game cannot shorten its last
  calls: a model with pinned tasks left finishes no sooner than :func:`pinned_finish`, its own
  bound for them plus the spread of its last calls, at that model's own latency;
* a model with too few calls measured for its sketch reads its prior shrunk toward the calls
  it answered and the time its running calls have run (:func:`balancer.estimates.latency.early_mean_s`).

Tasks allowed on a subset of models count as "any model" (the bound's feasibility test knows
only "any" and "exactly one"), so a backlog split across disjoint subsets reads optimistic.

>>> from balancer.estimates.capacity import ModelCapacity
>>> fast = ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0)
>>> [round(drain_eta({"fast": fast}, groups, in_flight={}, tokens_per_task=500), 1) for groups in ([(None, 100)], [])]
[21.0, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from balancer.dispatch.ready import ready_on_model
from balancer.estimates.capacity import ModelCapacity, makespan_bound, rate_bound
from balancer.estimates.latency import early_mean_s, little_latency, observed_latency

#: Fewer tasks solved in the window than this: no efficiency correction (1.0). A window
#: shorter than MIN_WINDOW_S (a run's first seconds) keeps the early band (:func:`forecast`).
MIN_SOLVED, MIN_WINDOW_S = 20, 20.0
#: Seconds of running at the bound the pace starts from (:func:`achieved_pace`).
PACE_PRIOR_S = 1.0
#: The efficiency is kept within these bounds: a stall of one minute must not
#: multiply the forecast by more than two, and no run beats its capacity bound
#: (a lower bound on the time by construction), so a pace above 1 is an error of
#: its inputs (latencies learned short, a burst spent in the window) and reads as 1.
EFFICIENCY_RANGE = (0.5, 1.0)


def efficiency(
    models: Mapping[str, ModelCapacity],
    solved: Sequence[tuple[Sequence[str] | None, int]],
    *,
    in_flight: Mapping[str, float],
    window_s: float,
    tokens_per_task: float,
    start_buckets: Mapping[str, tuple[float, float | None]] | None = None,
) -> float:
    """How fast the run went lately, as a share of its capacity bound: the bound
    of the work solved in the last ``window_s`` seconds (calls in flight count
    as half done), over ``window_s``, from the run's first seconds (:func:`achieved_pace`).
    The bound is at steady state (no bucket contents) for a window inside the run; for a
    window that starts with the run, ``start_buckets`` (each model's full token and request
    buckets) are what its bursts could spend, so the first minute's bursts do not read as speed.

    >>> from balancer.estimates.capacity import ModelCapacity
    >>> fast = {"fast": ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0)}
    >>> [round(efficiency(fast, [(None, n)], in_flight={}, window_s=60, tokens_per_task=500), 3) for n in (240, 5)]
    [0.803, 1.0]
    """
    done = sum(n for _, n in solved)
    if done < MIN_SOLVED or window_s <= 0:
        return 1.0
    full = start_buckets or {}
    steady = {name: ModelCapacity(m.concurrency, m.mean_latency, m.tpm, full.get(name, (0.0, None))[0], m.rpm,
                                  full.get(name, (0.0, None))[1] or 0.0, m.tokens_per_task)
              for name, m in models.items()}
    half_in_flight = {name: n / 2 for name, n in in_flight.items()}
    bound = _bound(steady, solved, half_in_flight, tokens_per_task)
    return 1.0 if bound is None else achieved_pace(bound, window_s)


def achieved_pace(bound_s: float, window_s: float) -> float:
    """The run's pace: ``bound_s``, the capacity bound of the work it did in ``window_s``,
    over ``window_s``, starting from PACE_PRIOR_S at the bound; within EFFICIENCY_RANGE.
    A run at 0.85 of its bound reads so from its first seconds.

    >>> [round(achieved_pace(b, w), 3) for b, w in ((8.5, 10), (0, 0), (1.7, 2), (30, 20), (2, 60))]   # last: a stall
    [0.864, 1.0, 0.9, 1.0, 0.5]
    """
    low, high = EFFICIENCY_RANGE
    return min(high, max(low, (bound_s + PACE_PRIOR_S) / (window_s + PACE_PRIOR_S)))


def drain_eta(
    models: Mapping[str, ModelCapacity],
    groups: Sequence[tuple[Sequence[str] | None, int]],
    *,
    in_flight: Mapping[str, float],
    tokens_per_task: float,
    pace: float = 1.0,
) -> float | None:
    """Seconds until the backlog is solved; None if some pinned work has no capacity.

    ``groups``: pending task counts by allowed models (None: any model);
    ``pace``: the run's :func:`efficiency`; the bound of the work left is divided
    by it, in the proportion of that work free to run on more than one model.
    A model with pinned work left finishes no sooner than its :func:`pinned_finish`.
    """
    total = sum(n for _, n in groups) + sum(in_flight.values())
    if total == 0:
        return 0.0
    bound = _bound(models, groups, in_flight, tokens_per_task)
    if bound is None:
        return None
    # The pace was measured on work free to go to any model (mostly the fast ones); work held to
    # one model runs at that model's own pace. So it applies in proportion to the work left that is free.
    free = sum(n for allowed, n in groups if allowed is None or len(allowed) > 1)
    scaled = 1 + (pace - 1) * free / total
    eta = bound / scaled + end_tail(models)
    for name, pinned in _pinned_by_model(models, groups).items():
        own = pinned_finish(models[name], pinned + in_flight.get(name, 0), tokens_per_task)
        eta = max(eta, own)
    return eta


def end_tail(models: Mapping[str, ModelCapacity]) -> float:
    """How long the last calls run after the fluid bound says the work is done: what the call
    running in each slot when the backlog runs out has left, on average over the slots. A call
    caught running is more often a long one (the inspection paradox): E[L²]/(2·E[L]) is left,
    half a call for a fixed latency, more the more latencies spread (``latency_dispersion``).

    >>> fast = ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0)
    >>> slow = ModelCapacity(concurrency=2, mean_latency=20.0, tpm=None, burst=0)
    >>> end_tail({"fast": fast}), round(end_tail({"fast": fast, "slow": slow}), 3)   # (10 × 2 + 2 × 20) / 12 / 2
    (1.0, 2.5)
    >>> end_tail({"fast": replace(fast, latency_dispersion=2.0)})   # exponential latencies: a whole mean call
    2.0
    """
    left = sum(m.concurrency * m.mean_latency * m.latency_dispersion for m in models.values())
    return left / max(1, sum(m.concurrency for m in models.values())) / 2


def pinned_finish(model: ModelCapacity, calls: float, tokens_per_task: float) -> float:
    """When a model ends ``calls`` that only it may run: its capacity bound for
    them (at least one call's latency), plus the spread of its last calls.

    The fluid bound has every slot end at once; in fact the last c calls end
    one by one, and the last of them ends about (H_c − 1)·E[L] after their mean
    (H_c the c-th harmonic number: exact for exponential latencies, a fair
    stand-in for the heavy-tailed ones of LLM calls), c = min(slots, calls).

    >>> slow = ModelCapacity(concurrency=3, mean_latency=30.0, tpm=None, burst=0)
    >>> [round(pinned_finish(slow, n, 500), 1) for n in (14, 1)]   # 14 × 30 / 3 = 140, plus (1/2 + 1/3) × 30; one call
    [165.0, 30.0]
    """
    bound = makespan_bound([model], tokens_per_task=max(1.0, tokens_per_task), any_model=0, pinned={0: calls})
    last = int(min(model.concurrency, math.ceil(calls)))
    spread = sum(1 / i for i in range(2, last + 1))
    return max(bound, model.mean_latency) + spread * model.mean_latency


def _usable(allowed: Sequence[str] | None, models: Collection[str]) -> list[str] | None:
    """The ``models`` a group allowed on ``allowed`` may run on (None: any of them)."""
    return None if allowed is None else [m for m in allowed if m in models]


def _pinned_by_model(
    models: Mapping[str, ModelCapacity], groups: Sequence[tuple[Sequence[str] | None, int]],
) -> dict[str, int]:
    """Pending tasks that exactly one configured model may run, by that model."""
    pinned: dict[str, int] = {}
    for allowed, count in groups:
        usable = _usable(allowed, models)
        if usable is not None and len(usable) == 1 and count:
            pinned[usable[0]] = pinned.get(usable[0], 0) + count
    return pinned


def _bound(
    models: Mapping[str, ModelCapacity],
    groups: Sequence[tuple[Sequence[str] | None, int]],
    in_flight: Mapping[str, float],
    tokens_per_task: float,
) -> float | None:
    """The capacity bound of ``groups`` plus ``in_flight`` (held to their model);
    None if some of it may run on no model, or has no capacity."""
    pinned = _pinned_by_model(models, groups)
    any_model = 0
    for allowed, count in groups:
        usable = _usable(allowed, models)
        if usable is not None and not usable:
            return None  # no configured model may run these tasks
        if usable is None or len(usable) > 1:
            any_model += count
    held = {name: pinned.get(name, 0) + in_flight.get(name, 0) for name in models}
    if any_model + sum(held.values()) == 0:
        return 0.0
    names = sorted(models)
    try:
        return makespan_bound([models[n] for n in names], tokens_per_task=max(1.0, tokens_per_task),
                              any_model=any_model, pinned={i: held[n] for i, n in enumerate(names)})
    except ValueError:
        return None


@dataclass(frozen=True)
class DrainState:
    """What the ETA is computed from, as read at one moment (see
    :func:`balancer.views.summary.drain_inputs`)."""

    models: Mapping[str, ModelCapacity]  # the enabled models, on their live buckets and learned latencies
    groups: Sequence[tuple[Sequence[str] | None, int]]  # pending (and ready-listed) tasks by allowed models
    in_flight: Mapping[str, int]  # calls in flight by model (hedges and cut-off losers included)
    tokens_per_task: float
    solved: Sequence[tuple[Sequence[str] | None, int]] = ()  # solved in the last window_s, by allowed models
    window_s: float = 0.0
    on_prior: Collection[str] = ()  # models with no measured latency yet (the band is wider while there are some)
    #: Each model's full buckets (tokens, requests or None), when the pace window starts with the run.
    start_buckets: Mapping[str, tuple[float, float | None]] | None = None
    unfinished: int | None = None  # tasks pending, queued or running (None: unknown)
    solved_by_model: Mapping[str, int] = field(default_factory=dict)  # solved in the last window_s, by answering model
    #: Tasks on a measured model's ready list: that model's work, as its calls in flight are (not pinned:
    #: the end game may hedge them, so they set no :func:`pinned_finish` of their own), up to what it
    #: finishes within ``ready_ttl_s`` (None: all of them).
    ready: Mapping[str, int] = field(default_factory=dict)
    #: The pending tasks of sources over their budget per day, by allowed models (a part of ``groups``
    #: and ``unfinished``): no dispatch claims them until the budget is raised or the day turns, so they
    #: are no work the drain can do; :func:`forecast` leaves them out and counts them in ``waiting``.
    waiting: Sequence[tuple[Sequence[str] | None, int]] = ()
    #: Models on their prior: (calls answered, their seconds, calls running, the seconds they have run).
    early_calls: Mapping[str, tuple[float, float, int, float]] = field(default_factory=dict)
    ready_ttl_s: float | None = None


@dataclass(frozen=True)
class Forecast:
    """The drain ETA (s) and the band it is expected in: ``low`` <= ``eta`` <= ``high``; and the
    pending tasks left out of it because their source's budget is spent (``waiting``), or because
    no enabled model may take them (``unplaced``: their models were removed or disabled)."""

    eta: float | None
    low: float | None
    high: float | None
    waiting: int = 0
    unplaced: int = 0


#: The band around the ETA, as shares of it: below and above, once the pace applies; before
#: it does (a run's first 20 s, a pace window cut short by a learned change, or a model still
#: on its prior), EARLY_WIDENING wider each side.
BAND = (0.15, 0.25)
EARLY_WIDENING = 0.15


def without_waiting(
    groups: Sequence[tuple[Sequence[str] | None, int]], waiting: Sequence[tuple[Sequence[str] | None, int]],
) -> list[tuple[Sequence[str] | None, int]]:
    """``groups`` less the tasks ``waiting`` on a budget, matched by allowed models (never below 0).

    >>> without_waiting([(None, 100), (["a"], 5)], [(None, 60), (["a"], 9)])
    [(None, 40)]
    """
    left: dict[tuple[str, ...] | None, int] = {}
    for allowed, n in waiting:
        key = None if allowed is None else tuple(allowed)
        left[key] = left.get(key, 0) + n
    out: list[tuple[Sequence[str] | None, int]] = []
    for allowed, n in groups:
        key = None if allowed is None else tuple(allowed)
        taken = min(n, left.get(key, 0))
        left[key] = left.get(key, 0) - taken
        if n - taken:
            out.append((allowed, n - taken))
    return out


def held_in_flight(in_flight: Mapping[str, int], running: int) -> dict[str, float]:
    """The calls in flight that are still a task's work: at most ``running`` in all.

    A hedged task has two calls in flight, and a hedge's loser may run on after
    its task was solved (the backend was not told, or cannot stop): those calls
    are no work left. When there are more calls than running tasks, each model's
    count shrinks in proportion.

    >>> held_in_flight({"a": 6, "b": 2}, running=4), held_in_flight({"a": 3}, running=5), held_in_flight({"a": 3}, 0)
    ({'a': 3.0, 'b': 1.0}, {'a': 3.0}, {'a': 0.0})
    """
    calls = sum(in_flight.values())
    share = 1.0 if calls <= running else max(0, running) / calls
    return {name: n * share for name, n in in_flight.items()}


def with_observed_latency(state: DrainState) -> dict[str, ModelCapacity]:
    """The models with a model on its prior at :func:`~balancer.estimates.latency.early_mean_s`
    of its ``early_calls``, and each one's mean latency raised toward its :func:`little_latency`
    (:func:`observed_latency`).

    >>> m = {"slow": ModelCapacity(concurrency=16, mean_latency=10.0, tpm=None, burst=0)}
    >>> s = DrainState(m, [(None, 100)], in_flight={"slow": 16}, tokens_per_task=500, window_s=60.0,
    ...                solved_by_model={"slow": 40})
    >>> with_observed_latency(s)["slow"].mean_latency   # Little's law reads 24 s, from 40 answers
    21.2
    """
    out = {name: replace(model, mean_latency=early_mean_s(model.mean_latency, *state.early_calls[name]))
           if name in state.on_prior and name in state.early_calls else model for name, model in state.models.items()}
    for name, model in out.items():
        if rate_bound(model, state.tokens_per_task):
            continue
        solved = state.solved_by_model.get(name, 0)
        little = little_latency(state.in_flight.get(name, 0), solved, state.window_s)
        out[name] = replace(model, mean_latency=observed_latency(model.mean_latency, little, solved))
    return out


def forecast(state: DrainState) -> Forecast:
    """The drain ETA of ``state`` with its band: exactly 0 when no task is left
    unfinished, whatever calls are still in flight. The tasks of sources over
    their budget (``state.waiting``) are left out of it and counted in ``waiting``;
    those no enabled model may take, in ``unplaced``.

    >>> from balancer.estimates.capacity import ModelCapacity
    >>> fast = {"fast": ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0)}
    >>> forecast(DrainState(fast, [], in_flight={"fast": 3}, tokens_per_task=500, unfinished=0))
    Forecast(eta=0.0, low=0.0, high=0.0, waiting=0, unplaced=0)
    >>> f = forecast(DrainState(fast, [(None, 100)], in_flight={}, tokens_per_task=500, unfinished=100))
    >>> round(f.eta, 1), round(f.low, 1), round(f.high, 1)   # no pace yet: the early band
    (21.0, 14.7, 29.4)
    >>> f = forecast(DrainState(fast, [(None, 100), (["removed"], 6)], in_flight={}, tokens_per_task=500, unfinished=106))
    >>> round(f.eta, 1), f.unplaced   # 6 pinned to a model that is gone: left out, not an unknown ETA
    (21.0, 6)
    """
    # Work no dispatch claims (its budget spent, or no enabled model may take it): not in the ETA, counted apart.
    claimable = without_waiting(state.groups, state.waiting)
    placeable = [(allowed, n) for allowed, n in claimable if _usable(allowed, state.models) != []]
    waiting, unplaced = sum(n for _, n in state.waiting), sum(n for _, n in claimable) - sum(n for _, n in placeable)
    if waiting or unplaced:
        unfinished = None if state.unfinished is None else max(0, state.unfinished - waiting - unplaced)
        state = replace(state, groups=placeable, waiting=(), unfinished=unfinished)
        return replace(forecast(state), waiting=waiting, unplaced=unplaced)
    if state.unfinished == 0:
        return Forecast(0.0, 0.0, 0.0)
    if state.ready_ttl_s is not None:  # what a ready list holds past its TTL goes back to pending
        rates = {name: model.rate(state.tokens_per_task) for name, model in state.models.items()}
        own, spill = ready_on_model(state.ready, rates, state.ready_ttl_s)
        state = replace(state, ready=own, groups=[*state.groups, (None, spill)], ready_ttl_s=None)
    in_flight: Mapping[str, float] = state.in_flight
    if state.unfinished is not None:
        queued = sum(n for _, n in state.groups) + sum(state.ready.values())
        in_flight = held_in_flight(state.in_flight, state.unfinished - queued)
    held = {name: in_flight.get(name, 0) + state.ready.get(name, 0) for name in set(in_flight) | set(state.ready)}
    models = with_observed_latency(state)
    pace = efficiency(models, state.solved, in_flight=in_flight, window_s=state.window_s,
                      tokens_per_task=state.tokens_per_task, start_buckets=state.start_buckets)
    # A model still on its prior keeps its own pinned finish at its early latency: a pace measured on
    # the other models says nothing about it.
    eta = drain_eta(models, state.groups, in_flight=held, tokens_per_task=state.tokens_per_task, pace=pace)
    if eta is None:
        return Forecast(None, None, None)
    early = state.window_s < MIN_WINDOW_S or sum(n for _, n in state.solved) < MIN_SOLVED or bool(state.on_prior)
    below, above = (share + (EARLY_WIDENING if early else 0.0) for share in BAND)
    return Forecast(eta, eta * (1 - below), eta * (1 + above))
