"""Shared HTTP plumbing for the backend clients: one pooled httpx client per
process, status-code mapping, and key-free error messages."""

from __future__ import annotations

import json
from typing import Any

import httpx

from balancer.backends.base import Permanent, RateLimited, Transient


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form), None if absent or unparseable.

    >>> parse_retry_after("2.5"), parse_retry_after(None), parse_retry_after("soon")
    (2.5, None, None)
    """
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return max(0.0, seconds)


class HttpBackend:
    """Base class: POST JSON, map failures to Transient / RateLimited / Permanent."""

    def __init__(self, base_url: str, *, timeout: float, api_key: str | None = None, max_connections: int = 1000) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def post_json(self, path: str, payload: dict[str, Any]) -> Any:
        try:
            response = self._client.post(path, json=payload)
        except httpx.TimeoutException as exc:
            raise Transient(f"timeout calling {path}: {type(exc).__name__}") from None
        except httpx.TransportError as exc:
            raise Transient(f"cannot reach backend at {path}: {type(exc).__name__}: {exc}") from None
        if response.status_code == 429:
            raise RateLimited(f"429 from {path}", parse_retry_after(response.headers.get("Retry-After")))
        if response.status_code >= 500:
            raise Transient(f"{response.status_code} from {path}: {response.text[:200]}")
        if response.status_code >= 400:
            raise Permanent(f"{response.status_code} from {path}: {response.text[:200]}")
        try:
            return response.json()
        except json.JSONDecodeError:
            raise Transient(f"malformed JSON from {path}: {response.text[:100]!r}") from None

    def close(self) -> None:
        self._client.close()


def require_int(data: Any, *path: str) -> int:
    value = data
    for key in path:
        if not isinstance(value, dict) or key not in value:
            raise Transient(f"malformed response: missing {'.'.join(path)}")
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Transient(f"malformed response: {'.'.join(path)} is not a count")
    return value
