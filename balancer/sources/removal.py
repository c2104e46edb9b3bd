"""What removing a source does to its tasks and write-backs, and what importing it again resumes.

``balancer source remove NAME`` drains by default: it is refused, with the counts,
while the source has tasks not ended (pending, ready, queued, running) or
write-backs waiting. ``--cancel`` removes it now: its pending tasks are cancelled
(audited in ``task_operations``), its waiting write-backs are dropped, and its
tasks in flight end without a write-back (the ``tasks_finished`` trigger queues
one only for a declared source); the removal's audit row in ``source_changes``
lists the tasks cancelled and the write-backs dropped. Nothing is read from or
written to the team's table, so a source whose table is gone is removed alike.

Importing the source again resumes its keys: the tasks its removal cancelled go
back to pending, and its tasks that ended without a write-back (dropped by the
removal, or ended while it was not declared) have their write-backs queued
again; each is still guarded as any write-back is, so a row someone else changed
meanwhile is not overwritten. Its rows already tasks are never inserted twice
(the ``tasks_source_key`` index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from balancer.backlog.statuses import IN_FLIGHT
from balancer.sources.schema import source_outbox
from balancer.storage import audit
from balancer.storage.schema import source_changes, task_operations, tasks

#: The filter recorded with the cancel a removal makes (``task_operations``).
REMOVAL_CANCEL = "source remove"


@dataclass(frozen=True)
class Left:
    """What a source still has going: tasks not ended and write-backs waiting (of tasks that exist)."""

    pending: int
    in_flight: int
    writebacks: int

    @property
    def anything(self) -> bool:
        return bool(self.pending or self.in_flight or self.writebacks)

    def text(self) -> str:
        return (f"{self.pending} pending task(s), {self.in_flight} in flight and {self.writebacks} write-back(s) "
                "waiting")


def left(conn: Connection, name: str) -> Left:
    pending, in_flight = conn.execute(sa.select(
        sa.func.count().filter(tasks.c.status == "pending"),
        sa.func.count().filter(tasks.c.status.in_(IN_FLIGHT)),
    ).where(tasks.c.source == name, tasks.c.status.in_(("pending", *IN_FLIGHT)))).one()
    waiting = conn.execute(sa.select(sa.func.count()).select_from(
        source_outbox.join(tasks, tasks.c.id == source_outbox.c.task_id)).where(
        source_outbox.c.source == name, source_outbox.c.state == "waiting")).scalar_one()
    return Left(int(pending), int(in_flight), int(waiting))


def refusal(name: str, now: Left) -> str:
    return (f"source {name} has {now.text()}: remove it once they have ended (balancer source list shows them), "
            "or now with --cancel (its pending tasks cancelled, its waiting write-backs dropped)")


def cancel_for_removal(conn: Connection, name: str, by: str) -> dict[str, Any]:
    """In the removal's transaction: cancel the pending tasks, drop the waiting write-backs.
    What was done, for the removal's audit row."""
    now = left(conn, name)
    cancelled = sorted(conn.execute(
        sa.update(tasks).where(tasks.c.source == name, tasks.c.status == "pending")
        .values(status="cancelled", error=f"cancelled: source {name} removed by {by}", updated_at=sa.func.now())
        .returning(tasks.c.id)).scalars())
    if cancelled:
        conn.execute(sa.insert(task_operations).values(done_by=by, action="cancel", task_ids=cancelled,
                                                       filter={"source": name, "by": REMOVAL_CANCEL}))
    dropped = sorted(conn.execute(
        sa.delete(source_outbox).where(source_outbox.c.source == name, source_outbox.c.state == "waiting")
        .returning(source_outbox.c.task_id)).scalars())
    return {"cancelled_tasks": cancelled, "dropped_writebacks": dropped, "in_flight": now.in_flight}


def resume(conn: Connection, name: str, by: str) -> dict[str, int]:
    """In the import's transaction, for a source created again: what its last removal left,
    resumed (see the module docstring). Counts, for the import's audit row."""
    removal = audit.last(conn, source_changes, name, "remove")
    if removal is None:
        return {}
    done = dict(removal.new_value or {})
    resumed = sorted(conn.execute(
        sa.update(tasks).where(tasks.c.id.in_([int(i) for i in done.get("cancelled_tasks", [])]),
                               tasks.c.status == "cancelled", tasks.c.source == name)
        .values(status="pending", error=None, attempts=0, updated_at=sa.func.now())
        .returning(tasks.c.id)).scalars())
    if resumed:
        conn.execute(sa.insert(task_operations).values(done_by=by, action="retry", task_ids=resumed,
                                                       filter={"source": name, "by": "source import"}))
    no_outbox = ~sa.exists().where(source_outbox.c.task_id == tasks.c.id)
    ended = sa.and_(tasks.c.source == name, tasks.c.from_table, tasks.c.status.in_(("solved", "failed")),
                    no_outbox)
    unwritten = sa.or_(tasks.c.id.in_([int(i) for i in done.get("dropped_writebacks", [])]),
                       tasks.c.updated_at >= removal.changed_at)
    queued = conn.execute(sa.insert(source_outbox).from_select(
        ["task_id", "source", "outcome"],
        sa.select(tasks.c.id, tasks.c.source, tasks.c.status).where(ended, unwritten))).rowcount
    return {"resumed_tasks": len(resumed), "writebacks_queued": int(queued)}
