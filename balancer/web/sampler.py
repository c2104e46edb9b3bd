"""The console's background sampler: what ``status`` and ``top`` read, every few seconds, kept 15 minutes.

One thread per console reads :func:`balancer.views.overview.read_overview` (task
counts, per-model rows, counters, the drain ETA, the sources' budgets against today's
spend, the spend so far and the backlog left's projected cost), the per-source counts
(:func:`balancer.web.queries.source_counts`) and failed tasks grouped by
error (:func:`balancer.web.queries.error_groups`) every ``interval`` seconds
(or, when a read takes longer than half of that, as long again as the read
took) into a ring buffer. Pages render from the newest sample, so a page costs no scan
of the backlog however large it is; sparklines, per-minute rates and the
burn-down come from the buffer. The buffer lives in this process only: a
restarted console starts with an empty history.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from balancer.backlog.statuses import UNFINISHED
from balancer.costs.budget import Standing
from balancer.costs.cost import Spend
from balancer.health.reasons import Health
from balancer.services import Services
from balancer.sources.reads import not_tasks_by_source
from balancer.urls import scrub
from balancer.views.overview import read_overview
from balancer.views.summary import ModelSummary
from balancer.web.queries import ErrorGroup, SourceCounts, error_groups, source_counts, top_sources

log = logging.getLogger(__name__)

#: How far back sparklines and the burn-down look.
HISTORY_S = 15 * 60.0
#: Per-minute rates are measured over this much of the buffer, as ``balancer top`` does.
RATE_WINDOW_S = 60.0
#: Grouping failed tasks by error gives up after this long (hundreds of thousands failed).
GROUPING_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class Sample:
    at: float  # time.time() when taken
    counts: dict[str, int]
    rows: list[ModelSummary]
    counters: dict[str, dict[str, int]]
    eta_s: float | None
    eta_low_s: float | None = None  # the ETA's band (balancer.views.eta.Forecast)
    eta_high_s: float | None = None
    sources: list[SourceCounts] = field(default_factory=list)  # the busiest (queries.TOP_SOURCES), by name
    spend: Spend = field(default_factory=lambda: Spend(None))  # so far, by model and source (balancer.backlog.spend)
    projected: Spend = field(default_factory=lambda: Spend(None))  # the backlog left's projected cost, by model
    error_groups: list[ErrorGroup] | None = field(default_factory=list)  # None: too many failed tasks to group in time
    budgets: dict[str, Standing] = field(default_factory=dict)  # per source with a budget per day: spent today, waiting
    waiting: int = 0  # pending tasks of sources over their budget: not in the ETA (balancer.views.eta.Forecast.waiting)
    health: Health = field(default_factory=lambda: Health({}, {}, None))  # why nothing moves (balancer.health.reasons)
    sources_other: SourceCounts | None = None  # every source past the busiest, added up (None: none)
    #: per source table with rows of work that are not tasks: how many, by reason (balancer.sources.reads)
    not_tasks: dict[str, dict[str, int]] = field(default_factory=dict)
    not_read: list[str] = field(default_factory=list)  # sources not read to their table's end: not in the ETA
    unplaced: int = 0  # pending tasks only removed, disabled or stopped models may take (Forecast.unplaced): not in the ETA

    @property
    def left(self) -> int:
        """Tasks not finished: pending, ready, queued or running."""
        return sum(self.counts.get(s, 0) for s in UNFINISHED)

    @property
    def nothing_else_to_run(self) -> bool:
        """No task left to run, yet not "done": pending tasks wait on a budget or on models that
        cannot take them, a source's rows are unread, or its answers are not written back."""
        aside = (self.waiting or self.unplaced or self.not_read or self.health.unread_sources
                 or self.health.writeback_failing_sources)
        return bool(aside) and self.eta_s is not None and self.eta_s <= 0


def per_minute(new: Sample, old: Sample, model: str, *fields: str) -> float:
    """How fast ``fields`` of ``model``'s counters grew between two samples, per minute.

    >>> a = Sample(0.0, {}, [], {"m": {"solved": 1}}, None)
    >>> b = Sample(30.0, {}, [], {"m": {"solved": 6, "failed": 1}}, None)
    >>> per_minute(b, a, "m", "solved", "failed")
    12.0
    """
    seconds = new.at - old.at
    if seconds <= 0:
        return 0.0
    grew = sum(new.counters.get(model, {}).get(f, 0) - old.counters.get(model, {}).get(f, 0) for f in fields)
    return grew * 60.0 / seconds


