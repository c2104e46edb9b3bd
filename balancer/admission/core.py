"""The admission core: Redis I/O around the Lua scripts in ``lua/``.

Every state change happens inside one script call, so any number of
dispatcher and worker processes can share one Redis without over-admitting.
This module only marshals arguments, decodes replies, and restores the live
state from PostgreSQL when Redis has lost it (it runs without persistence).

>>> core = AdmissionCore(redis.Redis(), namespace="balancer", restore=store.snapshot)  # doctest: +SKIP
>>> core.admit([Candidate(1800), Candidate(900, allowed=("gpt-a",))])                # doctest: +SKIP
[Admitted(model='gpt-b', admission_id='1732180000000-1'), NotNow(retry_at_ms=..., now_ms=...)]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Callable, Sequence

import redis

from balancer.admission.model import (
    UNITS,
    Admitted,
    Candidate,
    Decision,
    LeaseSeed,
    NotNow,
    Rejected,
    rejection_reason,
)
from balancer.quota import Quota

#: Called when the live state is missing: returns the quotas and in-flight leases to restore.
RestoreSource = Callable[[], tuple[Sequence[Quota], Sequence[LeaseSeed]]]


def _load_scripts() -> dict[str, str]:
    folder = resources.files("balancer.admission") / "lua"
    lib = (folder / "lib.lua").read_text()
    return {
        name: lib + "\n" + (folder / f"{name}.lua").read_text()
        for name in ("admit", "renew", "release", "reconcile", "set_quota", "remove_quota", "restore")
    }


_SCRIPTS = _load_scripts()


def keys_for(namespace: str) -> list[str]:
    """KEYS[1..3] of every script. The braces make ``namespace`` the hash tag."""
    tag = "{" + namespace + "}"
    return [f"{tag}:meta", f"{tag}:models", f"{tag}:leases"]


def quota_args(quota: Quota) -> list[str | int]:
    return [
        quota.name,
        quota.weight,
        quota.max_concurrent_requests,
        quota.max_tokens_per_minute,
        quota.max_requests_per_minute or 0,
        quota.burst,
        int(quota.enabled),
    ]


@dataclass(frozen=True)
class ModelLive:
    """A model's live state as ``balancer quota list`` shows it."""

    quota: Quota
    in_flight: int
    tokens_available: float
    requests_available: float | None
    deficit: int


