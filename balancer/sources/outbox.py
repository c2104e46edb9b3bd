"""The write-back outbox: each ended task of a declared source, until its row is written.

A row of ``source_outbox`` is in one state:

- ``waiting``: to write (again at ``next_attempt_at``);
- ``conflict``: not overwritten: the team's row no longer matched ``where`` (someone
  else answered or changed it), or is gone;
- ``changed``: not overwritten: the team changed the row's prompt since it was read
  and the row still matches ``where``; its task was asked again with the new prompt
  (:mod:`balancer.sources.reask`), whose end queues a new outbox row;
- ``written``: written, but the written row still matches ``where`` (so a re-read
  would take it for re-opened): kept, so that it is not asked again;
- ``unrecorded``: a failure its source declares no column for (no ``status``, no
  ``error``): nothing written, its row left as it was, still matching ``where``: kept,
  as a ``written`` one is, so that it is not asked again (``balancer tasks retry`` asks it);
- ``unwritable``: the team's table refused it ``BALANCER_WRITEBACK_ATTEMPTS`` times
  (a CHECK, a value too long, a character its encoding lacks), ``last_error`` says
  why; ``balancer source unwritable NAME --retry`` writes it again, ``--drop`` gives up;
- ``dropped``: given up by an operator (audited in ``source_changes``); kept, so that
  its row, which still matches ``where``, is not asked again.

A row written back is deleted. The back-off of a failed try is 2 ** tries seconds,
the exponent capped so that it never overflows, at most :data:`MAX_BACKOFF_S`.

``balancer tasks show`` says where an ended table task's write-back stands
(:func:`task_writeback`): the state of the outbox row its last end queued, or
written when that row is gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Engine

from balancer.errors import BalancerError
from balancer.sources.schema import source_outbox, sources
from balancer.storage import audit
from balancer.storage.schema import source_changes, tasks

WAITING, CONFLICT, CHANGED, WRITTEN, UNRECORDED, UNWRITABLE, DROPPED = (
    "waiting", "conflict", "changed", "written", "unrecorded", "unwritable", "dropped")
#: ``tasks show``: no write-back of the task, for its source is no longer declared (removed).
NO_SOURCE = "no source"
#: The states that keep a task from being asked again when its row is read matching ``where``.
KEEPS_TASK = (WAITING, WRITTEN, UNRECORDED, UNWRITABLE, DROPPED)
#: The longest wait before a failed write-back is tried again.
MAX_BACKOFF_S = 60
#: 2 ** this is past MAX_BACKOFF_S: the exponent never grows beyond it.
_MAX_EXPONENT = 6


def _backoff(tries: Any) -> Any:
    """``now()`` plus the back-off after ``tries`` failed tries (an SQL expression)."""
    seconds = sa.func.least(MAX_BACKOFF_S, sa.func.power(2, sa.func.least(tries, _MAX_EXPONENT)))
    return sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds)


def claim(conn: Connection, source: str, limit: int) -> list[dict]:
    """Up to ``limit`` of ``source``'s waiting write-backs that are due, locked for the caller's
    transaction (``SKIP LOCKED``: two drainers never take the same row), with their tasks'
    end and fence (a task ingested before the fence existed: its prompt's md5 now)."""
    fingerprint = sa.func.coalesce(tasks.c.source_fingerprint,
                                   sa.func.md5(sa.func.convert_to(tasks.c.prompt, "UTF8")))
    query = (
        sa.select(source_outbox.c.id, source_outbox.c.outcome, source_outbox.c.task_id, tasks.c.key, tasks.c.answer,
                  tasks.c.error, tasks.c.model, tasks.c.priority, tasks.c.max_tokens, fingerprint.label("fingerprint"),
                  tasks.c.source_replaces.label("replaces"))
        .join(tasks, tasks.c.id == source_outbox.c.task_id)
        .where(source_outbox.c.source == source, source_outbox.c.state == WAITING,
               source_outbox.c.next_attempt_at <= sa.func.now())
        .order_by(source_outbox.c.id).limit(limit)
        .with_for_update(of=source_outbox, skip_locked=True)
    )
    return [dict(r._mapping) for r in conn.execute(query)]


def mark(conn: Connection, ids: list[int], state: str, error: str | None = None) -> None:
    """``ids`` to ``state``; ``"deleted"``: written back, gone."""
    if not ids:
        return
    rows = source_outbox.c.id.in_(ids)
    if state == "deleted":
        conn.execute(sa.delete(source_outbox).where(rows))
    else:
        conn.execute(sa.update(source_outbox).where(rows).values(
            state=state, **({"last_error": error} if error is not None else {})))


def retry_later(conn: Connection, ids: list[int], error: str) -> None:
    """A transient failure (the database away, a lock or statement timeout): tried again after
    the back-off, without limit."""
    conn.execute(sa.update(source_outbox).where(source_outbox.c.id.in_(ids)).values(
        attempts=source_outbox.c.attempts + 1, last_error=error, next_attempt_at=_backoff(source_outbox.c.attempts)))


_REFUSE = sa.text("""
UPDATE source_outbox o SET refusals = o.refusals + 1, attempts = o.attempts + 1, last_error = v.error,
       state = CASE WHEN o.refusals + 1 >= :most THEN :unwritable ELSE o.state END,
       next_attempt_at = now() + make_interval(secs => least(:max_backoff, power(2, least(o.refusals, :max_exponent))))
FROM unnest(:ids, :errors) AS v(id, error) WHERE o.id = v.id
RETURNING o.state
""").bindparams(sa.bindparam("ids", type_=ARRAY(sa.BigInteger)), sa.bindparam("errors", type_=ARRAY(sa.Text)),
                unwritable=UNWRITABLE, max_backoff=MAX_BACKOFF_S, max_exponent=_MAX_EXPONENT)


def refuse(conn: Connection, refused: dict[int, str], most: int) -> int:
    """Write-backs the team's table refused, each with its error: tried again after the
    back-off, or ``unwritable`` at the ``most``-th refusal. Returns how many became unwritable."""
    if not refused:
        return 0
    states = conn.execute(_REFUSE, {"ids": list(refused), "errors": list(refused.values()), "most": most}).scalars()
    return sum(1 for s in states if s == UNWRITABLE)


# -- the operator's command: balancer source unwritable NAME [--retry | --drop] --------------

def unwritable(engine: Engine, source: str) -> list[dict[str, Any]]:
    """``source``'s unwritable write-backs, oldest first: the task, its key, outcome, tries and last error."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(source_outbox.c.task_id, tasks.c.key, source_outbox.c.outcome, source_outbox.c.refusals,
                      source_outbox.c.last_error)
            .join(tasks, tasks.c.id == source_outbox.c.task_id)
            .where(source_outbox.c.source == source, source_outbox.c.state == UNWRITABLE)
            .order_by(source_outbox.c.id)).mappings().all()
    return [dict(r) for r in rows]


def settle_unwritable(engine: Engine, source: str, action: str, *, by: str) -> int:
    """``retry``: ``source``'s unwritable write-backs wait again, their refusals reset; ``drop``:
    they are given up (``dropped``). Audited in ``source_changes``. Returns how many."""
    if action not in ("retry", "drop"):
        raise BalancerError(f"unknown action {action!r}")
    values: dict[str, Any] = ({"state": WAITING, "refusals": 0, "next_attempt_at": sa.func.now()} if action == "retry"
                              else {"state": DROPPED})
    with engine.begin() as conn:
        ids = conn.execute(sa.update(source_outbox)
                           .where(source_outbox.c.source == source, source_outbox.c.state == UNWRITABLE)
                           .values(**values).returning(source_outbox.c.task_id)).scalars().all()
        if ids:
            audit.record(conn, source_changes, source, by=by, action=f"{action} unwritable",
                         old={"unwritable": len(ids)}, new={"task_ids": sorted(ids)})
    return len(ids)


# -- one task's write-back, as ``balancer tasks show`` says it ------------------------------

@dataclass(frozen=True)
class TaskWriteback:
    """Where one ended table task's write-back stands: a state above (:data:`WRITTEN` also once
    its outbox row is gone, written), or :data:`NO_SOURCE`; a waiting one's tries and last error."""

    state: str
    attempts: int = 0
    last_error: str | None = None
    next_attempt_at: datetime | None = None

    def text(self) -> str:
        """For a person.

        >>> TaskWriteback(WAITING, 2, "permission denied for table t4").text()
        'waiting: failed 2 time(s), retried; last: permission denied for table t4'
        >>> TaskWriteback(WAITING).text(), TaskWriteback(WRITTEN).text()
        ('waiting to be written', 'written')
        """
        if self.state == WAITING and self.attempts:
            return f"waiting: failed {self.attempts} time(s), retried; last: {self.last_error or 'no error recorded'}"
        if self.state == UNWRITABLE:
            return f"unwritable: its table refused it; last: {self.last_error or 'no error recorded'}"
        return _SAID[self.state]

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "attempts": self.attempts, "last_error": self.last_error,
                "next_attempt_at": self.next_attempt_at, "text": self.text()}


