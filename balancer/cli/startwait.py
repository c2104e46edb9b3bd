"""A long-running process's start: wait for Redis and PostgreSQL to come back.

A worker, dispatcher or beat restarted while a service is down would otherwise
exit 2 and crash-loop under its supervisor. An :class:`~balancer.errors.Unreachable`
service (refused, timed out) is waited for, with back-off and one log line per
attempt, for ``BALANCER_START_WAIT`` seconds at most; then the last error is
raised (exit 2). Anything else (a bad URL, a refused password, a bad setting)
is raised at once. A worker waits the same way, once connected, for a model's
quota that was removed (:class:`~balancer.errors.QuotaRemoved`: ``retry_on``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import click

from balancer.errors import Unreachable

T = TypeVar("T")


def backoff(attempt: int, *, first: float = 0.5, cap: float = 10.0) -> float:
    """Seconds to wait after the ``attempt``-th failed try.

    >>> [backoff(n) for n in (1, 2, 3, 6, 9)]
    [0.5, 1.0, 2.0, 10.0, 10.0]
    """
    return min(cap, first * 2 ** (attempt - 1))


def start_when_ready(start: Callable[[], T], wait_seconds: float, *,
                     retry_on: tuple[type[Exception], ...] = (Unreachable,), awaited: str = "a service",
                     sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic) -> T:
    """``start()``, tried again while it raises one of ``retry_on`` and
    ``wait_seconds`` have not passed; one line on stderr per failed attempt,
    saying what is ``awaited``."""
    until = clock() + wait_seconds
    attempt = 0
    while True:
        try:
            return start()
        except retry_on as exc:
            attempt += 1
            left = until - clock()
            if left <= 0:
                raise
            pause = min(backoff(attempt), left)
            click.echo(f"waiting for {awaited} (attempt {attempt}, retrying in {pause:.1f}s, giving up in "
                       f"{left:.0f}s): {exc}", err=True)
            sleep(pause)


def snapshot():  # noqa: ANN201 - a context manager of Snapshot, imported lazily to keep `balancer --help` fast
    """A read-only :class:`~balancer.snapshot.Snapshot` on a migrated schema (``status``): the
    embedded stack when no URL is set, as :func:`migrated`; one line when a service cannot be reached."""
    from balancer.cli import resolved_settings
    from balancer.snapshot import open_snapshot

    return open_snapshot(resolved_settings())


def migrated(*, wait: bool = False):  # noqa: ANN201 - Services, imported lazily to keep `balancer --help` fast
    """Connected services on a migrated schema. ``wait``: a long-running process's
    start, which waits for an unreachable Redis or PostgreSQL (``BALANCER_START_WAIT``)."""
    from balancer.cli import resolved_settings, services
    from balancer.storage.migrate import require_migrated

    def start():  # noqa: ANN202
        svc = services()
        require_migrated(svc.engine)
        return svc

    if not wait:
        return start()
    import balancer.services  # noqa: F401 - imported before the wait's clock starts: seconds on a loaded machine
    return start_when_ready(start, resolved_settings().start_wait)
