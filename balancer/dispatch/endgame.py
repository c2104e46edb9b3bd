"""The end game: bind the last tasks to the models that will finish them soonest.

While the backlog is long, every free slot should take work (work-conserving):
any call started now ends long before the backlog does. At the end that is
wrong. A task handed to a slow, heavy-tailed model in the last minute can end
a minute after every other model has gone idle, and the whole run waits for
it. The fix is list scheduling by *minimum completion time*: each remaining
task, in priority order, goes to the model where it would finish soonest,
counting the wait for a slot, tokens and a request there, and a high quantile
of that model's latency. A task whose best model is busy stays pending, and
the free slot of a slower model stays idle.

The switch between the two comes from the estimate itself. The fluid drain
time is the backlog divided by the models' combined throughput (each model
at min(cap / mean latency, token rate / mean task, request rate)). While it
exceeds the slowest open model's p90, a call started anywhere now ends before
the backlog runs out, so every slot takes work. Below it, the plan decides.

Everything here is pure: the dispatcher builds a :class:`ModelOutlook` per
model from Redis and asks :func:`plan` which tasks to bind now.

>>> fast = ModelOutlook("fast", cap=2, free_slots=2, in_flight=0, latency=LatencyEstimate(1_000, 2_000, 3_000, 50))
>>> slow = ModelOutlook("slow", cap=2, free_slots=2, in_flight=0, latency=LatencyEstimate(20_000, 60_000, 90_000, 50))
>>> plan([Job(1, 100), Job(2, 100), Job(3, 100)], [fast, slow])
['fast', 'fast', None]

The third task waits for a fast slot (it would end at about 1 + 2 s) rather
than take the idle slow one (60 s at p90).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from balancer.estimates.capacity import throughput
from balancer.estimates.latency import LatencyEstimate

#: Which field of a model's LatencyEstimate a call's length is planned at
#: (``latency_field`` below). Without hedging, the end of a run
#: is set by its slowest calls, so a high quantile (p90). With hedging, a call
#: that overruns is overtaken by a hedge, so the expected latency (mean) is
#: what a placement should minimize, and slow models keep taking work longer.
CAUTIOUS = "p90_ms"
HEDGED = "mean_ms"


@dataclass(frozen=True)
class ModelOutlook:
    """One model as the plan sees it: slots, rates and latency, all as of now."""

    name: str
    cap: int
    free_slots: int  # slots that can take a call now (0 while paused or disabled)
    in_flight: int
    latency: LatencyEstimate
    tokens_available: float = math.inf
    tokens_per_ms: float = math.inf
    requests_available: float = math.inf
    requests_per_ms: float = math.inf
    paused_ms: float = 0.0
    #: Its latency comes from its own calls (or its quota), not the global prior ("not known yet").
    latency_known: bool = True

    def throughput_per_ms(self, mean_tokens: float) -> float:
        """Tasks per ms at this model's binding limit (0 if it takes nothing):
        :func:`balancer.estimates.capacity.throughput` in ms."""
        return throughput(self.cap, self.latency.mean_ms, self.tokens_per_ms, mean_tokens, self.requests_per_ms)


@dataclass(frozen=True)
class Job:
    """A pending task: its key, token estimate, and the models it may use (None: any)."""

    key: int
    estimated_tokens: int
    allowed: tuple[str, ...] | None = None
    avoid: str | None = None


def drain_ms(pending: int, mean_tokens: float, models: Sequence[ModelOutlook]) -> float:
    """Fluid estimate of how long the backlog takes to run out.

    >>> m = ModelOutlook("m", cap=10, free_slots=0, in_flight=10, latency=LatencyEstimate(1_000, 2_000, 3_000, 50))
    >>> round(drain_ms(100, 100, [m]))   # 10 calls per mean latency of 1.133 s
    11330
    """
    rate = sum(m.throughput_per_ms(mean_tokens) for m in models)
    return math.inf if rate <= 0 else pending / rate


def horizon_ms(models: Sequence[ModelOutlook], latency_field: str = CAUTIOUS) -> float:
    """How long a call started now on the slowest of ``models`` takes (its ``latency_field``),
    among those whose latency is known; all of them if none is. A model still on the global
    prior (30 s: "not known yet") is left out: counted, it made every run shorter than that
    an end game from the first seconds, in which a model on its prior is never chosen, so it
    never measured the calls that would free it.

    >>> fast = ModelOutlook("fast", cap=4, free_slots=4, in_flight=0, latency=LatencyEstimate(500, 1_000, 1_500, 50))
    >>> new = ModelOutlook("new", cap=4, free_slots=4, in_flight=0, latency=LatencyEstimate.prior(30.0),
    ...                    latency_known=False)
    >>> horizon_ms([fast, new]), horizon_ms([new])
    (1000, 57000.0)
    """
    known = [m for m in models if m.latency_known] or list(models)
    return max((getattr(m.latency, latency_field) for m in known), default=0.0)


def in_end_game(pending: int, mean_tokens: float, models: Sequence[ModelOutlook], latency_field: str = CAUTIOUS) -> bool:
    """True when the backlog would run out before a call started now on the
    slowest model with a free slot would end (at its p90, or its mean with ``latency_field=HEDGED``;
    :func:`horizon_ms`)."""
    open_models = [m for m in models if m.free_slots > 0]
    if not open_models or pending <= 0:
        return False
    return drain_ms(pending, mean_tokens, models) < horizon_ms(open_models, latency_field)


@dataclass
class _Timeline:
    """A model's future during planning: when each slot frees, tokens and requests used."""

    outlook: ModelOutlook
    slots: list[float]  # heap of the times (ms from now) at which each slot can start a call
    tokens_used: float = 0.0
    requests_used: float = 0.0

    @classmethod
    def of(cls, m: ModelOutlook) -> _Timeline:
        # Running calls end at unknown times; spread them evenly over one mean latency.
        busy = [m.latency.mean_ms * (j + 1) / (m.in_flight + 1) for j in range(min(m.in_flight, m.cap))]
        idle = [0.0] * max(0, min(m.free_slots, m.cap - len(busy)))
        slots = idle + busy
        if not slots:  # no slot free now and none known busy: the first frees after a mean latency
            slots = [m.latency.mean_ms]
        heapq.heapify(slots)
        return cls(m, slots)

    def start_at(self, est: int) -> float:
        m = self.outlook
        start = max(self.slots[0], m.paused_ms)
        if math.isfinite(m.tokens_per_ms):
            short = self.tokens_used + est - m.tokens_available
            if short > 0:
                start = max(start, short / m.tokens_per_ms if m.tokens_per_ms > 0 else math.inf)
        if math.isfinite(m.requests_per_ms):
            short = self.requests_used + 1 - m.requests_available
            if short > 0:
                start = max(start, short / m.requests_per_ms if m.requests_per_ms > 0 else math.inf)
        return start

    def take(self, start: float, est: int) -> None:
        heapq.heapreplace(self.slots, start + self.outlook.latency.mean_ms)
        self.tokens_used += est
        self.requests_used += 1


