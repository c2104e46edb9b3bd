"""Connected clients built from :class:`~balancer.settings.Settings`.

The one place that turns connection failures into one-line errors naming the
masked URL. It needs both URLs set: filling unset ones with the embedded stack
is the CLI's job (:func:`balancer.cli.resolved_settings`), never production's.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from sqlalchemy.engine import Engine

from balancer.admission import AdmissionCore, LeaseSeed, keys
from balancer.domain.quota import Quota
from balancer.errors import ConfigError, ServiceUnavailable, Unreachable
from balancer.settings import Settings
from balancer.storage.db import cached_engine
from balancer.storage.leases import in_flight_leases
from balancer.storage.quotas import QuotaStore
from balancer.urls import mask_url, scrub


def delete_namespace_keys(client: redis.Redis, namespace: str) -> int:
    """Delete a namespace's keys: admission state ``{ns}*`` and broker keys ``ns:*``.

    Only for namespaces the caller created (tests, the demo); never anything else.
    """
    deleted = 0
    for pattern in keys.namespace_patterns(namespace):
        batch = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += client.delete(*batch)
                batch = []
        if batch:
            deleted += client.delete(*batch)
    return deleted


def redis_client(url: str, *, check: bool = True) -> redis.Redis:
    try:
        # Timeouts on connect and on every reply: a Redis that accepts but never
        # answers must fail a call, not hang a worker thread for ever.
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10, health_check_interval=30)
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


@dataclass
class Services:
    """The handles a command or task needs, made once per process."""

    settings: Settings
    redis: redis.Redis
    engine: Engine
    core: AdmissionCore
    quotas: QuotaStore

    @classmethod
    def connect(cls, settings: Settings, *, check: bool = True, pre_ping: bool = True) -> Services:
        if not settings.redis_url or not settings.database_url:
            missing = "BALANCER_REDIS_URL" if not settings.redis_url else "BALANCER_DATABASE_URL"
            raise ConfigError(f"{missing} is not set")
        client = redis_client(settings.redis_url, check=check)
        engine = cached_engine(settings.database_url, pre_ping=pre_ping, pool_size=settings.db_pool_size)
        core = AdmissionCore(
            client,
            settings.namespace,
            lease_ms=settings.lease_seconds * 1000,
            base_quantum=settings.base_quantum,
        )
        store = QuotaStore(engine, live=core)
        services = cls(settings, client, engine, core, store)
        core.restore_source = services.restore_source
        return services

    def restore_source(self) -> tuple[list[Quota], list[LeaseSeed]]:
        """What Redis gets back after losing its data: PostgreSQL's quotas and in-flight leases."""
        return self.quotas.all(), self.in_flight_leases()

    def in_flight_leases(self) -> list[LeaseSeed]:
        return in_flight_leases(self.engine, self.settings.lease_seconds * 1000)
