"""The per-model summary that ``balancer status`` and ``balancer top`` show.

Pure once read: :func:`summarize` turns the live view and the counters into
rows, and :func:`binding_limit` says which limit holds a model back right now.
:func:`read` is the I/O around them.

>>> from balancer.admission.live import ModelLive
>>> from balancer.admission.quota import Quota
>>> live = ModelLive(Quota("m", 2, 60_000), in_flight=2, tokens_available=9_000, requests_available=None, deficit=0)
>>> [row.binding for row in summarize({"m": live}, {"m": {"solved": 4, "tokens_estimated": 2_000}}, prior_s=1.0)]
['concurrency']
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from balancer.admission.live import ModelLive
from balancer.backlog.reads import (
    Backlog,
    ModelSolves,
    backlog,
    pending_groups_of,
    recent_solves,
    recent_solves_by_model,
    running_calls,
    status_counts,
)
from balancer.backlog.statuses import UNFINISHED
from balancer.dispatch.budgets import held_sources
from balancer.estimates.capacity import ModelCapacity, own_tokens_per_task
from balancer.snapshot import ReadServices
from balancer.storage.rows import Reads, reading
from balancer.views.eta import DrainState, Forecast, forecast

#: The drain ETA's pace is measured over the last minute of solves (or less: :func:`pace_window_s`).
PACE_WINDOW_S = 60.0


def pace_window_s(view: Mapping[str, ModelLive], now_ms: float) -> float:
    """The window the drain ETA's pace is measured over: the last PACE_WINDOW_S seconds,
    or only those since a learned limit last changed (lowered or raised, on any model).
    The pace is the work solved in the window over its bound at the limits in force
    now; work done while a limit was lower reads as slowness, and the ETA stretched
    all of the work left by it (learn.toml at 25 % done: a pace of 0.85 over the
    run's first 21 s of slow start and lowerings, the ETA 20 % long, while the run
    then went at its bound). A window under the pace's minimum means no correction.

    >>> from dataclasses import replace
    >>> from balancer.admission.learned import Learned
    >>> from balancer.admission.quota import Quota
    >>> live = ModelLive(Quota("m", 4, 60_000), in_flight=0, tokens_available=0, requests_available=None, deficit=0)
    >>> pace_window_s({"m": live}, now_ms=100_000), pace_window_s({"m": replace(live, learned=Learned(raised_at=85_000))}, 100_000)
    (60.0, 15.0)
    """
    changes = [max(live.learned.lowered_at, live.learned.raised_at) for live in view.values() if live.quota.learn]
    latest = max(changes, default=0)
    return PACE_WINDOW_S if latest <= 0 else max(0.0, min(PACE_WINDOW_S, (now_ms - latest) / 1000))


@dataclass(frozen=True)
class ModelSummary:
    name: str
    in_flight: int
    cap: int
    tokens_available: float
    burst: int
    tpm: int
    requests_available: float | None
    rpm: int | None
    solved: int  # calls answered since the start
    rate_limited: int  # 429s since the start
    p50_s: float
    p99_s: float
    latency_measured: bool  # False: the p50/p99 are the prior
    binding: str  # which limit holds the model back now: see binding_limit
    #: The effective limits (learned: balancer.admission.learned) where they differ
    #: from the quota's cap, tpm and rpm above, and why ('' when they do not).
    limit_cap: int = 0
    limit_tpm: int = 0
    limit_rpm: int | None = None
    learned: str = ""
    request_burst: int = 0  # the request bucket's size (0 without an RPM)
    window_cap: bool = False  # no 60 s window above the TPM (RPM): no burst on top (balancer.admission.window)
    #: What its token bucket holds when full: the burst less the tokens in transit (ModelLive.token_capacity).
    bucket: float = 0.0

    @property
    def tokens_allowed_per_60s(self) -> int:
        """The most tokens any 60 s window may carry: a full bucket (the burst) on top of a minute of TPM,
        or the TPM alone under a window cap."""
        return self.tpm if self.window_cap else self.tpm + self.burst

    def allowance_cells(self, tokens_per_min: float, requests_per_min: float, *, short: bool = False) -> tuple[str, str]:
        """A minute's tokens and requests against what the quota allows in 60 s: the rate plus the burst
        on top of it, named as such (a rate above the TPM alone is the burst, not a breach), or the rate
        alone, named "window cap", under a window cap; ``short``: in thousands and millions, the word
        burst left to the column's title (a window cap's says "cap").

        >>> row = ModelSummary("m", 1, 4, 0.0, 30_000, 30_000, None, 60, 0, 0, 1.0, 1.0, True, "none", request_burst=60)
        >>> row.allowance_cells(46_531, 12)
        ('46,531 / 30,000 + 30,000 burst', '12 / 60 + 60 burst')
        >>> row.allowance_cells(46_531, 12, short=True)
        ('46.5k / 30k+30k', '12 / 60+60')
        >>> from dataclasses import replace
        >>> capped = replace(row, window_cap=True)
        >>> capped.allowance_cells(29_000, 12), capped.allowance_cells(29_000, 12, short=True)
        (('29,000 / 30,000 window cap', '12 / 60 window cap'), ('29k / 30k cap', '12 / 60 cap'))
        """
        if self.window_cap:
            word = "cap" if short else "window cap"
            shown = _short if short else (lambda n: f"{n:,.0f}")
            return (f"{shown(tokens_per_min)} / {shown(self.tpm)} {word}",
                    f"{shown(requests_per_min)} / " + (f"{shown(self.rpm)} {word}" if self.rpm else "-"))
        if short:
            return (f"{_short(tokens_per_min)} / {_short(self.tpm)}+{_short(self.burst)}",
                    f"{_short(requests_per_min)} / " + (f"{_short(self.rpm)}+{_short(self.request_burst)}" if self.rpm else "-"))
        requests = f"{requests_per_min:,.0f} / " + (f"{self.rpm:,} + {self.request_burst:,} burst" if self.rpm else "-")
        return f"{tokens_per_min:,.0f} / {self.tpm:,} + {self.burst:,} burst", requests

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def learned_cell(self) -> str:
        """The limits in force against the quota's, and why, where the model learned
        them ('' where it did not).

        >>> row = ModelSummary("m", 1, 40, 0.0, 30_000, 300_000, None, None, 0, 0, 1.0, 1.0, True, "none",
        ...                    limit_cap=4, limit_tpm=300_000, learned="concurrency lowered by 429s at 12:03 UTC, recovering")
        >>> row.learned_cell()
        'cap 4/40, TPM 300,000/300,000, RPM -/-: concurrency lowered by 429s at 12:03 UTC, recovering'
        """
        if not self.learned:
            return ""
        return (f"cap {self.limit_cap}/{self.cap}, TPM {self.limit_tpm:,}/{self.tpm:,}, "
                f"RPM {self.limit_rpm or '-'}/{self.rpm or '-'}: {self.learned}")


def _short(n: float) -> str:
    """A count in few characters.

    >>> [_short(n) for n in (12, 999.6, 30_000, 46_531, 2_000_000, 1_250_000_000)]
    ['12', '1k', '30k', '46.5k', '2M', '1.25G']
    """
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if round(n) >= size:
            return f"{n / size:.3g}{unit}" if n / size < 100 else f"{n / size:.0f}{unit}"
    return f"{n:.0f}"


def binding_limit(live: ModelLive, tokens_per_call: float) -> str:
    """Which limit stops the model taking one more call now.

    ``paused`` (a 429's Retry-After), ``concurrency``, ``requests`` (RPM),
    ``tokens`` (TPM: fewer left than a typical call), or ``none`` (room for more).

    >>> from balancer.admission.quota import Quota
    >>> q = Quota("m", 4, 60_000, max_requests_per_minute=60)
    >>> binding_limit(ModelLive(q, 1, 100.0, 5.0, 0), tokens_per_call=500)
    'tokens'
    >>> binding_limit(ModelLive(q, 1, 9_000.0, 0.2, 0), tokens_per_call=500)
    'requests'
    >>> binding_limit(ModelLive(q, 1, 9_000.0, 5.0, 0), tokens_per_call=500)
    'none'
    """
    q = live.limits  # the effective limits: the quota's, or lower where the model learned so
    if live.paused_ms > 0:
        return "paused"
    if live.in_flight >= live.cap_now:  # slow start's cap while a new quota ramps
        return "concurrency"
    if q.max_requests_per_minute and (live.requests_available or 0) < 1:
        return "requests"
    if live.tokens_available < tokens_per_call:
        return "tokens"
    return "none"


def summarize(view: Mapping[str, ModelLive], counters: Mapping[str, Mapping[str, int]], *, prior_s: float,
              default_tokens: float = 500.0) -> list[ModelSummary]:
    """One row per model. A typical call's tokens are the model's measured mean
    (admitted tokens per answered call), else ``default_tokens``."""
    rows = []
    for name, live in sorted(view.items()):
        stats = counters.get(name, {})
        q = live.quota
        solved = stats.get("solved", 0)
        tokens_per_call = stats.get("tokens_estimated", 0) / solved if solved else default_tokens
        latency = live.latency_estimate(prior_s)
        rows.append(ModelSummary(
            name=name, in_flight=live.in_flight, cap=q.max_concurrent_requests,
            tokens_available=round(live.tokens_available, 1), burst=q.burst, tpm=q.max_tokens_per_minute,
            requests_available=None if live.requests_available is None else round(live.requests_available, 2),
            rpm=q.max_requests_per_minute, solved=solved, rate_limited=stats.get("rate_limited", 0),
            p50_s=round(latency.p50_ms / 1000, 2), p99_s=round(latency.p99_ms / 1000, 2),
            latency_measured=latency.samples > 0, binding=binding_limit(live, tokens_per_call),
            limit_cap=live.cap_now, limit_tpm=live.limits.max_tokens_per_minute,
            limit_rpm=live.limits.max_requests_per_minute, learned=live.limits_reason, request_burst=q.request_burst,
            window_cap=q.window_cap, bucket=round(live.token_capacity, 1),
        ))
    return rows


def drain_inputs(
    services: ReadServices, view: Mapping[str, ModelLive] | None = None, left: Backlog | None = None,
    held: Collection[str] | None = None, pace_s: float | None = None, stopped: Collection[str] = (),
) -> DrainState | None:
    """What the drain ETA is computed from, read now: the live effective limits, buckets and
    learned latencies, the backlog (``left``: the pending tasks' composition, the tasks not
    finished), the solves of the pace's window (``pace_s``, or :func:`pace_window_s`), and the
    pending tasks of the sources over their budget (``held``: read now as the dispatcher reads
    it, when not given). The models of the ETA are the enabled ones but the ``stopped`` ones
    (:attr:`balancer.health.reasons.Health.stopped_models`); None when there is none.
    PostgreSQL's reads share one connection."""
    view = services.core.live() if view is None else view
    view = {name: live for name, live in view.items() if live.quota.enabled and name not in stopped}
    pace_s = pace_window_s(view, time.time() * 1000) if pace_s is None else pace_s
    with reading(services.db) as db:
        return _drain_inputs(services, db, view, backlog(db) if left is None else left, held, pace_s)


def _drain_inputs(services: ReadServices, db: Reads, view: Mapping[str, ModelLive], left: Backlog,
                  held: Collection[str] | None, pace_s: float) -> DrainState | None:
    groups = left.pending_groups()
    prior_s = services.settings.expected_latency_s
    pending = sum(n for _, n, _ in groups)
    tokens_per_task = sum(t for _, _, t in groups) / pending if pending else services.settings.expected_output_tokens
    # Each model at its effective limits: where 429s or the provider's headers taught a
    # limit lower than the quota, the quota is not what the drain can use (learn.toml's
    # ETA read the quotas and was 39 to 72 % short at 25 % done).
    solved, window_s = recent_solves(db, pace_s)
    by_model = recent_solves_by_model(db, PACE_WINDOW_S)  # each model's own tokens: its last minute's tasks
    # Little's-law latency reads in flight x window_s / solved: solves of the same window.
    paced_by_model = by_model if pace_s >= PACE_WINDOW_S else recent_solves_by_model(db, window_s)
    no_solves = ModelSolves(0, 0)

    def own_tokens(live: ModelLive) -> float:
        # A settle provider counts what was used, known from the answers that reported it.
        answered = by_model.get(live.quota.name, no_solves)
        if live.quota.settles:
            return own_tokens_per_task(tokens_per_task, answered.reported, answered.used_tokens)
        return own_tokens_per_task(tokens_per_task, answered.tasks, answered.estimated_tokens)

    estimates = {name: live.latency_estimate(prior_s) for name, live in view.items()}  # enabled only: drain_inputs
    models = {
        name: ModelCapacity(
            concurrency=live.limits.max_concurrent_requests,
            mean_latency=max(0.001, estimates[name].mean_ms / 1000),
            tpm=live.limits.max_tokens_per_minute, burst=max(0.0, live.tokens_available),
            rpm=live.limits.max_requests_per_minute,
            # (below 0 while the start gate is booked ahead: those calls are in flight already, counted there)
            request_burst=None if live.requests_available is None else max(0.0, live.requests_available),
            tokens_per_task=own_tokens(live), latency_dispersion=estimates[name].dispersion,
        )
        for name, live in view.items()
    }
    if not models:
        return None
    on_prior = [name for name in models if not estimates[name].samples]
    running = running_calls(db) if on_prior else {}
    # Tasks on a ready list are no longer pending, nor in flight yet: their model's work
    # still to do. On a model not measured yet they count as work for any model: its
    # latency is only the prior (30 s), and if it is slow they outlive their TTL and
    # go back to pending (counted as its own, they put tail.toml's ETA 67 % out at 25 %).
    unmeasured_ready = sum(live.ready for live in view.values() if live.ready and not live.latency_known)
    return DrainState(
        models=models,
        groups=[(allowed, n) for allowed, n, _ in groups] + ([(None, unmeasured_ready)] if unmeasured_ready else []),
        ready={name: live.ready for name, live in view.items() if live.ready and live.latency_known},
        ready_ttl_s=services.settings.ready_ttl,
        start_buckets={name: (float(live.limits.burst), float(live.limits.request_burst)
                              if live.limits.max_requests_per_minute else None)
                       for name, live in view.items()} if window_s < pace_s else None,
        in_flight={name: live.in_flight for name, live in view.items()}, tokens_per_task=tokens_per_task,
        solved=solved, window_s=window_s,
        on_prior=on_prior,
        early_calls={name: (view[name].latency.samples, view[name].latency.latency_ms_sum / 1000, *running.get(name, (0, 0.0)))
                     for name in on_prior},
        unfinished=left.unfinished,
        solved_by_model={name: answered.tasks for name, answered in paced_by_model.items()},
        waiting=pending_groups_of(db, held_sources(services, db) if held is None else held),
    )


def estimate_drain(
    services: ReadServices, view: Mapping[str, ModelLive] | None = None, left: Backlog | None = None,
) -> float | None:
    """The drain ETA in seconds (:func:`balancer.views.eta.forecast`) now."""
    state = drain_inputs(services, view, left)
    return None if state is None else forecast(state).eta


def estimate_band(
    services: ReadServices, view: Mapping[str, ModelLive] | None = None, left: Backlog | None = None,
    held: Collection[str] | None = None, stopped: Collection[str] = (),
) -> Forecast | None:
    """The drain ETA with its band (low, high) now, on the models not ``stopped``; None when no model
    is enabled and running."""
    state = drain_inputs(services, view, left, held, stopped=stopped)
    return None if state is None else forecast(state)


def read(services: ReadServices, held: Collection[str] | None = None, left: Backlog | None = None,
         view: Mapping[str, ModelLive] | None = None, counters: dict[str, dict[str, int]] | None = None,
         stopped: Collection[str] = (),
         ) -> tuple[dict[str, int], list[ModelSummary], dict[str, dict[str, int]], Forecast | None]:
    """(task counts by status, the per-model rows, the raw per-model counters, the drain ETA and its band) now;
    ``held``, ``left``, ``view`` and ``counters``: the sources over their budget, the backlog, the live view and
    the counters, when the caller has read them; ``stopped``: the models the ETA leaves out (:func:`drain_inputs`)."""
    counters = services.core.counters()[0] if counters is None else counters
    view = services.core.live() if view is None else view
    rows = summarize(view, counters, prior_s=services.settings.expected_latency_s,
                     default_tokens=services.settings.expected_output_tokens)
    return status_counts(services.db), rows, counters, estimate_band(services, view, left, held, stopped)


def calls_after_the_end(counts: Mapping[str, int], rows: Collection[Any]) -> int:
    """Calls still in flight when no task is left unfinished: each belongs to a finished task.
    A hedge's loser on a model whose provider finishes a request after its client goes
    (``on_disconnect = "continue"``, the default) runs to its end, and holds its slot until then.

    >>> from types import SimpleNamespace as Row
    >>> calls_after_the_end({"pending": 0, "running": 0, "solved": 9}, [Row(in_flight=2), Row(in_flight=1)])
    3
    >>> calls_after_the_end({"pending": 0, "running": 1, "solved": 8}, [Row(in_flight=2)])   # one still running
    0
    """
    if any(counts.get(status, 0) for status in UNFINISHED):
        return 0
    return sum(r.in_flight for r in rows)


def after_the_end_text(calls: int) -> str:
    """What ``status``, ``top`` and the demo say of :func:`calls_after_the_end`.

    >>> after_the_end_text(2)
    "2 call(s) of finished tasks still run at the backend (a hedge's loser runs to its end; its slot frees then)"
    """
    return f"{calls} call(s) of finished tasks still run at the backend (a hedge's loser runs to its end; its slot frees then)"


def waits_on(allowed: Collection[str] | None, source: str, rows: Collection[ModelSummary],
             reasons: Mapping[str, str], held: Collection[str]) -> list[str]:
    """Why a pending task waits, one line per thing it waits on: its source's budget per day (``held``:
    the sources over it), then each model it may take (``allowed``; None: any), with its calls in flight
    against its cap, the limit that holds it back now and its health (``reasons``: by model).

    >>> from types import SimpleNamespace as Row
    >>> rows = [Row(name="a", in_flight=4, cap=4, binding="concurrency"), Row(name="b", in_flight=0, cap=2, binding="none")]
    >>> waits_on(("b", "gone"), "crm", rows, {"b": "no worker consumes model.b"}, {"crm"})
    ["its source crm's budget per day is spent", 'b: 0/2 in flight, binds now: none; no worker consumes model.b', 'gone: no quota']
    """
    by_name = {r.name: r for r in rows}
    lines = [f"its source {source}'s budget per day is spent"] if source in held else []
    for name in sorted(by_name) if allowed is None else allowed:
        r = by_name.get(name)
        if r is None:
            lines.append(f"{name}: no quota")
            continue
        why = f"; {reasons[name]}" if reasons.get(name) else ""
        lines.append(f"{name}: {r.in_flight}/{r.cap} in flight, binds now: {r.binding}{why}")
    return lines
