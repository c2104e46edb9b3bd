"""The team's table: its database, its catalog checks, and the only SQL balancer
runs on it (one read of a batch, one guarded and fenced write-back per row).

Every identifier comes from the source's definition, is a plain identifier
(:func:`balancer.sources.definition.check_identifier`), was found in the
catalog at import, and is quoted with :class:`psycopg2.sql.Identifier`. Values
(keys, answers, statuses) are always bound parameters; keys are bound as
text and compared as the key column's own type, so an integer, text or uuid
key works alike. ``where`` is the team's own condition, placed in
parentheses; the read runs in a ``READ ONLY`` transaction.

The fence: a task carries the md5 of the prompt it was read with; its
write-back changes the row only while the row still matches ``where`` *and*
its prompt still hashes to that (computed on both sides over the prompt's text
as UTF-8, so the table's encoding does not matter).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from psycopg2 import sql
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from balancer.errors import printable
from balancer.settings import Settings
from balancer.sources.definition import SourceDef, SourceFileError
from balancer.sources.rows import TooLong, decode_prompt
from balancer.sources.tables import base_tables, check_view_key, identities, key_is_unique

# The team's database, imported from here by the rest of the room.
from balancer.sources.teamdb import TimeLimits, describe, team_connection, team_engine, team_url  # noqa: F401

#: ``BALANCER_MAX_PROMPT_BYTES``'s default, for a read not given the deployment's setting.
DEFAULT_MAX_PROMPT_BYTES: int = Settings.max_prompt_bytes


def _render(conn: Connection, query: sql.Composable) -> str:
    return query.as_string(conn.connection.dbapi_connection)


def _table(definition: SourceDef) -> sql.Composable:
    schema, table = definition.schema_and_table
    return sql.Identifier(schema, table) if schema else sql.Identifier(table)


def _where(definition: SourceDef) -> sql.Composable:
    # Bound parameters go with this text, so a '%' of the team's condition is doubled to stay a '%'.
    return sql.SQL("({})").format(sql.SQL(definition.where.replace("%", "%%")))


def read_query(definition: SourceDef, *, after: bool, upto: bool, as_bytes: bool = False) -> sql.Composable:
    """Rows of work past a key (and up to one): key as text, prompt (NULL when longer than
    the bytes bound first; its bytes as stored if ``as_bytes``), the prompt's length in bytes,
    priority; in key order. The team's database measures the prompt, so a longer one never
    crosses the wire. A row whose key is NULL is never read (:func:`count_null_keys` counts them)."""
    key = sql.Identifier(definition.key)
    prompt = sql.Identifier(definition.prompt)
    conditions = [_where(definition), sql.SQL("{} IS NOT NULL").format(key)]
    if after:
        conditions.append(sql.SQL("{} > %s").format(key))
    if upto:
        conditions.append(sql.SQL("{} <= %s").format(key))
    priority = sql.Identifier(definition.priority) if definition.priority else sql.SQL("NULL")
    # ORDER BY the qualified column: a bare name would take the output column of
    # that name, the key's text form, and order 10 before 9.
    size = sql.SQL("octet_length(CAST({} AS text))").format(prompt)
    return sql.SQL("SELECT CAST({key} AS text) AS balancer_key, "
                   "CASE WHEN {size} <= %s THEN {text} END AS balancer_prompt, "
                   "{size} AS balancer_prompt_bytes, {priority} AS balancer_priority "
                   "FROM {table} WHERE {cond} ORDER BY {table}.{key} LIMIT %s").format(
        key=key, text=sql.SQL("CAST(CAST({} AS text) AS bytea)" if as_bytes else "CAST({} AS text)").format(prompt),
        size=size, priority=priority, table=_table(definition), cond=sql.SQL(" AND ").join(conditions))


def read_rows(conn: Connection, definition: SourceDef, after: str | None, upto: str | None, limit: int,
              limits: TimeLimits | None = None, max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES) -> list[tuple]:
    """One batch of work rows (key, prompt, priority) with key > ``after`` (and <= ``upto``), in
    one READ ONLY transaction within ``limits`` (a table the team holds locked fails it in
    ``lock_s``): the only lock taken on the team's table is this read's. A prompt longer than
    ``max_prompt_bytes`` is not read: its row holds a :class:`~balancer.sources.rows.TooLong`."""
    params: list[Any] = [max_prompt_bytes] + [p for p in (after, upto) if p is not None] + [limit]
    try:
        rows = _read(conn, definition, after, upto, params, limits, as_bytes=False)
    except (UnicodeDecodeError, DBAPIError) as exc:
        if isinstance(exc, DBAPIError) and getattr(exc.orig, "pgcode", None) not in _NOT_TEXT:
            raise
        # A prompt that is not text in the table's encoding: the batch again, prompts as their
        # bytes, each decoded alone, so that only its own row fails (recorded, never a task).
        rows = _read(conn, definition, after, upto, params, limits, as_bytes=True)
    return [(key, TooLong(size, max_prompt_bytes) if prompt is None and size is not None and size > max_prompt_bytes
             else prompt, priority) for key, prompt, size, priority in rows]


_NOT_TEXT = ("22021", "22P05")  # SQLSTATEs of bytes that are not text in an encoding


def _read(conn: Connection, definition: SourceDef, after: str | None, upto: str | None, params: list[Any],
          limits: TimeLimits | None, *, as_bytes: bool) -> list[tuple]:
    query = _render(conn, read_query(definition, after=after is not None, upto=upto is not None, as_bytes=as_bytes))
    with conn.begin():
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        (limits or TimeLimits()).apply(conn, local=True)
        rows = [tuple(r) for r in conn.exec_driver_sql(query, tuple(params))]
        if not as_bytes:
            return rows
        encoding = str(conn.exec_driver_sql("SHOW server_encoding").scalar_one())
    return [(key, decode_prompt(prompt, encoding), *rest) for key, prompt, *rest in rows]


def count_null_keys(conn: Connection, definition: SourceDef, limits: TimeLimits | None = None) -> int:
    """Rows matching ``where`` whose key is NULL: they can never be a task (nothing to write
    back to), so they are counted instead (``sources.null_keys``), in a READ ONLY transaction."""
    query = sql.SQL("SELECT count(*) FROM {table} WHERE {cond} AND {key} IS NULL").format(
        table=_table(definition), cond=_where(definition), key=sql.Identifier(definition.key))
    with conn.begin():
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        (limits or TimeLimits()).apply(conn, local=True)
        return int(conn.exec_driver_sql(_render(conn, query)).scalar_one())


def read_one(conn: Connection, definition: SourceDef, key: str, limits: TimeLimits | None = None) -> str | None:
    """The prompt of the row ``key`` if it matches ``where`` now (None: it does not, or is
    gone), in its own READ ONLY transaction within ``limits``."""
    query = sql.SQL("SELECT CAST({prompt} AS text) FROM {table} WHERE {key} = %s AND {cond}").format(
        prompt=sql.Identifier(definition.prompt), table=_table(definition), key=sql.Identifier(definition.key),
        cond=_where(definition))
    with conn.begin():
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        (limits or TimeLimits()).apply(conn, local=True)
        row = conn.exec_driver_sql(_render(conn, query), (key,)).first()
    return None if row is None else row[0]


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


def writeback_query(definition: SourceDef, outcome: str) -> sql.Composable | None:
    """The guarded UPDATE of one row: it changes the row only while the row still
    matches ``where`` and its prompt is still the one read (the fence: someone else's
    change is never overwritten). It returns whether the row, written, still matches
    ``where``. None: nothing to write."""
    sets = _sets(definition, outcome)
    if not sets:
        return None
    assignments = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(col)) for _, col in sets)
    return sql.SQL("UPDATE {table} SET {sets} WHERE {key} = %s AND ({cond} OR {replaces}) AND {fingerprint} = %s "
                   "RETURNING coalesce({cond}, false)").format(
        table=_table(definition), sets=assignments, key=sql.Identifier(definition.key), cond=_where(definition),
        replaces=_replaces(definition), fingerprint=_fingerprint(definition))


_PARAMETER = sql.SQL("%s")


def _replaces(definition: SourceDef, flag: sql.Composable = _PARAMETER,
              values: dict[str, sql.Composable] | None = None) -> sql.Composable:
    """The guard's other way in, for a task ``tasks retry`` sent back after its failure was
    written: the row still holds exactly that failure (balancer's own write, nobody else's).
    ``flag``: whether the task has one; ``values``: each failed column's value (default: bound
    parameters, :func:`writeback_values`'s; the batch write passes its own columns)."""
    failed = _sets(definition, "failed")
    if not failed:
        return sql.SQL("false")
    given = values or {}
    return sql.SQL("({} AND {})").format(flag, sql.SQL(" AND ").join(
        sql.SQL("CAST({} AS text) IS NOT DISTINCT FROM {}").format(sql.Identifier(col), given.get(role, _PARAMETER))
        for role, col in failed))


