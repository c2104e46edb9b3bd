"""A batch of write-backs in one statement on the team's table.

The guarded, fenced UPDATE of the rows of a batch (its condition:
:func:`balancer.sources.catalog.guard`), many rows at once: their values arrive as arrays (``unnest``), each cast
to its column's type as the catalog names it (without a length: a value too
long for a ``varchar(n)`` is refused by the column, never cut), and the
statement returns which rows it wrote and whether each, written, still matches
``where``. One round trip for a batch instead of one per row.

When the table refuses a value (:func:`balancer.sources.catalog.refused_by_row`),
the batch is halved, each half in a savepoint of its own, down to the one row
that is refused: a batch of n rows with one refused row takes about 2 log2(n)
statements, not n.
"""

from __future__ import annotations

from typing import Any

from psycopg2 import sql
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from balancer.errors import printable
from balancer.sources.catalog import INSUFFICIENT_PRIVILEGE, _render, _replaces, _sets, _table, _where, guard, sqlstate
from balancer.sources.definition import SourceDef, SourceFileError
from balancer.sources.teamdb import describe

#: Each column's type by its catalog name, without its length or precision (``pg_catalog.varchar``,
#: not ``(20)``; ``pg_catalog.bpchar``, not ``character``, which a cast would read as ``character(1)``);
#: a domain's base type (a cast to a domain over ``varchar(20)`` cuts a value to 20 characters,
#: where the column's own assignment refuses it; the domain's checks hold at the assignment).
_TYPES = """
WITH RECURSIVE typed(attname, typid) AS (
  SELECT a.attname, a.atttypid FROM pg_attribute a
  WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
  SELECT typed.attname, t.typbasetype FROM typed JOIN pg_type t ON t.oid = typed.typid WHERE t.typtype = 'd')
SELECT typed.attname, quote_ident(n.nspname) || '.' || quote_ident(t.typname)
FROM typed JOIN pg_type t ON t.oid = typed.typid JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE t.typtype <> 'd'
"""


class ColumnsGone(LookupError):
    """A column the source names is no longer in its table (renamed or dropped since the import)."""


def column_types(conn: Connection, definition: SourceDef) -> dict[str, str]:
    """The source's columns and their types, as the team's catalog names them now;
    :class:`ColumnsGone` when the table or one of them is gone."""
    name = _render(conn, _table(definition))
    types = {column: kind for column, kind in conn.exec_driver_sql(_TYPES, (name,))}
    gone = [f"{column} ({role})" for role, column in definition.columns.items() if column not in types]
    if not types:
        raise ColumnsGone(f"table {definition.table} is gone (renamed or dropped since the source's import)")
    if gone:
        raise ColumnsGone(f"column(s) {', '.join(gone)} of {definition.table} are gone (renamed or dropped since "
                          "the source's import)")
    return types


class PrivilegesMissing(LookupError):
    """Balancer's role lacks a privilege a write-back needs on the source's table (revoked since the import)."""


# The columns of ARRAY (%s) on which the role lacks privilege %s of table %s.
_MISSING = "SELECT c FROM unnest(CAST(%s AS text[])) AS c WHERE NOT has_column_privilege(to_regclass(%s), c, %s)"


def check_privileges(conn: Connection, definition: SourceDef) -> None:
    """Balancer's role may UPDATE the columns a write-back sets and SELECT those its guard and ``where`` read;
    :class:`PrivilegesMissing` otherwise: the table's error, every write-back waits (a privilege
    refused with these held is a row's: a row-level security policy, a trigger)."""
    name = _render(conn, _table(definition))
    written = sorted({col for outcome in ("solved", "failed") for _, col in _sets(definition, outcome)})
    for privilege, columns in (("UPDATE", written), ("SELECT", sorted({definition.key, definition.prompt, *written}))):
        missing = [col for (col,) in conn.exec_driver_sql(_MISSING, (columns, name, privilege))]
        if missing:
            raise PrivilegesMissing(f"balancer's role may not {privilege} column(s) {', '.join(missing)} of "
                                    f"{definition.table} (a privilege revoked since the source's import)")
    # ``where`` is the team's SQL: the columns it reads are known only to PostgreSQL, which checks
    # them as it starts a statement, before (and without) reading a row.
    try:  # no savepoint: a refusal ends the batch's transaction anyway
        conn.exec_driver_sql(_render(conn, sql.SQL("SELECT 1 FROM {} WHERE false AND {}").format(
            _table(definition), _where(definition))))
    except DBAPIError as exc:
        if sqlstate(exc) != INSUFFICIENT_PRIVILEGE:
            raise
        raise PrivilegesMissing(f"balancer's role may not read what the source's where reads in {definition.table} "
                                f"({str(exc.orig).strip().splitlines()[0]})") from None


