"""PostgreSQL without SQLAlchemy: what every connection of balancer's shares, libpq's options
and a refused connection as one line."""

from __future__ import annotations

from typing import Any

from balancer.errors import ServiceUnavailable, Unreachable
from balancer.urls import mask_url, scrub


def connect_args(own_options: str) -> dict[str, Any]:
    """libpq's options on every connection, with the URL's own ``options`` (e.g. a
    ``search_path``) kept in front. connect_timeout: a server that accepts but never
    answers fails in 5 s, not never. TCP keepalives: a connection whose server vanished
    (no RST) is found dead in about 25 s. statement_timeout: no query of ours runs for a minute.

    >>> connect_args("-csearch_path=s")["options"]
    '-csearch_path=s -c statement_timeout=60000'
    """
    return {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
            "keepalives_count": 3, "options": f"{own_options} -c statement_timeout=60000".strip()}


#: libpq's words for a server that is down, starting or out of reach (not a bad
#: URL, user or password): a process starting waits for it.
_MAY_COME_BACK = ("connection refused", "timeout expired", "timed out", "the database system is starting up",
                  "the database system is shutting down", "server closed the connection", "no route to host",
                  "network is unreachable", "connection reset")


def describe_connect_error(url: str, exc: Exception) -> ServiceUnavailable:
    """Turn a driver error into one line that names the masked URL, never the password."""
    detail = str(getattr(exc, "orig", exc)).strip().splitlines()
    first = scrub(detail[0] if detail else type(exc).__name__, url)
    kind = Unreachable if any(sign in first.lower() for sign in _MAY_COME_BACK) else ServiceUnavailable
    return kind(f"cannot reach PostgreSQL at {mask_url(url)} (BALANCER_DATABASE_URL): {first}")
