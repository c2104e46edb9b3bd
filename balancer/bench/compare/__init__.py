"""``balancer bench SCENARIO``: the pipeline against today's Airflow pattern and the capacity bound.

* ``run`` — the command: scenario in, report out
* ``sides`` — the pipeline and the baseline, each run against a fresh simulator
* ``baseline`` — today's Airflow pattern, as its users run it
* ``bounds`` — the providers' real limits, the capacity bound and the pinned-work floor
* ``side_stats`` — one side's figures
* ``report`` — the report's maths: percentiles, refill gaps, usage series (pure)
* ``report_md`` — report.md, from report.json's figures
* ``plots`` — the PNG plots
* ``sources`` — the scenarios of kind sources: a backfill and a live trickle, fair share on and off
* ``overhead`` — the scenarios of kind overhead: tasks/s at zero latency against a bare Celery no-op
* ``backlog`` — the scenarios of kind backlog: dispatch with 10,000 and 1,000,000 pending
* ``noop_app`` — a bare Celery app with a no-op task: the overhead scenario's ceiling
* ``hedging`` — ``--compare-hedging``: what hedging costs in tokens and money
* ``eta_replay`` — a run's recorded ETA polls replayed with the current estimator or a variant
* ``dashboard`` — the Grafana dashboard for ``balancer metrics``, and its picture from a real run
"""
