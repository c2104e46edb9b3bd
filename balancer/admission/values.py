"""The admission core's values: what production code passes to and gets from it.

Candidates, decisions and settlements; the bucket units and the capacity rules that
both the Lua scripts (``lua/``, via :mod:`balancer.admission.core`) and the reference
model (:mod:`balancer.admission.reference`) follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from balancer.admission.quota import Quota

#: Bucket units per token (and per request): refill per ms == per-minute rate.
UNITS = 60_000
#: The circuit breaker (trip.lua): consecutive transient failures that open a
#: model's circuit, its first pause, and the longest pause a failed probe doubles to.
CIRCUIT_FAILURES, CIRCUIT_BASE_MS, CIRCUIT_MAX_MS = 3, 2_000, 30_000


class NoState(Exception):
    """The live state is missing (Redis lost it); restore it from PostgreSQL."""


@dataclass(frozen=True)
class Candidate:
    """A task asking for admission: its estimated tokens and allowed models (None = any)."""

    estimated_tokens: int
    allowed: tuple[str, ...] | None = None
    avoid: str | None = None  # a model to pass over if another is eligible (retry placement)

    def __post_init__(self) -> None:
        if self.allowed is not None:
            # An empty restriction means "any model", as it does on the wire.
            object.__setattr__(self, "allowed", tuple(self.allowed) or None)


@dataclass(frozen=True)
class Admitted:
    model: str
    admission_id: str
    start_delay_ms: int = 0  # from renew: wait this long before calling (the RPM start gate)


@dataclass(frozen=True)
class NotNow:
    """Nothing can take it now. ``retry_at_ms`` is on the Redis clock; None = no known time (models disabled)."""

    retry_at_ms: int | None
    now_ms: int

    @property
    def wait_ms(self) -> int | None:
        return None if self.retry_at_ms is None else max(0, self.retry_at_ms - self.now_ms)


@dataclass(frozen=True)
class Rejected:
    """It can never be admitted as things stand; ``reason`` says why."""

    reason: str

    @classmethod
    def no_such_model(cls, wanted: str) -> Rejected:
        """No model of ``wanted`` (comma-separated names; empty: any model) exists."""
        return cls(NO_SUCH_MODEL + wanted if wanted else NO_MODELS)

    @property
    def no_model(self) -> bool:
        """Rejected because no model it asked for exists now: removed since the caller looked
        (a dispatch round plans on a view read before it admits), not the task's own fault.

        >>> Rejected.no_such_model("a").no_model, Rejected("estimated 9 tokens > bucket 5").no_model
        (True, False)
        """
        return self.reason.startswith(NO_SUCH_MODEL) or self.reason == NO_MODELS


#: The reasons of a :class:`Rejected` whose models do not exist (the Lua and the reference model's).
NO_SUCH_MODEL = "no such model: "
NO_MODELS = "no models configured"


Decision = Admitted | NotNow | Rejected


@dataclass(frozen=True)
class Settlement:
    """What a finished call tells the core (``None`` = not known).

    ``used_tokens`` is prompt + completion as the provider reported them;
    ``reserved_tokens`` is prompt + max_tokens, what a ``reserve`` provider
    kept; ``remaining_*`` are the provider's ``x-ratelimit-remaining-*``
    headers, which lower the buckets (never raise them).

    >>> Settlement(used_tokens=900, reserved_tokens=1_300).remaining_tokens is None
    True
    """

    used_tokens: int | None = None
    reserved_tokens: int | None = None
    remaining_tokens: int | None = None
    remaining_requests: int | None = None
    #: The provider's ``x-ratelimit-limit-tokens`` / ``-requests``: the limits a learning model adopts (signals.lua, sync_limits).
    limit_tokens: int | None = None
    limit_requests: int | None = None
    #: An answered call's latency and completion tokens: a sample for the model's latency sketch.
    latency_ms: int | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True)
class ReadyTask:
    """A task on a model's ready list: stocked by the dispatcher ahead of a free
    slot, then taken (admitted under ``admission_id``) or dropped.

    ``start_delay_ms`` and ``restock`` are set when
    :meth:`AdmissionCore.finish_and_take` took it as the freed slot's next
    call: the lease is started and both start gates are passed, so the caller
    waits that long and calls, with no renew; ``restock`` says the list now
    holds fewer entries than the model has slots, so the caller asks the
    dispatcher to refill it (above that, a request per call only made the
    dispatcher run after every call: docs/benchmark-history.md, "The hot path").
    """

    task_id: int
    admission_id: str
    model: str
    estimated_tokens: int
    start_delay_ms: int = 0
    restock: bool = False


@dataclass(frozen=True)
class LeaseSeed:
    """An in-flight call known to PostgreSQL, re-seeded into a restored state."""

    admission_id: str
    model: str
    estimated_tokens: int
    remaining_ms: int  # lease time left, placed on the restoring clock (PostgreSQL's and Redis's may differ)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


#: A call reaches the provider up to this long after its admission charged our bucket.
TRANSIT_MS = 250
#: Of the start gate's burst tolerance, up to this much is kept for the last hop's jitter: a
#: run's first calls reach the provider up to 31 ms later than the next ones (a worker's first
#: connection, processes still starting), and at 20 ms a one-second window of two refused the third.
GATE_HOP_MS = 50
#: A provider's x-ratelimit-remaining-* counts reach the scripts (finish.lua, penalize.lua) up to
#: this long after the provider sent them: calls that started since are not in them (unarrived).
SYNC_LAG_MS = 25
#: A model others use too (``external`` > 0, learned from the provider's headers) keeps, beyond a
#: call's estimate, what they use in this long: their use between the count the provider last sent
#: and our call's arrival is as steady as its average only on average.
OUTSIDE_MARGIN_MS = 1_000
#: The outside-use estimate follows what the syncs show with this time constant, whatever their pace.
OUTSIDE_TAU_MS = 2_000

#: Lua lines the script loader puts before the scripts' library (core.LIBRARY): these constants, from this module.
LUA_PRELUDE = "\n".join([
    "-- generated from balancer/admission/values.py",
    f"local UNITS, TRANSIT_MS, GATE_HOP_MS, SYNC_LAG_MS = {UNITS}, {TRANSIT_MS}, {GATE_HOP_MS}, {SYNC_LAG_MS}",
    f"local OUTSIDE_MARGIN_MS, OUTSIDE_TAU_MS = {OUTSIDE_MARGIN_MS}, {OUTSIDE_TAU_MS}",
    "",
])


def gate_shape(limits: Quota) -> tuple[int, int]:
    """The start gate's (interval, burst tolerance) in ms for an RPM limit (limits.lua, gate_shape):
    calls start one per interval, up to ``request_burst`` at once less the last hop's jitter.

    >>> gate_shape(Quota("m", 8, 60_000, max_requests_per_minute=60))
    (1000, 58950)
    """
    interval = ceil_div(60_000, limits.max_requests_per_minute or 0)
    return interval, max(0, (limits.request_burst - 1) * interval - min(ceil_div(interval, 2), GATE_HOP_MS))


def token_cap(quota: Quota) -> int:
    """The token bucket's capacity in units: the burst less the transit allowance.

    While the provider's bucket sits full it wastes refill that ours, charged
    up to ``TRANSIT_MS`` earlier, keeps; a bucket as large as the provider's
    would run ahead of it by that much refill. Never less than half the burst.

    >>> token_cap(Quota("m", 1, 60_000, burst_tokens=10_000)) / UNITS   # 250 ms of 1,000 tokens/s
    9750.0
    """
    burst = quota.burst * UNITS
    return burst - min(quota.max_tokens_per_minute * TRANSIT_MS, burst // 2)


def most_charged(charged: int, estimated: int, quota: Quota) -> int:
    """What a finished call is charged at most (finish.lua): its quota's token bucket,
    or its estimate if larger. A call larger than the bucket could not have been
    admitted; a reply's usage of 3e9 tokens (or a router's ``actual_tokens`` of 1e8)
    otherwise left a debt of hours.

    >>> most_charged(3_000_000_000, 1_200, Quota("m", 1, 90_000)), most_charged(900, 1_200, Quota("m", 1, 90_000))
    (90000, 900)
    """
    return min(charged, max(estimated, quota.burst))


def outside_ceiling(tpm: int) -> int:
    """The most others' use is ever taken to be: 9/10 of ``tpm``, so the bucket refills at a
    tenth of it at least (limits.lua, outside_ceiling).

    >>> outside_ceiling(60_000)
    54000
    """
    return math.floor(tpm * 9 / 10)


def outside_rate(tpm: int, external: int) -> int:
    """The outside use the token bucket allows for: ``external``, at most 9/10 of ``tpm``,
    and none while the estimate is below 0 (limits.lua, outside_rate).

    >>> outside_rate(60_000, 12_000), outside_rate(60_000, 90_000), outside_rate(60_000, -3_000)
    (12000, 54000, 0)
    """
    return max(0, min(external, outside_ceiling(tpm)))


def known_rate(learn: bool, header_tpm: int, external: int) -> bool:
    """Whether a model's token bucket refills at its provider's rate, all of it ours (signals.lua,
    known_rate): its quota is taken as stated (``learn`` off), or the provider stated its token
    limit (``header_tpm``, which the effective TPM never exceeds); and no one else is seen using
    the quota (``external`` <= 0). Only then may a header sync credit the refill since an old count
    was taken: with a quota ten times the provider's, that credit would be ten times too much, and
    another client's use since the count is in no sum of ours.

    >>> known_rate(True, 0, 0), known_rate(True, 90_000, 0), known_rate(False, 0, 0), known_rate(False, 0, 6_000)
    (False, True, True, False)
    """
    return (not learn or header_tpm > 0) and external <= 0


def gap_growth(gap: int, sync_gap: int) -> int:
    """How much a header sync's token gap (our level less what the count explains) grew since the
    last sync left ``sync_gap`` (<= 0): what moves the outside-use estimate (signals.lua, gap_growth).

    A gap that shrinks counts in full: the estimate falls. A gap that grows counts only for its
    part above 0, where our bucket holds more than the provider has left. Below 0 we already hold
    less than the count explains, whoever used the rest, so no call of ours can meet a 429 for it;
    and a gap there moves with each count's age (a provider that counts as it admits a call sends
    counts as old as that call), not with anyone's use. Counted in full, those swings drove the
    estimate to 9/10 of a TPM-bound model's TPM, and its bucket refilled at a tenth of it, nothing
    in flight, while the provider's count stayed near its burst.

    >>> gap_growth(-200, -2_000), gap_growth(300, -2_000), gap_growth(300, 0), gap_growth(-2_500, -1_000)
    (0, 300, 300, -1500)
    """
    if gap < sync_gap:
        return gap - sync_gap
    return max(gap, 0) - max(sync_gap, 0)


def outside_estimate(external: int, tpm: int, growth: int, dt: int, count_full: bool) -> int:
    """The outside-use estimate (tokens per minute) after a header sync (signals.lua,
    outside_estimate). ``growth``: how much the gap between our token level and the
    count (less our calls on their way) grew since the last sync, ``dt`` ms ago: what
    others used beyond ``external`` meanwhile. It moves the estimate by itself over
    ``OUTSIDE_TAU_MS``, or over ``dt`` when the syncs are further apart than that (a
    step never goes past what it saw). A full count (``count_full``: at least our
    bucket's size) cannot show outside use: both buckets at their caps give the same
    gap at every sync, and would hold a wrong estimate for good; so while it lasts the
    estimate falls by at least ``min(dt, OUTSIDE_TAU_MS) / OUTSIDE_TAU_MS`` of itself
    (all of it after 2 s; an outside user is learned again once the buckets run below
    their caps). Kept between -1/10 and 9/10 of ``tpm``: below 0 it is noise to cancel,
    not a use (:func:`outside_rate`).

    >>> outside_estimate(0, 60_000, 200 * UNITS, 250, False)      # 200 tokens in 250 ms, over 2 s
    6000
    >>> outside_estimate(0, 60_000, 2_000 * UNITS, 10_000, False)  # 2,000 in 10 s: 12,000 a minute, not 54,000
    12000
    >>> outside_estimate(12_000, 60_000, 0, 500, True)              # a full count: a quarter of it goes
    9000
    >>> outside_estimate(0, 60_000, -1_000_000 * UNITS, 250, False)
    -6000
    """
    dt = max(0, dt)
    moved = math.floor(growth / max(OUTSIDE_TAU_MS, dt))
    if count_full and external > 0:
        moved = min(moved, -math.floor(external * min(dt, OUTSIDE_TAU_MS) / OUTSIDE_TAU_MS))
    return max(-math.floor(tpm / 10), min(outside_ceiling(tpm), external + moved))


def refilled(quota: Quota, tokens: int, requests: int, refilled_at: int, external: int, now: int,
             tat: int) -> tuple[int, int]:
    """The buckets (units) refilled from ``refilled_at`` to ``now``: tokens at TPM
    less what others use (``external``, at most 9/10 of TPM), up to :func:`token_cap`; requests at
    RPM, up to the request burst and to what the start gate (``tat``) starts within an interval
    (:func:`gate_room`); untouched without an RPM limit.

    The rule ``refill`` in limits.lua applies; the reference model and the live
    view (:meth:`balancer.admission.core.AdmissionCore.live`) both use this function.

    >>> q = Quota("m", 1, 600, max_requests_per_minute=60)   # 10 tokens/s, 1 request/s
    >>> [units / UNITS for units in refilled(q, 0, 0, refilled_at=0, external=0, now=2_000, tat=0)]
    [20.0, 2.0]
    """
    dt = max(0, now - refilled_at)
    tpm = quota.max_tokens_per_minute
    tokens = min(token_cap(quota), tokens + dt * (tpm - outside_rate(tpm, external)))
    if quota.max_requests_per_minute:
        requests = min(quota.request_burst * UNITS, requests + dt * quota.max_requests_per_minute,
                       gate_room(quota, tat, now))
    return tokens, requests


def gate_room(limits: Quota, tat: int, now: int) -> int:
    """Units of requests the start gate (its theoretical arrival time ``tat``) starts within one
    interval of ``now``: the most the request bucket holds (limits.lua, gate_room). Calls the gate
    has booked (started, or waiting there to start) are calls the bucket cannot admit again: after
    a provider's remaining count of 0, the calls admitted before it book the gate one interval
    each, and on learn.toml 36 of them waited at rpm-10's gate, one start a second, to the run's
    end while four models stood idle. Held so, the tasks stay pending for any model.

    >>> rpm60 = Quota("m", 40, 60_000, max_requests_per_minute=60)   # a start a second, 58.95 s of tolerance
    >>> [gate_room(rpm60, tat, 0) / UNITS for tat in (58_950, 59_950, 63_950)]   # next start now; in 1 s; in 5 s
    [2.0, 1.0, -3.0]

    Only for a model with an RPM limit (:func:`refilled` calls it so): the gate has no interval without one.
    """
    _, tolerance = gate_shape(limits)
    return (now + tolerance - tat) * (limits.max_requests_per_minute or 0) + 2 * UNITS


def tokens_needed(quota: Quota, est: int, external: int) -> int:
    """Units a task needs in the bucket: its estimate and, when others use the quota too
    (``external``), their use of ``OUTSIDE_MARGIN_MS``; or a full bucket if larger
    (limits.lua, tokens_needed).

    >>> q = Quota("m", 1, 60_000, burst_tokens=10_000)
    >>> [tokens_needed(q, 500, external) / UNITS for external in (0, 12_000)]   # 200 tokens a second others use
    [500.0, 700.0]
    >>> tokens_needed(q, 9_800, 12_000) == token_cap(q)
    True
    """
    margin = outside_rate(quota.max_tokens_per_minute, external) * OUTSIDE_MARGIN_MS
    return min(est * UNITS + margin, token_cap(quota))


def rejection_reason(estimated: int, largest_burst: int) -> str:
    return (
        f"needs {estimated} tokens, more than the largest burst_tokens "
        f"({largest_burst}) of its allowed models"
    )
