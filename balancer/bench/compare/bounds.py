"""What a bench scenario's providers allow: their real limits, the capacity bound
(:mod:`balancer.estimates.capacity`) for its generated workload, and the pinned-work floor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from balancer.devtools.scenario import Scenario
from balancer.devtools.sim.audit import Limits, limits_for
from balancer.devtools.sim.config import SimModel
from balancer.estimates.capacity import ModelCapacity, makespan_bound, pinned_work_floor

GRACE = 0.0  # the simulator is as strict as the providers: no refill above the buckets


def capacity_bound(scenario: Scenario) -> float:
    """The bound in real seconds for this scenario's generated workload."""
    return lines_bound(scenario.models, scenario.task_lines(), seed=scenario.seed, time_scale=scenario.time_scale)


def lines_bound(models: Sequence[SimModel], lines: Sequence[Mapping[str, Any]], *, seed: int, time_scale: float,
                lost_at_s: Mapping[str, float] | None = None) -> float:
    """The bound in real seconds for these task lines (``prompt``, ``max_tokens``, ``model``
    if pinned) on these simulated models; ``lost_at_s``: models that take nothing from that
    real second of the run on (a worker host cut off for the rest of it)."""
    # What a provider counts per task: the expected usage if it settles (the
    # simulator answers with 30-100 % of max_tokens, 65 % on average), the
    # reservation prompt + max_tokens if it reserves.
    mean_tokens = sum(len(x["prompt"]) / 4 + 0.65 * x["max_tokens"] for x in lines) / len(lines)
    mean_reserved = sum(len(x["prompt"]) / 4 + x["max_tokens"] for x in lines) / len(lines)
    names = [m.name for m in models]
    pinned: dict[int, int] = {}
    for line in lines:
        if "model" in line:
            i = names.index(line["model"])
            pinned[i] = pinned.get(i, 0) + 1
    any_model = len(lines) - sum(pinned.values())
    capacities = [
        ModelCapacity(
            concurrency=real.max_concurrent_requests,
            mean_latency=m.latency.mean(seed=seed),
            # another client's share is not ours; real_* shares: what the provider really allows
            tpm=m.max_tokens_per_minute * m.real_tokens * (1 - m.foreign_share),
            burst=real.burst,
            rpm=None if m.max_requests_per_minute is None
            else m.max_requests_per_minute * m.real_requests * (1 - m.foreign_share),
            request_burst=real.burst_requests,
            tokens_per_task=mean_tokens if m.accounting == "settle" else mean_reserved,
        )
        for m, real in zip(models, (m.real_quota() for m in models), strict=True)
    ]
    lost = {names.index(name): at / time_scale for name, at in (lost_at_s or {}).items()}
    return makespan_bound(capacities, tokens_per_task=mean_tokens, any_model=any_model, pinned=pinned,
                          lost_at=lost) * time_scale


def pinned_floor(scenario: Scenario) -> float:
    """The realized pinned-work floor (balancer/estimates/capacity.py) for this scenario's
    workload, with the latencies the simulator will draw for it."""
    from balancer.devtools.sim.provider import Simulator

    sim = Simulator(list(scenario.models), time_scale=scenario.time_scale, seed=scenario.seed)
    latencies: dict[str, list[float]] = {}
    for line in scenario.task_lines():
        if "model" in line:
            latency, _ = sim.draw(line["model"], line["prompt"], line["max_tokens"])
            latencies.setdefault(line["model"], []).append(latency)
    return pinned_work_floor(latencies, {m.name: m.max_concurrent_requests for m in scenario.models})


def limits(scenario: Scenario) -> dict[str, Limits]:
    """The providers' real limits (the audit and the utilization are measured against them)."""
    return limits_for(scenario.real_quotas(), GRACE)

