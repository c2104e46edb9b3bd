"""Configuration, read once from the environment.

Every knob is a ``BALANCER_*`` variable so the same code runs in tests, the
demo and docker-compose. Nothing else in the package reads ``os.environ``
for configuration, which is what lets a test check that docker-compose sets
only variables that exist (see ``ENVIRONMENT``).

URLs left unset mean "use the embedded stack" (see :mod:`balancer.devtools.embedded`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from balancer.errors import ConfigError, printable

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]{0,31}$")

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
    "BALANCER_LEASE_SECONDS": "how long an admitted slot and its task live without a heartbeat (renewed every third)",
    "BALANCER_BASE_QUANTUM": "WDRR quantum per unit of weight, in tokens",
    "BALANCER_VISIBILITY_TIMEOUT": "broker visibility timeout, seconds",
    "BALANCER_INBOX": "directory polled for *.jsonl files to ingest",
    "BALANCER_DISPATCH_WINDOW": "pending tasks the dispatcher looks at per tick",
    "BALANCER_READY_PER_SLOT": "tasks a concurrency-bound model keeps ready, per slot, for its next free slots (0: off)",
    "BALANCER_READY_TTL": "seconds a ready task waits for its model's slot before it goes back to pending",
    "BALANCER_DB_POOL_SIZE": "PostgreSQL connections each process keeps open and never exceeds (its threads share them)",
    "BALANCER_MAX_ATTEMPTS": "backend attempts before a task is marked failed",
    "BALANCER_EXPECTED_OUTPUT_TOKENS": "output tokens assumed when estimating a prompt",
    "BALANCER_DISPATCH_TICK": "seconds between periodic dispatch ticks (completions also trigger dispatch)",
    "BALANCER_SWEEP_TICK": "seconds between sweep ticks (return tasks past their deadline, repair quota drift)",
    "BALANCER_INGEST_TICK": "seconds between inbox polls",
    "BALANCER_ROUTER_TOKEN": "bearer token the router requires (required when it binds beyond loopback; never logged)",
    "BALANCER_ROUTER_LEASE_SECONDS": "how long a router admission lives without a heartbeat",
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
    """A URL reduced to what an error may show: scheme, host, port and database.

    Never the user name or password, however they are written: the
    credentials end at the *last* ``@`` (a host has none), so a password with
    an unencoded ``#``, ``?``, ``/`` or ``@`` is hidden too; query and fragment
    are dropped (they can carry a password as well).

    >>> mask_url("redis://:hunter2@localhost:6379/0")
    'redis://***@localhost:6379/0'
    >>> mask_url("postgresql://bob:p#w?/@x@db:5432/prod?password=pw")
    'postgresql://***@db:5432/prod'
    >>> mask_url("no-scheme-at-all")
    '<not a URL>'
    """
    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME.match(scheme):
        return "<not a URL>"
    userinfo, at, hostpart = rest.rpartition("@")
    cut = min([i for i in (hostpart.find(c) for c in "/?#") if i >= 0], default=len(hostpart))
    host, path = hostpart[:cut], hostpart[cut:]
    database = re.split(r"[/?#]", path[1:])[0] if path.startswith("/") else ""
    return printable(f"{scheme}://{'***@' if at else ''}{host}{'/' + database if database else ''}")


def scrub(message: str, url: str) -> str:
    """``message`` (a client library's error) without any piece of ``url``'s
    credentials, raw or percent-decoded: libraries quote what they could not
    parse ("port could not be cast", "could not translate host name").

    >>> scrub('could not translate host name "s3cr3t" to address', "postgresql://u:s3cr3t#x@h/db")
    'could not translate host name "***" to address'
    """
    userinfo = url.partition("://")[2].rpartition("@")[0]
    pieces = {userinfo, unquote(userinfo), *re.split(r"[:/?#@]", userinfo), *re.split(r"[:/?#@]", unquote(userinfo))}
    for piece in sorted((p for p in pieces if len(p) >= 3), key=len, reverse=True):
        message = message.replace(piece, "***")
    return message.replace(url, mask_url(url))


def check_url(setting: str, url: str, schemes: tuple[str, ...]) -> str:
    """Refuse a URL its client library would misread, in one line naming the setting.

    >>> check_url("BALANCER_REDIS_URL", "redis://:pw@h:6379/0", ("redis",))
    'redis://:pw@h:6379/0'
    >>> check_url("BALANCER_REDIS_URL", "redis://:p#w@h/0", ("redis",))
    Traceback (most recent call last):
    balancer.errors.ConfigError: BALANCER_REDIS_URL: percent-encode the user name and password (they contain / ? # or @): redis://***@h/0
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        expected = " or ".join(f"{s}://" for s in schemes)
        raise ConfigError(f"{setting} must be a {expected} URL, got {mask_url(url)!r}")
    userinfo, at, hostpart = rest.rpartition("@")
    if at and any(c in userinfo for c in "/?#@"):
        raise ConfigError(f"{setting}: percent-encode the user name and password (they contain / ? # or @): {mask_url(url)}")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise ConfigError(f"{setting} contains spaces or control characters: {mask_url(url)}")
    return url


#: The largest value any integer setting takes (a week of seconds, or a count far past any real use).
MAX_INT_SETTING = 7 * 86_400


def check_redis_url(setting: str, url: str) -> None:
    """A Redis URL redis-py reads as meant: its database, if given, a number.

    >>> check_redis_url("BALANCER_REDIS_URL", "redis://h:6379/abc")
    Traceback (most recent call last):
    balancer.errors.ConfigError: BALANCER_REDIS_URL: the database must be a number (redis://host:6379/0), got 'abc'
    """
    check_url(setting, url, ("redis", "rediss", "unix"))
    if url.lower().startswith("unix"):
        return
    database = urlsplit(url).path.strip("/")
    if database and not database.isdigit():
        raise ConfigError(f"{setting}: the database must be a number (redis://host:6379/0), got {printable(database)!r}")


def _int(name: str, default: int, minimum: int = 1, maximum: int = MAX_INT_SETTING) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {printable(raw)!r}") from None
    if not minimum <= value <= maximum:
        raise ConfigError(f"{name} must be from {minimum} to {maximum}, got {value}")
    return value


def _number(name: str, default: float, valid: Callable[[float], bool], expected: str) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be {expected}, got {printable(raw)!r}") from None
    if not math.isfinite(value) or not valid(value):
        raise ConfigError(f"{name} must be {expected}, got {value}")
    return value


def _seconds(name: str, default: float, low: float, high: float) -> float:
    """A duration setting, refused unless finite and within [low, high]."""
    return _number(name, default, lambda v: low <= v <= high, f"a number of seconds from {low:g} to {high:g}")


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
    raise ConfigError(f"{name} must be on or off, got {printable(raw)!r}")


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
    lease_seconds: int = 30
    base_quantum: int = 1000
    visibility_timeout: int = 900
    inbox: str | None = None
    dispatch_window: int = 200
    #: A concurrency-bound model keeps ceil(cap * this) tasks ready (balancer.domain.ready); 0: no ready lists.
    ready_per_slot: float = 3.0
    #: How long a ready task waits for its model's slot before it goes back to pending.
    ready_ttl: float = 5.0
    #: PostgreSQL connections one process keeps open and never exceeds (balancer.storage.db).
    db_pool_size: int = 5
    max_attempts: int = 5
    expected_output_tokens: int = 256
    #: The latency prior (median, seconds) of a model with no measured calls and no expected_latency_s.
    expected_latency_s: float = 30.0
    #: Finish-time-aware dispatch of the last tasks (balancer.domain.endgame); off: greedy to the end.
    end_game: bool = True
    #: Fill the dispatch window across sources by weight (balancer.domain.fairshare); off: priority, then age.
    source_fairness: bool = True
    #: Hedge tokens may reach this share of the run's tokens (0: no hedging).
    hedge_budget: float = 0.05
    #: Hedges per task at most.
    max_hedges: int = 1
    dispatch_tick: float = 1.0
    sweep_tick: float = 10.0
    ingest_tick: float = 5.0
    router_token: str | None = field(default=None, repr=False)
    router_lease_seconds: float = 30.0

    @property
    def hedging(self) -> bool:
        """Whether stragglers may be hedged (a budget and at least one hedge per task)."""
        return self.hedge_budget > 0 and self.max_hedges > 0

    @property
    def hard_time_limit(self) -> float:
        """Longest a solve may take: the backend timeout plus the database write."""
        return self.backend_timeout + self.write_grace

    @property
    def heartbeat_seconds(self) -> float:
        """How often a worker renews its running calls' leases: a third of a lease,
        so two beats may be late before a live call loses its slot."""
        return self.lease_seconds / 3

    def check_timing(self) -> None:
        """The broker must not redeliver a message whose solve may still run.

        What bounds a solve is enforced by the solver itself, not by Celery's
        ``task_time_limit`` (its thread pool ignores it): the HTTP call ends
        within ``backend_timeout`` in total time (a watchdog cuts it,
        :func:`balancer.backends.cancel.cut_at`), and the writes' retries give
        up at ``hard_time_limit`` from the solve's start
        (:data:`balancer.pipeline.solver.SOLVE_DEADLINE`). So the check is
        that limit against the visibility timeout. (A call's lease need not
        outlast the call: the heartbeat renews it, see
        :mod:`balancer.pipeline.heartbeat`; and a redelivered message does not
        start a second call while the first one's lease is alive.)"""
        if self.hard_time_limit >= self.visibility_timeout:
            raise ConfigError(
                f"BALANCER_VISIBILITY_TIMEOUT ({self.visibility_timeout}s) must exceed the task hard time limit "
                f"(BALANCER_BACKEND_TIMEOUT + BALANCER_WRITE_GRACE = {self.hard_time_limit:.0f}s)"
            )

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        database_url = env.get("BALANCER_DATABASE_URL") or None
        if database_url:
            database_url = normalize_database_url(check_url("BALANCER_DATABASE_URL", database_url, _SCHEMES_PG))
        redis_url = env.get("BALANCER_REDIS_URL") or None
        if redis_url:
            check_redis_url("BALANCER_REDIS_URL", redis_url)
        broker_url = env.get("BALANCER_BROKER_URL") or None
        if broker_url:
            check_url("BALANCER_BROKER_URL", broker_url, ("redis", "rediss", "amqp", "amqps", "pyamqp"))
            if broker_url.lower().startswith("redis"):
                check_redis_url("BALANCER_BROKER_URL", broker_url)
        backend_url = env.get("BALANCER_BACKEND_URL") or "http://127.0.0.1:8900"
        check_url("BALANCER_BACKEND_URL", backend_url, ("http", "https"))
        if not urlsplit(backend_url).hostname:
            raise ConfigError(f"BALANCER_BACKEND_URL has no host: {mask_url(backend_url)}")
        kind = env.get("BALANCER_BACKEND_KIND") or "models-backend"
        if kind not in BACKEND_KINDS:
            raise ConfigError(
                f"BALANCER_BACKEND_KIND must be one of {', '.join(BACKEND_KINDS)}, got {printable(kind)!r}"
            )
        namespace = env.get("BALANCER_NAMESPACE") or "balancer"
        if not _NAMESPACE.match(namespace):
            raise ConfigError(f"BALANCER_NAMESPACE must match {_NAMESPACE.pattern}, got {printable(namespace)!r}")
        settings = cls(
            redis_url=redis_url,
            database_url=database_url,
            broker_url=broker_url,
            backend_url=backend_url,
            backend_kind=kind,
            backend_api_key=env.get("BALANCER_BACKEND_API_KEY") or None,
            backend_timeout=_seconds("BALANCER_BACKEND_TIMEOUT", 150.0, 0.1, 3600),
            write_grace=_seconds("BALANCER_WRITE_GRACE", 30.0, 1, 3600),
            namespace=namespace,
            home=env.get("BALANCER_HOME") or ".balancer",
            lease_seconds=_int("BALANCER_LEASE_SECONDS", 30),
            base_quantum=_int("BALANCER_BASE_QUANTUM", 1000),
            visibility_timeout=_int("BALANCER_VISIBILITY_TIMEOUT", 900),
            inbox=env.get("BALANCER_INBOX") or None,
            dispatch_window=_int("BALANCER_DISPATCH_WINDOW", 200),
            ready_per_slot=_number("BALANCER_READY_PER_SLOT", 3.0, lambda v: 0 <= v <= 10, "a number from 0 to 10"),
            ready_ttl=_seconds("BALANCER_READY_TTL", 5.0, 0.1, 3600),
            db_pool_size=_int("BALANCER_DB_POOL_SIZE", 5, maximum=100),
            max_attempts=_int("BALANCER_MAX_ATTEMPTS", 5),
            expected_output_tokens=_int("BALANCER_EXPECTED_OUTPUT_TOKENS", 256),
            expected_latency_s=_seconds("BALANCER_EXPECTED_LATENCY_S", 30.0, 0.01, 3600),
            end_game=_switch("BALANCER_END_GAME", True),
            source_fairness=_switch("BALANCER_SOURCE_FAIRNESS", True),
            hedge_budget=_share("BALANCER_HEDGE_BUDGET", 0.05),
            max_hedges=_int("BALANCER_MAX_HEDGES", 1, minimum=0),
            dispatch_tick=_seconds("BALANCER_DISPATCH_TICK", 1.0, 0.05, 3600),
            sweep_tick=_seconds("BALANCER_SWEEP_TICK", 10.0, 0.1, 86_400),
            ingest_tick=_seconds("BALANCER_INGEST_TICK", 5.0, 0.1, 86_400),
            router_token=env.get("BALANCER_ROUTER_TOKEN") or None,
            router_lease_seconds=_seconds("BALANCER_ROUTER_LEASE_SECONDS", 30.0, 1, 86_400),
        )
        return settings
