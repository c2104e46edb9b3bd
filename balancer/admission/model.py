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
   have a free slot, enough tokens and (if RPM is set) a request.
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

from dataclasses import dataclass, field
from typing import Sequence

from balancer.quota import Quota

#: Bucket units per token (and per request): refill per ms == per-minute rate.
UNITS = 60_000


class NoState(Exception):
    """The live state is missing (Redis lost it); restore it from PostgreSQL."""


@dataclass(frozen=True)
class Candidate:
    """A task asking for admission: its estimated tokens and allowed models (None = any)."""

    estimated_tokens: int
    allowed: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.allowed is not None:
            # An empty restriction means "any model", as it does on the wire.
            object.__setattr__(self, "allowed", tuple(self.allowed) or None)


@dataclass(frozen=True)
class Admitted:
    model: str
    admission_id: str


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


@dataclass
class ModelState:
    quota: Quota
    tokens: int  # units; may go negative after a reconcile debit
    requests: int  # units; 0 when the model has no RPM limit
    refilled_at: int  # ms
    deficit: int  # tokens
    generation: int = 0  # bumped when the rate or bucket size changes


@dataclass
class Lease:
    model: str
    estimated_tokens: int
    deadline: int
    started: bool = False
    reconciled: bool = False
    generation: int = 0  # the model's quota generation when it was charged


@dataclass(frozen=True)
class LeaseSeed:
    """An in-flight call known to PostgreSQL, re-seeded into a restored state."""

    admission_id: str
    model: str
    estimated_tokens: int
    deadline_ms: int


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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
        state.tokens = min(quota.burst * UNITS, state.tokens + dt * quota.max_tokens_per_minute)
        if quota.max_requests_per_minute:
            rpm = quota.max_requests_per_minute
            state.requests = min(rpm * UNITS, state.requests + dt * rpm)
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
        state.tokens = min(quota.burst * UNITS, state.tokens + lease.estimated_tokens * UNITS)
        if quota.max_requests_per_minute:
            state.requests = min(quota.max_requests_per_minute * UNITS, state.requests + UNITS)

    def _has_capacity(self, name: str, est: int) -> bool:
        state = self.models[name]
        quota = state.quota
        return (
            len(self._inflight(name)) < quota.max_concurrent_requests
            and state.tokens >= est * UNITS
            and (not quota.max_requests_per_minute or state.requests >= UNITS)
        )

    def _wait(self, name: str, est: int, now: int) -> int:
        """Milliseconds until ``name`` has a slot, the tokens and a request for ``est``."""
        state = self.models[name]
        quota = state.quota
        token_wait = 0
        if state.tokens < est * UNITS:
            token_wait = ceil_div(est * UNITS - state.tokens, quota.max_tokens_per_minute)
        request_wait = 0
        if quota.max_requests_per_minute and state.requests < UNITS:
            request_wait = ceil_div(UNITS - state.requests, quota.max_requests_per_minute)
        slot_wait = 0
        inflight = self._inflight(name)
        if len(inflight) >= quota.max_concurrent_requests:
            slot_wait = inflight[len(inflight) - quota.max_concurrent_requests][0] - now
        return max(token_wait, request_wait, slot_wait)

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
            eligible = [n for n in fits if n not in held and self._has_capacity(n, est)]
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
                        and self.models[n].tokens < est * UNITS
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
            lease.started = True
            return Admitted(lease.model, admission_id)
        if est > quota.burst:
            return Rejected(rejection_reason(est, quota.burst))
        if not quota.enabled:
            return NotNow(None, now)
        if not self._has_capacity(model, est):
            return NotNow(now + self._wait(model, est, now), now)
        self._charge(model, est)
        self.leases[admission_id] = Lease(
            model, est, now + lease_ms, started=True, generation=self.models[model].generation
        )
        return Admitted(model, admission_id)

    def release(self, admission_id: str) -> bool:
        """Free the slot. Releasing twice, or an unknown id, is harmless."""
        return self.leases.pop(admission_id, None) is not None

    def reconcile(self, admission_id: str, actual_tokens: int, now: int) -> bool:
        """Debit ``actual - estimated`` tokens once per lease; a surplus is
        credited only within the quota generation that charged it."""
        lease = self.leases.get(admission_id)
        if lease is None or lease.reconciled or lease.model not in self.models:
            return False
        self._refill(lease.model, now)
        state = self.models[lease.model]
        surplus = lease.estimated_tokens - actual_tokens
        if surplus < 0 or self._same_generation(lease):
            state.tokens = min(state.quota.burst * UNITS, state.tokens + surplus * UNITS)
        lease.reconciled = True
        return True

    def set_quota(self, quota: Quota, now: int) -> None:
        """Create or change a model. Applies to the very next admission."""
        self._require_state()
        state = self.models.get(quota.name)
        if state is None:
            rpm = quota.max_requests_per_minute or 0
            self.models[quota.name] = ModelState(quota, quota.burst * UNITS, rpm * UNITS, now, 0)
            return
        self._refill(quota.name, now)
        old = state.quota
        had_rpm = bool(old.max_requests_per_minute)
        if (old.max_tokens_per_minute, old.max_requests_per_minute or 0, old.burst) != (
            quota.max_tokens_per_minute, quota.max_requests_per_minute or 0, quota.burst
        ):
            state.generation += 1
        state.quota = quota
        state.tokens = min(state.tokens, quota.burst * UNITS)
        rpm = quota.max_requests_per_minute or 0
        state.requests = min(state.requests, rpm * UNITS) if had_rpm else rpm * UNITS
        state.deficit = min(state.deficit, quota.burst)

    def remove_quota(self, name: str) -> bool:
        self._require_state()
        if self.models.pop(name, None) is None:
            return False
        for lid in [lid for lid, lease in self.leases.items() if lease.model == name]:
            del self.leases[lid]
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
        for quota in quotas:
            self.models[quota.name] = ModelState(quota, 0, 0, now, 0)
        for seed in leases:
            if seed.model in self.models:
                self.leases[seed.admission_id] = Lease(
                    seed.model, seed.estimated_tokens, seed.deadline_ms, started=True
                )
        return True

    def forget(self) -> None:
        """Simulate Redis losing all data."""
        self.models.clear()
        self.leases.clear()
        self.loaded = False
        self.epoch = self.seq = 0
        self.rr = ""
