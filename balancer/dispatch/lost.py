"""Solve messages the broker lost: their tasks go back to pending within seconds, not a lease.

A Redis failover loses what the old master had not yet sent to its replica: a
solve message just published, or one a worker had just taken but not yet
recorded as delivered. Its task stays ``queued`` under a lease that no call will
ever free, until its deadline passes and the sweep returns it: a lease and a
sweep tick (about 40 s) for a failover of a few seconds.

So the dispatcher looks, every :data:`CHECK_S` at most, at the tasks ``queued``
for longer than :data:`GRACE_S` (a message is normally taken within
milliseconds; only those are read from the broker, so an empty result costs one
indexed query). Such a task's message is *lost* (:func:`lost`) if it waits in
no model's queue, no live worker keeps its call alive (the live-call set of
:mod:`balancer.calls.heartbeat`), and either no worker holds it as delivered
(kombu's unacknowledged hash) or one does but has not registered its call for
a heartbeat interval past the grace (that worker is gone: its copy comes back
only after the broker's visibility timeout). Lost tasks go back to pending and
their leases are withdrawn, so they are dispatched again at once.

This can never start a second call of one task: a worker starts a call only by
moving its task from ``queued`` under the message's admission to ``running``
(:func:`balancer.backlog.transitions.start_solve`), and a returned task is no
longer under that admission (a late copy is ``stale`` and makes no call); a row
a worker is starting is locked and skipped. A call whose start was committed
but lost in a PostgreSQL crash is in the live-call set, and kept. The worst a
wrong guess costs is one more dispatch of the task.

Only a Redis broker can be read so; with another broker, lost messages wait for
the sweep as before.

A failover can lose a ready-list entry the same way (stocked, or taken by a
finishing call whose reply never came): its task stays ``ready`` in PostgreSQL
until its deadline, a ready list's life and a lease. A task ``ready`` for longer
than :data:`GRACE_S` whose entry is on no list, and whose message (a ready task
the dispatcher took is published like any) is lost as above, in two looks in a
row, goes back to pending too.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Collection, Iterable

import redis

from balancer.admission import keys
from balancer.backlog.leases import queued_since, return_lost, return_unlisted
from balancer.calls.heartbeat import live_calls
from balancer.services import Services
from balancer.snapshot import redis_client

log = logging.getLogger(__name__)

#: A task queued (or ready) for longer than this has had time for its message (or entry) to be taken (seconds).
GRACE_S = 3.0
#: Seconds between two looks at the broker, at most once per dispatch.
CHECK_S = 2.0


def admission_of(raw: bytes | str) -> str | None:
    """The admission id a solve message carries (kombu's Redis form: JSON, its body base64 JSON
    ``[args, kwargs, embed]``, args ``[task_id, admission_id, ...]``); None for any other message.

    >>> body = base64.b64encode(json.dumps([[7, "adm-1", "m", 10, False], {}, {}]).encode()).decode()
    >>> admission_of(json.dumps({"body": body, "headers": {"task": "balancer.solve"}}))
    'adm-1'
    >>> admission_of(json.dumps([{"body": body, "headers": {"task": "balancer.solve"}}, "", "model.m"]))
    'adm-1'
    >>> admission_of(b"not json") is None
    True
    """
    try:
        message = json.loads(raw)
        if isinstance(message, list):  # an unacknowledged entry: [message, exchange, routing key]
            message = message[0]
        if message.get("headers", {}).get("task") != keys.SOLVE_TASK:
            return None
        args = json.loads(base64.b64decode(message["body"]))[0]
        return str(args[1])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def lost(candidates: Iterable[tuple[str, str, float]], waiting: Collection[str], delivered: Collection[str],
         alive: Collection[str], delivered_grace: float) -> list[str]:
    """The admissions among ``candidates`` (admission id, model, seconds queued) whose messages are
    lost: in no queue (``waiting``), not kept alive by a worker (``alive``), and not delivered, or
    delivered more than ``delivered_grace`` seconds ago and still not kept alive.

    >>> lost([("a", "m", 5.0), ("b", "m", 5.0), ("c", "m", 5.0), ("d", "m", 5.0), ("e", "m", 20.0)],
    ...      waiting={"a"}, delivered={"b", "e"}, alive={"c"}, delivered_grace=13.0)
    ['d', 'e']
    """
    return [aid for aid, _, age in candidates
            if aid not in waiting and aid not in alive and (aid not in delivered or age > delivered_grace)]


def ready_entries(client: redis.Redis, namespace: str, models: Collection[str]) -> set[str]:
    """Admission ids on ``models``' ready lists (entries ``task:admission:tokens:expires``). One round trip."""
    pipe = client.pipeline(transaction=False)
    for model in sorted(models):
        pipe.lrange(keys.ready(namespace, model), 0, -1)
    return {entry.split(b":")[1].decode() for entries in pipe.execute() for entry in entries}


