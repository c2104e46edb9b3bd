"""A team's row asked again: its prompt changed since it was read, or it was re-opened.

A task of a source table is asked again (back to ``pending``, with the row's
prompt as it is now and its fence, :mod:`balancer.sources.catalog`) when:

- its write-back found the row changed (its prompt no longer the one read) and
  still matching ``where`` (:func:`ask_again`, from the write-back, in the
  transaction that settles its outbox row as ``changed``): the old answer is
  never written, the new prompt's is;
- a read of the table (the rescan behind the cursor) finds its row matching
  ``where`` again after it was written back: the team re-opened it
  (:func:`ask_reopened`). Only a task whose write-back ended as written (its
  outbox row gone) or ``conflict`` counts, and the row is read once more after
  that is seen, so a read from before the write-back committed never counts.

The task keeps its id and key (a source's key is one task); its end queues a new
write-back, and the results export sees it again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from balancer.backlog.operations import _RETRY as RETRY_VALUES  # what an operator's retry resets, declared once
from balancer.services import Services
from balancer.sources.catalog import RowRead, TimeLimits, read_one
from balancer.sources.definition import SourceDef
from balancer.sources.outbox import KEEPS_TASK
from balancer.sources.rows import TooLong, row_to_task
from balancer.sources.schema import source_outbox
from balancer.storage.schema import tasks

log = logging.getLogger(__name__)
#: Why a re-opened row's task was not asked again when it was retried or cancelled meanwhile.
NO_LONGER_ENDED = "it is no longer ended"

_ENDED = ("solved", "failed")
_NOT_REUSED = sa.text("UPDATE tasks SET reused_from = NULL WHERE id = :id AND reused_from IS NOT NULL")


def _kept() -> Any:
    """An outbox row of the task that keeps it from being asked again."""
    return sa.exists().where(source_outbox.c.task_id == tasks.c.id, source_outbox.c.state.in_(KEEPS_TASK))


def ask_again(conn: Connection, definition: SourceDef, task: Mapping[str, Any], row_now: RowRead,
              models: Mapping[str, int], max_prompt_bytes: int, *, checked: bool = False) -> str | None:
    """In the caller's transaction: the ended ``task`` (its ``task_id``, ``key``, ``priority``,
    ``max_tokens``) back to pending with its row's prompt now, fenced by the row as read
    (``row_now``). None: asked again; else why not (the
    prompt is no task: empty, a NUL, over ``max_prompt_bytes``, no model; or the task moved
    meanwhile). ``checked``: only while no outbox row keeps it."""
    prompt = row_now.prompt
    size = len(prompt.encode("utf-8"))
    row = row_to_task(definition.name, task["key"], TooLong(size, max_prompt_bytes) if size > max_prompt_bytes else prompt,
                      task["priority"], models=models, allowed=definition.models, max_tokens=task["max_tokens"])
    if isinstance(row, str):
        return row
    guard = [tasks.c.id == task["task_id"], tasks.c.status.in_(_ENDED)] + ([~_kept()] if checked else [])
    moved = conn.execute(sa.update(tasks).where(*guard).values(
        **RETRY_VALUES, prompt=prompt, source_fingerprint=row_now.fence, estimated_tokens=row.estimated_tokens,
        prompt_tokens=None, completion_tokens=None, updated_at=sa.func.now())).rowcount
    if not moved:
        return NO_LONGER_ENDED
    conn.execute(_NOT_REUSED, {"id": task["task_id"]})  # (tasks.reused_from is not in the Core table)
    return None


def ask_reopened(services: Services, definition: SourceDef, team: Connection,
                 keys: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Of the rows just read matching ``where`` (``keys``), those whose task was written back
    (or not overwritten) and whose row still matches ``where`` when read again: asked again.
    Returns their keys, and those of the rows whose new prompt is no task, with its reason (the
    caller records them: :func:`balancer.sources.ingest.record_rejects`)."""
    if not keys:
        return [], []
    with services.engine.connect() as conn:
        ended = conn.execute(
            sa.select(tasks.c.id.label("task_id"), tasks.c.key, tasks.c.priority, tasks.c.max_tokens)
            .where(tasks.c.source == definition.name, tasks.c.key.in_(list(keys)), tasks.c.status.in_(_ENDED),
                   ~_kept())).mappings().all()
    if not ended:
        return [], []
    models = {q.name: q.burst for q in services.quotas.all()}
    limits = TimeLimits.of(services.settings)
    asked: list[str] = []
    refused: list[tuple[str, str]] = []
    for task in ended:
        row_now = read_one(team, definition, task["key"], limits)  # after its write-back was seen done: not a stale read
        if row_now is None:
            continue
        with services.engine.begin() as conn:
            why = ask_again(conn, definition, dict(task), row_now, models, services.settings.max_prompt_bytes,
                            checked=True)
        if why is None:
            asked.append(task["key"])
        elif why == NO_LONGER_ENDED:  # retried or cancelled meanwhile: nothing to say of its row
            log.info("source %s: row %.80r re-opened, not asked again: %s", definition.name, task["key"], why)
        else:
            refused.append((task["key"], why))
    if asked:
        log.info("source %s: %d re-opened row(s) asked again", definition.name, len(asked))
    return asked, refused
