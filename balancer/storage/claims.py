"""The dispatcher's claims on the backlog: the pinned lane, the window of
flexible work, and marking admitted tasks ``queued`` (all in the dispatcher's
transaction, ``FOR UPDATE SKIP LOCKED`` so two dispatchers never see the same task)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from balancer.storage.schema import tasks


@dataclass(frozen=True)
class PendingTask:
    id: int
    estimated_tokens: int
    allowed_models: tuple[str, ...] | None
    avoid_model: str | None = None  # its last call failed there: retry elsewhere if another model has room
    source: str = "submit"
    priority: int = 0


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
            SELECT t.id, t.estimated_tokens, t.allowed_models, t.source, t.priority
              FROM unnest(CAST(:models AS text[]), CAST(:limits AS int[])) AS o(model, k)
             CROSS JOIN LATERAL (
                   SELECT id, estimated_tokens, allowed_models, priority, source
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
    return [PendingTask(r.id, r.estimated_tokens, tuple(r.allowed_models), None, r.source, r.priority) for r in rows]


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
    sa.select(tasks.c.id, tasks.c.estimated_tokens, tasks.c.allowed_models, tasks.c.avoid_model,
              tasks.c.source, tasks.c.priority)
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
        PendingTask(r.id, r.estimated_tokens, tuple(r.allowed_models) if r.allowed_models else None, r.avoid_model,
                    r.source, r.priority)
        for r in rows
    ]


# Every source with pending work: a skip scan, one probe of tasks_pending_source per source.
_PENDING_SOURCES = sa.text(
    """
    WITH RECURSIVE sources AS (
        (SELECT source FROM tasks WHERE status = 'pending' ORDER BY source LIMIT 1)
        UNION ALL
        SELECT (SELECT t.source FROM tasks t
                 WHERE t.status = 'pending' AND t.source > s.source ORDER BY t.source LIMIT 1)
          FROM sources s WHERE s.source IS NOT NULL
    )
    SELECT source FROM sources WHERE source IS NOT NULL
    """
)

# Each source's head, priority then age, that an open model could take: one
# range scan of tasks_pending_source per source (LATERAL), locked like the
# window above. The source is matched as a range of one value, not with ``=``,
# on purpose: with ``=`` the planner may take tasks_pending_order and filter by
# source, which walks through every other source's rows to reach this one's
# (with statistics from before a live source appeared: 1.06 s to claim 200 of
# its tasks behind a 1,000,000-row backfill, against 0.26 ms this way). A range
# leaves ``ORDER BY source, ...`` to sort, which only this index does for free.
# The sources come in as an array literal, so the planner counts them exactly
# (a guess of 100 outer rows made it JIT-compile a 200,000-task ready stock).
_CLAIM_BY_SOURCE = sa.text(
    """
    SELECT h.id, h.estimated_tokens, h.allowed_models, h.avoid_model, h.source, h.priority
      FROM unnest(CAST(:sources AS text[])) AS s(source)
     CROSS JOIN LATERAL (
           SELECT id, estimated_tokens, allowed_models, avoid_model, source, priority
             FROM tasks
            WHERE status = 'pending' AND source >= s.source AND source <= s.source
              AND (not_before IS NULL OR not_before <= now())
              AND (allowed_models IS NULL OR allowed_models && CAST(:open_models AS text[]))
            ORDER BY source, priority DESC, id
            LIMIT :k
              FOR UPDATE SKIP LOCKED) AS h
    """
)


def claim_by_source(conn: Connection, limit: int, open_models: Iterable[str]) -> dict[str, list[PendingTask]]:
    """Lock, for every source with pending work, up to ``limit`` of its tasks,
    priority then age, that an open model could take: the queues the fair
    share (:mod:`balancer.domain.fairshare`) fills the window from.

    The cost grows with the number of sources that have pending work, not with
    the backlog: a 1,000,000-row backfill is one probe and one short range scan
    of ``tasks_pending_source``. Each queue is in its source's order (the
    LATERAL's ``ORDER BY``, kept by the nested loop that runs it).
    """
    if limit <= 0:
        return {}
    sources = list(conn.execute(_PENDING_SOURCES).scalars())
    if not sources:
        return {}
    rows = conn.execute(_CLAIM_BY_SOURCE, {"sources": sources, "open_models": list(open_models), "k": limit})
    queues: dict[str, list[PendingTask]] = {source: [] for source in sources}
    for r in rows:
        queues[r.source].append(PendingTask(
            r.id, r.estimated_tokens, tuple(r.allowed_models) if r.allowed_models else None, r.avoid_model,
            r.source, r.priority,
        ))
    return {source: queue for source, queue in queues.items() if queue}


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


def pending_at_least(conn: Connection, n: int) -> bool:
    """Whether at least ``n`` tasks are pending: reads at most ``n`` index entries,
    so it costs the same for a backlog of a thousand or of a million."""
    if n <= 0:
        return True
    first_n = sa.select(tasks.c.id).where(tasks.c.status == "pending").limit(n).subquery()
    return conn.execute(sa.select(sa.func.count()).select_from(first_n)).scalar_one() >= n


def fail_pending(conn: Connection, failures: Sequence[tuple[int, str]]) -> None:
    """Mark tasks that can never be admitted as failed, with the reason."""
    for task_id, reason in failures:
        conn.execute(
            sa.update(tasks)
            .where(tasks.c.id == task_id, tasks.c.status == "pending")
            .values(status="failed", error=reason, updated_at=sa.func.now())
        )