def writeback_values(definition: SourceDef, outcome: str, task: dict[str, Any]) -> list[Any]:
    """The values :func:`writeback_query` binds, in its order: the columns set, the key, the
    failure a retried task may replace (``task["replaces"]``), the fingerprint."""
    value = {"answer": task.get("answer"), "model": task.get("model"), "error": task.get("error"),
             "status": definition.solved if outcome == "solved" else definition.failed}
    replaces = task.get("replaces")
    failure = {"status": definition.failed, "error": replaces.get("error") if replaces else None}
    failed = [failure[role] for role, _ in _sets(definition, "failed")]
    return ([value[role] for role, _ in _sets(definition, outcome)] + [task["key"]]
            + ([replaces is not None, *failed] if failed else []) + [task.get("fingerprint")])


#: What :func:`write_back` did: ``written``; ``written_matching`` (written, and the row still
#: matches ``where``: a re-read would take it for re-opened); ``missed`` (the guard matched no
#: row: changed, or gone); ``nothing`` (the source writes nothing back for this outcome).
WRITTEN, WRITTEN_MATCHING, MISSED, NOTHING = "written", "written_matching", "missed", "nothing"


def write_back(conn: Connection, definition: SourceDef, outcome: str, task: dict[str, Any],
               rendered: dict[str, str | None] | None = None) -> str:
    """Write one task's end to its row in the caller's transaction (one of the values above).
    ``task``: its key, answer, model, error and fingerprint. ``rendered`` keeps each
    outcome's statement text across the calls of one batch."""
    rendered = {} if rendered is None else rendered
    if outcome not in rendered:
        query = writeback_query(definition, outcome)
        rendered[outcome] = None if query is None else _render(conn, query)
    text = rendered[outcome]
    if text is None:
        return NOTHING
    row = conn.exec_driver_sql(text, tuple(writeback_values(definition, outcome, task))).first()
    return MISSED if row is None else WRITTEN_MATCHING if row[0] else WRITTEN


