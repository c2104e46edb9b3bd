"""Keep the leases of this process's running calls alive (seed design, iteration 2, B).

A call's lease is short (``BALANCER_LEASE_SECONDS``, 30 s by default),
whatever the call's own length: while a call runs, this process renews it
every third of a lease, in both places it lives:

- its slot in the admission core (``heartbeat.lua``: only a live lease is
  extended, an expired one is not taken again);
- its task's deadline in PostgreSQL, which is also what tells a redelivered
  message that the call is still running in a live worker
  (:func:`balancer.storage.transitions.start_solve` refuses it then).

A worker that dies stops beating: its slots free, and the sweep tick
returns its tasks to pending, within about one lease.

One thread per worker process, renewing every call this process holds in one
pass (one script call per lease, one UPDATE for all tasks).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from balancer.services import Services
from balancer.storage.transitions import extend_deadlines

log = logging.getLogger(__name__)


class Heartbeat:
    """Renews the leases registered with :meth:`running` every ``lease / 3`` seconds."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.lease_seconds = services.settings.lease_seconds
        self.interval = services.settings.heartbeat_seconds
        self._calls: dict[str, bool] = {}  # admission id -> whether it is the task's own (not a hedge's) lease
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def running(self, admission_id: str, *, hedge: bool = False) -> Iterator[None]:
        """Keep ``admission_id``'s lease (and, unless a hedge, its task's deadline) alive inside the block."""
        self._start()
        with self._lock:
            self._calls[admission_id] = not hedge
        try:
            yield
        finally:
            with self._lock:
                self._calls.pop(admission_id, None)

    def beat(self) -> tuple[int, int]:
        """One pass: (slots extended, task deadlines extended)."""
        with self._lock:
            calls = dict(self._calls)
        if not calls:
            return 0, 0
        core = self.services.core
        slots = sum(core.heartbeat(aid, self.lease_seconds * 1000) for aid in calls)
        lost = len(calls) - slots
        if lost:
            log.warning("%d running call(s) had lost their slot lease (expired, or Redis lost its data)", lost)
        tasks = extend_deadlines(self.services.engine, [aid for aid, own in calls.items() if own], self.lease_seconds)
        return slots, tasks

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 1)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lease-heartbeat", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception as exc:  # Redis or PostgreSQL away: the next beat tries again
                log.warning("lease heartbeat failed, retrying in %.1fs: %s", self.interval,
                            (str(exc).splitlines() or [""])[0])
