"""What a source's table is, whatever its spelling: checked at ``source import``.

A table is named in a sources file as ``s3``, ``public.s3`` or through a view
over it; balancer resolves the name to the relations it reads, each written
``SYSTEM:DATABASE:OID`` (the server's system identifier, the database's oid,
the table's oid; a partition as its partitioned table, a view as every table
it reads, through its rewrite rule's dependencies). Two sources whose
relations meet read the same rows, and are refused
(:func:`balancer.sources.store.import_sources`), as is a source on one of
balancer's own tables (:func:`own_relations`).

A view has no index, so its key is unique only through the table it reads:
a view is accepted when it reads one table, its plan is a plain scan of it
(no join, union, DISTINCT or aggregate: each view row is one table row), and
its key is a column of that table with a unique index of its own.

The ``solved`` and ``failed`` values a source writes into its status column
are checked against that column (:func:`check_status_values`): its type, its
length and the CHECK constraints on it alone, evaluated on the value in a
SELECT, as its UPDATE would, without writing anything.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from psycopg2 import sql
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from balancer.errors import printable
from balancer.sources.definition import SourceDef, SourceFileError
from balancer.sources.teamdb import describe
from balancer.sources.window import _render, _table

# The relations each of ``oids`` reads: itself, or for a view (or a materialized
# view), what its rewrite rule depends on, recursively; a partition as its root.
_READS = """
WITH RECURSIVE reads(start, rel) AS (
    SELECT s, s FROM unnest(CAST(%(oids)s AS oid[])) AS s
    UNION
    SELECT reads.start, d.refobjid FROM reads
    JOIN pg_rewrite r ON r.ev_class = reads.rel
    JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
                    AND d.refclassid = 'pg_class'::regclass AND d.refobjid <> reads.rel
)
SELECT DISTINCT reads.start, coalesce(pg_partition_root(c.oid), c.oid)::oid AS base
FROM reads JOIN pg_class c ON c.oid = reads.rel WHERE c.relkind IN ('r', 'p', 'f')
"""
_SYSTEM = "SELECT system_identifier::text FROM pg_control_system()"
_SERVER = "SELECT coalesce(host(inet_server_addr()), 'local') || '/' || coalesce(inet_server_port(), 0)"
_DATABASE = "SELECT oid FROM pg_database WHERE datname = current_database()"
_UNIQUE = """
SELECT 1 FROM pg_index WHERE indrelid = %s AND indisunique AND indpred IS NULL AND indexprs IS NULL
AND indnkeyatts = 1 AND indkey[0] = %s
"""
_ATTNUM = "SELECT attnum FROM pg_attribute WHERE attrelid = %s AND attname = %s AND attnum > 0 AND NOT attisdropped"
_NAME = "SELECT CAST(CAST(%s AS regclass) AS text)"
#: The plain scans a view's plan may be: each row of the view is one row of its table.
_SCANS = {"Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan", "Tid Scan", "Tid Range Scan"}
#: ``alias.column`` in a plan's output, either part possibly quoted.
_OUTPUT = re.compile(r'^(?:"(?:[^"]|"")+"|[^".]+)\.("(?:[^"]|"")+"|[^".]+)$')


def _database(conn: Connection) -> str:
    """This database's identity: the server's system identifier (or, where the role may
    not read it, its address) and the database's oid."""
    try:
        with conn.begin_nested():
            server = conn.exec_driver_sql(_SYSTEM).scalar_one()
    except DBAPIError:
        server = conn.exec_driver_sql(_SERVER).scalar_one()
    return f"{server}:{conn.exec_driver_sql(_DATABASE).scalar_one()}"


def base_tables(conn: Connection, oids: list[int]) -> dict[int, list[int]]:
    """The tables each of ``oids`` reads (itself for a table), by oid, in the caller's transaction."""
    found: dict[int, list[int]] = {oid: [] for oid in oids}
    for start, base in conn.exec_driver_sql(_READS, {"oids": list(oids)}):
        found[int(start)].append(int(base))
    return {oid: sorted(bases) for oid, bases in found.items()}


