"""The sources file: source tables as TOML, for ``balancer source import/export``.

Format::

    [sources.crm]
    database_url_env = "CRM_DATABASE_URL"   # optional; default: balancer's own database
    table = "public.prompts"                 # (schema-qualified) table the rows are read from
    key = "id"                               # unique, orderable column: the cursor and the write-back key
    prompt = "body"
    where = "status = 'unsolved'"            # which rows are work; a written-back row must stop matching it
    answer = "answer"
    status = "status"                        # optional, with solved / failed
    solved = "solved"
    failed = "failed"
    error = "error"                          # optional
    model = "solved_by"                      # optional
    priority = "priority"                    # optional: a column read as the task's priority
    cursor = "seq"                           # optional: a NOT NULL column that grows with each new row; the cursor follows it
    weight = 1
    poll_seconds = 5
    batch = 1000
    max_tokens = 256                         # optional: each task's max_tokens (default BALANCER_EXPECTED_OUTPUT_TOKENS)
    models = ["gpt-a"]                       # optional: the models its tasks may use (default: any)
    dedup = false                            # optional: take an identical solved task's answer, no call

Parsing is pure. Identifiers must be plain SQL identifiers (letters, digits,
``_`` and ``$``, at most 63 characters); they are quoted when used and checked
against the database's catalog at import (:mod:`balancer.sources.catalog`).
``where`` is SQL the team owns: outside its literals it may not contain ``;``, a comment, or a
parenthesis it did not open (:func:`check_where`), so it
is one condition inside balancer's one statement, never a statement of its own.
It guards each write-back (a row that no longer matches it is not
overwritten), so a row written back must stop matching it: that is what makes
a write-back retried after a crash a no-op rather than a second write.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from balancer.errors import BalancerError, did_you_mean, printable
from balancer.toml_text import load_toml

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")
#: Every role a column plays, in the order checks name them; those whose columns a write-back sets.
ROLES = ("key", "prompt", "answer", "status", "error", "model", "priority", "cursor")
WRITTEN_ROLES = ("answer", "model", "error", "status")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_WHERE_CHARS = 4000
MAX_BATCH = 100_000


class SourceFileError(BalancerError):
    """A sources file or a source definition is invalid."""


@dataclass(frozen=True)
class SourceDef:
    """One source table, as declared (never a secret: the URL's variable name only)."""

    name: str
    table: str
    key: str
    prompt: str
    answer: str
    where: str = "TRUE"
    database_url_env: str | None = None
    status: str | None = None
    solved: str = "solved"
    failed: str = "failed"
    error: str | None = None
    model: str | None = None
    priority: str | None = None
    #: a NOT NULL column whose values grow with each new row (a serial, a creation time): the
    #: cursor follows (cursor, key), so new rows of a key that does not grow (a uuid) are past it
    cursor: str | None = None
    weight: int = 1
    poll_seconds: float = 5.0
    batch: int = 1000
    max_tokens: int | None = None
    models: tuple[str, ...] | None = field(default=None)
    dedup: bool = False

    @property
    def schema_and_table(self) -> tuple[str | None, str]:
        """``("public", "prompts")`` for ``public.prompts``; ``(None, "prompts")`` when unqualified."""
        schema, _, table = self.table.rpartition(".")
        return (schema or None), table

    @property
    def columns(self) -> dict[str, str]:
        """Each role (key, prompt, answer, ...) and the column that plays it."""
        return {role: getattr(self, role) for role in ROLES if getattr(self, role) is not None}

    def same_table(self, other: SourceDef) -> bool:
        return (self.database_url_env, self.table) == (other.database_url_env, other.table)

    def reads_same_rows(self, other: SourceDef) -> bool:
        """Whether ``other`` reads the same rows in the same order (its cursor stays valid)."""
        return self.same_table(other) and (self.key, self.cursor) == (other.key, other.cursor)

    @property
    def order(self) -> tuple[str, ...]:
        """The columns a read orders its rows by and its cursor holds: (cursor, key), or key."""
        return (self.cursor, self.key) if self.cursor else (self.key,)

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if v is not None and k != "name"}
        if self.models is not None:
            data["models"] = list(self.models)
        return data


_STRING_FIELDS = ("table", "key", "prompt", "answer", "where", "database_url_env", "status", "solved", "failed",
                  "error", "model", "priority", "cursor")
_KNOWN = {*_STRING_FIELDS, "weight", "poll_seconds", "batch", "max_tokens", "models", "dedup"}
_REQUIRED = ("table", "key", "prompt", "answer", "where")


