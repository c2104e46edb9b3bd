"""The fair share's round-robin state in Redis, shared by every dispatcher.

A hash under :func:`balancer.admission.keys.fair_shares`: one deficit per
source with pending work and the source served last, a few dozen bytes
(:class:`balancer.sources.fairshare.Shares`). Each dispatcher reads it before
filling its window and writes it back after its admissions. Two dispatchers
filling at once may overwrite each other's update; that costs one round's
turns, not the shares over time, and the state is rebuilt from nothing after
Redis loses it (a deficit is at most a few tasks' worth).
"""

from __future__ import annotations

import redis
from redis.typing import EncodableT, FieldT

from balancer.admission import keys
from balancer.sources.fairshare import Shares

_DEFICIT = "d:"
_LAST = "last"
_INNER = "inner"


def load(client: redis.Redis, namespace: str) -> Shares:
    """The state as the last dispatcher left it (empty if none)."""
    raw: dict[bytes, bytes] = client.hgetall(keys.fair_shares(namespace))  # type: ignore[assignment]  # sync client
    deficits: dict[str, int] = {}
    last: str | None = None
    inner: str | None = None
    for name, value in raw.items():
        field, text = name.decode(), value.decode()
        if field == _LAST:
            last = text
        elif field == _INNER:
            inner = text
        elif field.startswith(_DEFICIT):
            try:
                deficits[field[len(_DEFICIT):]] = int(text)
            except ValueError:  # not ours: start that source from nothing
                continue
    return Shares(deficits, last, inner)


def save(client: redis.Redis, namespace: str, shares: Shares, shared_for_ms: int) -> None:
    """Replace the state in one transaction (sources that left drop out), and
    mark the window shared for ``shared_for_ms``."""
    key = keys.fair_shares(namespace)
    mapping: dict[FieldT, EncodableT] = {_DEFICIT + source: int(d) for source, d in shares.deficits.items()}
    if shares.last is not None:
        mapping[_LAST] = shares.last
    if shares.inner is not None:
        mapping[_INNER] = shares.inner
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    if mapping:
        pipe.hset(key, mapping=mapping)
    pipe.set(keys.fair_shared(namespace), 1, px=max(1, shared_for_ms))
    pipe.execute()


def recently_shared(client: redis.Redis, namespace: str) -> bool:
    """Whether a dispatcher filled its window from several sources within the marked time."""
    return bool(client.exists(keys.fair_shared(namespace)))
