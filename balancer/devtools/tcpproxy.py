"""A loopback TCP proxy that can stall: a network partition with the sockets left open.

The chaos run (``balancer.bench.chaos.run``) puts one in front of the workers'
PostgreSQL alone. :meth:`StallProxy.stall` stops forwarding in both directions
without closing anything: the clients' writes sit in buffers, their reads wait,
exactly as across a partition that drops packets. :meth:`StallProxy.resume`
forwards again, what was held back included. The proxy runs its own asyncio
loop in a daemon thread and listens on 127.0.0.1 unless told otherwise (the
real-hosts test listens on its network namespaces' bridge, so that they reach
this machine's PostgreSQL, which listens on loopback or a socket only).

Its target is a TCP address or a Unix socket: :meth:`StallProxy.for_database`
fronts a PostgreSQL URL of either kind (the embedded PostgreSQL listens on a
socket only), and :meth:`StallProxy.database_url` is the URL that goes through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

from sqlalchemy.engine import make_url

#: Bytes read from one side per step.
CHUNK = 65536


def database_target(url: str) -> tuple[str, int] | str:
    """Where a PostgreSQL URL connects: its Unix socket's path, or its host and port.

    >>> database_target("postgresql://postgres:@/balancer?host=/tmp/x/pg")
    '/tmp/x/pg/.s.PGSQL.5432'
    >>> database_target("postgresql://postgres@db:6432/test")
    ('db', 6432)
    """
    parsed = make_url(url)
    socket_dir = parsed.query.get("host")
    if isinstance(socket_dir, str) and socket_dir.startswith("/"):
        return os.path.join(socket_dir, f".s.PGSQL.{parsed.port or 5432}")
    return parsed.host or "127.0.0.1", parsed.port or 5432


class StallProxy:
    """Forward ``host``:``port`` (127.0.0.1 unless given) to ``target`` (host and port, or a Unix
    socket's path) until :meth:`close`."""

    def __init__(self, target: tuple[str, int] | str, port: int = 0, host: str = "127.0.0.1") -> None:
        self.target, self.host = target, host
        self._requested_port = port
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()  # set: forwarding; clear: stalled
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-proxy", daemon=True)
        self.port = 0
        self.connections = 0

    @classmethod
    def for_database(cls, url: str, port: int = 0, host: str = "127.0.0.1") -> StallProxy:
        """A proxy (not started) in front of the PostgreSQL that ``url`` names."""
        return cls(database_target(url), port, host)

    def database_url(self, url: str) -> str:
        """``url`` through this proxy: its address and port, over TCP.

        >>> StallProxy("/tmp/s", port=0).database_url("postgresql://postgres:@/balancer?host=/tmp/x/pg")
        'postgresql://postgres:@127.0.0.1:0/balancer'
        """
        parsed = make_url(url).difference_update_query(["host"])
        return parsed.set(host=self.host, port=self.port or self._requested_port).render_as_string(hide_password=False)

    def start(self) -> StallProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the TCP proxy did not start within 10 s")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self) -> None:
        self._open.set()
        self._server = await asyncio.start_server(self._accept, self.host, self._requested_port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._open.wait()  # a new connection during a stall hangs too
        try:
            if isinstance(self.target, str):
                up_reader, up_writer = await asyncio.open_unix_connection(self.target)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        self._writers.difference_update((writer, up_writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                await self._open.wait()  # stalled: hold the bytes, keep the socket
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                await self._open.wait()  # a close crosses a partition no sooner than the bytes before it
                writer.close()

    def stall(self) -> None:
        """Stop forwarding; every socket stays open."""
        self._loop.call_soon_threadsafe(self._open.clear)

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    @property
    def stalled(self) -> bool:
        return not self._open.is_set()

    def close(self) -> None:
        """Stop listening and close every connection (forwarding resumes first, so nothing waits forever)."""
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            self._open.set()
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
