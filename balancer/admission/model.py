"""A pure-Python model of the admission core, step for step the same as the Lua.

Why it exists: the Lua scripts are the product, but Lua inside Redis is hard to
reason about and impossible to step through. This model has *exactly* the
same semantics, so Hypothesis can drive both with the same random operations
and demand identical decisions (``tests/test_differential.py``). It is also
where the scheduling rules are easiest to read.

Units. Time is integer milliseconds. A token bucket holds integer *units*,
``UNITS`` per token, so that refilling at ``tpm`` tokens per minute is exactly
``tpm`` units per millisecond. The request bucket works the same way with
``UNITS`` per request. Everything stays an integer below 2**53, which keeps
Lua's doubles exact.

The rules, for one ``admit`` call over a batch of candidates (in the order
given, which the dispatcher makes priority-then-age):

1. Refill every model's buckets up to ``now``; drop expired leases. An expired
   lease that was never *started* (no worker renewed it, e.g. the dispatcher
   died before publishing) gives its tokens and request back.
2. For each candidate, its models are the allowed ones that exist (all models
   if unrestricted). If the estimate exceeds every one's ``burst``, it can
   never run: **rejected**, with the reason.
3. *Eligible* models are enabled, fit the estimate, are not held (step 5), and
   have a free slot, enough tokens and (if RPM is set) a request, and are not
   paused by a 429 (``penalize``) or an open circuit (``trip``): a model whose
   circuit is open takes one call at a time once its pause ends, a probe.
   A candidate may name a model to *avoid*
   (its last call there failed transiently): that model is passed over when
   another model is eligible.
4. WDRR. Each model has a quantum of ``weight * base_quantum`` tokens. If no
   eligible model's deficit covers the estimate, every *eligible* model (only
   those: idle or blocked models do not accrue) gains the smallest whole number
   of quanta that lets one of them cover it, computed in closed form, never
   one "round" per call as in the seed design. Deficits are capped at the
   model's ``burst``, so no model banks an unbounded claim. The first model in
   round-robin order (after the last one chosen) whose deficit covers the
   estimate takes it; its deficit, tokens and request are debited and a lease
   is created.
5. No eligible model: the answer is **not now**, with the earliest time any of
   its models could take it (token refill, request refill, or the deadline of
   the lease whose expiry frees a slot). The model among those short of
   *tokens* that could serve it soonest is **held** for the rest of the batch,
   so a stream of small tasks behind a large one cannot keep draining the
   bucket it is waiting for (no starvation). Holding affects tokens only on
   that one model; other models keep serving (no head-of-line blocking).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from balancer.domain import latency
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
    #: An answered call's latency and completion tokens: a sample for the model's latency sketch.
    latency_ms: int | None = None
    completion_tokens: int | None = None


@dataclass
class ModelState:
    quota: Quota
    tokens: int  # units; may go negative after a reconcile debit
    requests: int  # units; 0 when the model has no RPM limit
    refilled_at: int  # ms
    deficit: int  # tokens
    generation: int = 0  # bumped when the rate or bucket size changes
    paused_until: int = 0  # ms: a 429 holds the model until then
    tat: int = 0  # ms: the start gate's theoretical arrival time of the next call start
    external: int = 0  # tokens per minute others use of this quota, learned from headers
    synced_at: int = 0  # ms of the last x-ratelimit-remaining-tokens sync
    failures: int = 0  # consecutive transient failures (the circuit breaker)
    probing: bool = False  # the circuit is open: paused, then one call at a time until one is answered
    backoff_ms: int = 0  # the circuit's last pause
    #: The token gate's bucket (units), charged at call start as the provider charges on arrival, and its refill time.
    started_tokens: int = field(init=False)
    started_refilled_at: int = field(init=False)

    def __post_init__(self) -> None:
        self.started_tokens, self.started_refilled_at = self.tokens, self.refilled_at

    @property
    def refill_rate(self) -> int:
        """Units per ms (= tokens per minute) the bucket refills at: TPM less what others use."""
        return self.quota.max_tokens_per_minute - self.external


@dataclass
class Lease:
    model: str
    estimated_tokens: int
    deadline: int
    started: bool = False
    reconciled: bool = False
    generation: int = 0  # the model's quota generation when it was charged


@dataclass(frozen=True)
class ReadyTask:
    """A task on a model's ready list: stocked by the dispatcher ahead of a free
    slot, then taken (admitted under ``admission_id``) or dropped.

    ``start_delay_ms`` and ``restock`` are set when
    :meth:`ReferenceCore.finish_and_take` took it as the freed slot's next
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


