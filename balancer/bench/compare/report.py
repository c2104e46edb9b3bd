"""Benchmark report maths (pure): percentiles, refill gaps, usage series.

Everything here works on plain lists from the simulator's call log (dicts
with start, end, model, status, prompt_tokens, completion_tokens) and from
task rows, so it is tested without servers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from balancer.devtools.sim.audit import Limits
from balancer.estimates.stats import percentile as percentile  # the bench reports use it from here


def accepted(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls that ran: a 429 did not."""
    return [e for e in entries if e["status"] != 429]


def refill_gaps(entries: Iterable[dict[str, Any]], caps: dict[str, int], until: float | None = None) -> list[float]:
    """Seconds from a call ending at a *saturated* model to that model's next call
    arriving, both as the backend logged them.

    That is the pipeline's whole overhead as the provider sees it: its slot
    freed, then the next request on the wire. Only ends that found the model at
    its cap count, and (with ``until``, the moment the backlog ran out) only
    while tasks were pending, so idle time is not mistaken for overhead.

    >>> log = [dict(start=0, end=1, model="m", status=200), dict(start=0, end=2, model="m", status=200),
    ...        dict(start=1.01, end=3, model="m", status=200)]
    >>> [round(g, 3) for g in refill_gaps(log, {"m": 2})]
    [0.01]
    """
    by_model: dict[str, list[dict[str, Any]]] = {}
    for e in accepted(entries):
        by_model.setdefault(e["model"], []).append(e)
    gaps = []
    for model, calls in by_model.items():
        cap = caps.get(model)
        if cap is None:
            continue
        events = sorted([(c["start"], 1) for c in calls] + [(c["end"], -1) for c in calls], key=lambda x: (x[0], x[1]))
        starts = sorted(c["start"] for c in calls)
        level = 0
        cursor = 0
        for time, delta in events:
            if delta == -1 and level == cap and (until is None or time < until):
                while cursor < len(starts) and starts[cursor] < time:
                    cursor += 1
                if cursor < len(starts):
                    gaps.append(starts[cursor] - time)
            level += delta
    return gaps


def rolling_series(entries: Iterable[dict[str, Any]], model: str, *, t0: float, t1: float, window: float,
                   points: int = 200) -> dict[str, list[float]]:
    """Tokens and requests started in the trailing ``window``, and calls in flight, sampled over [t0, t1]."""
    calls = [e for e in accepted(entries) if e["model"] == model]
    times = [t0 + (t1 - t0) * i / (points - 1) for i in range(points)] if points > 1 else [t0]
    tokens, requests, in_flight = [], [], []
    for t in times:
        recent = [c for c in calls if t - window < c["start"] <= t]
        tokens.append(float(sum(c.get("counted", 0) for c in recent)))
        requests.append(float(len(recent)))
        in_flight.append(float(sum(1 for c in calls if c["start"] <= t < c["end"])))
    return {"t": [t - t0 for t in times], "tokens": tokens, "requests": requests, "in_flight": in_flight}


def estimate_accuracy(rows: Iterable[Any]) -> dict[str, dict[str, int]]:
    """Per model: tokens estimated at admission against tokens actually used."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        if row.model is None or row.prompt_tokens is None:
            continue
        m = out.setdefault(row.model, {"tasks": 0, "estimated": 0, "actual": 0})
        m["tasks"] += 1
        m["estimated"] += row.estimated_tokens
        m["actual"] += row.prompt_tokens + row.completion_tokens
    return out


def calls_by_model(entries: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Per model: calls the provider accepted, and 429s.

    >>> calls_by_model([{"model": "a", "status": 200}, {"model": "a", "status": 429}, {"model": "b", "status": 500}])
    {'a': {'calls': 1, 'rate_limited': 1}, 'b': {'calls': 1, 'rate_limited': 0}}
    """
    out: dict[str, dict[str, int]] = {}
    for e in entries:
        row = out.setdefault(e["model"], {"calls": 0, "rate_limited": 0})
        row["rate_limited" if e["status"] == 429 else "calls"] += 1
    return dict(sorted(out.items()))


