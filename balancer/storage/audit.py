"""Audit tables: who changed what, old → new, when.

Every change an operator (or balancer itself) makes to something declared, a
model's quota (``quota_changes``) or a source (``source_changes``), is one row
of an audit table: the thing changed (the table's *subject* column: ``model``,
``source``), when, by whom, the action, and its value before and after as JSON.
:func:`audit_table` declares that shape once; :func:`record` writes a row in the
caller's transaction, and the reads below find them again.
"""

from __future__ import annotations

import getpass
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, DateTime, MetaData, Table, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection, Row


def audit_table(name: str, subject: str, metadata: MetaData) -> Table:
    """The audit table ``name`` of the things named in its ``subject`` column."""
    return Table(
        name,
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=True),
        Column(subject, Text, nullable=False),
        Column("changed_at", DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        Column("changed_by", Text, nullable=False),
        Column("action", Text, nullable=False),
        Column("old_value", JSONB, nullable=True),
        Column("new_value", JSONB, nullable=True),
        info={"audit_subject": subject},
    )


def subject_of(table: Table) -> sa.Column[Any]:
    """The column naming what an audit table's row changed."""
    return table.c[table.info["audit_subject"]]


def default_actor() -> str:
    """Who changes something when no ``--by`` says: the OS user."""
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return "unknown"


def record(conn: Connection, table: Table, subject: str, *, by: str, action: str,
           old: Mapping[str, Any] | None = None, new: Mapping[str, Any] | None = None) -> None:
    """One audit row in the caller's transaction: ``by`` did ``action`` to ``subject``, ``old`` → ``new``."""
    conn.execute(sa.insert(table).values({
        subject_of(table): subject, table.c.changed_by: by, table.c.action: action,
        table.c.old_value: None if old is None else dict(old), table.c.new_value: None if new is None else dict(new),
    }))


def history(conn: Connection, table: Table, subject: str | None = None) -> list[dict[str, Any]]:
    """Every row (of ``subject``, or of all), oldest first."""
    query = sa.select(table).order_by(table.c.id)
    if subject is not None:
        query = query.where(subject_of(table) == subject)
    return [dict(r._mapping) for r in conn.execute(query)]


def last_per_subject(table: Table, *where: sa.ColumnElement[bool]) -> sa.Select[Any]:
    """Each subject's last row among those matching ``where``."""
    latest = sa.select(sa.func.max(table.c.id)).where(*where).group_by(subject_of(table))
    return sa.select(table).where(table.c.id.in_(latest))


def last(conn: Connection, table: Table, subject: str, action: str) -> Row[Any] | None:
    """``subject``'s last row of ``action``, if any."""
    return conn.execute(sa.select(table).where(subject_of(table) == subject, table.c.action == action)
                        .order_by(table.c.id.desc()).limit(1)).first()
