"""Ended tasks out, in pages, from a resumable cursor (``balancer results export``).

The cursor is the transaction that ended a task and the task's id
(``tasks.finished_xid``, set by the ``tasks_finished`` trigger), written
``XID-ID``. A page only holds tasks ended by transactions older than every
transaction still running (``pg_snapshot_xmin``), so no task can later appear
behind a cursor already handed out: resuming from it gives no gap and no
repeat, while tasks keep being solved. A task retried after it failed appears
again when it ends again.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.errors import BalancerError, printable

#: The columns of the ``balancer_results`` view that an export writes, in order.
COLUMNS = ("id", "source", "key", "metadata", "status", "answer", "error", "model", "prompt_tokens",
           "completion_tokens", "created_at", "started_at", "solved_at", "updated_at")
_CURSOR = re.compile(r"^(\d{1,20})-(\d{1,20})$")
START = "0-0"


@dataclass(frozen=True)
class ResultCursor:
    xid: int
    task_id: int

    def __str__(self) -> str:
        return f"{self.xid}-{self.task_id}"


def parse_cursor(text: str) -> ResultCursor:
    """``XID-ID`` as printed by an export.

    >>> parse_cursor("745-12")
    ResultCursor(xid=745, task_id=12)
    """
    match = _CURSOR.match(text)
    if not match:
        raise BalancerError(f"--since takes a cursor printed by an export (XID-ID), not {printable(text, 60)!r}")
    return ResultCursor(int(match.group(1)), int(match.group(2)))


_PAGE = sa.text("""
SELECT id, source, key, metadata, status, answer, error, model, prompt_tokens,
       completion_tokens, created_at, started_at, solved_at, updated_at, CAST(finished_xid AS text) AS xid FROM balancer_results
WHERE (finished_xid, id) > (CAST(CAST(:xid AS text) AS xid8), :task_id)
  AND finished_xid < pg_snapshot_xmin(pg_current_snapshot())
  AND (CAST(:source AS text) IS NULL OR source = :source)
ORDER BY finished_xid, id LIMIT :page
""")


def page(engine: Engine, after: ResultCursor, *, source: str | None, size: int = 1000) -> tuple[list[dict[str, Any]], ResultCursor]:
    """The next ``size`` ended tasks after ``after``, and the cursor after them."""
    with engine.connect() as conn:
        rows = conn.execute(_PAGE, {"xid": str(after.xid), "task_id": after.task_id, "source": source,
                                    "page": size}).all()
    if not rows:
        return [], after
    last = rows[-1]
    return [{c: getattr(r, c) for c in COLUMNS} for r in rows], ResultCursor(int(last.xid), int(last.id))


def pages(engine: Engine, after: ResultCursor, *, source: str | None,
          size: int = 1000) -> Iterator[tuple[list[dict[str, Any]], ResultCursor]]:
    """Every page from ``after`` until none is left (memory: one page)."""
    while True:
        rows, after = page(engine, after, source=source, size=size)
        if not rows:
            return
        yield rows, after
