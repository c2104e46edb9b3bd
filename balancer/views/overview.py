"""What ``status``, ``top`` and the console show of the whole backlog, read once per look.

The task counts, each model's row and raw counters, the drain ETA and its band, the
budgets' standings, the spend so far, the backlog left's projected cost, and each model's and
source's health (why nothing moves: :mod:`balancer.health.reasons`). The quotas,
the budgets and the backlog are each read once and handed to every part that needs them.
Each caller adds what only it shows (``status``: overdue calls and beat; ``top``: the
sources' weights; the console: the failed tasks by error)."""

from __future__ import annotations

from dataclasses import dataclass, field

from balancer.backlog.reads import backlog
from balancer.backlog.spend import projected_cost, spend_so_far
from balancer.costs.budget import Standing, held
from balancer.costs.cost import Spend
from balancer.dispatch.budgets import read_standings
from balancer.health.facts import read_health
from balancer.health.reasons import Health
from balancer.quotas.rows import all_quotas
from balancer.snapshot import ReadServices
from balancer.sources.reads import not_read_to_end, writebacks_by_source
from balancer.views.eta import Forecast
from balancer.views.summary import ModelSummary, read


@dataclass(frozen=True)
class Overview:
    counts: dict[str, int]  # tasks by status
    rows: list[ModelSummary]
    counters: dict[str, dict[str, int]]  # each model's raw counters (``top`` and the console take rates from them)
    drain: Forecast | None
    budgets: dict[str, Standing]
    spent: Spend
    projected: Spend  # the backlog left's projected cost
    health: Health
    #: sources not read to their table's end, not in the ETA (an unreadable one is health's, said once there)
    not_read: list[str] = field(default_factory=list)


def read_overview(services: ReadServices) -> Overview:
    """The overview now, through ``services`` (a :class:`~balancer.snapshot.Snapshot`, or
    :class:`~balancer.services.Services`' engine)."""
    db = services.db
    quotas = all_quotas(db)
    budgets, left = read_standings(services, quotas=quotas), backlog(db)
    view = services.core.live()
    counters, _ = services.core.counters()
    health = read_health(services.redis, services.settings.namespace, view, counters, budgets, left.unfinished,
                         consumers=services.settings.consumers_required, writebacks=writebacks_by_source(db))
    # A model stopped until something changes (no worker, backend down) is no capacity: the ETA leaves it out.
    counts, rows, counters, drain = read(services, held(budgets), left, view, counters, health.stopped_models)
    return Overview(counts, rows, counters, drain, budgets, spend_so_far(db, quotas), projected_cost(db, quotas, left),
                    health, [name for name in not_read_to_end(db) if name not in health.unread_sources])
