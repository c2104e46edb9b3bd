"""A poll's read of the team's table: one window of its rows in the source's order.

A poll costs in proportion to the rows it examines, never to the table: a window
is at most ``span`` rows past a position in the source's order (its key, or its
``cursor`` column and key), found through the key's unique index (or the
``cursor`` column's), whether they match ``where`` or not; only its rows that
match ``where`` are read whole. The cursor then moves to the window's last row,
so rows that do not match ``where`` are examined once, not at every poll
(:mod:`balancer.sources.ingest`). Both statements of a window run in one
``REPEATABLE READ, READ ONLY`` transaction (one snapshot) within the source's
time limits: the only lock taken on the team's table is this read's.

Identifiers come from the definition, checked at import and quoted with
:class:`psycopg2.sql.Identifier`; positions are bound as text and compared as
their columns' own types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from psycopg2 import sql
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from balancer.settings import Settings
from balancer.sources.definition import WRITTEN_ROLES, SourceDef
from balancer.sources.rows import TooLong, decode_prompt, position_text, position_values
from balancer.sources.teamdb import TimeLimits, read_only

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


def held(definition: SourceDef) -> sql.Composable:
    """The md5 of the columns a write-back sets, as the row holds them now: one row value of
    their text, so a NULL and an empty string differ."""
    columns = [definition.columns[role] for role in WRITTEN_ROLES if role in definition.columns]
    return sql.SQL("md5(CAST(ROW({}) AS text))").format(
        sql.SQL(", ").join(sql.SQL("CAST({} AS text)").format(sql.Identifier(c)) for c in columns))


def _bounds(definition: SourceDef, *, after: bool, upto: bool) -> list[sql.Composable]:
    """The order's columns not NULL, past a position (``after``) and up to one (``upto``): each
    position one bound parameter per column, compared as a row."""
    columns = sql.SQL(", ").join(sql.SQL("{}.{}").format(_table(definition), sql.Identifier(c)) for c in definition.order)
    values = sql.SQL(", ").join(sql.SQL("%s") for _ in definition.order)
    found = [sql.SQL("{} IS NOT NULL").format(sql.Identifier(c)) for c in definition.order]
    if after:
        found.append(sql.SQL("({}) > ({})").format(columns, values))
    if upto:
        found.append(sql.SQL("({}) <= ({})").format(columns, values))
    return found


def _order_by(definition: SourceDef, prefix: sql.Composable, descending: bool = False) -> sql.Composable:
    # The qualified column: a bare name would take an output column of that name (the key's text) and order 10 before 9.
    way = sql.SQL(" DESC" if descending else "")
    return sql.SQL(", ").join(sql.SQL("{}.{}{}").format(prefix, sql.Identifier(c), way) for c in definition.order)


def read_query(definition: SourceDef, *, after: bool, upto: bool, as_bytes: bool = False) -> sql.Composable:
    """Rows of work past a position (and up to one): key as text, prompt (NULL when longer than
    the bytes bound first; its bytes as stored if ``as_bytes``), the prompt's length in bytes,
    priority, what the written columns hold (:func:`held`); in the source's order. The team's database measures the prompt, so a longer one
    never crosses the wire. A row whose key is NULL is never read (:func:`count_null_keys`)."""
    prompt = sql.Identifier(definition.prompt)
    conditions = [_where(definition), *_bounds(definition, after=after, upto=upto)]
    priority = sql.Identifier(definition.priority) if definition.priority else sql.SQL("NULL")
    size = sql.SQL("octet_length(CAST({} AS text))").format(prompt)
    return sql.SQL("SELECT CAST({key} AS text) AS balancer_key, "
                   "CASE WHEN {size} <= %s THEN {text} END AS balancer_prompt, "
                   "{size} AS balancer_prompt_bytes, {priority} AS balancer_priority, {held} AS balancer_held "
                   "FROM {table} WHERE {cond} ORDER BY {order} LIMIT %s").format(
        key=sql.Identifier(definition.key),
        text=sql.SQL("CAST(CAST({} AS text) AS bytea)" if as_bytes else "CAST({} AS text)").format(prompt),
        size=size, priority=priority, held=held(definition), table=_table(definition),
        cond=sql.SQL(" AND ").join(conditions),
        order=_order_by(definition, _table(definition)))


def window_query(definition: SourceDef, *, after: bool, upto: bool) -> sql.Composable:
    """How many rows (at most the LIMIT) lie past a position (and up to one) in the source's
    order, and the last of them as text: read from the order's index, ``where`` not evaluated."""
    names = [sql.Identifier(f"balancer_o{i}") for i in range(len(definition.order))]
    inner = sql.SQL(", ").join(sql.SQL("{} AS {}").format(sql.Identifier(c), n) for c, n in zip(definition.order, names,
                                                                                                   strict=True))
    last = sql.SQL(", ").join(sql.SQL("CAST(w.{} AS text)").format(n) for n in names)
    window = sql.Identifier("w")
    descending = sql.SQL(", ").join(sql.SQL("{}.{} DESC").format(window, n) for n in names)
    return sql.SQL("SELECT count(*) OVER (), {last} FROM (SELECT {inner} FROM {table} WHERE {cond} ORDER BY {order} "
                   "LIMIT %s) w ORDER BY {descending} LIMIT 1").format(
        last=last, inner=inner, table=_table(definition),
        cond=sql.SQL(" AND ").join(_bounds(definition, after=after, upto=upto)),
        order=_order_by(definition, _table(definition)), descending=descending)


