"""A provider's rate limiter for one model (pure; time is passed in, in seconds).

Tokens: a bucket of capacity ``burst`` refilling at TPM/60 per second. A call
is charged ``prompt_tokens + max_tokens`` when it starts, as providers
reserve the output budget. ``settle`` providers credit the unused part back
when the call ends; ``reserve`` providers (the default, and the strict case:
OpenAI, Azure OpenAI) keep it. Requests: a bucket of ``request_burst``
(one RPM window's share; one minute of RPM by default) refilling at RPM/60 per
second. Concurrency: calls in progress.

``grace`` seconds of refill may be tolerated above the buckets. The default is
0: a client that keeps to the same limits has to account for the delay between
its admission and the call's arrival itself, as it must against a real provider.

>>> lim = ModelLimiter(cap=1, tpm=600, rpm=None, burst=100, now=0.0)
>>> lim.try_start(0.0, 100)
(True, 0.0)
>>> lim.try_start(0.0, 10)[0]   # concurrency cap
False
>>> lim.finish(1.0, unused=60)  # reserve: the unused 60 tokens stay spent
>>> round(lim.tokens)           # 1 s of refill at 10 tokens/s
10
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelLimiter:
    cap: int
    tpm: float
    rpm: float | None
    burst: float
    now: float
    grace: float = 0.0
    request_burst: float | None = None  # None: one minute of RPM
    settle: bool = False
    in_flight: int = 0
    refused_by: str | None = None  # the limit behind the last refusal: concurrency, tokens or requests
    #: Limit changes: (seconds after the first call, keyword arguments of :meth:`update`), in time order.
    schedule: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    first_call: float | None = None
    tokens: float = field(init=False)
    requests: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = self.token_capacity
        self.requests = self.request_capacity

    @property
    def token_capacity(self) -> float:
        return self.burst + self.tpm / 60 * self.grace

    @property
    def request_capacity(self) -> float:
        if not self.rpm:
            return 0.0
        size = self.request_burst if self.request_burst is not None else self.rpm
        return size + self.rpm / 60 * self.grace

    def _refill(self, now: float) -> None:
        dt = max(0.0, now - self.now)
        self.tokens = min(self.token_capacity, self.tokens + dt * self.tpm / 60)
        if self.rpm:
            self.requests = min(self.request_capacity, self.requests + dt * self.rpm / 60)
        self.now = max(self.now, now)

    def try_start(self, now: float, charge: float) -> tuple[bool, float]:
        """(accepted, retry_after seconds)."""
        if self.first_call is None:
            self.first_call = now
        while self.schedule and self.first_call + self.schedule[0][0] <= now:
            self.update(now, **self.schedule.pop(0)[1])
        self._refill(now)
        if self.in_flight >= self.cap:
            self.refused_by = "concurrency"
            return False, 1.0
        waits = []
        if self.tokens < charge:
            waits.append(((charge - self.tokens) / (self.tpm / 60), "tokens"))
        if self.rpm and self.requests < 1:
            waits.append(((1 - self.requests) / (self.rpm / 60), "requests"))
        if waits:
            wait, self.refused_by = max(waits)
            return False, wait
        self.tokens -= charge
        if self.rpm:
            self.requests -= 1
        self.in_flight += 1
        return True, 0.0

    def finish(self, now: float, unused: float) -> None:
        """A call ended having used ``unused`` tokens fewer than it was charged."""
        self._refill(now)
        self.in_flight -= 1
        if self.settle:
            self.tokens = min(self.token_capacity, self.tokens + unused)

    def take_foreign(self, now: float, tokens: float, requests: float) -> tuple[float, float]:
        """Another client of the same quota consumes what it can of ``tokens`` and
        ``requests`` (it is rate-limited too). Returns what it took."""
        self._refill(now)
        took_tokens = min(tokens, max(0.0, self.tokens))
        self.tokens -= took_tokens
        took_requests = 0.0
        if self.rpm:
            took_requests = min(requests, max(0.0, self.requests))
            self.requests -= took_requests
        return took_tokens, took_requests

    def remaining(self, now: float) -> tuple[int, int | None]:
        """What the provider's ``x-ratelimit-remaining-*`` headers say: whole tokens, requests."""
        self._refill(now)
        return max(0, int(self.tokens)), None if not self.rpm else max(0, int(self.requests))

    def update(self, now: float, *, cap: int, tpm: float, rpm: float | None, burst: float,
               request_burst: float | None = None) -> None:
        self._refill(now)
        self.cap, self.tpm, self.rpm, self.burst = cap, tpm, rpm, burst
        if request_burst is not None:
            self.request_burst = request_burst
        self.tokens = min(self.tokens, self.token_capacity)
        self.requests = min(self.requests, self.request_capacity) if rpm else 0.0
