"""One correction to kombu's Redis transport, so workers survive a Redis that dies.

When the broker connection drops, Celery *collects* the dead connection,
which clears the transport's ``client``, and then still uses its channel: it
closes it (restoring unacknowledged messages) and runs acknowledgements
already queued on the event loop. Each of those builds a new Redis client from
the cleared one and fails with ``AttributeError: 'NoneType' object has no
attribute 'hostname'`` (kombu 5.x; the same class of failure as celery/kombu
#582 and #970). Celery and kombu tolerate only *connection* errors on those
paths, so the worker stopped with "Unrecoverable error" instead of
reconnecting: after ``kill -9`` of Redis, workers died in about one run in five.

:func:`install` makes a channel whose connection was collected raise the
connection error it is (``redis.ConnectionError``), which those paths already
handle: the close or the ack is given up and the consumer reconnects. Nothing
is lost: messages not acknowledged go back to their queues after the
visibility timeout (or at once when the old Redis lost them anyway), and a
copy of a call still running starts no second call
(:mod:`balancer.calls.solver`). Imported with the Celery app
(:mod:`balancer.pipeline.app`), so every worker, dispatcher and beat has it.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as transport


def install() -> None:
    """Patch ``Channel._connparams`` once; fails loudly if kombu renames it."""
    original = transport.Channel._connparams
    if getattr(original, "_balancer", False):
        return

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:  # the transport, or its client, collected
            raise redis.ConnectionError("the broker connection was lost and collected")
        return original(self, asynchronous)

    _connparams._balancer = True  # type: ignore[attr-defined]
    transport.Channel._connparams = _connparams  # type: ignore[method-assign]
