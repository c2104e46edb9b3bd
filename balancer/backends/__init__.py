"""Backend clients, chosen by ``BALANCER_BACKEND_KIND``; one per process."""

from __future__ import annotations

import threading

from balancer.backends.base import Backend, BackendError, Cancelled, Completion, Permanent, RateLimited, Transient
from balancer.settings import Settings

_lock = threading.Lock()
_shared: dict[tuple, Backend] = {}


def make_backend(settings: Settings) -> Backend:
    if settings.backend_kind == "openai":
        from balancer.backends.openai import OpenAIBackend

        return OpenAIBackend(settings.backend_url, timeout=settings.backend_timeout, api_key=settings.backend_api_key)
    from balancer.backends.models_backend import ModelsBackend

    return ModelsBackend(settings.backend_url, timeout=settings.backend_timeout, api_key=settings.backend_api_key)


def shared_backend(settings: Settings) -> Backend:
    """One pooled client per process (and per configuration), shared by all worker threads."""
    key = (settings.backend_kind, settings.backend_url, settings.backend_timeout, settings.backend_api_key)
    with _lock:
        if key not in _shared:
            _shared[key] = make_backend(settings)
        return _shared[key]


__all__ = ["Backend", "BackendError", "Cancelled", "Completion", "Permanent", "RateLimited", "Transient", "make_backend", "shared_backend"]
