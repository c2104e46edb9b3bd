"""The pipeline: beat → dispatch → model.<name> queues → worker pools → backend → PostgreSQL.

* ``app`` — the Celery app (config: top-level ``celeryconfig.py``)
* ``tasks`` — the Celery task entry points, thin wrappers over:
* ``dispatcher`` — pending tasks → admission core → ``solve`` messages, and the ready lists' stock
* ``solver`` — each outcome of a call and the status change it makes
* ``signals`` — what a call's end tells the admission core (429 pause, circuit, settlement)
* ``call`` — one call's life: its admission, slot, heartbeat registration and answer
* ``answers`` — the answer writer, the only way an answer reaches PostgreSQL
* ``heartbeat`` — renews the leases of the calls this process owns
* ``cancellation`` — cuts off the losing call of a hedged task (Redis pub/sub)
* ``ingest`` — inbox JSONL files → tasks, each file once
* ``trigger`` — coalesced "dispatch now" requests (a slot freed with no next call, a ready list ran low)
* ``fallback`` — the dispatcher's own ticks, for when beat is gone
* ``pool`` — the resizable thread pool that follows each model's concurrency
* ``runtime`` — per-process handles (services, backend client)
* ``kombu_redis`` — a correction to kombu's Redis transport, so workers survive a Redis that dies
* ``metrics`` — ``balancer metrics``, the Prometheus exporter
* ``summary`` — the per-model summary ``balancer status`` and ``balancer top`` show
"""
