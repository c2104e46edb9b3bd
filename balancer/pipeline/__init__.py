"""The pipeline: beat → dispatch → model.<name> queues → worker pools → backend → PostgreSQL.

* ``app`` — the Celery app (config: top-level ``celeryconfig.py``)
* ``tasks`` — the Celery task entry points, thin wrappers over:
* ``dispatcher`` — pending tasks → admission core → ``solve`` messages
* ``solver`` — each outcome of a call and the status change it makes
* ``call`` — one call's life: its admission, slot, heartbeat registration and answer
* ``answers`` — the answer writer, the only way an answer reaches PostgreSQL
* ``heartbeat`` — renews the leases of the calls this process owns
* ``ingest`` — inbox JSONL files → tasks, each file once
* ``trigger`` — coalesced "dispatch now" requests (a slot just freed)
* ``pool`` — the resizable thread pool that follows each model's concurrency
* ``runtime`` — per-process handles (services, backend client)
"""
