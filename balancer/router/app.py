"""The router's HTTP API (FastAPI): ``/schedule``, ``/complete``, ``/heartbeat``, ``/advice``.

Every admission is a lease in the pipeline's own admission core, so router
callers and pipeline workers draw from one budget per model:

- ``POST /schedule`` admits (WDRR, token buckets, concurrency cap) and at
  once starts the lease, as a worker does before its call: the start gates
  (tokens as the provider charges them on arrival, requests per minute) may
  ask for a short delay, which the router waits out before it answers, so a
  caller may call the Models Backend the moment it gets a model. Otherwise
  it answers ``wait_for_ms`` (:func:`balancer.router.backpressure.wait_for_ms`).
  The admission's id is the router's own, unguessable, never a pipeline id;
  an ``Idempotency-Key`` header makes a retried ``/schedule`` get the same
  admission, from the same caller and until it is completed
  (:mod:`balancer.router.admissions`).
- The admission's id is sent as ``admission_id`` and as ``task_id`` (the seed's
  name for it), so a client written to the seed's flow works unchanged;
  ``/complete`` and ``/heartbeat`` take either field (both: they must agree).
- ``POST /heartbeat`` extends a live lease by one router lease
  (``BALANCER_ROUTER_LEASE_SECONDS``). An expired one is gone: ``not_found``.
- ``POST /complete`` settles the tokens as the model's accounting says and
  frees the slot; a second call, or a call after expiry, is harmless. Both
  act only on ids this router issued: any other answers ``not_found``. One
  that cannot reach Redis is kept by the router and applied when Redis
  answers (``reason: kept``): the caller need not retry it.
- A caller that dies stops heartbeating; its slot frees when the lease
  expires. Reclaim refunds what the provider did not charge: the lease was
  started at ``/schedule``, and strict providers charge a request on arrival,
  so the tokens stay charged (the seed's ``refund_for(lease)`` is 0 for it).

The Redis calls (blocking redis-py, each with socket timeouts) run in the
thread pool, never on the event loop: a stalled Redis holds the requests that
need it, not every request (the guards, validation, ``/openapi.json``).
Measured against the calls on the loop: docs/benchmark-history.md, the router.
Reading a request's head and body has a deadline (:mod:`balancer.router.server`).

Errors are 4xx with a ``detail`` that says why: malformed JSON (NaN and
infinities included), a field out of range, an unknown model, an admission
id of the wrong shape, an estimate no model can ever take (422), a body over
16 KiB (413), a missing or wrong bearer token (401), an ``Idempotency-Key``
whose first ``/schedule`` is still being answered (409). Redis unreachable is
a 503. A validation error's detail says where and why, not what was sent;
the unknown model names that are sent back go out as ASCII JSON (:class:`SafeJSON`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
from collections.abc import Iterable
from typing import Annotated, Any

import redis
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from balancer.admission.core import AdmissionCore
from balancer.admission.values import Rejected
from balancer.httpguard import MAX_BODY_BYTES, ASGIApp, BodyLimit, HostGuard, Receive, Scope, Send, problem
from balancer.router.admissions import (
    ADMISSION_ID_PATTERN,
    IDEMPOTENCY_KEY_PATTERN,
    Admissions,
    Granted,
    InProgress,
    Kept,
    KeyReused,
)
from balancer.router.backpressure import OutcomeWindow, advise, wait_for_ms

log = logging.getLogger(__name__)

#: Estimates and actual tokens above this are refused as malformed (422).
MAX_TOKENS = 100_000_000
#: Paths served without a token.
OPEN_PATHS = frozenset({"/healthz"})


class SafeJSON(JSONResponse):
    """JSON as ASCII, with no NaN: any string (a lone surrogate included) can be sent back."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


ModelName = Annotated[str, Field(min_length=1, max_length=200)]
AdmissionId = Annotated[str, Field(pattern=ADMISSION_ID_PATTERN, description="the admission_id /schedule returned")]


class ScheduleRequest(_Body):
    estimated_tokens: int = Field(ge=1, le=MAX_TOKENS, description="prompt + expected output tokens")
    models: list[ModelName] | None = Field(default=None, max_length=100, description="allowed models; none: any")


