"""Solve messages the broker lost (a Redis failover loses what its replica had not yet got):
their tasks go back to pending within seconds, not after a lease and a sweep (issue 40,
target "Redis master killed with Sentinel: makespan <= the same run + 2x the outage").

Real Redis as the broker, messages published by Celery; the last test runs real processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.admission import keys
from balancer.admission.quota import Quota
from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import parse_tasks
from balancer.calls.heartbeat import mark_live
from balancer.devtools.runner import control_app
from balancer.dispatch.dispatcher import Assignment, dispatch
from balancer.dispatch.lost import GRACE_S, LostMessages, admission_of
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import tasks
from tests.admission.test_consumers import wait_until

pytestmark = pytest.mark.usefixtures("migrated")


def status_of(svc: Services, task_id: int) -> str:
    with svc.engine.connect() as conn:
        return conn.execute(sa.select(tasks.c.status).where(tasks.c.id == task_id)).scalar_one()


def queued_ago(svc: Services, task_ids: list[int], seconds: float) -> None:
    """As if these tasks had been queued ``seconds`` ago."""
    with svc.engine.begin() as conn:
        conn.execute(sa.update(tasks).where(tasks.c.id.in_(task_ids))
                     .values(queued_at=sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds)))


def services_with_model_m() -> Services:
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("m", 10, 600_000, slow_start=False)])
    return svc


def submit_to_m(svc: Services, n: int) -> list[int]:
    rows, errors = parse_tasks("\n".join(json.dumps({"prompt": f"p{i}", "model": "m"}) for i in range(n)),
                               models={"m": 600_000})
    assert not errors
    with svc.engine.begin() as conn:
        return insert_tasks(conn, rows)


def test_only_a_message_in_no_queue_and_held_by_no_live_worker_is_returned(env: dict[str, str]) -> None:
    """Four queued tasks, their messages published by Celery to model.m: one still waits in the
    queue, one was delivered to a worker (unacknowledged), one's call a worker keeps alive, one's
    message is gone. Only the last goes back to pending (its lease withdrawn); the delivered one
    follows only once a heartbeat interval past the grace has passed with no worker keeping it."""
    svc = services_with_model_m()
    submit_to_m(svc, 4)
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    assert len(sent) == 4
    app = control_app("balancer-test-lost")
    with app.producer_or_acquire() as producer:
        for a in sent:
            app.send_task(keys.SOLVE_TASK, args=[a.task_id, a.admission_id, a.model, a.estimated_tokens, a.hedge],
                          queue=keys.model_queue(a.model), producer=producer)
    ns, queue = svc.settings.namespace, keys.broker_queue(svc.settings.namespace, keys.model_queue("m"))
    waiting, delivered, alive, gone = sent
    messages = {admission_of(raw): raw for raw in svc.redis.lrange(queue, 0, -1)}
    assert set(messages) == {a.admission_id for a in sent}
    for a in (delivered, alive, gone):
        svc.redis.lrem(queue, 1, messages[a.admission_id])
    raw = messages[delivered.admission_id]
    svc.redis.hset(keys.broker_unacked(ns), "tag-1", json.dumps([json.loads(raw), "", "model.m"]))
    mark_live(svc.redis, ns, [alive.admission_id], [], svc.settings.lease_seconds * 1000)
    check = LostMessages()
    assert check.check(svc, now=0.0) == []  # just queued: within the grace
    queued_ago(svc, [a.task_id for a in sent], GRACE_S + 1)
    assert check.check(svc, now=0.5) == []  # at most one look every CHECK_S
    assert check.check(svc, now=10.0) == [(gone.task_id, gone.admission_id)]
    assert [status_of(svc, a.task_id) for a in sent] == ["queued", "queued", "queued", "pending"]
    assert svc.core.live()["m"].in_flight == 3
    queued_ago(svc, [delivered.task_id, alive.task_id], svc.settings.heartbeat_seconds + GRACE_S + 1)
    assert check.check(svc, now=20.0) == [(delivered.task_id, delivered.admission_id)]
    assert [status_of(svc, a.task_id) for a in sent] == ["queued", "pending", "queued", "pending"]
    assert svc.core.live()["m"].in_flight == 2


def test_a_ready_task_whose_list_entry_redis_lost_is_returned(env: dict[str, str]) -> None:
    """Issue 40's Redis master killed at the issue's size: six ready tasks of one model waited a
    ready list's life and a lease (+27 s for a 1.6 s outage) for the sweep: their list entries
    were gone after the failover (stocked, or taken by a call whose reply never came), and they
    were ``ready`` in PostgreSQL. Now a task ready past the grace whose entry is on no list, in no
    queue and held by no live worker, in two looks in a row, goes back to pending; one on its list,
    one whose call a worker keeps alive and one the dispatcher took and published (its message
    waits in model.m) stay."""
    from balancer.backlog.ready import mark_ready

    svc = services_with_model_m()
    listed, alive, published, gone = ids = submit_to_m(svc, 4)
    with svc.engine.begin() as conn:
        mark_ready(conn, [(task_id, "m", f"r{task_id}") for task_id in ids], 60)
    assert svc.core.stock([("m", task_id, 100, f"r{task_id}") for task_id in ids], 60_000) == [True] * 4
    ready = keys.ready(svc.settings.namespace, "m")
    for entry in svc.redis.lrange(ready, 0, -1):
        if entry.split(b":")[0] != str(listed).encode():
            svc.redis.lrem(ready, 1, entry)
    mark_live(svc.redis, svc.settings.namespace, [f"r{alive}"], [], svc.settings.lease_seconds * 1000)
    control_app("balancer-test-lost").send_task(keys.SOLVE_TASK, args=[published, f"r{published}", "m", 100, False],
                                                queue=keys.model_queue("m"))
    check = LostMessages()
    assert check.check(svc, now=0.0) == []  # just stocked: within the grace
    queued_ago(svc, ids, GRACE_S + 1)
    assert check.check(svc, now=10.0) == []  # one look could fall between a worker's take and its start
    assert check.check(svc, now=20.0) == [(gone, f"r{gone}")]
    assert [status_of(svc, task_id) for task_id in ids] == ["ready", "ready", "ready", "pending"]


@pytest.mark.e2e
def test_a_message_deleted_from_its_queue_is_solved_within_seconds_not_a_lease(tmp_path: Path) -> None:
    """Real dispatcher, beat, workers and provider, a 60 s lease. Three tasks wait for a
    model whose worker is not up yet; the messages published for them are deleted from the broker's list (as a
    failover loses them), then the worker starts. Each task is answered within seconds, called
    once (before: each waited for its deadline, 60 s, and a sweep tick)."""
    from tests.pipeline_harness import Pipeline

    pipeline = Pipeline(tmp_path / "logs", model_count=2, extra_env={"BALANCER_LEASE_SECONDS": "60"})
    try:
        pipeline.start(workers=[["--model", "model-0"]])
        svc = pipeline.services
        ids = pipeline.submit([{"prompt": f"lost {i}", "model": "model-1", "max_tokens": 20} for i in range(3)])
        queue = keys.broker_queue(svc.settings.namespace, keys.model_queue("model-1"))
        wait_until(lambda: svc.redis.llen(queue) >= 1, 30, "messages in model.model-1")  # slow start: one at first
        assert svc.redis.delete(queue) == 1
        deleted = time.monotonic()
        pipeline.supervisor.start("worker-1", ["worker", "--model", "model-1", "--loglevel", "INFO"])
        pipeline.wait_done(3, timeout=30)
        answered_in = time.monotonic() - deleted
        assert all(status_of(svc, i) == "solved" for i in ids)
        prompts = sorted(e["prompt_key"] for e in pipeline.sim_log() if e["model"] == "model-1")
        assert len(prompts) == 3 and len(set(prompts)) == 3, prompts
        print(f"\nlost messages' tasks answered {answered_in:.1f} s after the deletion (lease 60 s)")
        assert answered_in < 25
    finally:
        pipeline.stop()
