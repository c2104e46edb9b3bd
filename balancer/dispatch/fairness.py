"""The dispatcher's flexible window, filled fairly across sources.

:func:`claim_flexible` claims each source's head (:func:`balancer.backlog.claims.claim_by_source`)
and orders the window by weighted deficit round robin
(:mod:`balancer.sources.fairshare`), with the weights of ``balancer source
set`` and the round robin's state from Redis (:mod:`balancer.dispatch.shares`).
:func:`settle` then gives back what the admission did not take and stores the
state. While several sources share, the pinned tasks an open model may take
are in their sources' queues like any other, and each source's head is
claimed by its share of the window (:func:`balancer.sources.fairshare.claim_sizes`).
Pinned tasks still have first claim on their model (:func:`pinned_lane`), but a
flexible task of the window that every model it may run on would keep out does not
wait: one of those models gives way to the round robin (:func:`given_way`; issue 38
finding 12).
A source with a weight set (a source table, or ``balancer source set NAME
--weight``) has a share of its own; the names no one set a weight for share one
share between them, taking turns by name, so a backfill spread over thousands
of source names weighs as one source (:func:`balancer.sources.fairshare.flow_of`).
With one source pending there is nothing to share: the window is
claimed as with fairness off (:func:`balancer.backlog.claims.claim_window`,
which never reads tasks no open model may take), and no state is read or
written. ``BALANCER_SOURCE_FAIRNESS=off``
claims the window by priority, then age, across all sources (the old rule).
A source over its budget (``held``) has none of its tasks claimed: while one
has pending work, the others' heads are claimed by source, fairness on or off.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from balancer.backlog.claims import (
    PendingTask,
    claim_by_source,
    claim_pinned,
    claim_window,
    models_with_pinned_backlog,
    pending_sources,
)
from balancer.dispatch import shares as shared_state
from balancer.services import Services
from balancer.sources import fairshare
from balancer.sources.weights import DEFAULT_WEIGHT, weights


@dataclass(frozen=True)
class Window:
    """The flexible tasks a round claimed, in admission order, and the share
    state after charging all of them (``None``: no sharing took place)."""

    tasks: list[PendingTask]
    shares: fairshare.Shares | None = None
    declared: frozenset[str] = frozenset()  # the sources with a share of their own (a weight set)


@dataclass(frozen=True)
class Pending:
    """The sources with pending work this round, and those of them not over their budget."""

    sources: list[str]
    kept: list[str]
    fair: bool

    @property
    def shared(self) -> bool:
        """Whether several sources share the window: then every task, pinned to one model or
        not, takes its source's turn, and the pinned lane gives way to it (:func:`pinned_lane`)."""
        return self.fair and len(self.kept) > 1


def pending(services: Services, conn: Connection, held: Collection[str] = ()) -> Pending:
    """Which sources have pending work (read only when fairness or a budget needs it)."""
    fair = services.settings.source_fairness
    sources = pending_sources(conn) if fair or held else []
    return Pending(sources, [source for source in sources if source not in held], fair)


def claim_flexible(services: Services, conn: Connection, limit: int, open_models: Iterable[str],
                   held: Collection[str] = (), who: Pending | None = None) -> Window:
    """Lock and order up to ``limit`` tasks for this round, none of a ``held`` source (over
    its budget: :mod:`balancer.dispatch.budgets`): the flexible ones, and while sources share
    (``who.shared``) the pinned ones an open model may take too, each in its source's turn."""
    who = who or pending(services, conn, held)
    if len(who.kept) == len(who.sources) and not who.shared:
        return Window(claim_window(conn, limit, open_models))
    if not who.shared:  # a held source has pending work: each other source's head, over its own index
        queues = claim_by_source(conn, who.kept, limit, open_models)
        return Window(sorted((task for queue in queues.values() for task in queue),
                             key=lambda t: (-t.priority, t.id))[:limit])
    declared = weights(conn)  # a source with a weight set has a share of its own; the others share one
    # Each source's part of the window twice over: thousands of sources cost a task or two each.
    parts = fairshare.claim_weights(who.kept, declared, declared.keys(), DEFAULT_WEIGHT)
    queues = claim_by_source(conn, who.kept, fairshare.claim_sizes(parts, limit), open_models)
    if len(queues) <= 1:
        return Window([task for queue in queues.values() for task in queue][:limit])
    state = shared_state.load(services.redis, services.settings.namespace)
    order, after = fairshare.fill(queues, limit, declared, state, default_weight=DEFAULT_WEIGHT,
                                  declared=declared.keys())
    return Window(order, after, frozenset(declared))


