"""A source table's rows to tasks, and its read cursor's moves: pure.

The cursor is the last row examined in the source's order (its key, or its
``cursor`` column and key: :attr:`~balancer.sources.definition.SourceDef.order`),
as the team's database writes them as text; only the database compares them.
A read examines a window of at most ``batch`` rows past it, whether they match
``where`` or not, and moves it to the window's last row; a window shorter than
asked means the read has caught up. The rescan walks from the start up to the
cursor, one window per caught-up tick, and wraps to the start at the end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from psycopg2.extensions import encodings

from balancer.backlog.intake import MAX_PRIORITY, TaskRow, check_key
from balancer.estimates.tokens import estimate_task_tokens


@dataclass(frozen=True)
class TooLong:
    """A row's prompt left unread: ``size`` bytes, more than ``limit`` (``BALANCER_MAX_PROMPT_BYTES``)."""

    size: int
    limit: int

    def __str__(self) -> str:
        return f"prompt is {self.size:,} bytes, more than BALANCER_MAX_PROMPT_BYTES ({self.limit:,})"


@dataclass(frozen=True)
class Undecodable:
    """A row's prompt whose bytes are not text in the team's database encoding (a SQL_ASCII
    table holding a LATIN1 ``\\xe9``): the row is recorded with this reason, the others are read."""

    encoding: str

    def __str__(self) -> str:
        return f"prompt is not valid {self.encoding} text"


def decode_prompt(raw: bytes | memoryview | None, encoding: str) -> str | Undecodable | None:
    """A prompt's bytes as stored in a database of ``encoding`` (PostgreSQL's name), as text;
    :class:`Undecodable` if they are not text in it. A SQL_ASCII database's bytes are taken as
    UTF-8, the common case.

    >>> decode_prompt(b"caf\\xc3\\xa9", "SQL_ASCII"), decode_prompt(b"caf\\xe9", "LATIN1")
    ('café', 'café')
    >>> str(decode_prompt(b"caf\\xe9", "SQL_ASCII"))
    'prompt is not valid UTF-8 text'
    """
    if raw is None:
        return None
    name = "UTF8" if encoding == "SQL_ASCII" else encoding
    try:
        return bytes(raw).decode(encodings.get(name, "utf-8"))
    except (UnicodeDecodeError, LookupError):
        return Undecodable("UTF-8" if name == "UTF8" else name)


def position_values(position: str | None, columns: int) -> list[str] | None:
    """A stored position as the values of the order's ``columns``: the key's text alone, or a
    JSON list of (cursor, key) texts.

    >>> position_values("7", 1), position_values('["2026-01-01 00:00:00+00", "ab"]', 2)
    (['7'], ['2026-01-01 00:00:00+00', 'ab'])
    """
    if position is None:
        return None
    return [position] if columns == 1 else [str(v) for v in json.loads(position)]


def position_text(values: Sequence[str]) -> str:
    """:func:`position_values`'s inverse.

    >>> position_text(["7"]), position_text(["3", "ab"])
    ('7', '["3", "ab"]')
    """
    return values[0] if len(values) == 1 else json.dumps(list(values))


def after_read(position: str | None, last: str | None, examined: int, span: int) -> tuple[str | None, bool]:
    """The cursor after a window that examined ``examined`` rows past ``position``, ``last`` the
    last of them (matching ``where`` or not), and whether the read caught up (fewer than ``span``).

    >>> after_read(None, "2", 2, 2), after_read("2", "3", 1, 2), after_read("3", None, 0, 2)
    (('2', False), ('3', True), ('3', True))
    """
    return (last if last is not None else position), examined < span


def after_rescan(last: str | None, examined: int, span: int) -> str | None:
    """The rescan's next start: the last row of a full window, else None (the start again).

    >>> after_rescan("2", 2, 2), after_rescan("3", 1, 2)
    ('2', None)
    """
    return last if examined == span else None


def row_to_task(source: str, key: str, prompt: object, priority: object, *, models: Mapping[str, int],
                allowed: tuple[str, ...] | None, max_tokens: int) -> TaskRow | str:
    """One row of a source table as a task, or why it cannot be one.

    >>> row_to_task("crm", "7", "hi", 3, models={"m": 1000}, allowed=None, max_tokens=10).priority
    3
    >>> row_to_task("crm", "8", "  ", None, models={"m": 1000}, allowed=None, max_tokens=10)
    'empty prompt'
    >>> row_to_task("crm", "9", TooLong(10_485_760, 1_048_576), None, models={"m": 1000}, allowed=None, max_tokens=10)
    'prompt is 10,485,760 bytes, more than BALANCER_MAX_PROMPT_BYTES (1,048,576)'
    """
    return _to_task(source, key, prompt, priority, allowed, max_tokens, _configured(models, allowed))


def rows_to_tasks(source: str, rows: Sequence[tuple], *, models: Mapping[str, int], allowed: tuple[str, ...] | None,
                  max_tokens: int) -> tuple[list[TaskRow], list[tuple[str, str]]]:
    """:func:`row_to_task` over a window's rows (key, prompt, priority): the tasks, and each
    refused row's key with its reason. What all its rows share (a model configured) is looked at once.

    >>> tasks, refused = rows_to_tasks("crm", [("1", "hi", None), ("2", "", None)], models={"m": 9}, allowed=None,
    ...                                max_tokens=10)
    >>> [t.key for t in tasks], refused
    (['1'], [('2', 'empty prompt')])
    """
    configured = _configured(models, allowed)
    tasks: list[TaskRow] = []
    refused: list[tuple[str, str]] = []
    for key, prompt, priority in rows:
        task = _to_task(source, key, prompt, priority, allowed, max_tokens, configured)
        if isinstance(task, str):
            refused.append((key, task))
        else:
            tasks.append(task)
    return tasks, refused


def _configured(models: Mapping[str, int], allowed: tuple[str, ...] | None) -> bool:
    """Whether any model a task may use is configured."""
    return any(m in models for m in (allowed if allowed is not None else tuple(models)))


_UNREAD = (TooLong, Undecodable)


def _to_task(source: str, key: str, prompt: object, priority: object, allowed: tuple[str, ...] | None,
             max_tokens: int, configured: bool) -> TaskRow | str:
    try:
        check_key(key)
    except ValueError as exc:
        return str(exc)
    if isinstance(prompt, _UNREAD):
        return str(prompt)
    if not isinstance(prompt, str) or not prompt.strip():
        return "empty prompt"
    if "\x00" in prompt:
        return "prompt contains a NUL character"
    level = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
    level = max(-MAX_PRIORITY, min(MAX_PRIORITY, level))
    if not configured:
        return "none of its models is configured"
    return TaskRow(prompt, level, allowed, max_tokens, estimate_task_tokens(prompt, max_tokens), source, key, None)
