"""PostgreSQL without SQLAlchemy: ``status``'s one read-only connection (psycopg2), and what
every connection of balancer's shares with it: libpq's options, and a refused connection as one line.

``status`` is a process that reads and exits, so it pays for SQLAlchemy's import (its
cost: docs/benchmark-history.md, ``balancer status --json``) and gets nothing from a pool. Its reads are the same SQL constants the engine
runs (:mod:`balancer.storage.rows`), all in one ``REPEATABLE READ READ ONLY`` transaction:
one snapshot, so the counts, the spend and the ETA's inputs agree with each other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import psycopg2
from psycopg2.extensions import QueryCanceledError, parse_dsn

from balancer.errors import ServiceUnavailable, Unreachable
from balancer.urls import mask_url, scrub


def connect_args(own_options: str) -> dict[str, Any]:
    """libpq's options on every connection, with the URL's own ``options`` (e.g. a
    ``search_path``) kept in front. connect_timeout: a server that accepts but never
    answers fails in 5 s, not never. TCP keepalives: a connection whose server vanished
    (no RST) is found dead in about 25 s. statement_timeout: no query of ours runs for a minute.
    What a database's or role's own settings must not change in what we read and write (a
    team's database may be anyone's): UTF-8 text whatever the database's encoding (a SQL_ASCII
    database's bytes are UTF-8 to us, not ASCII), and a float's text exact (a key of type
    ``float8`` read back as the row it names, whatever ``extra_float_digits`` the database sets).

    >>> connect_args("-csearch_path=s")["options"]
    '-csearch_path=s -c statement_timeout=60000 -c extra_float_digits=3'
    """
    return {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
            "keepalives_count": 3, "client_encoding": "UTF8",
            "options": f"{own_options} -c statement_timeout=60000 -c extra_float_digits=3".strip()}


#: libpq's words for a server that is down, starting or out of reach (not a bad
#: URL, user or password): a process starting waits for it.
MAY_COME_BACK = ("connection refused", "timeout expired", "timed out", "the database system is starting up",
                 "the database system is shutting down", "server closed the connection", "no route to host",
                 "network is unreachable", "connection reset")


#: What to do about a server that answered but refused us, by the words of its refusal (the
#: role's name is masked with the rest of the URL's user part, so the hint says which it is).
REFUSAL_HINTS = (
    (re.compile(r"FATAL:\s+role .* does not exist"),
     "the URL's user is no role on that server: create it (createuser NAME) or name another"),
    (re.compile(r"FATAL:\s+database .* does not exist"), "create it (createdb -O USER NAME), or name another in the URL"),
    (re.compile(r"password authentication failed"), "check the URL's user and password"),
)


def describe_connect_error(url: str, exc: Exception) -> ServiceUnavailable:
    """Turn a driver error into one line that names the masked URL, never the password, and
    what to do when the server refused us (:data:`REFUSAL_HINTS`).

    >>> refused = Exception('connection to server at "db" failed: FATAL:  role "bob" does not exist')
    >>> print(str(describe_connect_error("postgresql://bob@db/app", refused)).split(": ", 2)[2])
    FATAL:  role "***" does not exist: the URL's user is no role on that server: create it (createuser NAME) or name another
    """
    detail = str(getattr(exc, "orig", exc)).strip().splitlines()
    first = scrub(detail[0] if detail else type(exc).__name__, url)
    kind = Unreachable if any(sign in first.lower() for sign in MAY_COME_BACK) else ServiceUnavailable
    hint = next((f": {hint}" for words, hint in REFUSAL_HINTS if words.search(first)), "")
    return kind(f"cannot reach PostgreSQL at {mask_url(url)} (BALANCER_DATABASE_URL): {first}{hint}")


class ReadOnlyConnection:
    """One psycopg2 connection whose reads run in one read-only ``REPEATABLE READ`` transaction
    (begun by the first read); it runs :mod:`balancer.storage.rows`' reads as a SQLAlchemy
    connection does. A lost or refused connection is one line (:func:`describe_connect_error`)."""

    def __init__(self, connection: Any, url: str) -> None:
        self._connection = connection
        self._url = url

    def exec_driver_sql(self, statement: str, parameters: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        try:
            with self._connection.cursor() as cursor:
                cursor.execute(statement, parameters)
                return cursor.fetchall()
        except QueryCanceledError as exc:  # past statement_timeout: reached, but too slow
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ServiceUnavailable(f"PostgreSQL at {mask_url(self._url)} did not answer a read in time: {first}") from None
        except psycopg2.OperationalError as exc:  # lost
            raise describe_connect_error(self._url, exc) from None

    def close(self) -> None:
        """Ends the transaction (nothing was written) and the connection."""
        self._connection.close()


def connect_read_only(url: str) -> ReadOnlyConnection:
    """A :class:`ReadOnlyConnection` to ``url`` (a ``BALANCER_DATABASE_URL``, its driver named or not)."""
    params = parse_dsn("postgresql://" + url.partition("://")[2])
    params.update(connect_args(params.pop("options", "")))
    try:
        connection = psycopg2.connect(**params)
    except psycopg2.OperationalError as exc:
        raise describe_connect_error(url, exc) from None
    connection.set_session(isolation_level="REPEATABLE READ", readonly=True)
    return ReadOnlyConnection(connection, url)