def logged_latency_percentiles(entries: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per model, p50/p90/p99 of answered calls' latency (s) as the backend logged them:
    what the learned sketch is checked against.

    >>> logged_latency_percentiles([dict(model="m", status=200, start=0.0, end=float(i)) for i in range(1, 101)])["m"]["p90"]
    90.0
    """
    by_model: dict[str, list[float]] = {}
    for e in entries:
        if e["status"] == 200:
            by_model.setdefault(e["model"], []).append(e["end"] - e["start"])
    return {
        name: {f"p{q}": percentile(values, q) for q in (50, 90, 99)} for name, values in sorted(by_model.items())
    }


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (ties broken by order): does y grow with x at all?

    >>> rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]), rank_correlation([1, 2, 3, 4], [4, 3, 2, 1])
    (1.0, -1.0)
    """
    n = len(xs)
    if n < 3:
        return None

    def ranks(values: Sequence[float]) -> list[int]:
        out = [0] * n
        for rank, i in enumerate(sorted(range(n), key=lambda i: values[i])):
            out[i] = rank
        return out

    rx, ry = ranks(xs), ranks(ys)
    mean = (n - 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry, strict=True))
    var = sum((a - mean) ** 2 for a in rx)
    return round(cov / var, 3)


def size_dependence(entries: Iterable[Mapping[str, Any]]) -> dict[str, float | None]:
    """Per model, the rank correlation of an answered call's latency with its
    completion tokens: the check behind the latency sketch not conditioning on
    size (docs/endgame.md). Near 0: size does not predict latency here."""
    by_model: dict[str, tuple[list[float], list[float]]] = {}
    for e in entries:
        if e["status"] == 200 and e.get("completion_tokens") is not None:
            tokens, latency = by_model.setdefault(e["model"], ([], []))
            tokens.append(e["completion_tokens"])
            latency.append(e["end"] - e["start"])
    return {name: rank_correlation(t, lat) for name, (t, lat) in sorted(by_model.items())}


def eta_errors(etas: Iterable[tuple[float, float, float | None]], makespan: float) -> list[dict[str, Any]]:
    """How far each drain ETA made during the run was from the truth.

    ``finish_error``: the predicted finish (time of the ETA + the ETA) against
    the actual one, relative to the actual makespan (the issue's measure).
    ``remaining_error``: the ETA against the time that was actually left,
    relative to it (stricter: it grows as the end nears).

    >>> [(e["finish_error"], e["remaining_error"]) for e in eta_errors([(0.25, 10.0, 35.0), (0.5, 20.0, None)], 40.0)]
    [(0.125, 0.1667), (None, None)]
    """
    out = []
    for done, at, eta in etas:
        left = makespan - at
        row: dict[str, Any] = {"done": done, "at_s": round(at, 2), "eta_s": None if eta is None else round(eta, 2),
                               "finish_error": None, "remaining_error": None}
        if eta is not None:
            row["finish_error"] = round((at + eta - makespan) / makespan, 4)
            row["remaining_error"] = round((eta - left) / left, 4) if left > 0 else None
        out.append(row)
    return out


def polled_eta_errors(samples: Sequence[dict[str, Any]], makespan: float, total: int,
                      marks: Sequence[float] = (0.10, 0.25, 0.50, 0.75)) -> list[dict[str, Any]]:
    """The ETA polled through a run (``at_s``, ``done`` tasks, ``eta_s``, ``low_s``,
    ``high_s``), judged at each mark: the first poll with at least that share of
    the ``total`` tasks done, as :func:`eta_errors` judges it, plus whether the
    actual time left fell inside the ETA's band (``in_band``).

    >>> polls = [{"at_s": 5.0, "done": 10, "eta_s": 50.0, "low_s": 40.0, "high_s": 60.0},
    ...          {"at_s": 20.0, "done": 30, "eta_s": 30.0, "low_s": 25.0, "high_s": 35.0}]
    >>> [(r["done"], r["at_s"], r["finish_error"], r["in_band"]) for r in polled_eta_errors(polls, 60.0, 100, (0.1, 0.25, 0.9))]
    [(0.1, 5.0, -0.0833, True), (0.25, 20.0, -0.1667, False)]
    """
    out = []
    for mark in marks:
        poll = next((p for p in samples if p["done"] >= mark * total), None)
        if poll is None:
            continue
        row = eta_errors([(mark, poll["at_s"], poll["eta_s"])], makespan)[0]
        left = makespan - poll["at_s"]
        low, high = poll.get("low_s"), poll.get("high_s")
        row["low_s"], row["high_s"] = low, high
        row["in_band"] = None if low is None or high is None else low <= left <= high
        out.append(row)
    return out


