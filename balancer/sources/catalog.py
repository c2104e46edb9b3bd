"""The team's table: its database, its catalog checks, and the only SQL balancer
runs on it (a poll's read of a window, :mod:`balancer.sources.window`; one
guarded and fenced write-back per row).

Every identifier comes from the source's definition, is a plain identifier
(:func:`balancer.sources.definition.check_identifier`), was found in the
catalog at import, and is quoted with :class:`psycopg2.sql.Identifier`. Values
(keys, answers, statuses) are always bound parameters; keys are bound as
text and compared as the key column's own type, so an integer, text or uuid
key works alike. ``where`` is the team's own condition, placed in
parentheses; the read runs in a ``READ ONLY`` transaction.

The fence: a task carries the md5 of the prompt it was read with (computed on
both sides over the prompt's text as UTF-8, so the table's encoding does not
matter) and the md5 of the columns a write-back sets as they were then (the
answer, model, error and status columns, read as one row value); its write-back
changes the row only while the row still matches ``where``, its prompt still
hashes to the one and those columns to the other: an answer the team typed into
the row while its call ran is never overwritten. A task read before the second
part existed carries the first alone, and is fenced by it alone.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from psycopg2 import sql
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from balancer.errors import did_you_mean, printable
from balancer.sources.definition import SourceDef, SourceFileError
from balancer.sources.tables import (
    _COLUMN,
    base_tables,
    check_status_values,
    check_usable,
    check_view_key,
    identities,
    key_is_unique,
    view_column,
)

# The team's database, imported from here by the rest of the room.
from balancer.sources.teamdb import TimeLimits, describe, read_only, team_connection, team_engine, team_url  # noqa: F401
from balancer.sources.window import _render, _table, _where, held, read_query


@dataclass(frozen=True)
class RowRead:
    """A row of work as read: its prompt, and the md5 of the columns a write-back sets (:func:`held`)."""

    prompt: str
    held: str

    @property
    def fence(self) -> str:
        return fence(self.prompt, self.held)


def read_one(conn: Connection, definition: SourceDef, key: str, limits: TimeLimits | None = None) -> RowRead | None:
    """The row ``key`` if it matches ``where`` now (None: it does not, or is gone), in its own
    READ ONLY transaction within ``limits``."""
    query = sql.SQL("SELECT CAST({prompt} AS text), {held} FROM {table} WHERE {key} = %s AND {cond}").format(
        prompt=sql.Identifier(definition.prompt), held=held(definition), table=_table(definition),
        key=sql.Identifier(definition.key), cond=_where(definition))
    with read_only(conn, limits or TimeLimits()):
        row = conn.exec_driver_sql(_render(conn, query), (key,)).first()
    return None if row is None else RowRead(row[0], row[1])


def _sets(definition: SourceDef, outcome: str) -> list[tuple[str, str]]:
    """The (role, column) pairs a write-back of ``outcome`` sets."""
    roles = ["answer", "model"] if outcome == "solved" else ["error"]
    roles += ["status"]
    return [(role, col) for role in roles if (col := definition.columns.get(role)) is not None]


def _fingerprint(definition: SourceDef) -> sql.Composable:
    """The team's side of the fence: md5 of the prompt column's text as UTF-8, whatever the
    table's encoding (balancer's side: :func:`balancer.sources.store.insert_source_tasks`)."""
    return sql.SQL("md5(convert_to(CAST({} AS text), 'UTF8'))").format(sql.Identifier(definition.prompt))


def fingerprint(prompt: str) -> str:
    """A prompt's fingerprint as balancer computes it from what it read.

    >>> fingerprint("hi")
    '49f68a5c8493ec2c0bf489821c21fc3b'
    """
    return hashlib.md5(prompt.encode("utf-8"), usedforsecurity=False).hexdigest()


#: Between a fence's two parts: the prompt's fingerprint, then what the written columns held.
FENCE_SEPARATOR = ":"


def fence(prompt: str, held_md5: str) -> str:
    """A task's fence: its prompt's fingerprint and what the columns a write-back sets held when read.

    >>> fence("hi", "0123")
    '49f68a5c8493ec2c0bf489821c21fc3b:0123'
    """
    return f"{fingerprint(prompt)}{FENCE_SEPARATOR}{held_md5}"


def prompt_part(task_fence: str) -> str:
    """The prompt's fingerprint in a fence (a fence from before the second part is that alone).

    >>> prompt_part("49f6:0123"), prompt_part("49f6")
    ('49f6', '49f6')
    """
    return task_fence.split(FENCE_SEPARATOR, 1)[0]


def guard(definition: SourceDef, task_fence: sql.Composable, replaces: sql.Composable) -> sql.Composable:
    """A write-back's condition beside its key: the row matches ``where`` and its written columns
    hold what they held when read (unless the fence has no second part), or it holds exactly the
    failure a retried task may replace (``replaces``); and in either case its prompt is the one read."""
    part = sql.SQL("split_part({}, {}, {})")
    separator = sql.Literal(FENCE_SEPARATOR)
    return sql.SQL("(({cond} AND (strpos({fp}, {sep}) = 0 OR {held} = {second})) OR {replaces}) "
                   "AND {prompt} = {first}").format(
        cond=_where(definition), fp=task_fence, sep=separator, held=held(definition),
        second=part.format(task_fence, separator, sql.Literal(2)), replaces=replaces,
        prompt=_fingerprint(definition), first=part.format(task_fence, separator, sql.Literal(1)))


def _replaces(definition: SourceDef, flag: sql.Composable, values: dict[str, sql.Composable]) -> sql.Composable:
    """The guard's other way in, for a task ``tasks retry`` sent back after its failure was
    written: the row still holds exactly that failure (balancer's own write, nobody else's).
    ``flag``: whether the task has one; ``values``: each failed column's value."""
    failed = _sets(definition, "failed")
    if not failed:
        return sql.SQL("false")
    return sql.SQL("({} AND {})").format(flag, sql.SQL(" AND ").join(
        sql.SQL("CAST({} AS text) IS NOT DISTINCT FROM {}").format(sql.Identifier(col), values[role])
        for role, col in failed))


