"""Keep this process's calls alive, from their start to their answer's durable write.

A call's lease is short (``BALANCER_LEASE_SECONDS``, 30 s by default),
whatever the call's own length. A :class:`~balancer.calls.call.Call`
registers here when its worker takes it on and releases its registration when
its answer is durably written, or when it ends with no answer to write (see
the solver's table). Every third of a lease, this process renews what each
registered call holds:

- its slot in the admission core, until the slot is freed (``heartbeat.lua``:
  only a live lease is extended, an expired one is not taken again);
- its entry in the live-call set in Redis (:func:`live_calls`), which the
  sweep reads: a task past its deadline whose call (or hedge) is in that set
  is not returned to pending, its deadline is moved on instead
  (:func:`balancer.backlog.leases.return_expired`). This is what holds while
  the worker cannot reach PostgreSQL but the sweep can;
- its task's deadline in PostgreSQL (by the task's own admission id, or by its
  hedge's: whichever of a hedged task's calls is still live keeps it), which
  is also what tells a redelivered message that the call is still running in
  a live worker (:func:`balancer.backlog.transitions.start_solve` refuses it).
  This write runs on a thread of its own, so a stalled PostgreSQL never holds
  up the renewals in Redis; and the Redis renewals run on another, so a
  Redis that refuses or drops connections never holds up the deadlines.
  Each slot is renewed on its own: a Redis error on one does not skip the rest.

Each call has a registration of its own (its ``key``, the call's id), and an
admission is renewed while any of its registrations lasts: a redelivered copy
of a message whose call this process runs (kombu puts a worker's unacknowledged
messages back the moment its broker connection drops, and the same worker
takes them) makes no call, and its end must not let the running call go.

A registration lapses at its ``until`` (the solve's deadline plus one write
grace) even if it was never released: no call is kept alive for ever by a
write that hangs. A worker that dies stops beating: its slots free, and the
sweep tick returns its tasks to pending, within about one lease.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis

from balancer.admission import keys
from balancer.admission.finishes import KeptFinishes
from balancer.backlog.transitions import extend_deadlines
from balancer.services import Services

log = logging.getLogger(__name__)


@dataclass
class _Registration:
    until: float  # time.monotonic(): renewals stop here
    slot: bool = True  # the slot is held (not yet freed)
    started: bool = False  # the call is under way: a lost slot lease is worth a warning
    admission_id: str = ""  # what is renewed for it (one admission may have several registrations)


def redis_now_ms(client: redis.Redis) -> int:
    """Redis's clock (ms): the one clock every host's heartbeat and the sweep share."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def mark_live(client: redis.Redis, namespace: str, live: list[str], gone: list[str], lease_ms: int) -> None:
    """Record ``live`` calls as alive for one lease, forget ``gone`` ones, and
    drop entries a lease past their time (a worker that died)."""
    now = redis_now_ms(client)
    key = keys.live_calls(namespace)
    pipe = client.pipeline(transaction=False)
    if live:
        pipe.zadd(key, {aid: now + lease_ms for aid in live})
    if gone:
        pipe.zrem(key, *gone)
    pipe.zremrangebyscore(key, "-inf", now - lease_ms)
    pipe.execute()


def live_calls(client: redis.Redis, namespace: str) -> set[str]:
    """Admission ids of the calls some worker keeps alive now (for the sweep)."""
    now = redis_now_ms(client)
    members: list[bytes] = client.zrangebyscore(keys.live_calls(namespace), now, "+inf")  # type: ignore[assignment]
    return {m.decode() for m in members}


