"""The reference model's state and the helpers every operation shares (see the package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from balancer.admission import window
from balancer.admission.learned import (
    CLEAN_MS,
    MAX_WINDOW_MS,
    Learned,
    believed,
    effective,
    lower_of,
    note_bound,
    ramp_start,
    ramp_wait_ms,
    relaxed,
    slots_now,
    undone,
)
from balancer.admission.quota import Quota
from balancer.admission.reference.consumers import ConsumerRecords
from balancer.admission.shown import counted, first_bucket_rate, lowered, recent_rate, recent_step_ms, spent_early
from balancer.admission.values import UNITS, NoState, ceil_div, gate_room, gate_shape, outside_rate, refilled, token_cap, tokens_needed


@dataclass
class ModelState:
    quota: Quota
    tokens: int  # units; may go negative after a settlement debit
    requests: int  # units; 0 when the model has no RPM limit
    refilled_at: int  # ms
    deficit: int  # tokens
    generation: int = 0  # bumped when the rate or bucket size changes
    paused_until: int = 0  # ms: a 429 holds the model until then
    tat: int = 0  # ms: the start gate's theoretical arrival time of the next call start
    external: int = 0  # tokens per minute others use of this quota, learned from headers (below 0: none)
    synced_at: int = 0  # ms of the last x-ratelimit-remaining-tokens sync (0: none since a quota or token-limit change)
    sync_gap: int = 0  # units the token bucket was below the count less our calls on their way after it (<= 0)
    failures: int = 0  # consecutive transient failures (the circuit breaker)
    probing: bool = False  # the circuit is open: paused, then one call at a time until one is answered
    backoff_ms: int = 0  # the circuit's last pause
    learned: Learned = field(default_factory=Learned)  # limits that learn (balancer.admission.learned)
    #: With a window cap: (admitted ms, tokens) per admission of the last WINDOW_MS, oldest first (window.lua).
    window: list[tuple[int, int]] = field(default_factory=list)
    #: Estimated tokens of every call started under the model so far (state.lua, set_call_at).
    started_sum: int = 0
    #: The token gate's bucket (units), charged at call start as the provider charges on arrival, and its refill time.
    started_tokens: int = field(init=False)
    started_refilled_at: int = field(init=False)

    def __post_init__(self) -> None:
        self.started_tokens, self.started_refilled_at = self.tokens, self.refilled_at

    @property
    def limits(self) -> Quota:
        """The effective limits: the quota, or lower where the model learned so (limits.lua, eff_*)."""
        return effective(self.quota, self.learned)

    @property
    def refill_rate(self) -> int:
        """Units per ms (= tokens per minute) the bucket refills at: TPM less what others use (≤ 9/10)."""
        tpm = self.limits.max_tokens_per_minute
        return tpm - outside_rate(tpm, self.external)

    def tokens_needed(self, est: int) -> int:
        """Units a call of ``est`` tokens needs in a bucket (:func:`~balancer.admission.values.tokens_needed`)."""
        return tokens_needed(self.limits, est, self.external)

    def window_ms(self) -> int:
        return self.learned.window or CLEAN_MS

    def relax(self, now: int) -> None:
        """A clean window raises the learned limits that bound through it (limits.lua, relax)."""
        self.learned = relaxed(self.quota, self.learned, now)

    def learn_from_429(self, now: int, kind: str, sent: int, started: bool) -> None:
        """A 429 that paused the model (``started``) lowers its kind's effective
        limit to 7/10 of its level (concurrency: of the ``sent`` calls in flight
        that started, if any and fewer), at least 1; tokens and requests to 7/10 of
        the rate the first bucket shows, or of our recent rate if lower than the level
        (:func:`lowered`). A 429 within a window of a raise undoes that raise
        (:func:`undone`) and doubles the window. Any other 429 for concurrency caps it at
        the started calls in flight less one, and its peak at them. A kind whose limit
        the provider states is not lowered (signals.lua, learn_from_429)."""
        if not self.quota.learn:
            return
        k, limits = self.learned, self.limits
        if (kind == "tokens" and k.htpm) or (kind == "requests" and k.hrpm):
            return  # the provider states that limit: its 429 was a race the pause covers
        if not started:
            if kind == "concurrency" and 1 < sent <= limits.max_concurrent_requests:
                if k.lcap == 0:
                    k.pcap = limits.max_concurrent_requests
                k.lcap = max(1, sent - 1)
                k.lowered_at = now
            if kind == "concurrency" and k.lcap and k.lcap < sent < k.pcap:
                k.pcap = sent  # the 429 that started the pause may be for a call started after this one
            return
        w = self.window_ms()
        probed = k.raised_at > k.lowered_at and now - k.raised_at < w  # the last raise drew it: undone
        if probed:
            k.window = min(w * 2, MAX_WINDOW_MS)
        q, t, step = self.quota, now - k.first_at, recent_step_ms(self.quota)
        if kind == "tokens" and probed and k.ltpm:
            k.ltpm = undone(k.ltpm, k.ptpm, kind)
        elif kind == "requests" and probed and k.lrpm:
            k.lrpm = undone(k.lrpm, k.prpm, kind)
        elif kind == "concurrency" and probed and k.lcap:
            k.lcap = undone(k.lcap, k.pcap, kind)
        elif kind == "tokens":
            change = lowered(limits.max_tokens_per_minute,
                             first_bucket_rate(q.max_tokens_per_minute, q.burst, k.first_tokens, t),
                             recent_rate(k.recent_count(), step, now, tokens=True))
            if change:
                k.ptpm, k.ltpm = change
        elif kind == "requests":
            if not limits.max_requests_per_minute:
                return
            change = lowered(limits.max_requests_per_minute,
                             first_bucket_rate(q.max_requests_per_minute or 0, q.request_burst, k.first_calls, t),
                             recent_rate(k.recent_count(), step, now, tokens=False))
            if change:
                k.prpm, k.lrpm = change
        else:
            k.pcap = min(limits.max_concurrent_requests, sent) if sent else limits.max_concurrent_requests
            k.lcap = max(1, math.floor(k.pcap * 7 / 10))
        k.lowered_at = now

    def learn_from_spent(self, now: int, left: int, unstarted: int, counted_at: int | None = None) -> None:
        """Requests spent in the first bucket: ``left`` after our calls on their way,
        ``unstarted`` of them admitted and not started. A provider that states no
        request limit shows its rate (of the calls started and those), and an RPM well
        above it is lowered to it before its 429, once (:func:`spent_early`; signals.lua,
        learn_from_spent), read as of ``counted_at`` (the start of the call that carried the count)."""
        k, limits, q = self.learned, self.limits, self.quota
        if not q.learn or left > 0 or k.hrpm or k.lrpm or not limits.max_requests_per_minute:
            return
        shown = first_bucket_rate(q.max_requests_per_minute or 0, q.request_burst, k.first_calls + unstarted,
                                  max(0, (counted_at if counted_at is not None else now) - k.first_at))
        rpm = spent_early(limits.max_requests_per_minute, shown)
        if rpm:
            k.prpm, k.lrpm, k.lowered_at = rpm, rpm, now

    def count_start(self, est: int, now: int) -> None:
        """A call starts under the quota: the first bucket and the recent window count it, the
        recent count a step at a time (limits.lua, count_start; balancer.admission.shown)."""
        k, step = self.learned, recent_step_ms(self.quota)
        k.first_at = k.first_at or now
        k.ramp_at = k.ramp_at or now  # slow start's steps count from here
        k.first_calls, k.first_tokens = k.first_calls + 1, k.first_tokens + est
        k.set_recent_count(counted(k.recent_count(), step, now, est))

    def ramp_quota(self, in_flight: int, now: int) -> None:
        """A quota set or restored: slow start opens from the ``in_flight`` live calls, or what the
        provider just served at once (:func:`ramp_start`), its steps counted from the next call's
        start (limits.lua, ramp_quota)."""
        self.learned.ramp_from = ramp_start(self.learned, in_flight, now)
        self.learned.ramp_at = 0

    def sync_limits(self, limit_tokens: int | None, limit_requests: int | None, confirmed: bool = False) -> None:
        """Adopt the provider's x-ratelimit-limit-* (signals.lua, sync_limits): one far
        below the limit the model is held to waits for a 429 that carries it
        (``confirmed``) or a second reply that states it again (:func:`believed`); a changed
        one makes what 429s taught of that kind stale, and forgets the cap's peak (no
        header states concurrency; a provider that changed its limits may have changed
        that one too); a new token limit restarts the outside-use estimate (its gaps
        measured our own overdraft)."""
        if not self.quota.learn:
            return
        k, changed, limits = self.learned, False, self.limits
        if limit_tokens is not None and limit_tokens > 0 and limit_tokens != k.htpm:
            if not believed(limit_tokens, limits.max_tokens_per_minute, k.ctpm, confirmed):
                k.ctpm = limit_tokens
            else:
                if k.htpm > 0:
                    k.ltpm, k.ptpm, k.window, changed = 0, 0, 0, True
                tpm = self.quota.max_tokens_per_minute
                if lower_of(tpm, limit_tokens) != lower_of(tpm, k.htpm):  # a new token limit: others' use is re-learned
                    self.external, self.synced_at = 0, 0
                k.htpm, k.ctpm = limit_tokens, 0
        elif limit_tokens is not None and limit_tokens > 0:
            k.ctpm = 0
        if limit_requests is not None and limit_requests > 0 and limit_requests != k.hrpm:
            if not believed(limit_requests, limits.max_requests_per_minute or 0, k.crpm, confirmed):
                k.crpm = limit_requests
            else:
                if k.hrpm > 0:
                    k.lrpm, k.prpm, k.window, changed = 0, 0, 0, True
                k.hrpm, k.crpm = limit_requests, 0
        elif limit_requests is not None and limit_requests > 0:
            k.crpm = 0
        if changed and k.lcap:
            k.pcap = self.quota.max_concurrent_requests


@dataclass
class Lease:
    model: str
    estimated_tokens: int
    deadline: int
    started: bool = False
    generation: int = 0  # the model's quota generation when it was charged
    call_at: int = 0  # ms: when its call starts, once through its start gates (set when it is started)
    #: The model's started_sum before this call's first start (None: not started here, or restored).
    started_before: int | None = None


@dataclass
class ReadyEntry:
    task_id: int
    admission_id: str
    estimated_tokens: int
    expires_at: int  # ms: not taken by then, it is dropped and its task goes back to pending


@dataclass
class ReferenceState:
    """The admission state in memory, and the helpers its operations share."""

    models: dict[str, ModelState] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    #: Per model, the latency sketch's fields (balancer.estimates.latency.record).
    latency: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Per model, its ready list, oldest first (see :meth:`stock`).
    ready: dict[str, list[ReadyEntry]] = field(default_factory=dict)
    #: The worker processes consuming each model's queue (consumers.lua).
    consumers: ConsumerRecords = field(default_factory=ConsumerRecords)
    loaded: bool = False
    epoch: int = 0
    seq: int = 0
    rr: str = ""
    backend_failures: int = 0  # transient failures in a row on every model, no answer between (trip.lua's bfails)

    # -- helpers ---------------------------------------------------------------
    def _names(self) -> list[str]:
        return sorted(self.models, key=lambda n: n.encode())

    def _inflight(self, name: str) -> list[tuple[int, str]]:
        """(deadline, id) of the model's leases in sorted-set order."""
        return sorted(
            ((lease.deadline, lid) for lid, lease in self.leases.items() if lease.model == name),
            key=lambda pair: (pair[0], pair[1].encode()),
        )

    def _live_count(self, name: str, now: int) -> int:
        """The model's leases live at ``now`` (limits.lua, ramp_quota: ZCOUNT over (now, +inf))."""
        return sum(1 for deadline, _ in self._inflight(name) if deadline > now)

    def _refill(self, name: str, now: int) -> None:
        state = self.models[name]
        state.tokens, state.requests = refilled(state.limits, state.tokens, state.requests, state.refilled_at,
                                                state.external, now, state.tat)
        state.refilled_at = max(state.refilled_at, now)
        state.relax(now)
        if state.quota.window_cap:  # admissions WINDOW_MS old leave the window
            del state.window[:window.expired_count(state.window, now)]

    def _purge(self, name: str, now: int) -> None:
        for deadline, lid in self._inflight(name):
            if deadline > now:
                break
            lease = self.leases.pop(lid)
            if not lease.started:
                self._refund(name, lease, now)

    def _same_generation(self, lease: Lease) -> bool:
        """Whether ``lease`` was charged under the model's current quota.

        Credits go back only to the generation that paid for them: after the
        rate or burst is lowered, an old call's surplus must not refill the new,
        smaller bucket (traffic would then exceed the new quota).
        """
        return lease.generation == self.models[lease.model].generation

    def _refund(self, name: str, lease: Lease, now: int) -> None:
        """Give back what an admission charged, for a call that never happened: its request no
        further than the start gate's room (:func:`gate_room`), as a refill."""
        if not self._same_generation(lease):
            return
        state = self.models[name]
        quota = state.limits
        state.tokens = min(token_cap(quota), state.tokens + lease.estimated_tokens * UNITS)
        if quota.max_requests_per_minute:
            state.requests = min(quota.request_burst * UNITS, state.requests + UNITS, gate_room(quota, state.tat, now))

    def _slot_cap(self, name: str, now: int) -> int:
        """The concurrency cap (slow start's while it ramps: :func:`ramp_cap`), or 1 while the circuit is open."""
        state = self.models[name]
        return 1 if state.probing else slots_now(state.quota, state.learned, now)

    def _has_capacity(self, name: str, est: int, now: int) -> bool:
        """No pause, a slot, the tokens and a request for ``est``; each limit found short
        binds now (:func:`note_bound`; limits.lua, has_capacity); and room in a window cap."""
        state = self.models[name]
        quota = state.limits
        if state.paused_until > now:
            return False
        slots = len(self._inflight(name)) < self._slot_cap(name, now)
        tokens = state.tokens >= state.tokens_needed(est)
        requests = not quota.max_requests_per_minute or state.requests >= UNITS
        note_bound(state.learned, now, slots, tokens, requests)
        return slots and tokens and requests and window.fits(state.quota, state.window, est)

    def _wait(self, name: str, est: int, now: int) -> int:
        """Milliseconds until ``name`` has a slot, the tokens and a request for ``est``, room in its
        window, and no pause."""
        state = self.models[name]
        quota = state.limits
        token_wait = 0
        need = state.tokens_needed(est)
        if state.tokens < need:
            token_wait = ceil_div(need - state.tokens, state.refill_rate)
        request_wait = 0
        if quota.max_requests_per_minute and state.requests < UNITS:
            request_wait = ceil_div(UNITS - state.requests, quota.max_requests_per_minute)
        slot_wait = 0
        inflight, cap = self._inflight(name), self._slot_cap(name, now)
        if len(inflight) >= cap:
            slot_wait = inflight[len(inflight) - cap][0] - now
            if not state.probing and cap < quota.max_concurrent_requests:  # slow start's next step may come first
                slot_wait = min(slot_wait, ramp_wait_ms(state.learned, now))
        window_wait = window.wait_ms(state.quota, state.window, est, now)
        return max(token_wait, request_wait, slot_wait, state.paused_until - now, window_wait)

    @staticmethod
    def _refill_started(state: ModelState, now: int) -> None:
        dt = max(0, now - state.started_refilled_at)
        state.started_tokens = min(token_cap(state.limits), state.started_tokens + dt * state.refill_rate)
        state.started_refilled_at = max(state.started_refilled_at, now)

    def _token_gate(self, state: ModelState, est: int, now: int) -> int:
        """Milliseconds until the provider, charging on arrival, has the tokens for
        a call starting now; then charge them (the bucket may go negative).

        Admission charges the first bucket early; calls that then wait in the
        broker or a busy worker would start in bunches the provider refuses.
        This second bucket refills, settles and syncs like the first.
        """
        self._refill_started(state, now)
        need = state.tokens_needed(est)
        wait = ceil_div(need - state.started_tokens, state.refill_rate) if state.started_tokens < need else 0
        state.started_tokens -= est * UNITS
        return wait

    def _start_delay(self, name: str, est: int, first_start: bool, now: int) -> int:
        """Both gates for a call about to start; a restart was charged at the token
        gate, and counted toward the first bucket, already."""
        wait = 0
        if first_start:
            wait = self._token_gate(self.models[name], est, now)
            self.models[name].count_start(est, now)
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
        rpm = state.limits.max_requests_per_minute
        if not rpm:
            return 0
        interval, tolerance = gate_shape(state.limits)
        start = max(now, state.tat - tolerance)
        state.tat = max(state.tat, start) + interval
        return start - now

    def _charge(self, name: str, est: int, now: int) -> None:
        state = self.models[name]
        state.tokens -= est * UNITS
        if state.limits.max_requests_per_minute:
            state.requests -= UNITS
        if state.quota.window_cap:
            state.window.append((now, est))

    def _new_lease(self, name: str, est: int, deadline: int, started: bool) -> str:
        self.seq += 1
        lid = f"{self.epoch}-{self.seq}"
        self.leases[lid] = Lease(name, est, deadline, started=started, generation=self.models[name].generation)
        return lid

    def _require_state(self) -> None:
        if not self.loaded:
            raise NoState()
