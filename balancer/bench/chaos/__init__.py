"""The chaos run (``python -m balancer.bench.chaos.run``): a seeded schedule of overlapping
faults on a running pipeline, judged by an independent witness.

* ``run`` — the run: the pipeline, the router callers and the schedule, then the verdict
* ``plan`` — the seeded fault schedule, printed and replayable (pure)
* ``faults`` — starts and ends each fault of the schedule
* ``witness`` — the independent checker: pure maths over the backend's call log and PostgreSQL's writes
* ``report`` — its Markdown report
"""
