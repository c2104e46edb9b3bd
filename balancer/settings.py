"""Configuration, read once from the environment.

Every knob is a ``BALANCER_*`` variable so the same code runs in tests, the
demo and docker-compose. Nothing else in the package reads ``os.environ``
for configuration, which is what lets a test check that docker-compose sets
only variables that exist (see ``ENVIRONMENT``).

URLs left unset mean "use the embedded stack" (see :mod:`balancer.devtools.embedded`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from balancer.errors import ConfigError

#: Every environment variable the package reads, with a one-line meaning.
ENVIRONMENT: dict[str, str] = {
    "BALANCER_REDIS_URL": "Redis holding the live admission state (unset: embedded)",
    "BALANCER_DATABASE_URL": "PostgreSQL, the source of truth (unset: embedded)",
    "BALANCER_BROKER_URL": "Celery broker (unset: the Redis above)",
    "BALANCER_BACKEND_URL": "the Models Backend base URL",
    "BALANCER_BACKEND_KIND": "models-backend | openai",
    "BALANCER_BACKEND_API_KEY": "bearer token sent to the backend (never logged)",
    "BALANCER_BACKEND_TIMEOUT": "seconds one backend call may take",
    "BALANCER_WRITE_GRACE": "seconds a solve may take after the call (writing the answer)",
    "BALANCER_NAMESPACE": "Redis key prefix / hash tag, so several deployments share a Redis",
    "BALANCER_HOME": "directory for the embedded stack's data",
    "BALANCER_LEASE_SECONDS": "how long an admitted slot lives without renewal",
    "BALANCER_BASE_QUANTUM": "WDRR quantum per unit of weight, in tokens",
    "BALANCER_VISIBILITY_TIMEOUT": "broker visibility timeout, seconds",
    "BALANCER_INBOX": "directory polled for *.jsonl files to ingest",
    "BALANCER_DISPATCH_WINDOW": "pending tasks the dispatcher looks at per tick",
    "BALANCER_MAX_ATTEMPTS": "backend attempts before a task is marked failed",
    "BALANCER_EXPECTED_OUTPUT_TOKENS": "output tokens assumed when estimating a prompt",
    "BALANCER_DISPATCH_TICK": "seconds between periodic dispatch ticks (completions also trigger dispatch)",
    "BALANCER_RECONCILE_TICK": "seconds between reconcile ticks",
    "BALANCER_INGEST_TICK": "seconds between inbox polls",
}

_SCHEMES_PG = ("postgresql", "postgres", "postgresql+psycopg2")


def normalize_database_url(url: str) -> str:
    """Map plain ``postgresql://`` URLs to the psycopg2 driver.

    SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg 3, which is not a
    dependency here.

    >>> normalize_database_url("postgresql://u@h/db")
    'postgresql+psycopg2://u@h/db'
    >>> normalize_database_url("postgres://h/db")
    'postgresql+psycopg2://h/db'
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES_PG:
        raise ConfigError(
            f"BALANCER_DATABASE_URL must be a postgresql:// URL, got {mask_url(url)!r}"
        )
    return f"postgresql+psycopg2://{rest}"


