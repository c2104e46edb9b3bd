"""The ledger: one ``call_usage`` row per call sent to the backend, with the
tokens it is counted for in spend.

A task can cost more than its answer: a hedge that lost, a call cut off at
the client's timeout and retried, a 5xx. Each call's row is written on the
answer writer's path (:mod:`balancer.calls.answers`): an answered call's row
in the very statement that writes its answer (a data-modifying CTE, so no
round trip more, and a duplicate answer, the loser of a hedged race that ran
to its end, still leaves its row); the row of a call that got no answer in
the writer's next batch, behind the call, never on its path. What a call
that got no answer is counted for is one rule,
:func:`balancer.costs.cost.billed_tokens`.

Each row carries what the call cost at the prices in force when it was made,
in their currency (:class:`balancer.costs.cost.Charged`): spend and budgets
read that, so a later price change applies to later calls only.

Each row carries its call's own id (``call_id``) and is inserted with
``ON CONFLICT DO NOTHING``, so a write retried after a commit whose reply was
lost adds no second row. A row handed over and not yet written when its
process dies is lost, as an answer is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields, replace
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from balancer.backlog.statements import one_statement
from balancer.storage.schema import call_usage, tasks


@dataclass(frozen=True)
class Usage:
    """One call's row in the ledger (the columns of ``call_usage``, in order)."""

    call_id: str
    task_id: int
    source: str
    model: str
    admission_id: str
    prompt_tokens: int
    completion_tokens: int
    answered: bool
    hedge: bool
    ended_at: datetime
    #: At the prices in force when the call was made (None: its model had no price).
    cost: float | None = None
    currency: str | None = None


_COLUMNS = tuple(f.name for f in fields(Usage))


def _insert_rows() -> Any:
    """``INSERT ... SELECT FROM unnest(arrays) ON CONFLICT DO NOTHING``: any number of
    rows, bound as one array per column (``u_<column>``), built and compiled once."""
    kinds = [(name, call_usage.c[name].type) for name in _COLUMNS]
    rows = (
        sa.func.unnest(*(sa.bindparam(f"u_{name}", type_=postgresql.ARRAY(kind)) for name, kind in kinds))
        .table_valued(*(sa.column(name, kind) for name, kind in kinds))
        .render_derived(name="calls")
    )
    return postgresql.insert(call_usage).from_select(list(_COLUMNS), sa.select(*rows.c)).on_conflict_do_nothing()


_INSERT = _insert_rows()
#: The same insert, to ride in another write's statement (:func:`with_usage`).
_CTE = _INSERT.cte("ledger")


def usage_params(usage: Sequence[Usage]) -> dict[str, list[Any]]:
    """The bound arrays of ``usage``, for :data:`_INSERT` or a statement :func:`with_usage` built."""
    columns = list(zip(*(astuple(u) for u in usage), strict=True)) if usage else [()] * len(_COLUMNS)
    return {f"u_{name}": list(values) for name, values in zip(_COLUMNS, columns, strict=True)}


def storable_usage(usage: Sequence[Usage], most: int) -> list[Usage]:
    """``usage`` with each row's tokens held to 0..``most`` (what its columns hold)."""
    return [replace(u, prompt_tokens=max(0, min(most, u.prompt_tokens)),
                    completion_tokens=max(0, min(most, u.completion_tokens))) for u in usage]


def with_usage(statement: Any) -> Any:
    """``statement`` that also inserts the rows bound by :func:`usage_params` (none for empty arrays)."""
    return statement.add_cte(_CTE)


def record_usage(engine: Engine, usage: Sequence[Usage]) -> None:
    """Insert ``usage``'s rows in one statement, sent alone in autocommit."""
    if not usage:
        return
    with one_statement(engine) as conn:
        conn.execute(_INSERT, usage_params(usage))


def delete_usage(conn: Connection, task_ids: Sequence[int], ended_before: datetime) -> None:
    """Delete the rows of these tasks (pruned with them) of calls that ended before ``ended_before``:
    the rest are today's spend, which budgets per day read (:func:`delete_orphans` takes them later)."""
    if task_ids:
        conn.execute(sa.delete(call_usage).where(call_usage.c.task_id.in_(list(task_ids)),
                                                 call_usage.c.ended_at < ended_before))


def delete_orphans(conn: Connection, ended_before: datetime) -> int:
    """Delete the rows, of calls that ended before ``ended_before``, whose task is gone (pruned
    while they were the day's spend). Returns how many."""
    gone = ~sa.exists().where(tasks.c.id == call_usage.c.task_id)
    return int(conn.execute(sa.delete(call_usage).where(call_usage.c.ended_at < ended_before, gone)).rowcount or 0)


def calls_recorded(engine: Engine) -> int:
    """How many calls the ledger holds."""
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(call_usage)).scalar_one())
