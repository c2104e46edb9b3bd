"""Per-process handles, made lazily (after any fork) and shared by threads."""

from __future__ import annotations

import threading

from balancer.backends import Backend, shared_backend
from balancer.calls.answers import AnswerWriter
from balancer.calls.cancellation import CancelListener
from balancer.calls.heartbeat import Heartbeat
from balancer.services import Services
from balancer.settings import Settings

_lock = threading.Lock()
_services: Services | None = None
_listener: CancelListener | None = None
_heartbeat: Heartbeat | None = None
_writer: AnswerWriter | None = None


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


def cancel_listener() -> CancelListener | None:
    """This process's listener for calls to cut off; None when hedging is off (no call is ever cancelled)."""
    global _listener
    svc = services()
    if not svc.settings.hedging:
        return None
    with _lock:
        if _listener is None:
            _listener = CancelListener(svc.redis, svc.settings.namespace)
        return _listener


def heartbeat() -> Heartbeat:
    """This process's lease heartbeat (its thread starts with the first call)."""
    global _heartbeat
    svc = services()
    with _lock:
        if _heartbeat is None:
            _heartbeat = Heartbeat(svc)
        return _heartbeat


def answer_writer() -> AnswerWriter:
    """This process's answer writer (its thread starts with the first solve)."""
    global _writer
    svc = services()
    with _lock:
        if _writer is None:
            _writer = AnswerWriter(svc.engine)
        return _writer


def warm() -> None:
    """Make the handles a solve needs before this process takes its first message: the
    services, the backend client (importing its module and building its TLS context is
    CPU work which, made lazily with every worker process starting at once, held each
    model's first calls back), the answer writer and the cancel listener. Nothing here
    calls the backend or needs PostgreSQL or Redis to answer."""
    backend()
    answer_writer()
    cancel_listener()


def reset() -> None:
    """Forget handles (after fork, or in tests that change the environment)."""
    global _services, _listener, _heartbeat, _writer
    from balancer.storage.db import dispose_engines

    with _lock:
        if _listener is not None:
            _listener.close()
        if _heartbeat is not None:
            _heartbeat.close()
        if _writer is not None:
            _writer.close()  # every answer handed to it is written first
        _services, _listener, _heartbeat, _writer = None, None, None, None
        dispose_engines()
