"""Budgets per day, enforced by the dispatcher: a source whose budget is spent takes no new calls.

Once per dispatch run, in its first transaction, :func:`held_sources` reads the
budgets (a small table; with none set that is the only read) and what the budgeted sources spent since
00:00 UTC (:func:`balancer.backlog.spend.charges`: each call at the prices of its
start, so a price changed or a quota removed later does not give back what was
spent), and :func:`balancer.costs.budget.held` names the sources over budget.
The run's claims leave those sources' pending tasks where they are: the
pinned lane, the window, the ready lists' stock (:mod:`balancer.backlog.claims`,
:mod:`balancer.dispatch.fairness`) and hedges skip them, and a model whose
only pinned work is held is not kept from flexible work. So a budget change,
or the day turning, applies at the next dispatch run, and nothing is lost:
the tasks stay pending until then.

Quotas are untouched. Calls already in flight when a budget is reached finish,
and so do tasks already on a ready list (at most a few per slot, for at most
``BALANCER_READY_TTL`` seconds), so a budget can be overshot by those calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from balancer.admission.quota import Quota
from balancer.backlog.spend import charges
from balancer.costs.budget import Standing, day_start, held, standings
from balancer.costs.cost import price_list
from balancer.quotas.rows import all_quotas
from balancer.snapshot import ReadServices
from balancer.sources.reads import budgets
from balancer.storage.rows import RowSource, reading


def read_standings(services: ReadServices, conn: RowSource | None = None, now: datetime | None = None,
                   quotas: Sequence[Quota] | None = None) -> dict[str, Standing]:
    """Every budgeted source's budget against what it spent today (empty: no budget set),
    read on ``conn`` (in the caller's transaction) or on ``services.db`` (an engine, or
    ``status``'s snapshot); in the currency of ``quotas`` when the caller has read them."""
    with reading(services.db if conn is None else conn) as db:
        set_now = budgets(db)
        if not set_now:
            return {}
        today = charges(db, day_start(now or datetime.now(UTC)))
        currency = price_list(all_quotas(db) if quotas is None else quotas)[1]
    return standings(set_now, today, currency)


def held_sources(services: ReadServices, conn: RowSource | None = None) -> frozenset[str]:
    """The sources whose budget is spent: their tasks wait this dispatch run."""
    return held(read_standings(services, conn))
