"""Micro-benchmarks, one figure each, run as ``python -m balancer.bench.micro.NAME``.

* ``admission_rate`` — admissions per second of the admission core, against a bare INCR loop
* ``router_load`` — ``/schedule`` + ``/complete`` pairs per second, against a bare endpoint
* ``dispatch_round`` — one dispatch round's time with a backlog no enabled model may take
* ``finish_trigger`` — what the ``tasks_finished`` trigger costs the solve path
* ``memory`` — the pipeline's RSS with 1,000 requests in flight
* ``ingest_memory`` — peak RSS of ingesting one large inbox file
* ``ingest_stall`` — call starts while a large inbox file is ingested
* ``source_ingest`` — a 1,000,000-row team table read into the backlog
* ``source_lock`` — call starts with and without a locked source table
* ``writeback_lag`` — how long after a solve its answer is in the team's row
* ``status_time`` — how long ``balancer status --json`` and ``--help`` take
* ``web`` — the console's page times on a large backlog
* ``sampler_memory`` — the console sampler's memory with many sources
"""
