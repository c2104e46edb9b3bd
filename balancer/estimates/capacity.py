"""The capacity bound: the smallest makespan any scheduler could reach (pure).

Each model m can complete at most, by time T (scenario seconds)::

    cap_m(T) = min( C_m · T / E[L_m],                 # concurrency: C calls, each E[L] long
                    RPM_m · T / 60 + R_m,             # requests: refill + the request burst
                    (TPM_m · T / 60 + B_m) / E[t_m] ) # tokens: refill + burst, E[t_m] per task

tasks, where E[t_m] is what model m's provider counts per task: prompt +
max_tokens for ``reserve`` accounting (the reservation is kept), the expected
prompt + completion for ``settle``. R_m is the request burst (one minute of
RPM unless the provider checks a shorter window). Tasks
pinned to one model must fit in that model's own capacity; the rest can go
anywhere. The bound is the least T with

    pinned_m <= cap_m(T)  for every m,   and   Σ_m cap_m(T) >= N.

That is the feasibility condition of the transportation LP
(x_{g,m} >= 0, Σ_m x_{g,m} = N_g, Σ_g x_{g,m} <= cap_m(T)) when every group
is either "any model" or "exactly one model", so no LP solver is needed. cap_m
is increasing in T, so bisection finds the least T. It is a fluid bound: it
ignores that the last call still takes its full latency, so real schedules sit
above it, which is why utilization = bound / makespan is at most 1.

>>> m = ModelCapacity(concurrency=10, mean_latency=2.0, tpm=None, burst=0, rpm=None)
>>> round(makespan_bound([m], tokens_per_task=100, any_model=100, pinned={}), 3)   # 10 calls / 2 s = 5 tasks/s
20.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def throughput(slots: float, mean_latency: float, token_rate: float = math.inf, tokens_per_task: float = 1.0,
               request_rate: float = math.inf) -> float:
    """A model's steady-state tasks per unit of time at its binding limit:
    min(slots / mean latency, token rate / tokens per task, request rate), the
    rates in the latency's unit of time (math.inf: no such limit); 0 if it takes nothing.

    >>> throughput(4, 2.0, token_rate=1_000, tokens_per_task=2_000)   # tokens bind: 0.5 a second
    0.5
    >>> throughput(4, 2.0, request_rate=5.0)                          # slots bind: 4 calls of 2 s
    2.0
    """
    if slots <= 0 or mean_latency <= 0:
        return 0.0
    return min(slots / mean_latency, token_rate / max(1.0, tokens_per_task), request_rate)



#: A model's own tokens per task (:func:`own_tokens_per_task`): the backlog's mean weighs as this many tasks.
OWN_TOKENS_PRIOR = 10


def own_tokens_per_task(backlog_mean: float, tasks: int, tokens: int) -> float:
    """What a model's provider counts per task, from the ``tasks`` it answered lately
    and their ``tokens`` (estimated for ``reserve`` accounting, used for ``settle``),
    beside the backlog's mean, which weighs as OWN_TOKENS_PRIOR tasks. A token-bound
    model is not sent the backlog's mean: its bucket admits a small task sooner, so it
    takes the small ones (learn.toml's two TPM-bound models answered 383 and 395 tokens
    a task against the backlog's 536, and read at the mean the drain ETA had them 27 %
    slower than they ran).

    >>> own_tokens_per_task(536.0, 0, 0)
    536.0
    >>> round(own_tokens_per_task(536.0, 30, 11_490), 1)   # (10 x 536 + 11,490) / 40
    421.2
    """
    return (OWN_TOKENS_PRIOR * backlog_mean + tokens) / (OWN_TOKENS_PRIOR + tasks)


@dataclass(frozen=True)
class ModelCapacity:
    concurrency: int
    mean_latency: float  # seconds
    tpm: float | None  # tokens per minute (None: unlimited)
    burst: float  # tokens available at t = 0
    rpm: float | None = None
    request_burst: float | None = None  # requests available at t = 0 (None: one minute of RPM)
    tokens_per_task: float | None = None  # what this provider counts per task (None: the workload's figure)
    latency_dispersion: float = 1.0  # E[L²]/E[L]² of its latencies: 1 for a fixed latency

    def tasks_by(self, t: float, tokens_per_task: float) -> float:
        limits = [self.concurrency * t / self.mean_latency]
        if self.rpm:
            limits.append(self.rpm * t / 60 + (self.request_burst if self.request_burst is not None else self.rpm))
        if self.tpm:
            limits.append((self.tpm * t / 60 + self.burst) / (self.tokens_per_task or tokens_per_task))
        return min(limits)

    def rate(self, tokens_per_task: float) -> float:
        """Steady-state tasks per second: min(C/E[L], RPM/60, TPM/(60·E[t])).

        >>> ModelCapacity(4, 2.0, tpm=60_000, burst=0, tokens_per_task=2_000).rate(500)   # reserve: 2,000 a task
        0.5
        """
        return throughput(self.concurrency, self.mean_latency, self.tpm / 60 if self.tpm else math.inf,
                          self.tokens_per_task or tokens_per_task, self.rpm / 60 if self.rpm else math.inf)


def rate_bound(model: ModelCapacity, tokens_per_task: float) -> bool:
    """True if the model's token or request rate, not its slots over its latency, sets its
    throughput: its calls in flight then include calls waiting at the start gates, so Little's
    law reads their wait as latency, and its latency does not set its rate anyway.

    >>> rate_bound(ModelCapacity(40, 2.5, tpm=30_000, burst=0), 400), rate_bound(ModelCapacity(4, 2.5, None, 0), 400)
    (True, False)
    """
    return model.rate(tokens_per_task) < model.concurrency / model.mean_latency


def feasible(models: Sequence[ModelCapacity], t: float, tokens_per_task: float, any_model: int, pinned: Mapping[int, float],
             lost_at: Mapping[int, float] | None = None) -> bool:
    caps = [m.tasks_by(min(t, (lost_at or {}).get(i, t)), tokens_per_task) for i, m in enumerate(models)]
    if any(pinned.get(i, 0) > caps[i] + 1e-9 for i in range(len(models))):
        return False
    return sum(caps) + 1e-9 >= any_model + sum(pinned.values())


def makespan_bound(
    models: Sequence[ModelCapacity], *, tokens_per_task: float, any_model: int, pinned: Mapping[int, float],
    lost_at: Mapping[int, float] | None = None,
) -> float:
    """Least T (seconds) at which all tasks could be done; see the module docstring.

    ``lost_at``: models (by index) that take no work from that time on, a worker host cut off or a
    provider down for the rest of the run; what they complete before it counts. A cut host's share
    of the capacity sets how much longer than the same work without the cut any schedule takes:

    >>> a, b = (ModelCapacity(concurrency=c, mean_latency=1.0, tpm=None, burst=0) for c in (10, 5))
    >>> [round(makespan_bound([a, b], tokens_per_task=1, any_model=300, pinned={}, lost_at=lost), 1)
    ...  for lost in (None, {0: 2.0}, {0: 0.0})]                  # 15 a second; 30 by 2 s, then 5; 5
    [20.0, 56.0, 60.0]
    """
    low, high = 0.0, 1.0
    while not feasible(models, high, tokens_per_task, any_model, pinned, lost_at):
        high *= 2
        if high > 1e12:
            raise ValueError("no finite makespan: some pinned tasks have no capacity")
    for _ in range(100):
        mid = (low + high) / 2
        if feasible(models, mid, tokens_per_task, any_model, pinned, lost_at):
            high = mid
        else:
            low = mid
    return high


def pinned_work_floor(pinned_latencies: Mapping[str, Sequence[float]], concurrency: Mapping[str, int]) -> float:
    """A lower bound on the makespan from the work pinned to each model, for one
    *realized* workload (latencies known, as the simulator makes them).

    Model m must run every task pinned to it on its C_m slots, so it is busy
    for at least ``sum(latencies) / C_m``, and at least as long as its longest
    task. Unlike :func:`makespan_bound`, which uses *expected* latencies, this
    holds for the actual draw, so it shows how much of a gap to the fluid bound
    no scheduler could close.

    >>> pinned_work_floor({"slow": [30, 10, 20, 40]}, {"slow": 2})
    50.0
    >>> pinned_work_floor({"slow": [90, 10]}, {"slow": 4})
    90.0
    """
    floor = 0.0
    for name, latencies in pinned_latencies.items():
        if latencies:
            floor = max(floor, sum(latencies) / concurrency[name], max(latencies))
    return float(floor)
