"""What a call's end tells the reference model: finish, settle, hold, heartbeat,
and the provider's signals (headers, 429s, transient failures)."""

from __future__ import annotations

import math

from balancer.admission.learned import note_bound, note_served, served_more, slots_now
from balancer.admission.reference.state import ModelState, ReferenceState
from balancer.admission.values import (
    CIRCUIT_BASE_MS,
    CIRCUIT_FAILURES,
    CIRCUIT_MAX_MS,
    SYNC_LAG_MS,
    UNITS,
    Settlement,
    gap_growth,
    gate_shape,
    known_rate,
    most_charged,
    outside_estimate,
    token_cap,
)
from balancer.estimates import latency


class Signals(ReferenceState):
    """A call's end and the provider's signals."""

    def release(self, admission_id: str, now: int) -> bool:
        """Free the slot. Releasing twice, or an unknown id, is harmless."""
        return self.finish(admission_id, Settlement(), now)[1]

    def finish(self, admission_id: str, settlement: Settlement, now: int) -> tuple[bool, bool]:
        """Settle, sync to the headers, and free the slot: what ``finish.lua``
        does in one round trip. A second finish finds no lease. Returns (settled, released)."""
        settled = self._settle(admission_id, settlement, now)
        lease = self.leases.get(admission_id)
        if lease is not None and lease.model in self.models and settlement.latency_ms is not None:
            state = self.models[lease.model]
            state.failures, state.probing, state.backoff_ms = 0, False, 0  # an answer closes the circuit
            self.backend_failures = 0  # and the backend answers: a failure is a task's again (trip)
            if state.quota.learn:
                note_served(state.learned, now, sum(1 for deadline, lid in self._inflight(lease.model)
                                                    if deadline > now and self.leases[lid].started))
            completion = settlement.completion_tokens or 0
            latency.record(
                self.latency.setdefault(lease.model, {}), latency.bucket_of(settlement.latency_ms),
                settlement.latency_ms, max(0, (settlement.used_tokens or 0) - completion), completion,
            )
        if lease is not None and lease.model in self.models:
            state = self.models[lease.model]
            if len(self._inflight(lease.model)) >= state.limits.max_concurrent_requests:
                note_bound(state.learned, now, False, True, True)  # a call ended on a full model: its cap bound
        released = self.leases.pop(admission_id, None) is not None
        return settled, released

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

    def heartbeat(self, admission_id: str, lease_ms: int, now: int, starting: bool = False) -> bool:
        """Extend a live lease to ``now + lease_ms``: what ``heartbeat.lua`` does.

        An expired lease is not revived: its slot may carry another call now.
        With ``starting`` (a call about to start on it), the lease is dropped
        instead if its model is gone or has more live leases, this one
        included, than its concurrency cap as stored (lowered since the lease
        was taken): no new call starts above a lowered cap. Nothing is refunded.
        Returns True if the lease was live and is extended.
        """
        lease = self.leases.get(admission_id)
        if lease is None or lease.deadline <= now:
            return False
        state = self.models.get(lease.model)
        if starting and (state is None or sum(
                1 for other in self.leases.values() if other.model == lease.model and other.deadline > now
        ) > state.limits.max_concurrent_requests):
            del self.leases[admission_id]
            return False
        lease.deadline = now + lease_ms
        return True

    def _settle(self, admission_id: str, settlement: Settlement, now: int) -> bool:
        """Settle a finished call, then sync to the provider's headers.

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
        if settlement.used_tokens is not None:
            charged = settlement.used_tokens
            if not state.quota.settles:
                charged = settlement.reserved_tokens if settlement.reserved_tokens is not None else lease.estimated_tokens
            charged = most_charged(charged, lease.estimated_tokens, state.quota)
            surplus = lease.estimated_tokens - charged
            if surplus < 0 or (state.quota.settles and self._same_generation(lease)):
                state.tokens = min(token_cap(state.limits), state.tokens + surplus * UNITS)
                state.started_tokens = min(token_cap(state.limits), state.started_tokens + surplus * UNITS)
            settled = True
        state.sync_limits(settlement.limit_tokens, settlement.limit_requests)
        spent = self._sync_to_headers(lease.model, now, settlement.remaining_tokens, settlement.remaining_requests,
                                      admission_id)
        if spent is not None:
            state.learn_from_spent(now, *spent)
        return settled

    def _unarrived(self, model: str, now: int, own: str | None
                   ) -> tuple[int, int, int, int, int | None, int, int | None]:
        """The model's live calls the provider had not counted when it sent the
        headers being synced (signals.lua, unarrived): leases not started, and
        leases whose call starts after ``now - SYNC_LAG_MS`` (waiting at a start
        gate, or on their way). Their tokens and number, then those of the started
        ones; the call being finished (``own``) is not one of them. Then, for counts
        as old as the call ``own`` (taken as the provider admitted it): when it
        started (None: no such call), the tokens of the live calls not started or
        started after it, and of every call started after it, ended ones too (None:
        ``own`` has no started sum, a restored lease)."""
        own_lease = self.leases.get(own) if own else None
        own_at = own_lease.call_at if own_lease is not None and own_lease.started and 0 < own_lease.call_at < now \
            else None
        since_own = None
        if own_at is not None and own_lease is not None and own_lease.started_before is not None:
            since_own = max(0, self.models[model].started_sum - own_lease.started_before - own_lease.estimated_tokens)
        tokens = calls = started_tokens = started_calls = aged_tokens = 0
        for deadline, lid in self._inflight(model):
            if lid == own or deadline <= now:
                continue
            lease = self.leases[lid]
            waiting = lease.started and lease.call_at > now - SYNC_LAG_MS
            if not lease.started or waiting:
                tokens, calls = tokens + lease.estimated_tokens, calls + 1
            if waiting:
                started_tokens, started_calls = started_tokens + lease.estimated_tokens, started_calls + 1
            if own_at is not None and (not lease.started or lease.call_at > own_at):
                aged_tokens += lease.estimated_tokens
        return tokens, calls, started_tokens, started_calls, own_at, aged_tokens, since_own

    def _sync_to_headers(self, model: str, now: int, remaining_tokens: int | None, remaining_requests: int | None,
                         own: str | None = None) -> tuple[int, int, int | None] | None:
        """Lower the buckets to the provider's ``x-ratelimit-remaining-*``, the token
        buckets less what our calls it has not counted yet will take (:meth:`_unarrived`; ``own``:
        the lease of the call whose answer carried them, or None for a 429); never raise them.
        Returns the requests left for more calls, and how many of those on their way
        were not started (None: not sent, or no RPM).

        The token gap (our level against the count less our calls on their way)
        grows between two syncs by what others used of the quota beyond
        ``external`` meanwhile; that growth, its part above 0 only
        (:func:`~balancer.admission.values.gap_growth`), moves ``external``
        (:func:`~balancer.admission.values.outside_estimate`), and the bucket refills
        at TPM less that (never below a tenth of TPM). So a steady outside user is expected instead of met as a
        429 after every sync. The gap left after a sync (``sync_gap``: the bucket
        is never raised, so a gap below 0 stays) is not counted again at the
        next. The estimate may fall below 0, to a tenth of TPM (signals.lua says
        why); only its part above 0 is others' use (``outside_rate``).
        """
        if remaining_tokens is None and remaining_requests is None:
            return None
        state = self.models[model]
        tokens, calls, started_tokens, started_calls, own_at, aged_tokens, since_own = self._unarrived(model, now, own)
        if remaining_tokens is not None:
            remaining = remaining_tokens * UNITS
            ours_left = remaining - tokens * UNITS  # the count less our calls on their way
            gate_left = remaining - started_tokens * UNITS  # the count less our started calls on their way
            explained = ours_left  # or, for a count as old as the call that carried it, more (signals.lua)
            if own_at is not None:
                refilled = min(token_cap(state.limits), remaining + (now - own_at) * state.refill_rate)
                explained = max(ours_left, refilled - aged_tokens * UNITS)
                if since_own is not None and known_rate(state.quota.learn, state.learned.htpm, state.external):
                    arrived = max(0, since_own - started_tokens)  # started since, and counted by now
                    ours_left = max(ours_left, refilled - (arrived + tokens) * UNITS)
                    gate_left = max(gate_left, refilled - (arrived + started_tokens) * UNITS)
            gap = state.tokens - explained
            if state.synced_at > 0:
                count_full = remaining >= token_cap(state.limits)
                state.external = outside_estimate(state.external, state.limits.max_tokens_per_minute,
                                                  gap_growth(gap, state.sync_gap), now - state.synced_at, count_full)
            state.tokens = min(state.tokens, ours_left)
            state.synced_at, state.sync_gap = now, state.tokens - explained  # (<= 0)
            ReferenceState._refill_started(state, now)
            state.started_tokens = min(state.started_tokens, gate_left)
        if remaining_requests is not None and state.limits.max_requests_per_minute:
            # The request bucket and the start gate go to the count itself (signals.lua says
            # why); calls admitted but not started wait at the gate: at most that many more starts now.
            state.requests = min(state.requests, remaining_requests * UNITS)
            interval, tolerance = gate_shape(state.limits)
            state.tat = max(state.tat, now + tolerance - (remaining_requests - 1) * interval)
            return remaining_requests - calls, calls - started_calls, own_at
        return None

    def penalize(
        self, model: str, retry_after_ms: int, now: int,
        remaining_tokens: int | None = None, remaining_requests: int | None = None,
        limit_tokens: int | None = None, limit_requests: int | None = None, refused: str | None = None,
    ) -> bool:
        """A 429: pause ``model`` until now + Retry-After, unless a pause is running,
        and lower its buckets to the provider's remaining counts.

        One penalty per window: N concurrent 429s pause the model once, not N
        times as long. The pause holds the model whichever limit (tokens,
        requests, concurrency) the provider applied. The header sync applies to
        every 429: it is the surest sign that someone else uses the quota.
        A pause it starts also lowers the effective limit of the kind behind
        the 429 (:meth:`_limit_kind`), if the model learns; the limit headers
        are synced first, and a 429 for tokens or requests with no remaining
        count empties that bucket (:meth:`_empty_after_429`). While the pause
        runs, calls admitted before it do not start (``ReferenceCore.renew``).
        Returns True if it started a pause.
        """
        state = self.models.get(model)
        if state is None:
            return False
        self._refill(model, now)
        state.sync_limits(limit_tokens, limit_requests, confirmed=True)
        started = state.paused_until <= now
        if started:
            state.paused_until = now + retry_after_ms
        if state.quota.learn:
            kind, sent = self._limit_kind(model, now, remaining_tokens, remaining_requests, self._refused_at(model, refused))
            state.learn_from_429(now, kind, sent, started)
            self._empty_after_429(state, now, kind, remaining_tokens, remaining_requests)
        self._sync_to_headers(model, now, remaining_tokens, remaining_requests)
        return started

    @staticmethod
    def _empty_after_429(state: ModelState, now: int, kind: str, remaining_tokens: int | None,
                         remaining_requests: int | None) -> None:
        """A 429 for tokens or requests that does not say what is left says nothing
        is: that bucket (both token buckets for tokens) is emptied, as the header
        sync would with a remaining count of 0 (signals.lua, empty_after_429)."""
        if not state.quota.learn:
            return
        if kind == "tokens" and remaining_tokens is None:
            ReferenceState._refill_started(state, now)
            state.tokens, state.started_tokens = min(state.tokens, 0), min(state.started_tokens, 0)
        elif kind == "requests" and remaining_requests is None and state.limits.max_requests_per_minute:
            state.requests = min(state.requests, 0)

    def _refused_at(self, model: str, refused: str | None) -> int | None:
        """When the refused call started (signals.lua, refused_at): None if unknown."""
        lease = self.leases.get(refused) if refused else None
        if lease is None or lease.model != model or not lease.started or not lease.call_at:
            return None
        return lease.call_at

    def _limit_kind(self, model: str, now: int, remaining_tokens: int | None,
                    remaining_requests: int | None, before: int | None = None) -> tuple[str, int]:
        """The kind of limit behind a 429, and how many of the model's calls in
        flight started (signals.lua, limit_kind): with ``before`` (:meth:`_refused_at`),
        by the refused call's start, so calls started after it do not count as ones
        the provider had when it refused it (in learn.toml's first second, conc-10's
        cap was read as 7 where its provider took 4, and its probes of a fifth slot
        were not slowed at the level refused: ``PEAK_WINDOWS``).

        From the headers when they say: no request left; fewer tokens left than
        the calls in flight average; both left (the provider counted calls in
        progress). Otherwise the lowest of our own buckets as a share of its
        size (free slots for concurrency, of the cap in force: slow start's while
        it ramps); ties go to requests, then tokens. Concurrency is ruled out when
        the provider lately served more calls at once than had started
        (:func:`served_more`)."""
        state = self.models[model]
        limits = state.limits
        leases = [self.leases[lid] for _, lid in self._inflight(model)]
        n = len(leases)
        total = sum(lease.estimated_tokens for lease in leases)
        sent = sum(1 for lease in leases if lease.started and (before is None or lease.call_at <= before))
        rpm = limits.max_requests_per_minute or 0
        if remaining_requests is not None and remaining_requests < 1:
            return "requests", sent
        if remaining_tokens is not None and remaining_tokens * n < total:
            return "tokens", sent
        if remaining_tokens is not None and (remaining_requests is not None or rpm == 0):
            return "concurrency", sent
        cap = token_cap(limits)
        ft = (remaining_tokens * UNITS if remaining_tokens is not None else state.tokens) / cap
        fr = math.inf
        if rpm > 0:
            size = limits.request_burst * UNITS
            fr = (remaining_requests * UNITS if remaining_requests is not None else state.requests) / size
        slots = slots_now(state.quota, state.learned, now)
        fc = math.inf if served_more(state.learned, now, sent) else (slots - n) / slots
        if fr <= ft and fr <= fc:
            return "requests", sent
        return ("tokens" if ft <= fc else "concurrency"), sent

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
        flight when it opened) do not lengthen it. Nor is one counted from the
        ``CIRCUIT_FAILURES``-th failure in a row on every model with no answer
        anywhere between (``backend_failures``): the backend as a whole is down.
        """
        state = self.models.get(model)
        if state is None:
            return True, False
        self._refill(model, now)
        self.backend_failures += 1
        if state.probing:
            if state.paused_until > now:
                return False, False
            state.backoff_ms = min(state.backoff_ms * 2, CIRCUIT_MAX_MS)
            state.paused_until = now + state.backoff_ms
            return False, True
        state.failures += 1
        if state.failures < CIRCUIT_FAILURES:
            return self.backend_failures < CIRCUIT_FAILURES, False
        state.failures, state.probing, state.backoff_ms = 0, True, CIRCUIT_BASE_MS
        state.paused_until = max(state.paused_until, now + CIRCUIT_BASE_MS)
        return False, True