def identities(conn: Connection, oids: list[int]) -> list[str]:
    """Tables of this database as ``SYSTEM:DATABASE:OID``."""
    database = _database(conn)
    return sorted(f"{database}:{oid}" for oid in oids)


class TableReplaced(LookupError):
    """The source's table name reads other tables than at its import (dropped and created again,
    restored from a dump): nothing it was checked for holds of them until it is imported again."""


_REGCLASS = "SELECT CAST(to_regclass(%s) AS oid)"


def check_same_table(conn: Connection, definition: SourceDef, table_sql: str, recorded: Sequence[str]) -> None:
    """The tables ``table_sql`` (the source's table, quoted) reads now are those its import recorded
    (``recorded``, as :func:`identities` writes them), compared by database and table oid (a server
    reached at another address is the same server). :class:`TableReplaced` otherwise; nothing to
    compare when the import recorded none, or the name reads nothing now (said as gone elsewhere)."""
    oid = conn.exec_driver_sql(_REGCLASS, (table_sql,)).scalar_one()
    if not recorded or oid is None:
        return
    database = conn.exec_driver_sql(_DATABASE).scalar_one()
    now = {f"{database}:{base}" for base in base_tables(conn, [int(oid)])[int(oid)]}
    if now != {":".join(r.rsplit(":", 2)[-2:]) for r in recorded}:
        raise TableReplaced(f"table {printable(definition.table, 130)} is not the table the source's import checked "
                            "(dropped and created again, or restored, since): nothing is read from it or written to "
                            f"it until `balancer source import` checks it again")


def own_relations(conn: Connection, names: list[str]) -> dict[str, str]:
    """The tables balancer's own tables and views (``names``, found on its search path)
    are and read, as ``SYSTEM:DATABASE:OID``, each mapped to the name of balancer's it is."""
    oids: dict[int, str] = {}
    for name in names:
        oid = conn.exec_driver_sql("SELECT CAST(to_regclass(quote_ident(%s)) AS oid)", (name,)).scalar_one()
        if oid is not None:
            oids[int(oid)] = name
    database = _database(conn)
    own: dict[str, str] = {}
    for oid, bases in base_tables(conn, list(oids)).items():
        for base in bases:  # a table under its own name, rather than a view's that reads it
            if base == oid or f"{database}:{base}" not in own:
                own[f"{database}:{base}"] = oids[oid]
    return own


def _plan_key_column(plan: dict[str, Any]) -> str | None:
    """The table column a plain scan outputs first (the view's key), unquoted; None if the
    plan is not one plain scan or its first output is not a plain column."""
    if plan.get("Node Type") not in _SCANS or not plan.get("Output"):
        return None
    match = _OUTPUT.match(plan["Output"][0])
    if match is None:
        return None
    column = match.group(1)
    return column[1:-1].replace('""', '"') if column.startswith('"') else column


def view_column(conn: Connection, view_sql: str) -> str | None:
    """The table column a view's one-column SELECT (``view_sql``) reads, as its plan shows it; None if the
    plan is not one plain scan or the column is computed."""
    plan = conn.exec_driver_sql("EXPLAIN (VERBOSE, FORMAT JSON) " + view_sql).scalar_one()
    return _plan_key_column((plan[0] if isinstance(plan, list) else plan)["Plan"])


def check_view_key(conn: Connection, definition: SourceDef, view_sql: str, bases: list[int]) -> None:
    """A view's key is unique: it reads one table, its plan is a plain scan of it, and its
    key is a column of that table with a unique index of its own. :class:`SourceFileError` otherwise."""
    name, table = definition.name, printable(definition.table, 130)
    if len(bases) != 1:
        raise SourceFileError(f"sources.{name}: view {table} reads {len(bases)} tables, so its key "
                              f"{definition.key!r} cannot be shown unique: declare the table itself")
    [base] = bases
    column = view_column(conn, view_sql)
    attnum = None if column is None else conn.exec_driver_sql(_ATTNUM, (base, column)).scalar()
    if attnum is None or conn.exec_driver_sql(_UNIQUE, (base, attnum)).first() is None:
        under = conn.exec_driver_sql(_NAME, (base,)).scalar_one()
        raise SourceFileError(f"sources.{name}: the key {definition.key!r} of view {table} is not a column of "
                              f"{printable(under, 130)} with a unique index of its own (a view that joins, "
                              "unions, groups or computes its key may repeat it): declare the table itself")


