"""Write-back: each ended task of a declared source goes back to its row, once.

The ``tasks_finished`` trigger (migration 0010) puts a row in ``source_outbox``
in the very transaction that ends the task, so no end is missed and none is
queued twice. :func:`drain` takes waiting outbox rows (``FOR UPDATE SKIP
LOCKED``: two drainers never take the same row) and writes each to the team's
row with a guarded UPDATE (``... AND (where)``): a row someone else changed
meanwhile is not overwritten; its outbox row becomes a ``conflict``, counted
in ``balancer status``.

Exactly once: in balancer's own database the UPDATE and the outbox row's
removal commit together. In another database the UPDATE commits first; if
balancer dies before removing the outbox row, the retry's guarded UPDATE
matches nothing (the written row no longer matches ``where``) and the row is
read back: holding exactly what was to be written, it counts as done, not as
a conflict. A failed attempt (the database away) is retried with a back-off.

:class:`WritebackLoop` drains in every dispatcher process (the consumer of the
``control`` queue), on a thread of its own: again at once while there was
work, else after ``BALANCER_WRITEBACK_TICK``. Two dispatchers drain side by
side without taking the same row.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import sqlalchemy as sa
from celery import bootsteps
from sqlalchemy.engine import Connection

from balancer.admission import keys
from balancer.services import Services
from balancer.settings import Settings
from balancer.sources.catalog import describe, holds, team_connection, write_back
from balancer.sources.definition import SourceDef
from balancer.sources.schema import source_outbox
from balancer.sources.store import all_sources
from balancer.storage.schema import tasks

log = logging.getLogger(__name__)

#: The longest wait before a failed write-back is tried again.
MAX_BACKOFF_S = 60


@dataclass
class Drained:
    written: int = 0
    conflicts: int = 0
    retrying: int = 0


def _claim(conn: Connection, source: str, limit: int) -> list[dict]:
    query = (
        sa.select(source_outbox.c.id, source_outbox.c.outcome, tasks.c.key, tasks.c.answer, tasks.c.error, tasks.c.model)
        .join(tasks, tasks.c.id == source_outbox.c.task_id)
        .where(source_outbox.c.source == source, source_outbox.c.state == "waiting",
               source_outbox.c.next_attempt_at <= sa.func.now())
        .order_by(source_outbox.c.id).limit(limit)
        .with_for_update(of=source_outbox, skip_locked=True)
    )
    return [dict(r._mapping) for r in conn.execute(query)]


def _settle(conn: Connection, done: list[int], conflicts: list[int]) -> None:
    if done:
        conn.execute(sa.delete(source_outbox).where(source_outbox.c.id.in_(done)))
    if conflicts:
        conn.execute(sa.update(source_outbox).where(source_outbox.c.id.in_(conflicts)).values(state="conflict"))


def _retry_later(conn: Connection, ids: list[int], error: str) -> None:
    delay = sa.func.least(MAX_BACKOFF_S, sa.func.power(2, source_outbox.c.attempts))
    conn.execute(sa.update(source_outbox).where(source_outbox.c.id.in_(ids)).values(
        attempts=source_outbox.c.attempts + 1, last_error=error,
        next_attempt_at=sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, delay)))


def _write_batch(services: Services, definition: SourceDef, conn: Connection, claimed: list[dict]) -> tuple[list[int], list[int]]:
    """Write ``claimed`` back; the outbox ids done and those refused (someone else changed the row)."""
    done: list[int] = []
    conflicts: list[int] = []
    rendered: dict[str, str | None] = {}
    if definition.database_url_env is None:  # balancer's own database: one transaction for both
        with conn.begin_nested():
            for row in claimed:
                written = write_back(conn, definition, row["outcome"], row, rendered)
                (conflicts if written is False else done).append(row["id"])
        return done, conflicts
    with team_connection(definition, services.engine) as team, team.begin():
        for row in claimed:
            written = write_back(team, definition, row["outcome"], row, rendered)
            if written is False and not holds(team, definition, row["outcome"], row):
                conflicts.append(row["id"])
            else:
                done.append(row["id"])
    return done, conflicts


def drain_source(services: Services, definition: SourceDef, *, limit: int = 500, rounds: int = 20) -> Drained:
    report = Drained()
    for _ in range(rounds):
        with services.engine.begin() as conn:
            claimed = _claim(conn, definition.name, limit)
            if not claimed:
                break
            try:
                done, conflicts = _write_batch(services, definition, conn, claimed)
            except Exception as exc:  # noqa: BLE001 - the team's database away, a lock timeout...: retried later
                _retry_later(conn, [r["id"] for r in claimed], describe(definition, exc))
                report.retrying += len(claimed)
                log.warning("source %s: %d write-back(s) failed, will retry: %s", definition.name, len(claimed),
                            describe(definition, exc))
                break
            _settle(conn, done, conflicts)
        report.written += len(done)
        log.info("source %s: %d task(s) written back", definition.name, len(done))
        report.conflicts += len(conflicts)
        if conflicts:
            log.warning("source %s: %d row(s) changed by someone else meanwhile, not overwritten", definition.name,
                        len(conflicts))
        if len(claimed) < limit:
            break
    return report


def drain(services: Services) -> Drained:
    """One pass over every declared source's waiting write-backs."""
    with services.engine.connect() as conn:
        definitions = all_sources(conn)
    total = Drained()
    for definition in definitions:
        report = drain_source(services, definition)
        total.written += report.written
        total.conflicts += report.conflicts
        total.retrying += report.retrying
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
        # Connected here, not through balancer.pipeline.runtime: the sources room sits below the pipeline.
        svc = Services.connect(Settings.from_env(), check=False)
        idle = svc.settings.writeback_tick
        wait = idle
        while not self._stop.wait(wait):
            try:
                drained = drain(svc)
                wait = 0.0 if drained.written or drained.conflicts else idle
            except Exception:  # keep going through a PostgreSQL blip
                log.exception("write-back failed; retrying")
                wait = max(idle, 1.0)
