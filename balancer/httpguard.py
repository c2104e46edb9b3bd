"""The guards the router, the console and the metrics exporter share, as plain ASGI (no FastAPI, no Starlette):
who may be served without a token (:func:`is_loopback`), how large a body may be
(:class:`BodyLimit`), and which ``Host`` and ``Origin`` a request may name (:class:`HostNames`,
:class:`HostGuard`).

**DNS rebinding.** A page on another site can make its own name resolve to
127.0.0.1; the browser then sends that page's requests to a server on loopback,
as same-origin requests, with ``Host: the-other-site``. A server that answers any
``Host`` lets that page read it and post to it (a token-less console on loopback
above all). :class:`HostGuard` answers only requests whose ``Host`` names the
address it is bound to (:func:`allowed_names`: for a loopback bind, ``localhost``
and loopback addresses; for a wildcard bind, any address literal and this
machine's names) or a name given with ``--allow-host``; and refuses a POST (or any
change) whose ``Origin`` names any other. Clients that send no ``Origin``
(scripts, ``RouterClient``) are not browsers and are let through.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Larger request bodies get a 413 before they are parsed (the router's and the console's).
MAX_BODY_BYTES = 16 * 1024
#: Seconds a client has to send a whole request (head and body), from the connection's opening
#: or the first byte of the request; then the connection is closed (the router, the console
#: and the metrics exporter, each on its own server: balancer.router.server, balancer.views.metrics).
READ_TIMEOUT_S = 10.0
#: Methods that change something: their ``Origin``, when sent, must be one of ours.
CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})  # noqa: S104 - names of the wildcard bind, compared, not bound


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only.

    >>> [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.0.0.5")]
    [True, True, True, False, False]
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def host_name(value: str) -> str:
    """The name in a ``Host`` header or an origin's netloc, without its port, lower case.

    >>> host_name("LocalHost:8800"), host_name("[::1]:8700"), host_name("10.0.0.5"), host_name("a.example.:80")
    ('localhost', '::1', '10.0.0.5', 'a.example')
    """
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def allowed_names(bound: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The ``Host`` names a server bound to ``bound`` answers to (address literals are
    checked apart, by :meth:`HostNames.allows`).

    >>> sorted(allowed_names("127.0.0.1", ["console.example"]))
    ['127.0.0.1', 'console.example', 'localhost']
    """
    names = {host_name(bound), *(host_name(name) for name in extra)}
    if is_loopback(bound) or bound in WILDCARDS:
        names.add("localhost")
    if bound in WILDCARDS:
        names.update(n.lower() for n in (socket.gethostname(), socket.getfqdn()) if n)
    return frozenset(names - {""})


class HostNames:
    """The names a server bound to ``bound`` answers to: the rule :class:`HostGuard` applies
    (and the metrics exporter, a WSGI app)."""

    def __init__(self, bound: str, extra: Iterable[str] = ()) -> None:
        self.bound = bound
        self.names = allowed_names(bound, extra)

    def allows(self, name: str) -> bool:
        """``name`` is one of ours: a listed name, or an address literal that reaches this bind
        (a loopback bind: a loopback address; a wildcard bind: any address; else the bound one).

        >>> ours = HostNames("127.0.0.1")
        >>> [ours.allows(n) for n in ("localhost", "127.0.0.1", "::1", "rebind.attacker.example", "10.0.0.5")]
        [True, True, True, False, False]
        >>> HostNames("0.0.0.0").allows("192.168.1.9"), HostNames("10.0.0.5").allows("10.0.0.6")
        (True, False)
        """
        if name in self.names:
            return True
        address = _address(name)
        if address is None:
            return False
        if self.bound in WILDCARDS:
            return True
        return address.is_loopback and is_loopback(self.bound)


class HostGuard:
    """Answer only requests whose ``Host`` (and, on a change, ``Origin``) names this server."""

    def __init__(self, app: ASGIApp, bound: str, extra: Iterable[str] = ()) -> None:
        self.app = app
        self.hosts = HostNames(bound, extra)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            host = headers.get(b"host")
            if host is not None and not self.hosts.allows(host_name(host.decode("latin-1"))):
                await problem(send, 400, "this server does not answer to that Host name (start it with --allow-host "
                                         "NAME to serve it under a name of its own)")
                return
            origin = headers.get(b"origin")
            if origin is not None and scope.get("method", "GET") in CHANGING and not self._our_origin(origin):
                await problem(send, 403, "a change from a page of another origin is refused")
                return
        await self.app(scope, receive, send)

    def _our_origin(self, origin: bytes) -> bool:
        parts = urlsplit(origin.decode("latin-1"))
        return parts.scheme in ("http", "https") and bool(parts.netloc) and self.hosts.allows(host_name(parts.netloc))


async def problem(send: Send, status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Answer ``{"detail": ...}`` (ASCII JSON) with ``status``."""
    body = json.dumps({"detail": detail}, ensure_ascii=True, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with a 413, whether declared or streamed.

    The body (small by design) is read here in full, then replayed to the app."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await problem(send, 413, f"request body over {self.limit} bytes")
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if len(body) > self.limit:
                await problem(send, 413, f"request body over {self.limit} bytes")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
