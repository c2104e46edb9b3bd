"""Engine creation and the "is this database migrated?" check."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError, ProgrammingError

from balancer.errors import ConfigError, ServiceUnavailable, Unreachable
from balancer.settings import Settings
from balancer.urls import mask_url, normalize_database_url, scrub


def make_engine(url: str, pool_size: int = Settings.db_pool_size, **kwargs: object) -> Engine:
    """An engine for ``url`` (plain ``postgresql://`` accepted), using psycopg2,
    that opens at most ``pool_size`` connections and keeps them open."""
    url = normalize_database_url(url)
    try:
        # Worker processes run many threads; each holds a connection only for one
        # statement, so a few connections serve them all, and a thread finding
        # none free waits for one (the solver retries a pool timeout like an
        # outage). No overflow: an overflow connection is closed when returned,
        # and the next burst opens it again, which forks a PostgreSQL server
        # process each time. With 10 + 20 overflow, overhead.toml opened about
        # 700 connections for 2,000 tasks, and their set-up and teardown cost
        # more CPU than the statements (docs/benchmarks.md, the hot path, round 4).
        # Five per process keep a dozen processes inside PostgreSQL's default
        # max_connections (100).
        # connect_timeout: a server that accepts but never answers fails in 5 s, not never.
        # TCP keepalives: a connection whose server vanished (no RST) is found dead in
        # about 25 s. statement_timeout: no query of ours runs for a minute.
        # The URL's own `options` (e.g. a search_path) are kept: connect_args would replace them.
        own_options = sa.engine.make_url(url).query.get("options", "")
        if not isinstance(own_options, str):
            own_options = " ".join(own_options)
        connect_args = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
                        "keepalives_count": 3, "options": f"{own_options} -c statement_timeout=60000".strip()}
        options = {"pool_pre_ping": True, "pool_size": pool_size, "max_overflow": 0, "connect_args": connect_args, **kwargs}
        return sa.create_engine(url, **options)
    except (sa.exc.ArgumentError, ValueError) as exc:
        raise ConfigError(f"BALANCER_DATABASE_URL is malformed ({mask_url(url)}): {scrub(str(exc), url)}") from None


_ENGINES: dict[str, Engine] = {}


def cached_engine(url: str, *, pre_ping: bool = True, pool_size: int = Settings.db_pool_size) -> Engine:
    """One engine (one connection pool) per URL per process.

    ``pre_ping=False`` saves a round trip per checkout; for callers that retry
    a write when a pooled connection turns out dead (the solver), not for the
    one-shot CLI commands.
    """
    key = f"{url}#ping={pre_ping}#pool={pool_size}"
    if key not in _ENGINES:
        _ENGINES[key] = make_engine(url, pool_size, pool_pre_ping=pre_ping)
    return _ENGINES[key]


def dispose_engines() -> None:
    """Close every cached pool (tests, and workers after fork)."""
    while _ENGINES:
        _ENGINES.popitem()[1].dispose()


def describe_connect_error(url: str, exc: Exception) -> ServiceUnavailable:
    """Turn a driver error into one line that names the masked URL, never the password."""
    detail = str(getattr(exc, "orig", exc)).strip().splitlines()
    first = scrub(detail[0] if detail else type(exc).__name__, url)
    kind = Unreachable if any(sign in first.lower() for sign in _MAY_COME_BACK) else ServiceUnavailable
    return kind(f"cannot reach PostgreSQL at {mask_url(url)} (BALANCER_DATABASE_URL): {first}")


#: libpq's words for a server that is down, starting or out of reach (not a bad
#: URL, user or password): a process starting waits for it.
_MAY_COME_BACK = ("connection refused", "timeout expired", "timed out", "the database system is starting up",
                  "the database system is shutting down", "server closed the connection", "no route to host",
                  "network is unreachable", "connection reset")


def check_reachable(engine: Engine) -> None:
    url = engine.url.render_as_string(hide_password=False)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
    except OperationalError as exc:
        raise describe_connect_error(url, exc) from None


def current_revision(engine: Engine) -> str | None:
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text("select version_num from alembic_version")).scalar()
    except ProgrammingError:
        return None
