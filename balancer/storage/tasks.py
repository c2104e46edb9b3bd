"""The task backlog in PostgreSQL: every status change the pipeline makes.

Status flow::

    pending --dispatch--> queued --worker starts--> running --> solved
       ^                    |                          |   \\--> failed (max attempts / impossible)
       +----- 429, 5xx, timeout (with backoff), lease expired, stale -----+

Every update that follows a message is guarded by the task's current
``admission_id``, so a late or duplicate message can never overwrite what a
newer dispatch did, and a solved task is never written twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from balancer.admission import LeaseSeed
from balancer.domain.intake import TaskRow
from balancer.storage.schema import TASK_STATUSES, quotas, tasks


@dataclass(frozen=True)
class PendingTask:
    id: int
    estimated_tokens: int
    allowed_models: tuple[str, ...] | None
    avoid_model: str | None = None  # its last call failed there: retry elsewhere if another model has room


@dataclass(frozen=True)
class SolveContext:
    id: int
    status: str
    prompt: str
    max_tokens: int
    admission_id: str | None
    attempts: int
    rate_limited: int
    #: The call's model ends a request whose client went (``Quota.on_disconnect == "stop"``):
    #: only then is cutting the call off worth anything (see :mod:`balancer.pipeline.solver`).
    stops_on_disconnect: bool = False


def insert_tasks(conn: Connection, rows: Sequence[TaskRow]) -> list[int]:
    """Insert pending tasks; returns their ids."""
    if not rows:
        return []
    result = conn.execute(
        sa.insert(tasks).returning(tasks.c.id),
        [
            {
                "source": r.source,
                "prompt": r.prompt,
                "priority": r.priority,
                "allowed_models": list(r.allowed_models) if r.allowed_models else None,
                "max_tokens": r.max_tokens,
                "estimated_tokens": r.estimated_tokens,
            }
            for r in rows
        ],
    )
    return [row.id for row in result]


def claim_pinned(conn: Connection, free_slots: Mapping[str, int]) -> list[PendingTask]:
    """Lock, for each model, up to ``free_slots[model]`` pending tasks pinned to it alone.

    This is the dispatcher's *pinned lane*. Such a task has nowhere else to go,
    so it gets first claim on its model's free slots, ahead of tasks that any
    model could take; otherwise a slow model spends its few slots on flexible
    work and its own tasks form the tail of the run. One index range scan per
    model (``tasks_pending_pinned``), so the cost does not grow with the backlog.

    >>> claim_pinned(conn, {"model-7": 2})   # doctest: +SKIP
    [PendingTask(id=41, estimated_tokens=900, allowed_models=('model-7',)), ...]
    """
    wanted = {name: n for name, n in free_slots.items() if n > 0}
    if not wanted:
        return []
    rows = conn.execute(
        sa.text(
            """
            SELECT t.id, t.estimated_tokens, t.allowed_models
              FROM unnest(CAST(:models AS text[]), CAST(:limits AS int[])) AS o(model, k)
             CROSS JOIN LATERAL (
                   SELECT id, estimated_tokens, allowed_models, priority
                     FROM tasks
                    WHERE status = 'pending' AND allowed_models IS NOT NULL
                      AND allowed_models = ARRAY[o.model]
                      AND (not_before IS NULL OR not_before <= now())
                    ORDER BY allowed_models, priority DESC, id
                    LIMIT o.k
                      FOR UPDATE SKIP LOCKED) AS t
             ORDER BY t.priority DESC, t.id
            """
        ),
        {"models": list(wanted), "limits": list(wanted.values())},
    ).all()
    return [PendingTask(r.id, r.estimated_tokens, tuple(r.allowed_models)) for r in rows]


def pending_backlog(conn: Connection) -> tuple[int, float]:
    """(number of pending tasks, their mean token estimate): what the end-game switch weighs."""
    row = conn.execute(
        sa.select(sa.func.count(), sa.func.coalesce(sa.func.avg(tasks.c.estimated_tokens), 0))
        .where(tasks.c.status == "pending")
    ).one()
    return int(row[0]), float(row[1])


def models_with_pinned_backlog(conn: Connection, models: Iterable[str], exclude: Iterable[int] = ()) -> set[str]:
    """Which of ``models`` still have pending tasks pinned to them alone.

    Tasks in ``exclude`` (what this dispatcher just claimed) do not count;
    tasks another dispatcher holds do. The dispatcher keeps flexible work off
    these models. One index probe per model.
    """
    names = list(models)
    if not names:
        return set()
    rows = conn.execute(
        sa.text(
            """
            SELECT o.model
              FROM unnest(CAST(:models AS text[])) AS o(model)
             WHERE EXISTS (
                   SELECT 1 FROM tasks
                    WHERE status = 'pending' AND allowed_models IS NOT NULL
                      AND allowed_models = ARRAY[o.model]
                      AND (not_before IS NULL OR not_before <= now())
                      AND NOT (id = ANY(CAST(:exclude AS bigint[]))))
            """
        ),
        {"models": names, "exclude": list(exclude)},
    ).all()
    return {r.model for r in rows}


# Built once, like the solve path's statements below: the dispatcher runs it every round.
_CLAIM_WINDOW = (
    sa.select(tasks.c.id, tasks.c.estimated_tokens, tasks.c.allowed_models, tasks.c.avoid_model)
    .where(tasks.c.status == "pending")
    .where(sa.or_(tasks.c.not_before.is_(None), tasks.c.not_before <= sa.func.now()))
    .where(sa.or_(tasks.c.allowed_models.is_(None),
                  tasks.c.allowed_models.overlap(sa.bindparam("b_open_models", type_=tasks.c.allowed_models.type))))
    .order_by(tasks.c.priority.desc(), tasks.c.id)
    .limit(sa.bindparam("b_limit"))
    .with_for_update(skip_locked=True)
)


def claim_window(conn: Connection, limit: int, open_models: Iterable[str]) -> list[PendingTask]:
    """Lock up to ``limit`` pending tasks, priority then age, that an open model could take.

    ``FOR UPDATE SKIP LOCKED`` lets two dispatchers work side by side without
    seeing the same task. Tasks pinned only to saturated models are skipped
    here, so they cannot fill the window and block tasks that could go
    elsewhere (no head-of-line blocking).
    """
    rows = conn.execute(_CLAIM_WINDOW, {"b_open_models": list(open_models), "b_limit": limit}).all()
    return [
        PendingTask(r.id, r.estimated_tokens, tuple(r.allowed_models) if r.allowed_models else None, r.avoid_model)
        for r in rows
    ]


def mark_queued(conn: Connection, assignments: Sequence[tuple[int, str, str]], lease_seconds: int) -> None:
    """(task id, model, admission id) for each admitted task."""
    if not assignments:
        return
    ids, models, admissions = zip(*assignments, strict=True)
    conn.execute(
        sa.text(
            """
            UPDATE tasks AS t
               SET status = 'queued', model = v.model, admission_id = v.admission_id,
                   queued_at = now(), updated_at = now(), error = NULL,
                   deadline = now() + make_interval(secs => :lease)
              FROM unnest(CAST(:ids AS bigint[]), CAST(:models AS text[]), CAST(:admissions AS text[]))
                   AS v(id, model, admission_id)
             WHERE t.id = v.id AND t.status = 'pending'
            """
        ),
        {"ids": list(ids), "models": list(models), "admissions": list(admissions), "lease": lease_seconds},
    )


#: Admission ids the dispatcher names for ready-list entries (admit.lua's are ``epoch-seq``).
READY_ID_PREFIX = "r"


def ready_admission_id() -> str:
    """A new admission id for a ready-list entry (see :func:`in_flight_leases`)."""
    return READY_ID_PREFIX + uuid.uuid4().hex[:20]


def pending_at_least(conn: Connection, n: int) -> bool:
    """Whether at least ``n`` tasks are pending: reads at most ``n`` index entries,
    so it costs the same for a backlog of a thousand or of a million."""
    if n <= 0:
        return True
    first_n = sa.select(tasks.c.id).where(tasks.c.status == "pending").limit(n).subquery()
    return conn.execute(sa.select(sa.func.count()).select_from(first_n)).scalar_one() >= n


def unstock(conn: Connection, entries: Sequence[tuple[int, str]]) -> int:
    """(task id, admission id) of ready-list entries dropped before any call:
    back to pending, each only if still queued under that admission."""
    if not entries:
        return 0
    ids, admissions = zip(*entries, strict=True)
    result = conn.execute(
        sa.text(
            """
            UPDATE tasks AS t
               SET status = 'pending', model = NULL, admission_id = NULL, deadline = NULL, updated_at = now()
              FROM unnest(CAST(:ids AS bigint[]), CAST(:admissions AS text[])) AS v(id, admission_id)
             WHERE t.id = v.id AND t.admission_id = v.admission_id AND t.status = 'queued'
            """
        ),
        {"ids": list(ids), "admissions": list(admissions)},
    )
    return result.rowcount


def fail_pending(conn: Connection, failures: Sequence[tuple[int, str]]) -> None:
    """Mark tasks that can never be admitted as failed, with the reason."""
    for task_id, reason in failures:
        conn.execute(
            sa.update(tasks)
            .where(tasks.c.id == task_id, tasks.c.status == "pending")
            .values(status="failed", error=reason, updated_at=sa.func.now())
        )


def _guard(task_id: Any, admission_id: Any):  # noqa: ANN202
    return sa.and_(tasks.c.id == task_id, tasks.c.admission_id == admission_id, tasks.c.status.in_(("queued", "running")))


def _context_columns(model: Any) -> tuple[Any, ...]:
    """What a call on ``model`` (a column naming it) needs, in :class:`SolveContext` order;
    the model's ``on_disconnect`` comes in the same statement, from its quota row."""
    stops = (
        sa.select(quotas.c.on_disconnect == "stop").where(quotas.c.name == model).scalar_subquery()
    )
    return (tasks.c.id, tasks.c.status, tasks.c.prompt, tasks.c.max_tokens, tasks.c.admission_id,
            tasks.c.attempts, tasks.c.rate_limited, sa.func.coalesce(stops, sa.false()))


