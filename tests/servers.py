"""Serve an ASGI app on a free loopback port in a thread, for tests that talk HTTP to it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from balancer.devtools.embedded import free_port


@contextlib.contextmanager
def served(app: Any, configure: Callable[..., uvicorn.Config] = uvicorn.Config, **options: Any) -> Iterator[str]:
    """``app`` on ``http://127.0.0.1:<port>`` until the block ends; yields the URL.
    ``configure(app, host=, port=, **options)`` builds the server's configuration."""
    port = free_port()
    server = uvicorn.Server(configure(app, host="127.0.0.1", port=port, log_level="warning", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