def written_values(definition: SourceDef, outcome: str, task: dict[str, Any]) -> list[Any]:
    """What a write-back of ``task`` ending as ``outcome`` sets, column by column (:func:`_sets`' order)."""
    value = {"answer": task.get("answer"), "model": task.get("model"), "error": task.get("error"),
             "status": definition.solved if outcome == "solved" else definition.failed}
    return [value[role] for role, _ in _sets(definition, outcome)]


#: What a row's write-back did: ``written``; ``written_matching`` (written, and the row still
#: matches ``where``: a re-read would take it for re-opened); ``missed`` (the guard matched no
#: row: changed, or gone); ``nothing`` (the source writes nothing back for this outcome).
WRITTEN, WRITTEN_MATCHING, MISSED, NOTHING = "written", "written_matching", "missed", "nothing"


@dataclass(frozen=True)
class RowNow:
    """A team's row as it is now, beside a write-back its guard refused."""

    matches: bool  # it matches ``where``
    prompt: str | None  # its prompt column's text
    holds: bool  # it holds exactly what the write-back writes (written before a crash)
    held: str  # the md5 of the columns a write-back sets (:func:`held`), as they are now


def inspect(conn: Connection, definition: SourceDef, outcome: str, task: dict[str, Any]) -> RowNow | None:
    """The row of ``task`` now (None: gone), to tell why its guarded write-back matched nothing."""
    sets = _sets(definition, outcome)
    columns = sql.SQL("").join(sql.SQL(", CAST({} AS text)").format(sql.Identifier(c)) for _, c in sets)
    query = sql.SQL("SELECT coalesce({cond}, false), {held}, CAST({prompt} AS text){cols} FROM {table} "
                    "WHERE {key} = %s").format(
        cond=_where(definition), held=held(definition), prompt=sql.Identifier(definition.prompt), cols=columns,
        table=_table(definition), key=sql.Identifier(definition.key))
    row = conn.exec_driver_sql(_render(conn, query), (task["key"],)).first()
    if row is None:
        return None
    wanted = written_values(definition, outcome, task)
    holds = [None if v is None else str(v) for v in row[3:]] == [None if v is None else str(v) for v in wanted]
    return RowNow(bool(row[0]), row[2], holds, row[1])


#: SQLSTATE classes of an error one row's write causes (its value refused: a data exception,
#: a constraint, a trigger's RAISE, a view's check option): that row fails alone. Any other
#: error (connection, lock or statement timeout, privileges, a table or column gone) is the
#: table's or the database's, transient: the whole batch is tried again, without limit
#: (:data:`INSUFFICIENT_PRIVILEGE` is a row's once the privileges are found held).
_ROW_CLASSES = ("21", "22", "23", "27", "2F", "38", "39", "44", "P0")


#: A privilege refused: the table's when balancer's role lacks one (checked before each batch:
#: :func:`balancer.sources.batchwrite.check_privileges`), else one row's (an RLS policy, a trigger).
INSUFFICIENT_PRIVILEGE = "42501"


def sqlstate(exc: BaseException) -> str | None:
    code = getattr(getattr(exc, "orig", exc), "pgcode", None)
    return code if isinstance(code, str) else None