def _hedge_guard(task_id: Any, hedge_admission_id: Any):  # noqa: ANN202
    return sa.and_(tasks.c.id == task_id, tasks.c.hedge_admission_id == hedge_admission_id, tasks.c.status == "running")


@contextmanager
def _one_statement(engine: Engine) -> Iterator[Connection]:
    """A connection for a write that is one statement, atomic on its own.

    In autocommit, psycopg2 sends the statement alone: one round trip, where a
    transaction costs three (its own BEGIN, the statement, COMMIT). The solve
    path's writes are all single guarded ``UPDATE ... RETURNING`` statements.
    The flag is set on the pooled psycopg2 connection and put back by hand:
    ``execution_options(isolation_level="AUTOCOMMIT")`` would do the same, but
    SQLAlchemy then resets the level at check-in with a ``SET``, one round trip
    more (seen with strace).
    """
    with engine.connect() as conn:
        dbapi: Any = conn.connection.driver_connection  # psycopg2's own connection
        dbapi.autocommit = True
        try:
            yield conn
        finally:
            if not dbapi.closed:
                dbapi.autocommit = False


# The solve path's two statements per task, built once with bound parameters.
# SQLAlchemy caches a statement's compiled SQL, but building the statement
# object again on every call cost about four times what executing it does
# (0.70 ms of CPU per start_solve against 0.16 ms; docs/benchmarks.md).
_TASK_ID: Any = sa.bindparam("b_task_id")
_ADMISSION_ID: Any = sa.bindparam("b_admission_id")


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
    .where(tasks.c.id == _TASK_ID, tasks.c.admission_id == _ADMISSION_ID,
           sa.or_(tasks.c.status == "queued", sa.and_(tasks.c.status == "running", tasks.c.deadline < sa.func.now())))
    .values(status="running", started_at=sa.func.now(), updated_at=sa.func.now(), attempts=tasks.c.attempts + 1,
            deadline=sa.func.now() + sa.bindparam("b_lease", type_=sa.Interval()))
    .returning(*_context_columns(tasks.c.model), _NO_FLUSH)
)


