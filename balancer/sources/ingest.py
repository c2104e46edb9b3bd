"""Source tables into the backlog: every row matching a source's ``where`` becomes a task once.

Each tick reads each source past its cursor, in windows of at most ``batch``
rows in the source's order (:mod:`balancer.sources.window`), each window one
short READ ONLY read of the team's table (no lock held beyond it). The
window's rows of work become tasks and the cursor moves to the window's last
row, matching ``where`` or not, in one transaction of balancer's database; a
(source, key) already present is skipped (the ``tasks_source_key`` index). So
a crash mid-window re-reads the window, and two ingesters at once insert each
row once: the cursor only moves from where it was read
(:func:`balancer.sources.store.advance`). Once a source is caught up, each
tick also rescans one window behind the cursor, for rows that committed
behind it (a writer's transaction that took a smaller key and committed
late), rows of a key that does not grow, and rows re-opened: a poll examines
the new rows and at most ``batch`` rows behind the cursor, whatever the
table's size (issue 38 finding 11).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from balancer.backlog.intake import TaskRow
from balancer.services import Services
from balancer.sources.batchwrite import column_types
from balancer.sources.catalog import TimeLimits, read_only, team_connection
from balancer.sources.definition import SourceDef
from balancer.sources.read_errors import clear_read_error, note_read_error
from balancer.sources.reask import ask_reopened
from balancer.sources.rows import after_read, after_rescan, rows_to_tasks
from balancer.sources.schema import source_rejects, sources
from balancer.sources.store import Cursor, advance, all_sources, insert_source_tasks, read_cursor, recorded_relations
from balancer.sources.tables import check_same_table
from balancer.sources.window import Window, _render, _table, count_null_keys, read_window, still_work

log = logging.getLogger(__name__)


@dataclass
class SourceIngest:
    source: str
    read: int = 0
    created: int = 0
    skipped: int = 0
    reasked: int = 0  # rows found re-opened behind the cursor, asked again (balancer.sources.reask)
    caught_up: bool = False


@dataclass
class Read:
    """A window read from the team's table, its rows already turned into tasks and refusals."""

    window: Window
    tasks: list[TaskRow]
    refused: list[tuple[str, str]]


def _insert(services: Services, definition: SourceDef, read: Read, start: Cursor, end: Cursor, caught_up: bool,
            report: SourceIngest) -> bool:
    max_tokens = definition.max_tokens or services.settings.expected_output_tokens
    tasks, refused = read.tasks, read.refused
    report.skipped += len(refused)
    with services.engine.begin() as conn:
        # No wait for the WAL flush: a batch lost in a server crash loses its cursor move with it, and is read again.
        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
        conn.execute(sa.select(sources.c.name).where(sources.c.name == definition.name).with_for_update())
        if read_cursor(conn, definition.name) != start:
            return False  # another ingester moved the cursor first; its batch held these rows
        inserted = insert_source_tasks(conn, definition.name, max_tokens, definition.models, tasks,
                                       held=read.window.held, dedup=definition.dedup or services.settings.dedup)
        # Recorded before the cursor moves past them, in its transaction (issue 38 finding 7).
        for key, reason in record_rejects(conn, definition.name, refused, [t.key for t in tasks if t.key]):
            log.warning("source %s: row %.80r is not a task: %s", definition.name, key, reason)
        if not advance(conn, definition.name, start, end, inserted=inserted, caught_up=caught_up):
            raise RuntimeError(f"source {definition.name}: its cursor moved under a row lock")
    report.created += inserted
    return True


