"""A source table's rows to tasks, and its read cursor's moves: pure.

The cursor is the largest key read (keys as the team's database writes them
as text; only the database compares them). A batch read past it moves it to
the batch's last key; a batch shorter than asked means the read has caught up.
The rescan walks from the start up to the cursor, one batch per caught-up tick,
and wraps to the start when it reaches the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from psycopg2.extensions import encodings

from balancer.domain.intake import MAX_PRIORITY, TaskRow, check_key
from balancer.domain.tokens import estimate_task_tokens


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


def after_read(position: str | None, keys: Sequence[str], batch: int) -> tuple[str | None, bool]:
    """The cursor after reading ``keys`` past ``position``, and whether the read caught up.

    >>> after_read(None, ["1", "2"], 2), after_read("2", ["3"], 2), after_read("3", [], 2)
    (('2', False), ('3', True), ('3', True))
    """
    return (keys[-1] if keys else position), len(keys) < batch


def after_rescan(keys: Sequence[str], batch: int) -> str | None:
    """The rescan's next start: the last key of a full batch, else None (the start again).

    >>> after_rescan(["1", "2"], 2), after_rescan(["3"], 2)
    ('2', None)
    """
    return keys[-1] if len(keys) == batch else None


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
    try:
        check_key(key)
    except ValueError as exc:
        return str(exc)
    if isinstance(prompt, TooLong | Undecodable):
        return str(prompt)
    if not isinstance(prompt, str) or not prompt.strip():
        return "empty prompt"
    if "\x00" in prompt:
        return "prompt contains a NUL character"
    level = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
    level = max(-MAX_PRIORITY, min(MAX_PRIORITY, level))
    estimated = estimate_task_tokens(prompt, max_tokens)
    candidates = [m for m in (allowed if allowed is not None else tuple(models)) if m in models]
    if not candidates:
        return "none of its models is configured"
    return TaskRow(prompt, level, allowed, max_tokens, estimated, source, key, None)