def _solved(answer: Any, prompt_tokens: Any, completion_tokens: Any) -> dict[str, Any]:
    """The values a solved task holds (bound parameters or another table's columns)."""
    return dict(status="solved", answer=answer, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                solved_at=sa.func.now(), updated_at=sa.func.now(), error=None, deadline=None)


# A hedge's answer: ``b_admission_id`` is the hedge's, and the task records the hedge's model.
_MARK_HEDGE_SOLVED = (
    sa.update(tasks).where(_hedge_guard(_TASK_ID, _ADMISSION_ID))
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
    with _one_statement(engine) as conn:
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
    """Push the deadline of the running tasks under ``admission_ids`` one lease from now
    (a worker's heartbeat); returns how many were extended."""
    if not admission_ids:
        return 0
    with engine.begin() as conn:
        result = conn.execute(
            sa.update(tasks)
            .where(tasks.c.admission_id.in_(list(admission_ids)), tasks.c.status == "running")
            .values(deadline=sa.func.now() + timedelta(seconds=lease_seconds))
        )
    return result.rowcount


def start_hedge(engine: Engine, task_id: int, hedge_admission_id: str) -> SolveContext | None:
    """What a hedge's call needs; None if the task is no longer running with this hedge.

    It changes nothing: the task stays ``running`` under its first call, and
    a hedge does not count as an attempt.
    """
    with engine.connect() as conn:
        row = conn.execute(sa.select(*_context_columns(tasks.c.hedge_model)).where(_hedge_guard(task_id, hedge_admission_id))).first()
    return SolveContext(*row) if row else None


def _update_where(engine: Engine, guard: Any, /, **values: object) -> bool:
    """Apply ``values`` (column names) to the one task ``guard`` matches; False if none does."""
    with _one_statement(engine) as conn:
        return conn.execute(
            sa.update(tasks).where(guard).values(updated_at=sa.func.now(), **values).returning(tasks.c.id)
        ).first() is not None


def _guarded_update(engine: Engine, task_id: int, admission: str, /, *, unhedged: bool = False, **values: object) -> bool:
    """Apply ``values`` only if the task is still queued/running under this admission
    (and, with ``unhedged``, has no hedge in flight: then the hedge's answer decides)."""
    guard = _guard(task_id, admission)
    if unhedged:
        guard = sa.and_(guard, tasks.c.hedge_admission_id.is_(None))
    return _update_where(engine, guard, **values)


@dataclass(frozen=True)
class Written:
    """An answer stored. ``other_call``: the admission id of the task's other call
    when it was hedged, the loser of the race, to be cancelled; else None."""

    other_call: str | None = None


@dataclass(frozen=True)
class Answer:
    """One call's answer, to be written under its admission (:func:`mark_solved_many`)."""

    task_id: int
    admission_id: str
    answer: str
    prompt_tokens: int
    completion_tokens: int


def mark_solved(engine: Engine, answer: Answer, *, hedge_model: str | None = None) -> Written | None:
    """Write the answer once. None if someone else already finished it (a duplicate).

    With ``hedge_model``, ``answer.admission_id`` is the hedge's: the first
    answer of the two calls wins, and the task records the model that gave it.
    """
    if hedge_model is None:
        return mark_solved_many(engine, [answer])[0]
    params = {"b_task_id": answer.task_id, "b_admission_id": answer.admission_id, "b_answer": answer.answer,
              "b_prompt_tokens": answer.prompt_tokens, "b_completion_tokens": answer.completion_tokens,
              "b_model": hedge_model}
    with _one_statement(engine) as conn:
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
    return (
        sa.update(tasks).where(_guard(rows.c.id, rows.c.admission_id))
        .values(**_solved(rows.c.answer, rows.c.prompt_tokens, rows.c.completion_tokens))
        .returning(tasks.c.id, tasks.c.hedge_admission_id)
    )


_MARK_SOLVED_MANY = _mark_solved_many_statement()


def mark_solved_many(engine: Engine, answers: Sequence[Answer]) -> list[Written | None]:
    """:func:`mark_solved` for several answers in one statement (one commit, one
    WAL flush), each under its own guard. In ``answers``' order: what was
    written, or None for a duplicate. One answer per task: a task twice in one
    statement would be updated from either row, unpredictably.

    >>> # mark_solved_many(engine, [Answer(7, "a7", "42", 10, 2), Answer(8, "a8", "43", 10, 3)])
    """
    params = {"b_id": [a.task_id for a in answers], "b_admission_id": [a.admission_id for a in answers],
              "b_answer": [a.answer for a in answers], "b_prompt_tokens": [a.prompt_tokens for a in answers],
              "b_completion_tokens": [a.completion_tokens for a in answers]}
    with _one_statement(engine) as conn:
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


def return_expired(engine: Engine) -> int:
    """Queued/running tasks past their deadline go back to pending (lost message, dead worker)."""
    with engine.begin() as conn:
        result = conn.execute(
            sa.update(tasks)
            .where(tasks.c.status.in_(("queued", "running")), tasks.c.deadline < sa.func.now())
            .values(
                status="pending",
                model=None,
                admission_id=None,
                hedge_admission_id=None,
                hedge_model=None,
                deadline=None,
                updated_at=sa.func.now(),
                error="returned to pending: deadline passed while " + tasks.c.status,
            )
        )
    return result.rowcount


def in_flight_leases(engine: Engine, lease_ms: int) -> list[LeaseSeed]:
    """Calls PostgreSQL believes are in flight, to re-seed a restored Redis.

    Not a ready-list entry still ``queued``: no call runs under it and its list
    is gone with the data, so it would only hold a slot; the sweep returns it
    to pending at its deadline."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                tasks.c.admission_id,
                tasks.c.model,
                tasks.c.estimated_tokens,
                (sa.extract("epoch", sa.func.coalesce(tasks.c.deadline, sa.func.now()) - sa.func.now()) * 1000).label("remaining_ms"),
            ).where(tasks.c.status.in_(("queued", "running")), tasks.c.admission_id.is_not(None),
                    sa.not_(sa.and_(tasks.c.status == "queued", tasks.c.admission_id.startswith(READY_ID_PREFIX))))
        ).all()
        hedges = conn.execute(
            sa.select(
                tasks.c.hedge_admission_id, tasks.c.hedge_model, tasks.c.estimated_tokens,
                (sa.extract("epoch", sa.func.coalesce(tasks.c.deadline, sa.func.now()) - sa.func.now()) * 1000).label("remaining_ms"),
            ).where(tasks.c.status == "running", tasks.c.hedge_admission_id.is_not(None))
        ).all()
    # Time left, not an instant: PostgreSQL's clock and Redis's may disagree, and
    # the restored lease is placed on Redis's (restore.lua adds its own now).
    return [LeaseSeed(r[0], r[1], r.estimated_tokens, max(0, int(r.remaining_ms))) for r in [*rows, *hedges]]


def pending_groups(engine: Engine) -> list[tuple[list[str] | None, int, int]]:
    """The backlog's composition: (allowed models or None, pending tasks, their estimated tokens)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.allowed_models, sa.func.count(), sa.func.coalesce(sa.func.sum(tasks.c.estimated_tokens), 0))
            .where(tasks.c.status == "pending").group_by(tasks.c.allowed_models)
        ).all()
    return [(r[0], int(r[1]), int(r[2])) for r in rows]


