"""Errors that mean "the user asked for something wrong", not "the code broke".

The CLI prints these as one line and exits 2; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


class BalancerError(Exception):
    """A user-facing error: the message is the whole story."""


class ConfigError(BalancerError):
    """A setting is malformed or points at something unreachable."""


class QuotaError(BalancerError):
    """A quota value or quota file is invalid."""


class QuotaRemoved(QuotaError):
    """A model named at a worker's start has no quota now but had one (with
    ``--all-models``: no model has one, and one had): its last change removed it,
    perhaps to be created again (an import with ``--replace``, a quota file rewritten).
    A worker starting waits for it (``BALANCER_START_WAIT``), as for an unreachable
    service; a name that never had a quota is an error at once."""


class ServiceUnavailable(BalancerError):
    """Redis or PostgreSQL could not be reached; the message names the masked URL."""


class Unreachable(ServiceUnavailable):
    """Redis or PostgreSQL refused or timed out a connection: it may come back
    (a restart, a network blip), unlike a bad URL or a refused password. A
    worker, dispatcher or beat starting waits for it (``BALANCER_START_WAIT``)."""


def printable(text: str, limit: int = 200) -> str:
    """User-supplied text made safe to echo in a terminal: control characters
    (C0, C1, DEL) and bidi overrides escaped, and long text shortened.

    >>> printable("gpt\\x1b[31m-a"), printable("a\\u202eb"), printable("x" * 5, limit=3)
    ('gpt\\\\x1b[31m-a', 'a\\\\u202eb', 'xxx…')
    """
    out = []
    for char in text[:limit]:
        code = ord(char)
        if code < 0x20 or 0x7F <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif 0x202A <= code <= 0x202E or 0x2066 <= code <= 0x2069 or code in (0x2028, 0x2029):
            out.append(f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out) + ("…" if len(text) > limit else "")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A hint naming the choice ``word`` most likely misspells, for an error's end; "" if none is close.

    >>> did_you_mean("promt", ["prompt", "answer", "key"]), did_you_mean("zzz", ["prompt"])
    (" (did you mean 'prompt'?)", '')
    """
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {printable(close[0], 64)!r}?)" if close else ""
