"""Why nothing is moving: each model's and each source's reasons, from a snapshot of facts.

Pure: :func:`model_reasons` and :func:`source_reasons` read the facts one look
gathered (:class:`ModelFacts`, :class:`SourceFacts`; the I/O is
:mod:`balancer.health.facts`), and :func:`blocked` says whether the drain as
a whole can move. ``status``, ``top``, the metrics exporter and the console show
the same reasons. A new kind of trouble is one entry of :data:`REASONS`, one
fact, and one line in the function that reads it.

A fact that a process does not record yet stays at its "not known" default
(None) and yields no reason: a source's ``read_error``, ``unwritable`` and
``writeback_failing`` (its table's last read error, the write-backs its table
refused, those that failed and wait their next try). ``consumers`` (the
worker processes consuming a model's queue, a live record each:
:mod:`balancer.calls.consumers`) is known where the dispatcher requires one
(``BALANCER_CONSUMERS_REQUIRED``), else None.

>>> m = ModelFacts("gpt-a", failures=2, last_error="cannot reach backend: ConnectError: refused", unreachable=True)
>>> [r.text for r in model_reasons(m)]
['backend unreachable: cannot reach backend: ConnectError: refused']
>>> blocked([m], pending=10)
'blocked: gpt-a: backend unreachable: cannot reach backend: ConnectError: refused'
>>> blocked([m, ModelFacts("gpt-b")], pending=10) is None   # gpt-b can still run
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Every reason, by kind (the metrics' label values): what it means, whether it ``blocks`` (nothing
#: of the model or source moves while it holds; the others are shown, but work still moves), and
#: whether a model or a source has it.
REASONS: dict[str, tuple[str, bool, str]] = {
    "disabled": ("its quota is disabled", True, "model"),
    "unreachable": ("the backend cannot be reached (its calls are not sent)", True, "model"),
    "circuit_open": ("repeated failures opened its circuit: one probe call at a time", True, "model"),
    "paused": ("a 429 paused it for its Retry-After", True, "model"),
    "no_consumer": ("no worker consumes its queue", True, "model"),
    "failing": ("its last calls failed and none was answered since", False, "model"),
    "unreadable": ("the source's table could not be read", True, "source"),
    "over_budget": ("the source's budget per day is spent: none of its tasks is called until the next UTC day", True, "source"),
    "unwritable": ("the source's table refused write-backs until they were left unwritable", False, "source"),
    "writeback_failing": ("the source's write-backs failed (its table refused them, or could not be written) "
                          "and are retried", False, "source"),
}


#: The reasons that stop a model until something changes (an operator, a worker, the backend),
#: unlike a 429's pause, whose end is known: the drain ETA leaves such a model out, and the tasks
#: only it may take are counted apart (:class:`balancer.views.eta.Forecast`'s ``unplaced``).
STOPPING = frozenset({"disabled", "no_consumer", "unreachable", "circuit_open"})


def kinds(scope: str) -> tuple[str, ...]:
    """The reasons a ``model`` or a ``source`` may have.

    >>> kinds("source")
    ('unreadable', 'over_budget', 'unwritable', 'writeback_failing')
    """
    return tuple(k for k, (_, _, s) in REASONS.items() if s == scope)


@dataclass(frozen=True)
class Reason:
    kind: str  # a key of REASONS
    text: str  # for a person, with the detail (the error, how long)

    @property
    def blocks(self) -> bool:
        return REASONS[self.kind][1]


@dataclass(frozen=True)
class ModelFacts:
    """What one look saw of a model."""

    name: str
    enabled: bool = True
    paused_s: float = 0.0  # how much longer a 429 or an open circuit holds it
    circuit_open: bool = False
    failures: int = 0  # consecutive transient failures (the circuit breaker's count; 0 once one is answered)
    last_error: str | None = None  # its last failed call's error, when none was answered since
    unreachable: bool = False  # that call was never sent: the backend refused the connection or was not reached
    consumers: int | None = None  # workers consuming its queue now; None: not known


@dataclass(frozen=True)
class SourceFacts:
    """What one look saw of a source."""

    name: str
    read_error: str | None = None  # its table's last read failed with this error; None: read, or not known
    over_budget: str | None = None  # its budget per day that is spent ("money", "tokens"); None: none spent
    unwritable: int | None = None  # write-backs its table refused until they were left unwritable; None: not known
    unwritable_error: str | None = None  # the latest of those's error
    writeback_failing: int | None = None  # write-backs waiting after a failed try, retried; None: not known
    writeback_failing_error: str | None = None  # the latest of those's error


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def model_reasons(m: ModelFacts) -> list[Reason]:
    """Why ``m`` moves slowly or not at all, the one that blocks it first ([] when nothing is wrong).

    >>> [r.text for r in model_reasons(ModelFacts("a", paused_s=12.4))]
    ['paused by a 429 for 12 s more']
    >>> [r.kind for r in model_reasons(ModelFacts("a", paused_s=2, circuit_open=True, last_error="503 from /solve"))]
    ['circuit_open']
    >>> [r.text for r in model_reasons(ModelFacts("a", circuit_open=True, last_error="503 from /solve"))]
    ['circuit open (503 from /solve); probing it one call at a time']
    >>> [r.text for r in model_reasons(ModelFacts("a", enabled=False, consumers=0))]
    ['quota disabled', 'no worker consumes model.a']
    >>> [r.text for r in model_reasons(ModelFacts("a", last_error="404 from /solve: unknown model"))]
    ['failing: 404 from /solve: unknown model']
    >>> model_reasons(ModelFacts("a", consumers=2))
    []
    """
    reasons = []
    if not m.enabled:
        reasons.append(Reason("disabled", "quota disabled"))
    if m.consumers == 0:
        reasons.append(Reason("no_consumer", f"no worker consumes model.{m.name}"))
    error = m.last_error
    if m.unreachable and error and (m.failures or m.circuit_open):
        reasons.append(Reason("unreachable", f"backend unreachable: {error}"))
    elif m.circuit_open:
        pause = f"paused {_seconds(m.paused_s)} more, then " if m.paused_s > 0 else ""
        reasons.append(Reason("circuit_open", f"circuit open ({error or 'repeated failures'}); "
                                              f"{pause}probing it one call at a time"))
    elif m.paused_s > 0:
        reasons.append(Reason("paused", f"paused by a 429 for {_seconds(m.paused_s)} more"))
    elif error:
        reasons.append(Reason("failing", f"failing: {error}"))
    return reasons


def source_reasons(s: SourceFacts) -> list[Reason]:
    """Why ``s``'s rows do not move ([] when nothing is wrong).

    >>> [r.text for r in source_reasons(SourceFacts("legacy", read_error="LEGACY_URL is not set"))]
    ['table unreadable: LEGACY_URL is not set']
    >>> for r in source_reasons(SourceFacts("team", over_budget="money", unwritable=3)):
    ...     print(r.text)
    over its money budget per day: none of its tasks is called until the next UTC day
    3 write-back(s) refused by its table: balancer source unwritable team
    >>> [r.text for r in source_reasons(SourceFacts("t4", writeback_failing=6, writeback_failing_error="permission denied"))]
    ['6 write-back(s) failing, retried: permission denied']
    """
    reasons = []
    if s.read_error:
        reasons.append(Reason("unreadable", f"table unreadable: {s.read_error}"))
    if s.over_budget:
        reasons.append(Reason("over_budget", f"over its {s.over_budget} budget per day: "
                                             "none of its tasks is called until the next UTC day"))
    if s.unwritable:
        error = f" (last: {s.unwritable_error})" if s.unwritable_error else ""
        reasons.append(Reason("unwritable", f"{s.unwritable} write-back(s) refused by its table{error}: "
                                            f"balancer source unwritable {s.name}"))
    if s.writeback_failing:
        reasons.append(Reason("writeback_failing", f"{s.writeback_failing} write-back(s) failing, retried: "
                                                   f"{s.writeback_failing_error or 'no error recorded'}"))
    return reasons


def blocked(models: Sequence[ModelFacts], pending: int) -> str | None:
    """Why nothing can run while ``pending`` tasks wait: every model has a reason that
    blocks it (the ETA says this instead of a number); None when something can run.
    Models stopped by the same reason are named together: a backend that is down for
    all of them is said once.

    >>> blocked([ModelFacts("a", enabled=False), ModelFacts("b", paused_s=30)], pending=5)
    'blocked: a: quota disabled; b: paused by a 429 for 30 s more'
    >>> down = [ModelFacts(n, unreachable=True, failures=1, last_error="refused") for n in "abcde"]
    >>> blocked(down, pending=5)
    'blocked: a, b, c and 2 more: backend unreachable: refused'
    >>> blocked([ModelFacts("a", paused_s=30)], pending=0) is None   # nothing waits
    True
    >>> blocked([], pending=5)
    'blocked: no model has a quota'
    """
    if pending <= 0:
        return None
    if not models:
        return "blocked: no model has a quota"
    stopped_by: dict[str, list[str]] = {}
    for m in models:
        stops = [r for r in model_reasons(m) if r.blocks]
        if not stops:
            return None
        stopped_by.setdefault(stops[0].text, []).append(m.name)
    why = [f"{_some(names, ', ', ' and ')}: {text}" for text, names in stopped_by.items()]
    return "blocked: " + _some(why, "; ", "; ")


def _some(items: list[str], sep: str, before_more: str, shown: int = 3) -> str:
    """The first ``shown`` of ``items`` joined by ``sep``, then how many more."""
    more = f"{before_more}{len(items) - shown} more" if len(items) > shown else ""
    return sep.join(items[:shown]) + more


@dataclass(frozen=True)
class Health:
    """The reasons of one look: per model, per source (only those with one), and the drain's."""

    models: dict[str, list[Reason]]
    sources: dict[str, list[Reason]]
    blocked: str | None  # why nothing can run (the ETA shows it instead of a number); None: something can

    @property
    def stopped_models(self) -> frozenset[str]:
        """The models a :data:`STOPPING` reason holds: no work of theirs moves until it changes.

        >>> assess([ModelFacts("a", consumers=0), ModelFacts("b", paused_s=3), ModelFacts("c")], [], 5).stopped_models
        frozenset({'a'})
        """
        return frozenset(name for name, rs in self.models.items() if any(r.kind in STOPPING for r in rs))

    @property
    def unread_sources(self) -> list[str]:
        """The sources whose table could not be read: their rows are in no count and no ETA."""
        return sorted(name for name, rs in self.sources.items() if any(r.kind == "unreadable" for r in rs))

    @property
    def writeback_failing_sources(self) -> list[str]:
        """The sources whose answers wait to be written back after failed tries: no task is
        left to run, yet their table does not hold those answers.

        >>> assess([], [SourceFacts("t", writeback_failing=2), SourceFacts("u")], 0).writeback_failing_sources
        ['t']
        """
        return sorted(name for name, rs in self.sources.items() if any(r.kind == "writeback_failing" for r in rs))

    def model_text(self, name: str) -> str:
        """A model's reasons in one cell ('' when it has none)."""
        return "; ".join(r.text for r in self.models.get(name, []))

    def as_dict(self) -> dict[str, object]:
        def listed(reasons: dict[str, list[Reason]]) -> dict[str, list[dict[str, str]]]:
            return {name: [{"kind": r.kind, "text": r.text} for r in rs] for name, rs in reasons.items() if rs}

        return {"blocked": self.blocked, "models": listed(self.models), "sources": listed(self.sources)}


def assess(models: Sequence[ModelFacts], sources: Sequence[SourceFacts], unfinished: int) -> Health:
    """Every reason of one look; ``unfinished``: the tasks not ended (pending or in flight).

    >>> h = assess([ModelFacts("a", enabled=False)], [SourceFacts("s", over_budget="tokens")], unfinished=3)
    >>> h.blocked, h.model_text("a"), [r.kind for r in h.sources["s"]]
    ('blocked: a: quota disabled', 'quota disabled', ['over_budget'])
    """
    return Health({m.name: model_reasons(m) for m in models},
                  {s.name: rs for s in sources if (rs := source_reasons(s))},
                  blocked(models, unfinished))
