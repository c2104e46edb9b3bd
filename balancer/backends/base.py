"""What every backend client returns or raises.

The worker's retry policy depends only on these types, not on any HTTP detail:
``RateLimited`` goes back to the dispatcher after Retry-After; ``Transient``
(5xx, timeouts, refused connections, malformed replies) backs off and
retries; ``Permanent`` (4xx other than 429) fails the task at once;
``Cancelled`` ends a call its task no longer needs (see ``cancel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Remaining:
    """What the provider says is left of its quota (``x-ratelimit-remaining-*``; None = not sent)."""

    tokens: int | None = None
    requests: int | None = None
    #: The provider's limits (``x-ratelimit-limit-tokens`` / ``-requests``), when sent.
    limit_tokens: int | None = None
    limit_requests: int | None = None


@dataclass(frozen=True)
class Completion:
    answer: str
    prompt_tokens: int
    completion_tokens: int
    remaining: Remaining = Remaining()

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class BackendError(Exception):
    """Base of every backend failure; the message never contains the API key.

    ``ended`` says how far the call got, for what the provider bills
    (:func:`balancer.costs.cost.billed_tokens`): ``refused`` (an error status),
    ``cut_off`` (the request reached the backend, no readable reply came) or
    ``unsent`` (no connection was made)."""

    ended = "refused"


class RateLimited(BackendError):
    def __init__(self, message: str, retry_after: float | None, remaining: Remaining = Remaining()) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.remaining = remaining


class Transient(BackendError):
    """Worth retrying after a back-off: by default a call cut off (a timeout, a dropped
    connection, a reply that could not be read); a 5xx is ``refused``, a refused
    connection ``unsent``."""

    def __init__(self, message: str, *, ended: str = "cut_off") -> None:
        super().__init__(message)
        self.ended = ended


class Permanent(BackendError):
    """Retrying will not help (bad request, unknown model)."""


class Cancelled(BackendError):
    """The call was cut off on purpose (its task was answered by a hedge): no answer, nothing to retry."""

    ended = "cut_off"


class Backend(Protocol):
    def complete(self, model: str, prompt: str, max_tokens: int) -> Completion: ...

    def close(self) -> None: ...
