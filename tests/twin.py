"""Run the Lua core and the pure-Python reference side by side.

Both get the same operations and the same injected clock; every result and
the whole state after every step must be identical. Used by the differential
and property tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from balancer.admission import AdmissionCore, Candidate, Decision, NoState, ReadyTask, Settlement
from balancer.admission.core import prior_ms
from balancer.admission.reference import ReferenceCore
from balancer.domain.quota import Quota
from balancer.services import delete_namespace_keys

LEASE_MS = 5_000  # short, so refunds of expired leases are not hidden by refill
QUANTUM = 1000
T0 = 1_700_000_000_000


def delete_keys(client: redis.Redis, namespace: str) -> None:
    """Delete this namespace's keys (admission and broker), and nothing else."""
    delete_namespace_keys(client, namespace)


def canonical_lua(core: AdmissionCore) -> dict:
    raw = core.raw_state()
    meta = raw["meta"]
    return {
        "loaded": meta.get("loaded") == "1",
        "epoch": int(meta.get("epoch", 0)),
        "seq": int(meta.get("seq", 0)),
        "rr": meta.get("rr", ""),
        "models": {
            name: (
                m["weight"], m["cap"], m["tpm"], m["rpm"], m["burst"], m["enabled"],
                m["tokens"], m["requests"], m["refilled_at"], m["deficit"], m["gen"], m["inflight"],
                m["settle"], m["rburst"], m["paused"], m["tat"], m["ext"], m["synced_at"], m["ptokens"], m["prefilled_at"],
                m["prior"], m["latency"], m["fails"], m["probing"], m["backoff"], m["ready"],
            )
            for name, m in raw["models"].items()
        },
        "leases": {lid: (v["m"], v["e"], v["s"] == 1, v["r"] == 1, v["g"]) for lid, v in raw["leases"].items()},
    }


def canonical_ref(ref: ReferenceCore) -> dict:
    return {
        "loaded": ref.loaded,
        "epoch": ref.epoch,
        "seq": ref.seq,
        "rr": ref.rr,
        "models": {
            name: (
                s.quota.weight, s.quota.max_concurrent_requests, s.quota.max_tokens_per_minute,
                s.quota.max_requests_per_minute or 0, s.quota.burst, int(s.quota.enabled),
                s.tokens, s.requests, s.refilled_at, s.deficit, s.generation, ref._inflight(name),
                int(s.quota.settles), s.quota.request_burst, s.paused_until, s.tat, s.external, s.synced_at,
                s.started_tokens, s.started_refilled_at,
                prior_ms(s.quota), ref.latency.get(name, {}), s.failures, int(s.probing), s.backoff_ms,
                [f"{e.task_id}:{e.admission_id}:{e.estimated_tokens}:{e.expires_at}" for e in ref.ready.get(name, [])],
            )
            for name, s in ref.models.items()
        },
        "leases": {
            lid: (l.model, l.estimated_tokens, l.started, l.reconciled, l.generation) for lid, l in ref.leases.items()
        },
    }