def check_identifier(what: str, value: str) -> str:
    """A plain SQL identifier, or :class:`SourceFileError`.

    >>> check_identifier("key", "id")
    'id'
    """
    if not _IDENTIFIER.match(value):
        raise SourceFileError(f"{what} {printable(value, 80)!r} is not a plain SQL identifier "
                              "(letters, digits, _ and $, at most 63 characters)")
    return value


_IDENT_CHAR = re.compile(r"[A-Za-z0-9_$\u0080-\U0010ffff]")
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\u0080-\U0010ffff][A-Za-z0-9_\u0080-\U0010ffff]*)?\$")


def _bare(where: str, *, backslash_escapes: bool) -> str:
    """``where`` with the inside of every string literal, quoted identifier and
    dollar-quoted string blanked out, as PostgreSQL's lexer reads them (with
    ``backslash_escapes``: as a server with ``standard_conforming_strings = off``
    reads a plain '...'). :class:`SourceFileError` on one left unterminated.

    >>> _bare("a = 'x)' AND $t$--$t$ = b", backslash_escapes=False)
    "a = '  ' AND $t$  $t$ = b"
    """
    out: list[str] = []
    i, n = 0, len(where)
    while i < n:
        c = where[i]
        before = where[i - 1] if i else ""
        if c == "$" and not _IDENT_CHAR.match(before) and (tag := _DOLLAR_TAG.match(where, i)):
            end = where.find(tag.group(), tag.end())
            if end < 0:
                raise SourceFileError("where has an unterminated dollar-quoted string")
            out.append(tag.group() + " " * (end - tag.end()) + tag.group())
            i = end + len(tag.group())
            continue
        if c in "'\"":
            escapes = c == "'" and (backslash_escapes or (
                before in "Ee" and before != "" and not _IDENT_CHAR.match(where[i - 2] if i >= 2 else "")))
            j = i + 1
            while True:
                if j >= n:
                    raise SourceFileError("where has an unterminated " + ("string" if c == "'" else "quoted identifier"))
                if escapes and where[j] == "\\":
                    j += 2
                elif where[j] == c and j + 1 < n and where[j + 1] == c:
                    j += 2  # a doubled quote stands for one
                elif where[j] == c:
                    break
                else:
                    j += 1
            out.append(c + " " * (j - i - 1) + c)
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def check_where(where: str) -> str:
    """A condition that stays one condition inside balancer's statement, whatever it
    holds: outside its string literals and quoted identifiers (read as PostgreSQL's
    lexer reads them, with ``standard_conforming_strings`` on or off), no ``;``, no
    comment, and parentheses that balance without ever closing one it did not open,
    so it cannot leave the parentheses balancer puts it in. (That it is one boolean
    expression on the table is checked against the database at import:
    :func:`balancer.sources.catalog.check_source`.)

    >>> check_where("status = 'unsolved'")
    "status = 'unsolved'"
    >>> check_where("status = 'unsolved') OR (status = 'unsolved'")
    Traceback (most recent call last):
    ...
    balancer.sources.definition.SourceFileError: where closes a parenthesis it did not open: it must be one condition
    """
    if not where.strip() or len(where) > MAX_WHERE_CHARS:
        raise SourceFileError(f"where must be a non-empty SQL condition of at most {MAX_WHERE_CHARS} characters")
    if "\x00" in where:
        raise SourceFileError("where may not contain a NUL character")
    for backslash_escapes in (False, True):
        bare = _bare(where, backslash_escapes=backslash_escapes)
        for bad, what in ((";", "a ';'"), ("--", "a comment"), ("/*", "a comment")):
            if bad in bare:
                raise SourceFileError(f"where may not contain {what}: it is one condition, not a statement")
        depth = 0
        for c in bare:
            depth += (c == "(") - (c == ")")
            if depth < 0:
                raise SourceFileError("where closes a parenthesis it did not open: it must be one condition")
        if depth:
            raise SourceFileError("where has unbalanced parentheses")
    return where


def _int(name: str, fields: dict[str, Any], key: str, default: int | None, low: int, high: int) -> int | None:
    value = fields.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SourceFileError(f"sources.{name}.{key} must be a whole number from {low} to {high}")
    return value


def _check_roles(name: str, fields: dict[str, Any]) -> None:
    """A column a write-back sets is no other role's: writing the answer into the prompt or the
    key column would overwrite the team's own data, and one column set twice cannot be written.

    >>> _check_roles("s", {"key": "id", "prompt": "body", "answer": "out", "status": "state"})
    >>> _check_roles("s", {"key": "id", "prompt": "body", "answer": "body"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    balancer.sources.definition.SourceFileError: sources.s: answer and prompt name one column, 'body': ...
    """
    written = [(role, fields[role]) for role in WRITTEN_ROLES if fields.get(role) is not None]
    others = [(role, fields[role]) for role in ROLES if fields.get(role) is not None]
    for role, column in written:
        for other, same in others:
            if other != role and same == column:
                raise SourceFileError(f"sources.{name}: {role} and {other} name one column, {printable(column, 80)!r}: "
                                      "a column balancer writes back may be no other role's")


