"""The router's admissions: the ids it issues, and the answers it keeps for retried ``/schedule`` calls.

A router admission is a lease in the admission core, as a pipeline call's is,
but its caller never sees the core's id (``<epoch>-<sequence>``, sequential
and easy to guess). It gets an id of its own, ``rt_`` and 32 random URL-safe
characters (:func:`secrets.token_urlsafe`): no pipeline id has that shape, and
nobody can guess one. Redis maps each to the core's id of its lease
(:func:`balancer.admission.keys.router_admission`), for as long as the lease:
set at ``/schedule``, extended by each ``/heartbeat`` that finds the lease
alive. ``/complete`` and ``/heartbeat`` act on ids found there and on nothing
else, so a caller can free or keep only slots the router gave out.

``Idempotency-Key``: a ``/schedule`` sent with one is answered once. The
first request writes a marker (``SET NX``) before it admits and replaces it
with the admission it got; a retry with the same key and the same body gets
that admission again (after what is left of its start-gate delay), and one
that arrives while the first is still being answered is told to retry (409).
A wait or a refusal deletes the marker, so the caller asks again with the same
key. The record lives as long as its admission's lease (one lease, extended by
each ``/heartbeat``): an admission no caller heard of has expired with it, so a
retry never holds a second slot beside it.

The record is its caller's and its admission's: it is kept under the caller's
address as well as the key, so a caller elsewhere that sends the same key
(by mistake, or having seen it) gets an admission of its own, or a wait, never
that one; and ``/complete`` deletes it, so after the call no retry is handed an
admission that has ended (the key then asks for a new one).

A ``/complete`` that cannot reach Redis (a failover, a restart) is kept in memory
(:class:`balancer.admission.finishes.KeptFinishes`: bounded, retried every half
second) and applied when Redis answers, so the slot is free within moments of
Redis's return rather than at its lease's end; the caller is told it was kept.

Everything here is blocking Redis I/O: :mod:`balancer.router.app` runs it in a
thread pool, off the event loop.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from balancer.admission import keys
from balancer.admission.core import AdmissionCore
from balancer.admission.finishes import KeptFinishes
from balancer.admission.values import Admitted, Candidate, NotNow, Rejected, Settlement

#: Every router admission id starts with this; a pipeline admission id never does.
ADMISSION_ID_PREFIX = "rt_"
#: A router admission id: the prefix and ``secrets.token_urlsafe(24)``.
ADMISSION_ID_PATTERN = r"^rt_[A-Za-z0-9_-]{32}$"
#: What a client may send as ``Idempotency-Key``: long enough to be its own.
IDEMPOTENCY_KEY_PATTERN = r"^[A-Za-z0-9_-]{16,128}$"
_IN_PROGRESS = b"in-progress"


def new_admission_id() -> str:
    """A fresh router admission id.

    >>> import re
    >>> bool(re.fullmatch(ADMISSION_ID_PATTERN, new_admission_id()))
    True
    """
    return ADMISSION_ID_PREFIX + secrets.token_urlsafe(24)


@dataclass(frozen=True)
class Granted:
    """An admission: call ``model`` after ``delay_ms`` (its start gate), then complete ``admission_id``."""

    model: str
    admission_id: str
    delay_ms: int


@dataclass(frozen=True)
class Waiting:
    """No model can take it now; the core's earliest time, if it knows one."""

    core_wait_ms: int | None


@dataclass(frozen=True)
class InProgress:
    """A ``/schedule`` with the same idempotency key is still being answered."""


@dataclass(frozen=True)
class KeyReused:
    """The idempotency key was sent before with another body."""


Outcome = Granted | Waiting | Rejected | InProgress | KeyReused