def ingest_source(services: Services, definition: SourceDef, models: dict[str, int], *,
                  budget_s: float = 2.0) -> SourceIngest:
    """Read ``definition`` past its cursor until caught up (or ``budget_s`` is spent), then one rescan window."""
    report = SourceIngest(definition.name)
    deadline = time.monotonic() + budget_s
    limits = TimeLimits.of(services.settings)

    max_tokens = definition.max_tokens or services.settings.expected_output_tokens

    def prepared(window: Window) -> Read:
        return Read(window, *rows_to_tasks(definition.name, window.rows, models=models, allowed=definition.models,
                                           max_tokens=max_tokens))

    def read(position: str | None) -> Read:
        """A window past ``position``, turned into tasks on the reader's thread too (the GIL is free
        while the other thread waits on balancer's database)."""
        return prepared(read_window(team, definition, position, None, definition.batch, limits,
                                    services.settings.max_prompt_bytes))

    with services.engine.connect() as conn:
        recorded = recorded_relations(conn, definition.name)
    # The executor's exit waits for a read ahead before the team's connection closes.
    with team_connection(definition, services.engine, limits) as team, \
            ThreadPoolExecutor(1, thread_name_prefix=f"source-read-ahead-{definition.name}") as reader:
        with read_only(team, limits):
            check_same_table(team, definition, _render(team, _table(definition)), recorded)
        ahead: tuple[str | None, Future[Read]] | None = None
        while True:
            with services.engine.connect() as conn:
                start = read_cursor(conn, definition.name)
            # Waited for in any case: the team's connection is then free again.
            read_from, read_ahead = (ahead[0], ahead[1].result()) if ahead is not None else (None, None)
            if start is None:
                return report  # removed meanwhile
            this = read_ahead if read_ahead is not None and read_from == start.position else read(start.position)
            ahead = None
            report.read += len(this.window.rows)
            position, caught_up = after_read(start.position, this.window.last, this.window.examined, definition.batch)
            if not caught_up and time.monotonic() < deadline:
                # The next window is read while this one's tasks are inserted (the team's database and
                # balancer's work at once); it is used only if the cursor is where this window leaves it.
                ahead = (position, reader.submit(read, position))
            moved = _insert(services, definition, this, start, Cursor(position, start.rescan), caught_up, report)
            if caught_up and moved:
                report.caught_up = True
                break
            if time.monotonic() > deadline:
                return report
        if start.position is not None:
            start = Cursor(position, start.rescan)
            window = read_window(team, definition, start.rescan, position, definition.batch, limits,
                                 services.settings.max_prompt_bytes)
            rescan = after_rescan(window.last, window.examined, definition.batch)
            _insert(services, definition, prepared(window), start, Cursor(position, rescan), True, report)
            if rescan is None:  # the rescan went round the table: count its rows with no key again
                set_null_keys(services.engine, definition.name, count_null_keys(team, definition, limits))
                forget_gone_rejects(services.engine, definition, team, limits)
            asked, refused = ask_reopened(services, definition, team, [r[0] for r in window.rows])
            report.reasked += len(asked)
            if asked or refused:  # said once, and in `source rows`, not at every rescan
                with services.engine.begin() as conn:
                    for key, reason in record_rejects(conn, definition.name, refused, asked):
                        log.warning("source %s: row %.80r re-opened, not asked again: %s", definition.name, key, reason)
    return report


_RECORD = sa.text("""
INSERT INTO source_rejects (source, key, reason)
SELECT :source, r.key, r.reason FROM unnest(CAST(:keys AS text[]), CAST(:reasons AS text[])) AS r(key, reason)
ON CONFLICT (source, key) DO UPDATE SET reason = EXCLUDED.reason, recorded_at = now()
WHERE source_rejects.reason IS DISTINCT FROM EXCLUDED.reason
RETURNING key, reason
""")
_FORGET = sa.text("DELETE FROM source_rejects WHERE source = :source AND key = ANY(CAST(:keys AS text[]))")
#: A key is recorded with at most this many characters (an index entry has a size limit).
MAX_RECORDED_KEY = 200


def record_rejects(conn: Connection, source: str, refused: list[tuple[str, str]], taken: list[str]) -> list[tuple]:
    """In the batch's transaction: each row that is not a task, with its reason (``source_rejects``);
    a row that is a task now (the team fixed it) is no longer counted. The rows newly recorded."""
    if taken:  # one array bound, not a list of thousands of parameters; each key as it was recorded
        conn.execute(_FORGET, {"source": source, "keys": [k[:MAX_RECORDED_KEY] for k in taken]})
    if not refused:
        return []
    return [tuple(r) for r in conn.execute(_RECORD, {"source": source, "keys": [k[:MAX_RECORDED_KEY] for k, _ in refused],
                                                     "reasons": [reason for _, reason in refused]})]


