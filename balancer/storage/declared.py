"""A set declared in TOML, stored in PostgreSQL and audited: what ``quota import`` and
``source import`` share.

An import makes the stored set match a file's: :func:`plan` (pure) says, name by
name, what is created, updated, removed or left unchanged; :func:`import_set` then,
in the caller's transaction, locks the stored table against another import, lets the
kind refuse, applies each change and writes one audit row per change
(:mod:`balancer.storage.audit`). What differs, how a quota or a source is read,
written, refused and what else it sets, is the kind's own (:class:`Kind`:
:mod:`balancer.quotas.store`, :mod:`balancer.sources.store`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from sqlalchemy import Table, TextClause
from sqlalchemy.engine import Connection

from balancer.storage import audit


class Declared(Protocol):
    """One declared thing: a name, and what its audit rows store of it."""

    @property
    def name(self) -> str: ...

    def as_dict(self) -> dict[str, Any]: ...


D = TypeVar("D", bound=Declared)


@dataclass
class ImportSummary:
    """An import's names by what it does to them, each list sorted."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


def plan(current: Mapping[str, Any], wanted: Mapping[str, Any], *, whole: bool) -> ImportSummary:
    """What making ``current`` match ``wanted`` does, name by name (pure). With ``whole``,
    ``wanted`` is the whole set: a name only in ``current`` is removed; else it is kept.

    >>> plan({"a": 1, "b": 1}, {"a": 2, "c": 1}, whole=True)
    ImportSummary(created=['c'], updated=['a'], removed=['b'], unchanged=[])
    >>> plan({"a": 1, "b": 1}, {"a": 1}, whole=False)
    ImportSummary(created=[], updated=[], removed=[], unchanged=['a'])
    """
    summary = ImportSummary(removed=sorted(current.keys() - wanted.keys()) if whole else [])
    for name in sorted(wanted):
        if name not in current:
            summary.created.append(name)
        else:
            (summary.unchanged if current[name] == wanted[name] else summary.updated).append(name)
    return summary


class Kind(Protocol, Generic[D]):
    """What one kind of declared thing does in the store: only what is its own."""

    #: The stored set; the statement that locks it against another import (a constant: no SQL is
    #: built from strings); its audit table; the action created ones are audited as.
    table: Table
    lock: TextClause
    changes: Table
    created: str

    def read(self, conn: Connection) -> dict[str, D]:
        """The stored set, by name."""

    def refuse(self, conn: Connection, summary: ImportSummary, current: Mapping[str, D],
               wanted: Mapping[str, D]) -> None:
        """Raise to refuse the whole import (a dry run's too), before anything is written."""

    def write(self, conn: Connection, old: D | None, new: D | None, *, by: str) -> dict[str, Any]:
        """Store one change (``new`` None: remove ``old``); what its audit row's new value adds."""

    def settle(self, conn: Connection, old: D | None, new: D, *, by: str) -> None:
        """After each one the import lists, changed or not, and its audit row."""


def change(conn: Connection, kind: Kind[D], old: D | None, new: D | None, *, by: str) -> None:
    """Store one change of ``kind`` and its audit row (``old`` → ``new``, None for none)."""
    if new is not None:
        subject = new.name
    elif old is not None:
        subject = old.name
    else:
        return  # nothing to change, nothing to audit
    added = kind.write(conn, old, new, by=by)
    action = kind.created if old is None else "remove" if new is None else "update"
    audit.record(conn, kind.changes, subject, by=by, action=action,
                 old=None if old is None else old.as_dict(),
                 new=(added or None) if new is None else new.as_dict() | added)


def import_set(conn: Connection, kind: Kind[D], wanted: Sequence[D], *, by: str, whole: bool,
               dry_run: bool = False) -> ImportSummary:
    """Make the stored set of ``kind`` match ``wanted`` (with ``whole``, remove the others) in
    the caller's transaction, one audit row per change; with ``dry_run``, write nothing.
    What it did (or would do)."""
    conn.execute(kind.lock)
    current = kind.read(conn)
    by_name = {d.name: d for d in wanted}
    summary = plan(current, by_name, whole=whole)
    kind.refuse(conn, summary, current, by_name)
    if dry_run:
        return summary
    for name in summary.removed:
        change(conn, kind, current[name], None, by=by)
    for name, new in sorted(by_name.items()):
        old = current.get(name)
        if old != new:
            change(conn, kind, old, new, by=by)
        kind.settle(conn, old, new, by=by)
    return summary
