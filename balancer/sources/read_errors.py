"""Each source table's last failed read, where every process can see it.

A source is read on a thread of the dispatcher (:mod:`balancer.sources.polling`);
when its read fails (the table's URL variable unset, the table gone, a lock or
statement timeout, the database away), :func:`note_read_error` keeps the error
in Redis, and the next successful read removes it, as does the source's removal
(:func:`clear_read_errors`). ``status``, ``top``, the metrics and the console read
them (:func:`read_errors`) and say "table unreadable: <the error>" instead of a
silent cursor lag; only of a source still declared: a read that failed as its
source was removed may note its error after the removal cleared it.
"""

from __future__ import annotations

from collections.abc import Collection

import redis

from balancer.admission import keys

#: The longest error kept (the first line of a driver's message is enough to act on).
MAX_ERROR_CHARS = 300


def note_read_error(client: redis.Redis, namespace: str, source: str, error: str) -> None:
    """Record ``source``'s failed read."""
    client.hset(keys.source_read_errors(namespace), source, error[:MAX_ERROR_CHARS])


def clear_read_error(client: redis.Redis, namespace: str, source: str) -> None:
    """``source`` was read: its error, if any, is gone."""
    client.hdel(keys.source_read_errors(namespace), source)


def clear_read_errors(client: redis.Redis, namespace: str, removed: Collection[str]) -> None:
    """The sources ``removed`` are sources no more: their errors are gone. Best effort, after the
    removal committed: with Redis away they stay, and :func:`read_errors` leaves them out all the same."""
    if not removed:
        return
    try:
        client.hdel(keys.source_read_errors(namespace), *removed)
    except redis.RedisError:
        pass


def read_errors(client: redis.Redis, namespace: str, declared: Collection[str]) -> dict[str, str]:
    """Each of the ``declared`` sources whose last read failed, and its error (an entry of any
    other name is of a source removed: not said)."""
    errors = {_text(k): _text(v) for k, v in client.hgetall(keys.source_read_errors(namespace)).items()}
    return {name: error for name, error in errors.items() if name in declared}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
