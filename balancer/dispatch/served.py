"""Which models a dispatch run serves: work goes only where someone consumes it.

Each worker process keeps a short-lived record per model it consumes
(:mod:`balancer.calls.consumers`). With ``BALANCER_CONSUMERS_REQUIRED`` (the
default) a model with no live record is admitted nothing (admit.lua) and stocked
nothing (:func:`served_view`), and it is *orphaned*: its ready list goes back to
pending at once (take_ready.lua), and so do its queued tasks, whose messages wait
in a queue nobody reads, and the ready tasks a worker had taken
(:func:`return_orphans`); its calls in flight are hedged on served models before
new work. Other models, or hedges, take its work. When a worker comes back, its
model takes work at the next round.

A record that lapsed while Redis heard no worker at all (a failover, or every
worker away) says nothing about its worker: such a model is not orphaned until
the records can be believed again (:mod:`balancer.admission.liveness`). It takes
no new work meanwhile, and keeps what it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from balancer.admission.core import ModelLive
from balancer.backlog.leases import return_unconsumed
from balancer.services import Services

log = logging.getLogger(__name__)


def consumed_only(services: Services) -> bool:
    """Whether admissions need a live consumer (``BALANCER_CONSUMERS_REQUIRED``)."""
    return services.settings.consumers_required


def unserved(services: Services, view: dict[str, ModelLive]) -> set[str]:
    """The models of ``view`` no worker consumes now (none with ``BALANCER_CONSUMERS_REQUIRED`` off)."""
    return {name for name, m in view.items() if m.consumers == 0} if consumed_only(services) else set()


def orphaned(services: Services, view: dict[str, ModelLive]) -> set[str]:
    """The unserved models whose work is given up on: every one, unless their records lapsed
    while Redis heard no worker (then none, until the records can be believed again)."""
    unconsumed = unserved(services, view)
    return unconsumed if unconsumed and services.core.consumer_records_trusted() else set()


def served_view(services: Services, view: dict[str, ModelLive]) -> dict[str, ModelLive]:
    """The models a worker consumes now: the only ones a round claims, places or stocks for."""
    unconsumed = unserved(services, view)
    return {name: m for name, m in view.items() if name not in unconsumed}


def return_orphans(services: Services, orphans: Collection[str]) -> int:
    """The queued and ready tasks of the ``orphans`` (:func:`orphaned`) back to pending now, their
    leases withdrawn: their messages wait in queues nobody reads, and would hold them until their
    deadline. Returns how many."""
    models = sorted(orphans)
    returned = return_unconsumed(services.engine, models)
    if returned:
        services.core.withdraw([admission_id for _, admission_id in returned])
        log.warning("returned %d queued or ready task(s) to pending: no worker consumes %s", len(returned),
                    ", ".join(f"model.{name}" for name in models))
    return len(returned)
