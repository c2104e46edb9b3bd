"""Celery's worker consumer, surviving a Redis broker that dies mid-run.

When the broker connection drops, Celery's consumer first *collects* the dead
connection (which clears its client) and then *closes* it. For the Redis
transport, the close restores unacknowledged messages through a new client
built from that cleared one, and fails with ``AttributeError: 'NoneType'
object has no attribute 'hostname'`` (kombu 5.x; the same class of failure
as celery/kombu#582 and #970). ``ignore_errors`` lets only connection errors
through, so the worker stops with "Unrecoverable error" instead of
reconnecting: after ``kill -9`` of Redis, every worker and dispatcher died.

This consumer treats that failure as the connection error it is: the close is
abandoned and the usual reconnect cycle runs. Nothing is lost: messages that
were unacknowledged go back to their queues after the visibility timeout (or
at once when the old Redis lost them anyway), and a copy of a call that is
still running starts no second call (:mod:`balancer.pipeline.solver`).
Configured by ``worker_consumer`` in ``celeryconfig.py``, Celery's own
extension point.
"""

from __future__ import annotations

import logging

from celery.worker.consumer import Consumer as CeleryConsumer

log = logging.getLogger(__name__)


class Consumer(CeleryConsumer):
    def on_connection_error_after_connected(self, exc: Exception) -> None:
        try:
            super().on_connection_error_after_connected(exc)
        except AttributeError as broken:
            log.warning("closing the lost broker connection failed (%r); reconnecting anyway", broken)
