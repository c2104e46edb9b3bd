"""The router API over real HTTP (uvicorn in a thread), on the test's own Redis namespace.

The admission core under it is the pipeline's; what these tests check is the
HTTP face: the seed's flow, leases and heartbeats, the wait rules, auth,
validation and fuzzing. ``test_router_pipeline.py`` runs it beside the
pipeline on one model.
"""

from __future__ import annotations

import contextlib
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

from balancer.admission.quota import Quota
from balancer.client import RouterClient, RouterError
from balancer.router import server
from balancer.router.app import MAX_BODY_BYTES, asgi, create_app
from balancer.services import Services
from balancer.settings import Settings
from tests.servers import served

pytestmark = pytest.mark.usefixtures("migrated")

LEASE_MS = 1500
#: The lease of a router whose test is not about leases: no call's slot may expire
#: between two lines of the test, however loaded the machine is.
STEADY_LEASE_MS = 60_000
READ_TIMEOUT_S = 1.0
TOKEN = "s3cret-router-token"


@pytest.fixture
def svc() -> Services:
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([
        Quota("solo", 1, 60_000, burst_tokens=20_000),
        Quota("wide", 8, 600_000, burst_tokens=100_000),
    ], by="test")
    return services


def serve_router(svc: Services, token: str | None = None, lease_ms: int = LEASE_MS) -> Iterator[str]:
    core = svc.core.with_lease(lease_ms)
    app = asgi(create_app(core, lease_ms=lease_ms, token=token, rng=random.Random(5)))
    with served(app, server.config, read_timeout_s=READ_TIMEOUT_S) as url:
        yield url


@pytest.fixture
def url(svc: Services) -> Iterator[str]:
    yield from serve_router(svc)


@pytest.fixture
def steady_url(svc: Services) -> Iterator[str]:
    yield from serve_router(svc, lease_ms=STEADY_LEASE_MS)


def in_flight(svc: Services, model: str) -> int:
    return svc.core.live()[model].in_flight


def test_schedule_heartbeat_complete(steady_url: str, svc: Services) -> None:
    """The seed's flow: a model and an admission id; the slot is held until /complete;
    a second /complete is harmless; a heartbeat after it finds nothing. On the 60 s lease router: on
    a loaded machine a 1.5 s lease can end between two requests, and the heartbeat then finds nothing."""
    reply = httpx.post(f"{steady_url}/schedule", json={"estimated_tokens": 500, "models": ["solo"]}).json()
    assert reply["model_backend_id"] == "solo" and reply["lease_ms"] == STEADY_LEASE_MS
    assert in_flight(svc, "solo") == 1
    assert httpx.post(f"{steady_url}/heartbeat", json={"admission_id": reply["admission_id"]}).json() == {"ok": True, "reason": None}
    first = httpx.post(f"{steady_url}/complete", json={"admission_id": reply["admission_id"], "actual_tokens": 420})
    assert first.status_code == 200 and first.json() == {"ok": True, "released": True, "reason": None}
    assert in_flight(svc, "solo") == 0
    again = httpx.post(f"{steady_url}/complete", json={"admission_id": reply["admission_id"]})
    assert again.status_code == 200 and again.json() == {"ok": True, "released": False, "reason": None}
    gone = httpx.post(f"{steady_url}/heartbeat", json={"admission_id": reply["admission_id"]}).json()
    assert gone == {"ok": False, "reason": "not_found"}


