"""Shared HTTP plumbing for the backend clients: pooled httpx clients (one per
model) shared by a process's threads, status-code mapping, and key-free error
messages."""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import httpx

from balancer.backends.base import Cancelled, Permanent, RateLimited, Remaining, Transient
from balancer.backends.cancel import cut_at, make_cancellable
from balancer.urls import mask_url


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return max(0.0, number) if math.isfinite(number) else None


def parse_retry_after(value: str | None, value_ms: str | None = None) -> float | None:
    """Seconds from ``retry-after-ms`` (Azure) or else ``Retry-After`` (delta-seconds
    form); None if absent or unparseable.

    >>> parse_retry_after("2.5"), parse_retry_after(None), parse_retry_after("soon")
    (2.5, None, None)
    >>> parse_retry_after("3", "250")
    0.25
    """
    ms = _number(value_ms)
    return ms / 1000 if ms is not None else _number(value)


def parse_remaining(headers: httpx.Headers) -> Remaining:
    """The provider's ``x-ratelimit-remaining-tokens`` / ``-requests``, and its
    ``x-ratelimit-limit-tokens`` / ``-requests``, when sent.

    >>> parse_remaining(httpx.Headers({"x-ratelimit-remaining-tokens": "8000"}))
    Remaining(tokens=8000, requests=None, limit_tokens=None, limit_requests=None)
    """
    def whole(name: str) -> int | None:
        value = _number(headers.get(name))
        return None if value is None else int(value)

    return Remaining(whole("x-ratelimit-remaining-tokens"), whole("x-ratelimit-remaining-requests"),
                     whole("x-ratelimit-limit-tokens"), whole("x-ratelimit-limit-requests"))


class HttpBackend:
    """Base class: POST JSON, map failures to Transient / RateLimited / Permanent.

    One pooled client per model (the payload's ``model``), made on its first
    call: httpcore serves every request of a pool under one lock, and scans
    all the pool's connections while holding it. With every model's threads
    on one pool (about 120 in one worker process), they queued for that lock
    between every two calls; per model, a pool holds at most the model's
    concurrency cap of connections."""

    def __init__(self, base_url: str, *, timeout: float, api_key: str | None = None, max_connections: int = 1000) -> None:
        self.timeout = timeout  # total time of one call, from its start to the last byte of the answer
        self._base_url, self._max_connections = base_url, max_connections
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients: dict[str, httpx.Client] = {}
        self._urls: dict[str, httpx.URL] = {}
        self._lock = threading.Lock()
        # One TLS context for every model's client: httpx builds one per client
        # otherwise (46 ms of CPU each, loading the CA bundle), under the lock
        # above, on the first call of each model. At the start of a run that held
        # every first call back for up to a second, past its start gate, and they
        # then reached the provider together (429s on RPM checked over 1 s).
        self._tls = httpx.create_ssl_context()

    def _client(self, model: str) -> httpx.Client:
        client = self._clients.get(model)
        if client is None:
            with self._lock:
                client = self._clients.get(model)
                if client is None:
                    client = self._clients[model] = self._new_client()
        return client

    def _url(self, path: str) -> httpx.URL:
        """``path`` under the base URL, as httpx would merge it, made once: given an
        absolute URL, httpx skips that merge (a parse and a copy, 60 of the 95 µs
        of CPU its ``build_request`` took per call).

        >>> HttpBackend("http://backend:8000/api", timeout=1)._url("/single")
        URL('http://backend:8000/api/single')
        """
        url = self._urls.get(path)
        if url is None:
            base = httpx.URL(self._base_url)
            base = base.copy_with(raw_path=base.raw_path.rstrip(b"/") + b"/")  # as httpx.Client keeps its base_url
            url = self._urls[path] = base.join(path.lstrip("/"))
        return url

    def _new_client(self) -> httpx.Client:
        limits = httpx.Limits(max_connections=self._max_connections, max_keepalive_connections=self._max_connections)
        transport = httpx.HTTPTransport(verify=self._tls, limits=limits)
        make_cancellable(transport._pool)  # a call made inside cancel.cancellable() can be cut off
        timeout = httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0))
        return httpx.Client(base_url=self._base_url, headers=self._headers, timeout=timeout, transport=transport,
                            verify=self._tls)

    def post_json(self, path: str, payload: dict[str, Any]) -> tuple[Any, Remaining]:
        """The reply's JSON and the provider's remaining quota from its headers.

        The whole call, answer included, ends within ``timeout`` seconds: httpx
        bounds each read only, so a watchdog cuts a call still going at its
        deadline (:func:`~balancer.backends.cancel.cut_at`)."""
        with cut_at(time.monotonic() + self.timeout) as handle:
            try:
                response = self._client(str(payload.get("model", ""))).post(self._url(path), json=payload)
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                # Never connected (or waited for a pooled connection): the request was not sent.
                ended = "unsent" if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)) \
                    else "cut_off"
                if handle.reason == "deadline" or isinstance(exc, httpx.TimeoutException):
                    raise Transient(f"timeout calling {path}: no complete answer within {self.timeout:g}s "
                                    f"({type(exc).__name__})", ended=ended) from None
                if handle.cancelled:
                    raise Cancelled(f"call to {path} cancelled: the task was answered by its other call") from None
                raise Transient(f"cannot reach backend at {mask_url(str(self._url(path)))}: {type(exc).__name__}: {exc}",
                                ended=ended) from None
        if response.status_code == 429:
            retry_after = parse_retry_after(response.headers.get("Retry-After"), response.headers.get("retry-after-ms"))
            raise RateLimited(f"429 from {path}", retry_after, parse_remaining(response.headers))
        if response.status_code >= 500:
            raise Transient(f"{response.status_code} from {path}: {response.text[:200]}", ended="refused")
        if response.status_code >= 400:
            raise Permanent(f"{response.status_code} from {path}: {response.text[:200]}")
        try:
            return response.json(), parse_remaining(response.headers)
        except json.JSONDecodeError:
            raise Transient(f"malformed JSON from {path}: {response.text[:100]!r}") from None

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def require_int(data: Any, *path: str) -> int:
    value = data
    for key in path:
        if not isinstance(value, dict) or key not in value:
            raise Transient(f"malformed response: missing {'.'.join(path)}")
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Transient(f"malformed response: {'.'.join(path)} is not a count")
    return value
