"""Views: what ``status``, ``top``, the console and the metrics exporter show, each part read once.

* ``overview`` — the whole backlog, spend, sources and budgets, read once per look
* ``summary`` — the per-model summary ``balancer status`` and ``balancer top`` show
* ``eta`` — the drain ETA: how long until the current backlog is solved (pure)
* ``metrics`` — ``balancer metrics``, the Prometheus exporter
"""
