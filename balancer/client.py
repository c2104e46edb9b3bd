"""A Python client for the router (``balancer router``), sync and async.

The seed's flow in one ``with``: schedule (sleeping ``wait_for_ms`` between
tries), heartbeat in the background while the caller calls the Models
Backend, complete on exit with the actual tokens if the caller set them::

    client = RouterClient("http://127.0.0.1:8700")
    with client.slot(estimated_tokens=1_800) as slot:
        answer = call_models_backend(slot.model, prompt)        # your own call
        slot.actual_tokens = answer.prompt_tokens + answer.completion_tokens

    async with AsyncRouterClient(url) as client:
        async with client.slot(1_800, models=["gpt-a"]) as slot:
            ...

Each logical ``/schedule`` carries an ``Idempotency-Key`` of its own
(:func:`idempotency_key`), sent again on its retries (a read timeout, a 5xx,
a 409 while the first try is still being answered), so a retry gets the same
admission instead of holding a second slot.

A slot whose heartbeat comes back ``not_found`` (the lease expired, e.g.
after a long stall) is marked ``slot.lost``; the call in flight goes on, and
the caller may treat the quota as not held any more.

Only ``httpx`` is needed: this module imports nothing else from balancer, so
an Airflow worker can use it without the pipeline's dependencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

#: Retries of a request that got no answer (connection refused, timeout), a 5xx or a 409, with back-off.
RETRIES = 5


class RouterError(Exception):
    """The router refused a request (4xx): the message is its ``detail``."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"router answered {status}: {detail}")
        self.status, self.detail = status, detail


@dataclass
class Slot:
    """One admission: call ``model`` now; set ``actual_tokens`` before the block ends."""

    model: str
    admission_id: str
    lease_ms: int
    actual_tokens: int | None = None
    lost: bool = False  # a heartbeat found the lease gone


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def idempotency_key() -> str:
    """A fresh ``Idempotency-Key``: one per logical ``/schedule``."""
    return secrets.token_urlsafe(24)


def _schedule_body(estimated_tokens: int, models: Sequence[str] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"estimated_tokens": estimated_tokens}
    if models:
        body["models"] = list(models)
    return body


def _complete_body(slot: Slot) -> dict[str, Any]:
    body: dict[str, Any] = {"admission_id": slot.admission_id}
    if slot.actual_tokens is not None:
        body["actual_tokens"] = slot.actual_tokens
    return body


def _slot_or_pause(reply: dict[str, Any], give_up: float | None, estimated_tokens: int) -> Slot | float:
    """A ``/schedule`` reply as the slot it grants, or the seconds to sleep before asking again."""
    if "admission_id" in reply:
        return Slot(reply["model_backend_id"], reply["admission_id"], int(reply["lease_ms"]))
    pause = float(reply["wait_for_ms"]) / 1000
    if give_up is not None and time.monotonic() + pause > give_up:
        raise TimeoutError(f"no slot for {estimated_tokens} tokens before the timeout")
    return pause


def _json(response: httpx.Response) -> Any:
    """The body of a 2xx; :class:`RouterError` for a 4xx."""
    if response.is_success:
        return response.json()
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    raise RouterError(response.status_code, detail)


def _retryable(exc: Exception) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, RouterError) and (exc.status >= 500 or exc.status == 409)


def _backoff(attempt: int) -> float:
    return min(5.0, 0.2 * 2**attempt)


def _heartbeat_every(slot: Slot) -> float:
    """A third of the lease: two heartbeats may be lost before the slot is."""
    return max(0.05, slot.lease_ms / 3000)