class Heartbeat:
    """Renews the registered calls every ``lease / 3`` seconds; see the module docstring."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.lease_seconds = services.settings.lease_seconds
        self.interval = services.settings.heartbeat_seconds
        self._calls: dict[str, _Registration] = {}  # by registration key
        self._gone: list[str] = []  # admissions released since the last beat: out of the live-call set
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writing_deadlines = threading.Lock()  # one deadline write at a time
        self._beating_redis = threading.Lock()  # one Redis half at a time
        #: Finishes of this process's calls that could not reach Redis, applied when it answers.
        self.finishes = KeptFinishes(services.core)

    # -- a call's registration ---------------------------------------------------------
    def register(self, admission_id: str, *, until: float, key: str | None = None) -> None:
        """Keep ``admission_id`` alive until registration ``key`` (a call's own id; by default the
        admission id) is released, or ``until`` (monotonic) at the latest."""
        self._start()
        with self._lock:
            self._calls[key or admission_id] = _Registration(until, admission_id=admission_id)

    def started(self, key: str) -> None:
        """The call is under way (its slot should be live from now on)."""
        with self._lock:
            if (reg := self._calls.get(key)) is not None:
                reg.started = True

    def slot_freed(self, key: str) -> None:
        """The call's slot is free: renew only its task's deadline from now on."""
        with self._lock:
            if (reg := self._calls.get(key)) is not None:
                reg.slot = False

    def release(self, key: str) -> None:
        """The call is over (its answer written, or nothing left to write)."""
        with self._lock:
            if (reg := self._calls.pop(key, None)) is not None:
                self._gone.append(reg.admission_id)

    def mark_live_now(self, admission_id: str) -> None:
        """Put a registered call in the live-call set now, not at the next beat (a hedge's start:
        the sweep must see it at once). A Redis error is logged: the next beat adds it."""
        try:
            mark_live(self.services.redis, self.services.settings.namespace, [admission_id], [],
                      self.lease_seconds * 1000)
        except (redis.RedisError, OSError) as exc:
            log.warning("could not add call %s to the live-call set now (%s); the next beat adds it", admission_id,
                        _first_line(exc))

    def holds(self, admission_id: str) -> bool:
        """Whether ``admission_id`` is kept alive by some registration (for tests and logs)."""
        with self._lock:
            return any(reg.admission_id == admission_id for reg in self._calls.values())

    # -- the beat ------------------------------------------------------------------------
    def beat(self) -> tuple[int, int]:
        """One pass, both halves in this thread: (slots extended, task deadlines extended).
        The deadlines are extended whatever the Redis half does."""
        calls, gone = self._take()
        try:
            slots = self._beat_redis(calls, gone)
        finally:
            extended = self._extend_deadlines(list(calls))
        return slots, extended

    def _take(self) -> tuple[dict[str, _Registration], list[str]]:
        """The admissions to renew (each with what its registrations hold together), and those
        released or lapsed that no registration keeps any more."""
        now = time.monotonic()
        with self._lock:
            lapsed = [reg.admission_id for key, reg in self._calls.items() if reg.until <= now]
            self._calls = {key: reg for key, reg in self._calls.items() if reg.until > now}
            calls: dict[str, _Registration] = {}
            for reg in self._calls.values():
                both = calls.setdefault(reg.admission_id, _Registration(reg.until, False, False, reg.admission_id))
                both.until, both.slot = max(both.until, reg.until), both.slot or reg.slot
                both.started = both.started or reg.started
            gone = sorted({aid for aid in self._gone + lapsed if aid not in calls})
            self._gone = []
        if lapsed:
            log.warning("%d call(s) still unfinished one write grace past their solve's deadline (a start or an "
                        "answer's write hung on PostgreSQL): no longer kept alive, the sweep returns their tasks: %s",
                        len(lapsed), ", ".join(lapsed[:5]))
        return calls, gone

    def _beat_redis(self, calls: dict[str, _Registration], gone: list[str]) -> int:
        """The Redis half: slots and the live-call set. Returns the slots extended.

        A Redis error never ends the pass early: each slot's renewal is tried on
        its own (one failing lease does not skip the rest). The PostgreSQL half
        does not wait for this one (a Redis that refuses connections can hold a
        call for seconds of client retries)."""
        if not calls and not gone:
            return 0
        core, lease_ms = self.services.core, self.lease_seconds * 1000
        slots = lost = failed = 0
        error: Exception | None = None
        for aid, reg in calls.items():
            if not reg.slot:
                continue
            try:
                renewed = core.heartbeat(aid, lease_ms)
            except (redis.RedisError, OSError) as exc:
                failed, error = failed + 1, exc
                continue
            if renewed:
                slots += 1
            elif reg.started:
                lost += 1
        if lost:
            log.warning("%d running call(s) had lost their slot lease (expired, or Redis lost its data)", lost)
        if failed:
            log.warning("renewing %d slot lease(s) failed on Redis, the others went on; their task deadlines are "
                        "still extended: %s", failed, _first_line(error))
        try:
            mark_live(self.services.redis, self.services.settings.namespace, list(calls), gone, lease_ms)
        except (redis.RedisError, OSError) as exc:
            log.warning("updating the live-call set failed on Redis; task deadlines are still extended: %s",
                        _first_line(exc))
            with self._lock:  # forgotten next time
                self._gone.extend(gone)
        return slots

    def _extend_deadlines(self, admission_ids: list[str]) -> int:
        with self._writing_deadlines:
            return extend_deadlines(self.services.engine, admission_ids, self.lease_seconds)

    def _extend_in_background(self, admission_ids: list[str]) -> None:
        """The PostgreSQL half, off the beat's thread; skipped while the last one still runs."""
        if not admission_ids or self._writing_deadlines.locked():
            return

        def run() -> None:
            try:
                self._extend_deadlines(admission_ids)
            except Exception as exc:  # PostgreSQL away: the live-call set keeps the sweep off meanwhile
                log.warning("extending task deadlines failed: %s", (str(exc).splitlines() or [""])[0])

        threading.Thread(target=run, name="lease-deadlines", daemon=True).start()

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
            calls, gone = self._take()
            self._extend_in_background(list(calls))  # a Redis half that fails or hangs never holds it up
            self._beat_redis_in_background(calls, gone)

    def _beat_redis_in_background(self, calls: dict[str, _Registration], gone: list[str]) -> None:
        """The Redis half, off the beat's thread; skipped while the last one still runs
        (a Redis that refuses connections holds each command through the client's retries)."""
        if not self._beating_redis.acquire(blocking=False):
            with self._lock:  # forgotten next time
                self._gone.extend(gone)
            return

        def run() -> None:
            try:
                self._beat_redis(calls, gone)
            except Exception as exc:  # an unforeseen error: the next beat tries again
                log.warning("lease heartbeat failed, retrying in %.1fs: %s", self.interval, _first_line(exc))
            finally:
                self._beating_redis.release()

        threading.Thread(target=run, name="lease-slots", daemon=True).start()


def _first_line(exc: BaseException | None) -> str:
    return (str(exc).splitlines() or [""])[0]