def key_is_unique(conn: Connection, oid: int, attnum: int) -> bool:
    """Whether column ``attnum`` of relation ``oid`` has a unique index of its own."""
    return conn.exec_driver_sql(_UNIQUE, (oid, attnum)).first() is not None


# A column's type as SQL, whether it is NOT NULL, its type's type ('c': composite) and category
# ('S': a string type, or a domain over one).
_COLUMN = """
SELECT format_type(a.atttypid, a.atttypmod), a.attnotnull, t.typtype, t.typcategory
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid WHERE a.attrelid = %s AND a.attname = %s
"""
# The CHECK constraints of a table on one column alone, as SQL over that column.
_COLUMN_CHECKS = """
SELECT 'CHECK ' || c.conname, pg_get_expr(c.conbin, c.conrelid) FROM pg_constraint c
JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
WHERE c.conrelid = %s AND c.contype = 'c' AND cardinality(c.conkey) = 1 AND a.attname = %s ORDER BY c.conname
"""
# A partition's constraint when its partitioned table is partitioned by the status column alone:
# a write-back may move its row out, which PostgreSQL refuses on the partition itself.
_PARTITION_BY_STATUS = """
SELECT 'partition constraint', pg_get_partition_constraintdef(c.oid)
FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid JOIN pg_partitioned_table p ON p.partrelid = i.inhparent
JOIN pg_class root ON root.oid = p.partrelid AND NOT root.relispartition
JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0]
WHERE c.oid = %s AND c.relispartition AND p.partnatts = 1 AND a.attname = %s
  AND pg_get_partition_constraintdef(c.oid) IS NOT NULL
"""
_OPTIONS = "SELECT reloptions FROM pg_class WHERE oid = to_regclass(%s)"
#: SQLSTATE of a write tried in a READ ONLY transaction: a CHECK whose function writes.
_READ_ONLY = "25006"


def _catalog_sql(text: str) -> sql.Composable:
    """SQL text from the catalog (a type, a CHECK's expression), its ``%`` kept from psycopg2's parameters."""
    return sql.SQL(text.replace("%", "%%"))


# A rule that does a table's UPDATE instead (ev_type '2': UPDATE).
_UPDATE_INSTEAD = "SELECT rulename FROM pg_rewrite WHERE ev_class = %s AND ev_type = '2' AND is_instead LIMIT 1"


def check_usable(conn: Connection, definition: SourceDef, oid: int, relkind: str) -> None:
    """What of table ``oid`` the source cannot use: a bytea prompt (its text is hex), a cursor column
    that may be NULL (such a row is never read), a key or cursor of a composite type (a position is
    bound as text, which a composite does not take: every read would fail), a rule doing a table's
    UPDATE instead (a write-back would land elsewhere, its row left as it was).
    :class:`SourceFileError` in one line."""
    name, table = definition.name, printable(definition.table, 130)
    if relkind in ("r", "p") and (rule := conn.exec_driver_sql(_UPDATE_INSTEAD, (oid,)).scalar()) is not None:
        raise SourceFileError(f"sources.{name}: table {table} has the rule {printable(rule, 60)!r} doing its UPDATE "
                              "instead: a write-back would land elsewhere, its row left as it was (declare the table "
                              "the rule writes to, or drop the rule)")

    def column(col: str) -> Any:
        return conn.exec_driver_sql(_COLUMN, (oid, col)).one()

    if column(definition.prompt)[0] == "bytea":
        raise SourceFileError(f"sources.{name}: prompt column {definition.prompt!r} is bytea: its text would be "
                              "its bytes in hex, not the prompt (a view that decodes it, convert_from(...), can be "
                              "the source)")
    if definition.cursor and relkind != "v" and not column(definition.cursor)[1]:
        raise SourceFileError(f"sources.{name}: cursor column {definition.cursor!r} of {table} may be "
                              "NULL (a row with a NULL there would never be read): give a NOT NULL column")
    for col in definition.order:
        kind, _, typtype, _ = column(col)
        if typtype == "c":
            raise SourceFileError(f"sources.{name}: column {col!r} of {table}, which orders its reads, is of the "
                                  f"composite type {printable(kind, 60)}: a read's position cannot be bound to it "
                                  "(a view giving the key as text, or its fields as columns, can be the source)")


