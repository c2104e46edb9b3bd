"""What ``status``, ``top``, ``source list``, the metrics exporter and the dispatcher read per
source: each source table's tasks by state, write-backs and cursor lag
(:func:`source_status`), rows of work that are not tasks (:func:`not_tasks_by_source`),
every declared source's write-backs in trouble (:func:`writebacks_by_source`), every budget per day set
(:func:`budgets`), and whether any task carries a source (:func:`has_tasks`). SQL text, run
on an engine, a connection or ``status``'s snapshot (:mod:`balancer.storage.rows`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from balancer.backlog.statuses import IN_FLIGHT, sql_list
from balancer.costs.budget import Budget
from balancer.storage.rows import RowSource, fetch


@dataclass(frozen=True)
class SourceStatus:
    name: str
    pending: int
    in_flight: int
    solved: int
    failed: int
    cancelled: int  # taken out by an operator (``tasks cancel``, ``source remove --cancel``): its row stays as it was
    writebacks_waiting: int
    conflicts: int  # not overwritten: the row no longer matched where
    ingested: int
    lag_s: float | None  # seconds since the source was last read to its end (None: never)
    changed: int = 0  # not overwritten: the row's prompt changed since it was read (asked again)
    unwritable: int = 0  # refused by the table BALANCER_WRITEBACK_ATTEMPTS times (balancer.sources.outbox)
    unwritable_error: str | None = None  # the latest unwritable write-back's error
    writebacks_failing: int = 0  # of those waiting, the ones that failed at least once (retried after a back-off)
    writebacks_failing_error: str | None = None  # the latest of those's error
    #: rows of work that are not tasks, by reason (an empty or undecodable prompt, no model
    #: configured, a NULL key ...), each recorded before the cursor moved past it
    not_tasks: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


#: Per declared source: its rows of work that are not tasks, by reason (JSON), each recorded
#: (``source_rejects``) before the cursor moved past it, and its rows with a NULL key.
_NOT_TASKS = """
SELECT s.name, coalesce(r.reasons, '{}'::jsonb) || CASE WHEN s.null_keys > 0 THEN jsonb_build_object('NULL key', s.null_keys)
                                                        ELSE '{}'::jsonb END AS not_tasks
FROM sources s
LEFT JOIN (SELECT source, jsonb_object_agg(reason, n) AS reasons
           FROM (SELECT source, reason, count(*) AS n FROM source_rejects GROUP BY source, reason) x
           GROUP BY source) r ON r.source = s.name
"""

#: A write-back that failed at least once and waits its next try (:func:`balancer.sources.outbox.retry_later`,
#: and a refusal not yet the last: :func:`balancer.sources.outbox.refuse`).
_FAILING = "state = 'waiting' AND attempts > 0"

#: Of one source's outbox rows (grouped by ``source``): its write-backs in trouble, each kind's latest error.
_IN_TROUBLE = f"""count(*) FILTER (WHERE state = 'unwritable') AS unwritable,
       (array_agg(last_error ORDER BY id DESC) FILTER (WHERE state = 'unwritable'))[1] AS unwritable_error,
       count(*) FILTER (WHERE {_FAILING}) AS failing,
       (array_agg(last_error ORDER BY id DESC) FILTER (WHERE {_FAILING}))[1] AS failing_error"""

#: Per declared source, by name: its tasks by state, its write-backs waiting, failing and refused, its
#: rows ingested and the seconds since it was last read to its end, its rows not tasks.
_SOURCE_STATUS = f"""
SELECT s.name, coalesce(t.pending, 0), coalesce(t.in_flight, 0), coalesce(t.solved, 0), coalesce(t.failed, 0),
       coalesce(t.cancelled, 0), coalesce(o.waiting, 0), coalesce(o.conflicts, 0), s.ingested, extract(epoch FROM now() - s.caught_up_at),
       coalesce(o.changed, 0), coalesce(o.unwritable, 0), o.unwritable_error, coalesce(o.failing, 0), o.failing_error,
       n.not_tasks
FROM sources s
LEFT JOIN (SELECT source, count(*) FILTER (WHERE status = 'pending') AS pending,
                  count(*) FILTER (WHERE status IN {sql_list(IN_FLIGHT)}) AS in_flight,
                  count(*) FILTER (WHERE status = 'solved') AS solved, count(*) FILTER (WHERE status = 'failed') AS failed,
                  count(*) FILTER (WHERE status = 'cancelled') AS cancelled
           FROM tasks WHERE source IN (SELECT name FROM sources) GROUP BY source) t ON t.source = s.name