_SAID = {
    WAITING: "waiting to be written",
    CONFLICT: "not overwritten: its row no longer matched where (someone else changed or answered it, or it is gone)",
    CHANGED: "not written: its row's prompt changed since it was read (asked again with the new prompt)",
    WRITTEN: "written",
    UNRECORDED: ("none: its source declares no column for a failure (no status, no error): its row is left as it "
                 "was, not asked again (`balancer tasks retry` asks it again)"),
    DROPPED: "dropped by an operator: never written",
    NO_SOURCE: "none: its source is no longer declared",
}

#: The statuses a task ends in with a write-back queued (by the ``tasks_finished`` trigger).
ENDED_WITH_WRITEBACK = ("solved", "failed")


def of_last_end(outbox: sa.FromClause, task: sa.FromClause) -> sa.ColumnElement[bool]:
    """Whether an outbox row is the one its task's last end queued, or later. The end's trigger queues
    it in the transaction that ends the task, so not before the task last started or was solved; a
    row of an earlier end (kept as conflict, changed, written or dropped when the task was asked
    again or retried, both of which clear ``started_at`` and ``solved_at``:
    :data:`balancer.backlog.operations._RETRY`) is older."""
    never = sa.cast(sa.literal("-infinity"), sa.DateTime(timezone=True))
    return outbox.c.created_at >= sa.func.coalesce(task.c.solved_at, task.c.started_at, never)


