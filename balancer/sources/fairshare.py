"""A fair share across sources: weighted deficit round robin over the dispatch window.

Each round the dispatcher claims, for every source with pending work, the
head of that source's backlog (priority, then age) and :func:`fill` orders the
window from those queues:

- **Priority first.** Only the sources whose head has the highest priority
  compete; a source's lower-priority tasks wait until its higher ones are in.
- **Within a priority, weighted deficit round robin** (Shreedhar and Varghese).
  Each source has a deficit in estimated tokens. The sources take turns, one
  task per turn, and a source may take its head when its deficit covers the
  head's estimate; the estimate is then charged. When no competing source can
  pay, every competing source gains the fewest whole quanta (``weight ×
  quantum`` tokens) that let one of them pay: one step, as the admission
  core's WDRR across models does (docs/admission.md). So over time each
  source's tokens follow its weight, and a one-million-row backfill takes
  turns with a live source instead of standing ahead of it.
- **Work-conserving.** A source alone takes the whole window, and a source
  with nothing pending gives its turn away and banks nothing: its deficit is
  dropped, as a DRR queue that empties resets.

The state carried from round to round is small: one deficit per source with
pending work and the source served last (the round robin resumes after it).
Tasks the admission then refuses were charged but not served: :func:`refund`
gives their estimates back.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

#: Tokens a source of weight 1 gains per quantum. Below a typical task, so the
#: turns follow the weights within a few tasks (3:1 gives 6 and 2 of 8 places,
#: where a quantum of several tasks would hand out whole runs); a grant is one
#: step whatever its size.
DEFAULT_QUANTUM = 100
#: The largest weight a source may have (``balancer source set --weight``).
MAX_WEIGHT = 1_000_000

#: Ready-list entries per slot while several sources share the models (see
#: :mod:`balancer.dispatch.ready`). A task stocked behind a list of ``d`` entries
#: per slot waits about ``d`` calls before its own; at the default 3 (or the 2.5
#: a 1 s model's TTL allows) a live source's task waited 2 to 3 calls behind
#: the backfill's, whatever its turn (bench/scenarios/sources.toml with a 20 s
#: trickle: insert to answer 2.35x its calls' p95 at p95). Half a slot keeps
#: that wait to half a call (1.83x over 60 s, docs/benchmarks.md).
SHARED_READY_PER_SLOT = 0.5
#: How long, after a round that filled the window from several sources, the
#: ready lists stay shallow: a trickling source has nothing pending most of the
#: time, between its arrivals.
SHARED_FOR_MS = 10_000


def ready_per_slot(configured: float, shared: bool) -> float:
    """Ready-list entries per slot: as configured, or at most :data:`SHARED_READY_PER_SLOT`
    while sources share.

    >>> ready_per_slot(3.0, False), ready_per_slot(3.0, True), ready_per_slot(0.2, True)
    (3.0, 0.5, 0.2)
    """
    return min(configured, SHARED_READY_PER_SLOT) if shared else configured


class Work(Protocol):
    """What the rule reads of a claimed task."""

    @property
    def priority(self) -> int: ...

    @property
    def estimated_tokens(self) -> int: ...


W = TypeVar("W", bound=Work)


@dataclass(frozen=True)
class Shares:
    """The round robin's state between rounds."""

    deficits: Mapping[str, int] = field(default_factory=dict)
    last: str | None = None  # the flow served last; the next turn goes to the one after it
    inner: str | None = None  # the undeclared source served last; the group's next turn goes to the one after it


#: The flow the sources no one declared a weight for share (a key of ``Shares.deficits``): never
#: a source's name, which may not hold a NUL character.
UNDECLARED = "\x00undeclared"


def flow_of(source: str, declared: Collection[str] | None) -> str:
    """The flow a source's tasks are charged to: its own when declared (or when no one declares
    anything: ``declared`` None), else :data:`UNDECLARED`.

    >>> flow_of("crm", {"crm"}), flow_of("crm", None), flow_of("b7", {"crm"}) == UNDECLARED
    ('crm', 'crm', True)
    """
    return source if declared is None or source in declared else UNDECLARED


