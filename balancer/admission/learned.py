"""Limits that learn: a model's effective limits from its quota and what it learned.

The rule the scripts apply (limits.lua, ``eff_tpm`` ... ``eff_rburst``), shared by
the reference model and the live view. With ``learn`` on, the provider's
``x-ratelimit-limit-*`` headers cap the quota's limits (and give an RPM to a
quota that leaves it unset), and what 429s taught (``ltpm``, ``lrpm``,
``lcap``) lowers them further; bucket sizes scale with their rates. 0 in any
learned field means nothing learned.

>>> q = Quota("m", 10, 60_000, max_requests_per_minute=600)
>>> e = effective(q, Learned(lrpm=60, htpm=6_000))
>>> e.max_tokens_per_minute, e.burst, e.max_requests_per_minute, e.request_burst, e.max_concurrent_requests
(6000, 6000, 60, 60, 10)
>>> reason(q, Learned(lrpm=60, lowered_at=1_700_000_000_000))
'requests lowered by 429s at 22:13 UTC, recovering'
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime

from balancer.admission.quota import Quota
from balancer.admission.shown import FIRST_BUCKETS, RECENT_STEP_MS, RecentCount

#: A clean window (no 429 lowered a limit) raises each learned limit that bound
#: through it one step (:func:`relaxed`); a raise that draws a 429 within its
#: window doubles the window, up to the max.
CLEAN_MS, MAX_WINDOW_MS = 10_000, 320_000

#: A raise that takes a learned limit to the level its last 429 lowered it from
#: (its peak: the limit then, or the rate our calls showed if lower), or past it,
#: waits this many windows: back toward the level the provider refused at one step
#: a window, at and past it slowly (TCP CUBIC's plateau), so a limit the provider
#: enforces is probed rarely, not every window.
PEAK_WINDOWS = 4

#: Slow start (:func:`ramp_cap`): a new or changed quota's concurrency opens
#: RAMP_START slots at first and doubles every RAMP_MS from its first call's
#: start, one slot at a time within each step. A provider refuses a call over
#: its real limits as it arrives (tens of ms), so a slot that drew no 429 was
#: accepted, and the first 429 ends the ramp before the next slots open.
RAMP_START, RAMP_MS = 2, 250

#: Lua lines the script loader puts before the scripts' library (core.LIBRARY): these constants, from here and shown.py.
LUA_PRELUDE = "\n".join([
    "-- generated from balancer/admission/learned.py and shown.py",
    f"local CLEAN_MS, MAX_WINDOW_MS, PEAK_WINDOWS = {CLEAN_MS}, {MAX_WINDOW_MS}, {PEAK_WINDOWS}",
    f"local RAMP_START, RAMP_MS = {RAMP_START}, {RAMP_MS}",
    f"local FIRST_BUCKETS, RECENT_STEP_MS = {FIRST_BUCKETS}, {RECENT_STEP_MS}",
    "",
])


@dataclass
class Learned:
    """What a model learned of its provider's real limits (the hash's fields of the same names)."""

    ltpm: int = 0
    lrpm: int = 0
    lcap: int = 0
    ptpm: int = 0
    prpm: int = 0
    pcap: int = 0
    htpm: int = 0
    hrpm: int = 0
    lowered_at: int = 0
    raised_at: int = 0
    window: int = 0
    first_at: int = 0
    first_calls: int = 0
    first_tokens: int = 0
    recent_at: int = 0
    recent_first_at: int = 0
    recent_calls: int = 0
    recent_tokens: int = 0
    before_first_at: int = 0
    before_calls: int = 0
    before_tokens: int = 0
    ramp_from: int = 0
    ramp_at: int = 0
    served: int = 0
    served_at: int = 0
    bound_tpm: int = 0
    bound_rpm: int = 0
    bound_cap: int = 0
    ctpm: int = 0
    crpm: int = 0

    @classmethod
    def from_fields(cls, m: dict[str, int]) -> Learned:
        return cls(**{f.name: m.get(f.name, 0) for f in fields(cls)})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def recent_count(self) -> RecentCount:
        """The recent window's count (:data:`~balancer.admission.shown.RecentCount`)."""
        return (self.recent_at, self.recent_first_at, self.recent_calls, self.recent_tokens,
                self.before_first_at, self.before_calls, self.before_tokens)

    def set_recent_count(self, count: RecentCount) -> None:
        (self.recent_at, self.recent_first_at, self.recent_calls, self.recent_tokens,
         self.before_first_at, self.before_calls, self.before_tokens) = count