def batch_query(definition: SourceDef, outcome: str, types: dict[str, str]) -> sql.Composable | None:
    """The UPDATE of many rows ending as ``outcome``; it returns each written row's index
    and whether, written, it still matches ``where``. None: nothing to write."""
    sets = _sets(definition, outcome)
    if not sets:
        return None
    values = [sql.Identifier(f"balancer_v{i}") for i in range(len(sets))]
    assignments = sql.SQL(", ").join(
        sql.SQL("{} = CAST(balancer_v.{} AS {})").format(sql.Identifier(col), value, sql.SQL(types[col]))
        for (_, col), value in zip(sets, values, strict=True))
    arrays = sql.SQL(", ").join([sql.SQL("%s::text[]")] * (len(sets) + 2)
                                + [sql.SQL("%s::int[]"), sql.SQL("%s::boolean[]"), sql.SQL("%s::text[]")])
    table, key = _table(definition), sql.Identifier(definition.key)
    # A task ``tasks retry`` sent back may replace exactly the failure it wrote (catalog._replaces).
    replaces = _replaces(definition, sql.SQL("balancer_v.balancer_r"),
                         {"status": sql.Literal(definition.failed), "error": sql.SQL("balancer_v.balancer_re")})
    return sql.SQL(
        "UPDATE {table} SET {sets} FROM unnest({arrays}) AS balancer_v({values}, balancer_key, balancer_fp, balancer_i, "
        "balancer_r, balancer_re) WHERE {table}.{key} = CAST(balancer_v.balancer_key AS {key_type}) "
        "AND {guard} RETURNING balancer_v.balancer_i, coalesce({cond}, false)").format(
        table=table, sets=assignments, arrays=arrays, values=sql.SQL(", ").join(values), key=key,
        key_type=sql.SQL(types[definition.key]), cond=_where(definition),
        guard=guard(definition, sql.SQL("balancer_v.balancer_fp"), replaces))


class KeyNotUnique(LookupError):
    """A write-back's key matched several rows of the source's table: one row's refusal (its key's
    unique index or primary key dropped since the import), its statement undone."""


def held_elsewhere(conn: Connection, definition: SourceDef, keys: list[str], types: dict[str, str]) -> set[str]:
    """Lock the rows of ``keys`` for the caller's transaction, those no other transaction holds
    (``SKIP LOCKED``), and return the keys of the rows another one holds: their write-backs wait
    for a later pass, and the rest of the batch is written without waiting on them (a row the
    team held ``FOR UPDATE`` for minutes kept every row of its batch unwritten)."""
    table, key = _table(definition), sql.Identifier(definition.key)
    wanted = sql.SQL("{} IN (SELECT CAST(k AS {}) FROM unnest(CAST(%s AS text[])) AS k)").format(
        sql.SQL("balancer_t.{}").format(key), sql.SQL(types[definition.key]))
    query = sql.SQL("WITH balancer_mine AS (SELECT balancer_t.{key} AS k FROM {table} AS balancer_t WHERE {wanted} "
                    "FOR UPDATE OF balancer_t SKIP LOCKED) "
                    "SELECT CAST(balancer_t.{key} AS text) FROM {table} AS balancer_t WHERE {wanted} "
                    "AND balancer_t.{key} NOT IN (SELECT k FROM balancer_mine)").format(
        key=key, table=table, wanted=wanted)
    return {found for (found,) in conn.exec_driver_sql(_render(conn, query), (keys, keys))}


def write_many(conn: Connection, definition: SourceDef, outcome: str, tasks: list[dict[str, Any]],
               types: dict[str, str], rendered: dict[str, str | None]) -> dict[int, bool] | None:
    """Write ``tasks`` (all ending as ``outcome``) in one statement in the caller's transaction:
    for each task written (by its index in ``tasks``), whether its row still matches ``where``.
    None: the source writes nothing back for ``outcome``. A refused value raises."""
    if outcome not in rendered:
        query = batch_query(definition, outcome, types)
        rendered[outcome] = None if query is None else _render(conn, query)
    text = rendered[outcome]
    if text is None:
        return None
    written: dict[int, bool] = {}
    for i, matches in conn.exec_driver_sql(text, _parameters(definition, outcome, tasks)):
        if int(i) in written:  # raised inside the caller's savepoint: both rows' writes are undone
            raise KeyNotUnique(f"key {printable(str(tasks[int(i)]['key']), 100)} matches several rows of "
                               f"{printable(definition.table, 130)}: its key is no longer unique (a unique index "
                               "dropped since the source's import)")
        written[int(i)] = bool(matches)
    return written


def _parameters(definition: SourceDef, outcome: str, tasks: list[dict[str, Any]]) -> tuple[list[Any], ...]:
    """The arrays :func:`batch_query` binds for ``tasks``, in its order."""
    value = {"answer": "answer", "model": "model", "error": "error"}
    status = definition.solved if outcome == "solved" else definition.failed
    columns = [[status for _ in tasks] if role == "status" else [t.get(value[role]) for t in tasks]
               for role, _ in _sets(definition, outcome)]
    return (*columns, [t["key"] for t in tasks], [t.get("fingerprint") for t in tasks], list(range(len(tasks))),
            [t.get("replaces") is not None for t in tasks], [(t.get("replaces") or {}).get("error") for t in tasks])


_READ_ONLY = "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'"


def check_writable(conn: Connection, definition: SourceDef) -> None:
    """At import, after :func:`balancer.sources.catalog.check_source`: each outcome's write-back,
    the very statement a batch runs, planned on the table (EXPLAIN: never run, and rolled back
    all the same); :class:`SourceFileError` if PostgreSQL refuses it (a type that does not cast,
    a ``where`` naming a column ambiguously beside the statement's own), or if the database
    takes no write at all."""
    with conn.begin() as transaction:
        if conn.exec_driver_sql(_READ_ONLY).scalar_one():
            raise SourceFileError(f"sources.{definition.name}: its database is read only (a standby, or "
                                  "default_transaction_read_only): no answer could be written back")
        types = column_types(conn, definition)
        for outcome in ("solved", "failed"):
            query = batch_query(definition, outcome, types)
            if query is None:
                continue
            try:
                with conn.begin_nested():
                    conn.exec_driver_sql("EXPLAIN " + _render(conn, query), _parameters(definition, outcome, []))
            except DBAPIError as exc:
                raise SourceFileError(f"sources.{definition.name}: the write-back of a {outcome} task would fail: "
                                      f"{describe(definition, exc)}") from None
        transaction.rollback()
