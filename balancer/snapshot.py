"""Connected clients without SQLAlchemy: the Redis client every process makes, and ``status``'s
read-only snapshot of the pipeline.

:class:`Snapshot` is what ``balancer status`` reads through: the settings, a Redis client, the
admission core (its live view and counters) and one read-only PostgreSQL transaction
(:mod:`balancer.storage.dbapi`). It and :class:`balancer.services.Services` (SQLAlchemy, a
pool) both have what the read path needs (:class:`ReadServices`), so ``status``, ``top``, the
console and the metrics exporter run the same reads (:mod:`balancer.storage.rows`). Like
``Services``, it needs both URLs set and turns a refused connection into one line naming the
masked URL.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import redis

from balancer.admission.core import AdmissionCore
from balancer.errors import ConfigError, ServiceUnavailable, Unreachable
from balancer.settings import Settings
from balancer.storage.dbapi import ReadOnlyConnection, connect_read_only
from balancer.storage.migrate import current_revision, require_revision
from balancer.storage.rows import RowSource
from balancer.urls import SentinelURL, is_sentinel_url, mask_url, parse_sentinel_url, scrub

#: Timeouts on connect and on every reply: a Redis that accepts but never
#: answers must fail a call, not hang a worker thread for ever.
REDIS_OPTIONS = {"socket_connect_timeout": 3, "socket_timeout": 10, "health_check_interval": 30}


def sentinel_client(target: SentinelURL) -> redis.Redis:
    """A client of the master the Sentinels name: its pool asks them for the
    master's address on every new connection, so after a failover the next
    connection (the retry of the command that failed) reaches the promoted
    replica, in every process, without a restart. A connection that finds a
    replica (the old master back as one) is dropped on its first refused write."""
    from redis.sentinel import Sentinel

    sentinels = Sentinel(list(target.sentinels), socket_connect_timeout=1, socket_timeout=1)
    return sentinels.master_for(target.master, db=target.db, username=target.username, password=target.password,
                                **REDIS_OPTIONS)


def redis_client(url: str, *, check: bool = True) -> redis.Redis:
    try:
        if is_sentinel_url(url):
            client = sentinel_client(parse_sentinel_url(url))
        else:
            client = redis.Redis.from_url(url, **REDIS_OPTIONS)
        if check:
            client.ping()
    except (redis.AuthenticationError, ValueError) as exc:  # a bad URL or password: no wait helps
        raise ServiceUnavailable(
            f"cannot reach Redis at {mask_url(url)} (BALANCER_REDIS_URL): {scrub((str(exc).splitlines() or [''])[0], url)}"
        ) from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise Unreachable(
            f"cannot reach Redis at {mask_url(url)} (BALANCER_REDIS_URL): {scrub((str(exc).splitlines() or [''])[0], url)}"
        ) from None
    except redis.ResponseError as exc:
        raise ServiceUnavailable(f"Redis at {mask_url(url)} refused us (BALANCER_REDIS_URL): {scrub(str(exc), url)}") from None
    except redis.RedisError as exc:  # e.g. not Redis at all: an HTTP server's reply is a protocol error
        raise ServiceUnavailable(
            f"no Redis at {mask_url(url)} (BALANCER_REDIS_URL): {type(exc).__name__}: "
            f"{scrub((str(exc).splitlines() or [''])[0], url)}"
        ) from None
    return client


def admission_core(client: redis.Redis, settings: Settings) -> AdmissionCore:
    """The admission core on ``client``, as ``settings`` configure it."""
    return AdmissionCore(client, settings.namespace, lease_ms=settings.lease_seconds * 1000,
                         base_quantum=settings.base_quantum)


def require_urls(settings: Settings) -> tuple[str, str]:
    """(Redis URL, database URL), or one line naming the one not set."""
    if not settings.redis_url or not settings.database_url:
        missing = "BALANCER_REDIS_URL" if not settings.redis_url else "BALANCER_DATABASE_URL"
        raise ConfigError(f"{missing} is not set")
    return settings.redis_url, settings.database_url


class ReadServices(Protocol):
    """What the read path (:mod:`balancer.views.summary`, :mod:`balancer.dispatch.budgets`,
    ``status``) needs: the settings, Redis and the admission core on it, and where PostgreSQL's reads run."""

    @property
    def settings(self) -> Settings: ...

    @property
    def redis(self) -> redis.Redis: ...

    @property
    def core(self) -> AdmissionCore: ...

    @property
    def db(self) -> RowSource: ...


@dataclass
class Snapshot:
    """``status``'s clients: every PostgreSQL read in one read-only transaction (``db``)."""

    settings: Settings
    redis: redis.Redis
    core: AdmissionCore
    db: ReadOnlyConnection


@contextmanager
def open_snapshot(settings: Settings) -> Iterator[Snapshot]:
    """A :class:`Snapshot` on a migrated schema (one line, not a traceback, when it is not, or when
    Redis or PostgreSQL cannot be reached), closed when the ``with`` block ends."""
    redis_url, database_url = require_urls(settings)
    client = redis_client(redis_url)
    try:
        db = connect_read_only(database_url)
    except BaseException:
        client.close()
        raise
    try:
        require_revision(current_revision(db))
        yield Snapshot(settings, client, admission_core(client, settings), db)
    finally:
        db.close()
        client.close()
