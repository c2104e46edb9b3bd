"""Calls: one admitted task's call to the backend, from its start to its answer's durable write.

* ``solver`` — solve one task: each outcome of a call and the status change it makes
* ``call`` — :class:`Call`: one admission's slot, heartbeat registration and answer
* ``answers`` — the answer writer, the only way an answer reaches PostgreSQL
* ``signals`` — what a call's end tells the admission core (429 pause, circuit, settlement)
* ``heartbeat`` — renews the leases of the calls this process owns
* ``cancellation`` — cuts off the losing call of a hedged task (Redis pub/sub)
* ``pool`` — the resizable thread pool that follows each model's concurrency
* ``consumers`` — each worker process's live record of the models whose queues it consumes
* ``runtime`` — per-process handles (services, backend client), made after any fork
"""
