"""Each source table's last failed read, where every process can see it.

A source is read on a thread of the dispatcher (:mod:`balancer.sources.polling`);
when its read fails (the table's URL variable unset, the table gone, a lock or
statement timeout, the database away), :func:`note_read_error` keeps the error
in Redis, and the next successful read removes it. ``status``, ``top``, the
metrics and the console read them (:func:`read_errors`) and say "table
unreadable: <the error>" instead of a silent cursor lag.
"""

from __future__ import annotations

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


def read_errors(client: redis.Redis, namespace: str) -> dict[str, str]:
    """Each source whose last read failed, and its error."""
    return {k.decode() if isinstance(k, bytes) else str(k): v.decode() if isinstance(v, bytes) else str(v)
            for k, v in client.hgetall(keys.source_read_errors(namespace)).items()}
