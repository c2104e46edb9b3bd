"""The sources' Prometheus metrics (source tables, and budgets per day), added to ``balancer metrics``' families at every scrape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from sqlalchemy.engine import Engine

from balancer.backlog.reads import reused_count
from balancer.costs.budget import Standing
from balancer.sources.reads import source_status


def source_families() -> dict[str, Any]:
    source = ["source"]
    return {
        "balancer_source_tasks": GaugeMetricFamily(
            "balancer_source_tasks", "A source table's tasks by state (pending, in_flight, solved, failed, cancelled)",
            labels=["source", "state"]),
        "balancer_source_writebacks_waiting": GaugeMetricFamily(
            "balancer_source_writebacks_waiting", "Ended tasks not yet written back to their rows", labels=source),
        "balancer_source_writebacks_failing": GaugeMetricFamily(
            "balancer_source_writebacks_failing", "Of the write-backs waiting, those that failed at least once "
            "(the table refused them, or could not be written), retried after a back-off", labels=source),
        "balancer_source_not_overwritten": GaugeMetricFamily(
            "balancer_source_not_overwritten", "Write-backs refused: the row no longer matched where "
            "(someone else changed it)", labels=source),
        "balancer_source_changed": GaugeMetricFamily(
            "balancer_source_changed", "Write-backs not done: the row's prompt changed since it was read "
            "(its task asked again with the new prompt)", labels=source),
        "balancer_source_unwritable": GaugeMetricFamily(
            "balancer_source_unwritable", "Write-backs the source's table refused BALANCER_WRITEBACK_ATTEMPTS times, "
            "left unwritable (balancer source unwritable NAME)", labels=source),
        "balancer_source_rows_not_tasks": GaugeMetricFamily(
            "balancer_source_rows_not_tasks", "A source table's rows of work that are not tasks, by reason (a NULL key, "
            "an empty or undecodable prompt, no model configured ...)", labels=["source", "reason"]),
        "balancer_source_cursor_lag_seconds": GaugeMetricFamily(
            "balancer_source_cursor_lag_seconds", "Seconds since the source was last read to its end", labels=source),
        "balancer_source_over_budget": GaugeMetricFamily(
            "balancer_source_over_budget", "1 while a source's budget per day is spent (its tasks wait), else 0; "
            "sources with a budget only", labels=source),
        "balancer_source_spent_tokens_today": GaugeMetricFamily(
            "balancer_source_spent_tokens_today", "A budgeted source's prompt + completion tokens since 00:00 UTC",
            labels=source),
        "balancer_tasks_reused": GaugeMetricFamily(
            "balancer_tasks_reused", "Tasks that took an identical task's answer instead of a call (dedup)"),
    }


def add_source_metrics(families: dict[str, Any], engine: Engine, budgets: Mapping[str, Standing]) -> None:
    for name, b in budgets.items():
        families["balancer_source_over_budget"].add_metric([name], 1 if b.over else 0)
        families["balancer_source_spent_tokens_today"].add_metric([name], b.tokens)
    families["balancer_tasks_reused"].add_metric([], reused_count(engine))
    for s in source_status(engine):
        for state in ("pending", "in_flight", "solved", "failed", "cancelled"):
            families["balancer_source_tasks"].add_metric([s.name, state], getattr(s, state))
        families["balancer_source_writebacks_waiting"].add_metric([s.name], s.writebacks_waiting)
        families["balancer_source_writebacks_failing"].add_metric([s.name], s.writebacks_failing)
        families["balancer_source_not_overwritten"].add_metric([s.name], s.conflicts)
        families["balancer_source_changed"].add_metric([s.name], s.changed)
        families["balancer_source_unwritable"].add_metric([s.name], s.unwritable)
        for reason, n in s.not_tasks.items():
            families["balancer_source_rows_not_tasks"].add_metric([s.name, reason], n)
        if s.lag_s is not None:
            families["balancer_source_cursor_lag_seconds"].add_metric([s.name], s.lag_s)
