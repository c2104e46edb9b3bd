"""A provider's rate limiter for one model (pure; time is passed in, in seconds).

Tokens: a bucket of capacity ``burst`` refilling at TPM/60 per second. A call
is charged ``prompt_tokens + max_tokens`` when it starts (as providers
reserve the output budget), and the unused part is credited back when it
ends. Requests: a bucket of one minute of RPM. Concurrency: calls in progress.

``grace`` seconds of refill are allowed above ``burst``. A call reaches the
provider a few ms after the client admitted it, and a full provider bucket
wastes the refill of that delay, so a strictly equal bucket would 429 a client
that kept exactly to the same limits.

>>> lim = ModelLimiter(cap=1, tpm=600, rpm=None, burst=100, grace=0.0, now=0.0)
>>> lim.try_start(0.0, 100)
(True, 0.0)
>>> lim.try_start(0.0, 10)[0]   # concurrency cap
False
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelLimiter:
    cap: int
    tpm: float
    rpm: float | None
    burst: float
    grace: float
    now: float
    in_flight: int = 0
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
        return 0.0 if not self.rpm else self.rpm + self.rpm / 60 * self.grace

    def _refill(self, now: float) -> None:
        dt = max(0.0, now - self.now)
        self.tokens = min(self.token_capacity, self.tokens + dt * self.tpm / 60)
        if self.rpm:
            self.requests = min(self.request_capacity, self.requests + dt * self.rpm / 60)
        self.now = max(self.now, now)

    def try_start(self, now: float, charge: float) -> tuple[bool, float]:
        """(accepted, retry_after seconds)."""
        self._refill(now)
        if self.in_flight >= self.cap:
            return False, 1.0
        waits = []
        if self.tokens < charge:
            waits.append((charge - self.tokens) / (self.tpm / 60))
        if self.rpm and self.requests < 1:
            waits.append((1 - self.requests) / (self.rpm / 60))
        if waits:
            return False, max(waits)
        self.tokens -= charge
        if self.rpm:
            self.requests -= 1
        self.in_flight += 1
        return True, 0.0

    def finish(self, now: float, credit: float) -> None:
        self._refill(now)
        self.in_flight -= 1
        self.tokens = min(self.token_capacity, self.tokens + credit)

    def update(self, now: float, *, cap: int, tpm: float, rpm: float | None, burst: float) -> None:
        self._refill(now)
        self.cap, self.tpm, self.rpm, self.burst = cap, tpm, rpm, burst
        self.tokens = min(self.tokens, self.token_capacity)
        self.requests = min(self.requests, self.request_capacity) if rpm else 0.0
