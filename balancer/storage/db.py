"""Engine creation, and the check that its database answers."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from balancer.errors import ConfigError
from balancer.settings import Settings
from balancer.storage.dbapi import connect_args, describe_connect_error
from balancer.urls import mask_url, normalize_database_url, scrub


def make_engine(url: str, pool_size: int = Settings.db_pool_size, *, variable: str = "BALANCER_DATABASE_URL",
                **kwargs: object) -> Engine:
    """An engine for ``url`` (plain ``postgresql://`` accepted), using psycopg2,
    that opens at most ``pool_size`` connections and keeps them open (``variable``: where
    the URL came from, named by the error for a malformed one)."""
    url = normalize_database_url(url, variable)
    try:
        # Worker processes run many threads; each holds a connection only for one
        # statement, so a few connections serve them all, and a thread finding
        # none free waits for one (the solver retries a pool timeout like an
        # outage). No overflow: an overflow connection is closed when returned,
        # and the next burst opens it again, which forks a PostgreSQL server
        # process each time. With 10 + 20 overflow, overhead.toml opened about
        # 700 connections for 2,000 tasks, and their set-up and teardown cost
        # more CPU than the statements (docs/benchmark-history.md, the hot path).
        # Five per process keep a dozen processes inside PostgreSQL's default
        # max_connections (100).
        # The URL's own `options` (e.g. a search_path) are kept: connect_args would replace them.
        own_options = sa.engine.make_url(url).query.get("options", "")
        if not isinstance(own_options, str):
            own_options = " ".join(own_options)
        options = {"pool_pre_ping": True, "pool_size": pool_size, "max_overflow": 0,
                   "connect_args": connect_args(own_options), **kwargs}
        return sa.create_engine(url, **options)
    except (sa.exc.ArgumentError, ValueError) as exc:
        raise ConfigError(f"{variable} is malformed ({mask_url(url)}): {scrub(str(exc), url)}") from None


_ENGINES: dict[str, Engine] = {}


def cached_engine(url: str, *, pre_ping: bool = True, pool_size: int = Settings.db_pool_size,
                  variable: str = "BALANCER_DATABASE_URL") -> Engine:
    """One engine (one connection pool) per URL per process.

    ``pre_ping=False`` saves a round trip per checkout; for callers that retry
    a write when a pooled connection turns out dead (the solver), not for the
    one-shot CLI commands.
    """
    key = f"{url}#ping={pre_ping}#pool={pool_size}"
    if key not in _ENGINES:
        _ENGINES[key] = make_engine(url, pool_size, variable=variable, pool_pre_ping=pre_ping)
    return _ENGINES[key]


def dispose_engines() -> None:
    """Close every cached pool (tests, and workers after fork)."""
    while _ENGINES:
        _ENGINES.popitem()[1].dispose()


def check_reachable(engine: Engine) -> None:
    url = engine.url.render_as_string(hide_password=False)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
    except OperationalError as exc:
        raise describe_connect_error(url, exc) from None

