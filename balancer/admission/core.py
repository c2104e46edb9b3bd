"""The admission core: Redis I/O around the Lua scripts in ``lua/``.

Every state change happens inside one script call, so any number of
dispatcher and worker processes can share one Redis without over-admitting.
This module only marshals arguments, decodes replies, and restores the live
state from PostgreSQL when Redis has lost it (it runs without persistence).

>>> core = AdmissionCore(redis.Redis(), "balancer", lease_ms=30_000, restore=services.restore_source)  # doctest: +SKIP
>>> core.admit([Candidate(1800), Candidate(900, allowed=("gpt-a",))])                                 # doctest: +SKIP
[Admitted(model='gpt-b', admission_id='1732180000000-1'), NotNow(retry_at_ms=..., now_ms=...)]
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, cast

import redis

from balancer.admission import fields, keys, learned, liveness, values, window
from balancer.admission.live import ModelLive as ModelLive
from balancer.admission.live import open_slots as open_slots
from balancer.admission.live import read_live, records_trusted_now
from balancer.admission.live import slots_of as slots_of
from balancer.admission.quota import MAX_LIMIT, Quota
from balancer.admission.values import (
    Admitted,
    Candidate,
    Decision,
    LeaseSeed,
    NotNow,
    ReadyTask,
    Rejected,
    Settlement,
    rejection_reason,
)
from balancer.estimates.latency import bucket_of

#: Called when the live state is missing: returns the quotas and in-flight leases to restore.
RestoreSource = Callable[[], tuple[Sequence[Quota], Sequence[LeaseSeed]]]


#: The scripts' library in ``lua/``, put before every script in this order (Redis Lua has no
#: ``require``): each file uses what the ones before it define (see the head of state.lua).
LIBRARY = ("state", "window", "shown", "limits", "signals", "ready")


def _load_scripts() -> dict[str, str]:
    folder = resources.files("balancer.admission") / "lua"
    preludes = keys.LUA_PRELUDE + fields.LUA_PRELUDE + values.LUA_PRELUDE + learned.LUA_PRELUDE + window.LUA_PRELUDE
    lib = preludes + "\n".join((folder / f"{n}.lua").read_text() for n in LIBRARY)
    return {
        name: lib + "\n" + (folder / f"{name}.lua").read_text()
        for name in ("admit", "renew", "finish", "hold", "heartbeat", "penalize", "trip", "set_quota", "remove_quota",
                     "restore", "stock", "take_ready", "consumers")
    }


_SCRIPTS = _load_scripts()


def header_limit(value: int | None) -> int | None:
    """A provider's x-ratelimit-limit-* as the scripts take it: a whole number
    from 1 to MAX_LIMIT (bucket arithmetic stays exact), None if absent or 0."""
    if value is None or value < 1:
        return None
    return min(int(value), MAX_LIMIT)


def quota_args(quota: Quota) -> list[str | int]:
    """A quota as set_quota.lua and restore.lua take it: the name, then its hash fields."""
    return [quota.name, *fields.quota_fields(quota).values()]


class AdmissionCore:
    """Admit, renew, finish and release, atomically in Redis.

    ``lease_ms`` is how long an admitted slot lives without a renewal or a
    heartbeat (``BALANCER_LEASE_SECONDS``). ``restore`` is called (at most
    once per loss) when a script reports that
    the live state is gone; it normally reads PostgreSQL. ``clock`` injects
    the time in ms for tests; production leaves it None so Redis ``TIME`` is
    the only clock, whatever the callers' clocks say.
    """

    def __init__(
        self,
        client: redis.Redis,
        namespace: str = "balancer",
        *,
        lease_ms: int,
        restore: RestoreSource | None = None,
        base_quantum: int = 1000,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.redis = client
        self.namespace = namespace
        self.keys = keys.script_keys(namespace)
        self.restore_source = restore
        self.lease_ms = lease_ms
        self.base_quantum = base_quantum
        self.clock = clock
        self._scripts = {name: client.register_script(text) for name, text in _SCRIPTS.items()}

    def with_lease(self, lease_ms: int) -> AdmissionCore:
        """The same core (client, scripts, restore) admitting with another lease length:
        the router's own lease (``BALANCER_ROUTER_LEASE_SECONDS``)."""
        other = copy.copy(self)
        other.lease_ms = lease_ms
        return other

    def load_scripts(self) -> None:
        """Load every script now (else each one's first call costs two round trips more: EVALSHA, SCRIPT LOAD)."""
        for script in self._scripts.values():
            self.redis.script_load(script.script)

    # -- plumbing --------------------------------------------------------------
    def _now(self) -> str:
        return "" if self.clock is None else str(int(self.clock()))

    def _run(self, name: str, args: Sequence[Any]) -> Any:
        return self._scripts[name](keys=self.keys, args=list(args))

    def _run_with_state(self, name: str, args: Callable[[], Sequence[object]]) -> list:
        """Run a script; if the state is missing, restore it and run once more."""
        reply = self._run(name, args())
        if isinstance(reply, list) and reply[:1] == [b"NOSTATE"]:
            self.restore()
            reply = self._run(name, args())
            if isinstance(reply, list) and reply[:1] == [b"NOSTATE"]:
                raise RuntimeError("admission state still missing after restore")
        return reply

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
            args.extend([seed.admission_id, seed.model, seed.estimated_tokens, seed.remaining_ms])
        return self._run("restore", args) == 1

    @staticmethod
    def _decode(kind: bytes, a: bytes, b: bytes, candidate: Candidate | None) -> Decision:
        if kind == b"A":
            return Admitted(a.decode(), b.decode())
        if kind == b"W":
            return NotNow(int(a) if a else None, int(b))
        if a == b"toolarge" and candidate is not None:
            return Rejected(rejection_reason(candidate.estimated_tokens, int(b)))
        wanted = ",".join(sorted(candidate.allowed)) if candidate and candidate.allowed else ""
        return Rejected.no_such_model(wanted)

    # -- operations ------------------------------------------------------------
    def admit(self, candidates: Sequence[Candidate], *, consumed_only: bool = False) -> list[Decision]:
        """Admit a batch in one atomic call; one decision per candidate, in order. With
        ``consumed_only`` (the dispatcher's), only models a worker consumes now may take them."""
        if not candidates:
            return []

        def args() -> list[object]:
            flat: list[object] = [self._now(), self.lease_ms, self.base_quantum, "1" if consumed_only else "",
                                  len(candidates)]
            for cand in candidates:
                flat.append(cand.estimated_tokens)
                flat.append(",".join(cand.allowed) if cand.allowed else "")
                flat.append(cand.avoid or "")
            return flat

        reply = self._run_with_state("admit", args)
        return [
            self._decode(reply[i], reply[i + 1], reply[i + 2], candidates[i // 3])
            for i in range(0, len(reply), 3)
        ]

    def renew(self, admission_id: str, model: str, estimated_tokens: int, lease_ms: int | None = None) -> Decision:
        """Re-assert a slot before calling the backend; only call on :class:`Admitted`,
        and only after its ``start_delay_ms`` (the RPM start gate)."""
        reply = self._run_with_state(
            "renew",
            lambda: [self._now(), lease_ms or self.lease_ms, admission_id, model, estimated_tokens],
        )
        decision = self._decode(reply[0], reply[1], reply[2], Candidate(estimated_tokens, (model,)))
        if isinstance(decision, Admitted) and len(reply) > 3:
            return Admitted(decision.model, decision.admission_id, int(reply[3]))
        return decision

    def finish(self, admission_id: str, settlement: Settlement | None = None) -> tuple[bool, bool]:
        """Everything a finished call tells the core, in one script and one round
        trip: settle its tokens as the model's accounting says, sync the
        buckets to the provider's headers, and free the slot. Idempotent: a
        second finish finds no lease. Returns (settled, released).
        """
        reply = self._finish(admission_id, settlement, None)
        return reply[0] == 1, reply[1] == 1

    def finish_and_take(self, admission_id: str, settlement: Settlement | None = None,
                        lease_ms: int | None = None) -> ReadyTask | None:
        """:meth:`finish`, and in the same round trip the freed slot's next call: the head of its
        model's ready list, if the model can admit it now. The task returned is admitted and its
        lease started (both start gates passed): wait ``start_delay_ms`` and call, with no :meth:`renew`.
        None if nothing was ready or it must wait (the dispatcher's :meth:`take_ready` admits it later)."""
        reply = self._finish(admission_id, settlement, lease_ms or self.lease_ms)
        if len(reply) < 8:
            return None
        model, task, lid, est, delay, restock = reply[2:8]
        return ReadyTask(int(task), lid.decode(), model.decode(), int(est), int(delay), restock == 1)

    def _finish(self, admission_id: str, settlement: Settlement | None, take_lease_ms: int | None) -> list:
        s = settlement or Settlement()

        def opt(value: int | None) -> object:
            return "" if value is None else value

        sample: list[object] = ["", "", "", ""]
        if s.latency_ms is not None:
            completion = s.completion_tokens or 0
            prompt = max(0, (s.used_tokens or 0) - completion)
            sample = [bucket_of(s.latency_ms), s.latency_ms, prompt, completion]
        return cast(list, self._run("finish", [
            self._now(), admission_id, opt(s.used_tokens), opt(s.reserved_tokens),
            opt(s.remaining_tokens), opt(s.remaining_requests), *sample,
            "" if take_lease_ms is None else take_lease_ms, opt(header_limit(s.limit_tokens)),
            opt(header_limit(s.limit_requests)),
        ]))

    def stock(self, entries: Sequence[tuple[str, int, int, str]], ttl_ms: int) -> list[bool]:
        """Put (model, task id, estimated tokens, admission id) on the models' ready
        lists; whether each was stocked (not: unknown model). Mark the tasks
        queued under those ids, and commit, first: a finishing call may take an
        entry at once. One not taken within ``ttl_ms`` is dropped by :meth:`take_ready`."""
        if not entries:
            return []
        flat: list[object] = [self._now(), ttl_ms, len(entries)]
        for entry in entries:
            flat.extend(entry)
        return [done == 1 for done in self._run_with_state("stock", lambda: flat)]

    def take_ready(self, *, consumed_only: bool = False) -> tuple[list[ReadyTask], list[ReadyTask]]:
        """(taken, dropped): ready entries free slots admitted now (leases not
        started: renew them as after :meth:`admit`), and entries that can no
        longer be taken (expired, model disabled or too small; with ``consumed_only``,
        every entry of a model no worker consumes), whose tasks must go back to pending."""
        reply = self._run_with_state("take_ready", lambda: [self._now(), self.lease_ms, "1" if consumed_only else ""])
        taken: list[ReadyTask] = []
        dropped: list[ReadyTask] = []
        for i in range(0, len(reply), 5):
            kind, model, task, lid, est = reply[i:i + 5]
            entry = ReadyTask(int(task), lid.decode(), model.decode(), int(est))
            (taken if kind == b"T" else dropped).append(entry)
        return taken, dropped

    def note_consumers(self, consumer: str, models: Sequence[str], ttl_ms: int) -> None:
        """``consumer`` (a worker process) consumes these queues for ``ttl_ms`` more (0: no more): consumers.lua."""
        if models:
            self._run("consumers", [self._now(), max(0, int(ttl_ms)), liveness.SILENCE_MS, consumer, *models])

    def release(self, admission_id: str) -> bool:
        """Free the slot; releasing twice, or an unknown id, is harmless."""
        return self.finish(admission_id)[1]

    def withdraw(self, admission_ids: Sequence[str]) -> int:
        """Hand back admissions whose calls will never start (their dispatch did not commit), in one
        round trip: each lease ends now (hold.lua with 0 ms), and the next admission on its model
        purges it, its tokens back and its request up to the gate's room (limits.lua, purge). Returns how many were live."""
        if not admission_ids:
            return 0
        with self.redis.pipeline(transaction=False) as pipe:
            for admission_id in admission_ids:
                self._scripts["hold"](keys=self.keys, args=[self._now(), admission_id, 0], client=pipe)
            return sum(reply == 1 for reply in pipe.execute())

    def hold(self, admission_id: str, hold_ms: int) -> bool:
        """Keep a cancelled call's slot ``hold_ms`` longer (never past its lease), its reservation charged,
        for a provider that finishes the call anyway. True if a live lease is now held (freed when it expires)."""
        return self._run("hold", [self._now(), admission_id, max(0, int(hold_ms))]) == 1

    def heartbeat(self, admission_id: str, lease_ms: int | None = None, *, starting: bool = False) -> bool:
        """Extend a live lease to ``lease_ms`` from now (the core's lease by default).

        False if the lease is unknown or already expired: its slot is gone and
        is not taken again (unlike :meth:`renew`). With ``starting`` (a call
        about to start on it), also False, and the lease dropped, if its model
        is gone or holds more live leases than its concurrency cap (lowered
        since the lease was taken)."""
        return self._run("heartbeat", [self._now(), admission_id, max(1, int(lease_ms or self.lease_ms)),
                                       "1" if starting else ""]) == 1

    def penalize(self, model: str, retry_after_ms: int, remaining_tokens: int | None = None,
                 remaining_requests: int | None = None, *, limit_tokens: int | None = None,
                 limit_requests: int | None = None, refused: str | None = None) -> bool:
        """Pause ``model`` for a 429's Retry-After and sync its buckets to the 429's
        headers; True if this started the pause (a 429 during a running pause adds none).
        A pause it starts also lowers the effective limit of the kind behind the
        429, if the model learns (penalize.lua); ``limit_*`` are the 429's
        ``x-ratelimit-limit-*`` headers; ``refused`` is the refused call's admission id."""
        def opt(value: int | None) -> object:
            return "" if value is None else value

        args = [self._now(), model, max(1, int(retry_after_ms)), opt(remaining_tokens), opt(remaining_requests),
                opt(header_limit(limit_tokens)), opt(header_limit(limit_requests)), refused or ""]
        return self._run("penalize", args) == 1

    def trip(self, model: str) -> tuple[bool, bool]:
        """A transient failure on ``model``, for its circuit breaker (see trip.lua):
        (whether it counts against the task's attempts, whether the circuit opened now)."""
        counted, opened = self._run("trip", [self._now(), model])
        return counted == 1, opened == 1

    def set_quota(self, quota: Quota) -> None:
        self._run_with_state("set_quota", lambda: [self._now(), *quota_args(quota)])

    def remove_quota(self, name: str) -> bool:
        reply = self._run_with_state("remove_quota", lambda: [name])
        return reply[1] == 1

    def apply_quotas(self, changes: Sequence[tuple[str, Quota | None]]) -> None:
        """Several quota changes (None: remove the model) in one MULTI/EXEC, so
        every other client sees all of them or none: an import, a drift repair."""
        if not changes:
            return
        self.restore()  # a missing state is rebuilt first (nothing to do when it is there)
        for _ in range(2):
            pipe = self.redis.pipeline(transaction=True)
            for name, quota in changes:
                if quota is None:
                    self._scripts["remove_quota"](keys=self.keys, args=[name], client=pipe)
                else:
                    self._scripts["set_quota"](keys=self.keys, args=[self._now(), *quota_args(quota)], client=pipe)
            replies = pipe.execute()
            if not any(isinstance(r, list) and r[:1] == [b"NOSTATE"] for r in replies):
                return
            self.restore()  # lost between the restore and the transaction: every change was refused; again
        raise RuntimeError("admission state still missing after restore")

    def count(self, model: str, outcome: str) -> None:
        """Count a call outcome the scripts do not see (``transient``, ``failed``) for the metrics.

        Answered calls, 429s and transient failures are counted inside finish.lua,
        penalize.lua and trip.lua."""
        self.redis.hincrby(keys.stats(self.namespace, model), outcome, 1)

    # -- reading (no state changes, so no Lua needed) ---------------------------
    def counters(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """(per model, system) counters since the start, as the scripts and :meth:`count` keep them."""
        r = self.redis
        names = self.model_names()
        with r.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(keys.stats(self.namespace, name))
            pipe.hgetall(keys.system_stats(self.namespace))
            replies = [{k.decode(): int(v) for k, v in raw.items()} for raw in pipe.execute()]
        return dict(zip(names, replies, strict=False)), replies[-1]

    def model_names(self) -> list[str]:
        """The names of the models the live state holds, in admission order."""
        return [n.decode() for n in cast(list[bytes], self.redis.zrange(self.keys[1], 0, -1))]

    def is_loaded(self) -> bool:
        return self.redis.hget(self.keys[0], "loaded") == b"1"

    def consumer_records_trusted(self) -> bool:
        """Whether a model with no live consumer record is consumed by nobody (:mod:`.liveness`)."""
        return records_trusted_now(self.redis, self.namespace, None if self.clock is None else int(self.clock()))

    def raw_state(self) -> dict:
        """Everything in Redis for this namespace, decoded (the differential tests compare it)."""
        meta_key, models_key, leases_key = self.keys
        r: Any = self.redis  # redis-py's reply types are unions of every RESP shape
        meta = {k.decode(): v.decode() for k, v in r.hgetall(meta_key).items()}
        models = {}
        for raw_name in r.zrange(models_key, 0, -1):
            name = raw_name.decode()
            fields = {k.decode(): int(v) for k, v in r.hgetall(keys.model(self.namespace, name)).items()}
            inflight = [(int(score), member.decode())
                        for member, score in r.zrange(keys.inflight(self.namespace, name), 0, -1, withscores=True)]
            latency = {k.decode(): int(v) for k, v in r.hgetall(keys.latency(self.namespace, name)).items()}
            lists = {kind: [entry.decode() for entry in r.lrange(key(self.namespace, name), 0, -1)]
                     for kind, key in (("ready", keys.ready), ("window", keys.window))}
            models[name] = {**fields, "inflight": inflight, "latency": latency, **lists}
        leases = {k.decode(): json.loads(v) for k, v in r.hgetall(leases_key).items()}
        return {"meta": meta, "models": models, "leases": leases}

    def live_quotas(self) -> dict[str, Quota]:
        """Each model's quota as the live state holds it (the drift repair compares it with PostgreSQL)."""
        return {name: m.quota for name, m in self.live().items()}

    def live(self, now_ms: int | None = None) -> dict[str, ModelLive]:
        """Per-model live view, bucket levels refilled to ``now`` (Redis TIME by default):
        :func:`balancer.admission.live.read_live`. The dispatcher calls it every round."""
        return read_live(self.redis, self.namespace, now_ms)
