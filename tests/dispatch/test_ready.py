"""Ready lists in the dispatcher: stocked for busy models while the backlog is
long, taken into free slots, returned to pending when they can no longer run.
Real Redis and PostgreSQL; the solve side is in test_solver.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import sqlalchemy as sa

from balancer.admission.quota import Quota
from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import parse_tasks
from balancer.dispatch.dispatcher import Assignment, dispatch
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import tasks

pytestmark = pytest.mark.usefixtures("migrated")

#: One slot, 50 ms calls: a ready list of one; a backlog of a few tasks outlasts a call.
BUSY = Quota("m", 1, 600_000, expected_latency_s=0.05, slow_start=False)
OTHER = Quota("n", 4, 600_000, expected_latency_s=0.05, slow_start=False)


@pytest.fixture
def svc(monkeypatch: pytest.MonkeyPatch) -> Services:
    monkeypatch.setenv("BALANCER_READY_PER_SLOT", "1")  # one ready task per slot: the counts below
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([BUSY, OTHER])
    return services


def add_tasks(svc: Services, n: int, model: str | None = "m") -> list[int]:
    line = {"prompt": "p"} | ({"model": model} if model else {})
    rows, errors = parse_tasks("".join(json.dumps(line) + "\n" for _ in range(n)), models={q.name: q.burst for q in svc.quotas.all()})
    assert not errors
    with svc.engine.begin() as conn:
        return insert_tasks(conn, rows)


def statuses(svc: Services) -> dict[int, tuple[str, str | None]]:
    with svc.engine.connect() as conn:
        return {r.id: (r.status, r.admission_id) for r in conn.execute(sa.select(tasks.c.id, tasks.c.status, tasks.c.admission_id))}


def test_a_busy_model_gets_a_ready_list_and_a_free_slot_takes_it(svc: Services) -> None:
    ids = add_tasks(svc, 8)
    sent: list[Assignment] = []
    report = dispatch(svc, sent.extend)
    assert [a.task_id for a in sent] == ids[:1]  # one slot
    assert report.stocked == 1 and svc.core.live()["m"].ready == 1
    ready_task = ids[1]
    status, lid = statuses(svc)[ready_task]
    assert status == "ready" and lid is not None  # claimed: no other round takes it
    assert statuses(svc)[ids[0]] == ("queued", sent[0].admission_id)  # published: queued, not ready
    # A second round stocks nothing more (the list is full) and admits nothing (no slot).
    more: list[Assignment] = []
    assert dispatch(svc, more.extend).stocked == 0 and more == []
    # The slot frees without a finish taking the next call (a failed call, say):
    # the next round admits the ready task first, under the admission id it was stocked with.
    svc.core.release(sent[0].admission_id)
    report = dispatch(svc, more.extend)
    assert more[0] == Assignment(ready_task, "m", lid, more[0].estimated_tokens)
    assert report.admitted == 1 and report.stocked == 1  # and the list is stocked again


def test_nothing_is_stocked_near_the_end_of_the_backlog(svc: Services) -> None:
    """Two tasks for a one-slot model: the one left pending is the end game's to
    place, not the ready list's."""
    ids = add_tasks(svc, 2)
    report = dispatch(svc, [].extend)
    assert report.stocked == 0 and svc.core.live()["m"].ready == 0
    assert statuses(svc)[ids[1]][0] == "pending"


def test_lists_for_concurrency_bound_models_only_and_none_when_turned_off(svc: Services) -> None:
    tpm_bound = Quota("t", 4, 1_200, expected_latency_s=0.05, slow_start=False)  # a task's estimate is a fifth of the bucket
    svc.quotas.replace_all([BUSY, OTHER, tpm_bound])
    add_tasks(svc, 20, model="n")  # four slots: four running, four ready (one per slot)
    add_tasks(svc, 20, model="t")  # tokens bind it: its bucket runs low, so no list
    report = dispatch(svc, [].extend)
    view = svc.core.live()
    assert view["n"].ready == 4 and view["t"].ready == 0 and report.stocked == 4
    assert view["t"].in_flight > 0  # it did take work, through admission
    off = dataclasses.replace(svc, settings=dataclasses.replace(svc.settings, ready_per_slot=0.0))
    add_tasks(svc, 8)
    assert dispatch(off, [].extend).stocked == 0 and svc.core.live()["m"].ready == 0


def test_a_disabled_models_ready_tasks_go_back_to_pending(svc: Services) -> None:
    ids = add_tasks(svc, 8)
    dispatch(svc, [].extend)
    assert statuses(svc)[ids[1]][0] == "ready"
    svc.quotas.set("m", {"enabled": False})
    report = dispatch(svc, [].extend)
    assert report.unstocked == 1 and svc.core.live()["m"].ready == 0
    assert statuses(svc)[ids[1]] == ("pending", None)


def test_an_expired_ready_task_goes_back_to_pending(svc: Services) -> None:
    ids = add_tasks(svc, 8)
    dispatch(svc, [].extend)
    status, lid = statuses(svc)[ids[1]]
    assert status == "ready"
    seconds, micros = svc.core.redis.time()
    svc.core.clock = lambda: seconds * 1000 + micros // 1000 + 6_000  # past the entry's 5 s (the lease's 60 s are not)
    no_stocking = dataclasses.replace(svc, settings=dataclasses.replace(svc.settings, ready_per_slot=0.0))
    try:
        report = dispatch(no_stocking, [].extend)
    finally:
        svc.core.clock = None
    assert report.unstocked == 1 and svc.core.live()["m"].ready == 0
    assert statuses(svc)[ids[1]] == ("pending", None)


