"""Write-back: each ended task of a declared source goes back to its row, once.

The ``tasks_finished`` trigger (migration 0013; 0021 redefines it) puts a row in ``source_outbox``
in the very transaction that ends the task, so no end is missed and none is
queued twice. :func:`drain` takes waiting outbox rows (``FOR UPDATE SKIP
LOCKED``: two drainers never take the same row) and writes each to the team's
row with a guarded, fenced UPDATE (``... AND (where) AND md5(prompt) = <read>
AND md5(written columns) = <read>``, :mod:`balancer.sources.catalog`): a row
someone else changed meanwhile is never overwritten. Its outbox row becomes a
``conflict`` (the row no longer matches ``where``, or someone wrote into its
answer, model, error or status column), or ``changed`` (its prompt changed and it still matches: its task is
asked again with the new prompt, :mod:`balancer.sources.reask`); both are
counted in ``balancer status``. A failure the source declares no column for
(no ``status``, no ``error``) writes nothing: its outbox row is kept as
``unrecorded``, as a written row still matching ``where`` is kept, so that the
row is not asked again.

Each row alone: a batch is written in one transaction, one statement per
outcome (:mod:`balancer.sources.batchwrite`); when the team's table refuses a
value (a CHECK, a value too long for its column, a character its encoding
lacks), the statement is halved, each half in a savepoint, down to the row
refused, which fails alone with its error while the others are written. A refused row is
tried again after a back-off, and after ``BALANCER_WRITEBACK_ATTEMPTS``
refusals it is left ``unwritable`` (:mod:`balancer.sources.outbox`). A row
another transaction holds locked (the team's ``SELECT ... FOR UPDATE``, an
``UPDATE`` not yet committed) is skipped (``SKIP LOCKED``) and tried again
after the back-off, the rest of its batch written meanwhile. A transient
failure (the database away, a table lock, a lock or statement timeout:
``BALANCER_SOURCE_LOCK_TIMEOUT``, ``BALANCER_SOURCE_STATEMENT_TIMEOUT``; privileges)
fails the batch, which is tried again after the back-off without limit; a
source's failure never stops the sources after it.

Exactly once: in balancer's own database the UPDATE and the outbox row's
removal commit together. In another database the UPDATE commits first; if
balancer dies before removing the outbox row, the retry's guarded UPDATE
matches nothing (the written row no longer matches ``where``) and the row is
read back: holding exactly what was to be written, it counts as done, not as
a conflict.

:class:`WritebackLoop` drains in every dispatcher process (the consumer of the
``control`` queue), on a thread of its own: again at once while there was
work, else after ``BALANCER_WRITEBACK_TICK``. Two dispatchers drain side by
side without taking the same row.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

from celery import bootsteps
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from balancer.admission import keys
from balancer.services import Services
from balancer.settings import Settings
from balancer.sources import outbox
from balancer.sources.batchwrite import KeyNotUnique, check_privileges, column_types, held_elsewhere, write_many
from balancer.sources.catalog import (
    INSUFFICIENT_PRIVILEGE,
    NOTHING,
    WRITTEN,
    WRITTEN_MATCHING,
    RowRead,
    TimeLimits,
    _render,
    _table,
    describe,
    fence,
    fingerprint,
    inspect,
    prompt_part,
    refused_by_row,
    sqlstate,
    team_connection,
)
from balancer.sources.definition import SourceDef
from balancer.sources.reask import ask_again
from balancer.sources.store import all_sources, recorded_relations
from balancer.sources.tables import check_same_table

log = logging.getLogger(__name__)

#: What a write-back may raise: the database's error, or the driver's for a value the
#: connection's encoding cannot hold (:func:`balancer.sources.catalog.refused_by_row` tells them apart).
_WRITE_ERRORS = (DBAPIError, UnicodeError)
#: What one row's write-back came to, beside :mod:`balancer.sources.catalog`'s written ones
#: (``locked``: another transaction holds its row; tried again later).
CONFLICT, CHANGED, REFUSED, LOCKED = "conflict", "changed", "refused", "locked"
#: The error a write-back waiting on a row another transaction holds shows.
SKIPPED = ("its table skipped the update of a row as it was read (a BEFORE UPDATE trigger returning NULL, a rule, "
           "or a row-level security policy)")
ROW_LOCKED = ("its row could not be locked: another transaction holds it (FOR UPDATE, or an UPDATE not yet "
              "committed), or a row-level security policy hides it from UPDATE")
#: One row's write-back: what it came to, and the table's error (refused) or the row now (changed).
Result = tuple[str, str | RowRead | None]


@dataclass
class Drained:
    written: int = 0
    conflicts: int = 0  # not overwritten: the row no longer matched where
    changed: int = 0  # not overwritten: its prompt changed; asked again
    refused: int = 0  # refused by the team's table this time (tried again, or left unwritable)
    unwritable: int = 0  # of those, left unwritable
    unrecorded: int = 0  # failures the source declares no column for: nothing written, kept (not asked again)
    retrying: int = 0  # a transient failure: tried again later

    def add(self, other: Drained) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _why_missed(conn: Connection, definition: SourceDef, row: dict[str, Any]) -> Result:
    """A row whose guarded write matched nothing: written before a crash, changed (the row now),
    skipped by its table (the row as it was read, which the guard matches), or a conflict (it no
    longer matches ``where``, or its written columns changed: someone else's)."""
    now = inspect(conn, definition, row["outcome"], row)
    if now is not None and now.holds:
        return WRITTEN, None  # written before a crash, its outbox row not yet removed
    if now is not None and now.matches and now.prompt is not None and row["fingerprint"] == fence(now.prompt, now.held):
        return REFUSED, SKIPPED
    if (now is not None and now.matches and now.prompt is not None
            and fingerprint(now.prompt) != prompt_part(row["fingerprint"])):
        return CHANGED, RowRead(now.prompt, now.held)
    return CONFLICT, None


def _write_group(conn: Connection, definition: SourceDef, outcome: str, rows: list[dict], types: dict[str, str],
                 rendered: dict[str, str | None], results: dict[int, Result]) -> None:
    """``rows`` (all ending as ``outcome``) in one statement, in a savepoint; a value the table
    refuses (:func:`refused_by_row`, or a privilege refused with every privilege held: a row-level
    security policy, a trigger; or a key that matched several rows): each half again, down to the
    row refused alone with its error."""
    try:
        with conn.begin_nested():
            written = write_many(conn, definition, outcome, rows, types, rendered)
    except (*_WRITE_ERRORS, KeyNotUnique) as exc:
        if not (isinstance(exc, KeyNotUnique) or refused_by_row(exc) or sqlstate(exc) == INSUFFICIENT_PRIVILEGE):
            raise
        if len(rows) == 1:
            results[rows[0]["id"]] = (REFUSED, describe(definition, exc))
            return
        half = len(rows) // 2
        _write_group(conn, definition, outcome, rows[:half], types, rendered, results)
        _write_group(conn, definition, outcome, rows[half:], types, rendered, results)
        return
    _record(conn, definition, rows, written, results)


def _record(conn: Connection, definition: SourceDef, rows: list[dict], written: dict[int, bool] | None,
            results: dict[int, Result]) -> None:
    """Each row's result after its group's statement: written (still matching ``where`` or not),
    nothing to write, or why its guarded write matched nothing."""
    for i, row in enumerate(rows):
        if written is None:
            results[row["id"]] = (NOTHING, None)
        elif i in written:
            results[row["id"]] = (WRITTEN_MATCHING if written[i] else WRITTEN, None)
        else:
            results[row["id"]] = _why_missed(conn, definition, row)


@contextmanager
def _transaction(services: Services, definition: SourceDef, own: Connection) -> Iterator[Connection]:
    """A transaction on the team's database: a savepoint of ``own``'s when it is balancer's."""
    if definition.database_url_env is None:
        with own.begin_nested():
            yield own
        return
    with team_connection(definition, services.engine, TimeLimits.of(services.settings)) as team, team.begin():
        yield team  # within the session's time limits


def _write_batch(services: Services, definition: SourceDef, conn: Connection,
                 claimed: list[dict]) -> dict[int, Result]:
    """Write ``claimed`` back in one transaction: one statement per outcome, a refused row alone."""
    results: dict[int, Result] = {}
    with _transaction(services, definition, conn) as team:
        # A deferred constraint refuses its row at the row's statement, in its savepoint, not at COMMIT.
        team.exec_driver_sql("SET CONSTRAINTS ALL IMMEDIATE")
        types = column_types(team, definition)
        check_same_table(team, definition, _render(team, _table(definition)), recorded_relations(conn, definition.name))
        check_privileges(team, definition)  # a privilege refused later is then a row's (RLS, a trigger)
        busy = held_elsewhere(team, definition, [r["key"] for r in claimed], types)
        results.update({r["id"]: (LOCKED, None) for r in claimed if r["key"] in busy})
        rendered: dict[str, str | None] = {}
        for outcome in ("solved", "failed"):
            rows = [r for r in claimed if r["outcome"] == outcome and r["key"] not in busy]
            if rows:
                _write_group(team, definition, outcome, rows, types, rendered, results)
    return results


def _settle(services: Services, definition: SourceDef, conn: Connection, claimed: list[dict],
            results: dict[int, Result]) -> Drained:
    """The claimed rows' outbox states after their write-backs (in the claim's transaction)."""
    report = Drained()
    by_state: dict[str, list[int]] = {}
    refused: dict[int, str] = {}
    models: dict[str, int] | None = None
    locked = [row["id"] for row in claimed if results[row["id"]][0] == LOCKED]
    for row in claimed:
        result, detail = results[row["id"]]
        if result == LOCKED:
            continue
        if result == REFUSED:
            refused[row["id"]] = detail if isinstance(detail, str) else "refused"
            continue
        if result == CHANGED and isinstance(detail, RowRead):
            models = models if models is not None else {q.name: q.burst for q in services.quotas.all()}
            why = ask_again(conn, definition, row, detail, models, services.settings.max_prompt_bytes)
            if why is not None:
                log.warning("source %s: row %.80r changed since it was read, not asked again: %s", definition.name,
                            row["key"], why)
                result = CONFLICT
        state = {WRITTEN: "deleted", NOTHING: outbox.UNRECORDED, WRITTEN_MATCHING: outbox.WRITTEN,
                 CONFLICT: outbox.CONFLICT, CHANGED: outbox.CHANGED}[result]
        by_state.setdefault(state, []).append(row["id"])
    for state, ids in by_state.items():
        outbox.mark(conn, ids, state)
    report.written = len(by_state.get("deleted", [])) + len(by_state.get(outbox.WRITTEN, []))
    report.conflicts = len(by_state.get(outbox.CONFLICT, []))
    report.changed = len(by_state.get(outbox.CHANGED, []))
    report.unrecorded = len(by_state.get(outbox.UNRECORDED, []))
    report.refused = len(refused)
    report.unwritable = outbox.refuse(conn, refused, services.settings.writeback_attempts)
    if locked:
        outbox.retry_later(conn, locked, ROW_LOCKED)
        report.retrying = len(locked)
    return report


def drain_source(services: Services, definition: SourceDef, *, limit: int = 500, rounds: int = 20) -> Drained:
    report = Drained()
    for _ in range(rounds):
        with services.engine.begin() as conn:
            if definition.database_url_env is None:
                TimeLimits.of(services.settings).apply(conn, local=True)
            claimed = outbox.claim(conn, definition.name, limit)
            if not claimed:
                break
            try:
                results = _write_batch(services, definition, conn, claimed)
            except Exception as exc:  # noqa: BLE001 - the team's database away, a lock timeout...: retried later
                outbox.retry_later(conn, [r["id"] for r in claimed], describe(definition, exc))
                report.retrying += len(claimed)
                log.warning("source %s: %d write-back(s) failed, will retry: %s", definition.name, len(claimed),
                            describe(definition, exc))
                break
            round_report = _settle(services, definition, conn, claimed, results)
        report.add(round_report)
        _log(definition, round_report)
        if len(claimed) < limit:
            break
    return report


def _log(definition: SourceDef, report: Drained) -> None:
    log.info("source %s: %d task(s) written back", definition.name, report.written)
    if report.conflicts:
        log.warning("source %s: %d row(s) no longer matching where, not overwritten", definition.name, report.conflicts)
    if report.changed:
        log.warning("source %s: %d row(s) whose prompt changed since it was read, not overwritten: asked again",
                    definition.name, report.changed)
    if report.unrecorded:
        log.info("source %s: %d failed task(s) not written back: it declares no status or error column",
                 definition.name, report.unrecorded)
    if report.refused:
        log.warning("source %s: %d write-back(s) refused by its table (%d now unwritable)", definition.name,
                    report.refused, report.unwritable)
    if report.retrying:
        log.warning("source %s: %d write-back(s) wait: %s", definition.name, report.retrying, ROW_LOCKED)


def drain(services: Services) -> Drained:
    """One pass over every declared source's waiting write-backs; one source's failure
    (even balancer's database failing it) is logged and the next source is drained."""
    with services.engine.connect() as conn:
        definitions = all_sources(conn)
    total = Drained()
    for definition in definitions:
        try:
            total.add(drain_source(services, definition))
        except Exception as exc:  # noqa: BLE001 - the next sources are drained all the same
            log.warning("source %s: write-back not drained this pass: %s", definition.name, describe(definition, exc))
    return total


class WritebackLoop(bootsteps.StartStopStep):
    """In the dispatcher: :func:`drain`, in a loop on a thread of its own."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent, **kwargs) -> None:  # noqa: ANN001
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()

    def start(self, consumer) -> None:  # noqa: ANN001
        if keys.CONTROL_QUEUE not in {q.name for q in consumer.task_consumer.queues}:
            return  # a model worker
        self._stop.clear()
        threading.Thread(target=self._run, name="source-writeback", daemon=True).start()

    def stop(self, consumer) -> None:  # noqa: ANN001
        self._stop.set()

    def _run(self) -> None:
        # Connected here, not through balancer.calls.runtime: the sources room sits below the pipeline.
        svc = Services.connect(Settings.from_env(), check=False)
        idle = svc.settings.writeback_tick
        wait = idle
        while not self._stop.wait(wait):
            try:
                drained = drain(svc)
                wait = 0.0 if drained.written or drained.conflicts or drained.changed or drained.refused else idle
            except Exception:  # keep going through a PostgreSQL blip
                log.exception("write-back failed; retrying")
                wait = max(idle, 1.0)
