"""The live view of the admission state: what each model holds in Redis right now.

Read-only, so no Lua: the dispatcher, ``balancer quota list``, ``status``,
``top`` and the metrics exporter read it. The buckets are refilled to now by
the rule the scripts apply (:func:`balancer.admission.values.refilled`), and
the quota is read back through :mod:`balancer.admission.fields`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from balancer.admission import fields, keys
from balancer.admission.learned import Learned, effective, ramp_opens_ms, reason, relaxed, slots_now
from balancer.admission.liveness import records_trusted
from balancer.admission.quota import Quota
from balancer.admission.values import UNITS, outside_rate, refilled, token_cap
from balancer.estimates.latency import MIN_SAMPLES, LatencyEstimate, LatencySketch


@dataclass(frozen=True)
class ModelLive:
    """A model's live state as ``balancer quota list`` shows it."""

    quota: Quota
    in_flight: int
    tokens_available: float
    requests_available: float | None
    deficit: int
    paused_ms: int = 0  # how much longer a 429 holds the model
    external_tpm: int = 0  # tokens per minute others use of this quota, learned from the provider's headers
    latency: LatencySketch = LatencySketch()  # what its finished calls took (balancer.estimates.latency)
    ready: int = 0  # tasks on its ready list, waiting for a slot (see AdmissionCore.stock)
    learned: Learned = field(default_factory=Learned)  # what it learned of the provider's real limits (balancer.admission.learned)
    #: The concurrency cap in force when read: the effective one, or slow start's
    #: while a new quota ramps (balancer.admission.learned.slots_now); None: the effective one.
    slots: int | None = None
    circuit_open: bool = False  # repeated transient failures opened its circuit: probed one call at a time
    failures: int = 0  # consecutive transient failures toward opening it (0 once a call is answered)
    consumers: int = 0  # worker processes consuming its queue now (a live record each: keys.consumers)
    #: Ms until slow start opens a slot it holds closed, with no call ending, and no pause holds the
    #: model (None: none opens so: balancer.admission.learned.ramp_opens_ms)
    ramp_opens_ms: int | None = None

    @property
    def cap_now(self) -> int:
        """How many calls it may have in flight now (slow start included)."""
        return self.limits.max_concurrent_requests if self.slots is None else self.slots

    @property
    def token_capacity(self) -> float:
        """The most tokens its bucket holds now (an idle model's bucket fills to this): the burst
        less the tokens a call in transit may still take (:func:`~balancer.admission.values.token_cap`).

        >>> ModelLive(Quota("m", 1, 60_000, burst_tokens=10_000), 0, 9_750.0, None, 0).token_capacity
        9750.0
        """
        return token_cap(self.limits) / UNITS

    @property
    def limits(self) -> Quota:
        """The effective limits the scripts hold it to now: the quota's, or lower where it learned so."""
        return effective(self.quota, self.learned)

    @property
    def limits_reason(self) -> str:
        """Why :attr:`limits` (or :attr:`cap_now`) differ from the quota ('' if they do not)."""
        why = reason(self.quota, self.learned)
        cap = self.limits.max_concurrent_requests
        if self.cap_now < cap and self.learned.ramp_at:  # (an idle model's slow start has not begun: nothing to say)
            why = "; ".join(filter(None, [f"starting slowly: {self.cap_now} of {cap} slots open", why]))
        return why

    def latency_estimate(self, prior_s: float) -> LatencyEstimate:
        """What the model's calls take: its sketch, or until it has enough calls its
        own prior (``expected_latency_s``), else the global ``prior_s``."""
        return self.latency.estimate(self.quota.expected_latency_s or prior_s)

    @property
    def latency_known(self) -> bool:
        """Enough of its calls were measured, or its quota says what they take:
        more than the global prior, which only says "not known yet"."""
        return self.latency.samples >= MIN_SAMPLES or self.quota.expected_latency_s is not None


