"""The drain ETA: how long until the current backlog is solved (pure).

It is the capacity bound (:mod:`balancer.domain.capacity`) applied to the
work left, from now, on the live quotas: each model's concurrency over its
learned mean latency, its token and request buckets as they are now plus
their refill, pinned tasks held to their model. Two corrections turn that
fluid bound into a forecast:

* calls in flight count as work still to do on their model (they hold a
  slot until they end; counting each as a whole call over-states them by
  about half a call each, a small bias on the safe side);
* the last calls still take their latency after the fluid bound says the
  work is "done": half the mean latency of the fastest model with capacity,
  where the end game sends the last tasks;
* the run does not reach the bound, and the bound is only as good as the
  latencies it is given (early on, a slow model's are still its prior): the
  :func:`efficiency` of the last minute, the bound of the work solved in it
  over the time it took, scales the bound of the work left. The same
  latencies enter both, so a prior that is too slow cancels out.

Tasks allowed on a subset of models count as "any model" (the bound's
feasibility test knows only "any" and "exactly one"), so a backlog split
across disjoint subsets reads optimistic.

>>> from balancer.domain.capacity import ModelCapacity
>>> fast = ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0)
>>> round(drain_eta({"fast": fast}, [(None, 100)], in_flight={}, tokens_per_task=500), 1)   # 5 tasks/s + 1 s
21.0
>>> drain_eta({"fast": fast}, [], in_flight={}, tokens_per_task=500)
0.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from balancer.domain.capacity import ModelCapacity, makespan_bound

#: Fewer tasks solved in the window than this, or a window shorter than
#: MIN_WINDOW_S (a run's first seconds, when its buckets' bursts outrun any
#: steady state): no efficiency correction (1.0).
MIN_SOLVED, MIN_WINDOW_S = 20, 30.0
#: The efficiency is kept within these bounds: a burst or a stall of one minute
#: must not multiply or divide the forecast by more than two.
EFFICIENCY_RANGE = (0.5, 2.0)


def efficiency(
    models: Mapping[str, ModelCapacity],
    solved: Sequence[tuple[Sequence[str] | None, int]],
    *,
    in_flight: Mapping[str, int],
    window_s: float,
    tokens_per_task: float,
) -> float:
    """How fast the run went lately, as a share of its capacity bound: the bound
    of the work solved in the last ``window_s`` seconds (calls in flight count
    as half done), at steady state (no bucket contents), over ``window_s``.

    >>> from balancer.domain.capacity import ModelCapacity
    >>> fast = {"fast": ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0)}
    >>> round(efficiency(fast, [(None, 240)], in_flight={}, window_s=60, tokens_per_task=500), 6)   # 4 tasks/s of 5
    0.8
    >>> efficiency(fast, [(None, 5)], in_flight={}, window_s=60, tokens_per_task=500)   # too few to tell
    1.0
    """
    done = sum(n for _, n in solved)
    if done < MIN_SOLVED or window_s < MIN_WINDOW_S:
        return 1.0
    steady = {name: ModelCapacity(m.concurrency, m.mean_latency, m.tpm, 0.0, m.rpm, 0.0, m.tokens_per_task)
              for name, m in models.items()}
    half_in_flight = {name: n / 2 for name, n in in_flight.items()}
    bound = _bound(steady, solved, half_in_flight, tokens_per_task)
    if bound is None:
        return 1.0
    low, high = EFFICIENCY_RANGE
    return min(high, max(low, bound / window_s))


def drain_eta(
    models: Mapping[str, ModelCapacity],
    groups: Sequence[tuple[Sequence[str] | None, int]],
    *,
    in_flight: Mapping[str, int],
    tokens_per_task: float,
    pace: float = 1.0,
) -> float | None:
    """Seconds until the backlog is solved; None if some pinned work has no capacity.

    ``groups``: pending task counts by allowed models (None: any model);
    ``pace``: the run's :func:`efficiency`; the bound of the work left is divided
    by it, in the proportion of that work free to run on more than one model.
    """
    total = sum(n for _, n in groups) + sum(in_flight.values())
    if total == 0:
        return 0.0
    bound = _bound(models, groups, in_flight, tokens_per_task)
    if bound is None:
        return None
    # The pace was measured on work free to go to any model (mostly the fast
    # ones); work held to one model runs at that model's own pace. So it applies
    # in proportion to the work left that is free.
    free = sum(n for allowed, n in groups if allowed is None or len(allowed) > 1)
    pace = 1 + (pace - 1) * free / total
    tail = min(m.mean_latency for m in models.values()) / 2
    return bound / pace + tail


def _bound(
    models: Mapping[str, ModelCapacity],
    groups: Sequence[tuple[Sequence[str] | None, int]],
    in_flight: Mapping[str, float],
    tokens_per_task: float,
) -> float | None:
    """The capacity bound of ``groups`` plus ``in_flight`` (held to their model);
    None if some of it may run on no model, or has no capacity."""
    names = sorted(models)
    index = {name: i for i, name in enumerate(names)}
    any_model, pinned = 0, dict.fromkeys(range(len(names)), 0.0)
    for allowed, count in groups:
        usable = None if allowed is None else [m for m in allowed if m in index]
        if usable is not None and len(usable) == 1:
            pinned[index[usable[0]]] += count
        elif usable is None or usable:
            any_model += count
        else:
            return None  # no configured model may run these tasks
    for name, n in in_flight.items():
        if name in index:
            pinned[index[name]] += n
    if any_model + sum(pinned.values()) == 0:
        return 0.0
    try:
        return makespan_bound([models[n] for n in names], tokens_per_task=max(1.0, tokens_per_task),
                              any_model=any_model, pinned=pinned)
    except ValueError:
        return None