@dataclass
class Twin:
    """A Lua core and a reference core, plus the "PostgreSQL" quotas they restore from."""

    client: redis.Redis
    namespace: str
    now: int = T0
    stored: dict[str, Quota] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.core = AdmissionCore(
            self.client,
            self.namespace,
            restore=lambda: (list(self.stored.values()), []),
            lease_ms=LEASE_MS,
            base_quantum=QUANTUM,
            clock=lambda: self.now,
        )
        self.ref = ReferenceCore()

    def _ref(self, op: Callable[[], object]) -> object:
        try:
            return op()
        except NoState:
            self.ref.restore(sorted(self.stored.values(), key=lambda q: q.name), [], self.now)
            return op()

    def check_same_state(self) -> None:
        assert canonical_lua(self.core) == canonical_ref(self.ref)

    # -- operations, each applied to both sides ---------------------------------
    def admit(self, candidates: list[Candidate]) -> list[Decision]:
        lua = self.core.admit(candidates)
        ref = self._ref(lambda: self.ref.admit(candidates, self.now, LEASE_MS, QUANTUM)) if candidates else []
        assert lua == ref
        return lua

    def renew(self, lid: str, model: str, est: int) -> Decision:
        lua = self.core.renew(lid, model, est)
        ref = self._ref(lambda: self.ref.renew(lid, model, est, self.now, LEASE_MS))
        assert lua == ref
        return lua

    def release(self, lid: str) -> bool:
        lua = self.core.release(lid)
        assert lua == self.ref.release(lid, self.now)
        return lua

    def finish(self, lid: str, settlement: Settlement) -> tuple[bool, bool]:
        lua = self.core.finish(lid, settlement)
        assert lua == self.ref.finish(lid, settlement, self.now)
        return lua

    def finish_and_take(self, lid: str, settlement: Settlement) -> ReadyTask | None:
        lua = self.core.finish_and_take(lid, settlement, LEASE_MS)
        assert lua == self.ref.finish_and_take(lid, settlement, self.now, LEASE_MS)
        return lua

    def stock(self, entries: list[tuple[str, int, int, str]], ttl_ms: int) -> list[bool]:
        lua = self.core.stock(entries, ttl_ms)
        ref = self._ref(lambda: self.ref.stock(entries, ttl_ms, self.now)) if entries else []
        assert lua == ref
        return lua

    def take_ready(self) -> tuple[list[ReadyTask], list[ReadyTask]]:
        lua = self.core.take_ready()
        ref = self._ref(lambda: self.ref.take_ready(self.now, LEASE_MS))
        assert lua == ref
        return lua

    def hold(self, lid: str, hold_ms: int) -> bool:
        lua = self.core.hold(lid, hold_ms)
        assert lua == self.ref.hold(lid, hold_ms, self.now)
        return lua

    def heartbeat(self, lid: str, lease_ms: int) -> bool:
        lua = self.core.heartbeat(lid, lease_ms)
        assert lua == self.ref.heartbeat(lid, max(1, lease_ms), self.now)
        return lua

    def reconcile(self, lid: str, settlement: Settlement | int) -> bool:
        """Settle a call; a bare int means usage reported with no headers (reserved = usage)."""
        if isinstance(settlement, int):
            settlement = Settlement(used_tokens=settlement, reserved_tokens=settlement)
        lua = self.core.reconcile(lid, settlement)
        assert lua == self.ref.reconcile(lid, settlement, self.now)
        return lua

    def penalize(self, model: str, retry_after_ms: int, remaining_tokens: int | None = None,
                 remaining_requests: int | None = None) -> bool:
        lua = self.core.penalize(model, retry_after_ms, remaining_tokens, remaining_requests)
        ref = self._ref(lambda: self.ref.penalize(model, max(1, retry_after_ms), self.now, remaining_tokens, remaining_requests))
        assert lua == ref
        return lua

    def trip(self, model: str) -> tuple[bool, bool]:
        lua = self.core.trip(model)
        assert lua == self._ref(lambda: self.ref.trip(model, self.now))
        return lua

    # Like QuotaStore: a missing live state is restored from the stored set as it
    # was before the change, then the change is stored and pushed.
    def set_quota(self, quota: Quota) -> None:
        self.core.set_quota(quota)
        self._ref(lambda: self.ref.set_quota(quota, self.now))
        self.stored[quota.name] = quota

    def remove_quota(self, name: str) -> None:
        lua = self.core.remove_quota(name)
        assert lua == self._ref(lambda: self.ref.remove_quota(name))
        self.stored.pop(name, None)

    def lose_redis_data(self) -> None:
        delete_keys(self.client, self.namespace)
        self.ref.forget()

    def advance(self, ms: int) -> None:
        self.now += ms
