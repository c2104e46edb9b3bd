"""The provider's rate, as our own call starts show it when its 429 comes.

A provider that sends no limit header says what it allows only by refusing. When a 429
for tokens or requests comes, the calls we started before it tell how fast the
provider's bucket was being emptied, and so bound its rate, in two ways:

- **The first bucket** (:func:`first_bucket_rate`): for FIRST_BUCKETS bucket times
  after a quota's first call, a provider bucket of the quota's shape was full at that
  call and has been drained since, so what our calls took before it ran out gives its rate.
- **The recent window** (:func:`recent_rate`): later, its bucket may have refilled
  while we sent little, but whatever it held, our calls over the last bucket time or
  less (the refused one included) emptied it and its refill: our rate over the last
  second or two, from the first of those calls, is at least its rate. A 429 lowers to 7/10 of the lower of that rate
  and the level (:func:`lowered`), so a provider ten times stricter than the quota,
  met past the first bucket, costs a 429 or two, not the seven that 7/10 of the
  level at a time takes from 10x to 1x.

The counts are of calls started (renew: as they leave for the provider), and their
estimated tokens, kept in the model's hash (``first_*``, ``recent_*``, ``before_*``). The recent
window's reading also sets the level a lowered limit's raises step from (its peak), so it errs
high where it is unsure: over a short span, from the span's first call.
"""

from __future__ import annotations

import math

from balancer.admission.quota import Quota

#: A 429 shows the provider's rate from the first bucket (:func:`first_bucket_rate`) for this
#: many bucket times after the first call: a token limit that sends no header may draw its
#: first 429 before any call is answered, which reads as concurrency.
FIRST_BUCKETS = 2

#: The recent count's step (:func:`recent_step_ms`): our rate over one or two of them (1 to 2 s)
#: bounds the provider's only if its bucket is no shorter, and some enforce a per-minute limit
#: over a few seconds (Azure OpenAI: 1 to 10 s); a short span costs only a looser bound.
RECENT_STEP_MS = 1_000


def first_bucket_rate(rate: int, size: int, n: int, elapsed_ms: int) -> int:
    """The provider's rate a 429 early in the run shows; 0 past FIRST_BUCKETS bucket times (shown.lua, first_bucket_rate).

    From a model's first call under its quota until FIRST_BUCKETS bucket times
    (``size`` / ``rate`` each) have passed, a provider whose bucket has the
    quota's shape, full at the first call and drained since (no refill wasted),
    ran out once our calls had taken ``n`` (tokens or calls) in ``elapsed_ms``:
    its rate is about ``rate * n / (size + rate * t)``. A ``t`` below 0 (a clock
    behind the first call's, as after a failover to a Redis whose clock is behind)
    reads as 0: the bucket time our calls took is unknown, so they took it at once,
    the highest rate they can show (the rate could drop to 1 otherwise).

    >>> first_bucket_rate(600, 600, 63, 3_000)          # one-minute burst: 63 calls in 3 s -> 60 RPM
    60
    >>> first_bucket_rate(300_000, 30_000, 6_950, 7_900)  # past one 6-s bucket: ~30,000 TPM
    30000
    >>> first_bucket_rate(300_000, 30_000, 3_000, 0), first_bucket_rate(600, 600, 63, 120_000), first_bucket_rate(600, 600, 0, 0)
    (30000, 0, 0)
    >>> first_bucket_rate(600, 600, 60, -80_000), first_bucket_rate(600, 600, 60, -60_000)   # a clock behind: as at 0
    (60, 60)
    """
    elapsed_ms = max(0, elapsed_ms)
    if rate <= 0 or n <= 0 or elapsed_ms * rate >= FIRST_BUCKETS * size * 60_000:
        return 0
    return max(1, math.floor(float(rate) * n * 60_000 / (size * 60_000 + rate * elapsed_ms)))