class RouterClient:
    """Blocking client; thread-safe (one ``httpx.Client`` and its pool)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8700", *, token: str | None = None, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._http = httpx.Client(base_url=base_url, headers=_headers(token), timeout=timeout, transport=transport)

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              headers: dict[str, str] | None = None) -> Any:
        for attempt in range(RETRIES + 1):
            try:
                return _json(self._http.request(method, path, json=body, headers=headers))
            except (httpx.TransportError, RouterError) as exc:
                if not _retryable(exc) or attempt == RETRIES:
                    raise
                time.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    def schedule(self, estimated_tokens: int, models: Sequence[str] | None = None, key: str | None = None) -> dict[str, Any]:
        """One ``/schedule``: ``{"model_backend_id", "admission_id", ...}`` or ``{"wait_for_ms"}``.
        Retried under one ``Idempotency-Key`` (``key``, or a fresh one)."""
        headers = {"Idempotency-Key": key or idempotency_key()}
        return dict(self._call("POST", "/schedule", _schedule_body(estimated_tokens, models), headers))

    def acquire(self, estimated_tokens: int, models: Sequence[str] | None = None, timeout: float | None = None) -> Slot:
        """Schedule until admitted, sleeping each ``wait_for_ms``; TimeoutError after ``timeout`` seconds."""
        give_up = None if timeout is None else time.monotonic() + timeout
        key = idempotency_key()  # one logical schedule: a wait answer frees the key for the next try
        while True:
            admitted = _slot_or_pause(self.schedule(estimated_tokens, models, key), give_up, estimated_tokens)
            if isinstance(admitted, Slot):
                return admitted
            time.sleep(admitted)

    def heartbeat(self, admission_id: str) -> bool:
        """Extend the lease; False if it is gone (expired or completed)."""
        return bool(self._call("POST", "/heartbeat", {"admission_id": admission_id})["ok"])

    def complete(self, slot: Slot) -> bool:
        """Free the slot, settling ``slot.actual_tokens``; True if this call released it."""
        return bool(self._call("POST", "/complete", _complete_body(slot))["released"])

    def advice(self) -> dict[str, Any]:
        return dict(self._call("GET", "/advice"))

    @contextlib.contextmanager
    def slot(self, estimated_tokens: int, models: Sequence[str] | None = None,
             timeout: float | None = None) -> Iterator[Slot]:
        """Acquire a slot, heartbeat it in a background thread, complete it on exit (even on error)."""
        slot = self.acquire(estimated_tokens, models, timeout)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(_heartbeat_every(slot)):
                with contextlib.suppress(httpx.TransportError, RouterError):  # the next beat tries again
                    if not self.heartbeat(slot.admission_id):
                        slot.lost = True
                        return

        beater = threading.Thread(target=beat, name=f"heartbeat-{slot.model}", daemon=True)
        beater.start()
        try:
            yield slot
        finally:
            stop.set()
            beater.join()
            self.complete(slot)


class AsyncRouterClient:
    """The same client for asyncio: ``async with client.slot(...)``."""

    def __init__(self, base_url: str = "http://127.0.0.1:8700", *, token: str | None = None, timeout: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(token), timeout=timeout, transport=transport)

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
                    headers: dict[str, str] | None = None) -> Any:
        for attempt in range(RETRIES + 1):
            try:
                return _json(await self._http.request(method, path, json=body, headers=headers))
            except (httpx.TransportError, RouterError) as exc:
                if not _retryable(exc) or attempt == RETRIES:
                    raise
                await asyncio.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    async def schedule(self, estimated_tokens: int, models: Sequence[str] | None = None,
                       key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": key or idempotency_key()}
        return dict(await self._call("POST", "/schedule", _schedule_body(estimated_tokens, models), headers))

    async def acquire(self, estimated_tokens: int, models: Sequence[str] | None = None,
                      timeout: float | None = None) -> Slot:
        give_up = None if timeout is None else time.monotonic() + timeout
        key = idempotency_key()
        while True:
            admitted = _slot_or_pause(await self.schedule(estimated_tokens, models, key), give_up, estimated_tokens)
            if isinstance(admitted, Slot):
                return admitted
            await asyncio.sleep(admitted)

    async def heartbeat(self, admission_id: str) -> bool:
        return bool((await self._call("POST", "/heartbeat", {"admission_id": admission_id}))["ok"])

    async def complete(self, slot: Slot) -> bool:
        return bool((await self._call("POST", "/complete", _complete_body(slot)))["released"])

    async def advice(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/advice"))

    @contextlib.asynccontextmanager
    async def slot(self, estimated_tokens: int, models: Sequence[str] | None = None,
                   timeout: float | None = None) -> AsyncIterator[Slot]:
        """Acquire a slot, heartbeat it in a background task, complete it on exit (even on error)."""
        slot = await self.acquire(estimated_tokens, models, timeout)

        async def beat() -> None:
            while True:
                await asyncio.sleep(_heartbeat_every(slot))
                with contextlib.suppress(httpx.TransportError, RouterError):
                    if not await self.heartbeat(slot.admission_id):
                        slot.lost = True
                        return

        beater = asyncio.create_task(beat())
        try:
            yield slot
        finally:
            beater.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beater
            await self.complete(slot)