def projection_error(samples: Sequence[dict[str, Any]], total: int, final_spend: float, mark: float = 0.25) -> dict[str, Any] | None:
    """The cost projection judged at ``mark`` done: spend so far then plus the
    projected cost of the backlog left then, against the run's final spend.

    >>> polls = [{"done": 10, "at_s": 3.0, "spent": 1.0, "projected": 9.0}, {"done": 30, "at_s": 9.0, "spent": 3.0, "projected": 8.0}]
    >>> projection_error(polls, 100, final_spend=10.0)
    {'done': 0.25, 'at_s': 9.0, 'spent': 3.0, 'projected': 8.0, 'final_spend': 10.0, 'error': 0.1}
    >>> projection_error(polls, 100, final_spend=0.0) is None
    True
    """
    poll = next((p for p in samples if p["done"] >= mark * total and p.get("projected") is not None), None)
    if poll is None or final_spend <= 0:
        return None
    predicted = poll["spent"] + poll["projected"]
    return {"done": mark, "at_s": poll["at_s"], "spent": round(poll["spent"], 6), "projected": round(poll["projected"], 6),
            "final_spend": round(final_spend, 6), "error": round((predicted - final_spend) / final_spend, 4)}


def hedge_figures(rows: Iterable[Any]) -> dict[str, Any]:
    """Hedges sent and won, and the tokens they were admitted with, against the run's.

    >>> from types import SimpleNamespace as Row
    >>> hedge_figures([Row(hedges=1, hedge_model="b", model="b", hedge_tokens=50, estimated_tokens=50),
    ...                Row(hedges=0, hedge_model=None, model="a", hedge_tokens=0, estimated_tokens=950)])
    {'sent': 1, 'won': 1, 'tokens': 50, 'token_share': 0.05}
    """
    sent = won = tokens = total = 0
    for r in rows:
        sent += r.hedges
        won += int(r.hedges > 0 and r.hedge_model == r.model)
        tokens += r.hedge_tokens
        total += r.estimated_tokens
    return {"sent": sent, "won": won, "tokens": tokens, "token_share": round(tokens / total, 4) if total else 0.0}


def calls_cut_off(entries: Iterable[Mapping[str, Any]]) -> int:
    """Calls whose client went before the answer (cancelled losers, or calls
    abandoned at the backend timeout), as far as the backend has logged them:
    one that runs on after the disconnect is logged only when it ends (or, still
    running when the run ends, as ``unfinished``).

    >>> calls_cut_off([{"client_gone": True}, {"client_gone": False}, {}])
    1
    """
    return sum(1 for e in entries if e.get("client_gone"))


def last_task_start(rows: Iterable[Any]) -> float | None:
    """When the backlog ran out: the last time a task's call started (epoch s).

    Hedges do not count: they start late by design, on tasks already running.

    >>> from datetime import datetime, timezone
    >>> from types import SimpleNamespace as Row
    >>> last_task_start([Row(started_at=datetime(2026, 1, 1, tzinfo=timezone.utc)), Row(started_at=None)])
    1767225600.0
    """
    starts = [r.started_at.timestamp() for r in rows if r.started_at is not None]
    return max(starts) if starts else None


