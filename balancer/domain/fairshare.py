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
from collections.abc import Iterable, Mapping, Sequence
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
#: :mod:`balancer.domain.ready`). A task stocked behind a list of ``d`` entries
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
    last: str | None = None  # the source served last; the next turn goes to the one after it


def fill(queues: Mapping[str, Sequence[W]], limit: int, weights: Mapping[str, int], shares: Shares,
         *, default_weight: int = 1, quantum: int = DEFAULT_QUANTUM) -> tuple[list[W], Shares]:
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
    """
    heads = {source: 0 for source, queue in queues.items() if queue}
    # A source with nothing pending banks nothing (a DRR queue that empties resets).
    deficits = {source: max(0, int(shares.deficits.get(source, 0))) for source in heads}
    ring = sorted(heads)
    last = shares.last
    out: list[W] = []
    while len(out) < limit and heads:
        top = max(queues[s][heads[s]].priority for s in heads)
        tier = [s for s in _after(ring, last) if s in heads and queues[s][heads[s]].priority == top]
        payer = next((s for s in tier if deficits[s] >= _cost(queues[s][heads[s]])), None)
        if payer is None:
            grants = {s: max(1, weights.get(s, default_weight)) * quantum for s in tier}
            k = min(math.ceil((_cost(queues[s][heads[s]]) - deficits[s]) / grants[s]) for s in tier)
            for s in tier:
                deficits[s] += k * grants[s]
            continue
        task = queues[payer][heads[payer]]
        out.append(task)
        deficits[payer] -= _cost(task)
        heads[payer] += 1
        if heads[payer] == len(queues[payer]):
            del heads[payer]
        last = payer
    return out, Shares(deficits, last)


def claim_sizes(weights: Mapping[str, int], limit: int) -> dict[str, int]:
    """How many of each source's head to claim for a window of ``limit``: twice its share of
    the window by weight (a source that banked a deficit may take more than its share), at
    least one, at most ``limit``. So thousands of sources cost a task or two each, not a window each.

    >>> claim_sizes({"live": 2000, **{f"b{i}": 1 for i in range(2000)}}, 32)["live"], \
    ...     claim_sizes({"live": 2000, **{f"b{i}": 1 for i in range(2000)}}, 32)["b7"]
    (32, 1)
    >>> claim_sizes({"a": 1, "b": 1}, 10)
    {'a': 10, 'b': 10}
    """
    total = sum(max(1, w) for w in weights.values()) or 1
    return {s: max(1, min(limit, math.ceil(2 * limit * max(1, w) / total))) for s, w in weights.items()}


def refund(shares: Shares, unserved: Iterable[tuple[str, int]]) -> Shares:
    """Give back the estimates of (source, estimated tokens) charged by :func:`fill`
    but not served (the admission refused them, or no ready list had room).

    >>> refund(Shares({"a": 100, "b": 0}, "a"), [("a", 400), ("a", 50)])
    Shares(deficits={'a': 550, 'b': 0}, last='a')

    A refunded deficit is at most what it was before the charge, so refunds
    never grow a source's claim beyond what a grant gave it.
    """
    deficits = dict(shares.deficits)
    for source, tokens in unserved:
        if source in deficits:
            deficits[source] += max(0, tokens)
    return Shares(deficits, shares.last)


def _cost(task: Work) -> int:
    return max(0, task.estimated_tokens)


def _after(ring: Sequence[str], last: str | None) -> list[str]:
    """The sources in turn order, starting with the first one after ``last``."""
    if last is None:
        return list(ring)
    start = next((i for i, s in enumerate(ring) if s > last), 0)
    return [*ring[start:], *ring[:start]]
