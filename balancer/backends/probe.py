"""Whether the Models Backend's address takes connections, asked once when a process starts.

A worker started with a backend URL that refuses connections would otherwise
start without a word, and every call would fail into the circuit breaker; the
first line it prints says so instead (it still starts: the backend may come up
later). Only a TCP connection is tried: no request reaches the backend.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from balancer.urls import mask_url


def refusal(url: str, timeout: float = 2.0, grace: float = 0.0) -> str | None:
    """Why a TCP connection to ``url``'s host and port fails now (one line), or None if it opens.
    A port that refuses is tried again every 0.1 s for ``grace`` seconds: a backend started just
    before (``balancer sim &`` then ``balancer run``) is still binding its port.

    >>> import socket
    >>> with socket.socket() as s:
    ...     s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]   # bound, not listening: refused
    ...     print(refusal(f"http://127.0.0.1:{port}"))  # doctest: +ELLIPSIS
    the Models Backend at http://127.0.0.1:... refuses connections (... refused)
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    until = time.monotonic() + grace
    while True:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return None
        except ConnectionRefusedError as exc:
            if time.monotonic() < until:
                time.sleep(0.1)
                continue
            return f"the Models Backend at {mask_url(url)} refuses connections ({exc.strerror or type(exc).__name__})"
        except OSError as exc:
            return f"the Models Backend at {mask_url(url)} cannot be reached ({exc.strerror or type(exc).__name__})"