class Sampler:
    """Samples every ``interval`` seconds in a daemon thread; :meth:`latest` and :meth:`history` read the buffer."""

    def __init__(self, services: Services, interval: float = 2.0,
                 take: Callable[[Services], Sample] | None = None) -> None:
        self.services, self.interval = services, interval
        self._take = take or take_sample
        self._buffer: deque[Sample] = deque(maxlen=max(2, math.ceil(HISTORY_S / interval) + 1))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # the last sampling failure, shown on the pages

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="web-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def sample_now(self) -> Sample:
        sample = self._take(self.services)
        with self._lock:
            self._buffer.append(sample)
        self.error = None
        return sample

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample_now()
            except Exception as exc:  # noqa: BLE001 - Redis or PostgreSQL away: keep trying, say so on the page
                self.error = self._describe(exc)
                log.warning("sampling failed: %s", self.error)
            took = time.monotonic() - started
            # Every interval, but never busier than half the time: a slow read (a huge
            # backlog, a loaded database) spaces the next one out rather than piling up.
            self._stop.wait(max(self.interval - took, took))

    def _describe(self, exc: Exception) -> str:
        """The error's first line, with no piece of a service URL's credentials (it is shown on the pages)."""
        text = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        settings = self.services.settings
        for url in (settings.redis_url, settings.database_url, settings.broker_url):
            if url:
                text = scrub(text, url)
        return text

    def latest(self) -> Sample:
        """The newest sample (taken now if there is none yet)."""
        with self._lock:
            if self._buffer:
                return self._buffer[-1]
        return self.sample_now()

    def history(self) -> list[Sample]:
        """The samples of the last :data:`HISTORY_S`, oldest first."""
        with self._lock:
            samples = list(self._buffer)
        return [s for s in samples if s.at >= samples[-1].at - HISTORY_S] if samples else []

    def rates(self) -> dict[str, tuple[float, float]]:
        """Per model: (tokens per minute, requests per minute) over the last minute of samples."""
        samples = self.history()
        if len(samples) < 2:
            return {}
        new = samples[-1]
        old = next((s for s in samples if new.at - s.at <= RATE_WINDOW_S), samples[0])
        return {r.name: (per_minute(new, old, r.name, "tokens_estimated"),
                         per_minute(new, old, r.name, "solved", "transient", "failed")) for r in new.rows}

    def series(self, pick: Callable[[Sample, Sample | None], Mapping[str, float]]) -> dict[str, list[float]]:
        """Per model, one value per sample: ``pick(sample, previous sample)`` gives every model's value."""
        out: dict[str, list[float]] = {}
        previous: Sample | None = None
        for sample in self.history():
            for name, value in pick(sample, previous).items():
                out.setdefault(name, []).append(value)
            previous = sample
        return out


def kept_spend(spent: Spend, sources: list[SourceCounts]) -> Spend:
    """``spent`` with its spend by source kept for the sources shown by name (the rest: the other row's).

    >>> s = kept_spend(Spend("USD", 6.0, {"m": 6.0}, {"a": 1.0, "b": 2.0, "c": 3.0}), [SourceCounts("b", 0, 0, 0, 0, 0)])
    >>> s.by_source, s.total
    ({'b': 2.0}, 6.0)
    """
    named = {c.source for c in sources}
    return dataclasses.replace(spent, by_source={k: v for k, v in spent.by_source.items() if k in named})


def take_sample(services: Services) -> Sample:
    """One look, its sources cut to the busiest (:func:`~balancer.web.queries.top_sources`): 15 minutes of
    samples hold as much with 50,000 sources as with 50."""
    o = read_overview(services)
    drain = o.drain
    sources, other = top_sources(source_counts(services.engine))
    return Sample(time.time(), o.counts, o.rows, o.counters, None if drain is None else drain.eta,
                  None if drain is None else drain.low, None if drain is None else drain.high,
                  sources, kept_spend(o.spent, sources), o.projected,
                  error_groups(services.engine, timeout_ms=GROUPING_TIMEOUT_MS), o.budgets,
                  0 if drain is None else drain.waiting, o.health, other, not_tasks_by_source(services.engine),
                  o.not_read, 0 if drain is None else drain.unplaced)
