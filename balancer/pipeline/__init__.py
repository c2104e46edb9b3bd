"""The pipeline: beat → dispatch → model.<name> queues → worker pools → backend → PostgreSQL.

* ``app`` — the Celery app (config: top-level ``celeryconfig.py``)
* ``tasks`` — the Celery task entry points, thin wrappers over:
* ``dispatcher`` — pending tasks → admission core → ``solve`` messages, and the ready lists' stock
* ``fairness`` — the dispatch window filled across sources by weight
* ``budgets`` — the sources over their budget per day, whose tasks the dispatcher leaves pending
* ``placement`` — the end game in a dispatch round: each model's outlook, finish-time-aware placement
* ``stocking`` — how many tasks each busy model keeps ready, and marking them ``ready``
* ``solver`` — each outcome of a call and the status change it makes
* ``signals`` — what a call's end tells the admission core (429 pause, circuit, settlement)
* ``call`` — one call's life: its admission, slot, heartbeat registration and answer
* ``answers`` — the answer writer, the only way an answer reaches PostgreSQL
* ``heartbeat`` — renews the leases of the calls this process owns
* ``lost`` — queued tasks whose solve messages the broker lost, back to pending within seconds
* ``cancellation`` — cuts off the losing call of a hedged task (Redis pub/sub)
* ``consumers`` — each worker process's live record of the models whose queues it consumes
* ``ingest`` — inbox JSONL files → tasks, each file once
* ``trigger`` — coalesced "dispatch now" requests (a slot freed with no next call, a ready list ran low)
* ``fallback`` — the dispatcher's own ticks, for when beat is gone
* ``beat_seen`` — when beat last ticked, read without importing Celery
* ``ticklog`` — the periodic ticks' log lines at DEBUG
* ``pool`` — the resizable thread pool that follows each model's concurrency
* ``runtime`` — per-process handles (services, backend client)
* ``kombu_redis`` — a correction to kombu's Redis transport, so workers survive a Redis that dies
* ``health`` — the facts behind each model's and source's health, recorded and read
* ``overview`` — what ``status``, ``top`` and the console show of the whole backlog, read once per look
* ``summary`` — the per-model summary ``balancer status`` and ``balancer top`` show
* ``metrics`` — ``balancer metrics``, the Prometheus exporter
"""