def plan(
    jobs: Sequence[Job], models: Sequence[ModelOutlook], unclaimed: Sequence[Job] = (), latency_field: str = CAUTIOUS,
) -> list[str | None]:
    """For each job, in order, the model to bind it to now, or None to keep it pending.

    First the whole backlog, ``jobs`` then the ``unclaimed`` rest, is placed
    by minimum completion time: each in turn goes to the allowed model where
    it would *finish* soonest (start + p90, or + mean with ``latency_field=HEDGED``), seeing the slots, tokens and
    requests the earlier ones took. That says how many calls each model
    should start *now*: a slow model's free slot is worth filling only if
    the plan puts some of the backlog there at once. Then ``jobs``, in
    priority order, take those starts, each the soonest-finishing one it is
    allowed on; the rest stay pending. (Binding each job where the plan put
    it would not do: the plan puts the first jobs in the fast models' queues
    and the slow models' share at the back, which is unclaimed.) A job with
    an ``avoid`` model uses it only if it is the only one allowed.

    >>> a = ModelOutlook("a", cap=1, free_slots=1, in_flight=0, latency=LatencyEstimate(1_000, 1_500, 2_000, 50))
    >>> b = ModelOutlook("b", cap=1, free_slots=1, in_flight=0, latency=LatencyEstimate(1_500, 2_000, 2_500, 50))
    >>> plan([Job(1, 10), Job(2, 10), Job(3, 10, ("b",))], [a, b])
    ['a', 'b', None]
    """
    timelines = {m.name: _Timeline.of(m) for m in models}
    starts_now = dict.fromkeys(timelines, 0)
    for job in [*jobs, *unclaimed]:
        best: tuple[float, float, str] | None = None
        for name in _usable(job, timelines):
            line = timelines[name]
            start = line.start_at(job.estimated_tokens)
            ends = start + getattr(line.outlook.latency, latency_field)
            if best is None or (ends, start, name) < best:
                best = (ends, start, name)
        if best is None or not math.isfinite(best[0]):
            continue
        _, start, name = best
        line = timelines[name]
        if line.slots[0] == 0.0 and line.outlook.free_slots > 0:
            starts_now[name] += 1
        line.take(start, job.estimated_tokens)
    out: list[str | None] = []
    for job in jobs:
        usable = [n for n in _usable(job, timelines) if starts_now[n] > 0]
        if not usable:
            out.append(None)
            continue
        name = min(usable, key=lambda n: (getattr(timelines[n].outlook.latency, latency_field), n))
        starts_now[name] -= 1
        out.append(name)
    return out


