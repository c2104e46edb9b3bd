"""Ask for a dispatch run without flooding the control queue.

A freed slot whose finish took no next call from its model's ready list,
or a ready list that ran below one task per slot, wants a dispatch *now*
(so do ``balancer submit``, and a sweep or an ingest that made tasks
pending). A Redis ``SET NX PX`` flag coalesces these requests: only the
first request in a burst sends a message, and the dispatch task clears the
flag as it asks for the round (:func:`run_alone`), so a slot that frees
during a run triggers the next one. The flag expires by itself, so a lost message cannot block triggers
for long.

Delayed requests ("a model's tokens refill in 300 ms") use a second flag and
a countdown that is never longer than one dispatch tick, far below the broker
visibility timeout. A request due sooner than the one on its way is sent too,
and its flag takes the sooner expiry: a round slow start asks for in 60 ms is
not held back by a token wait's 900 ms.

One dispatch run at a time, across every dispatcher process and thread
(:func:`run_alone`). Two runs side by side lost a request: a run asked for by
a slot freed during another run found the pending rows that run held
(``SKIP LOCKED``) and ended with nothing, while the other, planning on a view
read before the slot freed, left them pending; both had cleared the request
flag, so the task waited for the next tick with the slot idle. A run asked
for while another holds the round is left to the holder, which runs again
once it ends; no thread waits for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

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

#: How long a run holds the round (ms), renewed at each run: above a round's length (tens of ms;
#: a round slower than this lets a second run beside it, as before), and all that a dispatcher
#: killed mid-run holds the others back (a probe killing the holder every few seconds lost about
#: this much each time: docs/benchmark-history.md).
ROUND_HOLD_MS = 1_000
#: How long an ask waits for the round (ms): longer than any run, so that it outlives a hold that
#: lapsed, a run that raised or a holder killed (the next run, a tick's at the latest, takes it).
#: One left behind costs one run more.
ASK_TTL_MS = 60_000

# KEYS: asked, running, the request flag; ARGV: the token of the take this call may make, hold ms,
# op, ask ms, the token of the take it ends (next, drop). 'ask': record an ask and clear the request
# flag (the message is here: a request from now on sends another, which a holder that died leaves to
# it), then take the round if free; 'next': let go of the round, then take it again if a run was
# asked for meanwhile; 'drop': let go of it. Taking it clears the ask and the request flag (the run
# taking it covers them). 1 if taken. Applied twice (a reply lost, the command retried), a call
# that took the round says so again.
_ROUND = """
local running = redis.call('GET', KEYS[2])
if ARGV[3] ~= 'drop' and running == ARGV[1] then return 1 end
if ARGV[3] ~= 'ask' and running == ARGV[5] then redis.call('DEL', KEYS[2]) end
if ARGV[3] == 'drop' then return 0 end
if ARGV[3] == 'ask' then
  redis.call('SET', KEYS[1], '1', 'PX', ARGV[4])
  redis.call('DEL', KEYS[3])
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1], KEYS[3])
return 1
"""
_ROUND_SHA = hashlib.sha1(_ROUND.encode(), usedforsecurity=False).hexdigest()

T = TypeVar("T")


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
    return _script(client, _SOONER, _SOONER_SHA, [timer_key], [delay_ms, SOONER_MS])


def _script(client: redis.Redis, source: str, sha: str, keys_: Sequence[str], args: Sequence[str | int]) -> bool:
    """Run a script by its digest (loaded on first use: a script cached per client kept
    up to eight clients, and their connection pools, alive)."""
    try:
        return bool(client.evalsha(sha, len(keys_), *keys_, *args))
    except redis.exceptions.NoScriptError:
        return bool(client.eval(source, len(keys_), *keys_, *args))


def take_round(client: redis.Redis, namespace: str, op: str, token: str, ending: str = "") -> bool:
    """One step of :func:`run_alone` (the ``_ROUND`` script): ``op`` with the take ``token`` may
    make and the take ``ending`` it ends."""
    return _script(client, _ROUND, _ROUND_SHA, [*keys.dispatch_round(namespace), keys.dispatch_flags(namespace)[0]],
                   [token, ROUND_HOLD_MS, op, ASK_TTL_MS, ending])


@dataclass
class LocalRound:
    """The round within one process: a run asked for while a thread of the process holds the round
    is left to that thread, which runs again for it with no Redis round trip (as long as its hold
    is young: past half of :data:`ROUND_HOLD_MS` it lets go in Redis and takes it again)."""

    held: threading.Lock = field(default_factory=threading.Lock)
    asked: threading.Event = field(default_factory=threading.Event)


def run_alone(client: redis.Redis, namespace: str, run: Callable[[], T], local: LocalRound | None = None) -> list[T]:
    """Ask for a run, and call ``run`` unless another run (of any process) holds the round: it is
    then left to that one, which runs again once it ends. Returns what each run here returned
    (none: left to another). With ``local``, a run asked for in this process while one of its
    threads holds the round is left to that thread without asking Redis."""
    if local is None:
        return _run_alone(client, namespace, run, None)
    done: list[T] = []
    local.asked.set()
    # Checked after each release: an ask that came while the lock was held is run by its holder.
    while local.asked.is_set() and local.held.acquire(blocking=False):
        try:
            local.asked.clear()
            done += _run_alone(client, namespace, run, local.asked)
        finally:
            local.held.release()
    return done


def _run_alone(client: redis.Redis, namespace: str, run: Callable[[], T], asked_here: threading.Event | None) -> list[T]:
    done: list[T] = []
    token = uuid.uuid4().hex
    taken = take_round(client, namespace, "ask", token)
    while taken:
        took = time.monotonic()
        try:
            done.append(run())
            while asked_here is not None and asked_here.is_set() and time.monotonic() - took < ROUND_HOLD_MS / 2000:
                asked_here.clear()
                clear_requests(client, namespace)  # as the Redis ask does: a request from now on sends a message
                done.append(run())
        except BaseException:
            with contextlib.suppress(redis.RedisError):  # the run's own error is the one to see; the hold lapses
                take_round(client, namespace, "drop", uuid.uuid4().hex, token)
            raise
        token, ending = uuid.uuid4().hex, token
        try:
            taken = take_round(client, namespace, "next", token, ending)
        except redis.RedisError:  # the hold lapses by itself; an ask left waits for the next run
            break
    return done


def clear_requests(client: redis.Redis, namespace: str) -> None:
    client.delete(keys.dispatch_flags(namespace)[0])
