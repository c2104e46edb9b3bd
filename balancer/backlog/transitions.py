"""A task's status changes on the solve path, each one guarded statement.

Status flow (``balancer.backlog.statuses.TASK_STATUSES``)::

    pending --dispatch (publish)--> queued --worker starts--> running --answer--> solved
     |  ^   \\--stock--> ready ------/ (a finishing call  |   \\--> failed (4xx, max attempts, 50 429s)
     |  |            (waits on its   takes it off its     |
     |  |             model's ready  model's ready list)  |
     |  |             list)                               |
     |  +---- 429, 5xx, timeout (with back-off), circuit open, no room, ----+
     |        deadline passed (the sweep: ready, queued or running),
     |        ready entry dropped (unstock), an operator's retry of a failed task
     +--operator cancel--> cancelled
     +--never admissible--> failed

Every change here is guarded by the task's admission id (:mod:`balancer.backlog.statements`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from balancer.backlog.ledger import Usage, storable_usage, usage_params, with_usage
from balancer.backlog.statements import (
    ADMISSION_ID,
    TASK_ID,
    SolveContext,
    admission_guard,
    context_columns,
    hedge_guard,
    one_statement,
    update_where,
)
from balancer.storage.schema import tasks

# A call's start is committed without waiting for the WAL flush (``synchronous_commit``
# off for its transaction only, set inside the statement: no extra round trip).
# PostgreSQL's fsync stalls (100 to 700 ms on a busy disk, every commit at once)
# then never hold a call back. Nothing is lost that matters: a start lost in a
# server crash leaves the task ``queued`` under the same admission, and its call's
# answer is still accepted (the write's guard takes ``queued``); the answer's
# own commit is durable and, the WAL being sequential, flushes the start with it.
_NO_FLUSH = sa.func.set_config("synchronous_commit", "off", sa.true())


_START_SOLVE = (
    sa.update(tasks)
    .where(tasks.c.id == TASK_ID, tasks.c.admission_id == ADMISSION_ID,
           sa.or_(tasks.c.status.in_(("ready", "queued")), sa.and_(tasks.c.status == "running", tasks.c.deadline < sa.func.now())))
    .values(status="running", started_at=sa.func.now(), updated_at=sa.func.now(), attempts=tasks.c.attempts + 1,
            deadline=sa.func.now() + sa.bindparam("b_lease", type_=sa.Interval()))
    .returning(*context_columns(tasks.c.model), _NO_FLUSH)
)


def _solved(answer: Any, prompt_tokens: Any, completion_tokens: Any) -> dict[str, Any]:
    """The values a solved task holds (bound parameters or another table's columns)."""
    return dict(status="solved", answer=answer, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                solved_at=sa.func.now(), updated_at=sa.func.now(), error=None, deadline=None)


# A hedge's answer: ``b_admission_id`` is the hedge's, and the task records the hedge's model.
# Its call's ledger row rides in the same statement (:func:`balancer.backlog.ledger.with_usage`).
_MARK_HEDGE_SOLVED = with_usage(
    sa.update(tasks).where(hedge_guard(TASK_ID, ADMISSION_ID))
    .values(model=sa.bindparam("b_model"),
            **_solved(sa.bindparam("b_answer"), sa.bindparam("b_prompt_tokens"), sa.bindparam("b_completion_tokens")))
    .returning(tasks.c.admission_id)
)


def start_solve(engine: Engine, task_id: int, admission_id: str, lease_seconds: int) -> SolveContext | None:
    """Mark the task running and read what the call needs, in one statement.

    None if the message is stale (the task was solved, failed, or dispatched
    again under another admission since this message was sent), or if its
    call is running in a live worker: ``running`` with a deadline its
    heartbeat keeps in the future. A redelivered or duplicated message
    must not start a second call; once the deadline has passed (the worker
    is gone), a redelivered message takes the call over.
    """
    with one_statement(engine) as conn:
        row = conn.execute(
            _START_SOLVE, {"b_task_id": task_id, "b_admission_id": admission_id, "b_lease": timedelta(seconds=lease_seconds)}
        ).first()
    return SolveContext(*row[:-1]) if row else None  # the last column is _NO_FLUSH's


def is_running_elsewhere(engine: Engine, task_id: int, admission_id: str) -> bool:
    """Whether the task's call under ``admission_id`` is running with a live deadline
    (what :func:`start_solve` refuses a second call for)."""
    with engine.connect() as conn:
        return conn.execute(
            sa.select(tasks.c.id).where(
                tasks.c.id == task_id, tasks.c.admission_id == admission_id, tasks.c.status == "running",
                tasks.c.deadline >= sa.func.now(),
            )
        ).first() is not None


def extend_deadlines(engine: Engine, admission_ids: Sequence[str], lease_seconds: int) -> int:
    """Push the deadline of the queued or running tasks whose call or hedge is one of
    ``admission_ids`` one lease from now (a worker's heartbeat: whichever call of a
    hedged task is still live keeps it); returns how many were extended.

    One statement in autocommit (:func:`one_statement`): PostgreSQL commits it as it runs, so a
    worker whose host is cut off after sending it holds no row. As a transaction of its own, a
    cut before its COMMIT left every running row of that worker locked until the cut healed, and
    the dispatcher's hedges of those very calls waited on them."""
    if not admission_ids:
        return 0
    ids = list(admission_ids)
    with one_statement(engine) as conn:
        result = conn.execute(
            sa.update(tasks)
            .where(sa.or_(tasks.c.admission_id.in_(ids), tasks.c.hedge_admission_id.in_(ids)),
                   tasks.c.status.in_(("ready", "queued", "running")))
            .values(deadline=sa.func.now() + timedelta(seconds=lease_seconds))
        )
    return result.rowcount


def _guarded_update(engine: Engine, task_id: int, admission: str, /, *, unhedged: bool = False, **values: object) -> bool:
    """Apply ``values`` only if the task is still queued/running under this admission
    (and, with ``unhedged``, has no hedge in flight: then the hedge's answer decides)."""
    guard = admission_guard(task_id, admission)
    if unhedged:
        guard = sa.and_(guard, tasks.c.hedge_admission_id.is_(None))
    return update_where(engine, guard, **values)


@dataclass(frozen=True)
class Written:
    """An answer stored. ``other_call``: the admission id of the task's other call
    when it was hedged, the loser of the race, to be cancelled; else None.
    ``refused``: the answer could not be stored, and its task failed with this reason
    (:func:`mark_unstorable`)."""

    other_call: str | None = None
    refused: str | None = None


@dataclass(frozen=True)
class Answer:
    """One call's answer, to be written under its admission (:func:`mark_solved_many`),
    or, with ``hedge_model``, a hedge's under the hedge's (:func:`mark_solved`)."""

    task_id: int
    admission_id: str
    answer: str
    prompt_tokens: int
    completion_tokens: int
    hedge_model: str | None = None


#: The largest value an ``integer`` column (a task's or a ledger row's tokens) holds.
MAX_INT = 2**31 - 1


def unstorable(answer: Answer) -> str | None:
    """Why PostgreSQL could not store ``answer``, or None: a NUL character or a lone
    surrogate in its text, or reported tokens outside an ``integer`` column.

    >>> unstorable(Answer(1, "a", "fine", 10, 2)) is None
    True
    >>> unstorable(Answer(1, "a", "bad\\x00", 10, 2))
    "the model's answer contains a NUL character (PostgreSQL's text cannot hold one)"
    >>> unstorable(Answer(1, "a", "ok", 2**31, 2))
    'the backend reported 2,147,483,648 prompt tokens, more than a task can record (2,147,483,647)'
    """
    if "\x00" in answer.answer:
        return "the model's answer contains a NUL character (PostgreSQL's text cannot hold one)"
    try:
        answer.answer.encode("utf-8")
    except UnicodeEncodeError:
        return "the model's answer is not valid UTF-8 (a lone surrogate)"
    for kind, value in (("prompt", answer.prompt_tokens), ("completion", answer.completion_tokens)):
        if not 0 <= value <= MAX_INT:
            return f"the backend reported {value:,} {kind} tokens, more than a task can record ({MAX_INT:,})"
    return None


def _failed(error: Any) -> dict[str, Any]:
    return dict(status="failed", error=error, deadline=None, updated_at=sa.func.now())


# An answer that cannot be stored ends its task failed, under the call's guard (a hedge's under the hedge's).
_REFUSE = with_usage(sa.update(tasks).where(admission_guard(TASK_ID, ADMISSION_ID))
                     .values(**_failed(sa.bindparam("b_error"))).returning(tasks.c.hedge_admission_id))
_REFUSE_HEDGE = with_usage(sa.update(tasks).where(hedge_guard(TASK_ID, ADMISSION_ID))
                           .values(model=sa.bindparam("b_model"), **_failed(sa.bindparam("b_error")))
                           .returning(tasks.c.admission_id))


def mark_unstorable(engine: Engine, answer: Answer, reason: str, usage: Sequence[Usage] = ()) -> Written | None:
    """The task of an answer PostgreSQL cannot store (:func:`unstorable`, or a write it refused)
    ends ``failed`` with ``reason``, so it is never called again for it; ``usage``'s ledger rows
    (the call was made, and paid) in the same statement, their tokens held to :data:`MAX_INT`.
    None if the task was already finished or taken from this call."""
    params = {"b_task_id": answer.task_id, "b_admission_id": answer.admission_id, "b_error": reason,
              "b_model": answer.hedge_model, **usage_params(storable_usage(usage, MAX_INT))}
    with one_statement(engine) as conn:
        row = conn.execute(_REFUSE if answer.hedge_model is None else _REFUSE_HEDGE, params).first()
    return None if row is None else Written(row[0], refused=reason)


def mark_solved(engine: Engine, answer: Answer, usage: Sequence[Usage] = ()) -> Written | None:
    """Write the answer once. None if someone else already finished it (a duplicate).
    ``usage``'s ledger rows are inserted in the same statement, written or not.

    With ``answer.hedge_model``, ``answer.admission_id`` is the hedge's: the first
    answer of the two calls wins, and the task records the model that gave it.
    """
    if answer.hedge_model is None:
        return mark_solved_many(engine, [answer], usage)[0]
    params = {"b_task_id": answer.task_id, "b_admission_id": answer.admission_id, "b_answer": answer.answer,
              "b_prompt_tokens": answer.prompt_tokens, "b_completion_tokens": answer.completion_tokens,
              "b_model": answer.hedge_model, **usage_params(usage)}
    with one_statement(engine) as conn:
        row = conn.execute(_MARK_HEDGE_SOLVED, params).first()
    return None if row is None else Written(row[0])


def _mark_solved_many_statement() -> Any:
    """One statement for any number of answers: their fields as arrays, unnested
    into rows, so it is built and compiled once (a ``VALUES`` list is a new
    statement for every batch size, compiled each time)."""
    fields = (("id", sa.BigInteger), ("admission_id", sa.String), ("answer", sa.String),
              ("prompt_tokens", sa.Integer), ("completion_tokens", sa.Integer))
    rows = (
        sa.func.unnest(*(sa.bindparam(f"b_{name}", type_=postgresql.ARRAY(kind)) for name, kind in fields))
        .table_valued(*(sa.column(name, kind) for name, kind in fields))
        .render_derived(name="answers")
    )
    return with_usage(
        sa.update(tasks).where(admission_guard(rows.c.id, rows.c.admission_id))
        .values(**_solved(rows.c.answer, rows.c.prompt_tokens, rows.c.completion_tokens))
        .returning(tasks.c.id, tasks.c.hedge_admission_id)
    )


_MARK_SOLVED_MANY = _mark_solved_many_statement()


def mark_solved_many(engine: Engine, answers: Sequence[Answer], usage: Sequence[Usage] = ()) -> list[Written | None]:
    """:func:`mark_solved` for several answers in one statement (one commit, one
    WAL flush), each under its own guard (none a hedge's), with ``usage``'s ledger
    rows (any calls', answered or not). In ``answers``' order: what was
    written, or None for a duplicate. One answer per task: a task twice in one
    statement would be updated from either row, unpredictably.

    >>> # mark_solved_many(engine, [Answer(7, "a7", "42", 10, 2), Answer(8, "a8", "43", 10, 3)])
    """
    params = {"b_id": [a.task_id for a in answers], "b_admission_id": [a.admission_id for a in answers],
              "b_answer": [a.answer for a in answers], "b_prompt_tokens": [a.prompt_tokens for a in answers],
              "b_completion_tokens": [a.completion_tokens for a in answers], **usage_params(usage)}
    with one_statement(engine) as conn:
        written = {row.id: Written(row.hedge_admission_id) for row in conn.execute(_MARK_SOLVED_MANY, params)}
    return [written.get(a.task_id) for a in answers]


def back_to_pending(
    engine: Engine,
    task_id: int,
    admission_id: str,
    *,
    error: str | None,
    delay_seconds: float = 0.0,
    rate_limited: bool = False,
    uncount_attempt: bool = False,
    avoid_model: str | None = None,
) -> bool:
    """Hand the task back to the dispatcher, which may choose another model
    (and passes over ``avoid_model`` when another allowed model has room)."""
    values: dict = {
        "status": "pending",
        "model": None,
        "admission_id": None,
        "deadline": None,
        "error": error,
        "not_before": sa.func.now() + timedelta(seconds=delay_seconds) if delay_seconds > 0 else None,
        "avoid_model": avoid_model,
    }
    if rate_limited:
        values["rate_limited"] = tasks.c.rate_limited + 1
    if uncount_attempt:  # no call was made after all
        values["attempts"] = tasks.c.attempts - 1
    return _guarded_update(engine, task_id, admission_id, unhedged=True, **values)


def mark_failed(engine: Engine, task_id: int, admission_id: str, error: str, *, uncount_attempt: bool = False) -> bool:
    """``failed`` for good; ``uncount_attempt`` when the last call does not count (a 429)."""
    values: dict = {"status": "failed", "error": error, "deadline": None}
    if uncount_attempt:
        values["attempts"] = tasks.c.attempts - 1
    return _guarded_update(engine, task_id, admission_id, unhedged=True, **values)