def source_from_dict(name: str, fields: dict[str, Any]) -> SourceDef:
    """One ``[sources.NAME]`` table to a :class:`SourceDef`, checked (without the database)."""
    if not _SOURCE_NAME.match(name):
        raise SourceFileError(f"source name {printable(name, 80)!r} must be 1 to 64 letters, digits, '_', '.' or '-'")
    unknown = set(fields) - _KNOWN
    if unknown:
        hint = did_you_mean(min(unknown), _KNOWN) if len(unknown) == 1 else ""
        raise SourceFileError(f"sources.{name}: unknown field(s): {', '.join(printable(k, 40) for k in sorted(unknown))}"
                              + hint)
    missing = [k for k in _REQUIRED if k not in fields]
    if missing:
        raise SourceFileError(f"sources.{name}: missing {', '.join(missing)}")
    for key in _STRING_FIELDS:
        if key in fields and not isinstance(fields[key], str):
            raise SourceFileError(f"sources.{name}.{key} must be a string")
    table = fields["table"]
    parts = table.split(".")
    if len(parts) > 2:
        raise SourceFileError(f"sources.{name}.table must be TABLE or SCHEMA.TABLE, not {printable(table, 80)!r}")
    try:
        for part in parts:
            check_identifier("table", part)
        for key in ROLES:
            if key in fields:
                check_identifier(f"sources.{name}.{key}", fields[key])
        check_where(fields["where"])
    except SourceFileError as exc:
        raise SourceFileError(f"sources.{name}: {exc}") from None
    _check_roles(name, fields)
    env = fields.get("database_url_env")
    if env is not None and not _ENV_NAME.match(env):
        raise SourceFileError(f"sources.{name}.database_url_env must name an environment variable")
    for key in ("solved", "failed"):
        if key in fields and (not fields[key] or "\x00" in fields[key]):
            raise SourceFileError(f"sources.{name}.{key} must be a non-empty string")
    poll = fields.get("poll_seconds", 5.0)
    if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0.1 <= poll <= 86_400:
        raise SourceFileError(f"sources.{name}.poll_seconds must be a number from 0.1 to 86400")
    if not isinstance(fields.get("dedup", False), bool):
        raise SourceFileError(f"sources.{name}.dedup must be true or false")
    models = fields.get("models")
    if models is not None and (not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models)):
        raise SourceFileError(f"sources.{name}.models must be a non-empty list of model names")
    return SourceDef(
        name=name, table=table, key=fields["key"], prompt=fields["prompt"], answer=fields["answer"],
        where=fields["where"], database_url_env=env, status=fields.get("status"),
        solved=fields.get("solved", "solved"), failed=fields.get("failed", "failed"), error=fields.get("error"),
        model=fields.get("model"), priority=fields.get("priority"), cursor=fields.get("cursor"),
        weight=_int(name, fields, "weight", 1, 1, 1_000_000) or 1, poll_seconds=float(poll),
        batch=_int(name, fields, "batch", 1000, 1, MAX_BATCH) or 1000,
        max_tokens=_int(name, fields, "max_tokens", None, 1, 1_000_000),
        models=tuple(dict.fromkeys(models)) if models is not None else None, dedup=fields.get("dedup", False),
    )


def parse_source_file(text: str) -> list[SourceDef]:
    """Every source in a sources file, sorted by name; :class:`SourceFileError` on the first problem.

    >>> [s.name for s in parse_source_file('[sources.a]\\ntable="t"\\nkey="id"\\nprompt="p"\\nanswer="a"\\nwhere="a IS NULL"\\n')]
    ['a']
    """
    data = load_toml(text, SourceFileError)
    unknown = set(data) - {"sources"}
    if unknown:
        raise SourceFileError(f"unknown top-level key(s): {', '.join(printable(k, 40) for k in sorted(unknown))}; "
                              "expected [sources.NAME] tables")
    table = data.get("sources", {})
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise SourceFileError("'sources' must be a table of [sources.NAME] sections")
    return sorted((source_from_dict(name, fields) for name, fields in table.items()), key=lambda s: s.name)


def format_source_file(definitions: list[SourceDef]) -> str:
    """Render sources as TOML that :func:`parse_source_file` reads back identically."""
    import tomli_w

    return tomli_w.dumps({"sources": {d.name: d.as_dict() for d in sorted(definitions, key=lambda d: d.name)}})
