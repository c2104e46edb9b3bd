"""The pipeline across real hosts with real network faults (issue 40, items 6 and 2).

Hosts are Linux network namespaces on a bridge (tests/hosts.py), on addresses of
the test's own: a Redis master (with a Sentinel), its replica (with a Sentinel), a
dispatcher host (dispatcher, beat and the third Sentinel), two worker hosts each
serving five of the simulator's ten models (a ``balancer worker --model M`` process per model), and
the simulator on a host of its own. PostgreSQL is this machine's (or the embedded one), reached through a
TCP proxy the test runs on its address on the bridge. Every balancer process reads
Redis and the broker through Sentinel (``sentinel://…``).

Three batches of the same work run one after another on the same processes:
without a fault; with the Redis master killed (SIGKILL); with a worker host cut off for
longer than a lease. After each, at the simulator and in PostgreSQL (a trigger logs
every write), the chaos witness (balancer.bench.chaos.witness) finds 0 tasks lost, 0
answers written twice, 0 overlapping calls, 0 429s and no call over a cap, and
the batch's makespan is within the bound stated below of the fault-free batch's.
No process is restarted. The figures are printed (``-s``) for docs/production.md.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests import hosts
from tests.sentinels import Node, RedisGroup, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

#: The run's size. The defaults keep the test within two minutes; the ``HOSTS_*`` variables run it
#: larger for docs/reliability.md (1,000 tasks a batch, the default 30 s lease, a 150 s cut as in
#: issue 40, longer than the batch), with the command given there.
TIME_SCALE = float(os.environ.get("HOSTS_TIME_SCALE", "0.05"))
MODELS = 10
TASKS = int(os.environ.get("HOSTS_TASKS", "120"))
WARM_UP = 30
#: A short lease keeps a cut "longer than a lease" within the test's two minutes (the default is 30 s);
#: shorter than this, calls on a loaded 2-core machine lost their leases with no fault at all.
LEASE_S = int(os.environ.get("HOSTS_LEASE_S", "10"))
CUT_S = float(os.environ.get("HOSTS_CUT_S", LEASE_S + 3))
#: How long a batch may take once its fault has ended.
BATCH_TIMEOUT_S = float(os.environ.get("HOSTS_BATCH_TIMEOUT_S", "120"))
#: Seconds into a batch when its fault starts: 2 s, as in issue 40's runs, or a quarter of the
#: fault-free batch if that is sooner (at the default size a batch takes 2-4 s, and a fault after its
#: end would test nothing).
FAULT_AT_S = 2.0
#: The stated bounds: issue 40's targets (a cut: 1.5 times the fault-free makespan; a master killed:
#: the fault-free makespan + twice the outage) and a slack for a loaded 2-core machine. A cut host's
#: models are known unconsumed within 3 s (a consumer record's life), its queued tasks go back at
#: once and its running calls are hedged on the other host's models: at the default size, where a
#: batch takes 2-4 s, those 3 s are most of the batch. A message the failover lost goes back within
#: seconds (balancer.dispatch.lost), not after a lease. docs/production.md has the runs.
SLACK_S = 10.0


def cut_bound(no_fault_s: float) -> float:
    return 1.5 * no_fault_s + SLACK_S


def kill_bound(no_fault_s: float, outage_s: float) -> float:
    return no_fault_s + 2 * outage_s + SLACK_S


@pytest.fixture
def network() -> Any:
    reason = hosts.why_not()
    if reason:
        pytest.skip(f"real hosts need network namespaces: {reason}")
    hosts.remove_stale()
    net = hosts.Network().create()
    try:
        yield net
    finally:
        net.remove()


def test_the_pipeline_across_hosts_survives_a_cut_worker_host_and_a_killed_redis_master(
        network: hosts.Network, migrated: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks
    from balancer.bench.chaos.run import WRITE_LOG_SQL
    from balancer.bench.chaos.witness import FaultWindow, TaskRow, WriteEvent, overlapping_calls, witness
    from balancer.bench.compare.bounds import lines_bound
    from balancer.devtools.sim.audit import limits_for
    from balancer.devtools.sim.config import default_models
    from balancer.devtools.sim.provider import prompt_key
    from balancer.devtools.tcpproxy import StallProxy
    from balancer.services import Services
    from balancer.settings import Settings
    from balancer.supervisor import Supervisor, wait_for_http
    from tests.pipeline_harness import prompt_lines

    net = network
    for name, octet in (("redis-a", 11), ("redis-b", 12), ("dispatch", 13), ("worker-1", 21), ("worker-2", 22),
                        ("sim", 31)):
        net.add_host(name, octet)
    a, b, d = net.hosts["redis-a"], net.hosts["redis-b"], net.hosts["dispatch"]
    group = RedisGroup(tmp_path / "redis", Node("master", a, 6379, net.launch("redis-a")),
                       Node("replica", b, 6379, net.launch("redis-b")),
                       [Node("sentinel-a", a, 26379, net.launch("redis-a")),
                        Node("sentinel-b", b, 26379, net.launch("redis-b")),
                        Node("sentinel-d", d, 26379, net.launch("dispatch"))])
    proxy = StallProxy.for_database(migrated["BALANCER_DATABASE_URL"], host=net.gateway).start()
    supervisor = Supervisor(tmp_path / "logs", env={**os.environ}).__enter__()
    try:
        group.start()
        with sa.create_engine(migrated["BALANCER_DATABASE_URL"]).begin() as conn:
            for statement in WRITE_LOG_SQL:
                conn.execute(sa.text(statement))
        sim_url = f"http://{net.hosts['sim']}:8900"
        hosts_env = {"BALANCER_REDIS_URL": group.url(), "BALANCER_BACKEND_URL": sim_url,
                     "BALANCER_DATABASE_URL": proxy.database_url(migrated["BALANCER_DATABASE_URL"]),
                     "BALANCER_LEASE_SECONDS": str(LEASE_S), "BALANCER_SWEEP_TICK": "2", "BALANCER_DISPATCH_TICK": "0.5",
                     "BALANCER_CONSUMERS_REQUIRED": os.environ.get("HOSTS_CONSUMERS_REQUIRED", "on")}
        monkeypatch.setenv("BALANCER_REDIS_URL", group.url())  # the test's own reads: this Redis, through Sentinel
        services = Services.connect(Settings.from_env())
        models = list(default_models(MODELS))
        services.quotas.replace_all([m.quota(time_scale=TIME_SCALE) for m in models], by="test")
        names = [m.name for m in models]

        sim = supervisor.start("sim", ["sim", "--host", net.hosts["sim"], "--port", "8900", "--models", str(MODELS),
                                       "--time-scale", str(TIME_SCALE), "--untagged-draws"], hosts_env, net.launch("sim"))
        wait_for_http(f"{sim_url}/models", child=sim, timeout=60)
        supervisor.start("dispatcher", ["dispatcher", "--loglevel", "INFO"], hosts_env, net.launch("dispatch"))
        supervisor.start("beat", ["beat", "--loglevel", "INFO"], {**hosts_env, "BALANCER_HOME": str(tmp_path / "beat")},
                         net.launch("dispatch"))
        served = {"worker-1": names[:5], "worker-2": names[5:]}
        for host, own in served.items():
            for model in own:  # a process per model: one per host would hold a host's share to one core
                supervisor.start(f"{host}-{model}", ["worker", "--model", model, "--loglevel", "INFO"], hosts_env,
                                 net.launch(host))
        pids = [c.process.pid for c in supervisor.children]

        def batch_lines(batch: int, count: int = TASKS) -> list[dict[str, Any]]:
            """The measured batches are the same work under their own tags: the simulator draws a
            tagged prompt's latency and length as the untagged one's (``--untagged-draws``), so a
            batch with a fault is compared with the same run without it, not with other dice."""
            lines = prompt_lines(count, names, pinned_every=0, seed=min(batch, 1))
            for line in lines:
                line["prompt"] = f"[batch-{batch}] {line['prompt']}"
            return lines

        batch_times: dict[int, float] = {}

        def submit(batch: int, count: int = TASKS) -> tuple[list[int], float]:
            lines = batch_lines(batch, count)
            rows, errors = parse_tasks("\n".join(json.dumps(line) for line in lines),
                                       models={q.name: q.burst for q in services.quotas.all()})
            assert not errors
            with services.engine.begin() as conn:
                ids = insert_tasks(conn, rows)
            batch_times[batch] = time.time()
            return ids, batch_times[batch]

        def makespan(ids: list[int], submitted: float, timeout: float) -> float:
            def ended() -> float | None:
                supervisor.check_alive()
                with services.engine.connect() as conn:
                    left = conn.execute(sa.text("SELECT count(*) FROM tasks WHERE id = ANY(:ids) AND status NOT IN "
                                                "('solved', 'failed', 'cancelled')"), {"ids": ids}).scalar_one()
                    if left:
                        return None
                    return conn.execute(sa.text("SELECT extract(epoch FROM max(at)) FROM chaos_writes WHERE "
                                                "task_id = ANY(:ids)"), {"ids": ids}).scalar_one()
            last = wait_until(ended, timeout, "every task of the batch ended", step=0.25)
            return float(last) - submitted  # type: ignore[arg-type]

        figures: dict[str, float] = {}
        ids, at = submit(0, WARM_UP)  # the first calls of a run wait on cold starts: not measured
        makespan(ids, at, 90)
        ids, at = submit(1)
        figures["no fault"] = makespan(ids, at, BATCH_TIMEOUT_S)
        fault_at_s = min(FAULT_AT_S, figures["no fault"] / 4)

        ids, at = submit(2)
        time.sleep(max(0.0, at + fault_at_s - time.time()))
        killed_at = time.time()
        died = group.kill_master()
        group.wait_failover()
        outage = wait_until(lambda: services.redis.ping() and time.monotonic() - died, 60, "Redis back through Sentinel")
        back_at = time.time()
        figures["redis master killed"] = makespan(ids, at, BATCH_TIMEOUT_S)
        figures["outage"] = float(outage)  # type: ignore[arg-type]

        # The cut comes last: a cut longer than the backend's timeout ends with the cut host's calls
        # timing out at the heal, which opens those models' circuits for a while; a batch after it
        # would be charged for that.
        ids, at = submit(3)
        time.sleep(max(0.0, at + fault_at_s - time.time()))
        cut_at = time.time()
        net.cut("worker-1")
        time.sleep(CUT_S)
        net.heal("worker-1")
        healed_at = time.time()
        figures["worker host cut"] = makespan(ids, at, BATCH_TIMEOUT_S)
        # The capacity bound of each batch (balancer.estimates.capacity): the cut batch's counts the cut
        # host's models only until the cut. Their ratio is what the cut alone costs at the same pace.
        bounds = {"no fault": lines_bound(models, batch_lines(1), seed=0, time_scale=TIME_SCALE),
                  "worker host cut": lines_bound(models, batch_lines(1), seed=0, time_scale=TIME_SCALE,
                                                 lost_at_s=dict.fromkeys(served["worker-1"], cut_at - at))}

        assert [c.process.pid for c in supervisor.children] == pids  # none restarted, none exited
        entries = httpx.get(f"{sim_url}/log", timeout=30).json()["entries"]
        # kept beside the processes' logs for a failure's trace: every call, and each batch's times
        (tmp_path / "logs" / "calls.json").write_text(json.dumps({"calls": entries, "batches": batch_times,
                                                                           "killed_at": killed_at, "cut_at": cut_at}))
        with services.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT id, prompt, status, error FROM tasks")).all()
            writes = conn.execute(sa.text("SELECT task_id, old_status, new_status, answer_written, extract(epoch FROM at) "
                                          "FROM chaos_writes")).all()
            hedges = conn.execute(sa.text("SELECT coalesce(sum(hedges), 0) FROM tasks")).scalar_one()
        caps = {m.name: [(0.0, m.max_concurrent_requests)] for m in models}
        task_of = {prompt_key(r.prompt): r.id for r in rows}
        same_model = [o for m in names for o in overlapping_calls([c for c in entries if c["model"] == m], task_of, [])]
        report = witness(
            entries, [TaskRow(r.id, prompt_key(r.prompt), r.status, r.error) for r in rows],
            [WriteEvent(w[0], w[1], w[2], bool(w[3]), float(w[4])) for w in writes],
            expected_tasks=3 * TASKS + WARM_UP, quota_caps=caps,
            provider=limits_for([replace(m.quota(time_scale=TIME_SCALE)) for m in models]),
            faults=[FaultWindow("cut worker-1", "partition", cut_at, healed_at),
                    FaultWindow("kill redis master", "redis_restart", killed_at, back_at)],
            kills=[], deaths=[])
        print(f"\nmakespans (s): {', '.join(f'{k} {v:.1f}' for k, v in figures.items())}; calls {len(entries)}, "
              f"repeats {len(report.repeats)}, overlaps {len(report.overlaps)} (hedges {hedges}, on one model {same_model}), "
              f"429s {report.rate_limited}, "
              f"ended {report.ended}, bounds: cut {cut_bound(figures['no fault']):.1f}, "
              f"kill {kill_bound(figures['no fault'], figures['outage']):.1f}; capacity bounds (s): "
              f"{', '.join(f'{k} {v:.1f} (utilization {v / figures[k]:.2f})' for k, v in bounds.items())}, "
              f"the cut's own cost {bounds['worker host cut'] / bounds['no fault']:.2f} times")
        assert report.lost == 0 and report.tasks == 3 * TASKS + WARM_UP, report.ended
        assert report.ended.get("solved") == 3 * TASKS + WARM_UP, report.ended
        assert report.double_written == 0 and not report.ended_twice
        # A hedge calls its task on another model while the first call runs: on purpose, and at
        # most once per hedge PostgreSQL counted. Two calls of one task at once on one model: never.
        assert same_model == [], same_model
        assert len(report.overlaps) <= hedges, (report.overlaps, hedges)
        assert report.rate_limited == {}, report.rate_limited
        assert report.quota_breaches == [] and report.provider_violations == [], (report.quota_breaches,
                                                                                  report.provider_violations[:5])
        assert figures["worker host cut"] <= cut_bound(figures["no fault"]), figures
        assert figures["redis master killed"] <= kill_bound(figures["no fault"], figures["outage"]), figures
    finally:
        supervisor.stop_all()
        group.stop()
        proxy.close()
