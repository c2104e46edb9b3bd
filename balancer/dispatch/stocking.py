"""Stocking the ready lists: how many tasks each busy model keeps ready
(:mod:`balancer.dispatch.ready`), which claimed tasks go where, and marking them
``ready`` once the dispatcher's transaction has them."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from balancer.admission.core import ModelLive, slots_of
from balancer.backlog.claims import PendingTask, pending_at_least
from balancer.backlog.ready import mark_ready, ready_admission_id, unstock
from balancer.dispatch import fairness
from balancer.dispatch import ready as ready_lists
from balancer.dispatch.placement import outlooks, planned_latency_field
from balancer.services import Services
from balancer.settings import Settings


def stock_targets(view: dict[str, ModelLive], settings: Settings, per_slot: float | None = None) -> dict[str, int]:
    """For each model whose slots bind it, how many tasks its ready list lacks
    (at ``per_slot`` entries per slot, default ``settings.ready_per_slot``).

    Only models that concurrency binds: enabled, not paused, a token bucket at
    least half full and requests in hand. A model that tokens or requests
    bind runs its bucket low; a freed slot there waits for tokens, not for a
    dispatch round, and a list would only bind its tasks early."""
    targets = {}
    for name, m in view.items():
        q = m.quota
        if not q.enabled or m.paused_ms > 0:
            continue
        if m.tokens_available < q.burst / 2 or (m.requests_available is not None and m.requests_available < 1):
            continue
        mean_ms = m.latency_estimate(settings.expected_latency_s).mean_ms if m.latency_known else None
        depth = ready_lists.depth(q.max_concurrent_requests, mean_ms,
                                  settings.ready_per_slot if per_slot is None else per_slot, settings.ready_ttl)
        room = depth - m.ready
        if room > 0:
            targets[name] = room
    return targets


def stock_ready(services: Services, view: dict[str, ModelLive], held: Collection[str] = ()) -> int:
    """Fill the ready lists of the models their concurrency caps bind (see the
    module docstring and :mod:`balancer.dispatch.ready`). Returns how many were stocked.

    Each model takes its pinned tasks first; flexible tasks go to a model only
    if it has no more pinned ones, in the window's order, to the model with the
    most room. Nothing is stocked unless the backlog outlasts the slowest
    model's call even without the stocked tasks: the end game decides the rest.
    The tasks of ``held`` sources (over their budget) are not stocked.
    """
    settings = services.settings
    per_slot = fairness.ready_per_slot(services)  # shallow while sources share (balancer.sources.fairshare)
    targets = stock_targets(view, settings, per_slot)
    if not targets:
        return 0
    wanted = sum(targets.values())
    with services.engine.begin() as conn:
        who = fairness.pending(services, conn, held)
        fair = fairness.claim_flexible(services, conn, wanted, targets, held, who)
        if fair.shares is not None and (shallow := fairness.ready_per_slot(services, shared_now=True)) < per_slot:
            targets = stock_targets(view, settings, shallow)  # sources met in this very claim
        pinned, _ = fairness.pinned_lane(conn, targets, slots_of(view), fair.tasks, held, who, reserving=False)
        placed = place_ready(pinned, fair.tasks, targets)
        if not placed:
            return 0
        mean_tokens = sum(t.estimated_tokens for t, _ in placed) / len(placed)
        enough = ready_lists.backlog_to_stock(mean_tokens, outlooks(view, settings.expected_latency_s),
                                              planned_latency_field(settings))
        if not pending_at_least(conn, enough + len(placed)):
            return 0
        entries = [(model, task.id, task.estimated_tokens, ready_admission_id()) for task, model in placed]
        # The database deadline outlives the Redis entry, so a task taken at the
        # last moment is still ``ready`` when its worker starts it.
        mark_ready(conn, [(task_id, model, lid) for model, task_id, _, lid in entries],
                    math.ceil(settings.ready_ttl) + settings.lease_seconds)
    # Committed: only now may a finishing call take them (it starts the task under
    # that id). A dispatcher that dies here leaves them ``ready`` on no list: the
    # next dispatcher's look for lost entries returns them (balancer.dispatch.lost).
    stocked = services.core.stock(entries, round(settings.ready_ttl * 1000))
    lost = [(task_id, lid) for (_, task_id, _, lid), done in zip(entries, stocked, strict=True) if not done]
    fairness.settle(services, fair, {task_id for (_, task_id, _, _), done in zip(entries, stocked, strict=True) if done})
    if lost:  # the model was removed meanwhile
        with services.engine.begin() as conn:
            unstock(conn, lost)
    return len(entries) - len(lost)


def place_ready(pinned: Sequence[PendingTask], flexible: Sequence[PendingTask],
                targets: dict[str, int]) -> list[tuple[PendingTask, str]]:
    """Which claimed task goes on which model's ready list.

    >>> pinned = [PendingTask(1, 10, ("a",))]
    >>> flexible = [PendingTask(2, 10, None), PendingTask(3, 10, ("b",)), PendingTask(4, 10, None)]
    >>> [(t.id, m) for t, m in place_ready(pinned, flexible, {"a": 2, "b": 2})]
    [(1, 'a'), (2, 'b'), (3, 'b'), (4, 'a')]

    Pinned tasks fill their model's room first. Only a model whose pinned lane
    came back short (no more pinned tasks pending for it) has room left for
    flexible ones: "a" asked for 2 and got 1 pinned, so task 4 may use it.
    """
    room = dict(targets)
    placed: list[tuple[PendingTask, str]] = []
    seen: set[int] = set()
    for task in pinned:
        model = task.allowed_models[0] if task.allowed_models else None
        if model in room and room[model] > 0:
            placed.append((task, model))
            room[model] -= 1
            seen.add(task.id)
    for task in flexible:
        if task.id in seen:
            continue
        options = [m for m, n in room.items() if n > 0 and (task.allowed_models is None or m in task.allowed_models)
                   and m != task.avoid_model]
        if not options:
            continue
        model = max(options, key=lambda m: room[m])
        placed.append((task, model))
        room[model] -= 1
        seen.add(task.id)
    return placed
