"""Cut off one backend call in flight, from another thread.

A hedged task has two calls; when one answers, the other is cancelled: its
HTTP request is closed, so the worker thread stops waiting at once and the
backend sees the client go. httpx has no public way to abort a blocking
request from outside, so the client's connection pool gets a network backend
that remembers, for the thread making a call, the socket that call is using;
:meth:`CallHandle.cancel` shuts that socket down. The blocked read then ends
and :class:`~balancer.backends.http.HttpBackend` raises
:class:`~balancer.backends.base.Cancelled` instead of a transient error.

The same cut enforces a call's *total* time: httpx bounds each read, so a
backend that trickles a byte a second could hold a call for ever.
:func:`cut_at` has one watchdog thread cut the call at its deadline
(``reason == "deadline"``), and the caller reports a timeout.

>>> with cancellable() as call:
...     call.cancel()          # before the request is sent: it is cut at its first write
...     call.cancelled, call.reason
(True, 'cancelled')
>>> current() is None          # outside the block, calls are not cancellable
True
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import ssl
import threading
import time
import typing
from collections.abc import Iterator

import httpcore

_local = threading.local()


class CallHandle:
    """One call that another thread may cancel; safe to cancel before, during or after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._cut = threading.Event()
        self.cancelled = False
        self.reason = ""  # "cancelled" (the task's other call answered) or "deadline" (out of time)

    def cancel(self, reason: str = "cancelled") -> None:
        with self._lock:
            if not self.cancelled:
                self.cancelled, self.reason = True, reason
            self._shut(self._sock)
        self._cut.set()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``, ending early if the call is cancelled; whether it was."""
        return self._cut.wait(seconds)

    def attach(self, sock: socket.socket | None) -> None:
        """The call's bytes now go through ``sock`` (cut it at once if already cancelled)."""
        with self._lock:
            self._sock = sock
            if self.cancelled:
                self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket | None) -> None:
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed by the pool: nothing to cut
                sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def cancellable() -> Iterator[CallHandle]:
    """Make the calls this thread sends inside the block cancellable through the handle."""
    handle = CallHandle()
    previous = current()
    _local.handle = handle
    try:
        yield handle
    finally:
        _local.handle = previous


def current() -> CallHandle | None:
    """The handle of the call this thread is making, if it is cancellable."""
    return getattr(_local, "handle", None)


class _Watchdog:
    """One thread that cuts calls at their deadlines (a heap, not a timer thread per call)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, CallHandle]] = []
        self._done: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, handle: CallHandle, deadline: float) -> int:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():  # also after a fork
                self._thread = threading.Thread(target=self._run, name="call-deadlines", daemon=True)
                self._thread.start()
            key = next(self._ids)
            heapq.heappush(self._heap, (deadline, key, handle))
            self._cond.notify()
            return key

    def unwatch(self, key: int) -> None:
        with self._cond:
            self._done.add(key)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] in self._done:
                    self._done.discard(heapq.heappop(self._heap)[1])
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                _, key, handle = heapq.heappop(self._heap)
                handle.cancel("deadline")


_watchdog = _Watchdog()


@contextlib.contextmanager
def cut_at(deadline: float) -> Iterator[CallHandle]:
    """The calls this thread makes inside the block are cut at ``deadline``
    (``time.monotonic()``); a cancellable block's handle is reused, so a hedge's
    cancel and the deadline cut the same call."""
    outer = current()
    with contextlib.ExitStack() as stack:
        handle = outer if outer is not None else stack.enter_context(cancellable())
        key = _watchdog.watch(handle, deadline)
        try:
            yield handle
        finally:
            _watchdog.unwatch(key)


class _TrackedStream(httpcore.NetworkStream):
    """A connection's stream that tells the calling thread's handle which socket it uses."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def _attach(self) -> None:
        handle = current()
        if handle is not None:
            handle.attach(self._stream.get_extra_info("socket"))

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._attach()
        return self._stream.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._attach()
        self._stream.write(buffer, timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        return _TrackedStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> typing.Any:
        return self._stream.get_extra_info(info)


class _TrackingBackend(httpcore.SyncBackend):
    def connect_tcp(self, *args: typing.Any, **kwargs: typing.Any) -> httpcore.NetworkStream:
        return _TrackedStream(super().connect_tcp(*args, **kwargs))

    def connect_unix_socket(self, *args: typing.Any, **kwargs: typing.Any) -> httpcore.NetworkStream:
        return _TrackedStream(super().connect_unix_socket(*args, **kwargs))


def make_cancellable(pool: object) -> None:
    """Give an httpx transport's httpcore pool the tracking network backend.

    One private attribute is set (httpcore builds every connection with
    ``pool._network_backend``); everything else (limits, TLS, timeouts) stays
    as httpx configured it. Fails loudly if httpcore ever renames it.
    """
    if not isinstance(getattr(pool, "_network_backend", None), httpcore.NetworkBackend):
        raise RuntimeError("this httpcore version has no ConnectionPool._network_backend: calls cannot be cancelled")
    pool._network_backend = _TrackingBackend()  # type: ignore[attr-defined]
