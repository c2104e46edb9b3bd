"""The Celery app: beat → dispatch → ``model.<name>`` queues → worker pools → backend → PostgreSQL.

The work itself lives in :mod:`balancer.dispatch` and :mod:`balancer.calls`; this package is
what Celery loads.

* ``app`` — the Celery app (config: top-level ``celeryconfig.py``)
* ``tasks`` — the Celery task entry points, thin wrappers over plain functions
* ``kombu_redis`` — a correction to kombu's Redis transport, so workers survive a Redis that dies
* ``reconnect`` — a lost broker is tried again within a second, not kombu's 2, 4, 6 ... 30 s
* ``ticklog`` — the periodic ticks' log lines at DEBUG
"""