def test_the_seeds_flow_with_task_id_works_unchanged(steady_url: str, svc: Services) -> None:
    """The seed's client: /schedule's answer read as ``task_id``, sent back as ``task_id`` to
    /heartbeat and /complete (before: absent from the answer, and a 422 "extra inputs")."""
    reply = httpx.post(f"{steady_url}/schedule", json={"estimated_tokens": 500, "models": ["solo"]}).json()
    task_id = reply["task_id"]
    assert task_id == reply["admission_id"] and reply["model_backend_id"] == "solo"
    beat = httpx.post(f"{steady_url}/heartbeat", json={"task_id": task_id})
    assert beat.status_code == 200 and beat.json()["ok"] is True
    assert in_flight(svc, "solo") == 1
    done = httpx.post(f"{steady_url}/complete", json={"task_id": task_id})
    assert done.status_code == 200 and done.json() == {"ok": True, "released": True, "reason": None}
    assert in_flight(svc, "solo") == 0
    assert httpx.post(f"{steady_url}/heartbeat", json={"task_id": task_id}).json() == {"ok": False, "reason": "not_found"}


@pytest.mark.parametrize(("body", "says"), [
    ({}, "admission_id (or task_id"),
    ({"actual_tokens": 5}, "admission_id (or task_id"),
    ({"task_id": "rt_" + "a" * 32, "admission_id": "rt_" + "b" * 32}, "two admissions"),
    ({"task_id": "../etc/passwd"}, "pattern"),
])
@pytest.mark.parametrize("path", ["/complete", "/heartbeat"])
def test_an_admission_named_neither_way_or_two_ways_is_a_422(url: str, path: str, body: dict, says: str) -> None:
    if path == "/heartbeat":
        body = {k: v for k, v in body.items() if k != "actual_tokens"}
    reply = httpx.post(f"{url}{path}", json=body)
    assert reply.status_code == 422 and says in json.dumps(reply.json()["detail"]), reply.json()


def test_both_names_of_one_admission_are_accepted_together(steady_url: str, svc: Services) -> None:
    reply = httpx.post(f"{steady_url}/schedule", json={"estimated_tokens": 500, "models": ["solo"]}).json()
    both = {"admission_id": reply["admission_id"], "task_id": reply["task_id"]}
    assert httpx.post(f"{steady_url}/heartbeat", json=both).json()["ok"] is True
    assert httpx.post(f"{steady_url}/complete", json=both).json()["released"] is True


