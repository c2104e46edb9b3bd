"""Each worker process says which models' queues it consumes: a short-lived record per model
in Redis (``keys.consumers``), renewed every ``BEAT_MS`` while the process consumes (the timings:
:mod:`balancer.admission.liveness`).

The dispatcher admits nothing to a model with no live record (admit.lua, with
``BALANCER_CONSUMERS_REQUIRED``), returns its ready list and its queued tasks to
pending at once (:mod:`balancer.dispatch.served`), and ``status``,
``top``, the metrics and the console name it (``no_consumer``,
:mod:`balancer.health.reasons`). So a worker host that is cut off, or gone, stops
getting work within :data:`TTL_MS` instead of the tasks cycling through its
queues for a lease each, and its models take work again within one beat of its
return.

:class:`ConsumerBeat` is a consumer bootstep: it beats while Celery's consumer
runs (from its connection to the broker), stops with it (a lost broker
connection restarts the consumer, and the beat with it), and removes its
records when the worker stops, so a drained host's models are known unconsumed
at once. A beat that cannot reach Redis is retried at the next one; the records
expire on their own.
"""

from __future__ import annotations

import logging
import os
import threading
from urllib.parse import urlsplit

import redis
from celery import bootsteps

from balancer.admission.liveness import BEAT_MS, TTL_MS
from balancer.calls.pool import model_queues

log = logging.getLogger(__name__)

BEAT_S = BEAT_MS / 1000


class ConsumerBeat(bootsteps.StartStopStep):
    """Renews this worker process's consumer records; see the module docstring."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent, **kwargs) -> None:  # noqa: ANN001
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._models: list[str] = []
        self._warmed = False
        self.consumer_id = ""

    def start(self, consumer) -> None:  # noqa: ANN001
        if not model_queues(consumer) and not consumer.app.conf.get("balancer_all_models"):
            return  # the dispatcher: it consumes no model's queue
        if not self._warmed:
            self._warmed = self._warm()
        self.consumer_id = f"{consumer.hostname}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(consumer, self._stop), name="consumer-beat",
                                        daemon=True)
        self._thread.start()

    def stop(self, consumer) -> None:  # noqa: ANN001
        self._stop.set()

    @staticmethod
    def _warm() -> bool:
        """Make the solve path's handles before the first record says this worker consumes:
        otherwise its models' first calls wait for them (:func:`balancer.calls.runtime.warm`)."""
        from balancer.calls.runtime import services, warm

        try:
            warm()
        except Exception as exc:  # noqa: BLE001 - made again at the first solve, which reports what fails
            log.warning("could not prepare the backend client before the first call (%s); it is made then", exc)
            return False
        settings = services().settings
        url = urlsplit(settings.backend_url)
        log.info("backend client ready: %s at %s://%s", settings.backend_kind, url.scheme, url.netloc.rpartition("@")[2])
        return True

    def shutdown(self, consumer) -> None:  # noqa: ANN001
        """The worker stops: its records go now, so its models are known unconsumed at once."""
        self._stop.set()
        if self._models:
            try:
                from balancer.calls.runtime import services

                services().core.note_consumers(self.consumer_id, self._models, 0)
            except (redis.RedisError, OSError) as exc:
                log.warning("could not remove this worker's consumer records (%s); they expire on their own", exc)

    def _run(self, consumer, stop: threading.Event) -> None:  # noqa: ANN001
        from balancer.calls.runtime import services

        failing = False
        while True:
            try:
                self._models = model_queues(consumer)
                services().core.note_consumers(self.consumer_id, self._models, TTL_MS)
                if failing:
                    log.info("consumer records renewed again for %s", ", ".join(self._models))
                failing = False
            except Exception as exc:  # noqa: BLE001 - Redis away: the records expire, and the next beat tries again
                if not failing:
                    log.warning("could not renew this worker's consumer records (%s); retrying every %.1f s", exc,
                                BEAT_S)
                failing = True
            if stop.wait(BEAT_S):
                return
