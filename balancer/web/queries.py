"""The console's own read-only SQL: tasks per source, and failed tasks grouped by error.

Everything else the console shows comes from the read paths ``status``,
``top`` and ``balancer tasks`` already use (:mod:`balancer.views.summary`,
:mod:`balancer.backlog.operations`).
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg2.errors
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.storage.schema import tasks

#: Errors are grouped on their first this-many characters (ids or timings at the end split no group).
ERROR_PREFIX = 120


@dataclass(frozen=True)
class SourceCounts:
    source: str
    pending: int
    in_flight: int  # ready, queued or running
    solved: int
    failed: int
    cancelled: int

    def share_of(self, total_in_flight: int) -> float:
        """This source's share of the calls in flight now, 0 to 1.

        >>> SourceCounts("a", 0, 3, 0, 0, 0).share_of(4)
        0.75
        """
        return self.in_flight / total_in_flight if total_in_flight else 0.0


def fold_source_counts(rows: list[tuple[str, str, int]]) -> list[SourceCounts]:
    """``(source, status, count)`` rows to one :class:`SourceCounts` per source, by name.

    >>> fold_source_counts([("b", "solved", 2), ("a", "ready", 1), ("a", "running", 2), ("a", "failed", 1)])
    [SourceCounts(source='a', pending=0, in_flight=3, solved=0, failed=1, cancelled=0), \
SourceCounts(source='b', pending=0, in_flight=0, solved=2, failed=0, cancelled=0)]
    """
    per: dict[str, dict[str, int]] = {}
    for source, status, n in rows:
        per.setdefault(source, {})[status] = int(n)
    return [SourceCounts(source, c.get("pending", 0), c.get("ready", 0) + c.get("queued", 0) + c.get("running", 0),
                         c.get("solved", 0), c.get("failed", 0), c.get("cancelled", 0)) for source, c in sorted(per.items())]


#: The sources the console keeps by name in each sample; the rest are one "other" row (its memory and
#: its Sources page do not grow with the number of sources).
TOP_SOURCES = 25


def top_sources(counts: list[SourceCounts], keep: int = TOP_SOURCES) -> tuple[list[SourceCounts], SourceCounts | None]:
    """The ``keep`` busiest sources (calls in flight, then pending, then failed, then solved), by name, and
    the rest added up into one row named by how many they are (None when none is left).

    >>> rows = [SourceCounts(n, p, f, s, 0, 0) for n, p, f, s in (("a", 1, 0, 9), ("b", 5, 2, 0), ("c", 0, 0, 3))]
    >>> kept, other = top_sources(rows, keep=1)
    >>> [r.source for r in kept], other
    (['b'], SourceCounts(source='2 other sources', pending=1, in_flight=0, solved=12, failed=0, cancelled=0))
    >>> top_sources(rows, keep=3)[1] is None
    True
    """
    ranked = sorted(counts, key=lambda c: (-c.in_flight, -c.pending, -c.failed, -c.solved, c.source))
    kept, rest = sorted(ranked[:keep], key=lambda c: c.source), ranked[keep:]
    if not rest:
        return kept, None
    return kept, SourceCounts(f"{len(rest):,} other sources", *(sum(getattr(c, f) for c in rest) for f in
                                                               ("pending", "in_flight", "solved", "failed", "cancelled")))


def source_counts(engine: Engine) -> list[SourceCounts]:
    """Tasks per ``source`` column and status (one scan; the console's sampler runs it, not a page)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(tasks.c.source, tasks.c.status, sa.func.count()).group_by(tasks.c.source, tasks.c.status))
        return fold_source_counts([(r[0], r[1], r[2]) for r in rows])


@dataclass(frozen=True)
class ErrorGroup:
    error: str  # the error's first ERROR_PREFIX characters
    tasks: int
    newest_id: int


def error_groups(engine: Engine, limit: int = 20, timeout_ms: int | None = None) -> list[ErrorGroup] | None:
    """Failed tasks grouped by the start of their error, biggest group first (the
    ``(status, id)`` index finds the failed ones, however large the backlog);
    None if grouping them took over ``timeout_ms`` (hundreds of thousands failed)."""
    prefix = sa.func.left(sa.func.coalesce(tasks.c.error, ""), ERROR_PREFIX).label("prefix")
    query = (sa.select(prefix, sa.func.count(), sa.func.max(tasks.c.id)).where(tasks.c.status == "failed")
             .group_by(prefix).order_by(sa.func.count().desc(), prefix).limit(limit))
    with engine.connect() as conn:
        if timeout_ms is not None:
            conn.execute(sa.select(sa.func.set_config("statement_timeout", str(int(timeout_ms)), True)))
        try:
            return [ErrorGroup(r[0], int(r[1]), int(r[2])) for r in conn.execute(query)]
        except sa.exc.OperationalError as exc:
            if not isinstance(exc.orig, psycopg2.errors.QueryCanceled):
                raise
            return None
