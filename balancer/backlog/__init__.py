"""The backlog: every task in PostgreSQL, from intake to its end and its history.

Pure rules first, then one job a module over the ``tasks`` table:

* ``intake`` — JSONL task lines (``balancer submit``, the inbox) parsed: task key and metadata (pure)
* ``statuses`` — every status a task can have, in the order ``status`` lists them (pure)
* ``insert`` — new tasks into the backlog (``pending``)
* ``claims`` — the dispatcher's claims: the pinned lane, the window, each source's head, marking tasks ``queued``
* ``ready`` — ready-list entries: their ids, marking them ``ready``, returning dropped ones
* ``statements`` — the admission guard and the one-statement writes every status change shares
* ``transitions`` — a task's status changes on the solve path
* ``hedges`` — straggling calls, recording a hedge, what a hedge's loss changes
* ``leases`` — task deadlines, the other half of a call's lease: the sweep, re-seeding Redis
* ``retry`` — writes that outlast a PostgreSQL outage, within the solve's deadline
* ``ledger`` — one ``call_usage`` row per call sent to the backend, written with its answer
* ``spend`` — spend so far, from the ledger, at each call's own price
* ``reads`` — the read-only queries of ``status``, the metrics exporter and the drain ETA
* ``removal`` — removing a model: what it would strand, failing the tasks only it could take
* ``operations`` — what an operator does: list, show, retry failed tasks, cancel pending ones (audited)
* ``results`` — ended tasks out, in pages, from a resumable cursor
* ``retention`` — what the history of finished tasks costs, and pruning it (audited)
"""