@dataclass
class ReadyEntry:
    task_id: int
    admission_id: str
    estimated_tokens: int
    expires_at: int  # ms: not taken by then, it is dropped and its task goes back to pending


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


def tokens_needed(quota: Quota, est: int) -> int:
    """Units a task needs in the bucket: its estimate, or a full bucket if larger."""
    return min(est * UNITS, token_cap(quota))


def rejection_reason(estimated: int, largest_burst: int) -> str:
    return (
        f"needs {estimated} tokens, more than the largest burst_tokens "
        f"({largest_burst}) of its allowed models"
    )


@dataclass
class ReferenceCore:
    """The admission state and its operations, in memory. See the module docstring."""

    models: dict[str, ModelState] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    #: Per model, the latency sketch's fields (balancer.domain.latency.record).
    latency: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Per model, its ready list, oldest first (see :meth:`stock`).
    ready: dict[str, list[ReadyEntry]] = field(default_factory=dict)
    loaded: bool = False
    epoch: int = 0
    seq: int = 0
    rr: str = ""

    # -- helpers ---------------------------------------------------------------
    def _names(self) -> list[str]:
        return sorted(self.models, key=lambda n: n.encode())

    def _inflight(self, name: str) -> list[tuple[int, str]]:
        """(deadline, id) of the model's leases in sorted-set order."""
        return sorted(
            ((lease.deadline, lid) for lid, lease in self.leases.items() if lease.model == name),
            key=lambda pair: (pair[0], pair[1].encode()),
        )

    def _refill(self, name: str, now: int) -> None:
        state = self.models[name]
        quota = state.quota
        dt = max(0, now - state.refilled_at)
        state.tokens = min(token_cap(quota), state.tokens + dt * state.refill_rate)
        if quota.max_requests_per_minute:
            rpm = quota.max_requests_per_minute
            state.requests = min(quota.request_burst * UNITS, state.requests + dt * rpm)
        state.refilled_at = max(state.refilled_at, now)

    def _purge(self, name: str, now: int) -> None:
        for deadline, lid in self._inflight(name):
            if deadline > now:
                break
            lease = self.leases.pop(lid)
            if not lease.started:
                self._refund(name, lease)

    def _same_generation(self, lease: Lease) -> bool:
        """Whether ``lease`` was charged under the model's current quota.

        Credits go back only to the generation that paid for them: after the
        rate or burst is lowered, an old call's surplus must not refill the new,
        smaller bucket (traffic would then exceed the new quota).
        """
        return lease.generation == self.models[lease.model].generation

    def _refund(self, name: str, lease: Lease) -> None:
        """Give back what an admission charged, for a call that never happened."""
        if not self._same_generation(lease):
            return
        state = self.models[name]
        quota = state.quota
        state.tokens = min(token_cap(quota), state.tokens + lease.estimated_tokens * UNITS)
        if quota.max_requests_per_minute:
            state.requests = min(quota.request_burst * UNITS, state.requests + UNITS)

    def _slot_cap(self, name: str) -> int:
        """The concurrency cap, or 1 while the circuit is open (a probe at a time)."""
        state = self.models[name]
        return 1 if state.probing else state.quota.max_concurrent_requests

    def _has_capacity(self, name: str, est: int, now: int) -> bool:
        state = self.models[name]
        quota = state.quota
        return (
            state.paused_until <= now
            and len(self._inflight(name)) < self._slot_cap(name)
            and state.tokens >= tokens_needed(quota, est)
            and (not quota.max_requests_per_minute or state.requests >= UNITS)
        )

    def _wait(self, name: str, est: int, now: int) -> int:
        """Milliseconds until ``name`` has a slot, the tokens and a request for ``est``, and no pause."""
        state = self.models[name]
        quota = state.quota
        token_wait = 0
        need = tokens_needed(quota, est)
        if state.tokens < need:
            token_wait = ceil_div(need - state.tokens, state.refill_rate)
        request_wait = 0
        if quota.max_requests_per_minute and state.requests < UNITS:
            request_wait = ceil_div(UNITS - state.requests, quota.max_requests_per_minute)
        slot_wait = 0
        inflight, cap = self._inflight(name), self._slot_cap(name)
        if len(inflight) >= cap:
            slot_wait = inflight[len(inflight) - cap][0] - now
        return max(token_wait, request_wait, slot_wait, state.paused_until - now)

    @staticmethod
    def _refill_started(state: ModelState, now: int) -> None:
        dt = max(0, now - state.started_refilled_at)
        state.started_tokens = min(token_cap(state.quota), state.started_tokens + dt * state.refill_rate)
        state.started_refilled_at = max(state.started_refilled_at, now)

    def _token_gate(self, state: ModelState, est: int, now: int) -> int:
        """Milliseconds until the provider, charging on arrival, has the tokens for
        a call starting now; then charge them (the bucket may go negative).

        Admission charges the first bucket early; calls that then wait in the
        broker or a busy worker would start in bunches the provider refuses.
        This second bucket refills, settles and syncs like the first.
        """
        self._refill_started(state, now)
        need = tokens_needed(state.quota, est)
        wait = ceil_div(need - state.started_tokens, state.refill_rate) if state.started_tokens < need else 0
        state.started_tokens -= est * UNITS
        return wait

    def _start_delay(self, name: str, est: int, first_start: bool, now: int) -> int:
        """Both gates for a call about to start; a restart was charged at the token gate already."""
        wait = self._token_gate(self.models[name], est, now) if first_start else 0
        return wait + self._start_gate(name, now + wait)

    def _start_gate(self, name: str, now: int) -> int:
        """Milliseconds to wait before the call starts (GCRA on call starts).

        Calls start at most RPM per minute with at most ``request_burst`` at once,
        timed at renew, just before the HTTP call. Admission already paces the
        request bucket, but the hops between admission and the call (broker,
        queue, worker) bunch calls up, and a provider checking RPM over 1 s sees
        those bunches. Without an RPM limit the gate is open.
        """
        state = self.models[name]
        rpm = state.quota.max_requests_per_minute
        if not rpm:
            return 0
        interval = ceil_div(60_000, rpm)
        tolerance = max(0, (state.quota.request_burst - 1) * interval - min(ceil_div(interval, 2), GATE_HOP_MS))
        start = max(now, state.tat - tolerance)
        state.tat = max(state.tat, start) + interval
        return start - now

    def _charge(self, name: str, est: int) -> None:
        state = self.models[name]
        state.tokens -= est * UNITS
        if state.quota.max_requests_per_minute:
            state.requests -= UNITS

    def _new_lease(self, name: str, est: int, deadline: int, started: bool) -> str:
        self.seq += 1
        lid = f"{self.epoch}-{self.seq}"
        self.leases[lid] = Lease(name, est, deadline, started=started, generation=self.models[name].generation)
        return lid

    def _require_state(self) -> None:
        if not self.loaded:
            raise NoState()

    # -- operations ------------------------------------------------------------
    def admit(
        self, candidates: Sequence[Candidate], now: int, lease_ms: int, base_quantum: int
    ) -> list[Decision]:
        self._require_state()
        names = self._names()
        for name in names:
            self._refill(name, now)
            self._purge(name, now)
        held: set[str] = set()
        decisions: list[Decision] = []
        for cand in candidates:
            est = cand.estimated_tokens
            pool = names if cand.allowed is None else [n for n in names if n in cand.allowed]
            if not pool:
                wanted = ",".join(sorted(cand.allowed)) if cand.allowed else ""
                decisions.append(Rejected(f"no such model: {wanted}" if wanted else "no models configured"))
                continue
            largest = max(self.models[n].quota.burst for n in pool)
            if est > largest:
                decisions.append(Rejected(rejection_reason(est, largest)))
                continue
            fits = [n for n in pool if self.models[n].quota.enabled and est <= self.models[n].quota.burst]
            if not fits:
                decisions.append(NotNow(None, now))
                continue
            eligible = [n for n in fits if n not in held and self._has_capacity(n, est, now)]
            if cand.avoid in eligible and len(eligible) > 1:
                eligible.remove(cand.avoid)
            if not eligible:
                earliest: int | None = None
                starved: str | None = None
                starved_at: int | None = None
                for n in fits:
                    at = now + self._wait(n, est, now)
                    if earliest is None or at < earliest:
                        earliest = at
                    if (
                        n not in held
                        and self.models[n].tokens < tokens_needed(self.models[n].quota, est)
                        and (starved_at is None or at < starved_at)
                    ):
                        starved, starved_at = n, at
                if starved is not None:
                    held.add(starved)
                decisions.append(NotNow(earliest, now))
                continue
            if not any(self.models[n].deficit >= est for n in eligible):
                rounds = min(
                    ceil_div(est - self.models[n].deficit, self.models[n].quota.weight * base_quantum)
                    for n in eligible
                )
                for n in eligible:
                    state = self.models[n]
                    state.deficit = min(
                        state.deficit + rounds * state.quota.weight * base_quantum, state.quota.burst
                    )
            start = names.index(self.rr) + 1 if self.rr in self.models else 0
            order = names[start:] + names[:start]
            chosen = next(n for n in order if n in eligible and self.models[n].deficit >= est)
            self.models[chosen].deficit -= est
            self._charge(chosen, est)
            lid = self._new_lease(chosen, est, now + lease_ms, started=False)
            self.rr = chosen
            decisions.append(Admitted(chosen, lid))
        return decisions

    def renew(self, admission_id: str, model: str, est: int, now: int, lease_ms: int) -> Decision:
        """Re-assert a slot (a redelivered message, or a worker starting its call).

        If the model has been disabled since, the call must not start: the
        lease is dropped (refunded if never started) and the answer is not-now.
        If the lease still exists it is extended and marked started. If it has
        expired, the slot is re-acquired like a fresh admission on that model
        (slot, tokens, request), outside WDRR; if there is no room the answer
        is not-now and the caller must not call the backend.
        """
        self._require_state()
        if model not in self.models:
            return Rejected(f"no such model: {model}")
        self._refill(model, now)
        self._purge(model, now)
        quota = self.models[model].quota
        lease = self.leases.get(admission_id)
        if lease is not None and not quota.enabled:
            # Disabled since admission: this call must not start. Give the slot
            # back, and the tokens too if no call was ever made under it.
            del self.leases[admission_id]
            if not lease.started:
                self._refund(model, lease)
            return NotNow(None, now)
        if lease is not None:
            lease.deadline = now + lease_ms
            delay = self._start_delay(model, lease.estimated_tokens, not lease.started, now)
            lease.started = True
            return Admitted(lease.model, admission_id, delay)
        if est > quota.burst:
            return Rejected(rejection_reason(est, quota.burst))
        if not quota.enabled:
            return NotNow(None, now)
        if not self._has_capacity(model, est, now):
            return NotNow(now + self._wait(model, est, now), now)
        self._charge(model, est)
        self.leases[admission_id] = Lease(
            model, est, now + lease_ms, started=True, generation=self.models[model].generation
        )
        return Admitted(model, admission_id, self._start_delay(model, est, True, now))

    def release(self, admission_id: str, now: int) -> bool:
        """Free the slot. Releasing twice, or an unknown id, is harmless."""
        return self.finish(admission_id, Settlement(), now)[1]

    def finish(self, admission_id: str, settlement: Settlement, now: int, release: bool = True) -> tuple[bool, bool]:
        """Settle (once), sync to the headers, and free the slot unless ``release``
        is False: what ``finish.lua`` does in one round trip. Returns (settled, released)."""
        settled = self._settle(admission_id, settlement, now)
        lease = self.leases.get(admission_id)
        if lease is not None and lease.model in self.models and settlement.latency_ms is not None:
            state = self.models[lease.model]
            state.failures, state.probing, state.backoff_ms = 0, False, 0  # an answer closes the circuit
            completion = settlement.completion_tokens or 0
            latency.record(
                self.latency.setdefault(lease.model, {}), latency.bucket_of(settlement.latency_ms),
                settlement.latency_ms, max(0, (settlement.used_tokens or 0) - completion), completion,
            )
        released = release and self.leases.pop(admission_id, None) is not None
        return settled, released

    # -- ready lists -------------------------------------------------------------
    def stock(self, entries: Sequence[tuple[str, int, int, str]], ttl_ms: int, now: int) -> list[bool]:
        """Put (model, task id, estimated tokens, admission id) entries on their
        models' ready lists, each expiring ``ttl_ms`` from now; what ``stock.lua``
        does. Returns whether each was stocked (not: unknown model).

        A ready list lets a freed slot carry its next call at once
        (:meth:`finish_and_take`): the dispatcher fills it for models their
        concurrency caps bind, ahead of the slot, not ahead of the admission. The
        caller names the admission ids, so it can mark the tasks queued under
        them in PostgreSQL, and commit, before any entry can be taken.
        """
        self._require_state()
        out = []
        for name, task_id, est, lid in entries:
            if name in self.models:
                self.ready.setdefault(name, []).append(ReadyEntry(task_id, lid, est, now + ttl_ms))
            out.append(name in self.models)
        return out

    def _take_ready(
        self, name: str, now: int, lease_ms: int, started: bool, limit: float, drop: bool
    ) -> tuple[list[ReadyEntry], list[ReadyEntry]]:
        """Take entries from the head of ``name``'s ready list while the model can
        admit them now: each is charged and leased like an admission, outside
        WDRR (the dispatcher chose the model when it stocked it). With ``drop``
        (the dispatcher's pass, which returns their tasks to pending), expired
        heads are dropped, and so is every entry the model can never take as it
        stands (disabled, or larger than its burst); without it (a finishing
        call) such a head stops the take. So does the first entry that must
        wait, so the list keeps its order."""
        queue = self.ready.get(name, [])
        quota = self.models[name].quota
        taken: list[ReadyEntry] = []
        dropped: list[ReadyEntry] = []
        while queue and len(taken) < limit:
            head = queue[0]
            est = head.estimated_tokens
            if drop and (head.expires_at <= now or not quota.enabled or est > quota.burst):
                dropped.append(queue.pop(0))
            elif head.expires_at > now and quota.enabled and est <= quota.burst and self._has_capacity(name, est, now):
                queue.pop(0)
                self._charge(name, est)
                self.leases[head.admission_id] = Lease(
                    name, est, now + lease_ms, started=started, generation=self.models[name].generation
                )
                taken.append(head)
            else:
                break
        if not queue:
            self.ready.pop(name, None)
        return taken, dropped

    def finish_and_take(self, admission_id: str, settlement: Settlement, now: int, lease_ms: int) -> ReadyTask | None:
        """:meth:`finish`, then, if a slot was freed, the head of its model's ready
        list as that slot's next call, if the model can admit it now: leased as
        started, through both start gates (``start_delay_ms``). One round trip
        in ``finish.lua``; no broker hop and no dispatcher between the two calls."""
        lease = self.leases.get(admission_id)
        _, released = self.finish(admission_id, settlement, now)
        if not released or lease is None or lease.model not in self.models:
            return None
        name = lease.model
        self._purge(name, now)
        taken, _ = self._take_ready(name, now, lease_ms, True, 1, False)
        if not taken:
            return None
        head = taken[0]
        delay = self._start_delay(name, head.estimated_tokens, True, now)
        restock = len(self.ready.get(name, [])) < self.models[name].quota.max_concurrent_requests
        return ReadyTask(head.task_id, head.admission_id, name, head.estimated_tokens, delay, restock)

    def take_ready(self, now: int, lease_ms: int) -> tuple[list[ReadyTask], list[ReadyTask]]:
        """The dispatcher's pass over the ready lists (``take_ready.lua``): per model
        with entries, in name order, what free slots take now (leases not
        started: the worker renews them) and what is dropped (to go back to
        pending). A freed slot whose finish could not take its next call (the
        tokens were short then) is filled from here, so no entry is stranded."""
        self._require_state()
        taken: list[ReadyTask] = []
        dropped: list[ReadyTask] = []
        for name in self._names():
            if not self.ready.get(name):
                continue
            self._refill(name, now)
            self._purge(name, now)
            got, lost = self._take_ready(name, now, lease_ms, False, math.inf, True)
            taken += [ReadyTask(e.task_id, e.admission_id, name, e.estimated_tokens) for e in got]
            dropped += [ReadyTask(e.task_id, e.admission_id, name, e.estimated_tokens) for e in lost]
        return taken, dropped

    def reconcile(self, admission_id: str, settlement: Settlement, now: int) -> bool:
        """:meth:`finish` without freeing the slot. Returns True if the tokens were settled now."""
        return self.finish(admission_id, settlement, now, release=False)[0]

    def hold(self, admission_id: str, hold_ms: int, now: int) -> bool:
        """Keep a cancelled call's slot for ``hold_ms`` more (never past its
        deadline), its reservation charged: what ``hold.lua`` does.

        A provider that finishes a non-streamed request after the client
        disconnects keeps its slot busy and charges the call in full, so the
        lease is neither settled nor released; the next purge frees it.
        Returns True if a live lease is now held.
        """
        lease = self.leases.get(admission_id)
        if lease is None or lease.deadline <= now:
            return False
        lease.deadline = min(lease.deadline, now + hold_ms)
        return True

    def heartbeat(self, admission_id: str, lease_ms: int, now: int) -> bool:
        """Extend a live lease to ``now + lease_ms``: what ``heartbeat.lua`` does.

        An expired lease is not revived: its slot may carry another call now.
        Returns True if the lease was live and is extended.
        """
        lease = self.leases.get(admission_id)
        if lease is None or lease.deadline <= now:
            return False
        lease.deadline = now + lease_ms
        return True

    def _settle(self, admission_id: str, settlement: Settlement, now: int) -> bool:
        """Settle a finished call once per lease, then sync to the provider's headers.

        The provider's charge is the usage (``settle``) or the reservation
        (``reserve``). A charge above the estimate is always debited; one below
        it is credited only by a ``settle`` model within the generation that
        charged it. A ``reserve`` provider keeps what it reserved, and so does
        this core: crediting it back is what drew 429s from strict providers.
        The remaining counts from the headers lower the buckets, never raise
        them. Returns True if the tokens were settled by this call.
        """
        lease = self.leases.get(admission_id)
        if lease is None or lease.model not in self.models:
            return False
        self._refill(lease.model, now)
        state = self.models[lease.model]
        self._refill_started(state, now)
        settled = False
        if not lease.reconciled and settlement.used_tokens is not None:
            charged = settlement.used_tokens
            if not state.quota.settles:
                charged = settlement.reserved_tokens if settlement.reserved_tokens is not None else lease.estimated_tokens
            surplus = lease.estimated_tokens - charged
            if surplus < 0 or (state.quota.settles and self._same_generation(lease)):
                state.tokens = min(token_cap(state.quota), state.tokens + surplus * UNITS)
                state.started_tokens = min(token_cap(state.quota), state.started_tokens + surplus * UNITS)
            lease.reconciled = settled = True
        self._sync_to_headers(state, now, settlement.remaining_tokens, settlement.remaining_requests)
        return settled

    @staticmethod
    def _sync_to_headers(state: ModelState, now: int, remaining_tokens: int | None, remaining_requests: int | None) -> None:
        """Lower the buckets to the provider's ``x-ratelimit-remaining-*``; never raise them.

        The token gap between two syncs is what others used of the quota
        meanwhile: its rate moves ``external``, and the bucket refills at TPM
        less that (never below a tenth of TPM). So a steady outside user is
        expected instead of met as a 429 after every sync. Biased to the safe
        side: an outside user shows as a positive gap and moves the estimate up
        by 1/4 of it; calls we charged that have not reached the provider yet
        show as a negative gap, so down moves take only 1/32. Float division
        then floor, exactly as the Lua does it.
        """
        if remaining_tokens is not None:
            remaining = remaining_tokens * UNITS
            if state.synced_at > 0 and now > state.synced_at:
                gap = state.tokens - remaining
                error_rate = math.floor(gap / ((4 if gap >= 0 else 32) * (now - state.synced_at)))
                ceiling = math.floor(state.quota.max_tokens_per_minute * 9 / 10)
                state.external = max(0, min(ceiling, state.external + error_rate))
            state.synced_at = now
            state.tokens = min(state.tokens, remaining)
            ReferenceCore._refill_started(state, now)
            state.started_tokens = min(state.started_tokens, remaining)
        if remaining_requests is not None and state.quota.max_requests_per_minute:
            state.requests = min(state.requests, remaining_requests * UNITS)

    def penalize(
        self, model: str, retry_after_ms: int, now: int,
        remaining_tokens: int | None = None, remaining_requests: int | None = None,
    ) -> bool:
        """A 429: pause ``model`` until now + Retry-After, unless a pause is running,
        and lower its buckets to the provider's remaining counts.

        One penalty per window: N concurrent 429s pause the model once, not N
        times as long. The pause holds the model whichever limit (tokens,
        requests, concurrency) the provider applied. The header sync applies to
        every 429: it is the surest sign that someone else uses the quota.
        Returns True if it started a pause.
        """
        state = self.models.get(model)
        if state is None:
            return False
        self._refill(model, now)
        started = state.paused_until <= now
        if started:
            state.paused_until = now + retry_after_ms
        self._sync_to_headers(state, now, remaining_tokens, remaining_requests)
        return started

    def trip(self, model: str, now: int) -> tuple[bool, bool]:
        """A transient failure (5xx, timeout, refused connection) on ``model``:
        what ``trip.lua`` does. Returns (counted, opened).

        After ``CIRCUIT_FAILURES`` in a row (an answered call resets the count)
        the circuit opens: the model pauses ``CIRCUIT_BASE_MS``, then takes one
        call at a time, a probe. A failed probe pauses it twice as long (up to
        ``CIRCUIT_MAX_MS``); an answered one closes the circuit. So a backend
        outage pauses the model instead of burning every task's attempts: only
        failures while the circuit is closed, and that do not open it, are
        *counted* against the task. Failures during a running pause (calls in
        flight when it opened) do not lengthen it.
        """
        state = self.models.get(model)
        if state is None:
            return True, False
        self._refill(model, now)
        if state.probing:
            if state.paused_until > now:
                return False, False
            state.backoff_ms = min(state.backoff_ms * 2, CIRCUIT_MAX_MS)
            state.paused_until = now + state.backoff_ms
            return False, True
        state.failures += 1
        if state.failures < CIRCUIT_FAILURES:
            return True, False
        state.failures, state.probing, state.backoff_ms = 0, True, CIRCUIT_BASE_MS
        state.paused_until = max(state.paused_until, now + CIRCUIT_BASE_MS)
        return False, True

    def set_quota(self, quota: Quota, now: int) -> None:
        """Create or change a model. Applies to the very next admission."""
        self._require_state()
        state = self.models.get(quota.name)
        if state is None:
            self.models[quota.name] = ModelState(quota, token_cap(quota), quota.request_burst * UNITS, now, 0)
            return
        self._refill(quota.name, now)
        self._refill_started(state, now)
        old = state.quota
        had_rpm = bool(old.max_requests_per_minute)
        if (old.max_tokens_per_minute, old.max_requests_per_minute or 0, old.burst, old.request_burst) != (
            quota.max_tokens_per_minute, quota.max_requests_per_minute or 0, quota.burst, quota.request_burst
        ):
            state.generation += 1
        state.quota = quota
        state.tokens = min(state.tokens, token_cap(quota))
        state.started_tokens = min(state.started_tokens, token_cap(quota))
        rburst = quota.request_burst
        state.requests = min(state.requests, rburst * UNITS) if had_rpm else rburst * UNITS
        state.deficit = min(state.deficit, quota.burst)
        state.external = min(state.external, math.floor(quota.max_tokens_per_minute * 9 / 10))

    def remove_quota(self, name: str) -> bool:
        self._require_state()
        if self.models.pop(name, None) is None:
            return False
        self.latency.pop(name, None)
        self.ready.pop(name, None)  # those tasks go back to pending at their database deadline
        # Its leases stay: their calls still run at the provider, and count again if the model comes back.
        return True

    def restore(self, quotas: Sequence[Quota], leases: Sequence[LeaseSeed], now: int) -> bool:
        """Rebuild lost state: quotas from PostgreSQL, buckets *empty* (the
        provider may have seen a burst just before the loss), and the calls
        PostgreSQL says are in flight re-seeded as started leases so the
        concurrency cap still counts them. Returns False if state exists."""
        if self.loaded:
            return False
        self.loaded = True
        self.epoch, self.seq, self.rr = now, 0, ""
        self.latency.clear()
        self.ready.clear()
        for quota in quotas:
            self.models[quota.name] = ModelState(quota, 0, 0, now, 0)
        for seed in leases:
            if seed.model in self.models:
                self.leases[seed.admission_id] = Lease(
                    seed.model, seed.estimated_tokens, now + seed.remaining_ms, started=True
                )
        return True

    def forget(self) -> None:
        """Simulate Redis losing all data."""
        self.models.clear()
        self.leases.clear()
        self.latency.clear()
        self.ready.clear()
        self.loaded = False
        self.epoch = self.seq = 0
        self.rr = ""
