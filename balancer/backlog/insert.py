"""New tasks into the backlog (``pending``).

Idempotent by (source, key): a task whose (source, key) is already stored is
not inserted again (the partial unique index ``tasks_source_key``); tasks
without a key are always inserted.

Answers reused (opt-in, ``dedup``): a new task whose prompt, allowed models and
``max_tokens`` equal those of a solved task (one inserted with ``dedup`` too)
takes its answer at once, with no call (``reused_from``); one identical to a
task still pending or in flight waits (``not_before``, at most
:data:`HOLD_SECONDS`) and takes that task's answer when it is solved, or is
dispatched when it fails: the ``tasks_finished`` trigger does both, in the
transaction that ends the first task. Identical tasks inserted at the same
moment by two transactions do not see each other, and each makes its call.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection

from balancer.backlog.intake import TaskRow
from balancer.storage.schema import tasks

_INSERT = (
    pg_insert(tasks)
    .on_conflict_do_nothing(index_elements=[tasks.c.source, tasks.c.key], index_where=tasks.c.key.is_not(None))
    .returning(tasks.c.id)
)


#: The longest a new task waits on an identical task in flight before it is dispatched itself.
HOLD_SECONDS = 600

# "Identical": the same prompt (its md5 first, for the tasks_dedup index), max_tokens and allowed models.
_MARK_DEDUP = sa.text("UPDATE tasks SET dedup = true WHERE id = ANY(:ids)")
_REUSE = sa.text("""
UPDATE tasks t SET status = 'solved', answer = s.answer, model = s.model, prompt_tokens = 0, completion_tokens = 0,
                   solved_at = now(), updated_at = now(), reused_from = coalesce(s.reused_from, s.id)
FROM tasks s
WHERE t.id = ANY(:ids) AND s.id = (
    SELECT o.id FROM tasks o
    WHERE o.dedup AND o.status = 'solved' AND o.id <> t.id AND md5(o.prompt) = md5(t.prompt)
      AND o.max_tokens = t.max_tokens AND o.prompt = t.prompt AND o.allowed_models IS NOT DISTINCT FROM t.allowed_models
    ORDER BY o.id LIMIT 1)
RETURNING t.id
""")
_HOLD = sa.text("""
UPDATE tasks t SET not_before = now() + make_interval(secs => :hold)
WHERE t.id = ANY(:ids) AND t.status = 'pending' AND EXISTS (
    SELECT 1 FROM tasks o
    WHERE o.dedup AND o.id < t.id AND o.status IN ('pending', 'ready', 'queued', 'running') AND md5(o.prompt) = md5(t.prompt)
      AND o.max_tokens = t.max_tokens AND o.prompt = t.prompt AND o.allowed_models IS NOT DISTINCT FROM t.allowed_models)
RETURNING t.id
""")


def share_answers(conn: Connection, ids: Sequence[int]) -> tuple[int, int]:
    """Mark new tasks ``dedup``; those identical to a solved task take its answer,
    those identical to one still pending or in flight wait on it. Returns (reused, waiting)."""
    if not ids:
        return 0, 0
    conn.execute(_MARK_DEDUP, {"ids": list(ids)})
    reused = len(conn.execute(_REUSE, {"ids": list(ids)}).all())
    waiting = len(conn.execute(_HOLD, {"ids": list(ids), "hold": HOLD_SECONDS}).all())
    return reused, waiting


def insert_tasks(conn: Connection, rows: Sequence[TaskRow], *, dedup: bool = False) -> list[int]:
    """Insert pending tasks; returns the ids of those inserted (a keyed task
    already present is skipped, so ``len(rows) - len(ids)`` were already present).
    With ``dedup``, they may take identical tasks' answers (:func:`share_answers`)."""
    if not rows:
        return []
    result = conn.execute(
        _INSERT,
        [
            {
                "source": r.source,
                "prompt": r.prompt,
                "priority": r.priority,
                "allowed_models": list(r.allowed_models) if r.allowed_models else None,
                "max_tokens": r.max_tokens,
                "estimated_tokens": r.estimated_tokens,
                "key": r.key,
                "metadata": r.metadata if r.metadata is not None else sa.null(),
            }
            for r in rows
        ],
    )
    ids = [row.id for row in result]
    if dedup:
        share_answers(conn, ids)
    return ids
