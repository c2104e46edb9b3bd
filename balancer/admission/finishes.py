"""Finishes that could not reach Redis, kept in memory and applied once it answers.

A call that ends while Redis is unreachable (a failover, a restart, a cut) could
not free its slot: its lease held that slot until it expired, a whole lease
after the outage ended, so a 5 s failover cost 30 s of throughput. Now its
finish is kept here (bounded: :data:`MAX_KEPT`, the oldest dropped first, whose
leases expire on their own) and retried every :data:`RETRY_S` on a thread of its
own, so the slots of calls that ended during the outage are free within a
retry of Redis answering again (on the promoted replica, through Sentinel).

A kept finish settles the call's tokens (``used``/``reserved``) and its latency
sample, but not the provider's remaining-quota or limit headers: those were true
when the call ended and would lower the buckets to a level the provider has
refilled since. A finish is idempotent (finish.lua): one whose lease expired
meanwhile, or that another path applied, finds nothing to free.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import redis

from balancer.admission.core import AdmissionCore
from balancer.admission.values import Settlement

log = logging.getLogger(__name__)

#: Finishes kept at most per process; past it the oldest is dropped (its lease expires on its own).
MAX_KEPT = 10_000
#: Seconds between attempts to apply the kept finishes.
RETRY_S = 0.5


def without_headers(settlement: Settlement | None) -> Settlement | None:
    """A settlement to apply late: its tokens and latency, not the provider's headers then.

    >>> without_headers(Settlement(used_tokens=10, reserved_tokens=20, remaining_tokens=5, limit_requests=9))
    Settlement(used_tokens=10, reserved_tokens=20, remaining_tokens=None, remaining_requests=None, \
limit_tokens=None, limit_requests=None, latency_ms=None, completion_tokens=None)
    """
    if settlement is None:
        return None
    return dataclasses.replace(settlement, remaining_tokens=None, remaining_requests=None, limit_tokens=None,
                               limit_requests=None)


class KeptFinishes:
    """This process's finishes waiting for Redis; see the module docstring.

    Each kept finish is an action under its admission id (a later one replaces it): a
    call's finish (:meth:`keep`), a cancelled call's hold (:meth:`keep_hold`), or any
    other (:meth:`keep_action`, e.g. the router's ``/complete``)."""

    def __init__(self, core: AdmissionCore, *, retry_s: float = RETRY_S, limit: int = MAX_KEPT) -> None:
        self.core, self.retry_s, self.limit = core, retry_s, limit
        self._kept: OrderedDict[str, Callable[[], object]] = OrderedDict()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def keep(self, admission_id: str, settlement: Settlement | None) -> None:
        """Keep a finish that failed on Redis, to apply when it answers."""
        late = without_headers(settlement)
        self.keep_action(admission_id, lambda: self.core.finish(admission_id, late))

    def keep_hold(self, admission_id: str, hold_ms: int) -> None:
        """Keep a cancelled call's hold (:meth:`AdmissionCore.hold`) that failed on Redis: applied
        late, it holds the slot only for what is left of ``hold_ms`` (none left: a finish)."""
        until = time.monotonic() + hold_ms / 1000

        def hold() -> object:
            left_ms = round((until - time.monotonic()) * 1000)
            return self.core.hold(admission_id, left_ms) if left_ms > 0 else self.core.finish(admission_id)

        self.keep_action(admission_id, hold)

    def keep_action(self, admission_id: str, action: Callable[[], object]) -> None:
        """Keep ``action``, which failed on Redis, to run when it answers (it raises a Redis error until then)."""
        with self._lock:
            self._kept[admission_id] = action
            while len(self._kept) > self.limit:
                self._kept.popitem(last=False)
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.warning("%d kept finish(es) dropped (more than %d waiting for Redis): their leases expire on "
                                "their own", self.dropped, self.limit)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kept-finishes", daemon=True)
                self._thread.start()

    def waiting(self) -> int:
        with self._lock:
            return len(self._kept)

    def apply(self) -> int:
        """Apply the kept finishes, oldest first, until Redis fails again; how many were applied."""
        with self._lock:
            kept = list(self._kept.items())
        applied = 0
        for admission_id, action in kept:
            try:
                action()
            except (redis.RedisError, OSError):
                break
            applied += 1
            with self._lock:
                if self._kept.get(admission_id) is action:  # (not kept again meanwhile)
                    del self._kept[admission_id]
        if applied:
            log.info("applied %d finish(es) kept while Redis was unreachable: their slots are free", applied)
        return applied

    def _run(self) -> None:
        while True:
            time.sleep(self.retry_s)
            self.apply()
            with self._lock:
                if not self._kept:
                    self._thread = None
                    return