def recent_solves(engine: Engine, window_s: float) -> tuple[list[tuple[list[str] | None, int]], float]:
    """The work solved in the last ``window_s`` seconds, grouped by allowed models,
    and the seconds it covers: the window, or less when the oldest of those
    tasks was created more recently (a run that started inside the window)."""
    since = sa.func.now() - timedelta(seconds=window_s)
    age = sa.extract("epoch", sa.func.now() - sa.func.min(tasks.c.created_at))
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.allowed_models, sa.func.count(), age)
            .where(tasks.c.status == "solved", tasks.c.updated_at >= since).group_by(tasks.c.allowed_models)
        ).all()
    covered = min([window_s, *(float(r[2]) for r in rows)])
    return [(r[0], int(r[1])) for r in rows], covered


def status_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(tasks.c.status, sa.func.count()).group_by(tasks.c.status)).all()
    counts = dict.fromkeys(TASK_STATUSES, 0)
    counts.update({status: n for status, n in rows})
    return counts


def _pinned_to(model: str, others: Sequence[str]) -> sa.ColumnElement[bool]:
    """Pending tasks that may run on ``model`` and on none of ``others``."""
    allowed = tasks.c.allowed_models
    condition = sa.and_(tasks.c.status == "pending", allowed.is_not(None), allowed.any_() == model)
    if others:
        condition = sa.and_(condition, sa.not_(allowed.overlap(sa.cast(list(others), allowed.type))))
    return condition


