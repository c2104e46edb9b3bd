"""Ended tasks out, in pages, from a resumable cursor (``balancer results export``).

The cursor is the transaction that ended a task and the task's id
(``tasks.finished_xid``, set by the ``tasks_finished`` trigger), written
``XID-ID``. A page only holds tasks ended by transactions older than every
transaction still running (``pg_snapshot_xmin``), so no task can later appear
behind a cursor already handed out: resuming from it gives no gap and no
repeat, while tasks keep being solved. A task retried after it failed appears
again when it ends again.

Each task also carries what its calls cost, from the ledger
(:func:`balancer.backlog.spend.usage_by_task`): how many calls were sent
(hedges and retries included), the tokens they are billed for, and their
cost at the prices of each call's start (:func:`balancer.costs.cost.task_cost`;
empty when a call made with no price took tokens).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.backlog.spend import TaskUsage, usage_by_task
from balancer.costs.cost import task_cost
from balancer.errors import BalancerError, printable

#: The columns of the ``balancer_results`` view that an export writes, in order.
VIEW_COLUMNS = ("id", "source", "key", "metadata", "status", "answer", "error", "model", "prompt_tokens",
                "completion_tokens", "created_at", "started_at", "solved_at", "updated_at")
#: What a task's calls cost, from the ledger: written after the view's columns.
COST_COLUMNS = ("calls", "billed_prompt_tokens", "billed_completion_tokens", "cost")
COLUMNS = VIEW_COLUMNS + COST_COLUMNS


def columns(with_prompt: bool) -> tuple[str, ...]:
    """The columns an export writes: :data:`COLUMNS`, and with the prompt, ``prompt`` after ``key``.

    >>> columns(True)[:4]
    ('id', 'source', 'key', 'prompt')
    """
    at = COLUMNS.index("key") + 1
    return COLUMNS[:at] + ("prompt",) + COLUMNS[at:] if with_prompt else COLUMNS

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
       completion_tokens, created_at, started_at, solved_at, updated_at, CAST(finished_xid AS text) AS xid,
       CASE WHEN :with_prompt THEN (SELECT t.prompt FROM tasks t WHERE t.id = balancer_results.id) END AS prompt
FROM balancer_results
WHERE (finished_xid, id) > (CAST(CAST(:xid AS text) AS xid8), :task_id)
  AND finished_xid < pg_snapshot_xmin(pg_current_snapshot())
  AND (CAST(:source AS text) IS NULL OR source = :source)
ORDER BY finished_xid, id LIMIT :page
""")


def page(engine: Engine, after: ResultCursor, *, source: str | None, size: int = 1000,
         with_prompt: bool = False) -> tuple[list[dict[str, Any]], ResultCursor]:
    """The next ``size`` ended tasks after ``after``, each with its calls' cost (and its prompt,
    ``with_prompt``), and the cursor after them."""
    with engine.connect() as conn:
        rows = conn.execute(_PAGE, {"xid": str(after.xid), "task_id": after.task_id, "source": source,
                                    "page": size, "with_prompt": with_prompt}).all()
        usage = usage_by_task(conn, [r.id for r in rows]) if rows else {}
    if not rows:
        return [], after
    last = rows[-1]
    return [_with_cost({c: getattr(r, c) for c in VIEW_COLUMNS + (("prompt",) if with_prompt else ())},
                       usage.get(r.id, [])) for r in rows], \
        ResultCursor(int(last.xid), int(last.id))


def _with_cost(row: dict[str, Any], usage: list[TaskUsage]) -> dict[str, Any]:
    row["calls"] = sum(u[3] for u in usage)
    row["billed_prompt_tokens"] = sum(u[1] for u in usage)
    row["billed_completion_tokens"] = sum(u[2] for u in usage)
    row["cost"] = task_cost([(model, prompt, completion, cost) for model, prompt, completion, _, cost, _ in usage])
    row["usage"] = usage  # per model called: what an export's spend summary adds up (not a written column)
    return row


def pages(engine: Engine, after: ResultCursor, *, source: str | None,
          size: int = 1000) -> Iterator[tuple[list[dict[str, Any]], ResultCursor]]:
    """Every page from ``after`` until none is left (memory: one page)."""
    while True:
        rows, after = page(engine, after, source=source, size=size)
        if not rows:
            return
        yield rows, after
