"""What an operator does to the backlog: list, show, retry failed (or cancelled) tasks, cancel pending ones.

Safe while the pipeline runs. ``retry`` changes only ``failed`` tasks (``cancelled``
ones when asked: ``--status cancelled``; a cancel otherwise stands) and ``cancel``
only ``pending`` ones, each in one UPDATE whose WHERE holds that status, so a task a
worker holds (``ready``, ``queued`` or ``running``) is never changed whatever the
filter says, and a task that a dispatcher takes meanwhile is simply not matched.
A cancelled task of a source table leaves its row as it was, never asked again
(its key is a task): its retry is how the row is asked again. Every applied retry
or cancel is audited in ``task_operations`` (who, when, the filter, the task ids),
as quota changes are in ``quota_changes``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.backlog.statuses import TASK_STATUSES
from balancer.errors import BalancerError, printable
from balancer.storage.schema import task_operations, tasks


@dataclass(frozen=True)
class TaskFilter:
    """Which tasks a command acts on; every field narrows, None means any.

    ``model`` matches the model a task ran on or any model it may use;
    ``task_id`` picks one task (the web console's retry of one task).
    """

    status: str | None = None
    model: str | None = None
    source: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    task_id: int | None = None

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in TASK_STATUSES:
            raise BalancerError(f"unknown status {printable(self.status)!r}: use one of {', '.join(TASK_STATUSES)}")
        if self.created_after and self.created_before and self.created_after >= self.created_before:
            raise BalancerError("--created-after must be earlier than --created-before")

    def clauses(self) -> list[Any]:
        where: list[Any] = []
        if self.status is not None:
            where.append(tasks.c.status == self.status)
        if self.model is not None:
            where.append(sa.or_(tasks.c.model == self.model, sa.literal(self.model) == sa.any_(tasks.c.allowed_models)))
        if self.source is not None:
            where.append(tasks.c.source == self.source)
        if self.created_after is not None:
            where.append(tasks.c.created_at > self.created_after)
        if self.created_before is not None:
            where.append(tasks.c.created_at < self.created_before)
        if self.task_id is not None:
            where.append(tasks.c.id == self.task_id)
        return where

    def as_dict(self) -> dict[str, str]:
        """The filter as the audit stores it (only the fields given)."""
        return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in vars(self).items() if v is not None}


def names_no_task_has(engine: Engine, flt: TaskFilter) -> list[str]:
    """For a filter that matched nothing: its model and source that no task names at all, each as a
    note (a typo matches nothing, which reads as "nothing to do"). Read only when nothing matched."""
    asked = ([(TaskFilter(model=flt.model), f"no task has run on, or may use, a model named {printable(flt.model, 80)!r}")]
             if flt.model is not None else []) + \
        ([(TaskFilter(source=flt.source), f"no task has the source {printable(flt.source, 80)!r}")]
         if flt.source is not None else [])
    with engine.connect() as conn:
        return [note for one, note in asked
                if conn.execute(sa.select(tasks.c.id).where(*one.clauses()).limit(1)).first() is None]


def list_tasks(engine: Engine, flt: TaskFilter, *, limit: int = 50, timeout_ms: int | None = None) -> list[Any]:
    """The matching tasks, newest first, at most ``limit``. With ``timeout_ms``, a search
    that takes longer is cancelled (PostgreSQL's statement_timeout; SQLAlchemy raises
    ``OperationalError``): a filter few tasks match may read the whole table."""
    columns = (tasks.c.id, tasks.c.status, tasks.c.model, tasks.c.allowed_models, tasks.c.source, tasks.c.priority,
               tasks.c.attempts, tasks.c.created_at, tasks.c.solved_at, tasks.c.error,
               sa.func.left(tasks.c.prompt, 60).label("prompt_preview"))
    with engine.connect() as conn:
        if timeout_ms is not None:
            conn.execute(sa.select(sa.func.set_config("statement_timeout", str(int(timeout_ms)), True)))
        return list(conn.execute(sa.select(*columns).where(*flt.clauses()).order_by(tasks.c.id.desc()).limit(limit)))


def get_task(engine: Engine, task_id: int) -> Any:
    """One task's whole row, or None."""
    with engine.connect() as conn:
        return conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).first()


