"""Read-only queries over the backlog for ``status``, the metrics exporter and the drain ETA.

Each is SQL text declared once, run on an engine, a connection or ``status``'s snapshot
(:mod:`balancer.storage.rows`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from balancer.backlog.statuses import IN_FLIGHT, TASK_STATUSES, UNFINISHED, sql_list
from balancer.storage.rows import RowSource, count, fetch

_BACKLOG = f"""
SELECT status, allowed_models, count(*), coalesce(sum(estimated_tokens), 0), coalesce(sum(max_tokens), 0) FROM tasks
WHERE status IN {sql_list(UNFINISHED)} GROUP BY status, allowed_models
"""  # noqa: S608 - the statuses are statuses.py's constants, not input


@dataclass(frozen=True)
class Backlog:
    """The tasks not finished yet (pending, ready, queued, running) by status and allowed models
    (None: any model): per group, how many, their estimated tokens (prompt + ``max_tokens``) and
    their ``max_tokens``. One read serves the drain ETA (the pending tasks' composition, how many
    are not finished) and the backlog's projected cost (:func:`balancer.backlog.spend.projected_cost`).

    >>> b = Backlog((("pending", None, 3, 900, 300), ("running", ["a"], 1, 250, 50), ("ready", None, 2, 600, 200)))
    >>> b.pending_groups(), b.unfinished, b.estimates()
    ([(None, 3, 900)], 6, [(None, 5, 1000, 500), (['a'], 1, 200, 50)])
    """

    groups: tuple[tuple[str, list[str] | None, int, int, int], ...]

    def pending_groups(self) -> list[tuple[list[str] | None, int, int]]:
        """The backlog's composition: (allowed models or None, pending tasks, their estimated tokens)."""
        return [(allowed, n, tokens) for status, allowed, n, tokens, _ in self.groups if status == "pending"]

    @property
    def unfinished(self) -> int:
        """Tasks not finished yet (each counted once, however many calls it has)."""
        return sum(n for _, _, n, _, _ in self.groups)

    def estimates(self) -> list[tuple[list[str] | None, int, int, int]]:
        """The tasks left by allowed models: (allowed or None, tasks, estimated prompt tokens, ``max_tokens``)."""
        merged: dict[tuple[str, ...] | None, tuple[int, int, int]] = {}
        for _, allowed, n, tokens, max_tokens in self.groups:
            key = None if allowed is None else tuple(allowed)
            tasks, prompt, most = merged.get(key, (0, 0, 0))
            merged[key] = (tasks + n, prompt + tokens - max_tokens, most + max_tokens)
        return [(None if key is None else list(key), *totals) for key, totals in merged.items()]


def backlog(db: RowSource) -> Backlog:
    """The :class:`Backlog` now."""
    return Backlog(tuple((status, allowed, int(n), int(tokens), int(most))
                         for status, allowed, n, tokens, most in fetch(db, _BACKLOG)))


_PENDING_GROUPS_OF = """
SELECT allowed_models, count(*) FROM tasks
WHERE status = 'pending' AND source = ANY(%(sources)s) GROUP BY allowed_models
"""


def pending_groups_of(db: RowSource, sources: Collection[str]) -> list[tuple[list[str] | None, int]]:
    """The pending tasks of ``sources`` by allowed models (no query when there are none)."""
    if not sources:
        return []
    return [(r[0], int(r[1])) for r in fetch(db, _PENDING_GROUPS_OF, {"sources": sorted(sources)})]


_RECENT_SOLVES = """
SELECT allowed_models, count(*), extract(epoch FROM now() - min(created_at)) FROM tasks
WHERE status = 'solved' AND updated_at >= now() - make_interval(secs => %(window_s)s) GROUP BY allowed_models
"""


def recent_solves(db: RowSource, window_s: float) -> tuple[list[tuple[list[str] | None, int]], float]:
    """The work solved in the last ``window_s`` seconds, grouped by allowed models,
    and the seconds it covers: the window, or less when the oldest of those
    tasks was created more recently (a run that started inside the window)."""
    rows = fetch(db, _RECENT_SOLVES, {"window_s": window_s})
    covered = min([window_s, *(float(r[2]) for r in rows)])
    return [(r[0], int(r[1])) for r in rows], covered


_RECENT_SOLVES_BY_MODEL = """
SELECT model, count(*), sum(estimated_tokens), count(prompt_tokens),
       sum(prompt_tokens + coalesce(completion_tokens, 0))
FROM tasks
WHERE status = 'solved' AND updated_at >= now() - make_interval(secs => %(window_s)s) AND model IS NOT NULL
GROUP BY model
"""


@dataclass(frozen=True)
class ModelSolves:
    """The tasks one model answered in a window and their estimated tokens (what a
    ``reserve`` provider counts), and those of them whose answer reported its usage,
    with the tokens used (prompt and completion: what a ``settle`` provider counts)."""

    tasks: int
    estimated_tokens: int
    reported: int = 0
    used_tokens: int = 0


def recent_solves_by_model(db: RowSource, window_s: float) -> dict[str, ModelSolves]:
    """Tasks solved in the last ``window_s`` seconds, by the model that answered them."""
    return {r[0]: ModelSolves(int(r[1]), int(r[2] or 0), int(r[3]), int(r[4] or 0))
            for r in fetch(db, _RECENT_SOLVES_BY_MODEL, {"window_s": window_s})}


_RUNNING_CALLS = """
SELECT model, count(*), coalesce(sum(extract(epoch FROM now() - started_at)), 0) FROM tasks
WHERE status = 'running' AND model IS NOT NULL AND started_at IS NOT NULL GROUP BY model
"""


def running_calls(db: RowSource) -> dict[str, tuple[int, float]]:
    """Tasks running now, by model: how many, and the seconds they have run so far in all."""
    return {r[0]: (int(r[1]), max(0.0, float(r[2]))) for r in fetch(db, _RUNNING_CALLS)}


def status_counts(db: RowSource) -> dict[str, int]:
    """Tasks by status, every status named (0 for none), in :data:`TASK_STATUSES`' order."""
    counts = dict.fromkeys(TASK_STATUSES, 0)
    counts.update({status: int(n) for status, n in fetch(db, "SELECT status, count(*) FROM tasks GROUP BY status")})
    return counts


_OVERDUE = f"SELECT count(*) FROM tasks WHERE status IN {sql_list(IN_FLIGHT)} AND deadline < now()"  # noqa: S608 - constants


def overdue_count(db: RowSource) -> int:
    """Ready, queued or running tasks past their deadline: no heartbeat renewed them (their
    worker is gone) and the sweep tick has not returned them to pending yet."""
    return count(db, _OVERDUE)


def reused_count(db: RowSource) -> int:
    """Tasks that took another task's answer instead of a call (:mod:`balancer.backlog.insert`)."""
    return count(db, "SELECT count(*) FROM tasks WHERE reused_from IS NOT NULL")


_STRANDED = """
SELECT count(*) FROM tasks
WHERE status = 'pending' AND allowed_models IS NOT NULL AND NOT (allowed_models && CAST(%(models)s AS text[]))
"""


def stranded_pending(db: RowSource, models: Sequence[str]) -> int:
    """Pending tasks that none of ``models`` may take (they were pinned to models since removed)."""
    return count(db, _STRANDED, {"models": list(models)})
