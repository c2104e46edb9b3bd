"""The admission core's values: what production code passes to and gets from it.

Candidates, decisions and settlements; the bucket units and the capacity rules that
both the Lua scripts (``lua/``, via :mod:`balancer.admission.core`) and the reference
model (:mod:`balancer.admission.reference`) follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from balancer.domain.quota import Quota

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
    dispatcher run after every call: docs/benchmarks.md, the hot path, round 5).
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
#: Of the start gate's burst tolerance, up to this much is kept for the last hop's jitter.
GATE_HOP_MS = 20
#: A provider's x-ratelimit-remaining-* counts reach the scripts (finish.lua, penalize.lua) up to
#: this long after the provider sent them: calls that started since are not in them (unarrived).
SYNC_LAG_MS = 25

#: Lua lines the script loader puts before the scripts' library (core.LIBRARY): these constants, from this module.
LUA_PRELUDE = "\n".join([
    "-- generated from balancer/admission/values.py",
    f"local UNITS, TRANSIT_MS, GATE_HOP_MS, SYNC_LAG_MS = {UNITS}, {TRANSIT_MS}, {GATE_HOP_MS}, {SYNC_LAG_MS}",
    "",
])


def gate_shape(limits: Quota) -> tuple[int, int]:
    """The start gate's (interval, burst tolerance) in ms for an RPM limit (limits.lua, gate_shape):
    calls start one per interval, up to ``request_burst`` at once less the last hop's jitter.

    >>> gate_shape(Quota("m", 8, 60_000, max_requests_per_minute=60))
    (1000, 58980)
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


def refilled(quota: Quota, tokens: int, requests: int, refilled_at: int, external: int, now: int) -> tuple[int, int]:
    """The buckets (units) refilled from ``refilled_at`` to ``now``: tokens at TPM
    less what others use (``external``, at most 9/10 of TPM), up to :func:`token_cap`; requests at
    RPM, up to the request burst (untouched without an RPM limit).

    The rule ``refill`` in limits.lua applies; the reference model and the live
    view (:meth:`balancer.admission.AdmissionCore.live`) both use this function.

    >>> q = Quota("m", 1, 600, max_requests_per_minute=60)   # 10 tokens/s, 1 request/s
    >>> [units / UNITS for units in refilled(q, 0, 0, refilled_at=0, external=0, now=2_000)]
    [20.0, 2.0]
    """
    dt = max(0, now - refilled_at)
    tpm = quota.max_tokens_per_minute
    tokens = min(token_cap(quota), tokens + dt * (tpm - min(external, math.floor(tpm * 9 / 10))))
    if quota.max_requests_per_minute:
        requests = min(quota.request_burst * UNITS, requests + dt * quota.max_requests_per_minute)
    return tokens, requests


def tokens_needed(quota: Quota, est: int) -> int:
    """Units a task needs in the bucket: its estimate, or a full bucket if larger."""
    return min(est * UNITS, token_cap(quota))


def rejection_reason(estimated: int, largest_burst: int) -> str:
    return (
        f"needs {estimated} tokens, more than the largest burst_tokens "
        f"({largest_burst}) of its allowed models"
    )
