"""Admissions per second of the admission core, against a bare INCR loop.

    python -m balancer.bench.micro.admission_rate [--redis-url URL] [--seconds 3] [--models 10]

Runs, in one go and on the same Redis: a plain ``INCR`` loop (one round trip
per call: the ceiling for anything that talks to Redis once per operation),
then ``admit`` with batch sizes 1 and 100, from 1 and 4 processes. Prints
admissions/s and the ratio to the INCR loop measured in the same run.

Uses a fresh key namespace and deletes only its own keys afterwards.
Without --redis-url (or BALANCER_REDIS_URL) it starts an embedded redis-server.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
import uuid
from contextlib import ExitStack

import redis
from rich.console import Console
from rich.table import Table

from balancer.admission import keys
from balancer.admission.core import AdmissionCore
from balancer.admission.quota import MAX_CONCURRENCY, Quota
from balancer.admission.values import Admitted, Candidate
from balancer.devtools.embedded import redis_for_bench
from balancer.services import delete_namespace_keys


def incr_key(namespace: str) -> str:
    """The counter a bare INCR loop (here, and router_load's bare endpoint) increments:
    under the namespace's hash tag, so the benchmark's cleanup deletes it with the rest."""
    return keys.tag(namespace) + ":bench:incr"


def incr_loop(url: str, key: str, seconds: float) -> float:
    client = redis.Redis.from_url(url)
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        client.incr(key)
        n += 1
    client.delete(key)
    return n / seconds


def admit_loop(url: str, namespace: str, batch: int, seconds: float, out: multiprocessing.Queue | None = None) -> float:
    core = AdmissionCore(redis.Redis.from_url(url), namespace, lease_ms=3_600_000)
    candidates = [Candidate(500 + (i * 37) % 1500) for i in range(batch)]
    admitted = 0
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        admitted += sum(isinstance(d, Admitted) for d in core.admit(candidates))
    rate = admitted / (time.perf_counter() - start)
    if out is not None:
        out.put(rate)
    return rate


def parallel(url: str, namespace: str, batch: int, seconds: float, processes: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=admit_loop, args=(url, namespace, batch, seconds, queue)) for _ in range(processes)]
    for proc in procs:
        proc.start()
    rates = [queue.get(timeout=seconds + 60) for _ in procs]
    for proc in procs:
        proc.join()
    return sum(rates)


def setup(url: str, namespace: str, models: int) -> AdmissionCore:
    core = AdmissionCore(redis.Redis.from_url(url), namespace, lease_ms=3_600_000)
    core.restore([])
    for i in range(models):
        core.set_quota(Quota(f"model-{i}", MAX_CONCURRENCY, 10**9, weight=1 + i % 3))  # no cap binds in a few seconds
    return core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=os.environ.get("BALANCER_REDIS_URL"))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--models", type=int, default=10)
    args = parser.parse_args()
    console = Console()
    with ExitStack() as stack:
        url = redis_for_bench(stack, args.redis_url)
        namespace = "bench-" + uuid.uuid4().hex[:8]
        client = redis.Redis.from_url(url)

        def cleanup() -> None:
            delete_namespace_keys(client, namespace)

        stack.callback(cleanup)
        version = client.info("server")["redis_version"]
        console.print(f"Redis {version} at {url.split('@')[-1]}, {args.models} models, {args.seconds:.0f} s per run")
        incr = incr_loop(url, incr_key(namespace), args.seconds)
        rows = []
        for processes in (1, 4):
            for batch in (1, 100):
                cleanup()
                setup(url, namespace, args.models)
                if processes == 1:
                    rate = admit_loop(url, namespace, batch, args.seconds)
                else:
                    rate = parallel(url, namespace, batch, args.seconds, processes)
                rows.append((processes, batch, rate))
        table = Table(title="admission throughput")
        for col in ("processes", "batch", "admissions/s", "÷ INCR loop (1 proc)"):
            table.add_column(col, justify="right")
        table.add_row("1", "INCR", f"{incr:,.0f}", "1.00")
        for processes, batch, rate in rows:
            table.add_row(str(processes), str(batch), f"{rate:,.0f}", f"{rate / incr:.2f}")
        console.print(table)
        one_proc_100 = next(r for p, b, r in rows if p == 1 and b == 100)
        verdict = "met" if one_proc_100 >= 10_000 else "MISSED"
        console.print(f"target >= 10,000 admissions/s from one process, batch 100: {one_proc_100:,.0f} ({verdict})")


if __name__ == "__main__":
    main()