def read_live(client: redis.Redis, namespace: str, now_ms: int | None = None) -> dict[str, ModelLive]:
    """Per-model live view, bucket levels refilled to ``now`` (Redis TIME by default).

    Read-only and pipelined: one round trip for the clock and the model
    names, one for every model's hash, live-lease count (ZCOUNT, so the cost does not grow
    with the number of calls in flight), latency sketch, ready-list length and live consumers.
    """
    models_key = keys.script_keys(namespace)[1]
    first = client.pipeline(transaction=False)
    first.time()
    first.zrange(models_key, 0, -1)
    (seconds, micros), raw_names = first.execute()
    if now_ms is None:
        now_ms = seconds * 1000 + micros // 1000
    names = [n.decode() for n in raw_names]
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.model(namespace, name))
        pipe.zcount(keys.inflight(namespace, name), f"({now_ms}", "+inf")
        pipe.hgetall(keys.latency(namespace, name))
        pipe.llen(keys.ready(namespace, name))
        pipe.zcount(keys.consumers(namespace, name), f"({now_ms}", "+inf")
    replies = pipe.execute()
    view = {}
    for i, name in enumerate(names):
        raw, in_flight, sketch, ready, consumers = replies[5 * i:5 * i + 5]
        if not raw:
            continue  # removed between the two reads
        m = fields.with_defaults({k.decode(): int(v) for k, v in raw.items()})
        quota = fields.quota_from_fields(name, m)
        learned = Learned.from_fields(m)
        limits = effective(quota, learned)
        tokens, requests = refilled(limits, m["tokens"], m["requests"], m["refilled_at"], m["ext"], now_ms, m["tat"])
        learned = relaxed(quota, learned, now_ms)  # as the next script will see it (refill, then relax)
        paused_ms = max(0, m["paused"] - now_ms)
        latency = LatencySketch.from_fields({k.decode(): int(v) for k, v in sketch.items()})
        opens = None if m["probing"] == 1 else ramp_opens_ms(quota, learned, now_ms)  # (probing: one call at a time)
        view[name] = ModelLive(quota, in_flight, tokens / UNITS,
                               requests / UNITS if limits.max_requests_per_minute else None,
                               m["deficit"], paused_ms, outside_rate(limits.max_tokens_per_minute, m["ext"]),
                               latency, ready, learned, slots_now(quota, learned, now_ms), m["probing"] == 1,
                               m["fails"], consumers, None if opens is None else max(opens, paused_ms))
    return view


def records_trusted_now(client: redis.Redis, namespace: str, now_ms: int | None = None) -> bool:
    """Whether lapsed consumer records can be believed now (Redis TIME by default):
    :func:`balancer.admission.liveness.records_trusted` on ``keys.consumers_heard``."""
    pipe = client.pipeline(transaction=False)
    pipe.hmget(keys.consumers_heard(namespace), "heard", "resumed")
    pipe.time()
    (heard, resumed), (seconds, micros) = pipe.execute()
    now = seconds * 1000 + micros // 1000 if now_ms is None else now_ms
    return records_trusted(now, None if heard is None else int(heard), None if resumed is None else int(resumed))


def next_slot_ms(view: dict[str, ModelLive]) -> int | None:
    """Ms until slow start opens a slot on one of the models it holds full (None: it holds none).
    No call ends to ask for a dispatch then, so the dispatcher asks for one itself."""
    return min((m.ramp_opens_ms for m in view.values()
                if m.ramp_opens_ms is not None and m.in_flight >= m.cap_now and m.quota.enabled), default=None)


def slots_of(view: dict[str, ModelLive]) -> dict[str, int]:
    """Each model's concurrency cap: its effective limit, slow start aside."""
    return {name: m.limits.max_concurrent_requests for name, m in view.items()}


def open_slots(view: dict[str, ModelLive]) -> dict[str, int]:
    """Free slots of the models that could admit *something* right now:
    enabled, not paused by a 429, a free slot, a token (or a full bucket, for a burst
    whose transit allowance leaves less: burst_tokens = 1 is full at 0.5) and (with
    RPM) a request. The dispatcher reads only tasks that one of these could take,
    so a task no bucket of its models can hold is read, and failed with the reason."""
    return {
        name: m.cap_now - m.in_flight
        for name, m in view.items()
        if m.quota.enabled
        and m.paused_ms == 0
        and m.in_flight < m.cap_now
        and m.tokens_available >= min(1.0, m.token_capacity)
        and (m.requests_available is None or m.requests_available >= 1)
    }
