"""Ask for a dispatch run without flooding the control queue.

A freed slot whose finish took no next call from its model's ready list,
or a ready list that ran below one task per slot, wants a dispatch *now*
(so do ``balancer submit``, and a sweep or an ingest that made tasks
pending). A Redis ``SET NX PX`` flag coalesces these requests: only the
first request in a burst sends a message, and the dispatch run clears the
flag when it starts, so a slot that frees during a run triggers the next
one. The flag expires by itself, so a lost message cannot block triggers
for long.

Delayed requests ("a model's tokens refill in 300 ms") use a second flag and
a countdown that is never longer than one dispatch tick, far below the broker
visibility timeout. A request due sooner than the one on its way is sent too,
and its flag takes the sooner expiry: a round slow start asks for in 60 ms is
not held back by a token wait's 900 ms.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import redis

from balancer.admission import keys

FLAG_TTL_MS = 2_000

#: A delayed request is sent unless one on its way is due no more than this much later.
SOONER_MS = 20

# SET the timer flag for ARGV[1] ms unless it exists with at most ARGV[1] + ARGV[2] ms left; 1 if set.
_SOONER = """
local left = redis.call('PTTL', KEYS[1])
if left >= 0 and left <= tonumber(ARGV[1]) + tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
return 1
"""
_SOONER_SHA = hashlib.sha1(_SOONER.encode(), usedforsecurity=False).hexdigest()


def request_dispatch(
    client: redis.Redis, namespace: str, send: Callable[[float], None], *, delay_ms: int = 0, max_delay_ms: int = 1_000
) -> bool:
    """Send a dispatch request unless one is already on its way. Returns True if sent."""
    now_key, timer_key = keys.dispatch_flags(namespace)
    if delay_ms <= 0:
        if client.set(now_key, "1", nx=True, px=FLAG_TTL_MS):
            send(0.0)
            return True
        return False
    delay_ms = max(min(delay_ms, max_delay_ms), 1)
    if _sooner(client, timer_key, delay_ms):
        send(delay_ms / 1000.0)
        return True
    return False


def _sooner(client: redis.Redis, timer_key: str, delay_ms: int) -> bool:
    """Run the flag script by its digest (loaded on first use: a script cached per client kept
    up to eight clients, and their connection pools, alive)."""
    args = (1, timer_key, delay_ms, SOONER_MS)
    try:
        return bool(client.evalsha(_SOONER_SHA, *args))
    except redis.exceptions.NoScriptError:
        return bool(client.eval(_SOONER, *args))


def clear_requests(client: redis.Redis, namespace: str) -> None:
    client.delete(keys.dispatch_flags(namespace)[0])
