"""The end game's glue in the dispatcher: each open model's outlook from the live
view, and finish-time-aware placement of a round's batch (the rules are
:mod:`balancer.dispatch.endgame`'s)."""

from __future__ import annotations

import dataclasses
import math

from sqlalchemy.engine import Connection

from balancer.admission.core import ModelLive, open_slots
from balancer.admission.values import Candidate
from balancer.backlog.claims import (
    PendingTask,
    pending_backlog,
)
from balancer.dispatch import endgame
from balancer.settings import Settings

#: The end game plans at most this many tasks beyond the claimed window (as
#: stand-ins of average size): enough to see where the backlog will go.
MAX_UNCLAIMED_PLANNED = 5_000


def outlooks(view: dict[str, ModelLive], prior_s: float) -> list[endgame.ModelOutlook]:
    """Each enabled model's outlook for the end-game plan, from the live view: at its effective
    limits (a model that learned 60 RPM of a quota's 600 refills its bucket at 60, so a bucket
    short by 36 requests waits 36 s, not 3.6 s) and its cap now (slow start's while it ramps)."""
    free = open_slots(view)
    out = []
    for name, m in view.items():
        if not m.quota.enabled:
            continue
        limits = m.limits  # the effective ones, learned or not: the buckets' own rates and units
        rpm = limits.max_requests_per_minute
        out.append(endgame.ModelOutlook(
            name,
            cap=m.cap_now,
            free_slots=free.get(name, 0),
            in_flight=m.in_flight,
            latency=m.latency_estimate(prior_s),
            tokens_available=m.tokens_available,
            tokens_per_ms=(limits.max_tokens_per_minute - m.external_tpm) / 60_000,
            requests_available=math.inf if m.requests_available is None else m.requests_available,
            requests_per_ms=rpm / 60_000 if rpm else math.inf,
            paused_ms=m.paused_ms,
            latency_known=m.latency_known,
        ))
    return out


def planned_latency_field(settings: Settings) -> str:
    """Plan a call's length at the mean latency when hedges can overtake stragglers, else at p90."""
    return endgame.HEDGED if settings.hedging else endgame.CAUTIOUS


def finish_time_aware(
    conn: Connection, batch: list[tuple[PendingTask, Candidate]], view: dict[str, ModelLive], *,
    window_full: bool, prior_s: float, latency_field: str = endgame.CAUTIOUS,
) -> list[tuple[PendingTask, Candidate]]:
    """The batch as the end game would bind it (see :mod:`balancer.dispatch.endgame`).

    In the bulk of the run it is returned unchanged. In the end game each task
    is bound to the model that would finish it soonest, or left pending if
    that model has no free slot now. A full window means more is pending than
    was claimed: the backlog's size and mean estimate then come from one count
    query, and the unclaimed rest is planned as stand-ins of average size.
    """
    models = outlooks(view, prior_s)
    pending = len(batch)
    mean_tokens = sum(c.estimated_tokens for _, c in batch) / len(batch)
    if not endgame.in_end_game(pending, mean_tokens, models, latency_field):
        return batch  # a larger backlog drains later still: the bulk of the run, no count needed
    if window_full:
        pending, mean_tokens = pending_backlog(conn)
        if not endgame.in_end_game(pending, mean_tokens, models, latency_field):
            return batch
    jobs = [endgame.Job(t.id, c.estimated_tokens, c.allowed, c.avoid) for t, c in batch]
    unclaimed = min(MAX_UNCLAIMED_PLANNED, max(0, pending - len(jobs)))
    placed = endgame.plan(jobs, models, [endgame.Job(-1 - i, round(mean_tokens)) for i in range(unclaimed)], latency_field)
    return [
        (task, dataclasses.replace(candidate, allowed=(model,)))
        for (task, candidate), model in zip(batch, placed, strict=True)
        if model is not None
    ]
