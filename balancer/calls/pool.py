"""A thread pool that follows each model's ``max_concurrent_requests``, live.

Why threads: a solve spends nearly all its time waiting on one HTTP call
(1 s to 2 min), so the work is I/O-bound. Threads need no monkey-patching of
psycopg2 or httpx (gevent would need both, and psycogreen), cost ~100 KB of
RSS each, and 1,000 of them fit easily in memory. Prefork would spend
a process per in-flight call.

Celery's own thread pool cannot grow or shrink, so this one adds ``grow``
and ``shrink`` (as Celery's gevent pool has). :class:`QuotaWatcher`, a
consumer bootstep, reads the live quotas every second and resizes the pool
and the prefetch count (exactly what Celery's ``pool_grow``/``pool_shrink``
remote commands do). With ``acks_late`` and prefetch multiplier 1, the
prefetch count is what bounds the calls a worker runs at once, so a shrink
takes effect as soon as running calls finish, with no restart and no lost
task. The admission core caps in-flight calls globally regardless.
"""

from __future__ import annotations

import logging
import threading

from celery import bootsteps
from celery.concurrency.thread import TaskPool

from balancer.admission import keys

log = logging.getLogger(__name__)

WATCH_INTERVAL = 1.0


class ResizableThreadPool(TaskPool):
    limit: int

    def grow(self, n: int = 1) -> None:
        self.limit += n
        self.executor._max_workers = self.limit  # ThreadPoolExecutor adds threads on demand

    def shrink(self, n: int = 1) -> None:
        self.limit = max(1, self.limit - n)
        self.executor._max_workers = self.limit

    @property
    def num_processes(self) -> int:
        return self.limit


def model_queues(consumer) -> list[str]:  # noqa: ANN001
    return [m for q in consumer.task_consumer.queues if (m := keys.queue_model(q.name)) is not None]


class QuotaWatcher(bootsteps.StartStopStep):
    """Resize the pool to the sum of this worker's models' concurrency caps.

    In a ``worker --all-models`` process (``app.conf.balancer_all_models``) it
    also starts consuming ``model.<name>`` for every model created after the
    worker started, through Celery's own ``add_consumer`` control command (run
    in the consumer's thread, as a remote ``celery control add_consumer`` is)."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent, **kwargs) -> None:  # noqa: ANN001
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, consumer) -> None:  # noqa: ANN001
        models = model_queues(consumer)
        all_models = bool(consumer.app.conf.get("balancer_all_models"))
        if not (models or all_models) or not hasattr(consumer.pool, "grow"):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(consumer, models), name="quota-watcher", daemon=True)
        self._thread.start()

    def stop(self, consumer) -> None:  # noqa: ANN001
        self._stop.set()

    def _run(self, consumer, models: list[str]) -> None:  # noqa: ANN001
        from balancer.calls.runtime import services

        all_models = bool(consumer.app.conf.get("balancer_all_models"))
        while not self._stop.wait(WATCH_INTERVAL):
            try:
                live = services().core.live()
                if all_models:
                    for name in sorted(live.keys() - set(models)):
                        consumer.app.control.add_consumer(keys.model_queue(name), destination=[consumer.hostname], reply=False)
                        models.append(name)
                        log.info("new model %s: consuming model.%s", name, name)
                target = max(1, sum(live[m].quota.max_concurrent_requests for m in models if m in live))
                diff = target - consumer.pool.num_processes
                if diff > 0:
                    consumer.pool.grow(diff)
                elif diff < 0:
                    consumer.pool.shrink(-diff)
                if diff:
                    consumer._update_prefetch_count(diff)
                    log.info("pool for %s resized to %d", ",".join(m for m in models if m in live),  # not a removed one
                             consumer.pool.num_processes)
            except Exception:  # keep watching through a Redis blip
                log.exception("quota watcher failed; retrying")
