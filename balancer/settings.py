"""Configuration, read once from the environment.

Every knob is a ``BALANCER_*`` variable so the same code runs in tests, the
demo and docker-compose. Nothing else in the package reads ``os.environ``
for configuration, which is what lets a test check that docker-compose sets
only variables that exist (see ``ENVIRONMENT``). Each setting is declared
once, as a field of :class:`Settings`: its default, its one-line meaning
and how it is read; ``ENVIRONMENT`` and :meth:`Settings.from_env` follow
from those fields.

URLs left unset mean "use the embedded stack" (see :mod:`balancer.devtools.embedded`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from balancer.errors import ConfigError, printable
from balancer.urls import (
    POSTGRES_SCHEMES,
    check_broker_url,
    check_database_url,
    check_redis_url,
    check_url,
    mask_url,
    normalize_database_url,
)

#: The largest value any integer setting takes (a week of seconds, or a count far past any real use).
MAX_INT_SETTING = 7 * 86_400


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


def _text(name: str, default: str | None) -> str | None:
    return os.environ.get(name) or default


#: How :meth:`Settings.from_env` reads one variable: (its name, the default) -> the value.
Reader = Callable[[str, Any], Any]


def _setting(meaning: str, default: Any = MISSING, read: Reader | None = None, *, secret: bool = False) -> Any:
    """One setting, declared once: its default, its one-line meaning (``ENVIRONMENT``)
    and how :meth:`Settings.from_env` reads it (None: from_env checks it by hand,
    as the URLs, the backend kind and the namespace need). ``secret``: never in a repr."""
    return field(default=default, repr=not secret, metadata={"meaning": meaning, "read": read})


def variable(setting: str) -> str:
    """The environment variable of a :class:`Settings` field.

    >>> variable("lease_seconds")
    'BALANCER_LEASE_SECONDS'
    """
    return "BALANCER_" + setting.upper()


_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
BACKEND_KINDS = ("models-backend", "openai")


@dataclass(frozen=True)
class Settings:
    """A snapshot of the configuration. Build one with :meth:`from_env`."""

    redis_url: str | None = _setting("Redis holding the live admission state: redis://, rediss://, unix:// or, through "
                                     "Sentinel, sentinel://host1:26379,host2:26379/master-name/db (unset: embedded)")
    database_url: str | None = _setting("PostgreSQL, the source of truth (unset: embedded)")
    broker_url: str | None = _setting("Celery broker: Redis (sentinel:// as above) or AMQP (unset: the Redis above)")
    backend_url: str = _setting("the Models Backend base URL", "http://127.0.0.1:8900")
    backend_kind: str = _setting("models-backend | openai", "models-backend")
    backend_api_key: str | None = _setting("bearer token sent to the backend (never logged)", None, _text, secret=True)
    backend_timeout: float = _setting("seconds one backend call may take", 150.0, partial(_seconds, low=0.1, high=3600))
    write_grace: float = _setting("seconds a solve may take after the call (writing the answer)", 30.0,
                                  partial(_seconds, low=1, high=3600))
    start_wait: float = _setting("seconds a worker, dispatcher or beat waits at start for an unreachable Redis or "
                                 "PostgreSQL (then exit 2)", 300.0, partial(_seconds, low=0, high=86400))
    namespace: str = _setting("Redis key prefix / hash tag, so several deployments share a Redis", "balancer")
    home: str = _setting("directory for the embedded stack's data", ".balancer", _text)
    lease_seconds: int = _setting(
        "how long an admitted slot and its task live without a heartbeat (renewed every third)", 30, _int)
    base_quantum: int = _setting("WDRR quantum per unit of weight, in tokens", 1000, _int)
    visibility_timeout: int = _setting("broker visibility timeout, seconds", 900, _int)
    inbox: str | None = _setting("directory polled for *.jsonl files to ingest", None, _text)
    dispatch_window: int = _setting("pending tasks the dispatcher looks at per tick", 200, _int)
    #: A concurrency-bound model keeps ceil(cap * this) tasks ready (balancer.dispatch.ready); 0: no ready lists.
    ready_per_slot: float = _setting(
        "tasks a concurrency-bound model keeps ready, per slot, for its next free slots (0: off)", 3.0,
        partial(_number, valid=lambda v: 0 <= v <= 10, expected="a number from 0 to 10"))
    ready_ttl: float = _setting("seconds a ready task waits for its model's slot before it goes back to pending", 5.0,
                                partial(_seconds, low=0.1, high=3600))
    #: PostgreSQL connections one process keeps open and never exceeds (balancer.storage.db).
    db_pool_size: int = _setting(
        "PostgreSQL connections each process keeps open and never exceeds (its threads share them)", 5,
        partial(_int, maximum=100))
    max_attempts: int = _setting("backend attempts before a task is marked failed", 5, _int)
    max_retry_after: float = _setting(
        "seconds a 429's Retry-After pauses its model at most (a longer one is capped, and logged)", 60.0,
        partial(_seconds, low=1, high=86_400))
    expected_output_tokens: int = _setting("output tokens assumed when estimating a prompt", 256, _int)
    max_prompt_bytes: int = _setting(
        "longest prompt (UTF-8 bytes) a task may have, from a JSONL line or a source table's row (a longer one is "
        "refused with its reason, never read into memory)", 1024 * 1024, partial(_int, maximum=4 * 1024 * 1024))
    max_source_chars: int = _setting("longest source name (characters) a JSONL line, the inbox or --source may give",
                                     256, partial(_int, maximum=1024))
    expected_latency_s: float = _setting(
        "latency prior (median, seconds) of a model with no measured calls and no expected_latency_s", 30.0,
        partial(_seconds, low=0.01, high=3600))
    end_game: bool = _setting(
        "on: the last tasks go where they finish soonest (balancer.dispatch.endgame); off: greedy to the end", True,
        _switch)
    source_fairness: bool = _setting(
        "on: fill the dispatch window across sources by weight (balancer.sources.fairshare); off: priority, then age",
        True, _switch)
    consumers_required: bool = _setting(
        "on: the dispatcher sends work only to models a live worker consumes (balancer.calls.consumers); "
        "off: to any model (tests that run no worker)", True, _switch)
    dedup: bool = _setting(
        "on: every new task may take the answer of an identical solved task instead of a call", False, _switch)
    hedge_budget: float = _setting("share of the run's tokens that hedges of straggling calls may use (0: none)", 0.05,
                                   _share)
    max_hedges: int = _setting("hedges per task at most", 1, partial(_int, minimum=0))
    dispatch_tick: float = _setting("seconds between periodic dispatch ticks (freed slots also ask for a dispatch)",
                                    1.0, partial(_seconds, low=0.05, high=3600))
    sweep_tick: float = _setting(
        "seconds between sweep ticks (return tasks past their deadline, repair quota drift)", 10.0,
        partial(_seconds, low=0.1, high=86_400))
    ingest_tick: float = _setting("seconds between inbox and source table polls", 5.0,
                                  partial(_seconds, low=0.1, high=86_400))
    source_lock_timeout: float = _setting(
        "seconds a read or write-back of a source table waits for a lock the team holds before it gives up until "
        "its next turn (PostgreSQL's lock_timeout)", 2.0, partial(_seconds, low=0.01, high=3600))
    source_statement_timeout: float = _setting(
        "seconds one read or write-back statement on a source table may run (PostgreSQL's statement_timeout)", 30.0,
        partial(_seconds, low=0.1, high=3600))
    writeback_tick: float = _setting(
        "seconds the dispatcher's write-back loop waits when no ended task of a source table is waiting", 0.2,
        partial(_seconds, low=0.01, high=3600))
    writeback_attempts: int = _setting(
        "times a source table may refuse one row's write-back (a CHECK, a value too long) before it is left "
        "unwritable (a transient failure, its database away, is retried without limit)", 5,
        partial(_int, maximum=1000))
    router_token: str | None = _setting(
        "bearer token the router requires (required when it binds beyond loopback; never logged)", None, _text,
        secret=True)
    router_lease_seconds: float = _setting("how long a router admission lives without a heartbeat", 30.0,
                                           partial(_seconds, low=1, high=86_400))
    metrics_token: str | None = _setting(
        "bearer token `balancer metrics` requires, when set (a scrape config's authorization; never logged)", None, _text,
        secret=True)
    web_token: str | None = _setting(
        "token the web console requires, as a bearer token or a basic-auth password (required when it binds "
        "beyond loopback; never logged)", None, _text, secret=True)

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
        (:data:`balancer.calls.solver.SOLVE_DEADLINE`). So the check is
        that limit against the visibility timeout. (A call's lease need not
        outlast the call: the heartbeat renews it, see
        :mod:`balancer.calls.heartbeat`; and a redelivered message does not
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
            check_url("BALANCER_DATABASE_URL", database_url, POSTGRES_SCHEMES)
            check_database_url("BALANCER_DATABASE_URL", database_url)
            database_url = normalize_database_url(database_url)
        redis_url = env.get("BALANCER_REDIS_URL") or None
        if redis_url:
            check_redis_url("BALANCER_REDIS_URL", redis_url)
        broker_url = env.get("BALANCER_BROKER_URL") or None
        if broker_url:
            check_broker_url("BALANCER_BROKER_URL", broker_url)
        backend_url = env.get("BALANCER_BACKEND_URL") or cls.backend_url
        check_url("BALANCER_BACKEND_URL", backend_url, ("http", "https"))
        if not urlsplit(backend_url).hostname:
            raise ConfigError(f"BALANCER_BACKEND_URL has no host: {mask_url(backend_url)}")
        kind = env.get("BALANCER_BACKEND_KIND") or cls.backend_kind
        if kind not in BACKEND_KINDS:
            raise ConfigError(
                f"BALANCER_BACKEND_KIND must be one of {', '.join(BACKEND_KINDS)}, got {printable(kind)!r}"
            )
        namespace = env.get("BALANCER_NAMESPACE") or cls.namespace
        if not _NAMESPACE.match(namespace):
            raise ConfigError(f"BALANCER_NAMESPACE must match {_NAMESPACE.pattern}, got {printable(namespace)!r}")
        read = {f.name: f.metadata["read"](variable(f.name), f.default) for f in fields(cls) if f.metadata["read"]}
        settings = cls(
            redis_url=redis_url,
            database_url=database_url,
            broker_url=broker_url,
            backend_url=backend_url,
            backend_kind=kind,
            namespace=namespace,
            **read,
        )
        return settings


#: Every environment variable the package reads, with a one-line meaning.
ENVIRONMENT: dict[str, str] = {variable(f.name): f.metadata["meaning"] for f in fields(Settings)}