def pinned_lane(conn: Connection, room: Mapping[str, int], slots: Mapping[str, int], window: Sequence[PendingTask],
                held: Collection[str], who: Pending, *, reserving: bool = True) -> tuple[list[PendingTask], set[str]]:
    """The pinned lane: for each model with ``room``, up to that many pending tasks pinned to
    it alone (priority, then age), none of a ``held`` source; and the models (those of
    ``slots``) that still have pinned tasks pending after it (tasks another dispatcher holds
    count), which take no flexible work. Pinned tasks have nowhere else to go, so they have
    first claim on their model: a slow model's own tasks never queue behind flexible work it
    took on, which sets a run's end (``bench/scenarios/default.toml``: its 3-slot model's
    pinned work is the floor).

    While sources share the ``window`` (issue 38 finding 12: a backfill pinned to the only
    model took every slot from a live source), the round robin keeps the last word:

    * a model the window holds pinned tasks for gets no lane: they come in their sources'
      turns, so two sources pinned to one model take turns on it;
    * a flexible task of the window that every model it may run on would keep out does not
      wait for their pinned backlogs: one of them with room gives way (:func:`given_way`).

    With ``reserving`` off (the ready lists, placed by room) the reserved models are read only
    while sources share, to give way by them, and an empty set is returned otherwise.
    """
    lane = dict(room)
    if who.shared:
        served_in_turn = {t.allowed_models[0] for t in window if t.allowed_models and len(t.allowed_models) == 1}
        lane = {m: n for m, n in room.items() if m not in served_in_turn}
    pinned = claim_pinned(conn, lane, held)
    if not reserving and not who.shared:
        return pinned, set()
    reserved = models_with_pinned_backlog(conn, slots, exclude=[t.id for t in pinned], held=held)
    if who.shared:
        yielding = given_way(reserved, window, slots, [m for m, n in room.items() if n > 0])
        pinned = [t for t in pinned if not set(t.allowed_models or ()) & yielding]
        reserved -= yielding
    return pinned, reserved


def given_way(reserved: Collection[str], window: Sequence[PendingTask], slots: Mapping[str, int],
              room: Collection[str]) -> set[str]:
    """The ``reserved`` models that give way to the ``window``'s flexible tasks: for each task
    every model it may run on (any of ``slots``' when it names none) is reserved for, the one
    of them with ``room`` now that has the most slots, where its own pinned work waits least
    behind a flexible call (none, when none of them has room: giving way would run nothing).

    >>> window = [PendingTask(1, 10, None), PendingTask(2, 10, ("x",)), PendingTask(3, 10, ("x", "y"))]
    >>> slots = {"x": 3, "y": 24}
    >>> sorted(given_way({"x"}, window, slots, slots)), sorted(given_way({"x", "y"}, window, slots, slots))
    ([], ['y'])
    >>> sorted(given_way({"x", "y"}, window, slots, ["x"]))   # y is full, or disabled
    ['x']
    >>> sorted(given_way({"x"}, [PendingTask(4, 10, None)], {"x": 3}, []))   # the only model, full
    []
    """
    kept = set(reserved)
    out: set[str] = set()
    for task in window:
        allowed = task.allowed_models
        if allowed is not None and len(allowed) == 1:
            continue  # a pinned task: its own turn in the window
        options = [m for m in (allowed or slots) if m in slots]
        open_now = [m for m in options if m in room]
        if options and open_now and all(m in kept for m in options):
            widest = max(open_now, key=lambda m: (slots[m], m))
            kept.discard(widest)
            out.add(widest)
    return out


def settle(services: Services, window: Window, served: Collection[int]) -> None:
    """Refund the window's tasks not in ``served`` (task ids) and store the state."""
    if window.shares is None:
        return
    unserved: Sequence[tuple[str, int]] = [(fairshare.flow_of(t.source, window.declared), t.estimated_tokens)
                                           for t in window.tasks if t.id not in served]
    shared_state.save(services.redis, services.settings.namespace, fairshare.refund(window.shares, unserved),
                      fairshare.SHARED_FOR_MS)


def ready_per_slot(services: Services, *, shared_now: bool = False) -> float:
    """Ready-list entries per slot: shallow while sources share the window (in
    this claim, ``shared_now``, or within :data:`balancer.sources.fairshare.SHARED_FOR_MS`)."""
    settings = services.settings
    if not settings.source_fairness or settings.ready_per_slot <= fairshare.SHARED_READY_PER_SLOT:
        return settings.ready_per_slot
    shared = shared_now or shared_state.recently_shared(services.redis, settings.namespace)
    return fairshare.ready_per_slot(settings.ready_per_slot, shared)
