"""The dispatcher's claims on the backlog: the pinned lane, the window, which
models still have pinned work, and marking admitted tasks ``queued`` (all in
the dispatcher's transaction). None of them reads a task that no
model it asks about may take.

One scan of the pending tasks in priority-then-age order would read, and
skip, every task no open model may take before it reached one that it may:
100,000 tasks pinned to a disabled model made each round read 100,000 rows.
A lateral probe per model did no better: PostgreSQL plans it once for any
model, and with nearly every pinned task on one model it judged that any
model's probe would match at once, so it scanned the priority index instead
of the pinned one. So each probe here is one branch of one statement with
the model (or the set of models) as a value the planner sees:

- the distinct sets of allowed models of the pending tasks come from a skip
  scan of ``tasks_pending_pinned`` (one index probe per set);
- the window merges the tasks any model may take (``tasks_pending_flexible``,
  in window order) with, for each set that overlaps the open models, that
  set's first tasks (``tasks_pending_pinned``);
- the pinned lane and the pinned-backlog check probe ``tasks_pending_pinned``
  once per model.

A set that no open model is in costs nothing but its probe in the skip scan.
The pinned lane and the pinned-backlog check take the sources over their
budget (``held``, :mod:`balancer.dispatch.budgets`) and leave their tasks out;
the window leaves them out by claiming the other sources' heads
(:func:`claim_by_source`, :mod:`balancer.dispatch.fairness`).

Each branch locks at most its limit (``FOR UPDATE SKIP LOCKED``, so two
dispatchers still work side by side); rows a branch locked but the merged
window did not keep stay locked only until the round's commit.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


_COLUMNS = "id, estimated_tokens, allowed_models, avoid_model, source, priority"
_READY = "status = 'pending' AND (not_before IS NULL OR not_before <= now())"

_SETS = sa.text(
    """
    WITH RECURSIVE sets(allowed) AS (
        (SELECT allowed_models FROM tasks
          WHERE status = 'pending' AND allowed_models IS NOT NULL
          ORDER BY allowed_models LIMIT 1)
        UNION ALL
        SELECT (SELECT allowed_models FROM tasks
                 WHERE status = 'pending' AND allowed_models IS NOT NULL AND allowed_models > s.allowed
                 ORDER BY allowed_models LIMIT 1)
          FROM sets AS s WHERE s.allowed IS NOT NULL
    )
    SELECT allowed FROM sets WHERE allowed IS NOT NULL
    """
)


def pending_model_sets(conn: Connection) -> list[tuple[str, ...]]:
    """The distinct allowed-model lists of the pending tasks that have one."""
    return [tuple(r.allowed) for r in conn.execute(_SETS)]


#: Leaves out the tasks of the sources in ``:held`` (over their budget: balancer.dispatch.budgets).
_NOT_HELD = " AND NOT (source = ANY(CAST(:held AS text[])))"


def _branch(i: int, *, flexible: bool = False, held: bool = False) -> str:
    """One locked probe: the flexible lane (``flexible``) or the tasks whose allowed
    models are ``:set<i>``; without the tasks of ``:held`` sources if ``held``."""
    where = "allowed_models IS NULL" if flexible else f"allowed_models IS NOT NULL AND allowed_models = CAST(:set{i} AS text[])"
    where += _NOT_HELD if held else ""
    order = "priority DESC, id" if flexible else "allowed_models, priority DESC, id"
    # Built from fixed fragments and the branch number only; every value is a bound parameter.
    return (f"SELECT * FROM (SELECT {_COLUMNS} FROM tasks WHERE {_READY} AND {where} "  # noqa: S608
            f"ORDER BY {order} LIMIT :limit{i} FOR UPDATE SKIP LOCKED) AS b{i}")


def _rows(conn: Connection, branches: list[str], params: dict[str, Any], limit: int | None = None) -> list[PendingTask]:
    if not branches:
        return []
    sql = " UNION ALL ".join(branches) + " ORDER BY priority DESC, id" + (" LIMIT :limit" if limit is not None else "")
    rows = conn.execute(sa.text(sql), {**params, "limit": limit}).all()
    return [
        PendingTask(r.id, r.estimated_tokens, tuple(r.allowed_models) if r.allowed_models else None, r.avoid_model,
                    r.source, r.priority)
        for r in rows
    ]


def claim_window(conn: Connection, limit: int, open_models: Iterable[str]) -> list[PendingTask]:
    """Lock up to ``limit`` pending tasks, priority then age, that an open model
    could take (see the module docstring). Tasks pinned only to saturated or
    disabled models are never read, so they neither fill the window nor slow it."""
    open_set = set(open_models)
    if limit <= 0 or not open_set:
        return []
    sets = [s for s in pending_model_sets(conn) if open_set.intersection(s)]
    branches = [_branch(0, flexible=True)]
    params: dict[str, Any] = {"limit0": limit}
    for i, allowed in enumerate(sets, start=1):
        branches.append(_branch(i))
        params[f"set{i}"], params[f"limit{i}"] = list(allowed), limit
    return _rows(conn, branches, params, limit)


def claim_pinned(conn: Connection, free_slots: Mapping[str, int], held: Collection[str] = ()) -> list[PendingTask]:
    """Lock, for each model, up to ``free_slots[model]`` pending tasks pinned to
    it alone (the dispatcher's pinned lane), priority then age, none of a
    ``held`` source: one probe of ``tasks_pending_pinned`` per model."""
    wanted = {name: n for name, n in free_slots.items() if n > 0}
    branches: list[str] = []
    params: dict[str, Any] = {"held": list(held)}
    for i, (name, n) in enumerate(wanted.items(), start=1):
        branches.append(_branch(i, held=bool(held)))
        params[f"set{i}"], params[f"limit{i}"] = [name], n
    return _rows(conn, branches, params)


def models_with_pinned_backlog(conn: Connection, models: Iterable[str], exclude: Iterable[int] = (),
                               held: Collection[str] = ()) -> set[str]:
    """Which of ``models`` still have pending tasks pinned to them alone, not
    counting the tasks in ``exclude`` (what this dispatcher just claimed) nor
    those of ``held`` sources (they wait, so they reserve nothing); tasks
    another dispatcher holds do count. One probe per model."""
    names = list(models)
    if not names:
        return set()
    skip = list(exclude)
    not_held = _NOT_HELD if held else ""
    branches = [  # fixed fragments and branch numbers; the names are bound parameters
        f"SELECT CAST(:m{i} AS text) AS model WHERE EXISTS (SELECT 1 FROM tasks WHERE {_READY} "  # noqa: S608
        f"AND allowed_models IS NOT NULL AND allowed_models = ARRAY[CAST(:m{i} AS text)] "
        f"AND NOT (id = ANY(CAST(:exclude AS bigint[]))){not_held})"
        for i in range(len(names))
    ]
    params: dict[str, Any] = {f"m{i}": name for i, name in enumerate(names)}
    return {r.model for r in conn.execute(sa.text(" UNION ALL ".join(branches)),
                                          {**params, "exclude": skip, "held": list(held)})}


def pending_backlog(conn: Connection) -> tuple[int, float]:
    """(number of pending tasks, their mean token estimate): what the end-game switch weighs."""
    row = conn.execute(
        sa.select(sa.func.count(), sa.func.coalesce(sa.func.avg(tasks.c.estimated_tokens), 0))
        .where(tasks.c.status == "pending")
    ).one()
    return int(row[0]), float(row[1])


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
      FROM unnest(CAST(:sources AS text[]), CAST(:ks AS int[])) AS s(source, k)
     CROSS JOIN LATERAL (
           SELECT id, estimated_tokens, allowed_models, avoid_model, source, priority
             FROM tasks
            WHERE status = 'pending' AND source >= s.source AND source <= s.source
              AND (not_before IS NULL OR not_before <= now())
              AND (allowed_models IS NULL OR allowed_models && CAST(:open_models AS text[]))
            ORDER BY source, priority DESC, id
            LIMIT s.k
              FOR UPDATE SKIP LOCKED) AS h
    """
)


