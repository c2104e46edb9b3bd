"""The router's wait rules and its parallelism advice (seed design, iteration 2, C and D).

Pure: no I/O, no clock of its own, so each rule is tested on hand-made cases.

**Waits.** A caller told to wait sleeps ``wait_for_ms`` and asks again. If
every caller got the same number they would all come back at once (a
stampede), so the admission core's earliest-capacity time (at most 1 s) is jittered by
±10 %, then rounded *up* to the next 100 ms tick (callers wake when capacity
exists, not just before it), and never less than 50 ms:

>>> import random
>>> wait_for_ms(230, random.Random(1))   # 207..253 ms, rounded up to the tick
300
>>> wait_for_ms(0, random.Random(1))     # capacity is there now: the floor
50

**Advice.** Over the last 60 s of ``/schedule`` outcomes, the backpressure
score mixes how long callers were told to wait (p95, normalized between
25 ms and 1 s) with how often they were not admitted; the suggested
parallelism adds to what is in flight the share of the free slots that the
score leaves open, within 4 and the total of the caps.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

from balancer.estimates.stats import percentile

#: Waits are aligned to this tick (the seed's TOKEN_REFILL_INTERVAL_MS).
TICK_MS = 100
#: No wait is shorter than this.
MIN_WAIT_MS = 50
#: ±this share of jitter around the earliest-capacity time.
JITTER = 0.10
#: The wait when no time is known (every allowed model is disabled).
UNKNOWN_WAIT_MS = 1000
#: The longest base wait. The core's earliest-capacity time is exact for
#: tokens and requests, but for a model at its cap it is the earliest lease
#: *deadline*: an upper bound (a pipeline lease is 300 s, its call ends long
#: before). So a caller asks again within a second, like the seed's short
#: back-off for a full model.
MAX_BASE_WAIT_MS = 1000
#: The advice window, seconds.
WINDOW_S = 60.0
#: The p95 wait is normalized between these (ms).
WAIT_LOW_MS, WAIT_HIGH_MS = 25.0, 1000.0
#: The suggested parallelism is never below this (nor above the total of the caps).
MIN_PARALLELISM = 4


def ceil_to_tick(ms: float, tick_ms: int = TICK_MS) -> int:
    """Round up to the next tick boundary.

    >>> [ceil_to_tick(x) for x in (0, 1, 100, 100.5, 250)]
    [0, 100, 100, 200, 300]
    """
    return int(math.ceil(ms / tick_ms - 1e-9)) * tick_ms


def wait_for_ms(earliest_ms: int | None, rng: random.Random) -> int:
    """The wait to return for an earliest-capacity time ``earliest_ms`` (None: unknown).

    At most ``MAX_BASE_WAIT_MS`` before the jitter; then jitter ±10 %, round up to the tick, then the floor, exactly as the seed's
    ``max(50, ceil_to_tick(base + jitter))``.

    >>> rng = random.Random(7)
    >>> sorted({wait_for_ms(1000, rng) for _ in range(200)})
    [1000, 1100]
    >>> wait_for_ms(None, rng), wait_for_ms(300_000, rng) in (1000, 1100)
    (1000, True)
    """
    if earliest_ms is None:
        return UNKNOWN_WAIT_MS
    jittered = min(earliest_ms, MAX_BASE_WAIT_MS) * (1 + rng.uniform(-JITTER, JITTER))
    return max(MIN_WAIT_MS, ceil_to_tick(jittered))


def normalize(value: float, low: float, high: float) -> float:
    """``value`` mapped to 0..1 between ``low`` and ``high``, clamped.

    >>> normalize(10, 25, 1000), normalize(512.5, 25, 1000), normalize(5000, 25, 1000)
    (0.0, 0.5, 1.0)
    """
    return min(1.0, max(0.0, (value - low) / (high - low)))


@dataclass(frozen=True)
class Advice:
    backpressure_score: float
    suggested_parallelism: int


def advise(waits_ms: list[int], schedules: int, admits: int, in_flight: int, total_cap: int) -> Advice:
    """The seed's formula over one window.

    ``waits_ms``: the waits returned in the window; ``schedules`` and
    ``admits``: the ``/schedule`` calls and how many were admitted. With no
    calls in the window the admit rate counts as 1 (no pressure seen).

    >>> advise([], 0, 0, in_flight=0, total_cap=40)
    Advice(backpressure_score=0.0, suggested_parallelism=40)
    >>> advise([1000] * 10, 20, 10, in_flight=30, total_cap=40)   # half refused, long waits
    Advice(backpressure_score=0.75, suggested_parallelism=32)
    >>> advise([2000] * 5, 5, 0, in_flight=0, total_cap=2)        # the floor is capped by the caps
    Advice(backpressure_score=1.0, suggested_parallelism=2)
    """
    admit_rate = admits / schedules if schedules else 1.0
    score = 0.5 * normalize(percentile(waits_ms, 95) or 0.0, WAIT_LOW_MS, WAIT_HIGH_MS) + 0.5 * (1 - admit_rate)
    score = min(1.0, max(0.0, score))
    headroom = max(0, total_cap - in_flight)
    suggested = in_flight + round(headroom * (1 - score))
    suggested = min(max(suggested, MIN_PARALLELISM), total_cap) if total_cap > 0 else 0
    return Advice(round(score, 4), suggested)


class OutcomeWindow:
    """The last ``WINDOW_S`` seconds of ``/schedule`` outcomes, with the caller's clock.

    >>> w = OutcomeWindow()
    >>> w.admitted(0.0); w.waited(1.0, 300); w.waited(61.5, 100)
    >>> w.snapshot(61.5)     # the first two fell out of the window
    ([100], 1, 0)
    """

    def __init__(self, window_s: float = WINDOW_S, max_events: int = 200_000) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque(maxlen=max_events)  # (time, wait ms or -1 for an admit)

    def admitted(self, now: float) -> None:
        self._events.append((now, -1))

    def waited(self, now: float, wait_ms: int) -> None:
        self._events.append((now, wait_ms))

    def snapshot(self, now: float) -> tuple[list[int], int, int]:
        """(waits in ms, schedule calls, admits) of the window ending at ``now``."""
        events = self._events
        while events and events[0][0] < now - self.window_s:
            events.popleft()
        waits = [w for _, w in events if w >= 0]
        return waits, len(events), len(events) - len(waits)
