"""Benchmark report maths (pure): percentiles, refill gaps, usage series.

Everything here works on plain lists from the simulator's call log (dicts
with start, end, model, status, prompt_tokens, completion_tokens) and from
task rows, so it is tested without servers.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile, q in [0, 100].

    >>> percentile([1, 2, 3, 4], 50), percentile([1, 2, 3, 4], 99), percentile([], 50)
    (2, 4, None)
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def accepted(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in entries if e["status"] != 429]


def refill_gaps(entries: Iterable[dict[str, Any]], caps: dict[str, int]) -> list[float]:
    """Seconds from a call ending at a *saturated* model to that model's next call starting.

    That is the dispatcher's overhead as the backend sees it: a slot freed,
    then the next request sent. Only ends that found the model at its cap
    count, so idle time (no backlog) is not mistaken for overhead.

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
            if delta == -1 and level == cap:
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
        tokens.append(float(sum(c.get("prompt_tokens", 0) + c.get("completion_tokens", 0) for c in recent)))
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
