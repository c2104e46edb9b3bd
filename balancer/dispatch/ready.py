"""Ready lists: how many tasks a busy model keeps ready, and when to stop.

When a call ends, its slot should carry the next call within milliseconds.
Through the dispatcher that takes a trigger, a dispatch round, a publish and a
consume: 60 to 300 ms between two calls of a busy model, measured before ready lists
(docs/benchmark-history.md, the hot path). So the dispatcher keeps a
*ready list* for each model that its concurrency cap binds: tasks placed on it
ahead of a free slot (not ahead of the admission). The call that frees a slot
admits the list's head in the same Redis round trip (``finish.lua``) and the
worker calls it next.

Placing a task early is a small loss of late binding, so it is bounded three ways:

- **Depth.** At most ``ceil(cap * per_slot)`` tasks, and no more than the
  model's slots finish in half the list's time to live, so a slow model keeps
  none (a 60 ms gap is nothing next to its calls) and entries rarely expire.
- **Time.** An entry not taken within its TTL is dropped and its task goes
  back to pending: a disabled, paused or slowed model strands nothing.
- **The end of the backlog.** Lists are stocked only while the backlog
  outlasts a call started now on the slowest model, the end game's own test
  (:mod:`balancer.dispatch.endgame`), so the last tasks are still placed where
  they finish soonest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from balancer.dispatch.endgame import ModelOutlook, horizon_ms


def depth(cap: int, mean_latency_ms: float | None, per_slot: float, ttl_s: float) -> int:
    """How many ready tasks a concurrency-bound model keeps.

    >>> depth(cap=8, mean_latency_ms=400, per_slot=1, ttl_s=5)      # fast: one per slot
    8
    >>> depth(cap=8, mean_latency_ms=400, per_slot=0.5, ttl_s=5)    # or half
    4
    >>> depth(cap=8, mean_latency_ms=4_000, per_slot=1, ttl_s=5)    # 8 slots finish 5 calls in 2.5 s
    5
    >>> depth(cap=3, mean_latency_ms=30_000, per_slot=1, ttl_s=5)   # slow: none
    0
    >>> depth(cap=8, mean_latency_ms=400, per_slot=0, ttl_s=5)      # lists off
    0
    >>> depth(cap=8, mean_latency_ms=None, per_slot=3, ttl_s=5)     # not measured yet: one per slot
    8

    A model with no measured calls yet (``None``; no latency given in its quota
    either) keeps one per slot: at the start of a run, the first calls' ends
    take their next calls from the list instead of waiting for a dispatcher
    busy placing the first wave. If the model
    turns out slow, its entries outlive their TTL and go back to pending.

    Three per slot by default (``BALANCER_READY_PER_SLOT``): on a loaded
    machine a dispatch run takes 100 ms or more, and lists of half a slot or
    one slot ran dry between two restocks (docs/benchmark-history.md, the hot path).
    """
    if per_slot <= 0 or cap <= 0:
        return 0
    if mean_latency_ms is None:
        return math.ceil(cap * min(per_slot, 1))
    by_slots = math.ceil(cap * per_slot)
    if mean_latency_ms <= 0:
        return by_slots
    by_ttl = math.floor(cap * ttl_s * 1000 / 2 / mean_latency_ms)
    return max(0, min(by_slots, by_ttl))


def backlog_to_stock(mean_tokens: float, models: Sequence[ModelOutlook], latency_field: str) -> int:
    """The fewest pending tasks that still outlast a call started now on the
    slowest model (at its ``latency_field``: p90 or mean, see :data:`balancer.dispatch.endgame.CAUTIOUS`): below it, ready lists are not
    stocked and the end game places the last tasks.

    >>> from balancer.estimates.latency import LatencyEstimate
    >>> fast = ModelOutlook("fast", cap=10, free_slots=0, in_flight=10, latency=LatencyEstimate(500, 1_000, 1_500, 50))
    >>> slow = ModelOutlook("slow", cap=2, free_slots=0, in_flight=2, latency=LatencyEstimate(2_000, 4_000, 6_000, 50))
    >>> round(fast.throughput_per_ms(100) * 1000, 1), round(slow.throughput_per_ms(100) * 1000, 2)
    (17.7, 0.88)
    >>> backlog_to_stock(100, [fast, slow], "p90_ms")   # 18.5 tasks/s over the slow p90 of 4 s
    75
    """
    horizon = horizon_ms([m for m in models if m.cap > 0], latency_field)
    return math.ceil(horizon * sum(m.throughput_per_ms(mean_tokens) for m in models))


def ready_on_model(ready: Mapping[str, int], rates: Mapping[str, float], ttl_s: float) -> tuple[dict[str, int], int]:
    """Each model's ready tasks that the model itself takes, at most what it finishes
    within the list's TTL at ``rates`` (tasks a second), and how many are left over:
    those outlive their TTL, go back to pending, and are work for any model (the
    drain ETA). On providers-foreign an RPM-bound model held 130 ready tasks, 32 s of
    its 4 a second, and counted as its own they put the ETA 26 % long at 75 % done.

    >>> ready_on_model({"rpm": 130, "conc": 8}, {"rpm": 4.0, "conc": 10.0}, ttl_s=5.0)
    ({'rpm': 20, 'conc': 8}, 110)
    """
    own = {name: min(n, math.ceil(rates[name] * ttl_s)) if math.isfinite(rates.get(name, math.inf)) else n
           for name, n in ready.items()}
    return own, sum(ready.values()) - sum(own.values())