def recent_step_ms(quota: Quota) -> int:
    """The recent count's step (shown.lua, recent_step): RECENT_STEP_MS, or half the
    quota's shorter bucket time (burst / rate, tokens and requests) if less, at least
    1 ms. The count spans one or two steps.

    >>> recent_step_ms(Quota("m", 4, 60_000)), recent_step_ms(Quota("m", 4, 6_000_000, burst_tokens=10_000))
    (1000, 50)
    """
    times = [RECENT_STEP_MS * 2, math.floor(float(quota.burst) * 60_000 / quota.max_tokens_per_minute)]
    if quota.max_requests_per_minute:
        times.append(math.floor(float(quota.request_burst) * 60_000 / quota.max_requests_per_minute))
    return max(1, min(times) // 2)


def steps_since(at: int, step: int, now: int) -> int:
    """Whole steps of ``step`` ms from the current step's start ``at`` to ``now`` (0: none
    counted, or a clock behind ``at``) (shown.lua, steps_since).

    >>> steps_since(1_000, 3_000, 3_999), steps_since(1_000, 3_000, 7_000), steps_since(0, 3_000, 9_000)
    (0, 2, 0)
    """
    return 0 if at == 0 else max(0, now - at) // step


#: The recent count as the model's hash keeps it: (recent_at, recent_first_at, recent_calls, recent_tokens,
#: before_first_at, before_calls, before_tokens): the current step's start, then for it and the step before
#: it, the first call's start in it and the calls and tokens started in it.
RecentCount = tuple[int, int, int, int, int, int, int]


def counted(count: RecentCount, step: int, now: int, est: int) -> RecentCount:
    """``count`` with one more call of ``est`` tokens started at ``now`` (shown.lua, count_recent):
    one step on, the current step's count becomes the one before it; two, both start again.

    >>> counted((0, 0, 0, 0, 0, 0, 0), 1_000, 5_000, 100)
    (5000, 5000, 1, 100, 0, 0, 0)
    >>> counted((5_000, 5_200, 4, 400, 4_100, 9, 900), 1_000, 6_500, 100)
    (6000, 6500, 1, 100, 5200, 4, 400)
    >>> counted((5_000, 5_200, 4, 400, 4_100, 9, 900), 1_000, 7_000, 100)
    (7000, 7000, 1, 100, 0, 0, 0)
    """
    at, first, calls, tokens, before_first, before_calls, before_tokens = count
    steps = steps_since(at, step, now)
    if steps:
        before_first, before_calls, before_tokens = (first, calls, tokens) if steps == 1 else (0, 0, 0)
        at, first, calls, tokens = at + steps * step, 0, 0, 0
    return at or now, first or now, calls + 1, tokens + est, before_first, before_calls, before_tokens


def recent_rate(count: RecentCount, step: int, now: int, tokens: bool) -> int:
    """Our rate per minute, of calls (or ``tokens``), over the count's span (shown.lua, recent_rate):
    the current step and the one before it, one step on only the current one, two steps on
    nothing (0: nothing to say); from the span's first call's start, not its start: a burst
    after a quiet spell reads as the rate it was sent at, not spread over the quiet part.

    >>> c = (10_000, 10_400, 30, 3_000, 9_000, 20, 2_000)
    >>> recent_rate(c, 1_000, 10_600, False), recent_rate(c, 1_000, 10_600, True)   # 50 calls from 9.0 to 10.6 s
    (1875, 187500)
    >>> recent_rate(c, 1_000, 11_400, False), recent_rate(c, 1_000, 12_000, False)  # 30 from 10.4 to 11.4 s; none
    (1800, 0)
    >>> recent_rate((10_000, 10_950, 11, 0, 0, 0, 0), 1_000, 10_950, False)          # a burst after a quiet second
    660000
    """
    at, first, calls, used, before_first, before_calls, before_used = count
    steps = steps_since(at, step, now)
    if at == 0 or steps > 1:
        return 0
    n, since = (calls, used)[tokens], first
    if steps == 0 and before_calls:
        n, since = n + (before_calls, before_used)[tokens], before_first
    return math.floor(float(n) * 60_000 / max(1, now - since)) if n > 0 else 0


def lowered(level: int, shown: int, recent: int = 0) -> tuple[int, int] | None:
    """What a 429 that starts a pause does to a rate at ``level`` (shown.lua, lowered):
    (the level remembered for the raises' step, the level it is lowered to), or None to
    leave it. Within FIRST_BUCKETS bucket times (``shown`` > 0: :func:`first_bucket_rate`),
    7/10 of the rate shown, once: a 429 that would not take it below ``level`` leaves it.
    Past them, 7/10 of the lower of ``level`` and our ``recent`` rate (:func:`recent_rate`).

    >>> lowered(600, 0), lowered(600, 60), lowered(42, 61), lowered(42, 50)
    ((600, 420), (60, 42), None, (42, 35))
    >>> lowered(6_000, 0, 840), lowered(600, 0, 900)   # past the first bucket: our rate, if lower
    ((840, 588), (600, 420))
    """
    if shown <= 0:
        at = recent if 0 < recent < level else level
        return at, max(1, math.floor(at * 7 / 10))
    to = max(1, math.floor(shown * 7 / 10))
    return (min(shown, level), to) if to < level else None


def spent_early(level: int, shown: int) -> int | None:
    """What requests spent in the first bucket do to an RPM at ``level``, before any
    429 (signals.lua, learn_from_spent): the RPM it is lowered to, which is also the
    level its raises step from, or None to leave it. A provider that states no
    request limit and has none left for our calls (those on their way included)
    within FIRST_BUCKETS bucket times shows its rate (``shown``: :func:`first_bucket_rate`);
    one below 9/10 of ``level`` becomes the RPM, so that 429 never comes. To the rate
    shown, not 7/10 of it as after a 429: none came, and the remaining counts such a
    provider sends keep the buckets from overdrawing it. A quota that is right spends
    its burst at about its own rate: left as it is.

    >>> spent_early(600, 56), spent_early(600, 580), spent_early(600, 0)
    (56, None, None)
    """
    return shown if 0 < shown and shown * 10 < level * 9 else None
