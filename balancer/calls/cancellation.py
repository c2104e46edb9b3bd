"""Cut off the losing call of a hedged task, in whichever worker process runs it.

The call that answers first writes the task (the admission-id guard makes
that happen once) and learns the admission id of the task's other call. It
publishes that id on the namespace's cancel channel
(:func:`balancer.admission.keys.cancel_channel`). Every worker process that
makes hedge-able calls keeps one :class:`CancelListener`: a thread subscribed
to the channel, and the handles of the calls this process has on the wire
on models whose provider stops a call when its client goes
(``Quota.on_disconnect == "stop"``; on the others a cut-off call would still
hold its provider slot, so it runs to its end). When it hears an id it holds,
it cancels that call (:mod:`balancer.backends.cancel` closes its HTTP
request) and the solver frees its slot. A first call waiting at its model's
start gate is held too, on any model: cancelled there, it is never sent
(:meth:`balancer.calls.call.Call.after_gate`).

A cancel is a courtesy, not a guarantee: one that arrives before its call
started, or while the listener is reconnecting, is lost, and the call simply
runs to its end; its answer is then a duplicate and never written. A call not
yet sent can ask :func:`was_cancelled`: the publish leaves a key behind
(:func:`balancer.admission.keys.cancelled_call`) for :data:`CANCELLED_KEPT_MS`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import redis

from balancer.admission import keys
from balancer.backends.cancel import CallHandle, cancellable

log = logging.getLogger(__name__)

#: How long a listener waits for one message before checking it should still run (seconds).
POLL_SECONDS = 1.0
#: How long a cancel's key is kept: longer than any start gate's wait (one interval of a request limit).
CANCELLED_KEPT_MS = 10 * 60_000


def cancel_call(client: redis.Redis, namespace: str, admission_id: str) -> int:
    """Ask every worker process to cut off the call under ``admission_id``, and leave the
    request behind for a call not yet listening (:func:`was_cancelled`).

    Returns how many processes listen (the process making the call is one of
    them while it runs)."""
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.cancelled_call(namespace, admission_id), 1, px=CANCELLED_KEPT_MS)
    pipe.publish(keys.cancel_channel(namespace), admission_id)
    return int(pipe.execute()[1])


def was_cancelled(client: redis.Redis, namespace: str, admission_id: str) -> bool:
    """Whether the call under ``admission_id`` was cancelled in the last :data:`CANCELLED_KEPT_MS`."""
    return bool(client.exists(keys.cancelled_call(namespace, admission_id)))


class CancelListener:
    """One per worker process: cancels this process's calls named on the cancel channel."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self._client = client
        self._channel = keys.cancel_channel(namespace)
        self._calls: dict[str, CallHandle] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._subscribed = threading.Event()
        self._stop = threading.Event()

    @contextlib.contextmanager
    def watch(self, admission_id: str) -> Iterator[CallHandle]:
        """Make the call this thread sends inside the block cancellable under ``admission_id``."""
        self._start()
        with cancellable() as handle:
            with self._lock:
                self._calls[admission_id] = handle
            try:
                yield handle
            finally:
                with self._lock:
                    self._calls.pop(admission_id, None)

    def cancel(self, admission_id: str) -> bool:
        """Cancel one of this process's calls; False if it has none under that id."""
        with self._lock:
            handle = self._calls.get(admission_id)
        if handle is None:
            return False
        handle.cancel()
        log.info("cancelled call %s: its task was answered by its other call", admission_id)
        return True

    def close(self) -> None:
        """Stop listening (waits up to one poll for the thread to end)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(POLL_SECONDS + 1)

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._subscribed.clear()
            self._thread = threading.Thread(target=self._run, name="cancel-listener", daemon=True)
            self._thread.start()
        self._subscribed.wait(timeout=2.0)  # a cancel published before the subscription would be lost

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._channel)
                self._subscribed.set()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=POLL_SECONDS)
                    if message is not None and message["type"] == "message":
                        self.cancel(message["data"].decode())
                pubsub.close()
            except (redis.RedisError, OSError, ValueError) as exc:  # keep listening through a Redis blip
                if self._stop.is_set():
                    return
                log.warning("cancel listener lost Redis, resubscribing: %s", (str(exc).splitlines() or [""])[0])
                self._stop.wait(1.0)
