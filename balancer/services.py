"""Connected clients built from :class:`~balancer.settings.Settings`.

With :mod:`balancer.snapshot` (its Redis client, and ``status``'s read-only snapshot without
SQLAlchemy), the one place that turns connection failures into one-line errors naming the
masked URL. It needs both URLs set: filling unset ones with the embedded stack
is the CLI's job (:func:`balancer.cli.resolved_settings`), never production's.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from sqlalchemy.engine import Engine

from balancer.admission import keys
from balancer.admission.core import AdmissionCore
from balancer.admission.quota import Quota
from balancer.admission.values import LeaseSeed
from balancer.backlog.leases import in_flight_leases
from balancer.quotas.store import QuotaStore
from balancer.settings import Settings
from balancer.snapshot import admission_core, redis_client, require_urls
from balancer.storage.db import cached_engine


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
        redis_url, database_url = require_urls(settings)
        client = redis_client(redis_url, check=check)
        engine = cached_engine(database_url, pre_ping=pre_ping, pool_size=settings.db_pool_size)
        core = admission_core(client, settings)
        store = QuotaStore(engine, live=core)
        services = cls(settings, client, engine, core, store)
        core.restore_source = services.restore_source
        return services

    @property
    def db(self) -> Engine:
        """Where the read path's queries run (:class:`balancer.snapshot.ReadServices`): the engine's pool."""
        return self.engine

    def restore_source(self) -> tuple[list[Quota], list[LeaseSeed]]:
        """What Redis gets back after losing its data: PostgreSQL's quotas and in-flight leases."""
        return self.quotas.all(), self.in_flight_leases()

    def in_flight_leases(self) -> list[LeaseSeed]:
        return in_flight_leases(self.engine, self.settings.lease_seconds * 1000)