@dataclass(frozen=True)
class Window:
    """A read's window: its rows of work (key, prompt, priority), how many rows it examined,
    the last of them (a position: :func:`balancer.sources.rows.position_text`), None if none,
    and what each row of work's written columns held, by key (:func:`held`)."""

    rows: list[tuple]
    examined: int
    last: str | None
    held: dict[str, str] = field(default_factory=dict)


_NOT_TEXT = ("22021", "22P05")  # SQLSTATEs of bytes that are not text in an encoding


def read_window(conn: Connection, definition: SourceDef, after: str | None, upto: str | None, span: int,
                limits: TimeLimits | None = None, max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES) -> Window:
    """At most ``span`` rows past ``after`` (and up to ``upto``), positions as stored, and of them
    the rows of work, within ``limits`` (a table the team holds locked fails it in ``lock_s``).
    A prompt longer than ``max_prompt_bytes`` is not read: its row holds a
    :class:`~balancer.sources.rows.TooLong`."""
    columns = len(definition.order)
    bounds = [v for p in (after, upto) if p is not None for v in position_values(p, columns) or ()]
    try:
        examined, last, rows = _read(conn, definition, after, upto, span, bounds, limits, max_prompt_bytes,
                                     as_bytes=False)
    except (UnicodeDecodeError, DBAPIError) as exc:
        if isinstance(exc, DBAPIError) and getattr(exc.orig, "pgcode", None) not in _NOT_TEXT:
            raise
        # A prompt that is not text in the table's encoding: the window again, prompts as their
        # bytes, each decoded alone, so that only its own row fails (recorded, never a task).
        examined, last, rows = _read(conn, definition, after, upto, span, bounds, limits, max_prompt_bytes,
                                     as_bytes=True)
    return Window([(key, TooLong(size, max_prompt_bytes) if prompt is None and size is not None
                    and size > max_prompt_bytes else prompt, priority) for key, prompt, size, priority, _ in rows],
                  examined, last, {key: written for key, *_, written in rows})


def _read(conn: Connection, definition: SourceDef, after: str | None, upto: str | None, span: int, bounds: list[Any],
          limits: TimeLimits | None, max_prompt_bytes: int, *, as_bytes: bool) -> tuple[int, str | None, list[tuple]]:
    has_after, has_upto = after is not None, upto is not None
    with read_only(conn, limits or TimeLimits(), snapshot=True):
        found = conn.exec_driver_sql(_render(conn, window_query(definition, after=has_after, upto=has_upto)),
                                     (*bounds, span)).first()
        if found is None:
            return 0, None, []
        examined, *last = found
        query = read_query(definition, after=has_after, upto=True, as_bytes=as_bytes)
        past = bounds[:len(last)] if has_after else []
        params = (max_prompt_bytes, *past, *last, span)
        rows = [tuple(r) for r in conn.exec_driver_sql(_render(conn, query), params)]
        if as_bytes:
            encoding = str(conn.exec_driver_sql("SHOW server_encoding").scalar_one())
            rows = [(key, decode_prompt(prompt, encoding), *rest) for key, prompt, *rest in rows]
    return int(examined), position_text(last), rows


def count_null_keys(conn: Connection, definition: SourceDef, limits: TimeLimits | None = None) -> int:
    """Rows matching ``where`` whose key is NULL: they can never be a task (nothing to write
    back to), so they are counted instead (``sources.null_keys``), in a READ ONLY transaction."""
    query = sql.SQL("SELECT count(*) FROM {table} WHERE {cond} AND {key} IS NULL").format(
        table=_table(definition), cond=_where(definition), key=sql.Identifier(definition.key))
    with read_only(conn, limits or TimeLimits()):
        return int(conn.exec_driver_sql(_render(conn, query)).scalar_one())


def still_work(conn: Connection, definition: SourceDef, keys: list[str], key_type: str,
               limits: TimeLimits | None = None) -> set[str]:
    """Of ``keys`` (as text), those whose row is there and matches ``where`` now, found through
    the key's index (``key_type``: its type as the catalog names it), in a READ ONLY transaction."""
    query = sql.SQL("SELECT CAST({key} AS text) FROM {table} WHERE {key} IN "
                    "(SELECT CAST(k AS {kind}) FROM unnest(CAST(%s AS text[])) AS k) AND {cond}").format(
        key=sql.Identifier(definition.key), table=_table(definition), kind=sql.SQL(key_type), cond=_where(definition))
    with read_only(conn, limits or TimeLimits()):
        return {key for (key,) in conn.exec_driver_sql(_render(conn, query), (keys,))}