@dataclass(frozen=True)
class RowNow:
    """A team's row as it is now, beside a write-back its guard refused."""

    matches: bool  # it matches ``where``
    prompt: str | None  # its prompt column's text
    holds: bool  # it holds exactly what the write-back writes (written before a crash)


def inspect(conn: Connection, definition: SourceDef, outcome: str, task: dict[str, Any]) -> RowNow | None:
    """The row of ``task`` now (None: gone), to tell why its guarded write-back matched nothing."""
    sets = _sets(definition, outcome)
    columns = sql.SQL("").join(sql.SQL(", CAST({} AS text)").format(sql.Identifier(c)) for _, c in sets)
    query = sql.SQL("SELECT coalesce({cond}, false), CAST({prompt} AS text){cols} FROM {table} WHERE {key} = %s").format(
        cond=_where(definition), prompt=sql.Identifier(definition.prompt), cols=columns, table=_table(definition),
        key=sql.Identifier(definition.key))
    row = conn.exec_driver_sql(_render(conn, query), (task["key"],)).first()
    if row is None:
        return None
    wanted = writeback_values(definition, outcome, task)[:len(sets)]
    held = [None if v is None else str(v) for v in row[2:]] == [None if v is None else str(v) for v in wanted]
    return RowNow(bool(row[0]), row[1], held)


#: SQLSTATE classes of an error one row's write causes (its value refused: a data exception,
#: a constraint, a trigger's RAISE, a view's check option): that row fails alone. Any other
#: error (connection, lock or statement timeout, privileges, a table or column gone) is the
#: table's or the database's, transient: the whole batch is tried again, without limit.
_ROW_CLASSES = ("21", "22", "23", "27", "2F", "38", "39", "44", "P0")


