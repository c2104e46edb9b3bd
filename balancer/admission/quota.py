"""One model's quota: the limits the admission core enforces.

Pure values and validation only; storing them is :mod:`balancer.quotas.store`,
enforcing them is :mod:`balancer.admission`.

>>> q = Quota("gpt-a", max_concurrent_requests=8, max_tokens_per_minute=60_000)
>>> q.burst, q.allowed_per_minute, q.replace(window_cap=True).allowed_per_minute
(60000, (120000, None), (60000, None))
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from balancer.costs.cost import check_currency, check_price
from balancer.errors import QuotaError

#: Model names become Celery queue names (``model.<name>``) and Redis key parts,
#: and travel comma-separated inside the admission script, so keep them plain.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

#: Upper bound on any numeric limit. Keeps bucket arithmetic (tokens x 60,000
#: units) exact in Lua's doubles, which are exact below 2**53.
MAX_LIMIT = 1_000_000_000
#: Upper bound on max_concurrent_requests: a worker runs one thread per
#: concurrent call, so a typo must not size a pool to a billion threads.
#: (bench/scenarios/backlog.toml holds 28,000 admissions on two models.)
MAX_CONCURRENCY = 100_000

INT_FIELDS = (
    "weight",
    "max_concurrent_requests",
    "max_tokens_per_minute",
    "max_requests_per_minute",
    "burst_tokens",
    "burst_requests",
)

#: How a provider counts a call against TPM (docs/admission.md, "How providers count"):
#: ``reserve`` charges prompt + max_tokens when the call arrives and never
#: refunds (OpenAI, Azure OpenAI); ``settle`` charges the estimate, then
#: settles to actual usage (Anthropic, self-hosted backends).
TOKEN_ACCOUNTING = ("reserve", "settle")
#: What the provider does with a call whose client disconnected: continue it (and charge it) or stop.
ON_DISCONNECT = ("continue", "stop")
#: Older names of ``on_disconnect`` values, still accepted (quota files, the CLI, stored rows).
ON_DISCONNECT_ALIASES = {"finish": "continue"}


def check_model_name(name: str) -> str:
    if not isinstance(name, str) or not MODEL_NAME.match(name):
        raise QuotaError(
            f"invalid model name {name!r}: use letters, digits, '.', '_' or '-' (max 64)"
        )
    return name


def check_limit(field: str, value: Any, *, optional: bool = False, maximum: int = MAX_LIMIT) -> int | None:
    """Validate one numeric limit: a whole number from 1 to ``maximum``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuotaError(f"{field} must be a whole number, got {value!r}")
    if value < 1:
        raise QuotaError(f"{field} must be >= 1, got {value}")
    if value > maximum:
        raise QuotaError(f"{field} must be <= {maximum}, got {value}")
    return value


#: Bounds on a latency prior, in seconds.
LATENCY_RANGE = (0.01, 3600.0)


def check_window_cap(quota: Quota) -> None:
    """A window cap admits at most the TPM (RPM) in 60 s, so no burst may be larger: a call
    the bucket fits but no window does would wait for ever."""
    for burst, rate, what in ((quota.burst_tokens, quota.max_tokens_per_minute, "max_tokens_per_minute"),
                              (quota.burst_requests, quota.max_requests_per_minute, "max_requests_per_minute")):
        if burst is not None and rate is not None and burst > rate:
            field = "burst_tokens" if what == "max_tokens_per_minute" else "burst_requests"
            raise QuotaError(f"{field} {burst:,} is above {what} {rate:,}: "
                             "with window_cap no 60 s window admits more than the rate")


def check_latency(field: str, value: Any) -> None:
    """A latency prior: None, or a finite number of seconds within ``LATENCY_RANGE``."""
    if value is None:
        return
    low, high = LATENCY_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise QuotaError(f"{field} must be a number of seconds from {low} to {high:g}, got {value!r}")


