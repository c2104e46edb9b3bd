"""How a read query runs: SQL text declared once, on a SQLAlchemy engine or connection, or on
``status``'s read-only psycopg2 snapshot (:mod:`balancer.storage.dbapi`), without SQLAlchemy.

A read query is a constant string with pyformat parameters (``%(name)s``), bound by psycopg2
on either path: a SQLAlchemy :class:`~sqlalchemy.engine.Connection`'s ``exec_driver_sql``
hands the string and its parameters to psycopg2's cursor as they are, and the snapshot does the
same. So the rows are psycopg2's own values on both paths (``numeric`` as ``Decimal``, arrays as
lists), read by position. A query's text holds no literal ``%``.

The web console, the metrics exporter, ``top`` and the dispatcher pass their engine (each read
checks out a connection of the pool) or a connection in their own transaction; ``status`` passes
its snapshot, whose reads all see one transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Reads(Protocol):
    """What runs a read: a SQLAlchemy ``Connection``, or :class:`balancer.storage.dbapi.ReadOnlyConnection`."""

    def exec_driver_sql(self, statement: str, parameters: Mapping[str, Any]) -> Iterable[Sequence[Any]]: ...


class Connects(Protocol):
    """What gives a connection that runs reads: a SQLAlchemy ``Engine``."""

    def connect(self) -> AbstractContextManager[Reads]: ...


#: Where a read runs: an engine (a pooled connection for the read) or a connection (in its transaction).
RowSource = Reads | Connects


@contextmanager
def reading(db: RowSource) -> Iterator[Reads]:
    """``db`` itself when it runs reads, else a connection of its own for the ``with`` block."""
    if isinstance(db, Reads):
        yield db
        return
    with db.connect() as conn:
        yield conn


def fetch(db: RowSource, statement: str, parameters: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """Every row of ``statement``, as tuples."""
    with reading(db) as conn:
        return [tuple(row) for row in conn.exec_driver_sql(statement, parameters or {})]


def count(db: RowSource, statement: str, parameters: Mapping[str, Any] | None = None) -> int:
    """The one number ``statement`` (``SELECT count(*) ...``) answers."""
    [(value,)] = fetch(db, statement, parameters)
    return int(value)
