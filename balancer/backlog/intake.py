"""Parse JSONL task files (``balancer submit`` and the inbox), without I/O.

One task per line::

    {"prompt": "Summarise ...", "priority": 5, "model": "gpt-a", "max_tokens": 300, "source": "crm"}

``model`` pins one model, ``models`` allows a list; neither means any model.
``key`` (1 to 256 printable characters) identifies the task within its
source: a (source, key) already stored is not inserted again. ``metadata``
(a JSON object of at most 64 KiB) is kept and returned with the answer.
Tasks without a key are never taken for one another.
Every bad line is reported with its number, so a user can fix the file, and
a bad line never costs the good ones. Lines are split as JSONL says: on
``\\n`` only (a U+2028 inside a JSON string is text, not a line break), with
``\\r\\n`` endings and a leading UTF-8 BOM accepted. Bytes that are not UTF-8
(decoded with ``surrogateescape``), NUL characters, lone surrogates,
nesting deeper than ``MAX_DEPTH`` and lines over ``MAX_LINE_BYTES`` are
per-line errors: PostgreSQL could not store the first three, and the last
two are how a hostile file exhausts a parser. :class:`IntakeRules` adds what
the deployment decides: the longest prompt and source name
(``BALANCER_MAX_PROMPT_BYTES``, ``BALANCER_MAX_SOURCE_CHARS``), and the
names of the table sources, whose tasks come from their table only: a line
under such a name is a per-line error that names the source.

>>> rows, errors = parse_tasks('{"prompt": "hi"}\\n{"prompt": 3}\\n', models={"m": 1000})
>>> [r.prompt for r in rows], [e.line for e in errors]
(['hi'], [2])
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

from balancer.errors import printable
from balancer.estimates.tokens import estimate_task_tokens

MAX_PRIORITY = 1_000_000
KNOWN_FIELDS = {"prompt", "priority", "model", "models", "max_tokens", "source", "key", "metadata"}
#: The longest task key, in characters.
MAX_KEY_CHARS = 256
#: The largest metadata object, in UTF-8 bytes of its JSON.
MAX_METADATA_BYTES = 64 * 1024
#: The longest line accepted, in UTF-8 bytes (a prompt of about 1 M tokens' worth of text would not fit a model).
MAX_LINE_BYTES = 4 * 1024 * 1024
#: How deeply a line's JSON may nest (a task needs 2: the object and the models list).
MAX_DEPTH = 32
BOM = "\ufeff"
T = TypeVar("T")


@dataclass(frozen=True)
class IntakeRules:
    """What a line may hold beyond its shape. ``None``: no limit but :data:`MAX_LINE_BYTES`.
    ``table_sources``: names a line may not take (each is a table source's)."""

    max_prompt_bytes: int | None = None
    max_source_chars: int | None = None
    table_sources: frozenset[str] = frozenset()


NO_RULES = IntakeRules()


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~6x (a source's ingest makes millions)
class TaskRow:
    prompt: str
    priority: int
    allowed_models: tuple[str, ...] | None
    max_tokens: int
    estimated_tokens: int
    source: str
    key: str | None = None
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class LineError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def _int_field(data: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    """``data[key]`` (``default`` if absent), an integer in [low, high]; what was wrong, as the JSON said it.

    >>> _int_field({"priority": True}, "priority", 0, -10, 10)
    Traceback (most recent call last):
    ValueError: priority must be an integer, got true
    """
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {printable(json.dumps(value), limit=80)}")
    if not low <= value <= high:
        raise ValueError(f"{key} must be between {low} and {high}, got {value}")
    return value


def nesting_depth(text: str) -> int:
    """How deeply the brackets outside JSON strings nest (checked before parsing,
    so a hostile line cannot exhaust the parser's recursion).

    >>> nesting_depth('{"a": [[1], "]]]["]}'), nesting_depth("[" * 50)
    (3, 50)
    """
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _check_text(field: str, value: str) -> None:
    """Text PostgreSQL can store: no NUL, no lone surrogate (an invalid byte, or a ``\\ud800`` escape)."""
    if "\x00" in value:
        raise ValueError(f"{field} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} is not valid UTF-8 (an invalid byte or a lone surrogate)") from None


def check_key(value: object) -> str:
    """A task key: a string of 1 to :data:`MAX_KEY_CHARS` printable characters.

    >>> check_key("crm-17")
    'crm-17'
    """
    if not isinstance(value, str):
        raise ValueError(f"key must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_KEY_CHARS:
        raise ValueError(f"key must be 1 to {MAX_KEY_CHARS} characters, got {len(value)}")
    if not value.isprintable():
        raise ValueError("key must be printable characters only")
    _check_text("key", value)
    return value


def check_source(value: object, rules: IntakeRules = NO_RULES) -> str:
    """A task's source name: a non-empty string PostgreSQL can store, within
    ``rules.max_source_chars``, and no table source's.

    >>> check_source("crm")
    'crm'
    >>> check_source("legacy", IntakeRules(table_sources=frozenset({"legacy"})))
    Traceback (most recent call last):
    ...
    ValueError: source 'legacy' is a table source: its tasks come from its table only (give another source name)
    """
    if not isinstance(value, str) or not value:
        raise ValueError("source must be a non-empty string")
    if rules.max_source_chars is not None and len(value) > rules.max_source_chars:
        raise ValueError(f"source is {len(value):,} characters, more than BALANCER_MAX_SOURCE_CHARS "
                         f"({rules.max_source_chars:,})")
    _check_text("source", value)
    if value in rules.table_sources:
        raise ValueError(f"source {printable(value, 80)!r} is a table source: its tasks come from its table only "
                         "(give another source name)")
    return value


def check_prompt_size(prompt: str, max_bytes: int | None) -> None:
    """A prompt within ``max_bytes`` UTF-8 bytes (None: any).

    >>> check_prompt_size("héllo", 5)
    Traceback (most recent call last):
    ...
    ValueError: prompt is 6 bytes, more than BALANCER_MAX_PROMPT_BYTES (5)
    """
    if max_bytes is None or len(prompt) * 4 <= max_bytes:
        return
    size = len(prompt.encode("utf-8", "surrogateescape"))
    if size > max_bytes:
        raise ValueError(f"prompt is {size:,} bytes, more than BALANCER_MAX_PROMPT_BYTES ({max_bytes:,})")


def check_metadata(value: object) -> dict[str, Any]:
    """Task metadata: a JSON object of at most :data:`MAX_METADATA_BYTES`, storable by PostgreSQL."""
    if not isinstance(value, dict):
        raise ValueError(f"metadata must be a JSON object, got {type(value).__name__}")
    text = json.dumps(value, ensure_ascii=False)
    if len(text.encode("utf-8", "surrogateescape")) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is larger than {MAX_METADATA_BYTES // 1024} KiB")
    if "\\u0000" in text:
        raise ValueError("metadata contains a NUL character")
    _check_text("metadata", text)
    return value


def parse_line(
    text: str, *, models: Mapping[str, int], default_max_tokens: int, default_source: str,
    rules: IntakeRules = NO_RULES,
) -> TaskRow:
    """One JSONL line to a task. ``models`` maps each known model to its burst_tokens."""
    if len(text) > MAX_LINE_BYTES or len(text.encode("utf-8", "surrogateescape")) > MAX_LINE_BYTES:
        raise ValueError(f"line longer than {MAX_LINE_BYTES:,} bytes")
    if nesting_depth(text) > MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        # A byte that is not UTF-8 (read with surrogateescape as U+DC80..U+DCFF) where the parser
        # stopped, or before it, is the cause: say so (a UTF-16 or Latin-1 file), not "invalid JSON".
        bad = next((i for i, ch in enumerate(text[:exc.pos + 1]) if "\udc80" <= ch <= "\udcff"), None)
        if bad is not None:
            raise ValueError(f"not UTF-8: byte 0x{ord(text[bad]) - 0xDC00:02X} at column {bad + 1}") from None
        raise ValueError(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise ValueError("each line must be a JSON object")
    unknown = set(data) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(printable(k) for k in sorted(unknown))}")
    prompt = data.get("prompt")
    if prompt is None:
        raise ValueError("missing prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("empty prompt")
    check_prompt_size(prompt, rules.max_prompt_bytes)
    _check_text("prompt", prompt)
    priority = _int_field(data, "priority", 0, -MAX_PRIORITY, MAX_PRIORITY)
    max_tokens = _int_field(data, "max_tokens", default_max_tokens, 1, 1_000_000)
    if "model" in data and "models" in data:
        raise ValueError("give either model or models, not both")
    allowed: tuple[str, ...] | None = None
    if "model" in data:
        if not isinstance(data["model"], str):
            raise ValueError("model must be a string")
        allowed = (data["model"],)
    elif "models" in data:
        if not isinstance(data["models"], list) or not all(isinstance(m, str) for m in data["models"]) or not data["models"]:
            raise ValueError("models must be a non-empty list of strings")
        allowed = tuple(dict.fromkeys(data["models"]))
    if allowed is not None:
        unknown_models = [m for m in allowed if m not in models]
        if unknown_models:
            raise ValueError(f"unknown model(s): {', '.join(printable(m) for m in unknown_models)}")
    source = check_source(data.get("source", default_source), rules)
    key = check_key(data["key"]) if "key" in data else None
    metadata = check_metadata(data["metadata"]) if data.get("metadata") is not None else None
    estimated = estimate_task_tokens(prompt, max_tokens)
    candidates = allowed if allowed is not None else tuple(models)
    if not candidates:
        raise ValueError("no models are configured")
    largest = max(models[m] for m in candidates)
    if estimated > largest:
        raise ValueError(
            f"needs ~{estimated} tokens, more than the largest burst_tokens ({largest}) of its allowed models"
        )
    return TaskRow(prompt, priority, allowed, max_tokens, estimated, source, key, metadata)


def jsonl_lines(text: str) -> list[str]:
    """Lines as JSONL defines them: split on ``\\n`` only, a ``\\r`` before it and a
    leading BOM dropped.

    >>> jsonl_lines('\\ufeffa\\r\\nb\\u2028c\\n')
    ['a', 'b\\u2028c']
    """
    if text.startswith(BOM):
        text = text[len(BOM):]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_lines(stream: BinaryIO, max_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes | None]:
    """The lines of a binary stream as JSONL defines them (see :func:`jsonl_lines`),
    one at a time: memory stays bounded by ``max_bytes`` whatever the stream's
    size. A longer line is ``None``: its bytes are skipped, never held.

    >>> list(read_lines(io.BytesIO(b"\\xef\\xbb\\xbfa\\r\\nbb\\n" + b"x" * 9 + b"\\nc"), max_bytes=4))
    [b'a', b'bb', None, b'c']
    """
    limit = max_bytes + 3  # room for the BOM, or the line's "\r\n"
    first = True
    while True:
        line = stream.readline(limit)
        if not line:
            return
        cut_short = len(line) >= limit and not line.endswith(b"\n")
        if first:
            first = False
            line = line.removeprefix(BOM.encode("utf-8"))
        if cut_short:
            while True:  # the rest of an over-long line, in bounded pieces
                rest = stream.readline(limit)
                if not rest or rest.endswith(b"\n"):
                    break
            yield None
            continue
        line = line.removesuffix(b"\n")
        yield line.removesuffix(b"\r")


def parse_stream(
    stream: BinaryIO,
    *,
    models: Mapping[str, int],
    default_max_tokens: int = 256,
    default_source: str = "submit",
    rules: IntakeRules = NO_RULES,
) -> Iterator[TaskRow | LineError]:
    """Each line of a JSONL stream as a task or an error, in order, one at a
    time (bounded memory); blank lines are skipped. A byte that is not UTF-8
    fails its line, not the stream."""
    for number, raw in enumerate(read_lines(stream), start=1):
        if raw is None:
            yield LineError(number, f"line longer than {MAX_LINE_BYTES:,} bytes")
            continue
        line = raw.decode("utf-8", errors="surrogateescape")
        if not line.strip():
            continue
        try:
            yield parse_line(line, models=models, default_max_tokens=default_max_tokens, default_source=default_source,
                             rules=rules)
        except ValueError as exc:
            yield LineError(number, str(exc))


def batches(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in lists of at most ``size``.

    >>> list(batches(range(5), 2))
    [[0, 1], [2, 3], [4]]
    """
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def parse_tasks(
    text: str,
    *,
    models: Mapping[str, int],
    default_max_tokens: int = 256,
    default_source: str = "submit",
    rules: IntakeRules = NO_RULES,
) -> tuple[list[TaskRow], list[LineError]]:
    """All valid rows and all errors of a whole text; blank lines are skipped.

    >>> rows, errors = parse_tasks('\\ufeff{"prompt": "a\\u2028b"}\\r\\n{"prompt": "c\u2028d"}\\n', models={"m": 1000})
    >>> [r.prompt for r in rows], errors
    (['a\\u2028b', 'c\\u2028d'], [])
    """
    rows: list[TaskRow] = []
    errors: list[LineError] = []
    stream = io.BytesIO(text.encode("utf-8", errors="surrogateescape"))
    for item in parse_stream(stream, models=models, default_max_tokens=default_max_tokens, default_source=default_source,
                             rules=rules):
        (errors if isinstance(item, LineError) else rows).append(item)  # type: ignore[arg-type]
    return rows, errors