def _other_models(conn: Connection, model: str) -> list[str]:
    return [r[0] for r in conn.execute(sa.select(quotas.c.name).where(quotas.c.name != model))]


def model_occupancy(conn: Connection, model: str) -> tuple[int, int]:
    """(calls in flight on ``model``, pending tasks that only it may take): what
    removing it would strand. Runs in the caller's transaction."""
    others = _other_models(conn, model)
    in_flight = conn.execute(
        sa.select(sa.func.count()).where(
            tasks.c.status.in_(("queued", "running")), sa.or_(tasks.c.model == model, tasks.c.hedge_model == model)
        )
    ).scalar_one()
    pinned = conn.execute(sa.select(sa.func.count()).where(_pinned_to(model, others))).scalar_one()
    return int(in_flight), int(pinned)


def fail_pinned(conn: Connection, model: str, reason: str) -> int:
    """Fail the pending tasks that only ``model`` may take (it is being removed)."""
    others = _other_models(conn, model)
    result = conn.execute(
        sa.update(tasks).where(_pinned_to(model, others)).values(status="failed", error=reason, updated_at=sa.func.now())
    )
    return int(result.rowcount)


def overdue_count(engine: Engine) -> int:
    """Queued or running tasks past their deadline: no heartbeat renewed them (their
    worker is gone) and the sweep tick has not returned them to pending yet."""
    with engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).where(tasks.c.status.in_(("queued", "running")), tasks.c.deadline < sa.func.now())
        ).scalar_one())