def _usable(job: Job, timelines: Mapping[str, _Timeline]) -> list[str]:
    names = [n for n in (job.allowed or timelines) if n in timelines]
    if job.avoid in names and len(names) > 1:
        names.remove(job.avoid)
    return names


@dataclass(frozen=True)
class Running:
    """A call in flight that a hedge might overtake."""

    key: int
    model: str
    elapsed_ms: float
    estimated_tokens: int
    allowed: tuple[str, ...] | None = None


def remaining_ms(elapsed_ms: float, latency: LatencyEstimate) -> float:
    """The median time a call that has run ``elapsed_ms`` still has to run.

    Latency is read as a lognormal through the model's p50 and p90; given that
    the call has lasted ``elapsed_ms``, it ends at the median of what is left
    of that distribution. For a heavy tail that is far from zero even past the
    model's p50: the longer a call has run, the longer it is likely to run.

    >>> est = LatencyEstimate(10_000, 30_000, 90_000, 50)
    >>> round(remaining_ms(0, est)), round(remaining_ms(10_000, est)), round(remaining_ms(30_000, est))
    (10000, 7828, 10962)
    """
    if latency.p90_ms <= latency.p50_ms or latency.p50_ms <= 0:
        return max(0.0, latency.p50_ms - elapsed_ms)
    sigma = math.log(latency.p90_ms / latency.p50_ms) / _Z90
    survived = 1.0 if elapsed_ms <= 0 else 1.0 - _NORMAL.cdf(math.log(elapsed_ms / latency.p50_ms) / sigma)
    z = _NORMAL.inv_cdf(min(1.0 - 1e-12, 1.0 - survived / 2))
    return max(0.0, latency.p50_ms * math.exp(sigma * z) - elapsed_ms)


_NORMAL = NormalDist()
_Z90 = _NORMAL.inv_cdf(0.9)


def worth_hedging(elapsed_ms: float, running: LatencyEstimate, fresh: LatencyEstimate) -> bool:
    """Whether a fresh call (at its p90) would likely beat a call that has run ``elapsed_ms``.

    Either what the call still has to run (:func:`remaining_ms`) exceeds a
    fresh call's p90, or the call has run past its model's p90 and longer than
    a fresh call's p90: the model's own distribution no longer describes it
    (a hung call, a backend that slowed down), so what it has already run is
    the best guess of what it still has to.

    >>> slow, fast = LatencyEstimate(10_000, 30_000, 90_000, 50), LatencyEstimate(1_000, 2_000, 4_000, 50)
    >>> worth_hedging(5_000, slow, fast), worth_hedging(20_000, slow, slow), worth_hedging(40_000, slow, fast)
    (True, False, True)
    >>> light = LatencyEstimate(100, 190, 320, 50)   # 2 s is 20x its median: hung, not "about to end"
    >>> worth_hedging(2_500, light, fast), worth_hedging(1_000, light, fast)
    (True, False)
    """
    overrun = elapsed_ms > running.p90_ms and elapsed_ms > fresh.p90_ms
    return overrun or remaining_ms(elapsed_ms, running) > fresh.p90_ms


def slot_wait_ms(model: ModelOutlook, free_slots: int, queued: int = 0) -> float:
    """Roughly how long until ``model`` can start one more call: now with a free
    slot; else its 429 pause, or the time until ``queued + 1`` of its calls in
    flight have ended (its median over how many run, per call ahead).

    >>> est = LatencyEstimate(1_000, 2_000, 4_000, 50)
    >>> m = ModelOutlook("m", cap=4, free_slots=0, in_flight=4, latency=est)
    >>> slot_wait_ms(m, 1), slot_wait_ms(m, 0), slot_wait_ms(m, 0, queued=3)
    (0.0, 250.0, 1000.0)
    """
    if free_slots > 0:
        return 0.0
    return max(model.paused_ms, (queued + 1) * model.latency.p50_ms / max(1, model.in_flight))


#: The run's last calls keep a share of the hedge budget: while more running calls than this could be
#: hedged, hedges leave untouched what hedging this many would cost. The last calls set the run's end,
#: and a budget spent on the many stragglers before them left them unhedged.
LAST_CALLS = 4


