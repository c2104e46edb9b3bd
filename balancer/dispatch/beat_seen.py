"""When beat's dispatch tick last ran (a Redis key that expires): read by
``balancer status`` and :mod:`balancer.dispatch.fallback`. Apart from the
fallback so that ``status`` does not import Celery."""

from __future__ import annotations

import time

import redis

from balancer.admission import keys

#: Beat counts as absent once its dispatch tick has not run for this many tick intervals.
ABSENT_AFTER = 5


def mark_beat_seen(client: redis.Redis, namespace: str, dispatch_tick: float) -> None:
    """Called by beat's dispatch tick: beat is alive."""
    ttl_ms = max(1_000, int(dispatch_tick * ABSENT_AFTER * 1000))
    client.set(keys.beat_seen(namespace), str(int(time.time() * 1000)), px=ttl_ms)


def beat_last_seen_s(client: redis.Redis, namespace: str) -> float | None:
    """Seconds since beat's last dispatch tick, or None if beat counts as absent."""
    raw = client.get(keys.beat_seen(namespace))
    if raw is None:
        return None
    return max(0.0, time.time() - int(raw) / 1000)
