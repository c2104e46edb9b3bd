"""A failover costs its outage, not a lease (issue 40, item 3): a call that ends while Redis
is unreachable keeps its finish in memory and applies it when Redis answers, so the slots of
calls that ended during the outage are free within seconds of its end.

The Redis is the test's own ``redis-server`` (an append-only file written at every command):
killed while calls run, started again on the same port from its file, holding the leases
as a promoted replica does after a failover."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from balancer.admission.finishes import KeptFinishes
from balancer.admission.values import Admitted, Candidate, Settlement
from balancer.backends import make_backend
from balancer.calls.answers import AnswerWriter
from balancer.calls.heartbeat import Heartbeat
from balancer.devtools.embedded import free_port, redis_server_binary
from balancer.services import Services
from balancer.settings import Settings
from tests.calls.test_solver import MODEL, dispatch_one, faults, message, sim, task_row  # noqa: F401 - fixtures
from tests.solving import chain

pytestmark = pytest.mark.usefixtures("migrated")


class OwnRedis:
    """A redis-server of the test's own on loopback, its data in an append-only file."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.process: subprocess.Popen | None = None
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "redis.conf").write_text("\n".join([
            f"port {self.port}", "bind 127.0.0.1", "protected-mode no", f"dir {folder}", 'save ""',
            "appendonly yes", "appendfsync always"]) + "\n")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> OwnRedis:
        self.process = subprocess.Popen([redis_server_binary(), str(self.folder / "redis.conf")],
                                        stdout=(self.folder / "log").open("ab"), stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    return self
            except (redis.RedisError, OSError):
                assert time.monotonic() < deadline, "the test's redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.kill()


def wait_for(condition, timeout: float, what: str) -> float:  # noqa: ANN001
    started = time.monotonic()
    while True:
        try:
            if condition():
                return time.monotonic() - started
        except (redis.RedisError, OSError):
            pass
        assert time.monotonic() - started < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def test_calls_that_end_while_redis_is_away_free_their_slots_within_seconds_of_its_return(
        own_redis: OwnRedis, sim, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Issue 40 finding 3: calls answered while Redis was away could not free their slots
    ("the slot's lease expires on its own"), and the Redis that came back (a promoted replica)
    held those leases for a whole lease: a 5 s outage cost 30 s of throughput. Here three calls
    end while the test's Redis is down; their answers are written, their finishes are kept,
    and within seconds of Redis answering again (from its file, leases and all) their slots
    are free."""
    url, simulator = sim
    monkeypatch.setenv("BALANCER_BACKEND_URL", url)
    monkeypatch.setenv("BALANCER_BACKEND_TIMEOUT", "10")
    monkeypatch.setenv("BALANCER_LEASE_SECONDS", "60")
    monkeypatch.setenv("BALANCER_REDIS_URL", own_redis.url)
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([dataclasses.replace(MODEL.quota(), slow_start=False)])
    faults(url, hang={"m": 1.5})
    sent = [dispatch_one(svc, {"prompt": f"p{i}", "model": "m", "max_tokens": 20}) for i in range(3)]
    heartbeat, writer = Heartbeat(svc), AnswerWriter(svc.engine)
    backend = make_backend(svc.settings)
    outcomes: list[object] = []
    threads = [threading.Thread(target=lambda a=a: outcomes.append(chain(svc, backend, message(a), heartbeat=heartbeat,
                                                                         writer=writer)), daemon=True) for a in sent]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: all(task_row(svc, a.task_id).status == "running" for a in sent), 10, "the calls' starts")
        wait_for(lambda: svc.core.live()["m"].in_flight == 3, 5, "three slots held")
        # At the backend, so past re-asserting their slots: a call whose slot Redis cannot re-assert is not
        # made (its task back to pending, "no_room"), which a kill between its start and its renew showed.
        wait_for(lambda: simulator.limiters["m"].in_flight == 3, 5, "three calls at the backend")
        own_redis.kill()
        for thread in threads:
            thread.join(15)
        assert sorted(map(str, outcomes)) == ["['solved']"] * 3
        assert all(task_row(svc, a.task_id).status == "solved" for a in sent)
        assert heartbeat.finishes.waiting() == 3
        own_redis.start()
        freed_in = wait_for(lambda: svc.core.live()["m"].in_flight == 0, 10, "the slots freed after Redis returned")
        assert freed_in < 3, freed_in
        # (the last kept finish is dropped just after it is applied)
        wait_for(lambda: heartbeat.finishes.waiting() == 0, 5, "no finish kept any more")
    finally:
        writer.close()
        heartbeat.close()


def test_kept_finishes_are_bounded_and_keep_no_provider_headers(own_redis: OwnRedis) -> None:
    """Issue 40 item 3: what a process keeps for a Redis that does not answer is bounded (the
    oldest dropped first: their leases expire on their own), and a kept finish applies the call's
    tokens but not the provider's remaining-quota headers of its time."""
    core = Services.connect(Settings.from_env()).core
    kept = KeptFinishes(core, retry_s=3600, limit=2)
    for aid in ("a", "b", "c"):
        kept.keep(aid, Settlement(used_tokens=5, reserved_tokens=10, remaining_tokens=1))
    assert kept.waiting() == 2 and kept.dropped == 1
    assert kept.apply() == 2 and kept.waiting() == 0


def test_a_message_taken_while_redis_is_away_goes_back_to_pending_at_once(
        own_redis: OwnRedis, sim, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Issue 40 finding 3: a worker that took a message during the outage could not re-assert
    its slot; the Redis error ended the solve with the task ``running``, and it waited a whole
    lease for the sweep after Redis was back. Now the call is not made, its slot's finish is
    kept, and the task is back to pending at once (no attempt counted)."""
    url, simulator = sim
    monkeypatch.setenv("BALANCER_BACKEND_URL", url)
    monkeypatch.setenv("BALANCER_LEASE_SECONDS", "60")
    monkeypatch.setenv("BALANCER_REDIS_URL", own_redis.url)
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([MODEL.quota()])
    a = dispatch_one(svc, {"prompt": "taken in the outage", "model": "m", "max_tokens": 20})
    own_redis.kill()
    heartbeat = Heartbeat(svc)
    try:
        assert chain(svc, make_backend(svc.settings), message(a), heartbeat=heartbeat) == ["no_room"]
        row = task_row(svc, a.task_id)
        assert (row.status, row.attempts) == ("pending", 0)
        assert simulator.log == []
        assert heartbeat.finishes.waiting() == 1
    finally:
        heartbeat.close()


def test_a_cancelled_call_let_go_while_redis_is_away_is_applied_when_it_returns(
        own_redis: OwnRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hedged task's losing call is cut off (Slot.let_go): its slot is freed (a model that stops
    a call whose client went) or held for what the provider may still count. While Redis was
    unreachable that raised, and the slot waited for its lease's end; now the release is kept and
    applied when Redis answers: the freed slot is free within seconds, the held one still held."""
    from balancer.admission.quota import Quota
    from balancer.calls.call import Slot

    monkeypatch.setenv("BALANCER_LEASE_SECONDS", "60")
    monkeypatch.setenv("BALANCER_REDIS_URL", own_redis.url)
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("stops", 2, 600_000, slow_start=False, on_disconnect="stop"),
                            Quota("finishes", 2, 600_000, slow_start=False)])
    stopped, finishing = (svc.core.admit([Candidate(10, allowed=(m,))])[0] for m in ("stops", "finishes"))
    assert isinstance(stopped, Admitted) and isinstance(finishing, Admitted)
    kept = KeptFinishes(svc.core, retry_s=0.2)
    own_redis.kill()
    Slot(svc.core, stopped.admission_id, kept=kept).let_go(svc, "stops", ran_s=1.0)
    Slot(svc.core, finishing.admission_id, kept=kept).let_go(svc, "finishes", ran_s=1.0)
    assert kept.waiting() == 2
    own_redis.start()
    freed_in = wait_for(lambda: kept.waiting() == 0 and svc.core.live()["stops"].in_flight == 0, 10,
                        "the cut-off call's slot freed after Redis returned")
    assert freed_in < 3, freed_in
    assert svc.core.live()["finishes"].in_flight == 1  # held (charged) for what the provider may still run


def test_a_router_complete_while_redis_is_away_frees_the_slot_when_it_returns(
        own_redis: OwnRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A router caller's /complete while Redis is unreachable was a 503, and the slot waited for
    its lease's end unless the caller retried. Now the router keeps the completion, answers
    ``reason: kept``, and frees the slot within seconds of Redis answering again."""
    import random

    import httpx

    from balancer.admission.quota import Quota
    from balancer.router import server
    from balancer.router.app import asgi, create_app
    from tests.servers import served

    monkeypatch.setenv("BALANCER_REDIS_URL", own_redis.url)
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("solo", 1, 60_000, burst_tokens=20_000, slow_start=False)], by="test")
    lease_ms = 60_000
    app = asgi(create_app(svc.core.with_lease(lease_ms), lease_ms=lease_ms, rng=random.Random(5)))
    with served(app, server.config, read_timeout_s=5.0) as url, httpx.Client(base_url=url, timeout=30) as http:
        granted = http.post("/schedule", json={"estimated_tokens": 100, "models": ["solo"]}).json()
        assert svc.core.live()["solo"].in_flight == 1
        own_redis.kill()
        reply = http.post("/complete", json={"admission_id": granted["admission_id"], "actual_tokens": 80})
        assert reply.status_code == 200 and reply.json() == {"ok": True, "released": False, "reason": "kept"}
        own_redis.start()
        freed_in = wait_for(lambda: svc.core.live()["solo"].in_flight == 0, 10, "the slot freed after Redis returned")
        assert freed_in < 3, freed_in
        again = http.post("/complete", json={"admission_id": granted["admission_id"]}).json()
        assert again["released"] is False  # the kept completion freed it