def pending_sources(conn: Connection) -> list[str]:
    """Every source with pending work: a skip scan, one probe of ``tasks_pending_source`` per source."""
    return list(conn.execute(_PENDING_SOURCES).scalars())


def claim_by_source(conn: Connection, sources: list[str], limit: int | Mapping[str, int],
                    open_models: Iterable[str]) -> dict[str, list[PendingTask]]:
    """Lock, for each of ``sources``, up to ``limit`` (or ``limit[source]``) of its pending tasks,
    priority then age, that an open model could take: the queues the fair
    share (:mod:`balancer.sources.fairshare`) fills the window from.

    The cost grows with the number of sources that have pending work, not with
    the backlog: a 1,000,000-row backfill is one short range scan of
    ``tasks_pending_source``. Each queue is in its source's order (the
    LATERAL's ``ORDER BY``, kept by the nested loop that runs it). Unlike
    :func:`claim_window`, a source's scan reads past the tasks at its head that
    no open model may take: the dispatcher uses this only while several
    sources have pending work.
    """
    sizes = [limit.get(source, 0) if isinstance(limit, Mapping) else limit for source in sources]
    if not sources or max(sizes) <= 0:
        return {}
    rows = conn.execute(_CLAIM_BY_SOURCE, {"sources": sources, "open_models": list(open_models), "ks": sizes})
    queues: dict[str, list[PendingTask]] = {source: [] for source in sources}
    for r in rows:
        queues[r.source].append(PendingTask(
            r.id, r.estimated_tokens, tuple(r.allowed_models) if r.allowed_models else None, r.avoid_model,
            r.source, r.priority,
        ))
    return {source: queue for source, queue in queues.items() if queue}


def mark_queued(conn: Connection, assignments: Sequence[tuple[int, str, str]], lease_seconds: int,
                status: str = "queued") -> None:
    """(task id, model, admission id) for each admitted task: pending to ``status``
    (``queued``, its solve message about to be published, or ``ready``, see
    :func:`balancer.backlog.ready.mark_ready`)."""
    if not assignments:
        return
    ids, models, admissions = zip(*assignments, strict=True)
    conn.execute(
        sa.text(
            """
            UPDATE tasks AS t
               SET status = :status, model = v.model, admission_id = v.admission_id,
                   queued_at = now(), updated_at = now(), error = NULL,
                   deadline = now() + make_interval(secs => :lease)
              FROM unnest(CAST(:ids AS bigint[]), CAST(:models AS text[]), CAST(:admissions AS text[]))
                   AS v(id, model, admission_id)
             WHERE t.id = v.id AND t.status = 'pending'
            """
        ),
        {"ids": list(ids), "models": list(models), "admissions": list(admissions), "lease": lease_seconds,
         "status": status},
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
