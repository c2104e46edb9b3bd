"""How soon a process tries its broker again after losing it.

kombu retries a lost broker connection 2 s after the first failure, then 4, 6,
... up to 30 s apart (Celery's consumer and beat pass no intervals of their
own). After a Redis failover that takes a few seconds, that wait can cost as
much again as the outage: workers and the dispatcher come back seconds after
Sentinel has named the new master, and work stands still meanwhile. Here the
retries start :data:`RETRY_START_S` after
a failure and grow by :data:`RETRY_STEP_S` to at most :data:`RETRY_MAX_S`, so a
process is back at most that long after its broker, and a broker that stays
dead costs one connection attempt per broker URL every :data:`RETRY_MAX_S`.
A caller that states its own intervals (a publish's retry policy) keeps them.
"""

from __future__ import annotations

from typing import Any

import kombu
from celery.app.amqp import AMQP

RETRY_START_S = 0.25
RETRY_STEP_S = 0.25
RETRY_MAX_S = 1.0


class PromptConnection(kombu.Connection):
    """A kombu connection whose reconnection retries default to the intervals above."""

    def _ensure_connection(self, errback: Any = None, max_retries: int | None = None,
                           interval_start: float = RETRY_START_S, interval_step: float = RETRY_STEP_S,
                           interval_max: float = RETRY_MAX_S, *args: Any, **kwargs: Any) -> Any:
        return super()._ensure_connection(errback, max_retries, interval_start, interval_step, interval_max,
                                          *args, **kwargs)


class PromptAMQP(AMQP):
    """Celery's AMQP layer with :class:`PromptConnection` for every broker connection (``Celery(amqp=...)``)."""

    Connection = PromptConnection
    BrokerConnection = PromptConnection
