"""``balancer source rows NAME``: the rows of a source's table that hold no answer from balancer,
each by its key, and why: not a task (its reason, :mod:`balancer.sources.ingest`), cancelled
(by an operator), or its task ended but its write-back is waiting, was not overwritten, or was
refused until left unwritable, or its task failed and its source has no column for a failure
(:mod:`balancer.sources.outbox`). The counts ``source list`` and
``status`` show, row by row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.sources.outbox import (
    CONFLICT,
    ENDED_WITH_WRITEBACK,
    UNRECORDED,
    UNWRITABLE,
    WAITING,
    TaskWriteback,
    of_last_end,
)
from balancer.sources.schema import source_outbox
from balancer.storage.schema import tasks

#: How a cancelled task's row may be asked again.
CANCELLED = "cancelled by an operator: `balancer tasks retry --status cancelled --source {source}` asks it again"

#: Each ended task's outbox row of its last end (as :func:`balancer.sources.outbox.task_writeback`
#: reads one), to keep those in a state that leaves its row without balancer's answer.
_LAST_FIRST = (sa.select(tasks.c.key, tasks.c.id.label("task_id"), tasks.c.error, source_outbox.c.state,
                         source_outbox.c.attempts, source_outbox.c.last_error, source_outbox.c.next_attempt_at,
                         sa.func.row_number().over(partition_by=tasks.c.id, order_by=source_outbox.c.id.desc())
                         .label("nth"))
               .select_from(source_outbox.join(tasks, tasks.c.id == source_outbox.c.task_id))
               .where(source_outbox.c.source == sa.bindparam("source"), tasks.c.status.in_(ENDED_WITH_WRITEBACK),
                      of_last_end(source_outbox, tasks))
               .subquery("o"))
_ENDED = sa.select(_LAST_FIRST).where(_LAST_FIRST.c.nth == 1).order_by(_LAST_FIRST.c.task_id)
_SHOWN = (WAITING, CONFLICT, UNWRITABLE, UNRECORDED)


@dataclass(frozen=True)
class Unanswered:
    key: str
    why: str
    task_id: int | None = None  # balancer's task, when the row is one

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "why": self.why, "task_id": self.task_id}


def unanswered(engine: Engine, source: str, limit: int) -> list[Unanswered]:
    """Up to ``limit`` of ``source``'s rows without balancer's answer: not tasks, then cancelled,
    then write-backs not written (waiting after a failed try, not overwritten, unwritable, a failure
    with no column to write)."""
    with engine.connect() as conn:
        rejected = conn.execute(sa.text("SELECT key, reason FROM source_rejects WHERE source = :source ORDER BY key "
                                        "LIMIT :limit"), {"source": source, "limit": limit}).all()
        cancelled = conn.execute(sa.text("SELECT key, id FROM tasks WHERE source = :source AND from_table AND "
                                         "status = 'cancelled' ORDER BY id LIMIT :limit"),
                                 {"source": source, "limit": limit}).all()
        ended = [r for r in conn.execute(_ENDED, {"source": source})
                 if r.state in _SHOWN and (r.state != WAITING or r.attempts > 0)][:limit]
    rows = [Unanswered(key, f"not a task: {reason}") for key, reason in rejected]
    rows += [Unanswered(key, CANCELLED.format(source=source), task_id) for key, task_id in cancelled]
    rows += [Unanswered(r.key, (f"task failed: {r.error or 'no error recorded'}; " if r.state == UNRECORDED else "")
                        + "write-back " + TaskWriteback(r.state, int(r.attempts), r.last_error,
                                                        r.next_attempt_at).text(), r.task_id) for r in ended]
    return rows[:limit]