@dataclass(frozen=True)
class Quota:
    """Limits for one model.

    ``burst_tokens`` is the token bucket's capacity; ``None`` means one minute
    of TPM, as in the seed design. ``burst_requests`` is the request bucket's
    capacity; ``None`` means one minute of RPM. Set it to RPM x window / 60 to
    match a provider that checks RPM over a 1 s or 10 s window (Azure).
    ``token_accounting`` says how the provider counts tokens; the default,
    ``reserve``, is the one that never draws a 429 from a provider that keeps
    what it reserved.
    """

    name: str
    max_concurrent_requests: int
    max_tokens_per_minute: int
    weight: int = 1
    max_requests_per_minute: int | None = None
    burst_tokens: int | None = None
    enabled: bool = True
    token_accounting: str = "reserve"  # noqa: S105 - an accounting mode, not a credential
    burst_requests: int | None = None
    #: The latency prior (median, seconds) until the model's own calls have taught
    #: the dispatcher better (balancer.estimates.latency); None: the global default.
    expected_latency_s: float | None = None
    #: What the provider does when balancer cuts off a hedged task's losing call:
    #: ``continue`` (the default, and the strict case) keeps working on a
    #: non-streamed request and charges it, so the call's slot stays held until it
    #: would have ended; ``stop`` frees it at once. ``finish`` is read as ``continue``.
    on_disconnect: str = "continue"
    #: What the model's calls cost per million prompt (input) and completion (output)
    #: tokens, in ``currency`` (balancer.costs.cost); None: not priced. Admission ignores them.
    price_per_million_input: float | None = None
    price_per_million_output: float | None = None
    #: The prices' currency, named once in the quota file (three capital letters).
    currency: str | None = None
    #: Learn the provider's real limits below these ones (429s lower an effective
    #: limit, clean windows raise it back; x-ratelimit-limit-* headers are
    #: adopted): docs/admission.md, "Limits that learn". False: the limits above, exactly.
    learn: bool = True
    #: With ``learn``: open a new or changed quota's concurrency gradually (a few
    #: slots, doubling every quarter second from the first call) until a 429 or
    #: the cap, so a quota above what the provider allows draws a few 429s, not
    #: one per slot (balancer.admission.learned.ramp_cap). False: the whole cap at once.
    slow_start: bool = True
    #: A window cap instead of the burst on top of the rate: no 60 s window admits more than
    #: ``max_tokens_per_minute`` tokens, nor (with an RPM) ``max_requests_per_minute`` calls
    #: (balancer.admission.window). False: the token bucket alone, which admits up to its burst
    #: on top of a minute of refill in one minute (docs/admission.md, "What a quota guarantees").
    window_cap: bool = False

    def __post_init__(self) -> None:
        check_model_name(self.name)
        check_limit("weight", self.weight)
        check_limit("max_concurrent_requests", self.max_concurrent_requests, maximum=MAX_CONCURRENCY)
        check_limit("max_tokens_per_minute", self.max_tokens_per_minute)
        check_limit("max_requests_per_minute", self.max_requests_per_minute, optional=True)
        check_limit("burst_tokens", self.burst_tokens, optional=True)
        check_limit("burst_requests", self.burst_requests, optional=True)
        if self.token_accounting not in TOKEN_ACCOUNTING:
            raise QuotaError(f"token_accounting must be one of {', '.join(TOKEN_ACCOUNTING)}, got {self.token_accounting!r}")
        check_latency("expected_latency_s", self.expected_latency_s)
        if isinstance(self.on_disconnect, str) and self.on_disconnect in ON_DISCONNECT_ALIASES:
            object.__setattr__(self, "on_disconnect", ON_DISCONNECT_ALIASES[self.on_disconnect])
        if self.on_disconnect not in ON_DISCONNECT:
            raise QuotaError(f"on_disconnect must be one of {', '.join(ON_DISCONNECT)}, got {self.on_disconnect!r}")
        if not isinstance(self.enabled, bool):
            raise QuotaError(f"enabled must be true or false, got {self.enabled!r}")
        for flag in ("learn", "slow_start", "window_cap"):
            if not isinstance(getattr(self, flag), bool):
                raise QuotaError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.window_cap:
            check_window_cap(self)
        check_price("price_per_million_input", self.price_per_million_input)
        check_price("price_per_million_output", self.price_per_million_output)
        check_currency(self.currency)

    @property
    def burst(self) -> int:
        """Token bucket capacity, defaulting to one minute of TPM."""
        return self.burst_tokens if self.burst_tokens is not None else self.max_tokens_per_minute

    @property
    def request_burst(self) -> int:
        """Request bucket capacity (0 without an RPM limit), defaulting to one minute of RPM."""
        if not self.max_requests_per_minute:
            return 0
        return self.burst_requests if self.burst_requests is not None else self.max_requests_per_minute

    @property
    def allowed_per_minute(self) -> tuple[int, int | None]:
        """The most tokens and requests (None: no RPM) one minute may admit: the rate plus its
        burst, or the rate alone under a window cap. What a display compares a minute's rate to."""
        if self.window_cap:
            return self.max_tokens_per_minute, self.max_requests_per_minute
        rpm = self.max_requests_per_minute
        return self.max_tokens_per_minute + self.burst, rpm + self.request_burst if rpm else None

    @property
    def settles(self) -> bool:
        """Whether the provider settles a call to its actual usage (``settle``)."""
        return self.token_accounting == "settle"  # noqa: S105 - an accounting mode, not a credential

    def replace(self, **changes: Any) -> Quota:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON, TOML and the audit table."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Quota:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise QuotaError(f"unknown quota field(s): {', '.join(sorted(unknown))}")
        missing = {"name", "max_concurrent_requests", "max_tokens_per_minute"} - set(data)
        if missing:
            raise QuotaError(f"missing quota field(s): {', '.join(sorted(missing))}")
        return cls(**data)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:,}" if isinstance(value, int) else str(value)