def hedge_allowance(budget_left: float, call_tokens: Sequence[int]) -> float:
    """What hedges may spend now, of the ``budget_left`` (tokens), given the estimated tokens of
    the running calls that could be hedged (``call_tokens``): all of it once at most
    :data:`LAST_CALLS` such calls are left, else what is left over a reserve for hedging the
    last ones, :data:`LAST_CALLS` times their mean tokens. (Calls, not slots: a hedged pair's
    loser may hold its slot for long after its task is answered.)

    >>> hedge_allowance(10_000, [500, 1_500] * 10)   # 4 x 1,000 kept for the last calls
    6000.0
    >>> hedge_allowance(10_000, [500, 1_500])        # the last calls: all of it
    10000
    >>> hedge_allowance(3_000, [1_000] * 20)         # less than the reserve: nothing before the last calls
    0.0
    """
    if len(call_tokens) <= LAST_CALLS:
        return budget_left
    return max(0.0, budget_left - LAST_CALLS * sum(call_tokens) / len(call_tokens))


def pick_hedges(calls: Sequence[Running], models: Sequence[ModelOutlook], budget_tokens: float,
                orphans: Collection[str] = ()) -> list[tuple[int, str]]:
    """(call key, model) for each hedge to send now, the calls expected to end last first.

    A hedge goes to the allowed model (not the call's own) where a fresh call
    is :func:`worth_hedging` and would end soonest: the wait for a slot there
    (:func:`slot_wait_ms`, counting the hedges already waiting for it) plus
    its p90. If that model has no free slot now,
    the call waits for it rather than take a slower model's free slot: a task
    gets one hedge, and one spent on a slow model in the middle of the run
    (whose free slots the end game leaves idle) is a second heavy-tailed draw
    when a fast model would have a slot in a moment. The hedges' token
    estimates stay within ``budget_tokens``.

    A call on one of the ``orphans`` (no worker consumes its model's queue: its
    worker's host is cut off, or gone; :mod:`balancer.dispatch.served`) may never
    end, and without a hedge its task waits a whole lease for the sweep: it is
    hedged first, whatever its latency says and whatever the budget, on another
    model. No hedge goes to an orphan.

    >>> slow = ModelOutlook("slow", cap=2, free_slots=0, in_flight=2, latency=LatencyEstimate(10_000, 30_000, 90_000, 50))
    >>> fast = ModelOutlook("fast", cap=1, free_slots=1, in_flight=0, latency=LatencyEstimate(1_000, 2_000, 4_000, 50))
    >>> pick_hedges([Running(1, "slow", 45_000, 500), Running(2, "slow", 40_000, 500)], [slow, fast], 10_000)
    [(1, 'fast')]
    >>> pick_hedges([Running(1, "slow", 45_000, 500)], [slow, fast], 400)   # over budget
    []
    >>> busy_fast = ModelOutlook("fast", cap=4, free_slots=0, in_flight=4, latency=fast.latency)
    >>> mid = ModelOutlook("mid", cap=2, free_slots=1, in_flight=1, latency=LatencyEstimate(8_000, 20_000, 60_000, 50))
    >>> pick_hedges([Running(1, "slow", 45_000, 500)], [slow, busy_fast, mid], 10_000)   # fast frees a slot in ~250 ms
    []
    >>> pick_hedges([Running(1, "slow", 45_000, 500)], [slow, mid], 10_000)              # mid is the best there is
    [(1, 'mid')]
    >>> orphaned = [Running(1, "slow", 45_000, 500), Running(2, "fast", 10, 500)]
    >>> pick_hedges(orphaned, [slow, fast, mid], 0), pick_hedges(orphaned, [slow, fast, mid], 0, {"fast"})  # no budget
    ([], [(2, 'mid')])
    """
    by_name = {m.name: m for m in models}
    free = {m.name: m.free_slots for m in models}
    queued = dict.fromkeys(by_name, 0)  # hedges waiting for a slot there, this round
    out: list[tuple[int, str]] = []
    def expected_end(call: Running) -> float:
        running = by_name.get(call.model)
        if call.model in orphans:
            return math.inf
        return -math.inf if running is None else remaining_ms(call.elapsed_ms, running.latency)

    for call in sorted(calls, key=lambda c: -expected_end(c)):
        running = by_name.get(call.model)
        orphan = call.model in orphans
        if running is None or (call.estimated_tokens > budget_tokens and not orphan):
            continue
        targets = [
            by_name[n] for n in (call.allowed or by_name)
            if n in by_name and n != call.model and n not in orphans
            and (orphan or worth_hedging(call.elapsed_ms, running.latency, by_name[n].latency))
        ]
        if not targets:
            continue
        target = min(targets, key=lambda m: (slot_wait_ms(m, free[m.name], queued[m.name]) + m.latency.p90_ms, m.name))
        if free[target.name] <= 0:
            queued[target.name] += 1  # the best model for this hedge is busy: hedge there when a slot frees
            continue
        free[target.name] -= 1
        budget_tokens -= call.estimated_tokens
        out.append((call.key, target.name))
    return out
