"""The router API over real HTTP (uvicorn in a thread), on the test's own Redis namespace.

The admission core under it is the pipeline's; what these tests check is the
HTTP face: the seed's flow, leases and heartbeats, the wait rules, auth,
validation and fuzzing. ``test_router_pipeline.py`` runs it beside the
pipeline on one model.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer.client import RouterClient, RouterError
from balancer.domain.quota import Quota
from balancer.router.app import MAX_BODY_BYTES, asgi, create_app
from balancer.services import Services
from balancer.settings import Settings
from tests.servers import served

pytestmark = pytest.mark.usefixtures("migrated")

LEASE_MS = 1500
TOKEN = "s3cret-router-token"


@pytest.fixture
def svc() -> Services:
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([
        Quota("solo", 1, 60_000, burst_tokens=20_000),
        Quota("wide", 8, 600_000, burst_tokens=100_000),
    ], by="test")
    return services


def serve_router(svc: Services, token: str | None = None) -> Iterator[str]:
    core = svc.core.with_lease(LEASE_MS)
    with served(asgi(create_app(core, lease_ms=LEASE_MS, token=token, rng=random.Random(5)))) as url:
        yield url


@pytest.fixture
def url(svc: Services) -> Iterator[str]:
    yield from serve_router(svc)


def in_flight(svc: Services, model: str) -> int:
    return svc.core.live()[model].in_flight


def test_schedule_heartbeat_complete(url: str, svc: Services) -> None:
    """The seed's flow: a model and a task id; the slot is held until /complete;
    a second /complete is harmless; a heartbeat after it finds nothing."""
    reply = httpx.post(f"{url}/schedule", json={"estimated_tokens": 500, "models": ["solo"]}).json()
    assert reply["model_backend_id"] == "solo" and reply["lease_ms"] == LEASE_MS
    assert in_flight(svc, "solo") == 1
    assert httpx.post(f"{url}/heartbeat", json={"task_id": reply["task_id"]}).json() == {"ok": True, "reason": None}
    first = httpx.post(f"{url}/complete", json={"task_id": reply["task_id"], "actual_tokens": 420})
    assert first.status_code == 200 and first.json() == {"ok": True, "released": True}
    assert in_flight(svc, "solo") == 0
    again = httpx.post(f"{url}/complete", json={"task_id": reply["task_id"]})
    assert again.status_code == 200 and again.json() == {"ok": True, "released": False}
    gone = httpx.post(f"{url}/heartbeat", json={"task_id": reply["task_id"]}).json()
    assert gone == {"ok": False, "reason": "not_found"}


def test_a_full_model_answers_a_tick_aligned_wait(url: str, svc: Services) -> None:
    """Cap 1: the second caller waits. The slot frees at the latest when the
    1.5 s lease expires, but the call may end any moment: the wait is at most
    about a second (1 s + 10 % jitter), in whole 100 ms ticks or the 50 ms floor."""
    held = httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()
    waits = [httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()["wait_for_ms"]
             for _ in range(5)]
    assert all(w == 50 or w % 100 == 0 for w in waits), waits
    assert all(w <= 1100 for w in waits), waits  # not the 1.5 s lease deadline
    assert waits[0] >= 100  # asked right away: most of the lease is left
    httpx.post(f"{url}/complete", json={"task_id": held["task_id"]})
    assert "task_id" in httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()


def test_a_slot_without_heartbeats_is_reclaimed_and_with_them_is_kept(url: str, svc: Services) -> None:
    abandoned = httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()
    deadline = time.monotonic() + 10
    while in_flight(svc, "solo") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert in_flight(svc, "solo") == 0  # expired: the slot is free again
    assert httpx.post(f"{url}/heartbeat", json={"task_id": abandoned["task_id"]}).json()["ok"] is False

    with RouterClient(url) as client, client.slot(100, models=["solo"]) as slot:
        started = time.monotonic()
        while time.monotonic() - started < 3 * LEASE_MS / 1000:  # three leases, kept by heartbeats
            assert in_flight(svc, "solo") == 1 and not slot.lost
            time.sleep(0.1)
    assert in_flight(svc, "solo") == 0  # completed on exit


def test_a_killed_client_frees_its_slot_by_lease_expiry(url: str, svc: Services) -> None:
    """A real process holding a slot through RouterClient.slot is killed -9 mid-call."""
    script = (
        "import sys, time\n"
        "from balancer.client import RouterClient\n"
        f"with RouterClient({url!r}).slot(100, models=['solo']) as slot:\n"
        "    print(slot.task_id, flush=True)\n"
        "    time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        task_id = child.stdout.readline().strip()
        assert task_id and in_flight(svc, "solo") == 1
        score = svc.core.raw_state()["models"]["solo"]["inflight"][0][0]
        deadline = time.monotonic() + 10  # the child heartbeats: the lease moves forward
        while svc.core.raw_state()["models"]["solo"]["inflight"][0][0] == score:
            assert time.monotonic() < deadline, "no heartbeat moved the lease"
            time.sleep(0.05)
        child.kill()
        child.wait(timeout=10)
        killed_at = time.monotonic()
        while in_flight(svc, "solo"):
            assert time.monotonic() - killed_at < LEASE_MS / 1000 + 5, "the dead client's slot was not reclaimed"
            time.sleep(0.05)
        assert httpx.post(f"{url}/heartbeat", json={"task_id": task_id}).json()["reason"] == "not_found"
    finally:
        child.kill()
        child.wait(timeout=10)


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"estimated_tokens": -5}, 422, "greater than or equal to 1"),
        ({"estimated_tokens": 10**12}, 422, "less than or equal to"),
        ({"estimated_tokens": 50_000, "models": ["solo"]}, 422, "more than the largest burst_tokens (20000)"),
        ({"estimated_tokens": 10, "models": ["nope", "solo"]}, 422, "unknown model: nope"),
        ({"estimated_tokens": "10"}, 422, "valid integer"),
        ({"estimated_tokens": 10, "bogus": 1}, 422, "Extra inputs"),
        ({}, 422, "Field required"),
    ],
)
def test_schedule_refuses_bad_bodies_with_a_reason(url: str, body: dict, status: int, says: str) -> None:
    reply = httpx.post(f"{url}/schedule", json=body)
    assert reply.status_code == status
    assert says in json.dumps(reply.json()["detail"]), reply.json()


def test_malformed_json_unknown_tasks_and_huge_bodies(url: str) -> None:
    bad = httpx.post(f"{url}/schedule", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 422 and "JSON" in json.dumps(bad.json()["detail"])
    unknown = httpx.post(f"{url}/complete", json={"task_id": "../etc/passwd"})
    assert unknown.status_code == 422 and "pattern" in json.dumps(unknown.json()["detail"])
    huge = {"estimated_tokens": 1, "models": ["x" * 100] * 200}
    assert httpx.post(f"{url}/schedule", json=huge).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit still holds
        yield b'{"estimated_tokens": 1, "pad": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    streamed = httpx.post(f"{url}/schedule", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and "bytes" in streamed.json()["detail"]


def test_a_token_is_required_everywhere_but_healthz(svc: Services) -> None:
    for url in serve_router(svc, token=TOKEN):
        assert httpx.get(f"{url}/healthz").json() == {"ok": True}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            refused = httpx.post(f"{url}/schedule", json={"estimated_tokens": 10}, headers=headers)
            assert refused.status_code == 401 and refused.json()["detail"] == "missing or wrong bearer token"
            assert httpx.get(f"{url}/openapi.json", headers=headers).status_code == 401
        with RouterClient(url, token=TOKEN) as client:
            slot = client.acquire(10)
            assert client.complete(slot)


def test_the_openapi_schema_lists_the_api(url: str) -> None:
    schema = httpx.get(f"{url}/openapi.json").json()
    assert {"/schedule", "/complete", "/heartbeat", "/advice", "/healthz"} <= set(schema["paths"])


def test_advice_follows_the_pressure(url: str, svc: Services) -> None:
    calm = httpx.get(f"{url}/advice").json()
    assert calm == {"backpressure_score": 0.0, "suggested_parallelism": 9}  # nothing seen yet: every cap (1 + 8)
    httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]})
    for _ in range(9):  # refused, and told to wait about a lease
        httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]})
    pressed = httpx.get(f"{url}/advice").json()
    assert pressed["backpressure_score"] == pytest.approx(0.5 + 0.5 * 0.9)
    assert 4 <= pressed["suggested_parallelism"] < calm["suggested_parallelism"]


def test_the_client_raises_the_routers_reason(url: str) -> None:
    with RouterClient(url) as client, pytest.raises(RouterError, match="unknown model: nope"):
        client.acquire(10, models=["nope"])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=15), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(["estimated_tokens", "models", "priority", "task_id", "actual_tokens", "x"])
bodies = st.one_of(
    json_values,
    st.dictionaries(fields, json_values, max_size=4),
    st.fixed_dictionaries({"estimated_tokens": st.integers(-10, 200_000)},
                          optional={"models": st.lists(st.sampled_from(["solo", "wide", "nope", ""]), max_size=3),
                                    "priority": st.integers(-(2**40), 2**40)}),
    st.fixed_dictionaries({"task_id": st.from_regex(r"[0-9]{1,20}-[0-9]{1,20}", fullmatch=True) | st.text(max_size=25)},
                          optional={"actual_tokens": st.integers(-10, 2**40)}),
)


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/schedule", "/complete", "/heartbeat"]), body=bodies)
def test_fuzzed_bodies_get_no_5xx_and_every_4xx_says_why(url: str, path: str, body: object) -> None:
    reply = httpx.post(f"{url}{path}", content=json.dumps(body).encode())
    assert reply.status_code < 500, (path, body, reply.text)
    if reply.status_code >= 400:
        assert reply.json()["detail"], (path, body, reply.text)
    elif path == "/schedule" and "task_id" in reply.json():
        httpx.post(f"{url}/complete", json={"task_id": reply.json()["task_id"]})  # keep the slots free


def test_the_async_client_holds_heartbeats_and_completes(url: str, svc: Services) -> None:
    import asyncio

    from balancer.client import AsyncRouterClient

    async def main() -> tuple[str, bool, int]:
        async with AsyncRouterClient(url) as client:
            async with client.slot(100, models=["solo"]) as slot:
                started = time.monotonic()
                while time.monotonic() - started < 2 * LEASE_MS / 1000:  # two leases, kept by heartbeats
                    assert in_flight(svc, "solo") == 1
                    await asyncio.sleep(0.1)
                slot.actual_tokens = 80
                lost = slot.lost
            return slot.model, lost, in_flight(svc, "solo")

    assert asyncio.run(main()) == ("solo", False, 0)


def test_the_router_refuses_to_serve_beyond_loopback_without_a_token(migrated: dict[str, str]) -> None:
    from balancer.devtools.embedded import free_port

    env = {k: v for k, v in __import__("os").environ.items() if k != "BALANCER_ROUTER_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "balancer", "router", "--host", "0.0.0.0", "--port", str(free_port())],  # noqa: S104
                          env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: BALANCER_ROUTER_TOKEN must be set to serve the router beyond loopback (--host 0.0.0.0)"]


def test_the_token_never_reaches_the_logs(migrated: dict[str, str], tmp_path) -> None:  # noqa: ANN001
    """`balancer router --access-log` with a token: right and wrong tokens go by,
    a 401 and a 200 are logged, and neither token appears in the output."""
    import os

    from balancer.devtools.embedded import free_port
    from balancer.devtools.supervisor import wait_for_http

    port = free_port()
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        child = subprocess.Popen([sys.executable, "-m", "balancer", "router", "--port", str(port), "--access-log"],
                                 env={**os.environ, "BALANCER_ROUTER_TOKEN": TOKEN}, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/healthz")
        wrong = "Bearer wrong-" + TOKEN[::-1]
        assert httpx.post(f"{url}/schedule", json={"estimated_tokens": 10}, headers={"Authorization": wrong}).status_code == 401
        ok = httpx.get(f"{url}/advice", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
    finally:
        child.terminate()
        child.wait(timeout=10)
    text = log.read_text()
    assert "/advice" in text and "401" in text  # the access log did log the requests
    assert TOKEN not in text and TOKEN[::-1] not in text
