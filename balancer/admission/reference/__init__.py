"""A pure-Python model of the admission core, step for step the same as the Lua.

Why it exists: the Lua scripts are the product, but Lua inside Redis is hard to
reason about and impossible to step through. This model has *exactly* the
same semantics, so Hypothesis can drive both with the same random operations
and demand identical decisions (``tests/admission/test_differential.py``). It is also
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
   paused by a 429 (``penalize``) or an open circuit (``trip``), and, with a
   window cap, have room in their window (a minute and the hop) (:mod:`balancer.admission.window`): a model whose
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
   With ``consumed_only`` (the dispatcher's batches), a model no worker
   consumes now (no live record, :meth:`note_consumers`) is passed over as a
   disabled one is: work goes only where someone takes it from the queue.
5. No eligible model: the answer is **not now**, with the earliest time any of
   its models could take it (token refill, request refill, or the deadline of
   the lease whose expiry frees a slot). The model among those short of
   *tokens* (its bucket's, or its window cap's) that could serve it soonest is **held** for the rest of the batch,
   so a stream of small tasks behind a large one cannot keep draining the
   bucket it is waiting for (no starvation). Holding affects tokens only on
   that one model; other models keep serving (no head-of-line blocking).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from balancer.admission import window
from balancer.admission.quota import Quota
from balancer.admission.reference.consumers import ConsumerRecords
from balancer.admission.reference.signals import Signals
from balancer.admission.reference.state import Lease, ModelState, ReadyEntry
from balancer.admission.values import (
    UNITS,
    Admitted,
    Candidate,
    Decision,
    LeaseSeed,
    NotNow,
    ReadyTask,
    Rejected,
    Settlement,
    ceil_div,
    rejection_reason,
    token_cap,
)


class ReferenceCore(Signals):
    """The admission state and its operations, in memory. See the module docstring."""

    # -- operations ------------------------------------------------------------
    def admit(
        self, candidates: Sequence[Candidate], now: int, lease_ms: int, base_quantum: int, consumed_only: bool = False
    ) -> list[Decision]:
        self._require_state()
        names = self._names()
        for name in names:
            self._refill(name, now)
            self._purge(name, now)
        serves = {name for name in names if not consumed_only or self.consumers.consumed(name, now)}
        held: set[str] = set()
        decisions: list[Decision] = []
        for cand in candidates:
            est = cand.estimated_tokens
            pool = names if cand.allowed is None else [n for n in names if n in cand.allowed]
            if not pool:
                wanted = ",".join(sorted(cand.allowed)) if cand.allowed else ""
                decisions.append(Rejected.no_such_model(wanted))
                continue
            largest = max(self.models[n].quota.burst for n in pool)
            if est > largest:
                decisions.append(Rejected(rejection_reason(est, largest)))
                continue
            fits = [n for n in pool if self.models[n].quota.enabled and est <= self.models[n].quota.burst and n in serves]
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
                        and (self.models[n].tokens < self.models[n].tokens_needed(est)
                             or window.tokens_short(self.models[n].quota, self.models[n].window, est))
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
            self._charge(chosen, est, now)
            lid = self._new_lease(chosen, est, now + lease_ms, started=False)
            self.rr = chosen
            decisions.append(Admitted(chosen, lid))
        return decisions

    def renew(self, admission_id: str, model: str, est: int, now: int, lease_ms: int) -> Decision:
        """Re-assert a slot (a redelivered message, or a worker starting its call).

        If the model has been disabled since, the call must not start: the
        lease is dropped (refunded if never started) and the answer is not-now.
        A model that learns and is paused by a 429 starts no call admitted
        before the pause: a lease not started yet is dropped and refunded, and
        the answer is not-now until the pause ends (the circuit breaker's pause
        leaves its calls alone).
        So too if the model's live leases, this one included, are above its
        concurrency cap (a cap lowered since admission: calls already running
        are not recalled, but no new one starts above the new cap); the
        not-now then names the model's next room.
        If the lease still exists it is extended and marked started. If it has
        expired, the slot is re-acquired like a fresh admission on that model
        (slot, tokens, request), outside WDRR; if there is no room the answer
        is not-now and the caller must not call the backend.
        """
        self._require_state()
        if model not in self.models:
            return Rejected.no_such_model(model)
        self._refill(model, now)
        self._purge(model, now)
        quota = self.models[model].quota
        lease = self.leases.get(admission_id)
        if lease is not None and not quota.enabled:
            # Disabled since admission: this call must not start. Give the slot
            # back, and the tokens too if no call was ever made under it.
            del self.leases[admission_id]
            if not lease.started:
                self._refund(model, lease, now)
            return NotNow(None, now)
        state = self.models[model]
        if lease is not None and quota.learn and state.paused_until > now and not state.probing and not lease.started:
            # Admitted before a 429's pause and not started: the provider refuses
            # it now, and the limits it was admitted under were too high. Given back.
            del self.leases[admission_id]
            self._refund(model, lease, now)
            return NotNow(state.paused_until, now)
        if lease is not None and len(self._inflight(lease.model)) > self.models[model].limits.max_concurrent_requests:
            del self.leases[admission_id]
            if not lease.started:
                self._refund(model, lease, now)
            return NotNow(now + self._wait(model, lease.estimated_tokens, now), now)
        if lease is not None:
            lease.deadline = now + lease_ms
            first = not lease.started
            delay = self._start_delay(model, lease.estimated_tokens, first, now)
            self._start_call(model, lease, now + delay, first)
            return Admitted(lease.model, admission_id, delay)
        if est > quota.burst:
            return Rejected(rejection_reason(est, quota.burst))
        if not quota.enabled:
            return NotNow(None, now)
        if not self._has_capacity(model, est, now):
            return NotNow(now + self._wait(model, est, now), now)
        self._charge(model, est, now)
        delay = self._start_delay(model, est, True, now)
        self.leases[admission_id] = Lease(model, est, now + lease_ms, generation=self.models[model].generation)
        self._start_call(model, self.leases[admission_id], now + delay, first=True)
        return Admitted(model, admission_id, delay)

    def _start_call(self, name: str, lease: Lease, at: int, first: bool) -> None:
        """The lease's call on ``name`` starts at ``at`` (state.lua, set_call_at): at its ``first``
        start it keeps the model's started_sum before its own tokens, which are then added."""
        if first:
            state = self.models[name]
            lease.started_before = state.started_sum
            state.started_sum += lease.estimated_tokens
        lease.started, lease.call_at = True, at

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
                self._charge(name, est, now)
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
        self._start_call(name, self.leases[head.admission_id], now + delay, first=True)
        restock = len(self.ready.get(name, [])) < self.models[name].limits.max_concurrent_requests
        return ReadyTask(head.task_id, head.admission_id, name, head.estimated_tokens, delay, restock)

    def take_ready(self, now: int, lease_ms: int, consumed_only: bool = False) -> tuple[list[ReadyTask], list[ReadyTask]]:
        """The dispatcher's pass over the ready lists (``take_ready.lua``): per model
        with entries, in name order, what free slots take now (leases not
        started: the worker renews them) and what is dropped (to go back to
        pending). A freed slot whose finish could not take its next call (the
        tokens were short then) is filled from here, so no entry is stranded.
        With ``consumed_only``, a model no worker consumes takes nothing and its
        whole list is dropped at once."""
        self._require_state()
        taken: list[ReadyTask] = []
        dropped: list[ReadyTask] = []
        for name in self._names():
            if not self.ready.get(name):
                continue
            self._refill(name, now)
            self._purge(name, now)
            if consumed_only and not self.consumers.consumed(name, now):
                got, lost = [], self.ready.pop(name)  # type: list[ReadyEntry], list[ReadyEntry]
            else:
                got, lost = self._take_ready(name, now, lease_ms, False, math.inf, True)
            taken += [ReadyTask(e.task_id, e.admission_id, name, e.estimated_tokens) for e in got]
            dropped += [ReadyTask(e.task_id, e.admission_id, name, e.estimated_tokens) for e in lost]
        return taken, dropped

    def note_consumers(self, consumer: str, models: Sequence[str], ttl_ms: int, now: int) -> int:
        """A worker's beat (``consumers.lua``): :meth:`ConsumerRecords.note`. Needs no live state."""
        return self.consumers.note(consumer, models, ttl_ms, now)

    def set_quota(self, quota: Quota, now: int) -> None:
        """Create or change a model. Applies to the very next admission."""
        self._require_state()
        state = self.models.get(quota.name)
        if state is None:
            state = self.models[quota.name] = ModelState(quota, token_cap(quota), quota.request_burst * UNITS, now, 0)
            state.ramp_quota(self._live_count(quota.name, now), now)  # a model recreated under its calls in flight
            return
        self._refill(quota.name, now)
        self._refill_started(state, now)
        old = state.quota
        had_rpm = bool(state.limits.max_requests_per_minute)
        if (old.max_tokens_per_minute, old.max_requests_per_minute or 0, old.burst, old.request_burst) != (
            quota.max_tokens_per_minute, quota.max_requests_per_minute or 0, quota.burst, quota.request_burst
        ):
            state.generation += 1
        state.quota = quota
        # What 429s taught is forgotten, and so are the provider's limit headers.
        k = state.learned
        k.ltpm = k.lrpm = k.lcap = k.ptpm = k.prpm = k.pcap = k.lowered_at = k.raised_at = k.window = 0
        k.first_at = k.first_calls = k.first_tokens = 0  # the new quota's first bucket, and its recent count
        k.set_recent_count((0, 0, 0, 0, 0, 0, 0))
        state.ramp_quota(self._live_count(quota.name, now), now)  # and a slow start from the calls in flight
        limits = state.limits
        state.tokens = min(state.tokens, token_cap(limits))
        state.started_tokens = min(state.started_tokens, token_cap(limits))
        rburst = limits.request_burst
        state.requests = min(state.requests, rburst * UNITS) if had_rpm else rburst * UNITS
        state.deficit = min(state.deficit, quota.burst)
        state.external, state.synced_at = 0, 0  # learned again; the clipped buckets are no one's use
        k.htpm = k.hrpm = k.ctpm = k.crpm = 0  # the limit headers too (set_quota.lua says why)
        state.tokens, state.started_tokens = max(state.tokens, 0), max(state.started_tokens, 0)  # and any debt
        state.requests, state.tat = max(state.requests, 0), min(state.tat, now)
        if not quota.window_cap:
            state.window.clear()  # a cap kept keeps its window; one set on starts empty

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
        for name, state in self.models.items():  # slow start opens from the calls still running
            state.ramp_quota(self._live_count(name, now), now)
        return True

    def forget(self) -> None:
        """Simulate Redis losing all data."""
        self.models.clear()
        self.leases.clear()
        self.latency.clear()
        self.ready.clear()
        self.consumers = ConsumerRecords()
        self.loaded = False
        self.epoch = self.seq = self.backend_failures = 0
        self.rr = ""
