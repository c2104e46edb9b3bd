"""The chaos run's fault schedule: drawn from a seed, printed, replayable (pure).

Every fault has a start (seconds after the run's clock starts) and a duration:
how long the process stays dead before its supervisor restarts it, how long
Redis stays down, PostgreSQL stalls, the backend is out or answers 500s, a
quota stays lowered or removed. Faults overlap freely. The same seed, window
and models give the same schedule.

>>> plan = draw_schedule(seed=7, window_s=600, models=["a", "b"])
>>> len(plan) >= 40 and plan == draw_schedule(seed=7, window_s=600, models=["a", "b"])
True
>>> sorted({f.kind for f in plan}) == sorted(KINDS)
True
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: kind: (weight when drawing beyond one of each, shortest and longest duration in s)
KINDS: dict[str, tuple[float, float, float]] = {
    "kill_worker": (4.0, 0.5, 15.0),  # duration: until the supervisor restarts it
    "kill_dispatcher": (2.0, 0.5, 15.0),
    "kill_beat": (1.5, 0.5, 15.0),
    "redis_restart": (1.0, 0.5, 5.0),  # killed, restarted empty this long after
    "redis_drop": (2.0, 0.0, 0.0),  # CLIENT KILL of every client connection
    "pg_stall": (1.5, 5.0, 60.0),  # the workers' PostgreSQL proxy stops forwarding
    "backend_outage": (1.0, 5.0, 120.0),  # every call answered 503
    "backend_500": (1.5, 5.0, 60.0),  # one model answers 500
    "quota_lower": (2.0, 10.0, 90.0),  # `quota set` to a share of the limits, then back
    "quota_remove": (1.0, 5.0, 30.0),  # `quota remove --force`, then `quota set --create`
    "inbox_file": (1.5, 0.0, 0.0),  # a task file dropped into the inbox
}

#: Faults per minute of window, and at least this many in all.
FAULTS_PER_MINUTE = 4.5
MIN_FAULTS = 6


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    duration: float
    model: str | None = None  # kill_worker, backend_500, quota_lower, quota_remove
    share: float = 1.0  # quota_lower: the share of concurrency and TPM kept
    lines: int = 0  # inbox_file: task lines in the file

    @property
    def end(self) -> float:
        return self.at + self.duration

    def describe(self) -> str:
        what = {
            "kill_worker": f"kill -9 worker-{self.model}, restarted after {self.duration:.1f} s",
            "kill_dispatcher": f"kill -9 the dispatcher, restarted after {self.duration:.1f} s",
            "kill_beat": f"kill -9 beat, restarted after {self.duration:.1f} s",
            "redis_restart": f"kill -9 Redis, restarted empty after {self.duration:.1f} s",
            "redis_drop": "CLIENT KILL every Redis client connection",
            "pg_stall": f"the workers' PostgreSQL stalls {self.duration:.1f} s (sockets open)",
            "backend_outage": f"backend outage (503) for {self.duration:.1f} s",
            "backend_500": f"{self.model} answers 500 for {self.duration:.1f} s",
            "quota_lower": f"quota set {self.model} to {self.share:.0%} of its limits for {self.duration:.1f} s",
            "quota_remove": f"quota remove --force {self.model}, re-created after {self.duration:.1f} s",
            "inbox_file": f"an inbox file of {self.lines} tasks",
        }[self.kind]
        return f"+{self.at:7.1f}s  {what}"


def draw_schedule(seed: int, window_s: float, models: list[str]) -> list[Fault]:
    """Faults starting in the first 85% of ``window_s``; every kind at least once when there is room.

    Durations are capped at a third of the window, so a short CI run still heals
    before its drain."""
    rng = random.Random(seed)
    count = max(MIN_FAULTS, round(FAULTS_PER_MINUTE * window_s / 60))
    kinds = list(KINDS)
    rng.shuffle(kinds)
    chosen = kinds[:count]
    names, weights = list(KINDS), [KINDS[k][0] for k in KINDS]
    chosen += rng.choices(names, weights, k=count - len(chosen))
    cap = window_s / 3
    faults = []
    for kind in chosen:
        _, low, high = KINDS[kind]
        duration = round(rng.uniform(low, min(high, max(low, cap))), 1)
        at = round(rng.uniform(0.05, 0.85) * window_s, 1)
        model = rng.choice(models) if kind in ("kill_worker", "backend_500", "quota_lower", "quota_remove") else None
        share = round(rng.uniform(0.25, 0.75), 2) if kind == "quota_lower" else 1.0
        lines = rng.randint(20, 200) if kind == "inbox_file" else 0
        faults.append(Fault(at, kind, duration, model, share, lines))
    return sorted(faults, key=lambda f: (f.at, f.kind))


def kind_counts(faults: list[Fault]) -> dict[str, int]:
    out: dict[str, int] = {}
    for fault in faults:
        out[fault.kind] = out.get(fault.kind, 0) + 1
    return out