def fill(queues: Mapping[str, Sequence[W]], limit: int, weights: Mapping[str, int], shares: Shares,
         *, default_weight: int = 1, quantum: int = DEFAULT_QUANTUM,
         declared: Collection[str] | None = None) -> tuple[list[W], Shares]:
    """Up to ``limit`` tasks from ``queues`` (each a source's head, priority then
    age), in the order the window admits them, and the state after charging them.

    >>> from collections import namedtuple
    >>> T = namedtuple("T", "name priority estimated_tokens")
    >>> a = [T(f"a{i}", 0, 400) for i in range(6)]          # a backfill
    >>> b = [T(f"b{i}", 0, 400) for i in range(4)]          # a live source
    >>> order, after = fill({"a": a, "b": b}, 5, {}, Shares())
    >>> [t.name for t in order], dict(after.deficits), after.last
    (['a0', 'b0', 'a1', 'b1', 'a2'], {'a': 0, 'b': 400}, 'a')

    Weights set the shares; priority comes first; a source alone takes everything:

    >>> [t.name for t in fill({"a": a, "b": b}, 9, {"a": 2}, Shares())[0]]
    ['a0', 'b0', 'a1', 'a2', 'b1', 'a3', 'a4', 'b2', 'a5']
    >>> urgent = [T("u0", 5, 400)]
    >>> [t.name for t in fill({"a": a, "u": urgent}, 3, {}, Shares())[0]]
    ['u0', 'a0', 'a1']
    >>> len(fill({"a": a}, 4, {}, Shares())[0])
    4

    With ``declared``, the sources not in it share one flow of ``default_weight``, taking turns
    within it by name: a backfill over many names weighs as one source beside a declared one.

    >>> names = {f"n{i:02}": [T(f"n{i:02}", 0, 400)] for i in range(50)}
    >>> [t.name for t in fill({"live": b, **names}, 6, {"live": 1}, Shares(), declared={"live"})[0]]
    ['n00', 'b0', 'n01', 'b1', 'n02', 'b2']
    """
    heads = {source: 0 for source, queue in queues.items() if queue}
    members: dict[str, list[str]] = {}
    for source in sorted(heads):
        members.setdefault(flow_of(source, declared), []).append(source)
    # A flow with nothing pending banks nothing (a DRR queue that empties resets).
    deficits = {flow: max(0, int(shares.deficits.get(flow, 0))) for flow in members}
    ring = sorted(members)
    last, inner = shares.last, shares.inner

    def head(flow: str) -> str:
        """The source whose task is the flow's next: the flow's own, or the undeclared one
        after ``inner`` whose head has the group's top priority."""
        pending = [s for s in members[flow] if s in heads]
        if len(pending) == 1:
            return pending[0]
        top = max(queues[s][heads[s]].priority for s in pending)
        return next(s for s in _after(pending, inner) if queues[s][heads[s]].priority == top)

    out: list[W] = []
    while len(out) < limit and heads:
        now = {flow: head(flow) for flow in members if any(s in heads for s in members[flow])}
        top = max(queues[s][heads[s]].priority for s in now.values())
        tier = [f for f in _after(ring, last) if f in now and queues[now[f]][heads[now[f]]].priority == top]
        payer = next((f for f in tier if deficits[f] >= _cost(queues[now[f]][heads[now[f]]])), None)
        if payer is None:
            grants = {f: max(1, weights.get(f, default_weight)) * quantum for f in tier}
            k = min(math.ceil((_cost(queues[now[f]][heads[now[f]]]) - deficits[f]) / grants[f]) for f in tier)
            for f in tier:
                deficits[f] += k * grants[f]
            continue
        source = now[payer]
        task = queues[source][heads[source]]
        out.append(task)
        deficits[payer] -= _cost(task)
        heads[source] += 1
        if heads[source] == len(queues[source]):
            del heads[source]
        last = payer
        if payer == UNDECLARED:
            inner = source
    return out, Shares(deficits, last, inner)


def claim_sizes(weights: Mapping[str, float], limit: int) -> dict[str, int]:
    """How many of each source's head to claim for a window of ``limit``: twice its share of
    the window by weight (a source that banked a deficit may take more than its share), at
    least one, at most ``limit``. So thousands of sources cost a task or two each, not a window each.

    >>> sizes = claim_sizes({"live": 1, **{f"b{i}": 1 / 2000 for i in range(2000)}}, 32)
    >>> sizes["live"], sizes["b7"]
    (32, 1)
    >>> claim_sizes({"a": 1, "b": 1}, 10)
    {'a': 10, 'b': 10}
    """
    total = sum(max(0.0, w) for w in weights.values()) or 1.0
    return {s: max(1, min(limit, math.ceil(2 * limit * max(0.0, w) / total))) for s, w in weights.items()}


def claim_weights(sources: Iterable[str], weights: Mapping[str, int], declared: Collection[str],
                  default_weight: int = 1) -> dict[str, float]:
    """Each source's part of the window for :func:`claim_sizes`: a declared source its weight,
    an undeclared one its equal part of the group's ``default_weight``.

    >>> claim_weights(["live", "b1", "b2"], {"live": 2}, {"live"})
    {'live': 2, 'b1': 0.5, 'b2': 0.5}
    """
    names = list(sources)
    undeclared = [s for s in names if s not in declared]
    return {s: weights.get(s, default_weight) if s in declared else default_weight / len(undeclared) for s in names}


def refund(shares: Shares, unserved: Iterable[tuple[str, int]]) -> Shares:
    """Give back the estimates of (flow, estimated tokens) charged by :func:`fill`
    but not served (the admission refused them, or no ready list had room); a
    source's flow is :func:`flow_of` it.

    >>> refund(Shares({"a": 100, "b": 0}, "a"), [("a", 400), ("a", 50)])
    Shares(deficits={'a': 550, 'b': 0}, last='a', inner=None)

    A refunded deficit is at most what it was before the charge, so refunds
    never grow a source's claim beyond what a grant gave it.
    """
    deficits = dict(shares.deficits)
    for source, tokens in unserved:
        if source in deficits:
            deficits[source] += max(0, tokens)
    return Shares(deficits, shares.last, shares.inner)


def _cost(task: Work) -> int:
    return max(0, task.estimated_tokens)


def _after(ring: Sequence[str], last: str | None) -> list[str]:
    """The sources in turn order, starting with the first one after ``last``."""
    if last is None:
        return list(ring)
    start = next((i for i, s in enumerate(ring) if s > last), 0)
    return [*ring[start:], *ring[:start]]
