"""The team's database: its URL and engine, a connection within the source's time limits,
and its errors in one line without a secret (:mod:`balancer.sources.catalog` runs the SQL)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from balancer.errors import ConfigError, ServiceUnavailable, printable
from balancer.settings import Settings
from balancer.sources.definition import SourceDef
from balancer.storage.db import cached_engine
from balancer.urls import mask_url, normalize_database_url, scrub


def team_url(definition: SourceDef, own_url: str) -> str:
    """The URL of the source's database: its ``database_url_env`` variable's value, or balancer's own."""
    if definition.database_url_env is None:
        return own_url
    url = os.environ.get(definition.database_url_env)
    if not url:
        raise ConfigError(f"source {definition.name}: the environment variable {definition.database_url_env} "
                          "(its database URL) is not set")
    normalize_database_url(url, definition.database_url_env)  # another scheme: the error names this variable
    return url


def team_engine(definition: SourceDef, own: Engine) -> Engine:
    """An engine on the source's database (``own`` when it is balancer's)."""
    if definition.database_url_env is None:
        return own
    return cached_engine(team_url(definition, ""), pool_size=2, variable=definition.database_url_env)


def describe(definition: SourceDef, exc: BaseException) -> str:
    """A database error in one line, without any secret of the source's URL."""
    text = str(getattr(exc, "orig", exc)).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    if definition.database_url_env is not None:
        url = os.environ.get(definition.database_url_env, "")
        if url:
            first = scrub(first, url)
    return printable(first, 300)


@dataclass(frozen=True)
class TimeLimits:
    """How long a statement on the team's table may wait for the team's lock, and run: the
    team's database must never hold balancer's threads (``BALANCER_SOURCE_LOCK_TIMEOUT``,
    ``BALANCER_SOURCE_STATEMENT_TIMEOUT``)."""

    lock_s: float = Settings.source_lock_timeout
    statement_s: float = Settings.source_statement_timeout

    @classmethod
    def of(cls, settings: Settings) -> TimeLimits:
        return cls(settings.source_lock_timeout, settings.source_statement_timeout)

    def apply(self, conn: Connection, *, local: bool) -> None:
        """Set both limits on ``conn``: for its transaction (``local``) or its session."""
        conn.exec_driver_sql("SELECT set_config('lock_timeout', %s, %s), set_config('statement_timeout', %s, %s)",
                             (f"{max(1, round(self.lock_s * 1000))}ms", local,
                              f"{max(1, round(self.statement_s * 1000))}ms", local))


@contextmanager
def team_connection(definition: SourceDef, own: Engine, limits: TimeLimits | None = None) -> Iterator[Connection]:
    """A connection on the source's database; an unreachable one is a one-line :class:`ServiceUnavailable`.
    On the team's own database, every statement of the session has ``limits``; on balancer's,
    :func:`read_rows` sets them for its transaction (a pooled session of balancer's keeps its own)."""
    engine = team_engine(definition, own)
    try:
        conn = engine.connect()
        if definition.database_url_env is not None:
            (limits or TimeLimits()).apply(conn, local=False)
            conn.commit()
    except DBAPIError as exc:
        where = mask_url(team_url(definition, "")) if definition.database_url_env else "balancer's database"
        raise ServiceUnavailable(f"source {definition.name}: cannot reach {where}: {describe(definition, exc)}") from None
    with conn:
        yield conn


@contextmanager
def read_only(conn: Connection, limits: TimeLimits | None = None, *, snapshot: bool = False) -> Iterator[Connection]:
    """A ``READ ONLY`` transaction on ``conn`` within ``limits`` (None: the session's own)
    (``snapshot``: one snapshot for all its statements, ``REPEATABLE READ``), rolled back at
    its end, so that a setting a ``where`` changed for the session (``set_config(..., false)``)
    goes with it."""
    with conn.begin() as transaction:
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY" if snapshot
                             else "SET TRANSACTION READ ONLY")
        if limits is not None:
            limits.apply(conn, local=True)
        yield conn
        transaction.rollback()
