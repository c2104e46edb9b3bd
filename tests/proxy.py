"""A TCP proxy on loopback that can stop forwarding while keeping every socket open:
a network partition as a client meets it (no RST, no FIN, just silence), for
the tests that stall one party's PostgreSQL while the others still reach it."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from balancer.devtools.embedded import free_port


class PausableProxy:
    """Forwards ``127.0.0.1:port`` to ``target``; :meth:`pause` holds every byte
    (both ways, on open and new connections alike) until :meth:`resume`."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._started = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, name="pausable-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the proxy did not start")

    def pause(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.set)

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        self.resume()
        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._flowing.set()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._started.set()
        self._loop.run_forever()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        pumps = [asyncio.ensure_future(self._pump(client_reader, upstream_writer)),
                 asyncio.ensure_future(self._pump(upstream_reader, client_writer))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # the proxy is closing
        finally:
            for pump in pumps:
                pump.cancel()
            for writer in (client_writer, upstream_writer):
                writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await self._flowing.wait()
            data = await reader.read(65536)
            if not data:
                return
            await self._flowing.wait()  # bytes read just before a pause wait for the resume
            writer.write(data)
            await writer.drain()