def refused_by_row(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal of one row's values rather than a transient failure: an
    SQLSTATE of :data:`_ROW_CLASSES`, or a value the connection's encoding (the table's
    database's) cannot encode, which the driver refuses before sending it."""
    code = sqlstate(exc)
    return isinstance(getattr(exc, "orig", exc), UnicodeError) or (code is not None and code[:2] in _ROW_CLASSES)


# -- checks at import ------------------------------------------------------------------

_RELATION = """
SELECT c.oid, n.nspname, c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(CASE WHEN %(schema)s IS NULL THEN quote_ident(%(table)s)
                               ELSE quote_ident(%(schema)s) || '.' || quote_ident(%(table)s) END)
"""
_COLUMNS = "SELECT attname, attnum FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped"
#: A table that other tables inherit from (a partitioned table's partitions are relkind 'p' parents, not these).
_CHILDREN = "SELECT 1 FROM pg_inherits WHERE inhparent = %s LIMIT 1"


#: PostgreSQL's type oid of ``boolean``.
_BOOLEAN = 16
#: How long ``where`` may take on one row at import.
CONDITION_TIMEOUT_S = 5


#: A function called in a plan's text (EXPLAIN VERBOSE deparses each call as ``name(`` or ``"name"(``).
_CALLED = re.compile(r'"((?:[^"]|"")+)"\s*\(|([A-Za-z_][A-Za-z0-9_$]*)\s*\(')
#: Of those names, the ones a volatile function has (``set_config``, ``random``, a function declared without
#: STABLE); and the operators in the plan that call one (an operator hides its function's name).
_VOLATILE = ("SELECT proname FROM pg_proc WHERE proname = ANY(%s) AND provolatile = 'v' UNION SELECT 'operator ' || "
             "oprname FROM pg_operator JOIN pg_proc ON pg_proc.oid = oprcode WHERE provolatile = 'v' AND strpos(%s, oprname) > 0 "
             "ORDER BY 1")


def _check_condition(conn: Connection, definition: SourceDef) -> None:
    """In the caller's READ ONLY transaction: ``where`` alone in a select list is one
    column of type boolean (one expression, not two, not a row), and evaluates on a
    row of the table, read only, within :data:`CONDITION_TIMEOUT_S` (a function that
    writes, or a sleep, is refused here rather than run by every write-back), and calls
    no volatile function, by the names in its plan: a ``where`` runs in the write-back's
    transaction, which on balancer's own database goes on with balancer's statements, so
    ``set_config('search_path', ..., false)`` there would send those to the team's tables."""
    query = sql.SQL("SELECT {cond} AS balancer_condition FROM {table} LIMIT %s").format(
        cond=_where(definition), table=_table(definition))
    try:
        with conn.begin_nested():
            conn.exec_driver_sql(f"SET LOCAL statement_timeout = '{CONDITION_TIMEOUT_S}s'")
            result = conn.exec_driver_sql(_render(conn, query), (1,))
            types = [column[1] for column in result.cursor.description or ()]
            result.fetchall()
    except DBAPIError as exc:
        raise SourceFileError(f"sources.{definition.name}: where cannot be evaluated, read only, on a row of "
                              f"{definition.table}: {describe(definition, exc)}") from None
    if types != [_BOOLEAN]:
        raise SourceFileError(f"sources.{definition.name}: where is not one boolean condition")
    plan = "\n".join(line for (line,) in conn.exec_driver_sql("EXPLAIN (VERBOSE, COSTS OFF) " + _render(conn, query), (1,)))
    called = sorted({quoted.replace('""', '"') if quoted else bare for quoted, bare in _CALLED.findall(plan)})
    volatile = [name for (name,) in conn.exec_driver_sql(_VOLATILE, (called, plan))]
    if volatile:
        raise SourceFileError(f"sources.{definition.name}: where calls {', '.join(printable(v, 63) for v in volatile)}, "
                              "a volatile function: a condition may call only stable and immutable ones (a volatile "
                              "one, such as set_config, could change the session balancer's own queries run in)")


#: A table with fewer rows than this gets no note: the rescan goes round it in a few polls.
NOTE_FROM_ROWS = 10_000
#: Key types whose new values grow (a serial, a sequence's default, a time): new rows land past the cursor.
_GROWING = ("smallint", "integer", "bigint", "numeric", "date", "timestamp without time zone",
            "timestamp with time zone")
_ROWS = "SELECT reltuples FROM pg_class WHERE oid = %s"


def poll_note(conn: Connection, definition: SourceDef) -> str | None:
    """A note for the import when the source's new rows need not land past its cursor (issue 38
    finding 11): its key is not of a type whose values grow (a uuid, a text) and it declares no
    ``cursor`` column, on a table of :data:`NOTE_FROM_ROWS` rows or more. Then a new row is found
    by the rescan, one window of ``batch`` rows a poll: within about rows / batch polls. None: no note."""
    if definition.cursor is not None:
        return None
    schema, table = definition.schema_and_table
    with read_only(conn):  # the session's own time limits
        relation = conn.exec_driver_sql(_RELATION, {"schema": schema, "table": table}).first()
        if relation is None:
            return None
        kind, *_ = conn.exec_driver_sql(_COLUMN, (relation.oid, definition.key)).one()
        rows = float(conn.exec_driver_sql(_ROWS, (relation.oid,)).scalar() or 0)
    if kind in _GROWING or rows < NOTE_FROM_ROWS:
        return None
    wait = rows / definition.batch * definition.poll_seconds
    return (f"note: sources.{definition.name}: key {definition.key} ({printable(kind, 40)}) does not grow with each new "
            f"row: a new row behind the cursor is found by the rescan, {definition.batch:,} rows a poll, within about "
            f"{wait:,.0f} s for the {rows:,.0f} rows of {printable(definition.table, 130)}. A NOT NULL column that grows "
            "with each new row (a serial, a creation time), declared as cursor = \"COLUMN\" and indexed, finds them "
            "at the next poll")


def check_source(conn: Connection, definition: SourceDef) -> list[str]:
    """Check the definition against the source's catalog: the table, every column,
    a unique key (a view's through its table: :func:`balancer.sources.tables.check_view_key`),
    a ``where`` that is a condition on it, write-backs that would parse.
    :class:`SourceFileError` in one line when anything is wrong; changes nothing.
    Returns the tables it reads, as :func:`balancer.sources.tables.identities` writes them."""
    name = definition.name
    schema, table = definition.schema_and_table
    with read_only(conn):  # the session's own time limits
        relation = conn.exec_driver_sql(_RELATION, {"schema": schema, "table": table}).first()
        if relation is None or relation.relkind not in ("r", "p", "v", "m", "f"):
            raise SourceFileError(f"sources.{name}: no table {printable(definition.table, 130)} in its database")
        if relation.relkind == "f":
            raise SourceFileError(f"sources.{name}: {printable(definition.table, 130)} is a foreign table: its key cannot "
                                  "be proven unique here, and one write-back could change several rows (declare the "
                                  "remote table itself, its URL in database_url_env)")
        if relation.relkind == "r" and conn.exec_driver_sql(_CHILDREN, (relation.oid,)).first() is not None:
            raise SourceFileError(f"sources.{name}: {printable(definition.table, 130)} has tables that inherit from it: "
                                  "its key is unique in it alone, not across them, and one write-back could change a "
                                  "row in each (declare each table alone, or a partitioned table)")
        columns = {r.attname: r.attnum for r in conn.exec_driver_sql(_COLUMNS, (relation.oid,))}
        for role, column in definition.columns.items():
            if column not in columns:
                raise SourceFileError(f"sources.{name}: no column {column!r} ({role}) in {definition.table}"
                                      + did_you_mean(column, columns))
        check_usable(conn, definition, relation.oid, relation.relkind)
        if relation.relkind in ("r", "p", "m") and not key_is_unique(conn, relation.oid, columns[definition.key]):
            raise SourceFileError(f"sources.{name}: key column {definition.key!r} of {definition.table} is not unique "
                                  "(give a column with a primary key or a unique index of its own)")
        bases = base_tables(conn, [relation.oid])[relation.oid]
        if relation.relkind == "v":
            check_view_key(conn, definition, _render(conn, sql.SQL("SELECT {} FROM {}").format(
                sql.Identifier(definition.key), _table(definition))), bases)
        relations = identities(conn, bases)
        try:
            with conn.begin_nested():
                conn.exec_driver_sql("EXPLAIN " + _render(conn, read_query(definition, after=True, upto=False)),
                                     (1, *[None] * len(definition.order), 1))
        except DBAPIError as exc:
            raise SourceFileError(f"sources.{name}: where is not a condition on {definition.table}: "
                                  f"{describe(definition, exc)}") from None
        _check_condition(conn, definition)
        status = definition.columns.get("status")
        if relation.relkind in ("r", "p"):
            check_status_values(conn, definition, relation.oid, status)
        elif relation.relkind == "v" and status is not None:  # its UPDATE meets its one table's constraints
            check_status_values(conn, definition, bases[0], view_column(conn, _render(conn, sql.SQL(
                "SELECT {} FROM {}").format(sql.Identifier(status), _table(definition)))))
    return relations

