"""Run the Lua core and the pure-Python reference side by side.

Both get the same operations and the same injected clock; every result and
the whole state after every step must be identical. Used by the differential
and property tests.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from balancer.admission import keys
from balancer.admission.core import AdmissionCore
from balancer.admission.fields import MODEL_FIELDS, STATE_FIELDS, quota_fields
from balancer.admission.quota import Quota
from balancer.admission.reference import ReferenceCore
from balancer.admission.values import UNITS, Candidate, Decision, NoState, ReadyTask, Settlement, outside_rate
from balancer.admission.window import entry_text
from balancer.admission.window import sums as window_sums
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
        "bfails": int(meta.get("bfails", 0)),
        "models": {name: {f: m[f] for f in (*MODEL_FIELDS, *OTHER_KEYS)} for name, m in raw["models"].items()},
        "leases": {lid: (v["m"], v["e"], v["s"] == 1, v["g"], v.get("c")) for lid, v in raw["leases"].items()},
    }


#: What the model's other keys hold, beside its hash (see AdmissionCore.raw_state).
OTHER_KEYS = ("inflight", "latency", "ready", "window")


def reference_fields(ref: ReferenceCore, name: str) -> dict:
    """The reference model's state of one model under the Lua hash's field names."""
    s = ref.models[name]
    state = {
        "tokens": s.tokens, "requests": s.requests, "refilled_at": s.refilled_at, "deficit": s.deficit,
        "gen": s.generation, "paused": s.paused_until, "tat": s.tat, "ext": s.external, "synced_at": s.synced_at,
        "sync_gap": s.sync_gap, "started_sum": s.started_sum, "ptokens": s.started_tokens,
        "prefilled_at": s.started_refilled_at, "fails": s.failures,
        "probing": int(s.probing), "backoff": s.backoff_ms, **s.learned.as_dict(),
        **dict(zip(("wtokens", "wcalls"), window_sums(s.window))),
    }
    assert set(state) == set(STATE_FIELDS), "the twin must compare every state field the scripts keep"
    return {
        **quota_fields(s.quota), **state,
        "inflight": ref._inflight(name), "latency": ref.latency.get(name, {}),
        "ready": [f"{e.task_id}:{e.admission_id}:{e.estimated_tokens}:{e.expires_at}" for e in ref.ready.get(name, [])],
        "window": [entry_text(at, est) for at, est in s.window],
    }


def canonical_ref(ref: ReferenceCore) -> dict:
    return {
        "loaded": ref.loaded,
        "epoch": ref.epoch,
        "seq": ref.seq,
        "rr": ref.rr,
        "bfails": ref.backend_failures,
        "models": {name: reference_fields(ref, name) for name in ref.models},
        "leases": {lid: (l.model, l.estimated_tokens, l.started, l.generation, l.started_before)
                   for lid, l in ref.leases.items()},
    }


def live_lua(core: AdmissionCore, now: int) -> dict:
    """The live view (what the dispatcher and ``balancer quota list`` read) at ``now``."""
    return {name: (quota_fields(m.quota), quota_fields(m.limits), m.in_flight, m.tokens_available,
                   m.requests_available, m.deficit, m.paused_ms, m.external_tpm, m.consumers)
            for name, m in core.live(now).items()}


def live_ref(ref: ReferenceCore, now: int) -> dict:
    """The same view from the reference model: a copy of it, each model refilled to ``now``."""
    ref = copy.deepcopy(ref)
    view = {}
    for name, s in ref.models.items():
        ref._refill(name, now)
        live = sum(1 for deadline, _ in ref._inflight(name) if deadline > now)
        view[name] = (quota_fields(s.quota), quota_fields(s.limits), live, s.tokens / UNITS,
                      s.requests / UNITS if s.limits.max_requests_per_minute else None,
                      s.deficit, max(0, s.paused_until - now),
                      outside_rate(s.limits.max_tokens_per_minute, s.external),
                      sum(1 for until in ref.consumers.records.get(name, {}).values() if until > now))
    return view


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
        assert self.lua_consumers(set(self.ref.consumers.records) | set(self.ref.models)) == self.ref.consumers.records
        heard = self.client.hmget(keys.consumers_heard(self.namespace), "heard", "resumed")
        assert [None if v is None else int(v) for v in heard] == [self.ref.consumers.heard, self.ref.consumers.resumed]
        if self.ref.loaded:  # what the dispatcher and the views read, computed on each side
            assert live_lua(self.core, self.now) == live_ref(self.ref, self.now)

    def lua_consumers(self, names: set[str]) -> dict[str, dict[str, int]]:
        """Each model's consumer records in Redis (models with none left out), as the reference keeps them."""
        out = {}
        for name in names:
            raw = self.client.zrange(keys.consumers(self.namespace, name), 0, -1, withscores=True)
            if raw:
                out[name] = {member.decode(): int(score) for member, score in raw}
        return out

    # -- operations, each applied to both sides ---------------------------------
    def admit(self, candidates: list[Candidate], consumed_only: bool = False) -> list[Decision]:
        lua = self.core.admit(candidates, consumed_only=consumed_only)
        ref = self._ref(lambda: self.ref.admit(candidates, self.now, LEASE_MS, QUANTUM, consumed_only)) \
            if candidates else []
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

    def finish(self, lid: str, settlement: Settlement | int) -> tuple[bool, bool]:
        """Finish a call; a bare int means usage reported with no headers (reserved = usage)."""
        if isinstance(settlement, int):
            settlement = Settlement(used_tokens=settlement, reserved_tokens=settlement)
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

    def take_ready(self, consumed_only: bool = False) -> tuple[list[ReadyTask], list[ReadyTask]]:
        lua = self.core.take_ready(consumed_only=consumed_only)
        ref = self._ref(lambda: self.ref.take_ready(self.now, LEASE_MS, consumed_only))
        assert lua == ref
        return lua

    def note_consumers(self, consumer: str, models: list[str], ttl_ms: int) -> None:
        self.core.note_consumers(consumer, models, ttl_ms)
        if models:
            self.ref.note_consumers(consumer, models, ttl_ms, self.now)

    def hold(self, lid: str, hold_ms: int) -> bool:
        lua = self.core.hold(lid, hold_ms)
        assert lua == self.ref.hold(lid, hold_ms, self.now)
        return lua

    def heartbeat(self, lid: str, lease_ms: int, starting: bool = False) -> bool:
        lua = self.core.heartbeat(lid, lease_ms, starting=starting)
        assert lua == self.ref.heartbeat(lid, max(1, lease_ms), self.now, starting)
        return lua

    def penalize(self, model: str, retry_after_ms: int, remaining_tokens: int | None = None,
                 remaining_requests: int | None = None, limit_tokens: int | None = None,
                 limit_requests: int | None = None, refused: str | None = None) -> bool:
        lua = self.core.penalize(model, retry_after_ms, remaining_tokens, remaining_requests,
                                 limit_tokens=limit_tokens, limit_requests=limit_requests, refused=refused)
        ref = self._ref(lambda: self.ref.penalize(model, max(1, retry_after_ms), self.now, remaining_tokens,
                                                  remaining_requests, limit_tokens, limit_requests, refused))
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