def test_a_full_model_answers_a_tick_aligned_wait(steady_url: str, svc: Services) -> None:
    """Cap 1: the second caller waits. The slot frees at the latest when the
    lease expires (60 s here, so that it cannot end between two requests on a loaded
    machine), but the call may end any moment: the wait is at most about a second
    (1 s + 10 % jitter), in whole 100 ms ticks or the 50 ms floor."""
    held = httpx.post(f"{steady_url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()
    waits = [httpx.post(f"{steady_url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()["wait_for_ms"]
             for _ in range(5)]
    assert all(w == 50 or w % 100 == 0 for w in waits), waits
    assert all(w <= 1100 for w in waits), waits  # not the lease's deadline
    assert waits[0] >= 100  # asked right away: most of the lease is left
    httpx.post(f"{steady_url}/complete", json={"admission_id": held["admission_id"]})
    assert "admission_id" in httpx.post(f"{steady_url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()


def test_a_slot_without_heartbeats_is_reclaimed_and_with_them_is_kept(url: str, svc: Services) -> None:
    abandoned = httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()
    deadline = time.monotonic() + 10
    while in_flight(svc, "solo") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert in_flight(svc, "solo") == 0  # expired: the slot is free again
    assert httpx.post(f"{url}/heartbeat", json={"admission_id": abandoned["admission_id"]}).json()["ok"] is False

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
        "    print(slot.admission_id, flush=True)\n"
        "    time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        admission_id = child.stdout.readline().strip()
        assert admission_id and in_flight(svc, "solo") == 1
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
        assert httpx.post(f"{url}/heartbeat", json={"admission_id": admission_id}).json()["reason"] == "not_found"
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
    unknown = httpx.post(f"{url}/complete", json={"admission_id": "../etc/passwd"})
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


def test_advice_follows_the_pressure(steady_url: str, svc: Services) -> None:
    url = steady_url
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
fields = st.sampled_from(["estimated_tokens", "models", "admission_id", "actual_tokens", "x"])
bodies = st.one_of(
    json_values,
    st.dictionaries(fields, json_values, max_size=4),
    st.fixed_dictionaries({"estimated_tokens": st.integers(-10, 200_000)},
                          optional={"models": st.lists(st.sampled_from(["solo", "wide", "nope", ""]), max_size=3)}),
    st.fixed_dictionaries({"admission_id": st.from_regex(r"[0-9]{1,20}-[0-9]{1,20}", fullmatch=True)
                           | st.from_regex(r"rt_[A-Za-z0-9_-]{32}", fullmatch=True) | st.text(max_size=25)},
                          optional={"actual_tokens": st.integers(-10, 2**40)}),
)


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/schedule", "/complete", "/heartbeat"]), body=bodies)
def test_fuzzed_bodies_get_no_5xx_and_every_4xx_says_why(url: str, path: str, body: object) -> None:
    reply = httpx.post(f"{url}{path}", content=json.dumps(body).encode())
    assert reply.status_code < 500, (path, body, reply.text)
    if reply.status_code >= 400:
        assert reply.json()["detail"], (path, body, reply.text)
    elif path == "/schedule" and "admission_id" in reply.json():
        httpx.post(f"{url}/complete", json={"admission_id": reply.json()["admission_id"]})  # keep the slots free


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
    from balancer.supervisor import wait_for_http

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


# -- R5: ids, idempotency, malformed bodies, slow clients, a stalled Redis -------------------------
def test_complete_and_heartbeat_refuse_ids_the_router_did_not_issue(steady_url: str, svc: Services) -> None:
    """A pipeline call's admission id (the core's ``<epoch>-<sequence>``) is refused by
    both endpoints and its slot stays taken; a router id no /schedule returned is not found."""
    url = steady_url
    from balancer.admission.values import Candidate

    [pipeline] = svc.core.admit([Candidate(100, ("wide",))])  # as the dispatcher admits a pipeline call
    router_call = httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["wide"]}).json()
    assert router_call["admission_id"].startswith("rt_") and len(router_call["admission_id"]) == 35
    lease = svc.core.raw_state()["models"]["wide"]["inflight"]
    assert len(lease) == 2
    for path in ("/complete", "/heartbeat"):
        for core_id in (pipeline.admission_id, *(lid for _, lid in lease)):  # every id the core holds
            refused = httpx.post(f"{url}{path}", json={"admission_id": core_id})
            assert refused.status_code == 422, refused.text
    guessed = "rt_" + "A" * 32
    assert httpx.post(f"{url}/complete", json={"admission_id": guessed}).json() == {
        "ok": False, "released": False, "reason": "not_found"}
    assert httpx.post(f"{url}/heartbeat", json={"admission_id": guessed}).json() == {"ok": False, "reason": "not_found"}
    assert in_flight(svc, "wide") == 2  # both slots still held
    assert httpx.post(f"{url}/complete", json={"admission_id": router_call["admission_id"]}).json()["released"] is True
    assert in_flight(svc, "wide") == 1  # only the router's own


@pytest.mark.parametrize("raw", [
    b'{"estimated_tokens": NaN}',
    b'{"estimated_tokens": Infinity}',
    b'{"estimated_tokens": -Infinity, "models": ["solo"]}',
    b'{"estimated_tokens": 1e400}',
    b'{"estimated_tokens": 10, "models": ["\\ud800"]}',
    b'{"estimated_tokens": 10, "\\ud800": 1}',
    b'{"estimated_tokens": "\\ud800"}',
    b'{"admission_id": "\\ud800"}',
    b'{"admission_id": NaN}',
])
def test_every_malformed_body_is_a_422_without_a_traceback(url: str, raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    for path in ("/schedule", "/complete", "/heartbeat"):
        reply = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"})
        assert reply.status_code == 422, (path, raw, reply.status_code, reply.text)
        assert reply.json()["detail"]
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]  # uvicorn logs a 500's traceback


def test_a_retried_schedule_gets_the_same_admission(steady_url: str, svc: Services) -> None:
    """The idempotency record lives as long as its admission's lease: on the 1.5 s lease, a loaded
    machine let it end between two requests and the retry was a new admission."""
    url = steady_url
    key = "k" * 20
    first = httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["wide"]},
                       headers={"Idempotency-Key": key}).json()
    again = httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["wide"]},
                       headers={"Idempotency-Key": key}).json()
    assert again == first and in_flight(svc, "wide") == 1
    other_body = httpx.post(f"{url}/schedule", json={"estimated_tokens": 200, "models": ["wide"]},
                            headers={"Idempotency-Key": key})
    assert other_body.status_code == 422 and "another body" in other_body.json()["detail"]
    short = httpx.post(f"{url}/schedule", json={"estimated_tokens": 100}, headers={"Idempotency-Key": "short"})
    assert short.status_code == 422
    fresh = httpx.post(f"{url}/schedule", json={"estimated_tokens": 100, "models": ["wide"]},
                       headers={"Idempotency-Key": "f" * 20}).json()
    assert fresh["admission_id"] != first["admission_id"] and in_flight(svc, "wide") == 2