def _task_writeback() -> sa.Select:
    t = tasks.alias("t")
    o = (sa.select(source_outbox.c.state, source_outbox.c.attempts, source_outbox.c.last_error,
                   source_outbox.c.next_attempt_at)
         .where(source_outbox.c.task_id == t.c.id, of_last_end(source_outbox, t))
         .order_by(source_outbox.c.id.desc()).limit(1).lateral("o"))
    declared = sa.exists().where(sources.c.name == t.c.source).label("declared")
    return (sa.select(declared, o.c.state, o.c.attempts, o.c.last_error, o.c.next_attempt_at)
            .select_from(t.outerjoin(o, sa.true()))
            .where(t.c.id == sa.bindparam("id"), t.c.from_table, t.c.key.is_not(None),
                   t.c.status.in_(ENDED_WITH_WRITEBACK)))


_TASK_WRITEBACK = _task_writeback()


def task_writeback(conn: Connection, task_id: int) -> TaskWriteback | None:
    """Where the write-back of task ``task_id`` stands; None: it is no ended task of a source table."""
    row = conn.execute(_TASK_WRITEBACK, {"id": task_id}).first()
    if row is None:
        return None
    if row.state is not None:
        return TaskWriteback(row.state, int(row.attempts), row.last_error, row.next_attempt_at)
    return TaskWriteback(WRITTEN if row.declared else NO_SOURCE)
