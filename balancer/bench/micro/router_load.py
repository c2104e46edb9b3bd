"""Router throughput: ``/schedule`` + ``/complete`` pairs per second, against a bare endpoint.

    python -m balancer.bench.micro.router_load [--redis-url URL] [--seconds 10] [--connections 32]

In one run, on the same Redis and the same machine, each in its own process:

1. a bare FastAPI endpoint, served by uvicorn the same way as the router,
   that does one Redis ``INCR`` per request (the ceiling for any HTTP
   service that talks to Redis once per request);
2. the router (:func:`balancer.router.app.create_app`) over 10 models with
   room for every call, so each ``/schedule`` is admitted.

A separate load process keeps ``--connections`` keep-alive connections busy
for ``--seconds``, each sending a pair after the previous answered: for the
router, ``/schedule`` then ``/complete`` with the admission id it got; for the bare
endpoint, two requests. It prints pairs per second and the p50 / p99 latency
of each request, measured at the load process, and the ratio of the two
runs. The load process speaks HTTP/1.1 over asyncio streams itself, so the
client's own cost (an HTTP library's) is not what is measured.

Uses a fresh key namespace and deletes only its own keys afterwards.
Without --redis-url (or BALANCER_REDIS_URL) it starts an embedded redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass

import redis
from rich.console import Console
from rich.table import Table

from balancer.bench.micro.admission_rate import incr_key
from balancer.devtools.embedded import redis_for_bench
from balancer.estimates.stats import percentile
from balancer.services import delete_namespace_keys

MODELS = 10


# -- the two servers (each runs in its own process) ------------------------------
def serve_router(redis_url: str, namespace: str, port: int) -> None:
    from balancer.admission.core import AdmissionCore
    from balancer.admission.quota import MAX_CONCURRENCY, Quota
    from balancer.router.app import asgi, create_app
    from balancer.router.server import serve

    core = AdmissionCore(redis.Redis.from_url(redis_url), namespace, lease_ms=60_000)
    for i in range(MODELS):
        core.set_quota(Quota(f"model-{i}", MAX_CONCURRENCY, 1_000_000_000))
    serve(asgi(create_app(core, lease_ms=60_000)), "127.0.0.1", port, log_level="warning", access_log=False)


def serve_bare(redis_url: str, namespace: str, port: int) -> None:
    from fastapi import FastAPI
    from starlette.concurrency import run_in_threadpool

    from balancer.router.server import serve

    client = redis.Redis.from_url(redis_url)
    key = incr_key(namespace)
    app = FastAPI()

    @app.post("/incr")
    async def incr() -> dict[str, int]:
        return {"n": await run_in_threadpool(client.incr, key)}

    serve(app, "127.0.0.1", port, log_level="warning", access_log=False)


# -- the load ------------------------------------------------------------------
@dataclass
class Load:
    pairs: int
    seconds: float
    first_ms: list[float]
    second_ms: list[float]
    errors: int

    @property
    def pairs_per_s(self) -> float:
        return self.pairs / self.seconds


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, body: bytes) -> tuple[int, bytes]:
    writer.write(
        b"POST " + path.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return status, await reader.readexactly(length)


async def _connection(port: int, kind: str, until: float, load: Load) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    schedule = json.dumps({"estimated_tokens": 500}).encode()
    try:
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            if kind == "router":
                status, body = await _request(reader, writer, "/schedule", schedule)
                t1 = time.perf_counter()
                admission_id = json.loads(body).get("admission_id") if status == 200 else None
                if admission_id is None:
                    load.errors += 1
                    continue
                complete = json.dumps({"admission_id": admission_id}).encode()
                status, _ = await _request(reader, writer, "/complete", complete)
            else:
                status, _ = await _request(reader, writer, "/incr", b"{}")
                t1 = time.perf_counter()
                status, _ = await _request(reader, writer, "/incr", b"{}")
            t2 = time.perf_counter()
            if status != 200:
                load.errors += 1
                continue
            load.pairs += 1
            load.first_ms.append((t1 - t0) * 1000)
            load.second_ms.append((t2 - t1) * 1000)
    finally:
        writer.close()


def run_load(port: int, kind: str, seconds: float, connections: int) -> Load:
    load = Load(0, seconds, [], [], 0)

    async def main() -> None:
        until = time.perf_counter() + seconds
        await asyncio.gather(*(_connection(port, kind, until, load) for _ in range(connections)))

    asyncio.run(main())
    return load


def _load_process(port: int, kind: str, seconds: float, connections: int, out: multiprocessing.Queue) -> None:
    out.put(run_load(port, kind, seconds, connections))


def measure(target: str, redis_url: str, namespace: str, seconds: float, connections: int) -> Load:
    """Start one server in its own process, warm it up, then load it from another process."""
    from balancer.devtools.embedded import free_port
    from balancer.supervisor import wait_for_http

    port = free_port()
    code = f"from balancer.bench.micro.router_load import serve_{target} as s; s({redis_url!r}, {namespace!r}, {port})"
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)  # noqa: S603
    try:
        wait_for_http(f"http://127.0.0.1:{port}/openapi.json")
        run_load(port, target, 1.0, 4)  # warm-up (imports, connection pools, scripts loaded)
        ctx = multiprocessing.get_context("spawn")
        out: multiprocessing.Queue = ctx.Queue()
        loader = ctx.Process(target=_load_process, args=(port, target, seconds, connections, out))
        loader.start()
        result: Load = out.get(timeout=seconds + 60)
        loader.join(timeout=10)
        return result
    finally:
        server.terminate()
        server.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("BALANCER_REDIS_URL"))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args(argv)
    console = Console()
    with ExitStack() as stack:
        url = redis_for_bench(stack, args.redis_url)
        namespace = "bench-router-" + uuid.uuid4().hex[:8]
        stack.callback(delete_namespace_keys, redis.Redis.from_url(url), namespace)
        results = {target: measure(target, url, namespace, args.seconds, args.connections) for target in ("bare", "router")}
    table = Table(title=f"{args.connections} connections, {args.seconds:g} s each, one server process, "
                        f"{os.cpu_count()} CPUs shared with the load process")
    for col in ("server", "pairs/s", "1st request p50 / p99 ms", "2nd request p50 / p99 ms", "errors"):
        table.add_column(col, justify="right")
    for target, load in results.items():
        name = "bare INCR endpoint (x2)" if target == "bare" else "router /schedule + /complete"
        table.add_row(
            name, f"{load.pairs_per_s:,.0f}",
            f"{percentile(load.first_ms, 50) or 0:.1f} / {percentile(load.first_ms, 99) or 0:.1f}",
            f"{percentile(load.second_ms, 50) or 0:.1f} / {percentile(load.second_ms, 99) or 0:.1f}", str(load.errors),
        )
    console.print(table)
    ratio = results["router"].pairs_per_s / max(results["bare"].pairs_per_s, 1e-9)
    console.print(f"router / bare: {ratio:.2f} of the bare endpoint's pairs per second "
                  f"(target: ≥ 2,000 pairs/s with p99 ≤ 10 ms)")


if __name__ == "__main__":
    main()