def change_text(old: Quota | None, new: Quota) -> str:
    """What a quota change did, field by field (``field from → to``); for a new quota, each field
    it sets beyond the defaults; ``unchanged`` when nothing changed. The fields are the dataclass's.

    >>> q = Quota("m", 4, 30_000)
    >>> change_text(q, q.replace(max_tokens_per_minute=60_000, weight=2))
    'updated: max_tokens_per_minute 30,000 → 60,000, weight 1 → 2'
    >>> change_text(None, q.replace(enabled=False))
    'created: max_concurrent_requests 4, max_tokens_per_minute 30,000, enabled false'
    >>> change_text(q, q)
    'unchanged'
    >>> change_text(q, q.replace(burst_tokens=50_000))   # unset, a bucket is one minute of its rate
    'updated: burst_tokens 30,000 (the default) → 50,000'
    """
    if old is None:
        base = Quota(new.name, new.max_concurrent_requests, new.max_tokens_per_minute)
        required = ("max_concurrent_requests", "max_tokens_per_minute")
        shown = [f"{f.name} {_shown(getattr(new, f.name))}" for f in dataclasses.fields(new)
                 if f.name != "name" and (f.name in required or getattr(new, f.name) != getattr(base, f.name))]
        return "created: " + ", ".join(shown)
    moved = [f"{f.name} {_field_shown(old, f.name)} → {_field_shown(new, f.name)}"
             for f in dataclasses.fields(new) if getattr(old, f.name) != getattr(new, f.name)]
    return "updated: " + ", ".join(moved) if moved else "unchanged"


#: Fields that, unset, take a value the quota derives (its property): shown as that value.
_DERIVED = {"burst_tokens": "burst", "burst_requests": "request_burst"}


def _field_shown(quota: Quota, name: str) -> str:
    """A field as ``change_text`` shows it: an unset bucket size as the size it takes, as ``quota list`` shows it.

    >>> _field_shown(Quota("m", 4, 30_000), "burst_tokens"), _field_shown(Quota("m", 4, 30_000), "burst_requests")
    ('30,000 (the default)', 'none')
    """
    value = getattr(quota, name)
    derived = getattr(quota, _DERIVED[name]) if value is None and name in _DERIVED else None
    return f"{_shown(derived)} (the default)" if derived else _shown(value)
