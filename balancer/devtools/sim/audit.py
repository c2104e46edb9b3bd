"""Check a provider call log against limits, independently of any limiter.

For every model: the number of calls in progress at every instant, and the
tokens (and requests) started in *every* interval [a, b] against
``burst + rate·(b − a) + rate·grace``, which is the rule the simulated
provider enforces. The interval check is exact and O(n): with prefix sums P,
an interval i..j breaks the rule iff ``(P_j − r·t_j) − (P_{i−1} − r·t_i) > C``,
so a running minimum of ``P_{i−1} − r·t_i`` finds the worst interval.

>>> calls = [Call(0.0, 1.0, "m", 60), Call(0.5, 2.0, "m", 60)]
>>> audit(calls, {"m": Limits(cap=1, tpm=60, rpm=None, burst=100)})[0].kind
'concurrency'
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from balancer.admission.quota import Quota


@dataclass(frozen=True)
class Call:
    start: float  # seconds
    end: float
    model: str
    tokens: int  # what the provider counted against TPM: the reservation, or the usage if it settles


def calls_from_log(entries: Iterable[Mapping]) -> list[Call]:
    """The calls the provider accepted (429s excluded), from the simulator's log."""
    return [Call(e["start"], e["end"], e["model"], e.get("counted", 0)) for e in entries if e["status"] != 429]


@dataclass(frozen=True)
class Limits:
    cap: int
    tpm: float  # per real minute
    rpm: float | None
    burst: float
    grace: float = 0.0
    request_burst: float | None = None  # None: one minute of RPM


def limits_for(quotas: Iterable[Quota], grace: float = 0.0) -> dict[str, Limits]:
    """The audit's limits for these quotas, by model name."""
    return {
        q.name: Limits(q.max_concurrent_requests, q.max_tokens_per_minute, q.max_requests_per_minute, q.burst, grace,
                       q.request_burst or None)
        for q in quotas
    }


@dataclass(frozen=True)
class Violation:
    model: str
    kind: str  # concurrency | tokens | requests
    at: float
    amount: float
    limit: float

    def __str__(self) -> str:
        return f"{self.model}: {self.kind} {self.amount:.0f} > {self.limit:.0f} at t={self.at:.3f}"


@dataclass(frozen=True)
class Peaks:
    in_flight: int
    tokens_per_60s: int
    requests_per_60s: int


def peak_concurrency(calls: Iterable[Call]) -> tuple[int, float]:
    events = sorted([(c.start, 1) for c in calls] + [(c.end, -1) for c in calls], key=lambda e: (e[0], e[1]))
    level = peak = 0
    at = 0.0
    for time, delta in events:
        level += delta
        if level > peak:
            peak, at = level, time
    return peak, at


def worst_interval(starts: list[tuple[float, float]], rate_per_s: float) -> tuple[float, float]:
    """max over intervals i..j of amount(i..j) − rate·(t_j − t_i), and where it ends."""
    worst, at = float("-inf"), 0.0
    prefix = 0.0
    best_min = float("inf")
    for time, amount in starts:
        best_min = min(best_min, prefix - rate_per_s * time)
        prefix += amount
        excess = prefix - rate_per_s * time - best_min
        if excess > worst:
            worst, at = excess, time
    return worst, at


def peak_in_window(starts: list[tuple[float, float]], window: float) -> float:
    total = peak = 0.0
    queue: deque[tuple[float, float]] = deque()
    for time, amount in starts:
        queue.append((time, amount))
        total += amount
        while queue[0][0] <= time - window:
            total -= queue.popleft()[1]
        peak = max(peak, total)
    return peak


def audit(calls: Iterable[Call], limits: Mapping[str, Limits]) -> list[Violation]:
    """Every limit breach in the log (empty when the limits held)."""
    by_model: dict[str, list[Call]] = {}
    for call in calls:
        by_model.setdefault(call.model, []).append(call)
    violations = []
    for model, model_calls in sorted(by_model.items()):
        lim = limits.get(model)
        if lim is None:
            continue
        peak, at = peak_concurrency(model_calls)
        if peak > lim.cap:
            violations.append(Violation(model, "concurrency", at, peak, lim.cap))
        starts = sorted((c.start, float(c.tokens)) for c in model_calls)
        rate = lim.tpm / 60
        excess, at = worst_interval(starts, rate)
        allowed = lim.burst + rate * lim.grace
        if excess > allowed + 1e-6:
            violations.append(Violation(model, "tokens", at, excess, allowed))
        if lim.rpm:
            rrate = lim.rpm / 60
            excess, at = worst_interval([(t, 1.0) for t, _ in starts], rrate)
            allowed = (lim.request_burst or lim.rpm) + rrate * lim.grace
            if excess > allowed + 1e-6:
                violations.append(Violation(model, "requests", at, excess, allowed))
    return violations


def peaks(calls: Iterable[Call], window: float = 60.0) -> dict[str, Peaks]:
    by_model: dict[str, list[Call]] = {}
    for call in calls:
        by_model.setdefault(call.model, []).append(call)
    out = {}
    for model, model_calls in by_model.items():
        starts = sorted((c.start, float(c.tokens)) for c in model_calls)
        out[model] = Peaks(
            in_flight=peak_concurrency(model_calls)[0],
            tokens_per_60s=int(peak_in_window(starts, window)),
            requests_per_60s=int(peak_in_window([(t, 1.0) for t, _ in starts], window)),
        )
    return out
