"""Serving the router with uvicorn: every request must arrive whole within a deadline.

uvicorn's own ``timeout_keep_alive`` covers only the idle time after a
response, and any byte received cancels it: a client that opens a connection
and sends nothing, or trickles its headers or body a byte at a time, holds
the connection for ever. :class:`DeadlineProtocol` arms a timer when a
connection opens and when each request begins, cancels it once the request's
head and body are read, and closes the connection if it fires first. The time
the app takes to answer is not counted.

:func:`listening_sockets` binds the port before a command says it serves, so a port
in use is one line, not a success line followed by uvicorn's error (the simulator
binds through it too).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from balancer.errors import BalancerError, printable
from balancer.httpguard import READ_TIMEOUT_S

#: Seconds an idle keep-alive connection stays open after a response.
KEEP_ALIVE_S = 5
#: Connections the servers' sockets queue before they are accepted.
BACKLOG = 4096


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on reading each request."""

    read_timeout_s = READ_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _too_slow(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection that did not send its request within %g s", self.read_timeout_s)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()


def protocol(read_timeout_s: float = READ_TIMEOUT_S) -> type[DeadlineProtocol]:
    """:class:`DeadlineProtocol` with another deadline (tests use a short one)."""
    return type("DeadlineProtocol", (DeadlineProtocol,), {"read_timeout_s": read_timeout_s})


def config(app: Any, host: str, port: int, *, read_timeout_s: float = READ_TIMEOUT_S, **options: Any) -> uvicorn.Config:
    """The uvicorn configuration the router is served with (``balancer router``, the benchmark, the tests)."""
    # proxy_headers off: uvicorn would otherwise take X-Forwarded-For from a loopback client as the
    # caller's address, and the router keys an idempotency record by that address.
    return uvicorn.Config(app, host=host, port=port, http=protocol(read_timeout_s), timeout_keep_alive=KEEP_ALIVE_S,
                          backlog=BACKLOG, proxy_headers=False, **options)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets listening on ``port`` at every address ``host`` resolves to ("": every
    interface), as asyncio's ``create_server`` binds them (an IPv6 one for IPv6 only), for
    uvicorn to serve on: a port in use, or an address this machine does not have, is a
    :class:`BalancerError` (one line).

    >>> [taken] = listening_sockets("127.0.0.1", 0)
    >>> listening_sockets("127.0.0.1", taken.getsockname()[1])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    balancer.errors.BalancerError: cannot listen on 127.0.0.1:...: Address already in use
    >>> taken.close()
    """
    sockets: list[socket.socket] = []
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, True)
            sock.bind(address)
            sock.listen(BACKLOG)  # bound but not listening, a second server could still bind the port
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise BalancerError(f"cannot listen on {printable(host)}:{port}: {exc.strerror or exc}") from None
    return sockets


def serve(app: Any, host: str, port: int, *, sockets: list[socket.socket] | None = None, **options: Any) -> None:
    """Serve ``app`` until interrupted, on ``sockets`` (:func:`listening_sockets`) or sockets bound here."""
    sockets = sockets if sockets is not None else listening_sockets(host, port)
    uvicorn.Server(config(app, host, port, **options)).run(sockets=sockets)
