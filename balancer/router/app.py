"""The router's HTTP API (FastAPI): ``/schedule``, ``/complete``, ``/heartbeat``, ``/advice``.

Every admission is a lease in the pipeline's own admission core, so router
callers and pipeline workers draw from one budget per model:

- ``POST /schedule`` admits (WDRR, token buckets, concurrency cap) and at
  once starts the lease, as a worker does before its call: the start gates
  (tokens as the provider charges them on arrival, requests per minute) may
  ask for a short delay, which the router waits out before it answers, so a
  caller may call the Models Backend the moment it gets a model. Otherwise
  it answers ``wait_for_ms`` (:func:`balancer.domain.backpressure.wait_for_ms`).
- ``POST /heartbeat`` extends a live lease by one router lease
  (``BALANCER_ROUTER_LEASE_SECONDS``). An expired one is gone: ``not_found``.
- ``POST /complete`` settles the tokens as the model's accounting says and
  frees the slot; a second call, or a call after expiry, is harmless.
- A caller that dies stops heartbeating; its slot frees when the lease
  expires. Reclaim refunds what the provider did not charge: the lease was
  started at ``/schedule``, and strict providers charge a request on arrival,
  so the tokens stay charged (the seed's ``refund_for(lease)`` is 0 for it).

The Redis calls are made on the event loop itself, not in a thread pool:
each is one round trip to a Redis next door (every client has socket
timeouts), and measured side by side the pool's hand-offs cost more than
they spare (docs/benchmarks.md, the router section).

Errors are 4xx with a ``detail`` that says why: malformed JSON, a field out
of range, an unknown model, a task id this router never issues, an estimate
no model can ever take (422), a body over 16 KiB (413), a missing or wrong
bearer token (401). Redis unreachable is a 503.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import random
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Annotated, Any

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from balancer.admission import AdmissionCore, Admitted, Candidate, NotNow, Rejected, Settlement
from balancer.domain.backpressure import OutcomeWindow, advise, wait_for_ms

log = logging.getLogger(__name__)

#: Larger bodies get a 413 before they are parsed.
MAX_BODY_BYTES = 16 * 1024
#: Estimates and actual tokens above this are refused as malformed (422).
MAX_TOKENS = 100_000_000
#: An admission id as the core issues it: ``<epoch>-<sequence>``.
TASK_ID_PATTERN = r"^[0-9]{1,18}-[0-9]{1,18}$"
#: Paths served without a token.
OPEN_PATHS = frozenset({"/healthz"})

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


ModelName = Annotated[str, Field(min_length=1, max_length=200)]
TaskId = Annotated[str, Field(pattern=TASK_ID_PATTERN, description="the task_id /schedule returned")]


class ScheduleRequest(_Body):
    estimated_tokens: int = Field(ge=1, le=MAX_TOKENS, description="prompt + expected output tokens")
    models: list[ModelName] | None = Field(default=None, max_length=100, description="allowed models; none: any")
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000,
                          description="accepted for the seed's API; admission is first come, first served")


class Scheduled(BaseModel):
    model_backend_id: str
    task_id: str
    lease_ms: int = Field(description="heartbeat within this, or the slot is reclaimed")


class Wait(BaseModel):
    wait_for_ms: int


class CompleteRequest(_Body):
    task_id: TaskId
    actual_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS, description="prompt + completion tokens used")


class Completed(BaseModel):
    ok: bool
    released: bool = Field(description="false for a second /complete, or after the lease expired")


class HeartbeatRequest(_Body):
    task_id: TaskId


class HeartbeatReply(BaseModel):
    ok: bool
    reason: str | None = None


class AdviceReply(BaseModel):
    backpressure_score: float
    suggested_parallelism: int


class Problem(BaseModel):
    detail: Any


@dataclass(frozen=True)
class Granted:
    """An admission, and how long its start gate asks to hold off before answering."""

    reply: Scheduled
    delay_ms: int


class Router:
    """The state one router process keeps: the core, its lease, the advice window."""

    def __init__(self, core: AdmissionCore, lease_ms: int, rng: random.Random | None = None) -> None:
        self.core, self.lease_ms = core, lease_ms
        self.window = OutcomeWindow()
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self._models: frozenset[str] = frozenset()

    def unknown_models(self, wanted: list[str]) -> list[str]:
        """Names no quota has. The known names are cached and re-read on a miss."""
        missing = [m for m in wanted if m not in self._models]
        if missing:
            self._models = frozenset(self.core.model_names())
            missing = [m for m in wanted if m not in self._models]
        return sorted(set(missing))

    def schedule(self, body: ScheduleRequest) -> Granted | Wait | Rejected:
        est = body.estimated_tokens
        [decision] = self.core.admit([Candidate(est, tuple(body.models) if body.models else None)])
        if isinstance(decision, Admitted):
            decision = self.core.renew(decision.admission_id, decision.model, est, self.lease_ms)
        now = time.monotonic()
        if isinstance(decision, Admitted):
            self.window.admitted(now)
            reply = Scheduled(model_backend_id=decision.model, task_id=decision.admission_id, lease_ms=self.lease_ms)
            return Granted(reply, decision.start_delay_ms)
        if isinstance(decision, Rejected):
            return decision
        wait = wait_for_ms(decision.wait_ms if isinstance(decision, NotNow) else None, self.rng)
        self.window.waited(now, wait)
        return Wait(wait_for_ms=wait)

    def advice(self) -> AdviceReply:
        live = self.core.live()
        in_flight = sum(m.in_flight for m in live.values())
        total_cap = sum(m.quota.max_concurrent_requests for m in live.values() if m.quota.enabled)
        waits, schedules, admits = self.window.snapshot(time.monotonic())
        advice = advise(waits, schedules, admits, in_flight, total_cap)
        return AdviceReply(backpressure_score=advice.backpressure_score, suggested_parallelism=advice.suggested_parallelism)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only.

    >>> [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.0.0.5")]
    [True, True, True, False, False]
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def create_app(core: AdmissionCore, *, lease_ms: int, token: str | None = None, rng: random.Random | None = None) -> FastAPI:
    """The ASGI app; ``token``, if given, is required as ``Authorization: Bearer``
    on every path but ``/healthz``."""
    router = Router(core, lease_ms, rng)
    app = FastAPI(
        title="balancer router",
        version="1",
        description=__doc__,
        responses={401: {"model": Problem}, 413: {"model": Problem}, 422: {"model": Problem}, 503: {"model": Problem}},
    )

    @app.exception_handler(redis.RedisError)
    async def redis_down(request: Request, exc: redis.RedisError) -> JSONResponse:
        log.warning("Redis error on %s: %s", request.url.path, (str(exc).splitlines() or [""])[0])
        return JSONResponse({"detail": "the admission state (Redis) is unavailable; retry shortly"}, status_code=503)

    @app.post("/schedule", response_model=Scheduled | Wait, summary="Ask for a model for one call")
    async def schedule(body: ScheduleRequest) -> Scheduled | Wait | JSONResponse:
        unknown = router.unknown_models(body.models or []) if body.models else []
        if unknown:
            return JSONResponse({"detail": f"unknown model: {', '.join(unknown)}"}, status_code=422)
        result = router.schedule(body)
        if isinstance(result, Rejected):
            return JSONResponse({"detail": result.reason}, status_code=422)
        if isinstance(result, Wait):
            return result
        if result.delay_ms > 0:
            await asyncio.sleep(result.delay_ms / 1000)  # the start gate: the caller calls as soon as we answer
        return result.reply

    @app.post("/complete", response_model=Completed, summary="Report a call finished; frees its slot")
    async def complete(body: CompleteRequest) -> Completed:
        settlement = Settlement(used_tokens=body.actual_tokens)
        _, released = core.finish(body.task_id, settlement)
        return Completed(ok=True, released=released)

    @app.post("/heartbeat", response_model=HeartbeatReply, summary="Keep a call's slot for another lease")
    async def heartbeat(body: HeartbeatRequest) -> HeartbeatReply:
        alive = core.heartbeat(body.task_id, router.lease_ms)
        return HeartbeatReply(ok=True) if alive else HeartbeatReply(ok=False, reason="not_found")

    @app.get("/advice", response_model=AdviceReply, summary="Backpressure and a suggested number of callers")
    async def advice() -> AdviceReply:
        return router.advice()

    @app.get("/healthz", summary="Liveness: the router and its Redis answer")
    async def healthz() -> dict[str, bool]:
        core.redis.ping()
        return {"ok": True}

    guarded: ASGIApp = BodyLimit(app, MAX_BODY_BYTES)
    if token:
        guarded = BearerToken(guarded, token)
    app.state.asgi = guarded
    app.state.router = router
    return app


def asgi(app: FastAPI) -> ASGIApp:
    """The app with its guards (token, body size) in front: what uvicorn serves."""
    return app.state.asgi


async def _problem(send: Send, status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = JSONResponse({"detail": detail}).body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class BearerToken:
    """Require ``Authorization: Bearer <token>`` (compared in constant time) on every path but ``/healthz``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _problem(send, 401, "missing or wrong bearer token", ((b"www-authenticate", b"Bearer"),))
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with a 413, whether declared or streamed.

    The body (small by design) is read here in full, then replayed to the app."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await _problem(send, 413, f"request body over {self.limit} bytes")
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if len(body) > self.limit:
                await _problem(send, 413, f"request body over {self.limit} bytes")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
