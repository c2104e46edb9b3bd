"""Per-process handles, made lazily (after any fork) and shared by threads."""

from __future__ import annotations

import threading

from balancer.backends import Backend, shared_backend
from balancer.services import Services
from balancer.settings import Settings

_lock = threading.Lock()
_services: Services | None = None


def services() -> Services:
    global _services
    with _lock:
        if _services is None:
            # No pre-ping: a dead pooled connection fails the statement, and every
            # write on the solve path is retried (solver.with_db_retry).
            _services = Services.connect(Settings.from_env(), check=False, pre_ping=False)
        return _services


def backend() -> Backend:
    return shared_backend(services().settings)


def reset() -> None:
    """Forget handles (after fork, or in tests that change the environment)."""
    global _services
    from balancer.storage.db import dispose_engines

    with _lock:
        _services = None
        dispose_engines()