def mask_url(url: str) -> str:
    """Hide the password in a URL so it can go into an error message.

    >>> mask_url("redis://:hunter2@localhost:6379/0")
    'redis://:***@localhost:6379/0'
    >>> mask_url("postgresql://bob:pw@db/x")
    'postgresql://bob:***@db/x'
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    netloc = f"{user}:***@{host}{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _number(name: str, default: float, valid: Callable[[float], bool], expected: str) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be {expected}, got {raw!r}") from None
    if not valid(value):
        raise ConfigError(f"{name} must be {expected}, got {value}")
    return value


def _float(name: str, default: float) -> float:
    return _number(name, default, lambda v: v > 0, "a number > 0")


def _share(name: str, default: float) -> float:
    return _number(name, default, lambda v: 0 <= v <= 1, "a number from 0 to 1")


def _switch(name: str, default: bool) -> bool:
    raw = (os.environ.get(name) or "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise ConfigError(f"{name} must be on or off, got {raw!r}")


_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
BACKEND_KINDS = ("models-backend", "openai")


@dataclass(frozen=True)
class Settings:
    """A snapshot of the configuration. Build one with :meth:`from_env`."""

    redis_url: str | None
    database_url: str | None
    broker_url: str | None
    backend_url: str = "http://127.0.0.1:8900"
    backend_kind: str = "models-backend"
    backend_api_key: str | None = field(default=None, repr=False)
    backend_timeout: float = 150.0
    write_grace: float = 30.0
    namespace: str = "balancer"
    home: str = ".balancer"
    lease_seconds: int = 300
    base_quantum: int = 1000
    visibility_timeout: int = 900
    inbox: str | None = None
    dispatch_window: int = 200
    max_attempts: int = 5
    expected_output_tokens: int = 256
    #: The latency prior (median, seconds) of a model with no measured calls and no expected_latency_s.
    expected_latency_s: float = 30.0
    #: Finish-time-aware dispatch of the last tasks (balancer.domain.endgame); off: greedy to the end.
    end_game: bool = True
    #: Hedge tokens may reach this share of the run's tokens (0: no hedging).
    hedge_budget: float = 0.05
    #: Hedges per task at most.
    max_hedges: int = 1
    dispatch_tick: float = 1.0
    reconcile_tick: float = 10.0
    ingest_tick: float = 5.0

    @property
    def hedging(self) -> bool:
        """Whether stragglers may be hedged (a budget and at least one hedge per task)."""
        return self.hedge_budget > 0 and self.max_hedges > 0

    @property
    def hard_time_limit(self) -> float:
        """Longest a solve may take: the backend timeout plus the database write."""
        return self.backend_timeout + self.write_grace

    def check_timing(self) -> None:
        """A call must never be redelivered while it still runs, nor outlive its lease."""
        if self.hard_time_limit >= self.visibility_timeout:
            raise ConfigError(
                f"BALANCER_VISIBILITY_TIMEOUT ({self.visibility_timeout}s) must exceed the task hard time limit "
                f"(BALANCER_BACKEND_TIMEOUT + BALANCER_WRITE_GRACE = {self.hard_time_limit:.0f}s)"
            )
        if self.hard_time_limit >= self.lease_seconds:
            raise ConfigError(
                f"BALANCER_LEASE_SECONDS ({self.lease_seconds}s) must exceed the task hard time limit "
                f"(BALANCER_BACKEND_TIMEOUT + BALANCER_WRITE_GRACE = {self.hard_time_limit:.0f}s)"
            )

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        database_url = env.get("BALANCER_DATABASE_URL") or None
        if database_url:
            database_url = normalize_database_url(database_url)
        redis_url = env.get("BALANCER_REDIS_URL") or None
        if redis_url and not redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"BALANCER_REDIS_URL must be a redis:// URL, got {mask_url(redis_url)!r}"
            )
        kind = env.get("BALANCER_BACKEND_KIND") or "models-backend"
        if kind not in BACKEND_KINDS:
            raise ConfigError(
                f"BALANCER_BACKEND_KIND must be one of {', '.join(BACKEND_KINDS)}, got {kind!r}"
            )
        namespace = env.get("BALANCER_NAMESPACE") or "balancer"
        if not _NAMESPACE.match(namespace):
            raise ConfigError(f"BALANCER_NAMESPACE must match {_NAMESPACE.pattern}, got {namespace!r}")
        settings = cls(
            redis_url=redis_url,
            database_url=database_url,
            broker_url=env.get("BALANCER_BROKER_URL") or None,
            backend_url=env.get("BALANCER_BACKEND_URL") or "http://127.0.0.1:8900",
            backend_kind=kind,
            backend_api_key=env.get("BALANCER_BACKEND_API_KEY") or None,
            backend_timeout=_float("BALANCER_BACKEND_TIMEOUT", 150.0),
            write_grace=_float("BALANCER_WRITE_GRACE", 30.0),
            namespace=namespace,
            home=env.get("BALANCER_HOME") or ".balancer",
            lease_seconds=_int("BALANCER_LEASE_SECONDS", 300),
            base_quantum=_int("BALANCER_BASE_QUANTUM", 1000),
            visibility_timeout=_int("BALANCER_VISIBILITY_TIMEOUT", 900),
            inbox=env.get("BALANCER_INBOX") or None,
            dispatch_window=_int("BALANCER_DISPATCH_WINDOW", 200),
            max_attempts=_int("BALANCER_MAX_ATTEMPTS", 5),
            expected_output_tokens=_int("BALANCER_EXPECTED_OUTPUT_TOKENS", 256),
            expected_latency_s=_float("BALANCER_EXPECTED_LATENCY_S", 30.0),
            end_game=_switch("BALANCER_END_GAME", True),
            hedge_budget=_share("BALANCER_HEDGE_BUDGET", 0.05),
            max_hedges=_int("BALANCER_MAX_HEDGES", 1, minimum=0),
            dispatch_tick=_float("BALANCER_DISPATCH_TICK", 1.0),
            reconcile_tick=_float("BALANCER_RECONCILE_TICK", 10.0),
            ingest_tick=_float("BALANCER_INGEST_TICK", 5.0),
        )
        return settings