class AdmissionCore:
    """Admit, renew, release and reconcile, atomically in Redis.

    ``restore`` is called (at most once per loss) when a script reports that
    the live state is gone; it normally reads PostgreSQL. ``clock`` injects
    the time in ms for tests; production leaves it None so Redis ``TIME`` is
    the only clock, whatever the callers' clocks say.
    """

    def __init__(
        self,
        client: redis.Redis,
        namespace: str = "balancer",
        *,
        restore: RestoreSource | None = None,
        lease_ms: int = 300_000,
        base_quantum: int = 1000,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.redis = client
        self.namespace = namespace
        self.keys = keys_for(namespace)
        self.restore_source = restore
        self.lease_ms = lease_ms
        self.base_quantum = base_quantum
        self.clock = clock
        self._scripts = {name: client.register_script(text) for name, text in _SCRIPTS.items()}

    # -- plumbing --------------------------------------------------------------
    def _now(self) -> str:
        return "" if self.clock is None else str(int(self.clock()))

    def _run(self, name: str, args: Sequence[object]) -> object:
        return self._scripts[name](keys=self.keys, args=list(args))

    def _run_with_state(self, name: str, args: Callable[[], Sequence[object]]) -> list:
        """Run a script; if the state is missing, restore it and run once more."""
        reply = self._run(name, args())
        if isinstance(reply, list) and reply[:1] == [b"NOSTATE"]:
            self.restore()
            reply = self._run(name, args())
            if isinstance(reply, list) and reply[:1] == [b"NOSTATE"]:
                raise RuntimeError("admission state still missing after restore")
        return reply  # type: ignore[return-value]

    def restore(self, quotas: Sequence[Quota] | None = None, leases: Sequence[LeaseSeed] = ()) -> bool:
        """Rebuild the live copy if it is missing. Returns True if this call rebuilt it."""
        if quotas is None:
            if self.restore_source is None:
                quotas, leases = (), ()
            else:
                quotas, leases = self.restore_source()
        args: list[object] = [self._now(), len(quotas)]
        for quota in quotas:
            args.extend(quota_args(quota))
        args.append(len(leases))
        for seed in leases:
            args.extend([seed.admission_id, seed.model, seed.estimated_tokens, seed.deadline_ms])
        return self._run("restore", args) == 1

    @staticmethod
    def _decode(kind: bytes, a: bytes, b: bytes, candidate: Candidate | None) -> Decision:
        if kind == b"A":
            return Admitted(a.decode(), b.decode())
        if kind == b"W":
            return NotNow(int(a) if a else None, int(b))
        if a == b"toolarge":
            assert candidate is not None
            return Rejected(rejection_reason(candidate.estimated_tokens, int(b)))
        wanted = ",".join(sorted(candidate.allowed)) if candidate and candidate.allowed else ""
        return Rejected(f"no such model: {wanted}" if wanted else "no models configured")

    # -- operations ------------------------------------------------------------
    def admit(self, candidates: Sequence[Candidate]) -> list[Decision]:
        """Admit a batch in one atomic call; one decision per candidate, in order."""
        if not candidates:
            return []

        def args() -> list[object]:
            flat: list[object] = [self._now(), self.lease_ms, self.base_quantum, len(candidates)]
            for cand in candidates:
                flat.append(cand.estimated_tokens)
                flat.append(",".join(cand.allowed) if cand.allowed else "")
            return flat

        reply = self._run_with_state("admit", args)
        return [
            self._decode(reply[i], reply[i + 1], reply[i + 2], candidates[i // 3])
            for i in range(0, len(reply), 3)
        ]

    def renew(self, admission_id: str, model: str, estimated_tokens: int, lease_ms: int | None = None) -> Decision:
        """Re-assert a slot before calling the backend; only call on :class:`Admitted`."""
        reply = self._run_with_state(
            "renew",
            lambda: [self._now(), lease_ms or self.lease_ms, admission_id, model, estimated_tokens],
        )
        return self._decode(reply[0], reply[1], reply[2], Candidate(estimated_tokens, (model,)))

    def release(self, admission_id: str) -> bool:
        return self._run("release", [admission_id]) == 1

    def reconcile(self, admission_id: str, actual_tokens: int) -> bool:
        return self._run("reconcile", [self._now(), admission_id, actual_tokens]) == 1

    def finish(self, admission_id: str, actual_tokens: int | None) -> tuple[bool, bool]:
        """Reconcile (if ``actual_tokens`` is given) and release, in one round trip.

        Each is still its own atomic script; pipelining only saves the wait.
        Returns (reconciled, released).
        """
        pipe = self.redis.pipeline(transaction=False)
        if actual_tokens is not None:
            self._scripts["reconcile"](keys=self.keys, args=[self._now(), admission_id, actual_tokens], client=pipe)
        self._scripts["release"](keys=self.keys, args=[admission_id], client=pipe)
        replies = pipe.execute()
        reconciled = actual_tokens is not None and replies[0] == 1
        return reconciled, replies[-1] == 1

    def set_quota(self, quota: Quota) -> None:
        self._run_with_state("set_quota", lambda: [self._now(), *quota_args(quota)])

    def remove_quota(self, name: str) -> bool:
        reply = self._run_with_state("remove_quota", lambda: [name])
        return reply[1] == 1

    # -- reading (no state changes, so no Lua needed) ---------------------------
    def is_loaded(self) -> bool:
        return self.redis.hget(self.keys[0], "loaded") == b"1"

    def raw_state(self) -> dict:
        """Everything in Redis for this namespace, decoded (the differential tests compare it)."""
        meta_key, models_key, leases_key = self.keys
        prefix = meta_key[: -len(":meta")]
        meta = {k.decode(): v.decode() for k, v in self.redis.hgetall(meta_key).items()}
        models = {}
        for raw_name in self.redis.zrange(models_key, 0, -1):
            name = raw_name.decode()
            fields = {k.decode(): int(v) for k, v in self.redis.hgetall(f"{prefix}:model:{name}").items()}
            inflight = [
                (int(score), member.decode())
                for member, score in self.redis.zrange(f"{prefix}:inflight:{name}", 0, -1, withscores=True)
            ]
            models[name] = {**fields, "inflight": inflight}
        leases = {k.decode(): json.loads(v) for k, v in self.redis.hgetall(leases_key).items()}
        return {"meta": meta, "models": models, "leases": leases}

    def live(self, now_ms: int | None = None) -> dict[str, ModelLive]:
        """Per-model live view, bucket levels refilled to ``now`` (Redis TIME by default).

        Read-only and pipelined: one round trip for the clock and the model
        names, one for every model's hash and live-lease count (ZCOUNT, so the cost does not grow
        with the number of calls in flight). The dispatcher calls it every round.
        """
        meta_key, models_key, _ = self.keys
        prefix = meta_key[: -len(":meta")]
        first = self.redis.pipeline(transaction=False)
        first.time()
        first.zrange(models_key, 0, -1)
        (seconds, micros), raw_names = first.execute()
        if now_ms is None:
            now_ms = seconds * 1000 + micros // 1000
        names = [n.decode() for n in raw_names]
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(f"{prefix}:model:{name}")
            pipe.zcount(f"{prefix}:inflight:{name}", f"({now_ms}", "+inf")
        replies = pipe.execute()
        view = {}
        for i, name in enumerate(names):
            raw, in_flight = replies[2 * i], replies[2 * i + 1]
            if not raw:
                continue  # removed between the two reads
            m = {k.decode(): int(v) for k, v in raw.items()}
            quota = Quota(
                name=name,
                weight=m["weight"],
                max_concurrent_requests=m["cap"],
                max_tokens_per_minute=m["tpm"],
                max_requests_per_minute=m["rpm"] or None,
                burst_tokens=m["burst"],
                enabled=bool(m["enabled"]),
            )
            dt = max(0, now_ms - m["refilled_at"])
            tokens = min(m["burst"] * UNITS, m["tokens"] + dt * m["tpm"]) / UNITS
            requests = min(m["rpm"] * UNITS, m["requests"] + dt * m["rpm"]) / UNITS if m["rpm"] else None
            view[name] = ModelLive(quota, in_flight, tokens, requests, m["deficit"])
        return view


def open_slots(view: dict[str, ModelLive]) -> dict[str, int]:
    """Free slots of the models that could admit *something* right now:
    enabled, a free slot, tokens above zero and (with RPM) a request. The
    dispatcher reads only tasks that one of these could take."""
    return {
        name: m.quota.max_concurrent_requests - m.in_flight
        for name, m in view.items()
        if m.quota.enabled
        and m.in_flight < m.quota.max_concurrent_requests
        and m.tokens_available >= 1
        and (m.requests_available is None or m.requests_available >= 1)
    }