def last_solved(rows: Iterable[Any], started: float, count: int = 5,
                calls_of: Callable[[Any], Iterable[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """The ``count`` tasks solved last, last first: what a run's tail was made of.

    Per task: the model that answered, whether and where it was hedged, and
    when (seconds since ``started``) its first call started and its answer
    was written. With ``calls_of`` (a row: the backend's log entries of its
    task's calls), also each call that ran (:func:`accepted`) in the order they
    started, as ``[model, start s, length s]``: which call set the end, and when
    its hedge went out (what the log misses: docs/scenarios.md, The report).

    >>> from datetime import datetime, timezone
    >>> from types import SimpleNamespace as Row
    >>> at = lambda s: datetime.fromtimestamp(s, timezone.utc)
    >>> rows = [Row(id=1, status="solved", model="mid", hedges=1, hedge_model="mid", started_at=at(10), solved_at=at(90)),
    ...         Row(id=2, status="solved", model="fast", hedges=0, hedge_model=None, started_at=at(5), solved_at=at(6))]
    >>> last_solved(rows, started=0.0, count=1)
    [{'task': 1, 'model': 'mid', 'hedges': 1, 'hedged_to': 'mid', 'started_s': 10.0, 'solved_s': 90.0}]
    >>> log = {1: [dict(model="mid", start=80.0, end=90.0, status=200), dict(model="slow", start=10.0, end=95.5, status=200)]}
    >>> last_solved(rows, started=0.0, count=1, calls_of=lambda r: log[r.id])[0]["calls"]
    [['slow', 10.0, 85.5], ['mid', 80.0, 10.0]]
    >>> log[1][1].update(status=0, unfinished=True)   # still running when the run was read
    >>> last_solved(rows, started=0.0, count=1, calls_of=lambda r: log[r.id])[0]["calls"][0]
    ['slow', 10.0, '85.50+']
    """
    solved = [r for r in rows if r.status == "solved" and r.solved_at is not None and r.started_at is not None]
    solved.sort(key=lambda r: r.solved_at, reverse=True)
    out: list[dict[str, Any]] = []
    for r in solved[:count]:
        task: dict[str, Any] = {
            "task": r.id, "model": r.model, "hedges": r.hedges, "hedged_to": r.hedge_model,
            "started_s": round(r.started_at.timestamp() - started, 2), "solved_s": round(r.solved_at.timestamp() - started, 2)}
        if calls_of is not None:
            calls = sorted(accepted(calls_of(r)), key=lambda e: e["start"])
            # A call still running when the run was read (a hedge's loser): its length so far, and "+".
            task["calls"] = [[e["model"], round(e["start"] - started, 2),
                              f"{e['end'] - e['start']:.2f}+" if e.get("unfinished") else round(e["end"] - e["start"], 2)]
                             for e in calls]
        out.append(task)
    return out


def backlog_out(entries: Iterable[dict[str, Any]]) -> float | None:
    """When the backlog ran out, as the backend saw it: the start of the last call.

    After it no task waits for a model: what remains is the tail, calls still running.

    >>> backlog_out([dict(start=1.0, end=9.0, model="m", status=200), dict(start=4.0, end=5.0, model="m", status=429)])
    4.0
    """
    starts = [e["start"] for e in entries]
    return max(starts) if starts else None


def limit_utilization(entries: Iterable[dict[str, Any]], limits: Mapping[str, Limits], t0: float, t1: float) -> dict[str, float]:
    """Per model, how much of what the provider allows it used in [t0, t1]:
    the largest of tokens counted / (burst + TPM·T), requests / (request burst
    + RPM·T) and mean calls in flight / cap. A model kept at its binding limit
    scores 1.0, whichever limit binds.

    >>> log = [dict(start=0.0, end=1.0, model="m", status=200, counted=50), dict(start=1.0, end=2.0, model="m", status=200, counted=50)]
    >>> limit_utilization(log, {"m": Limits(cap=1, tpm=6_000, rpm=None, burst=100)}, 0.0, 2.0)
    {'m': 1.0}
    """
    span = t1 - t0
    out: dict[str, float] = {}
    calls = accepted(entries)
    for model, lim in sorted(limits.items()):
        mine = [c for c in calls if c["model"] == model]
        started = [c for c in mine if t0 <= c["start"] <= t1]
        ratios = [sum(max(0.0, min(c["end"], t1) - max(c["start"], t0)) for c in mine) / span / lim.cap]
        if lim.tpm:
            ratios.append(sum(c.get("counted", 0) for c in started) / (lim.burst + lim.tpm / 60 * span))
        if lim.rpm:
            ratios.append(len(started) / ((lim.request_burst or lim.rpm) + lim.rpm / 60 * span))
        out[model] = round(max(ratios), 3)
    return out


def backend_usage(entries: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, int, int]]:
    """What the backend worked on, per model, as ``(source, model, prompt, completion)``
    usage rows (source ``backend``): every call it answered (200) or whose client went
    (499, with what it generated by then), answered first or not. A 429 or a 5xx
    did no work.

    >>> backend_usage([{"model": "a", "status": 200, "prompt_tokens": 10, "completion_tokens": 4},
    ...                {"model": "a", "status": 499, "prompt_tokens": 10, "completion_tokens": 1},
    ...                {"model": "a", "status": 500, "prompt_tokens": 10, "completion_tokens": 0}])
    [('backend', 'a', 20, 5)]
    """
    out: dict[str, tuple[int, int]] = {}
    for e in entries:
        if e["status"] in (200, 499):
            prompt, completion = out.get(e["model"], (0, 0))
            out[e["model"]] = (prompt + e["prompt_tokens"], completion + e["completion_tokens"])
    return [("backend", model, prompt, completion) for model, (prompt, completion) in sorted(out.items())]


def answered_usage(rows: Iterable[Any]) -> list[tuple[str, str, int, int]]:
    """The tokens of each solved task's answering call alone (what spend counted before the ledger).

    >>> from types import SimpleNamespace as Row
    >>> answered_usage([Row(status="solved", source="s", model="a", prompt_tokens=3, completion_tokens=2),
    ...                 Row(status="failed", source="s", model="a", prompt_tokens=None, completion_tokens=None)])
    [('s', 'a', 3, 2)]
    """
    return [(r.source, r.model, r.prompt_tokens or 0, r.completion_tokens or 0) for r in rows
            if r.status == "solved" and r.model is not None]
