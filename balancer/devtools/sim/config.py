"""Simulated models: provider limits, how the provider counts, latency, errors.

The defaults are the strictest provider behaviour the project knows of
(docs/admission.md, "How providers count"): tokens are *reserved*
(prompt + max_tokens, never refunded, as OpenAI and Azure OpenAI do), no grace
above the bucket, and rate-limit headers on every reply.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from balancer.admission.quota import Quota
from balancer.devtools.sim.limiter import ModelLimiter

#: z-score of the 99th percentile of a standard normal.
Z99 = 2.3263


@dataclass(frozen=True)
class Latency:
    """Lognormal with the given median and p99 (seconds), clipped to [low, high]."""

    median: float = 8.0
    p99: float = 90.0
    low: float = 1.0
    high: float = 120.0

    def sample(self, rng: random.Random) -> float:
        sigma = math.log(self.p99 / self.median) / Z99 if self.p99 > self.median else 0.0
        return min(self.high, max(self.low, self.median * math.exp(sigma * rng.gauss(0.0, 1.0))))

    def mean(self, samples: int = 20_000, seed: int = 0) -> float:
        """E[L] of the clipped distribution (Monte Carlo; used by the capacity bound)."""
        rng = random.Random(seed)
        return sum(self.sample(rng) for _ in range(samples)) / samples


@dataclass(frozen=True)
class SimModel:
    name: str
    max_concurrent_requests: int
    max_tokens_per_minute: int
    max_requests_per_minute: int | None = None
    burst_tokens: int | None = None
    latency: Latency = Latency()
    error_rate: float = 0.0
    weight: int = 1
    #: "reserve": prompt + max_tokens charged on arrival, never refunded (OpenAI, Azure);
    #: "settle": the unused part credited back when the call ends (Anthropic, self-hosted).
    accounting: str = "reserve"
    #: Seconds over which RPM is checked: 60, 10 or 1 (Azure checks over 1 s or 10 s).
    #: The request bucket then holds one window's share, RPM x window / 60.
    rpm_window: float = 60.0
    #: Send x-ratelimit-remaining-tokens / -requests (and limits) with every reply.
    headers: bool = True
    #: Share of TPM and RPM consumed by another client of the same provider quota.
    foreign_share: float = 0.0
    #: What the provider does with a call whose client disconnected: "continue" (the
    #: default, strict: it runs to its end, holding its slot and charged in full, as
    #: providers do with non-streamed requests) or "stop" (the slot is free at once;
    #: the prompt and the tokens generated so far are charged).
    on_disconnect: str = "continue"
    #: What the provider really allows, as a share of the limits above (which are
    #: the quota balancer is given): tokens (TPM and the token burst), requests
    #: (RPM and the request burst), concurrency. 1.0: exactly the quota.
    real_tokens: float = 1.0
    real_requests: float = 1.0
    real_concurrency: float = 1.0
    #: Mid-run changes: (seconds after the model's first call, factor); from then on
    #: the real limits are the shares above times factor (0.5: cut to half; 1.0: restored).
    limit_changes: tuple[tuple[float, float], ...] = ()
    #: With ``headers``, also send x-ratelimit-limit-tokens / -requests (False: only the remaining counts).
    limit_headers: bool = True
    #: When the remaining counts sent with a reply are taken: "admission" (the default, strict:
    #: as the provider's limiter, or a proxy's, admitted the call, so a count is as old as the
    #: call's latency when it arrives) or "response" (as the call ends).
    headers_at: str = "admission"

    def provider_limits(self, factor: float = 1.0, time_scale: float = 1.0) -> dict[str, float | None]:
        """The provider's real limits at ``factor`` (rates in real-time per minute):
        cap, tpm, rpm, burst and request_burst, as :class:`ModelLimiter` takes them."""
        rpm, rburst = self.max_requests_per_minute, self.request_burst
        return {
            "cap": max(1, round(self.max_concurrent_requests * self.real_concurrency * factor)),
            "tpm": self.max_tokens_per_minute * self.real_tokens * factor / time_scale,
            "rpm": None if rpm is None else rpm * self.real_requests * factor / time_scale,
            "burst": max(1.0, self.burst * self.real_tokens * factor),
            "request_burst": None if rburst is None else max(1, int(rburst * self.real_requests * factor)),
        }

    def limiter(self, *, time_scale: float, grace: float, now: float) -> ModelLimiter:
        """The provider's limiter for this model: its real limits now, and its mid-run changes."""
        first = self.provider_limits(1.0, time_scale)
        return ModelLimiter(cap=int(first["cap"] or 1), tpm=float(first["tpm"] or 0), rpm=first["rpm"],
                            burst=float(first["burst"] or 0), now=now, grace=grace,
                            request_burst=first["request_burst"], settle=self.accounting == "settle",
                            schedule=[(at, self.provider_limits(f, time_scale)) for at, f in sorted(self.limit_changes)])

    def real_quota(self, *, time_scale: float = 1.0) -> Quota:
        """What the provider really allows at the start, as a quota (the benchmark's
        audit and utilization are measured against it; mid-run changes aside)."""
        quota = self.quota(time_scale=time_scale)
        real = self.provider_limits(1.0, time_scale)
        rpm = quota.max_requests_per_minute
        return quota.replace(
            max_concurrent_requests=int(real["cap"] or 1), max_tokens_per_minute=max(1, round(real["tpm"] or 1)),
            burst_tokens=max(1, int(real["burst"] or 1)),
            max_requests_per_minute=None if rpm is None else max(1, round(real["rpm"] or 1)),
            burst_requests=None if rpm is None else int(real["request_burst"] or 1),
        )

    @property
    def burst(self) -> int:
        return self.burst_tokens or self.max_tokens_per_minute

    @property
    def request_burst(self) -> int | None:
        """The provider's request bucket: one RPM window's share (at least one request)."""
        if self.max_requests_per_minute is None:
            return None
        return max(1, int(self.max_requests_per_minute * self.rpm_window // 60))

    def quota(self, *, time_scale: float = 1.0) -> Quota:
        """The balancer quota that matches this provider model.

        Per-minute limits are in *scenario* minutes; with ``time_scale`` s a
        scenario minute lasts 60·s real seconds, so real-time rates are
        divided by s.
        """
        return Quota(
            name=self.name,
            max_concurrent_requests=self.max_concurrent_requests,
            max_tokens_per_minute=max(1, round(self.max_tokens_per_minute / time_scale)),
            max_requests_per_minute=None
            if self.max_requests_per_minute is None
            else max(1, round(self.max_requests_per_minute / time_scale)),
            burst_tokens=self.burst,
            weight=self.weight,
            token_accounting=self.accounting,
            # Bucket sizes are in scenario units at every time scale, as burst_tokens is.
            burst_requests=self.request_burst,
            on_disconnect=self.on_disconnect,
        )


def default_models(count: int = 10) -> list[SimModel]:
    """Ten models with mixed limits: some concurrency-bound, some TPM-bound."""
    # Demand at full concurrency is cap / E[latency] calls/s of ~800 tokens each
    # (demo prompts), so the TPM-bound ones are those whose TPM is below that.
    shapes = [
        # cap, TPM, RPM, burst, median s, p99 s        bound by
        (8, 40_000, None, 10_000, 4.0, 30.0),       # TPM
        (16, 600_000, 600, None, 6.0, 60.0),        # concurrency
        (4, 8_000, 60, 4_000, 10.0, 110.0),         # TPM
        (12, 150_000, None, None, 3.0, 20.0),       # concurrency
        (6, 15_000, 120, 5_000, 8.0, 90.0),         # TPM
        (20, 1_000_000, None, None, 5.0, 45.0),     # concurrency
        (10, 80_000, None, 20_000, 2.0, 15.0),      # TPM
        (3, 200_000, 30, None, 20.0, 120.0),        # concurrency
        (24, 300_000, 900, None, 6.0, 70.0),        # concurrency
        (8, 30_000, 200, 8_000, 4.0, 40.0),         # TPM
    ]
    models = []
    for i in range(count):
        cap, tpm, rpm, burst, median, p99 = shapes[i % len(shapes)]
        models.append(
            SimModel(
                name=f"model-{i}",
                max_concurrent_requests=cap,
                max_tokens_per_minute=tpm,
                max_requests_per_minute=rpm,
                burst_tokens=burst,
                latency=Latency(median=median, p99=p99),
                error_rate=0.0,
            )
        )
    return models