#: How many recorded rows that are not tasks one round of the rescan looks up again.
RECHECKED_REJECTS = 10_000


def forget_gone_rejects(engine: Engine, definition: SourceDef, team: Connection, limits: TimeLimits) -> int:
    """Once a round of the rescan: the rows recorded as not tasks that are gone, or no longer
    match ``where``, are no longer counted (a row that is a task now is forgotten as it is
    inserted, :func:`record_rejects`). Returns how many were forgotten."""
    with engine.connect() as conn:
        recorded = list(conn.execute(sa.select(source_rejects.c.key).where(
            source_rejects.c.source == definition.name, sa.func.length(source_rejects.c.key) < MAX_RECORDED_KEY)
            .limit(RECHECKED_REJECTS)).scalars())
    if not recorded:
        return 0
    key_type = column_types(team, definition)[definition.key]
    team.rollback()  # the catalog read's transaction: still_work opens its own
    gone = sorted(set(recorded) - still_work(team, definition, recorded, key_type, limits))
    if gone:
        with engine.begin() as conn:
            conn.execute(_FORGET, {"source": definition.name, "keys": gone})
    return len(gone)


def set_null_keys(engine: Engine, source: str, count: int) -> None:
    with engine.begin() as conn:
        conn.execute(sa.update(sources).where(sources.c.name == source, sources.c.null_keys != count)
                     .values(null_keys=count))
    if count:
        log.warning("source %s: %d row(s) of work have a NULL key: never tasks", source, count)


def due_sources(services: Services) -> list[SourceDef]:
    """Every declared source whose ``poll_seconds`` have passed since it was last read."""
    with services.engine.connect() as conn:
        due = set(conn.execute(sa.select(sources.c.name).where(sa.or_(
            sources.c.read_at.is_(None),
            sources.c.read_at <= sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0,
                                                                      sa.cast(sources.c.definition["poll_seconds"].astext, sa.Float))
        ))).scalars())
        return [d for d in all_sources(conn) if d.name in due]


def quota_bursts(services: Services) -> dict[str, int]:
    """Every configured model and its burst: what :func:`balancer.sources.rows.row_to_task` checks a row against."""
    return {q.name: q.burst for q in services.quotas.all()}


def ingest_logged(services: Services, definition: SourceDef, models: dict[str, int], *,
                  budget_s: float = 2.0) -> SourceIngest | None:
    """:func:`ingest_source`, its outcome logged, a failed read's error recorded for the displays
    (:mod:`balancer.sources.read_errors`); None if the source could not be read this time."""
    namespace = services.settings.namespace
    try:
        report = ingest_source(services, definition, models, budget_s=budget_s)
    except Exception as exc:  # noqa: BLE001 - one unreachable source must not starve the others
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.warning("source %s not read this tick: %s", definition.name, error)
        try:
            note_read_error(services.redis, namespace, definition.name, error)
        except redis.RedisError:
            pass  # Redis away too: the log says it
        return None
    try:
        clear_read_error(services.redis, namespace, definition.name)
    except redis.RedisError:
        pass
    if report.created or report.skipped:  # rows that stay not tasks are read again each poll: said once a poll at debug
        log.log(logging.INFO if report.created else logging.DEBUG, "source %s: %d task(s) created, %d row(s) not tasks",
                definition.name, report.created, report.skipped)
    return report


def ingest_sources(services: Services, *, budget_s: float = 2.0) -> list[SourceIngest]:
    """Every due source, one after another (the dispatcher reads each on a thread of its own instead:
    :mod:`balancer.sources.polling`)."""
    definitions = due_sources(services)
    if not definitions:
        return []
    models = quota_bursts(services)
    return [r for d in definitions if (r := ingest_logged(services, d, models, budget_s=budget_s)) is not None]