def test_a_wait_leaves_the_key_for_the_next_try(steady_url: str, svc: Services) -> None:
    held = httpx.post(f"{steady_url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()
    key = {"Idempotency-Key": "w" * 20}
    assert "wait_for_ms" in httpx.post(f"{steady_url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}, headers=key).json()
    httpx.post(f"{steady_url}/complete", json={"admission_id": held["admission_id"]})
    got = httpx.post(f"{steady_url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]}, headers=key).json()
    assert got["model_backend_id"] == "solo" and got["admission_id"] != held["admission_id"]


class LoseFirstScheduleAnswer(httpx.HTTPTransport):
    """Real HTTP; the first /schedule reaches the router, but its answer is lost (a read timeout)."""

    lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path == "/schedule" and not self.lost:
            response.read()
            self.lost += 1
            raise httpx.ReadTimeout("answer lost", request=request)
        return response


def test_the_client_retrying_a_lost_answer_holds_one_slot(steady_url: str, svc: Services) -> None:
    transport = LoseFirstScheduleAnswer()
    with RouterClient(steady_url, transport=transport) as client:
        slot = client.acquire(100, models=["wide"])
        assert transport.lost == 1
        assert in_flight(svc, "wide") == 1  # the lost answer's admission is the one the retry got
        assert client.complete(slot)
    assert in_flight(svc, "wide") == 0


def test_slow_connections_are_closed_within_the_read_deadline(url: str) -> None:
    """Idle, trickled head, trickled body: each closed about READ_TIMEOUT_S after it opened
    (none is ever answered), while a well-behaved request is still served."""
    import socket

    port = int(url.rsplit(":", 1)[1])
    partial = {
        "idle": b"",
        "head": b"POST /schedule HTTP/1.1\r\nhost: 127.0.0.1\r\n",
        "body": b"POST /schedule HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 40\r\n\r\n{",
    }
    socks = {}
    for name, data in partial.items():
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(data)
        sock.setblocking(False)
        socks[name] = sock
    opened = time.monotonic()
    closed: dict[str, float] = {}
    while len(closed) < len(socks) and time.monotonic() - opened < 10 * READ_TIMEOUT_S:
        for name, sock in socks.items():
            if name in closed:
                continue
            try:
                got = sock.recv(4096)
            except BlockingIOError:
                if name != "idle":
                    with contextlib.suppress(OSError):
                        sock.send(b" " if name == "body" else b"x")  # a byte now and then keeps nothing alive
                continue
            except OSError:
                got = b""
            assert got == b"", (name, got)  # closed, not answered
            closed[name] = time.monotonic() - opened
        assert httpx.get(f"{url}/openapi.json").status_code == 200
        time.sleep(0.1)
    for sock in socks.values():
        sock.close()
    assert set(closed) == set(socks), closed
    assert all(READ_TIMEOUT_S * 0.9 <= t <= READ_TIMEOUT_S + 2 for t in closed.values()), closed


def test_a_stalled_redis_does_not_stall_the_event_loop(svc: Services) -> None:
    """The router's Redis answers nothing (a listener that never replies): /schedule
    waits for it, but requests that need no Redis are answered meanwhile."""
    import socket
    import threading

    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from balancer.admission.core import AdmissionCore

    hole = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(hole.accept()[0]), daemon=True).start()
    stalled = redis.Redis(host="127.0.0.1", port=hole.getsockname()[1], socket_timeout=4, socket_connect_timeout=4,
                          retry=Retry(NoBackoff(), 0))  # one stall of 4 s, not redis-py's retries of it
    core = AdmissionCore(stalled, svc.core.namespace, lease_ms=LEASE_MS)
    with served(asgi(create_app(core, lease_ms=LEASE_MS)), server.config) as url:
        result: list[int] = []
        caller = threading.Thread(target=lambda: result.append(
            httpx.post(f"{url}/schedule", json={"estimated_tokens": 10}, timeout=30).status_code))
        caller.start()
        deadline = time.monotonic() + 5
        while not accepted:  # the /schedule's Redis call has reached the stalled Redis
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)  # (its request is sent; the loop is now either free or blocked)
        started = time.monotonic()
        assert httpx.post(f"{url}/schedule", json={"estimated_tokens": -1}, timeout=30).status_code == 422
        assert httpx.get(f"{url}/openapi.json", timeout=30).status_code == 200
        answered_in = time.monotonic() - started
        caller.join(timeout=30)
    hole.close()
    for conn in accepted:
        conn.close()
    assert result == [503]  # the stalled call ends as Redis unavailable, after its socket timeout
    assert answered_in < 2, answered_in  # not after the 4 s socket timeout


def test_concurrent_retries_of_one_schedule_share_one_admission(steady_url: str, svc: Services) -> None:
    """Eight copies of one logical /schedule at once (one key): whichever comes
    second is answered the first's admission, or a 409 the client retries."""
    import threading

    key = "c" * 24
    got: list[str] = []
    barrier = threading.Barrier(8)

    def retry() -> None:
        with RouterClient(steady_url) as client:
            barrier.wait()
            got.append(client.schedule(100, ["wide"], key)["admission_id"])

    threads = [threading.Thread(target=retry) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got) == 8 and len(set(got)) == 1, got
    assert in_flight(svc, "wide") == 1


def test_an_idempotency_record_ends_with_its_admission(steady_url: str, svc: Services) -> None:
    """After /complete the key no longer hands out the ended admission (before: the same id
    again, "call now", on a slot already freed): the next /schedule with it is a new admission."""
    key = {"Idempotency-Key": "e" * 24}
    body = {"estimated_tokens": 100, "models": ["solo"]}
    first = httpx.post(f"{steady_url}/schedule", json=body, headers=key).json()
    assert httpx.post(f"{steady_url}/complete", json={"admission_id": first["admission_id"]}).json()["released"]
    again = httpx.post(f"{steady_url}/schedule", json=body, headers=key).json()
    assert again["admission_id"] != first["admission_id"] and in_flight(svc, "solo") == 1


def test_callers_elsewhere_sharing_a_key_each_get_their_own_admission(steady_url: str, svc: Services) -> None:
    """40 callers, each from an address of its own (127.0.0.2 to .41), send one key at once to a
    model with a cap of 1: one gets "call now", the others wait (before: all 40 got the one admission)."""
    import threading

    key = {"Idempotency-Key": "s" * 24}
    answers: list[dict] = []
    barrier = threading.Barrier(40)

    def call(address: str) -> None:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30) as client:
            barrier.wait()
            answers.append(client.post(f"{steady_url}/schedule", json={"estimated_tokens": 100, "models": ["solo"]},
                                       headers=key).json())

    threads = [threading.Thread(target=call, args=(f"127.0.0.{i + 2}",)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(answers) == 40
    admitted = [a for a in answers if "admission_id" in a]
    assert len(admitted) == 1, admitted
    assert all("wait_for_ms" in a for a in answers if "admission_id" not in a), answers
    assert in_flight(svc, "solo") == 1


def test_an_idempotency_record_lives_as_long_as_its_heartbeated_admission(svc: Services) -> None:
    """An admission kept alive by /heartbeat past its first lease is still what a retry of its
    /schedule gets (before: the record ended after one lease, and the retry was told to wait
    while the caller's own admission held the model's one slot)."""
    lease_ms = 3_000
    with contextlib.closing(serve_router(svc, lease_ms=lease_ms)) as urls:
        url = next(urls)
        key, body = {"Idempotency-Key": "h" * 24}, {"estimated_tokens": 100, "models": ["solo"]}
        first = httpx.post(f"{url}/schedule", json=body, headers=key, timeout=30).json()
        until = time.monotonic() + 1.5 * lease_ms / 1000
        while time.monotonic() < until:
            beat = httpx.post(f"{url}/heartbeat", json={"admission_id": first["admission_id"]}, timeout=30).json()
            assert beat["ok"], beat
            time.sleep(lease_ms / 6000)
        retried = httpx.post(f"{url}/schedule", json=body, headers=key, timeout=30).json()
        assert retried.get("admission_id") == first["admission_id"], retried
        assert in_flight(svc, "solo") == 1


def test_a_loopback_caller_cannot_claim_another_callers_key_with_x_forwarded_for(steady_url: str, svc: Services) -> None:
    """A caller on 127.0.0.2 holds a key's admission; another on 127.0.0.1 sends that key with
    ``X-Forwarded-For: 127.0.0.2`` and gets no "call now" of its own or of the first's (before:
    uvicorn took the header as its address and handed it the first caller's admission)."""
    key = {"Idempotency-Key": "f" * 24}
    body = {"estimated_tokens": 100, "models": ["solo"]}
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30) as first:
        held = first.post(f"{steady_url}/schedule", json=body, headers=key).json()
    assert "admission_id" in held
    claimed = httpx.post(f"{steady_url}/schedule", json=body, headers={**key, "X-Forwarded-For": "127.0.0.2"},
                         timeout=30).json()
    assert "admission_id" not in claimed and "wait_for_ms" in claimed, claimed
    assert in_flight(svc, "solo") == 1


@pytest.mark.parametrize(("headers", "status"), [
    ({"Host": "rebind.attacker.example"}, 400),
    ({"Host": "rebind.attacker.example:8700"}, 400),
    ({"Origin": "http://rebind.attacker.example"}, 403),
    ({"Origin": "null"}, 403),
    ({"Host": "localhost", "Origin": "http://localhost:8700"}, 200),
    ({"Host": "[::1]"}, 200),
])
def test_a_request_naming_another_host_or_origin_is_refused(url: str, svc: Services, headers: dict, status: int) -> None:
    """DNS rebinding: a page of another site whose name resolves to 127.0.0.1 sends its own
    name as Host (and as Origin on a POST); before, the router answered it."""
    reply = httpx.post(f"{url}/schedule", json={"estimated_tokens": 10, "models": ["wide"]}, headers=headers)
    assert reply.status_code == status, reply.text
    if status != 200:
        assert in_flight(svc, "wide") == 0 and "detail" in reply.json()


def test_a_name_given_with_allow_host_is_served(svc: Services) -> None:
    core = svc.core.with_lease(LEASE_MS)
    app = asgi(create_app(core, lease_ms=LEASE_MS, bound="127.0.0.1", allow_hosts=["router.example"]))
    with served(app, server.config, read_timeout_s=READ_TIMEOUT_S) as url:
        assert httpx.get(f"{url}/advice", headers={"Host": "router.example:443"}).status_code == 200
        assert httpx.get(f"{url}/advice", headers={"Host": "other.example"}).status_code == 400
