"""Cut off one backend call in flight, from another thread.

A hedged task has two calls; when one answers, the other is cancelled: its
HTTP request is closed, so the worker thread stops waiting at once and the
backend sees the client go. httpx has no public way to abort a blocking
request from outside, so the client's connection pool gets a network backend
that remembers, for the thread making a call, the socket that call is using;
:meth:`CallHandle.cancel` shuts that socket down. The blocked read then ends
and :class:`~balancer.backends.http.HttpBackend` raises
:class:`~balancer.backends.base.Cancelled` instead of a transient error.

>>> with cancellable() as call:
...     call.cancel()          # before the request is sent: it is cut at its first write
...     call.cancelled
True
>>> current() is None          # outside the block, calls are not cancellable
True
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import typing
from collections.abc import Iterator

import httpcore

_local = threading.local()


class CallHandle:
    """One call that another thread may cancel; safe to cancel before, during or after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            self._shut(self._sock)

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