def test_the_drain_eta_counts_ready_tasks(svc: Services) -> None:
    """A ready task is neither pending nor in flight, but still its model's work."""
    from balancer.views.summary import estimate_drain

    add_tasks(svc, 12)
    dispatch(svc, [].extend)
    view = svc.core.live()
    assert view["m"].ready == 1
    without = {name: dataclasses.replace(m, ready=0) for name, m in view.items()}
    eta, eta_without = estimate_drain(svc, view), estimate_drain(svc, without)
    assert eta is not None and eta_without is not None and eta > eta_without


def test_the_drain_eta_counts_a_not_yet_measured_models_ready_tasks_as_anyones(
    svc: Services, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a model still on the 30 s global prior, ready tasks weigh exactly as
    as many more pending tasks that any model may take, not as that model's
    own last calls (the prior put tail.toml's ETA 67 % out at 25 % done)."""
    from balancer.backlog.reads import backlog
    from balancer.views.summary import estimate_drain

    monkeypatch.setenv("BALANCER_READY_PER_SLOT", "3")
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("u", 4, 600_000), Quota("s", 2, 600_000, expected_latency_s=1)])
    add_tasks(svc, 140, model=None)
    dispatch(svc, [].extend)
    view = svc.core.live()
    assert view["u"].ready == 4 and not view["u"].latency_known
    left = backlog(svc.engine)
    [(_, pending, tokens)] = left.pending_groups()
    # u's 4 ready tasks counted as 4 pending ones instead (as many tasks not finished as before)
    as_pending = dataclasses.replace(left, groups=(*left.groups, ("pending", None, 4, 4 * (tokens // pending), 0),
                                                   ("ready", None, -4, 0, 0)))
    assert as_pending.unfinished == left.unfinished
    without = {name: dataclasses.replace(m, ready=0) for name, m in view.items()}
    eta, eta_as_pending = estimate_drain(svc, view, left), estimate_drain(svc, without, as_pending)
    assert eta is not None and eta == pytest.approx(eta_as_pending, rel=0.05)  # 44 % more, counted as u's own
    own = {name: dataclasses.replace(m, quota=dataclasses.replace(m.quota, expected_latency_s=30))
           for name, m in view.items()}  # once u's latency is known, they are its own work
    assert estimate_drain(svc, own, left) > eta * 1.1


def test_a_restore_after_redis_lost_its_data_seeds_no_lease_for_a_ready_task(svc: Services) -> None:
    """No call runs under a ready entry: after the loss it must not hold a slot."""
    from balancer.services import delete_namespace_keys

    ids = add_tasks(svc, 12)
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    assert svc.core.live()["m"].ready == 1 and len(sent) == 1
    ready_status, ready_lid = statuses(svc)[ids[1]]
    assert ready_status == "ready" and statuses(svc)[ids[0]][0] == "queued"
    delete_namespace_keys(svc.redis, svc.settings.namespace)  # Redis lost everything
    svc.core.restore()
    view = svc.core.live()
    assert view["m"].in_flight == 1 and view["m"].ready == 0  # the dispatched call's lease only
    assert set(svc.core.raw_state()["leases"]) == {sent[0].admission_id}  # not ready_lid
    assert ready_lid not in svc.core.raw_state()["leases"]


def test_a_run_that_stocks_in_its_first_round_and_stops_there_does_not_stock_again(svc: Services) -> None:
    """The run's last view was read before its own stock: stocking from it again
    would put twice the list's depth on it."""
    tpm_bound = Quota("t", 4, 300, expected_latency_s=0.05)  # one task's estimate drains its bucket
    svc.quotas.replace_all([BUSY, tpm_bound])
    add_tasks(svc, 12)
    add_tasks(svc, 4, model="t")
    no_stocking = dataclasses.replace(svc, settings=dataclasses.replace(svc.settings, ready_per_slot=0.0))
    dispatch(no_stocking, [].extend)  # m's one slot and t's tokens are taken
    report = dispatch(svc, [].extend)  # t waits for tokens: its first round admits nothing
    assert report.rounds == 1 and report.admitted == 0
    assert svc.core.live()["m"].ready == 1 == report.stocked  # one slot, one per slot


def test_a_model_not_measured_yet_keeps_one_ready_task_per_slot(svc: Services, monkeypatch: pytest.MonkeyPatch) -> None:
    """No calls measured and no latency in its quota: one per slot (not three,
    not none from the 30 s global prior), so the first calls' ends take their
    next from the list. A model whose quota says its calls are slow keeps none."""
    monkeypatch.setenv("BALANCER_READY_PER_SLOT", "3")
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("u", 4, 600_000, slow_start=False), Quota("s", 2, 600_000, expected_latency_s=30, slow_start=False)])
    add_tasks(svc, 60, model=None)
    report = dispatch(svc, [].extend)
    assert report.admitted == 6
    live = svc.core.live()
    assert (live["u"].ready, live["s"].ready) == (4, 0)