class Scheduled(BaseModel):
    model_backend_id: str
    admission_id: str
    task_id: str = Field(description="the same id under the seed's name: /complete and /heartbeat take either")
    lease_ms: int = Field(description="heartbeat within this, or the slot is reclaimed")


class Wait(BaseModel):
    wait_for_ms: int


class _Handle(_Body):
    """An admission named by ``admission_id`` or by ``task_id``, the seed's name for it (one is enough;
    both must agree)."""

    admission_id: AdmissionId | None = None
    task_id: AdmissionId | None = Field(default=None, description="the seed's name for admission_id")

    @model_validator(mode="after")
    def _one_admission(self) -> _Handle:
        if self.admission_id is None and self.task_id is None:
            raise ValueError("admission_id (or task_id, the seed's name for it) is required")
        if self.admission_id is not None and self.task_id is not None and self.admission_id != self.task_id:
            raise ValueError("admission_id and task_id name two admissions: send one")
        return self

    @property
    def admission(self) -> str:
        return self.admission_id or self.task_id or ""


class CompleteRequest(_Handle):
    actual_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS, description="prompt + completion tokens used")


class Completed(BaseModel):
    ok: bool = Field(description="false: this router has no such admission (never issued, or its lease ended)")
    released: bool = Field(description="false for a second /complete, or after the lease expired")
    reason: str | None = Field(default=None, description="not_found; or kept: Redis was unreachable, and the router "
                                                         "frees the slot when it answers (no retry needed)")


class HeartbeatRequest(_Handle):
    pass


class HeartbeatReply(BaseModel):
    ok: bool
    reason: str | None = None


class AdviceReply(BaseModel):
    backpressure_score: float
    suggested_parallelism: int


class Problem(BaseModel):
    detail: Any


class Router:
    """The state one router process keeps: its admissions, its lease, the advice window.

    The window and the jitter live on the event loop; :attr:`admissions` does
    the Redis I/O, which the endpoints run in the thread pool."""

    def __init__(self, core: AdmissionCore, lease_ms: int, rng: random.Random | None = None) -> None:
        self.core, self.lease_ms = core, lease_ms
        self.admissions = Admissions(core, lease_ms)
        self.window = OutcomeWindow()
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not security

    def advice(self) -> tuple[int, int]:
        """(calls in flight, the enabled models' caps), read from the core (blocking)."""
        live = self.core.live()
        in_flight = sum(m.in_flight for m in live.values())
        return in_flight, sum(m.quota.max_concurrent_requests for m in live.values() if m.quota.enabled)


