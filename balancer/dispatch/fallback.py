"""The dispatcher's own ticks, for when beat is gone.

Beat drives the periodic dispatch, sweep and ingest ticks. If beat dies, work
must not stop: freed slots and ``submit`` still ask for dispatches, but a task
whose back-off ends, a model whose 429 pause ends, an expired lease or a file in
the inbox needs a tick. So beat's dispatch tick records when it ran (a Redis key
that expires after :data:`ABSENT_AFTER` ticks), and every dispatcher process
runs :class:`FallbackTicks`: while that key is missing it sends the three ticks
itself, at beat's intervals, and logs once that beat is absent (``balancer
status`` says so too). Two dispatchers doing this is harmless: dispatch
requests coalesce (:mod:`balancer.dispatch.trigger`), the sweep is idempotent
and ingestion claims each file once.

Each time the dispatcher's consumer connects to the broker (at start, and after
a lost connection, a Redis failover among them) it also asks for a dispatch at
once (:meth:`FallbackTicks.connected`): the ticks and requests sent while it was
away may have gone with the old master.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from celery import bootsteps

from balancer.admission import keys
from balancer.dispatch.beat_seen import ABSENT_AFTER as ABSENT_AFTER
from balancer.dispatch.beat_seen import beat_last_seen_s as beat_last_seen_s
from balancer.dispatch.beat_seen import mark_beat_seen as mark_beat_seen
from balancer.settings import Settings

log = logging.getLogger(__name__)

#: One of beat's ticks: its interval in seconds, and what sends it.
Tick = tuple[float, Callable[[], object]]


class FallbackTicks(bootsteps.StartStopStep):
    """In the dispatcher (the consumer of the ``control`` queue): beat's ticks while beat is absent.

    A subclass says what the ticks are (:meth:`ticks`): the Celery tasks live in
    :mod:`balancer.pipeline.tasks`, which registers that subclass, so this module
    does not import it back."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent, **kwargs) -> None:  # noqa: ANN001
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()

    def start(self, consumer) -> None:  # noqa: ANN001
        """Runs when the consumer starts, and again each time it reconnects to the broker."""
        if keys.CONTROL_QUEUE not in {q.name for q in consumer.task_consumer.queues}:
            return  # a model worker: beat's ticks are the dispatcher's business
        self._stop = stop = threading.Event()  # a thread of its own per start: the last one's ends with its stop
        threading.Thread(target=self._run, args=(stop,), name="fallback-ticks", daemon=True).start()

    def stop(self, consumer) -> None:  # noqa: ANN001
        self._stop.set()

    def ticks(self, settings: Settings) -> list[Tick]:
        """Beat's schedule: (interval, send) for the dispatch, sweep and ingest ticks."""
        raise NotImplementedError

    def connected(self) -> None:
        """Once the consumer is (again) connected to the broker: the ticks and dispatch requests
        sent while it was away may be lost with a failed-over broker, so ask for what they would
        have asked for now. Nothing by default."""

    def _run(self, stop: threading.Event) -> None:
        from balancer.calls.runtime import services

        try:
            self.connected()
        except Exception:  # the loop below goes on: beat's ticks or its own ask again
            log.exception("asking for a dispatch after the broker connection failed")
        settings = services().settings
        ticks = self.ticks(settings)
        last_sent = [0.0] * len(ticks)
        absent = False
        grace_until = time.monotonic() + settings.dispatch_tick * ABSENT_AFTER  # beat may be starting too
        while not stop.wait(min(1.0, settings.dispatch_tick)):
            try:
                svc = services()
                if time.monotonic() < grace_until or beat_last_seen_s(svc.redis, settings.namespace) is not None:
                    if absent:
                        log.info("beat is back; the dispatcher's fallback ticks stop")
                    absent = False
                    continue
                if not absent:
                    log.warning("beat has not ticked for %ss: the dispatcher runs the dispatch, sweep and ingest ticks "
                                "itself until it is back", f"{settings.dispatch_tick * ABSENT_AFTER:g}")
                absent = True
                now = time.monotonic()
                for i, (interval, send) in enumerate(ticks):
                    if now - last_sent[i] >= interval:
                        last_sent[i] = now
                        send()
            except Exception:  # keep ticking through a Redis or broker blip
                log.exception("fallback tick failed; retrying")
