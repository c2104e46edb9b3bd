"""``balancer status``: the backlog, each model, spend, sources and budgets, read once.

It reads through a :class:`~balancer.snapshot.Snapshot`: Redis, and every PostgreSQL read in
one read-only transaction on one psycopg2 connection, without SQLAlchemy, whose import it
would pay on every run (its cost: docs/benchmark-history.md). The reads are the ones ``top``, the console
and the metrics exporter run on their engine (:func:`read_status` takes either).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from balancer.cli import print_table
from balancer.cli.pipeline import drain_text, health_lines, model_table
from balancer.cli.startwait import snapshot
from balancer.errors import printable

if TYPE_CHECKING:
    from balancer.costs.budget import Standing
    from balancer.costs.cost import Spend
    from balancer.health.reasons import Health
    from balancer.snapshot import ReadServices
    from balancer.sources.reads import SourceStatus
    from balancer.views.eta import Forecast
    from balancer.views.summary import ModelSummary


@dataclass(frozen=True)
class StatusReads:
    """Everything ``status`` shows, read now."""

    counts: dict[str, int]
    rows: list[ModelSummary]
    drain: Forecast | None
    reused: int
    overdue: int
    beat: float | None  # seconds since beat's last dispatch tick; None: not seen lately
    spent: Spend
    projected: Spend
    sources: list[SourceStatus]
    budgets: dict[str, Standing]
    health: Health
    not_read: list[str]  # sources not read to their table's end (views.overview.Overview.not_read)


def read_status(services: ReadServices) -> StatusReads:
    """What ``status`` shows, read through ``services`` (a :class:`~balancer.snapshot.Snapshot`,
    or :class:`~balancer.services.Services`' engine)."""
    from balancer.backlog.reads import overdue_count, reused_count
    from balancer.dispatch.beat_seen import beat_last_seen_s
    from balancer.sources.reads import source_status
    from balancer.views.overview import read_overview

    db, o = services.db, read_overview(services)
    return StatusReads(o.counts, o.rows, o.drain, reused_count(db), overdue_count(db),
                       beat_last_seen_s(services.redis, services.settings.namespace),
                       o.spent, o.projected, source_status(db), o.budgets, o.health, o.not_read)


def band_fields(drain: Any) -> dict[str, float | None]:
    """The ETA's band for ``status --json``: ``eta_low_s`` and ``eta_high_s`` (None when there is no ETA)."""
    low = None if drain is None or drain.low is None else round(drain.low, 1)
    high = None if drain is None or drain.high is None else round(drain.high, 1)
    return {"eta_low_s": low, "eta_high_s": high}


def status_json(s: StatusReads) -> dict[str, Any]:
    """``status --json``'s object."""
    from balancer.views.summary import calls_after_the_end

    eta = None if s.drain is None else s.drain.eta
    projected = s.projected.as_dict()
    projected.pop("by_source", None)  # the backlog left's projected cost: as ``spend``, without ``by_source``
    blocked = s.health.blocked
    return {**s.counts, "reused": s.reused, "overdue": s.overdue,
            "calls_after_the_end": calls_after_the_end(s.counts, s.rows),
            "eta_s": None if eta is None or blocked else round(eta, 1), "blocked": blocked,
            "health": s.health.as_dict(),
            **band_fields(s.drain), "waiting_on_budget": 0 if s.drain is None else s.drain.waiting,
            "waiting_on_no_model": 0 if s.drain is None else s.drain.unplaced,
            "beat_last_tick_s": None if s.beat is None else round(s.beat, 1),
            "models": [r.as_dict() for r in s.rows], "spend": s.spent.as_dict(),
            "projected": projected, "sources": [r.as_dict() for r in s.sources],
            "budgets": [b.as_dict() for b in s.budgets.values()]}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(as_json: bool) -> None:
    """Task counts by status, and per model: calls in flight against the cap,
    buckets, 429s, latency, and the limit that holds it back now."""
    with snapshot() as snap:
        s = read_status(snap)
    if as_json:
        click.echo(json.dumps(status_json(s)))
        return
    from balancer.cli.source import budget_line, source_line
    from balancer.costs.cost import projection_text, spend_text
    from balancer.views.summary import calls_after_the_end

    eta = drain_text(s.drain, s.health.blocked, s.health.unread_sources, s.not_read, calls_after_the_end(s.counts, s.rows),
                     s.health.writeback_failing_sources)
    click.echo("  ".join(f"{k}: {v}" for k, v in s.counts.items()) + (f"  reused: {s.reused}" if s.reused else "")
               + f"  eta: {eta}")
    for line in health_lines(s.health):
        click.echo(line)
    if s.spent.by_model or s.spent.unpriced_tokens:
        click.echo(spend_text(s.spent))
    if s.projected.by_model or s.projected.unpriced_tokens:
        click.echo(projection_text(s.projected))
    for r in s.sources:
        click.echo(f"source {r.name}: {source_line(r)}")
    for b in s.budgets.values():
        click.echo(printable(f"budget {b.budget.source}: {budget_line(b)}", limit=400))
    if s.beat is None:
        # Said of any dispatcher: status cannot tell whether one runs (a new user read "the dispatcher
        # runs the ticks itself" with none started).
        click.echo("beat: not seen lately; a running dispatcher runs the periodic ticks itself "
                   "(start `balancer beat`, or `balancer run` for the dispatcher, workers and beat)")
    if s.overdue:
        click.echo(f"overdue: {s.overdue} call(s) whose lease ran out with no heartbeat (a worker is gone); "
                   "the sweep tick returns them to pending")
    if s.rows:
        print_table(model_table(s.rows), 120)
