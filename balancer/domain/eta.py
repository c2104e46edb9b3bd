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
  where the end game sends the last tasks.

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


def drain_eta(
    models: Mapping[str, ModelCapacity],
    groups: Sequence[tuple[Sequence[str] | None, int]],
    *,
    in_flight: Mapping[str, int],
    tokens_per_task: float,
) -> float | None:
    """Seconds until the backlog is solved; None if some pinned work has no capacity.

    ``groups``: pending task counts by allowed models (None: any model).
    """
    names = sorted(models)
    index = {name: i for i, name in enumerate(names)}
    any_model, pinned = 0, dict.fromkeys(range(len(names)), 0)
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
    capacities = [models[n] for n in names]
    try:
        bound = makespan_bound(capacities, tokens_per_task=max(1.0, tokens_per_task), any_model=any_model, pinned=pinned)
    except ValueError:
        return None
    tail = min(m.mean_latency for m in capacities) / 2
    return bound + tail