def refused_by_row(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal of one row's values rather than a transient failure: an
    SQLSTATE of :data:`_ROW_CLASSES`, or a value the connection's encoding (the table's
    database's) cannot encode, which the driver refuses before sending it."""
    cause = getattr(exc, "orig", exc)
    code = getattr(cause, "pgcode", None)
    return isinstance(cause, UnicodeError) or (isinstance(code, str) and code[:2] in _ROW_CLASSES)


# -- checks at import ------------------------------------------------------------------

_RELATION = """
SELECT c.oid, n.nspname, c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(CASE WHEN %(schema)s IS NULL THEN quote_ident(%(table)s)
                               ELSE quote_ident(%(schema)s) || '.' || quote_ident(%(table)s) END)
"""
_COLUMNS = "SELECT attname, attnum FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped"


#: PostgreSQL's type oid of ``boolean``.
_BOOLEAN = 16
#: How long ``where`` may take on one row at import.
CONDITION_TIMEOUT_S = 5


def _check_condition(conn: Connection, definition: SourceDef) -> None:
    """In the caller's READ ONLY transaction: ``where`` alone in a select list is one
    column of type boolean (one expression, not two, not a row), and evaluates on a
    row of the table, read only, within :data:`CONDITION_TIMEOUT_S` (a function that
    writes, or a sleep, is refused here rather than run by every write-back)."""
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


#: A table with fewer rows than this gets no note: any plan reads it in a moment.
NOTE_FROM_ROWS = 10_000
_SCANS = ("Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan")
_RELTUPLES = "SELECT reltuples FROM pg_class WHERE oid = to_regclass(quote_ident(%s) || '.' || quote_ident(%s))"


def _reads_past_where(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The scans of a plan (EXPLAIN's JSON) that read rows and only then check a condition."""
    found = [plan] if plan.get("Node Type") in _SCANS and (plan["Node Type"] == "Seq Scan" or "Filter" in plan) else []
    return found + [scan for child in plan.get("Plans", []) for scan in _reads_past_where(child)]


def poll_note(conn: Connection, definition: SourceDef) -> str | None:
    """A note for the import when a poll of the source cannot use an index for ``where`` (issue 38
    finding 11): EXPLAIN of its read behind the cursor (the rescan) over the whole key range
    finds a scan that reads rows and filters them, on a table of :data:`NOTE_FROM_ROWS` rows or
    more. Then each poll reads every row behind the cursor, matching or not. None: no note."""
    key, table = sql.Identifier(definition.key), _table(definition)
    with conn.begin():
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        low, high = conn.exec_driver_sql(_render(conn, sql.SQL(
            "SELECT CAST(min({key}) AS text), CAST(max({key}) AS text) FROM {table}").format(key=key, table=table))).one()
        if low is None:
            return None
        query = _render(conn, read_query(definition, after=True, upto=True))
        [[plan]] = conn.exec_driver_sql("EXPLAIN (FORMAT JSON, VERBOSE) " + query, (1, low, high, definition.batch)).one()
        rows = [float(conn.exec_driver_sql(_RELTUPLES, (scan.get("Schema"), scan.get("Relation Name"))).scalar() or 0)
                for scan in _reads_past_where(plan["Plan"])]
    if not rows or max(rows) < NOTE_FROM_ROWS:
        return None
    return (f"note: sources.{definition.name}: where cannot use an index of {printable(definition.table, 130)}: each "
            f"poll reads the rows behind its cursor (about {max(rows):,.0f}) to find the rows of work. An index that "
            f"holds only those, e.g. CREATE INDEX ON {printable(definition.table, 130)} ({definition.key}) WHERE "
            f"{printable(definition.where, 200)}, makes a poll read the rows of work only")


def check_source(conn: Connection, definition: SourceDef) -> list[str]:
    """Check the definition against the source's catalog: the table, every column,
    a unique key (a view's through its table: :func:`balancer.sources.tables.check_view_key`),
    a ``where`` that is a condition on it, write-backs that would parse.
    :class:`SourceFileError` in one line when anything is wrong; changes nothing.
    Returns the tables it reads, as :func:`balancer.sources.tables.identities` writes them."""
    name = definition.name
    schema, table = definition.schema_and_table
    with conn.begin():
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        relation = conn.exec_driver_sql(_RELATION, {"schema": schema, "table": table}).first()
        if relation is None or relation.relkind not in ("r", "p", "v", "m", "f"):
            raise SourceFileError(f"sources.{name}: no table {printable(definition.table, 130)} in its database")
        columns = {r.attname: r.attnum for r in conn.exec_driver_sql(_COLUMNS, (relation.oid,))}
        for role, column in definition.columns.items():
            if column not in columns:
                raise SourceFileError(f"sources.{name}: no column {column!r} ({role}) in {definition.table}")
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
                                     (1, None, 1))
        except DBAPIError as exc:
            raise SourceFileError(f"sources.{name}: where is not a condition on {definition.table}: "
                                  f"{describe(definition, exc)}") from None
        _check_condition(conn, definition)
    with conn.begin() as transaction:  # EXPLAIN plans the UPDATE, never runs it; rolled back all the same
        for outcome in ("solved", "failed"):
            query = writeback_query(definition, outcome)
            if query is None:
                continue
            values = writeback_values(definition, outcome, {"key": None, "answer": "", "model": "", "error": "",
                                                            "fingerprint": ""})
            try:
                with conn.begin_nested():
                    conn.exec_driver_sql("EXPLAIN " + _render(conn, query), tuple(values))
            except DBAPIError as exc:
                raise SourceFileError(f"sources.{name}: the write-back of a {outcome} task would fail: "
                                      f"{describe(definition, exc)}") from None
        transaction.rollback()
    return relations