#: What a retry resets: a failed task becomes a fresh pending one.
#: balancer.sources' tables, as far as a retry reads them (storage sits below the sources room).
_sources = sa.table("sources", sa.column("name", sa.Text))
_outbox = sa.table("source_outbox", sa.column("task_id", sa.BigInteger), sa.column("state", sa.Text))
#: A retried source task's write-backs of its failure still to do, or with nothing to do (``unrecorded``:
#: kept only so that its row is not asked again): dropped, its new end is written instead.
_FAILURE_UNWRITTEN = ("waiting", "unwritable", "unrecorded")

_RETRY = dict(status="pending", attempts=0, rate_limited=0, error=None, model=None, admission_id=None,
              hedge_admission_id=None, hedge_model=None, avoid_model=None, not_before=None, deadline=None,
              answer=None, queued_at=None, started_at=None, solved_at=None, hedges=0,
              # A declared source's task: what its failure wrote to its row, which the new end's
              # write-back may replace (issue 38 finding 7; balancer.sources.catalog). A cancelled
              # task wrote nothing: it keeps what it held when it last went back to pending.
              source_replaces=sa.case(
                  (tasks.c.status == "cancelled", tasks.c.source_replaces),
                  (sa.and_(tasks.c.key.is_not(None), sa.exists().where(_sources.c.name == tasks.c.source)),
                   sa.func.jsonb_build_object("error", tasks.c.error)), else_=sa.null()))

#: The statuses each action changes; the first is the one it changes when the filter names none.
ACTS_ON = {"retry": ("failed", "cancelled"), "cancel": ("pending",)}


def retry_failed_or_cancelled(engine: Engine, flt: TaskFilter, *, by: str, apply: bool) -> list[int]:
    """Failed tasks matching ``flt`` (cancelled ones, with ``status="cancelled"``) back to pending
    with their attempts reset (if ``apply``). Returns the ids (that were, or would be, retried)."""
    return _act(engine, "retry", flt, _RETRY, by=by, apply=apply)


def still_too_large(engine: Engine, ids: Sequence[int], bursts: Mapping[str, int]) -> int:
    """How many of the tasks ``ids`` need more tokens than the largest ``bursts`` (each model's
    burst_tokens) of the models they may use: retried, they fail again at once, for that reason."""
    if not ids or not bursts:
        return 0
    with engine.connect() as conn:
        rows = conn.execute(sa.select(tasks.c.estimated_tokens, tasks.c.allowed_models).where(tasks.c.id.in_(ids))).all()
    # Only models that have a quota: a task whose models were all removed waits for one (warn_stranded says so).
    largest = [max((bursts[m] for m in (r.allowed_models or bursts) if m in bursts), default=None) for r in rows]
    return sum(1 for r, most in zip(rows, largest, strict=True) if most is not None and r.estimated_tokens > most)


def cancel_pending(engine: Engine, flt: TaskFilter, *, by: str, apply: bool) -> list[int]:
    """Pending tasks matching ``flt`` out of the backlog, as ``cancelled`` (if ``apply``)."""
    return _act(engine, "cancel", flt, {"status": "cancelled", "error": f"cancelled by {by}"}, by=by, apply=apply)


def _act(engine: Engine, action: str, flt: TaskFilter, values: dict[str, Any], *, by: str, apply: bool) -> list[int]:
    acts_on = ACTS_ON[action]
    if flt.status not in (None, *acts_on):
        raise BalancerError(f"{action} acts on {' or '.join(acts_on)} tasks only: --status {flt.status} would change "
                            "nothing")
    where = [tasks.c.status == (flt.status or acts_on[0]), *flt.clauses()]
    with engine.begin() as conn:
        if not apply:
            return list(conn.execute(sa.select(tasks.c.id).where(*where).order_by(tasks.c.id)).scalars())
        ids = sorted(conn.execute(
            sa.update(tasks).where(*where).values(updated_at=sa.func.now(), **values).returning(tasks.c.id)
        ).scalars())
        if ids and action == "retry":
            conn.execute(sa.delete(_outbox).where(_outbox.c.task_id.in_(ids), _outbox.c.state.in_(_FAILURE_UNWRITTEN)))
        if ids:
            conn.execute(sa.insert(task_operations).values(done_by=by, action=action, filter=flt.as_dict(), task_ids=ids))
    return ids


def operations(engine: Engine) -> list[dict[str, Any]]:
    """The audit of applied retries and cancels, oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(task_operations).order_by(task_operations.c.id)).mappings().all()
    return [dict(r) for r in rows]