def lower_of(limit: int, other: int) -> int:
    """The lower of two limits, 0 meaning none."""
    return other if other > 0 and (limit == 0 or other < limit) else limit


def believed(header: int, held: int, candidate: int, confirmed: bool) -> bool:
    """Whether a limit header that differs from the one adopted is believed now
    (signals.lua, believed): one that is not far below the limit the model is held
    to (``held``, 0: none), at least half of it, is; one far below it is not until
    it is confirmed, by a 429 that carries it (``confirmed``) or by a second reply
    that states it again (``candidate``: the one a reply stated last, not believed).
    One reply's ``x-ratelimit-limit-tokens: 1`` held a model at 0 calls in 30 s.

    >>> believed(45_000, 90_000, 0, False), believed(1, 90_000, 0, False), believed(1, 90_000, 1, False)
    (True, False, True)
    >>> believed(1, 90_000, 0, True), believed(120, 0, 0, False)     # a 429; no RPM held: any is far below
    (True, False)
    """
    return confirmed or header == candidate or (held > 0 and header * 2 >= held)


def effective(quota: Quota, learned: Learned) -> Quota:
    """The limits the model is held to now: ``quota`` itself if it does not learn or learned nothing."""
    if not quota.learn:
        return quota
    tpm, rpm = quota.max_tokens_per_minute, quota.max_requests_per_minute or 0
    etpm = lower_of(lower_of(tpm, learned.htpm), learned.ltpm)
    erpm = lower_of(lower_of(rpm, learned.hrpm), learned.lrpm)
    ecap = lower_of(quota.max_concurrent_requests, learned.lcap)
    if (etpm, erpm, ecap) == (tpm, rpm, quota.max_concurrent_requests):
        return quota
    burst = quota.burst if etpm == tpm else max(1, math.floor(float(quota.burst) * etpm / tpm))
    if erpm == rpm:
        rburst = quota.request_burst
    elif rpm == 0:
        rburst = erpm  # discovered: one minute of it
    else:
        rburst = max(1, math.floor(float(quota.request_burst) * erpm / rpm))
    return quota.replace(max_tokens_per_minute=etpm, burst_tokens=burst, max_requests_per_minute=erpm or None,
                         burst_requests=rburst or None, max_concurrent_requests=ecap)