def broker_messages(client: redis.Redis, namespace: str, models: Collection[str]) -> tuple[set[str], set[str]]:
    """(waiting, delivered): admission ids of the solve messages in ``models``' queues, and of
    those delivered to a worker and not yet acknowledged. One round trip."""
    pipe = client.pipeline(transaction=False)
    for model in sorted(models):
        pipe.lrange(keys.broker_queue(namespace, keys.model_queue(model)), 0, -1)
    pipe.hvals(keys.broker_unacked(namespace))
    *queues, unacked = pipe.execute()
    waiting = {aid for queue in queues for raw in queue if (aid := admission_of(raw)) is not None}
    delivered = {aid for raw in unacked if (aid := admission_of(raw)) is not None}
    return waiting, delivered


class LostMessages:
    """The dispatcher's check for lost solve messages (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._client: redis.Redis | None = None
        self._unlisted: set[str] = set()  # ready tasks the last look found lost: returned if this one does too

    def broker(self, services: Services) -> redis.Redis | None:
        """A client of the broker's Redis (None: the broker is not Redis)."""
        url = services.settings.broker_url
        if not url:
            return services.redis
        if not url.lower().startswith(("redis://", "rediss://", "sentinel://", "unix://")):
            return None
        if self._client is None:
            self._client = redis_client(url, check=False)
        return self._client

    def check(self, services: Services, *, now: float | None = None) -> list[tuple[int, str]]:
        """Return the lost messages' tasks to pending and withdraw their leases, at most once every
        :data:`CHECK_S`; (task id, admission id) of each. A Redis error skips this look."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._last < CHECK_S:
                return []
            self._last = now
        try:
            return self._check(services)
        except (redis.RedisError, OSError) as exc:
            log.info("could not look for lost solve messages (%s); looking again in %.0f s",
                     (str(exc).splitlines() or [""])[0], CHECK_S)
            return []

    def _check(self, services: Services) -> list[tuple[int, str]]:
        queued, ready = queued_since(services.engine, GRACE_S)
        client = self.broker(services) if queued or ready else None
        # The lists before the queues: an entry taken meanwhile is published after it left its list. The
        # queues (every message decoded) are read only for the tasks on no list, normally none or a few.
        if ready and client is not None:
            listed = ready_entries(services.redis, services.settings.namespace, {model for _, model, _ in ready})
            ready = [task for task in ready if task[0] not in listed]
        if client is None or not (queued or ready):
            self._unlisted = set()
            return []
        namespace = services.settings.namespace
        waiting, delivered = broker_messages(client, namespace, {model for _, model, _ in queued + ready})
        alive = live_calls(services.redis, namespace)
        grace = services.settings.heartbeat_seconds + GRACE_S
        returned = return_lost(services.engine, lost(queued, waiting, delivered, alive, grace))
        if returned:
            log.warning("returned %d queued task(s) to pending: the broker lost their solve messages (in no queue, "
                        "held by no live worker)", len(returned))
        # A worker that takes an entry starts its task at once, so a ready task found lost in two looks in a
        # row is: one look could fall between a worker's take and its start.
        suspects = set(lost(ready, waiting, delivered, alive, grace))
        unlisted = return_unlisted(services.engine, suspects & self._unlisted)
        self._unlisted = suspects
        if unlisted:
            log.warning("returned %d ready task(s) to pending: Redis lost their ready-list entries (on no list, in "
                        "no queue, held by no live worker)", len(unlisted))
        if returned or unlisted:
            services.core.withdraw([admission_id for _, admission_id in returned + unlisted])
        return returned + unlisted
