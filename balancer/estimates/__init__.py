"""Estimates, pure: what a task will take, how long a model answers, and what any scheduler could reach.

* ``tokens`` — token estimates: what admission charges before the call
* ``latency`` — per-model latency, learned online: the sketch's buckets and quantiles
* ``capacity`` — the capacity bound (the smallest makespan), and a model's own tokens per task
* ``stats`` — small statistics shared by the router's advice and the bench reports
"""
