"""The simulated Models Backend over HTTP: a FastAPI app serving both APIs
for a :class:`~balancer.devtools.sim.provider.Simulator`.

* ``POST /single``, ``POST /batch`` (the Models Backend API)
* ``POST /v1/chat/completions`` (OpenAI-compatible)
* ``GET /models``; ``GET /log`` (every accepted and rejected call, once it ended; with
  ``running=true`` also the calls admitted and not yet ended)
* ``POST /admin/limits`` (change a model's provider limits), ``POST /admin/faults``

``/batch`` without a model spreads prompts round-robin over all models,
unaware of quotas, as the users' backend does; it answers only after every
prompt has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from balancer.devtools.sim.provider import DEFAULT_MAX_TOKENS, Faults, Simulator


def disconnect_of(request: Request) -> Callable[[], Awaitable[None]]:
    """A coroutine function that returns when the client of ``request`` disconnects."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return gone


def _json_bytes(body: Any) -> bytes:
    """JSON as Starlette's JSONResponse writes it."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


class SingleRoute:
    """``POST /single`` served straight on ASGI, everything else by the FastAPI app.

    It is the route every benchmark call takes, and FastAPI's routing, validation and
    request classes cost more CPU per call than the pipeline's whole worker: on a
    shared machine the referee's own cost would be charged to the system it referees.
    The semantics are the FastAPI route's: 422 for a body that is not a JSON object,
    400 without a model and a prompt, the malformed-reply fault, and the client's
    disconnect watched while the call runs (``on_disconnect``)."""

    def __init__(self, app: FastAPI, sim: Simulator) -> None:
        self.app, self.sim = app, sim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/single" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            payload = json.loads(b"".join(chunks))
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            await self._send(send, 422, _json_bytes({"detail": "the body must be a JSON object"}), {})
            return
        model, prompt = payload.get("model"), payload.get("prompt")
        if not isinstance(model, str) or not isinstance(prompt, str):
            await self._send(send, 400, _json_bytes({"error": "model and prompt are required"}), {})
            return
        max_tokens = int(payload.get("max_tokens") or DEFAULT_MAX_TOKENS)

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        status, body, headers = await self.sim.call(model, prompt, max_tokens, "single", gone)
        if status == 200 and self.sim.faults.get(self.sim.faults.malformed, model):
            await self._send(send, 200, b'{"answer": "trunc', headers)
        else:
            await self._send(send, status, _json_bytes(body), headers)

    @staticmethod
    async def _send(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})


def create_app(sim: Simulator) -> SingleRoute:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        foreign = asyncio.create_task(sim.run_foreign_traffic())
        yield
        foreign.cancel()

    app = FastAPI(title="balancer simulated Models Backend", lifespan=lifespan)

    def reply(status: int, body: dict[str, Any], headers: dict[str, str], model: str) -> Response:
        if status == 200 and sim.faults.get(sim.faults.malformed, model):
            return Response(content=b'{"answer": "trunc', status_code=200, media_type="application/json", headers=headers)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.post("/batch")
    async def batch(payload: dict[str, Any]) -> JSONResponse:
        prompts = payload.get("prompts")
        if not isinstance(prompts, list):
            return JSONResponse({"error": "prompts must be a list"}, status_code=400)
        model = payload.get("model")
        max_tokens = int(payload.get("max_tokens") or DEFAULT_MAX_TOKENS)
        targets = [model or sim.next_model() for _ in prompts]
        results = await asyncio.gather(*(sim.call(m, str(p), max_tokens, "batch") for m, p in zip(targets, prompts, strict=True)))
        out = []
        for m, (status, body, headers) in zip(targets, results, strict=True):
            item = {"model": m, "status": status, **body}
            if "Retry-After" in headers:
                item["retry_after"] = float(headers["Retry-After"])
            out.append(item)
        return JSONResponse({"results": out})

    @app.post("/v1/chat/completions")
    async def chat(payload: dict[str, Any], request: Request) -> Response:
        model = payload.get("model")
        messages = payload.get("messages") or []
        prompt = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        if not isinstance(model, str):
            return JSONResponse({"error": {"message": "model is required"}}, status_code=400)
        max_tokens = int(payload.get("max_tokens") or DEFAULT_MAX_TOKENS)
        status, body, headers = await sim.call(model, prompt, max_tokens, "openai", disconnect_of(request))
        if status == 200 and "answer" in body:
            body = {
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": body["answer"]}, "finish_reason": "stop"}],
                **({"usage": {**body["usage"], "total_tokens": sum(body["usage"].values())}} if "usage" in body else {}),
            }
        return reply(status, body, headers, model)

    @app.get("/models")
    async def models() -> dict[str, Any]:
        return {
            "models": [
                {**asdict(m), "latency": asdict(m.latency), "time_scale": sim.time_scale} for m in sim.models.values()
            ],
            "grace": sim.grace,
        }

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        with sim._lock:
            return {"in_flight": {name: lim.in_flight for name, lim in sim.limiters.items()}, "calls": len(sim.log),
                    "foreign_tokens": dict(sim.foreign_taken)}

    @app.get("/log")
    async def log(since: int = 0, running: bool = False) -> dict[str, Any]:
        """The log's entries from ``since``; with ``running``, in the same read, the calls admitted
        and not yet ended (their start, model, prompt and charge; no status or end yet), and when."""
        with sim._lock:
            out: dict[str, Any] = {"entries": sim.log[since:], "next": len(sim.log)}
            if running:
                out.update(running=sim.still_running(), at=time.time())
            return out

    @app.post("/admin/limits")
    async def set_limits(payload: dict[str, Any]) -> dict[str, Any]:
        name = payload["model"]
        lim = sim.limiters[name]
        with sim._lock:
            lim.update(time.time(), cap=int(payload.get("cap", lim.cap)), tpm=float(payload.get("tpm", lim.tpm)),
                       rpm=payload.get("rpm", lim.rpm), burst=float(payload.get("burst", lim.burst)))
        return {"ok": True}

    @app.post("/admin/faults")
    async def set_faults(request: Request) -> dict[str, Any]:
        payload = await request.json()
        faults = Faults()
        for key, value in payload.items():
            setattr(faults, key, dict(value))
        sim.faults = faults
        return {"ok": True}

    return SingleRoute(app, sim)