def check_option_note(conn: Connection, definition: SourceDef) -> str | None:
    """A note for the import of a view WITH CHECK OPTION: a written row must still be one of its
    rows, so if its condition reads a column a write-back sets (the status, say), each write-back
    is refused and left unwritable. None: not such a view."""
    options = conn.exec_driver_sql(_OPTIONS, (_render(conn, _table(definition)),)).scalar()
    if not any(str(o).startswith("check_option=") for o in options or ()):
        return None
    return (f"note: sources.{definition.name}: view {printable(definition.table, 130)} has WITH CHECK OPTION: a "
            "written row must still be one of its rows, so if its condition reads a column the write-back sets, "
            "each write-back is refused and left unwritable (declare its table, or the view without the option)")


def check_status_values(conn: Connection, definition: SourceDef, oid: int, column: str | None) -> None:
    """The ``solved`` and ``failed`` values fit the status column (``column`` of table ``oid``: the
    source's own, or the one its view reads; None: none to check): they cast to its
    type (a domain's checks with it), are no longer than it, and no CHECK on that column alone is
    false for them or fails on them. :class:`SourceFileError` otherwise: every write-back of that
    outcome would be refused, each row left unwritable. A CHECK over several columns is left to the
    write-back, as is one that writes (this runs read-only)."""
    if column is None:
        return
    type_, _, _, category = conn.exec_driver_sql(_COLUMN, (oid, column)).one()
    checks = [*conn.exec_driver_sql(_COLUMN_CHECKS, (oid, column)), *conn.exec_driver_sql(_PARTITION_BY_STATUS,
                                                                                           (oid, column))]
    for outcome, value in (("solved", definition.solved), ("failed", definition.failed)):
        where = (f"sources.{definition.name}: {outcome} = {printable(value, 60)!r} for status column "
                 f"{definition.columns['status']!r} ({type_})")
        as_stored = sql.SQL("SELECT CAST(CAST(%s AS {}) AS text)").format(_catalog_sql(type_))
        stored = _evaluate(conn, definition, as_stored, value, where)
        # An explicit cast cuts a string to the column's length; another type may spell it otherwise
        # ('02' as 2, JSON's spacing): a retried task's write-back finds its failure by that text.
        if stored is not None and stored != (value.rstrip(" ") if category == "S" else value):
            raise SourceFileError(f"{where}: the column stores it as {printable(stored, 60)!r} (set {outcome} to a "
                                  "value the column keeps as it is written)")
        for name, check in checks:
            holds = sql.SQL("SELECT ({}) IS NOT FALSE FROM (SELECT CAST(%s AS {}) AS {}) AS balancer_check").format(
                _catalog_sql(check), _catalog_sql(type_), sql.Identifier(column))
            if _evaluate(conn, definition, holds, value, f"{where}: its table's {name}") is False:
                hint = ("declare its partitioned table, in which a row may move" if name == "partition constraint"
                        else f"set {outcome} to a value it allows")
                raise SourceFileError(f"{where}: refused by its table's {name}: {printable(check, 200)} ({hint})")


def _evaluate(conn: Connection, definition: SourceDef, query: sql.Composable, value: str, where: str) -> Any:
    """``query``'s one value with ``value`` bound; an error is :class:`SourceFileError` (None: the
    query tried to write, which the write-back may do)."""
    try:
        with conn.begin_nested():
            return conn.exec_driver_sql(_render(conn, query), (value,)).scalar_one()
    except DBAPIError as exc:
        if getattr(exc.orig, "pgcode", None) == _READ_ONLY:
            return None
        raise SourceFileError(f"{where}: {describe(definition, exc)}") from None