@dataclass(frozen=True)
class Straggler:
    """A running call that a hedge might overtake."""

    id: int
    model: str
    admission_id: str
    estimated_tokens: int
    allowed_models: tuple[str, ...] | None
    elapsed_ms: float


def stragglers(conn: Connection, max_hedges: int, limit: int = 50) -> list[Straggler]:
    """Running tasks with no hedge in flight and fewer than ``max_hedges`` so far, longest-running first."""
    rows = conn.execute(
        sa.select(
            tasks.c.id, tasks.c.model, tasks.c.admission_id, tasks.c.estimated_tokens, tasks.c.allowed_models,
            (sa.extract("epoch", sa.func.now() - tasks.c.started_at) * 1000).label("elapsed_ms"),
        )
        .where(tasks.c.status == "running", tasks.c.hedge_admission_id.is_(None), tasks.c.hedges < max_hedges,
               tasks.c.started_at.is_not(None))
        .order_by(tasks.c.started_at)
        .limit(limit)
    ).all()
    return [
        Straggler(r.id, r.model, r.admission_id, r.estimated_tokens,
                  tuple(r.allowed_models) if r.allowed_models else None, float(r.elapsed_ms))
        for r in rows
    ]


def hedge_spending(conn: Connection) -> tuple[int, int]:
    """(tokens hedges were admitted with, tokens of the run) over the current run:
    the tasks created since the oldest one still unfinished."""
    oldest = (
        sa.select(sa.func.min(tasks.c.created_at))
        .where(tasks.c.status.in_(("pending", "queued", "running")))
        .scalar_subquery()
    )
    row = conn.execute(
        sa.select(sa.func.coalesce(sa.func.sum(tasks.c.hedge_tokens), 0),
                  sa.func.coalesce(sa.func.sum(tasks.c.estimated_tokens), 0))
        .where(tasks.c.created_at >= oldest)
    ).one()
    return int(row[0]), int(row[1])


def mark_hedged(conn: Connection, task_id: int, admission_id: str, hedge_admission_id: str, model: str, tokens: int) -> bool:
    """Record a hedge, if the task still runs under ``admission_id`` with none in flight."""
    result = conn.execute(
        sa.update(tasks)
        .where(tasks.c.id == task_id, tasks.c.status == "running", tasks.c.admission_id == admission_id,
               tasks.c.hedge_admission_id.is_(None))
        .values(hedge_admission_id=hedge_admission_id, hedge_model=model, hedges=tasks.c.hedges + 1,
                hedge_tokens=tasks.c.hedge_tokens + tokens, updated_at=sa.func.now())
    )
    return result.rowcount == 1


def clear_hedge(engine: Engine, task_id: int, hedge_admission_id: str) -> bool:
    """A hedge that got no answer: the task is again decided by its first call alone."""
    return _update_where(engine, sa.and_(tasks.c.id == task_id, tasks.c.hedge_admission_id == hedge_admission_id),
                         hedge_admission_id=None, hedge_model=None)


def stranded_pending(engine: Engine, models: Sequence[str]) -> int:
    """Pending tasks that none of ``models`` may take (they were pinned to models since removed)."""
    with engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.count())
            .where(tasks.c.status == "pending", tasks.c.allowed_models.is_not(None),
                   sa.not_(tasks.c.allowed_models.overlap(sa.cast(list(models), tasks.c.allowed_models.type))))
        ).scalar_one()
