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

A slot whose heartbeat comes back ``not_found`` (the lease expired, e.g.
after a long stall) is marked ``slot.lost``; the call in flight goes on, and
the caller may treat the quota as not held any more.

Only ``httpx`` is needed: this module imports nothing else from balancer, so
an Airflow worker can use it without the pipeline's dependencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

#: Retries of a request that got no answer (connection refused, timeout) or a 503, with back-off.
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
    task_id: str
    lease_ms: int
    actual_tokens: int | None = None
    lost: bool = False  # a heartbeat found the lease gone


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _schedule_body(estimated_tokens: int, models: Sequence[str] | None, priority: int) -> dict[str, Any]:
    body: dict[str, Any] = {"estimated_tokens": estimated_tokens, "priority": priority}
    if models:
        body["models"] = list(models)
    return body


def _complete_body(slot: Slot) -> dict[str, Any]:
    body: dict[str, Any] = {"task_id": slot.task_id}
    if slot.actual_tokens is not None:
        body["actual_tokens"] = slot.actual_tokens
    return body


def _slot_or_pause(reply: dict[str, Any], give_up: float | None, estimated_tokens: int) -> Slot | float:
    """A ``/schedule`` reply as the slot it grants, or the seconds to sleep before asking again."""
    if "task_id" in reply:
        return Slot(reply["model_backend_id"], reply["task_id"], int(reply["lease_ms"]))
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
    return isinstance(exc, RouterError) and exc.status >= 500


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

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        for attempt in range(RETRIES + 1):
            try:
                return _json(self._http.request(method, path, json=body))
            except (httpx.TransportError, RouterError) as exc:
                if not _retryable(exc) or attempt == RETRIES:
                    raise
                time.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    def schedule(self, estimated_tokens: int, models: Sequence[str] | None = None, priority: int = 0) -> dict[str, Any]:
        """One ``/schedule``: ``{"model_backend_id", "task_id", ...}`` or ``{"wait_for_ms"}``."""
        return dict(self._call("POST", "/schedule", _schedule_body(estimated_tokens, models, priority)))

    def acquire(self, estimated_tokens: int, models: Sequence[str] | None = None, priority: int = 0,
                timeout: float | None = None) -> Slot:
        """Schedule until admitted, sleeping each ``wait_for_ms``; TimeoutError after ``timeout`` seconds."""
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            admitted = _slot_or_pause(self.schedule(estimated_tokens, models, priority), give_up, estimated_tokens)
            if isinstance(admitted, Slot):
                return admitted
            time.sleep(admitted)

    def heartbeat(self, task_id: str) -> bool:
        """Extend the lease; False if it is gone (expired or completed)."""
        return bool(self._call("POST", "/heartbeat", {"task_id": task_id})["ok"])

    def complete(self, slot: Slot) -> bool:
        """Free the slot, settling ``slot.actual_tokens``; True if this call released it."""
        return bool(self._call("POST", "/complete", _complete_body(slot))["released"])

    def advice(self) -> dict[str, Any]:
        return dict(self._call("GET", "/advice"))

    @contextlib.contextmanager
    def slot(self, estimated_tokens: int, models: Sequence[str] | None = None, priority: int = 0,
             timeout: float | None = None) -> Iterator[Slot]:
        """Acquire a slot, heartbeat it in a background thread, complete it on exit (even on error)."""
        slot = self.acquire(estimated_tokens, models, priority, timeout)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(_heartbeat_every(slot)):
                with contextlib.suppress(httpx.TransportError, RouterError):  # the next beat tries again
                    if not self.heartbeat(slot.task_id):
                        slot.lost = True
                        return

        beater = threading.Thread(target=beat, name=f"heartbeat-{slot.task_id}", daemon=True)
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

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        for attempt in range(RETRIES + 1):
            try:
                return _json(await self._http.request(method, path, json=body))
            except (httpx.TransportError, RouterError) as exc:
                if not _retryable(exc) or attempt == RETRIES:
                    raise
                await asyncio.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    async def schedule(self, estimated_tokens: int, models: Sequence[str] | None = None, priority: int = 0) -> dict[str, Any]:
        return dict(await self._call("POST", "/schedule", _schedule_body(estimated_tokens, models, priority)))

    async def acquire(self, estimated_tokens: int, models: Sequence[str] | None = None, priority: int = 0,
                      timeout: float | None = None) -> Slot:
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            admitted = _slot_or_pause(await self.schedule(estimated_tokens, models, priority), give_up, estimated_tokens)
            if isinstance(admitted, Slot):
                return admitted
            await asyncio.sleep(admitted)

    async def heartbeat(self, task_id: str) -> bool:
        return bool((await self._call("POST", "/heartbeat", {"task_id": task_id}))["ok"])

    async def complete(self, slot: Slot) -> bool:
        return bool((await self._call("POST", "/complete", _complete_body(slot)))["released"])

    async def advice(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/advice"))

    @contextlib.asynccontextmanager
    async def slot(self, estimated_tokens: int, models: Sequence[str] | None = None, priority: int = 0,
                   timeout: float | None = None) -> AsyncIterator[Slot]:
        """Acquire a slot, heartbeat it in a background task, complete it on exit (even on error)."""
        slot = await self.acquire(estimated_tokens, models, priority, timeout)

        async def beat() -> None:
            while True:
                await asyncio.sleep(_heartbeat_every(slot))
                with contextlib.suppress(httpx.TransportError, RouterError):
                    if not await self.heartbeat(slot.task_id):
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
