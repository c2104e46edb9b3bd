"""What the history of finished tasks costs, and how to drop it.

Finished tasks (``solved``, ``failed``, ``cancelled``) pile up for ever;
everything that runs often must not read them. The live statuses are
counted from their partial indexes (``tasks_pending_order`` and
``tasks_in_flight_deadline``), so that count grows with the backlog, not with
the history. The finished ones are counted in full only by
:func:`finished_counts`, which the metrics exporter calls at most once per
:data:`FINISHED_RECOUNT_S` (:mod:`balancer.views.metrics`).

``balancer tasks prune --before T`` deletes finished tasks last changed
before ``T``, in batches of :data:`PRUNE_BATCH` (each its own transaction,
through the ``tasks_status_updated`` index), and audits each batch in
``task_operations`` (action ``prune``) as retries and cancels are. Their
calls' ledger rows (``call_usage``) are deleted with them, in the same
transaction, except the rows of calls that ended today (UTC): those are the
day's spend against each source's budget per day, so pruning today's tasks
gives nothing back to a budget; a prune after the day turns deletes them. So
spend so far counts the tasks kept, plus the calls of today's pruned ones. A task
that is pending, queued or running is never deleted, and a failed task a
``retry`` sends back to pending meanwhile is not matched. Nor is a task of a
source table whose write-back has not ended (:data:`WRITEBACK_ENDED`): the
prune says how many it kept (:func:`kept_for_writeback`).
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.backlog.ledger import delete_orphans, delete_usage
from balancer.costs.budget import day_start
from balancer.storage.schema import task_operations, tasks

LIVE_STATUSES = ("pending", "ready", "queued", "running")
FINISHED_STATUSES = ("solved", "failed", "cancelled")
#: Tasks one prune statement deletes (and one audit row lists).
PRUNE_BATCH = 10_000
#: Seconds the exporter reuses its count of finished tasks.
FINISHED_RECOUNT_S = 60.0


def live_status_counts(engine: Engine) -> dict[str, int]:
    """Pending, ready, queued and running tasks, each counted from its partial index."""
    with engine.connect() as conn:
        pending = conn.execute(sa.select(sa.func.count()).where(tasks.c.status == "pending")).scalar_one()
        rows = conn.execute(
            sa.select(tasks.c.status, sa.func.count())
            .where(tasks.c.status.in_(("ready", "queued", "running"))).group_by(tasks.c.status)
        ).all()
    counts = dict.fromkeys(LIVE_STATUSES, 0)
    counts["pending"] = int(pending)
    counts.update({status: int(n) for status, n in rows})
    return counts


def finished_counts(engine: Engine) -> dict[str, int]:
    """Solved, failed and cancelled tasks: reads the whole history (see the module docstring)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.status, sa.func.count()).where(tasks.c.status.in_(FINISHED_STATUSES)).group_by(tasks.c.status)
        ).all()
    counts = dict.fromkeys(FINISHED_STATUSES, 0)
    counts.update({status: int(n) for status, n in rows})
    return counts


#: balancer.sources' outbox, as far as a prune reads it (storage sits below the sources room).
_outbox = sa.table("source_outbox", sa.column("task_id", sa.BigInteger), sa.column("state", sa.Text))
#: The outbox states that end a write-back for good and let its task go: ``conflict``, the team's
#: row no longer matched ``where`` (changed by someone else, or gone), so reading it again finds
#: nothing; ``changed``, its prompt changed and the task was asked again (its next write-back has
#: an outbox row of its own). Any other state (waiting, or kept so that a row still matching
#: ``where`` is not asked again: balancer.sources.outbox) keeps its task: deleting it would have
#: the row read as new work and paid for twice.
WRITEBACK_ENDED = ("conflict", "changed")


def _writeback_open() -> sa.ColumnElement[bool]:
    return sa.exists().where(_outbox.c.task_id == tasks.c.id, _outbox.c.state.notin_(WRITEBACK_ENDED))


def _prunable(before: datetime) -> list[sa.ColumnElement[bool]]:
    return [tasks.c.status.in_(FINISHED_STATUSES), tasks.c.updated_at < before, ~_writeback_open()]


def kept_for_writeback(engine: Engine, before: datetime) -> int:
    """Finished tasks last changed before ``before`` that a prune keeps: a write-back of theirs
    to a source table has not ended (issue 38 finding 7)."""
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(
            tasks.c.status.in_(FINISHED_STATUSES), tasks.c.updated_at < before, _writeback_open())).scalar_one())


def prune(engine: Engine, before: datetime, *, by: str, apply: bool) -> int:
    """Delete (if ``apply``; else count) the finished tasks last changed before
    ``before``. Returns how many were, or would be, deleted."""
    if not apply:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).where(*_prunable(before))).scalar_one())
    deleted = 0
    today = day_start(datetime.now(UTC))  # the ledger rows since then are the budgets' spend today: kept
    while True:
        with engine.begin() as conn:
            batch = sa.select(tasks.c.id).where(*_prunable(before)).limit(PRUNE_BATCH) \
                .with_for_update(skip_locked=True).scalar_subquery()
            ids = sorted(conn.execute(
                sa.delete(tasks).where(tasks.c.id.in_(batch), *_prunable(before)).returning(tasks.c.id)
            ).scalars())
            if ids:
                # Their ended write-backs go with them (no outbox row outlives its task).
                conn.execute(sa.delete(_outbox).where(_outbox.c.task_id.in_(ids)))
                delete_usage(conn, ids, today)  # their calls' ledger rows go with them, but today's
                conn.execute(sa.insert(task_operations).values(
                    done_by=by, action="prune", filter={"before": before.isoformat()}, task_ids=ids))
        deleted += len(ids)
        if len(ids) < PRUNE_BATCH:
            with engine.begin() as conn:
                delete_orphans(conn, today)  # the rows an earlier day's prune kept
            return deleted