def _validation_problem(exc: RequestValidationError) -> SafeJSON:
    """A 422 listing where and why, without the input (which may be anything, NaN or a lone surrogate)."""
    errors = [{"loc": [part if isinstance(part, int) else str(part) for part in e.get("loc", ())],
               "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))} for e in exc.errors()]
    return SafeJSON({"detail": errors}, status_code=422)


def create_app(core: AdmissionCore, *, lease_ms: int, token: str | None = None, rng: random.Random | None = None,
               bound: str = "127.0.0.1", allow_hosts: Iterable[str] = ()) -> FastAPI:
    """The ASGI app; ``token``, if given, is required as ``Authorization: Bearer``
    on every path but ``/healthz``; ``Host`` must name ``bound`` (the address served) or
    one of ``allow_hosts`` (:class:`balancer.httpguard.HostGuard`)."""
    router = Router(core, lease_ms, rng)
    admissions = router.admissions
    app = FastAPI(
        title="balancer router",
        version="2",
        description=__doc__,
        default_response_class=SafeJSON,
        responses={401: {"model": Problem}, 409: {"model": Problem}, 413: {"model": Problem}, 422: {"model": Problem},
                   503: {"model": Problem}},
    )

    @app.exception_handler(redis.RedisError)
    async def redis_down(request: Request, exc: redis.RedisError) -> SafeJSON:
        log.warning("Redis error on %s: %s", request.url.path, (str(exc).splitlines() or [""])[0])
        return SafeJSON({"detail": "the admission state (Redis) is unavailable; retry shortly"}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> SafeJSON:
        return _validation_problem(exc)

    @app.post("/schedule", response_model=Scheduled | Wait, summary="Ask for a model for one call")
    async def schedule(
        body: ScheduleRequest,
        request: Request,
        idempotency_key: Annotated[str | None, Header(pattern=IDEMPOTENCY_KEY_PATTERN, description=(
            "one per logical /schedule, the same on its retries: a retry gets the same admission"))] = None,
    ) -> Scheduled | Wait | SafeJSON:
        unknown = await run_in_threadpool(admissions.unknown_models, body.models) if body.models else []
        if unknown:
            return SafeJSON({"detail": f"unknown model: {', '.join(unknown)}"}, status_code=422)
        caller = request.client.host if request.client else ""  # an idempotency record is its caller's
        result = await run_in_threadpool(admissions.schedule, body.estimated_tokens, body.models, idempotency_key,
                                         caller)
        now = time.monotonic()
        if isinstance(result, Rejected):
            return SafeJSON({"detail": result.reason}, status_code=422)
        if isinstance(result, InProgress):
            return SafeJSON({"detail": "a /schedule with this Idempotency-Key is still being answered; retry"},
                            status_code=409)
        if isinstance(result, KeyReused):
            return SafeJSON({"detail": "this Idempotency-Key was sent with another body"}, status_code=422)
        if isinstance(result, Granted):
            router.window.admitted(now)
            if result.delay_ms > 0:
                await asyncio.sleep(result.delay_ms / 1000)  # the start gate: the caller calls as soon as we answer
            return Scheduled(model_backend_id=result.model, admission_id=result.admission_id, task_id=result.admission_id,
                             lease_ms=lease_ms)
        wait = wait_for_ms(result.core_wait_ms, router.rng)
        router.window.waited(now, wait)
        return Wait(wait_for_ms=wait)

    @app.post("/complete", response_model=Completed, summary="Report a call finished; frees its slot")
    async def complete(body: CompleteRequest) -> Completed:
        released = await run_in_threadpool(admissions.complete, body.admission, body.actual_tokens)
        if released is None:
            return Completed(ok=False, released=False, reason="not_found")
        if isinstance(released, Kept):  # Redis unreachable: freed when it answers, no retry needed
            return Completed(ok=True, released=False, reason="kept")
        return Completed(ok=True, released=released)

    @app.post("/heartbeat", response_model=HeartbeatReply, summary="Keep a call's slot for another lease")
    async def heartbeat(body: HeartbeatRequest) -> HeartbeatReply:
        alive = await run_in_threadpool(admissions.heartbeat, body.admission)
        return HeartbeatReply(ok=True) if alive else HeartbeatReply(ok=False, reason="not_found")

    @app.get("/advice", response_model=AdviceReply, summary="Backpressure and a suggested number of callers")
    async def advice() -> AdviceReply:
        in_flight, total_cap = await run_in_threadpool(router.advice)
        waits, schedules, admits = router.window.snapshot(time.monotonic())
        given = advise(waits, schedules, admits, in_flight, total_cap)
        return AdviceReply(backpressure_score=given.backpressure_score, suggested_parallelism=given.suggested_parallelism)

    @app.get("/healthz", summary="Liveness: the router and its Redis answer")
    async def healthz() -> dict[str, bool]:
        await run_in_threadpool(core.redis.ping)
        return {"ok": True}

    guarded: ASGIApp = BodyLimit(app, MAX_BODY_BYTES)
    if token:
        guarded = BearerToken(guarded, token)
    app.state.asgi = HostGuard(guarded, bound, allow_hosts)
    app.state.router = router
    return app


def asgi(app: FastAPI) -> ASGIApp:
    """The app with its guards (Host and Origin, token, body size) in front: what uvicorn serves."""
    return app.state.asgi


class BearerToken:
    """Require ``Authorization: Bearer <token>`` (compared in constant time) on every path but ``/healthz``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await problem(send, 401, "missing or wrong bearer token", ((b"www-authenticate", b"Bearer"),))
                return
        await self.app(scope, receive, send)