def ramp_cap(cap: int, learned: Learned, now: int) -> int:
    """The concurrency cap ``cap`` while the model starts slowly (limits.lua, ramp_cap).

    A learning model's new or changed quota has not been shown to hold: a quota
    of 40 slots on a provider that takes 4 would send 40 calls before the first
    429 comes back. So it opens ``max(RAMP_START, ramp_from)`` slots (``ramp_from``:
    the calls live when the quota was set or restored, whose slots stay open),
    doubling every RAMP_MS from ``ramp_at`` (the first call's start under it), up to
    ``cap``. Within a step the new slots open one at a time, evenly spread (a step
    from 4 to 8 opens one every 62 ms), so when calls are admitted as slots open the
    provider's first 429 comes back and ends the ramp before the next slot opens,
    rather than after a step's four calls have all reached it (conc-10 drew three
    429s in its first second; a dispatcher round that comes late still finds several
    slots open, and admits them together). A 429 that lowers a limit (``lowered_at``)
    ends it: the learned limits take over.

    >>> k = Learned(ramp_at=1_000)
    >>> [ramp_cap(40, k, now) for now in (1_000, 1_124, 1_125, 1_250, 1_500, 1_750, 1_875, 2_000)]
    [2, 2, 3, 4, 8, 16, 24, 32]
    >>> ramp_cap(40, Learned(), 5_000), ramp_cap(40, Learned(ramp_at=1, ramp_from=12), 1), ramp_cap(40, k, 9_000)
    (2, 12, 40)
    >>> ramp_cap(40, Learned(ramp_at=1_000, lowered_at=1_100), 1_100), ramp_cap(40, k, 700)  # a clock behind ramp_at
    (40, 2)
    """
    if learned.lowered_at:
        return cap
    start = max(RAMP_START, learned.ramp_from)
    elapsed = 0 if learned.ramp_at == 0 else max(0, now - learned.ramp_at)  # a clock behind ramp_at: step 0
    steps, into = divmod(elapsed, RAMP_MS)
    if steps >= 16 or start << steps >= cap:
        return cap
    base = start << steps
    return int(min(cap, base + base * into // RAMP_MS))


def ramp_start(learned: Learned, live: int, now: int) -> int:
    """The slots a quota set or restored opens at once (``ramp_from``; limits.lua, ramp_quota):
    the ``live`` calls in flight, whose slots stay open, or as many as the provider served at
    once within CLEAN_MS (:func:`note_served`), if more. Those are not in doubt: a right quota
    changed in its tokens, or raised, ramps only past what was just served, even between two
    calls. Evidence older than CLEAN_MS does not count: a provider may have changed since.

    >>> k = Learned(served=16, served_at=1_000)
    >>> ramp_start(k, 3, 2_000), ramp_start(k, 3, 1_000 + CLEAN_MS), ramp_start(k, 20, 2_000), ramp_start(Learned(), 0, 5)
    (16, 3, 20, 0)
    """
    return max(live, learned.served) if now - learned.served_at < CLEAN_MS else live


def slots_now(quota: Quota, learned: Learned, now: int) -> int:
    """The concurrency cap at ``now``: the effective one, or slow start's while it ramps (:func:`ramp_cap`).

    >>> q = Quota("m", 40, 60_000)
    >>> slots_now(q, Learned(ramp_at=1_000), 1_500), slots_now(q.replace(slow_start=False), Learned(), 0)
    (8, 40)
    """
    cap = effective(quota, learned).max_concurrent_requests
    return ramp_cap(cap, learned, now) if quota.learn and quota.slow_start else cap


def ramp_wait_ms(learned: Learned, now: int) -> int:
    """Ms until slow start opens its next slot (limits.lua, ramp_wait); RAMP_MS before ``ramp_at``.

    >>> k = Learned(ramp_at=1_000)
    >>> ramp_wait_ms(k, 1_000), ramp_wait_ms(k, 1_124), ramp_wait_ms(k, 1_600), ramp_wait_ms(Learned(), 1_600), ramp_wait_ms(k, 900)
    (125, 1, 25, 250, 125)
    """
    if learned.ramp_at == 0:
        return RAMP_MS
    steps, into = divmod(max(0, now - learned.ramp_at), RAMP_MS)
    base = max(RAMP_START, learned.ramp_from) << min(steps, 16)
    opened = base * into // RAMP_MS
    return min(RAMP_MS, -(-(opened + 1) * RAMP_MS // base)) - into


def ramp_opens_ms(quota: Quota, learned: Learned, now: int) -> int | None:
    """Ms until slow start opens a slot it holds closed now, with no call ending (None: it
    holds none, or none opens before a call starts or ends).

    Before its clock starts (``ramp_at`` 0), a new quota's first slot opens that long after
    its first call starts, and the calls a dispatch admitted start within ms of it: the wait
    as if one started now. A quota set while calls ran (``ramp_from``) opens nothing until
    one of them ends, and that end asks for a round itself.

    >>> q = Quota("m", 40, 60_000)
    >>> ramp_opens_ms(q, Learned(), 5_000), ramp_opens_ms(q, Learned(ramp_from=5), 5_000), ramp_opens_ms(q, Learned(ramp_at=1_000), 1_100)
    (125, None, 25)
    >>> ramp_opens_ms(q, Learned(ramp_at=1_000), 9_000), ramp_opens_ms(q.replace(slow_start=False), Learned(), 0)
    (None, None)
    """
    if slots_now(quota, learned, now) >= effective(quota, learned).max_concurrent_requests:
        return None
    if learned.ramp_at == 0:
        return None if learned.ramp_from else ramp_wait_ms(replace(learned, ramp_at=now), now)
    return ramp_wait_ms(learned, now)


def note_served(learned: Learned, now: int, sent: int) -> None:
    """An answered call of a learning model ends with ``sent`` calls started and live in
    flight (itself included): the provider served that many at once, at most (a call it
    refused may not have come back yet). The most it served at once is kept while it
    is seen again within CLEAN_MS (signals.lua, note_served).

    >>> k = Learned()
    >>> note_served(k, 1_000, 4); note_served(k, 5_000, 2); (k.served, k.served_at)
    (4, 1000)
    >>> note_served(k, 11_000, 2); (k.served, k.served_at)    # 4 at once not seen again for CLEAN_MS
    (2, 11000)
    """
    if sent >= learned.served or now - learned.served_at >= CLEAN_MS:
        learned.served, learned.served_at = sent, now


def served_more(learned: Learned, now: int, sent: int) -> bool:
    """True if the provider lately served more calls at once than the ``sent`` that
    had started when a 429 came back (:func:`note_served`): that 429 was not for
    concurrency (signals.lua, served_more). Only a 429 whose headers do not tell its
    kind asks: a token limit without headers otherwise reads as concurrency, the
    cap the slots fill by design (slow start's, or a lowered one), and its 429s
    cut the cap to 1 (learn.toml's tpm-10-silent ran at 0.73 of its real TPM).

    >>> served_more(Learned(served=4, served_at=1_000), 5_000, 3), served_more(Learned(served=4, served_at=1_000), 5_000, 4)
    (True, False)
    >>> served_more(Learned(served=4, served_at=1_000), 11_000, 3)   # too long ago to tell
    False
    """
    return sent < learned.served and now - learned.served_at < CLEAN_MS


def step_of(peak: int) -> int:
    """One raise of a learned limit last lowered from ``peak``: 1/20 of it, at least 1 (limits.lua, step_of).
    A raise that draws a 429 is undone (:func:`undone`: one step, or two for a rate)."""
    return max(1, -(-peak // 20))


def undone(level: int, peak: int, kind: str) -> int:
    """A learned limit at ``level`` after a raise of it drew a 429 (signals.lua, undone):
    concurrency goes one step down (:func:`step_of` its ``peak``), since a provider
    refuses a call over its cap at once, so the level before the raise held. Tokens
    and requests go two: a provider's bucket hides a small overshoot for longer than
    a window (on learn.toml, tpm-10-silent's level before a failed raise was 8 % over
    its real TPM, drew the next 429 8 s later, and that one cut it to 7/10).

    >>> undone(34_416, 38_240, "tokens"), undone(5, 5, "concurrency"), undone(2, 40, "requests")
    (30592, 4, 1)
    """
    return max(1, level - (1 if kind == "concurrency" else 2) * step_of(peak))


def note_bound(learned: Learned, now: int, slots: bool, tokens: bool, requests: bool) -> None:
    """A call found the model without a free slot, the tokens or a request (False), or
    a call ended on a full model (its slot bound): each such limit binds now, and
    ``bound_*`` keeps the first time it did since the last raise or lowering (at or after it)
    (limits.lua, note_bound). A clean window raises only a limit that has bound for a
    window (:func:`relaxed`).

    >>> k = Learned(lowered_at=1_000)
    >>> note_bound(k, 2_000, True, False, True); note_bound(k, 3_000, True, False, True); k.bound_tpm
    2000
    """
    since = max(learned.raised_at, learned.lowered_at)
    if not slots and learned.bound_cap < since:
        learned.bound_cap = now
    if not tokens and learned.bound_tpm < since:
        learned.bound_tpm = now
    if not requests and learned.bound_rpm < since:
        learned.bound_rpm = now


def relaxed(quota: Quota, learned: Learned, now: int) -> Learned:
    """``learned`` after a clean window (limits.lua, relax): every learned limit that
    has bound for a window since the last raise or lowering (first bound, ``bound_*``,
    at least CLEAN_MS, or the doubled ``window``, ago) goes one step up, 1/20 of the
    level its last 429 lowered it from (its peak), and ``raised_at`` is now; a step to
    the peak or past it waits PEAK_WINDOWS windows. At the limit without learning it
    is forgotten (0). A limit the traffic did not reach is not
    raised, and while none is, nothing changes: a clean window says nothing of a
    limit nobody reached (learn.toml's tpm-10-silent, held by its cap, had its TPM
    raised to 1.2 times its provider's, then drew two 429s and a cut to 7/10 once
    its cap let its tokens bind).

    >>> q = Quota("m", 10, 60_000, max_requests_per_minute=600)
    >>> relaxed(q, Learned(lrpm=294, prpm=420, bound_rpm=5_000), now=20_000).lrpm   # + 420 / 20
    315
    >>> relaxed(q, Learned(lrpm=294, prpm=420, bound_rpm=15_000), now=20_000).lrpm  # bound for 5 s only
    294
    >>> relaxed(q, Learned(lrpm=294, prpm=420), now=20_000).raised_at               # never waited for a request
    0
    >>> [relaxed(q, Learned(lrpm=399, prpm=420, bound_rpm=1), now=t).lrpm for t in (30_000, 40_001)]   # to the peak
    [399, 420]
    """
    k = learned
    if not quota.learn or not (k.ltpm or k.lrpm or k.lcap):
        return k
    since, w = max(k.raised_at, k.lowered_at), k.window or CLEAN_MS
    if now - since < w:
        return k

    def raised(level: int, peak: int, ceiling: int, bound_at: int) -> int:
        wait = w * PEAK_WINDOWS if level + step_of(peak) >= peak else w
        if level == 0 or bound_at == 0 or bound_at < since or now - bound_at < wait:
            return level
        level += step_of(peak)
        return 0 if ceiling == 0 or level >= ceiling else level

    levels = (raised(k.ltpm, k.ptpm, lower_of(quota.max_tokens_per_minute, k.htpm), k.bound_tpm),
              raised(k.lrpm, k.prpm, lower_of(quota.max_requests_per_minute or 0, k.hrpm), k.bound_rpm),
              raised(k.lcap, k.pcap, quota.max_concurrent_requests, k.bound_cap))
    if levels == (k.ltpm, k.lrpm, k.lcap):
        return k
    return replace(k, ltpm=levels[0], lrpm=levels[1], lcap=levels[2], raised_at=now)


def reason(quota: Quota, learned: Learned) -> str:
    """Why the effective limits differ from the quota ('' if they do not), for people."""
    if not quota.learn:
        return ""
    parts = []
    lowered = [kind for kind, value in (("tokens", learned.ltpm), ("requests", learned.lrpm),
                                         ("concurrency", learned.lcap)) if value]
    if lowered:
        at = datetime.fromtimestamp(learned.lowered_at / 1000, UTC).strftime("%H:%M")
        parts.append(f"{', '.join(lowered)} lowered by 429s at {at} UTC, recovering")
    if learned.htpm and learned.htpm < quota.max_tokens_per_minute:
        parts.append(f"provider says {learned.htpm:,} TPM")
    rpm = quota.max_requests_per_minute or 0
    if learned.hrpm and (rpm == 0 or learned.hrpm < rpm):
        parts.append(f"provider says {learned.hrpm:,} RPM" + ("" if rpm else " (discovered)"))
    return "; ".join(parts)