@dataclass(frozen=True)
class Kept:
    """A ``/complete`` that could not reach Redis: kept, and applied when Redis answers."""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class Admissions:
    """The router's admissions on one admission core (blocking Redis calls)."""

    def __init__(self, core: AdmissionCore, lease_ms: int) -> None:
        self.core, self.lease_ms = core, lease_ms
        self.redis, self.namespace = core.redis, core.namespace
        self._models: frozenset[str] = frozenset()
        #: Completions that could not reach Redis, applied when it answers.
        self.kept = KeptFinishes(core)

    def unknown_models(self, wanted: Sequence[str]) -> list[str]:
        """Names no quota has. The known names are cached and re-read on a miss."""
        missing = [m for m in wanted if m not in self._models]
        if missing:
            self._models = frozenset(self.core.model_names())
            missing = [m for m in wanted if m not in self._models]
        return sorted(set(missing))

    def schedule(self, estimated_tokens: int, models: Sequence[str] | None,
                 idempotency_key: str | None = None, caller: str = "") -> Outcome:
        """Admit one call and start its lease; with a key, at most once per key and caller
        (see the module docstring)."""
        if idempotency_key is None:
            return self._admit(estimated_tokens, models)
        record_key = keys.router_idempotency(self.namespace, caller, idempotency_key)
        request = json.dumps([estimated_tokens, list(models) if models else None])
        if not self.redis.set(record_key, _IN_PROGRESS, nx=True, px=self.lease_ms):
            raw = self.redis.get(record_key)
            if raw is None or raw == _IN_PROGRESS:  # (None: it ended between the two reads; the retry will see)
                return InProgress()
            record = json.loads(raw)
            if record["request"] != request:
                return KeyReused()
            return Granted(record["model"], record["admission_id"], max(0, record["start_at_ms"] - _now_ms()))
        try:
            outcome = self._admit(estimated_tokens, models, record_key)
        except BaseException:
            self.redis.delete(record_key)
            raise
        if isinstance(outcome, Granted):
            record = {"request": request, "model": outcome.model, "admission_id": outcome.admission_id,
                      "start_at_ms": _now_ms() + outcome.delay_ms}
            self.redis.set(record_key, json.dumps(record), px=self.lease_ms)
        else:
            self.redis.delete(record_key)  # nothing held: the caller asks again, with the same key
        return outcome

    def _admit(self, estimated_tokens: int, models: Sequence[str] | None, record_key: str = "") -> Outcome:
        [decision] = self.core.admit([Candidate(estimated_tokens, tuple(models) if models else None)])
        if isinstance(decision, Admitted):
            decision = self.core.renew(decision.admission_id, decision.model, estimated_tokens, self.lease_ms)
        if isinstance(decision, Admitted):
            admission_id = new_admission_id()
            # The lease's id, and the idempotency record that hands it out (deleted at /complete).
            self.redis.set(keys.router_admission(self.namespace, admission_id),
                           f"{decision.admission_id} {record_key}".rstrip(), px=self.lease_ms)
            return Granted(decision.model, admission_id, decision.start_delay_ms)
        if isinstance(decision, Rejected):
            return decision
        return Waiting(decision.wait_ms if isinstance(decision, NotNow) else None)

    def _issued(self, admission_id: str) -> tuple[str, str] | None:
        """(the lease's id, its idempotency record's key or ""), or None if never issued or ended."""
        raw: Any = self.redis.get(keys.router_admission(self.namespace, admission_id))
        if raw is None:
            return None
        lease, _, record_key = raw.decode().partition(" ")
        return lease, record_key

    def complete(self, admission_id: str, used_tokens: int | None) -> bool | Kept | None:
        """Settle and free the slot: whether this call freed it (False: already
        completed), or None if the router has no such admission (never issued, or
        its lease ended), when nothing is changed. The idempotency record that
        hands this admission out ends with it. With Redis unreachable, the
        completion is kept and applied when it answers (:class:`Kept`)."""
        try:
            return self._complete(admission_id, used_tokens)
        except (redis.RedisError, OSError):
            self.kept.keep_action(admission_id, lambda: self._complete(admission_id, used_tokens))
            return Kept()

    def _complete(self, admission_id: str, used_tokens: int | None) -> bool | None:
        issued = self._issued(admission_id)
        if issued is None:
            return None
        lease, record_key = issued
        released = self.core.finish(lease, Settlement(used_tokens=used_tokens))[1]
        if record_key:
            self._end_record(record_key, admission_id)
        return released

    def _end_record(self, record_key: str, admission_id: str) -> None:
        """Delete the record if it still hands out ``admission_id`` (not a newer admission of the key)."""
        def end(pipe: Any) -> None:
            raw = pipe.get(record_key)
            pipe.multi()
            if raw is not None and raw != _IN_PROGRESS and json.loads(raw)["admission_id"] == admission_id:
                pipe.delete(record_key)

        self.redis.transaction(end, record_key)

    def heartbeat(self, admission_id: str) -> bool:
        """Extend a live lease, the router's record of it and the idempotency record that
        hands it out, by one lease; False if there is none (never issued, expired or completed)."""
        issued = self._issued(admission_id)
        if issued is None or not self.core.heartbeat(issued[0], self.lease_ms):
            return False
        self.redis.pexpire(keys.router_admission(self.namespace, admission_id), self.lease_ms)
        if issued[1]:  # a retry after the first lease is still handed this admission, not a second one
            self.redis.pexpire(issued[1], self.lease_ms)
        return True