LEFT JOIN (SELECT source, count(*) FILTER (WHERE state = 'waiting') AS waiting,
                  count(*) FILTER (WHERE state = 'conflict') AS conflicts,
                  count(*) FILTER (WHERE state = 'changed') AS changed,
                  {_IN_TROUBLE}
           FROM source_outbox GROUP BY source) o ON o.source = s.name
LEFT JOIN ({_NOT_TASKS}) n ON n.name = s.name
ORDER BY s.name
"""  # noqa: S608 - the statuses are statuses.py's constants, not input


def not_tasks_by_source(db: RowSource) -> dict[str, dict[str, int]]:
    """Each declared source with rows of work that are not tasks: how many, by reason."""
    return {name: reasons for name, not_tasks in fetch(db, _NOT_TASKS + " ORDER BY s.name")
            if (reasons := _reasons(not_tasks))}


def _reasons(not_tasks: dict[str, Any] | None) -> dict[str, int]:
    return {str(k): int(v) for k, v in sorted((not_tasks or {}).items())}


def source_status(db: RowSource) -> list[SourceStatus]:
    """Per declared source: its tasks by state (cancelled too), write-backs waiting, failing and refused, the cursor's lag."""
    return [SourceStatus(name, int(pending), int(in_flight), int(solved), int(failed), int(cancelled), int(waiting),
                         int(conflicts), int(ingested), None if lag is None else round(float(lag), 1), int(changed),
                         int(unwritable), unwritable_error, int(failing), failing_error, _reasons(not_tasks))
            for name, pending, in_flight, solved, failed, cancelled, waiting, conflicts, ingested, lag, changed, unwritable,
            unwritable_error, failing, failing_error, not_tasks in fetch(db, _SOURCE_STATUS)]


@dataclass(frozen=True)
class Writebacks:
    """A declared source's write-backs in trouble (:mod:`balancer.sources.outbox`)."""

    unwritable: int = 0  # refused by its table until they were left unwritable
    unwritable_error: str | None = None  # the latest of those's error
    failing: int = 0  # waiting after at least one failed try: retried after a back-off
    failing_error: str | None = None  # the latest of those's error


_WRITEBACKS = f"""
SELECT s.name, coalesce(o.unwritable, 0), o.unwritable_error, coalesce(o.failing, 0), o.failing_error
FROM sources s
LEFT JOIN (SELECT source, {_IN_TROUBLE} FROM source_outbox WHERE state IN ('unwritable', 'waiting') GROUP BY source) o
       ON o.source = s.name
ORDER BY s.name
"""  # noqa: S608 - constant fragments, not input


def writebacks_by_source(db: RowSource) -> dict[str, Writebacks]:
    """Every declared source (and no other name: a source removed is no longer one), with its
    write-backs in trouble: left unwritable, and failing (retried); how many, each kind's latest error."""
    return {source: Writebacks(int(unwritable), unwritable_error, int(failing), failing_error)
            for source, unwritable, unwritable_error, failing, failing_error in fetch(db, _WRITEBACKS)}


def not_read_to_end(db: RowSource) -> list[str]:
    """The declared sources never read to the end of their table (``SourceStatus.lag_s`` None):
    some of their rows may not be tasks yet, so no ETA counts them."""
    return [name for (name,) in fetch(db, "SELECT name FROM sources WHERE caught_up_at IS NULL ORDER BY name")]


_BUDGETS = """
SELECT source, money_per_day, tokens_per_day FROM source_budgets
WHERE money_per_day IS NOT NULL OR tokens_per_day IS NOT NULL ORDER BY source
"""


def budgets(db: RowSource) -> list[Budget]:
    """Every source with a budget set, by name (:mod:`balancer.sources.budgets` sets them)."""
    return [Budget(source, money, None if tokens is None else int(tokens)) for source, money, tokens in fetch(db, _BUDGETS)]


_HAS_TASKS = "SELECT EXISTS (SELECT 1 FROM tasks WHERE source = %(source)s)"  # an index probe (tasks_source_id)


def has_tasks(db: RowSource, source: str) -> bool:
    """True if any task, in any status, carries ``source``."""
    [(found,)] = fetch(db, _HAS_TASKS, {"source": source})
    return bool(found)
