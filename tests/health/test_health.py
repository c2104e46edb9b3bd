"""Health with its reason: the pure reasons on hand-made cases, and a pipeline whose backend
refuses connections, as ``status``, the metrics and the ETA say it (real Redis, PostgreSQL,
Celery processes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from balancer.admission.quota import Quota
from balancer.health.reasons import REASONS, ModelFacts, SourceFacts, assess, blocked, kinds, model_reasons, source_reasons
from balancer.services import Services
from balancer.settings import Settings
from balancer.supervisor import Supervisor, pipeline_plan

#: One hand-made case per reason: every kind of REASONS is reachable from its facts.
CASES: dict[str, ModelFacts | SourceFacts] = {
    "disabled": ModelFacts("m", enabled=False),
    "unreachable": ModelFacts("m", failures=1, last_error="cannot reach backend", unreachable=True),
    "circuit_open": ModelFacts("m", circuit_open=True, paused_s=4, last_error="503 from /solve"),
    "paused": ModelFacts("m", paused_s=2.5),
    "no_consumer": ModelFacts("m", consumers=0),
    "failing": ModelFacts("m", last_error="404 from /solve"),
    "unreadable": SourceFacts("s", read_error="relation \"legacy\" does not exist"),
    "over_budget": SourceFacts("s", over_budget="money"),
    "unwritable": SourceFacts("s", unwritable=2),
    "writeback_failing": SourceFacts("s", writeback_failing=3, writeback_failing_error="permission denied"),
}


@pytest.mark.parametrize("kind", sorted(REASONS))
def test_every_reason_comes_from_its_fact_alone(kind: str) -> None:
    facts = CASES[kind]
    reasons = model_reasons(facts) if isinstance(facts, ModelFacts) else source_reasons(facts)
    assert [r.kind for r in reasons] == [kind]
    assert kind in kinds(REASONS[kind][2])


def test_a_model_with_no_trouble_and_unknown_facts_has_no_reason() -> None:
    assert model_reasons(ModelFacts("m")) == [] and source_reasons(SourceFacts("s")) == []


def test_an_unreachable_backend_is_said_with_its_error_over_the_open_circuit() -> None:
    m = ModelFacts("m", circuit_open=True, paused_s=8, last_error="ConnectError: refused", unreachable=True)
    assert [r.text for r in model_reasons(m)] == ["backend unreachable: ConnectError: refused"]


def test_an_old_failure_without_failures_now_is_not_unreachable() -> None:
    # A refused call long ago, then the circuit's count went back to 0 without an answer (a quota change):
    # the error is still the model's last word, but it no longer blocks.
    m = ModelFacts("m", last_error="ConnectError: refused", unreachable=True)
    assert [r.kind for r in model_reasons(m)] == ["failing"] and blocked([m], pending=1) is None


def test_a_refused_call_stops_saying_unreachable_once_any_model_is_answered(redis_client, namespace: str) -> None:  # noqa: ANN001
    """The backend is one: after a refused call of model-1, a call of model-0 answered through
    it says it is reachable, though model-1 got no call since (before, `status` said "backend
    unreachable" for model-1 until its own next answer, or an hour)."""
    from balancer.admission.live import ModelLive
    from balancer.health.facts import model_facts, note_failure, read_failures

    note_failure(redis_client, namespace, "model-1", "ConnectError: refused", unsent=True, anywhere=4)
    failures = read_failures(redis_client, namespace, ["model-0", "model-1"])
    assert failures["model-1"].answered_anywhere == 4
    view = {n: ModelLive(Quota(n, 1, 60_000), 0, 60_000.0, None, 0) for n in ("model-0", "model-1")}
    facts = {f.name: f for f in model_facts(view, {"model-0": {"solved": 4}}, failures)}
    assert facts["model-1"].unreachable and facts["model-1"].last_error == "ConnectError: refused"
    facts = {f.name: f for f in model_facts(view, {"model-0": {"solved": 5}}, failures)}
    assert not facts["model-1"].unreachable and facts["model-1"].last_error is None
    # A failure that reached the backend (a 404 for that model) is the model's own: it stays.
    note_failure(redis_client, namespace, "model-1", "404 from /solve: unknown model", unsent=False)
    failures = read_failures(redis_client, namespace, ["model-1"])
    assert model_facts(view, {"model-0": {"solved": 9}}, failures)[1].last_error == "404 from /solve: unknown model"


def test_a_worker_notes_a_refused_call_with_every_models_answered_count(twin) -> None:  # noqa: ANN001
    """What a worker records of a failed call (calls.signals.note_failed): for one never sent,
    every model's answered count then; for one that reached the backend, not (it is the model's own)."""
    from balancer.admission import keys
    from balancer.backends import Transient
    from balancer.calls.signals import note_failed
    from balancer.health.facts import read_failures

    for name in ("model-0", "model-1"):
        twin.set_quota(Quota(name, 2, 60_000))
    twin.client.hincrby(keys.stats(twin.namespace, "model-0"), "solved", 3)
    note_failed(twin.core, "model-1", Transient("ConnectError: refused", ended="unsent"))
    note_failed(twin.core, "model-0", Transient("ReadTimeout"))
    failures = read_failures(twin.client, twin.namespace, ["model-0", "model-1"])
    assert failures["model-1"].unsent and failures["model-1"].answered_anywhere == 3
    assert not failures["model-0"].unsent and failures["model-0"].answered_anywhere is None


def test_blocked_only_while_every_model_is_blocked_and_work_waits() -> None:
    stuck, fine, failing = CASES["paused"], ModelFacts("ok"), CASES["failing"]
    assert blocked([stuck], 3) == "blocked: m: paused by a 429 for 2.5 s more"
    assert blocked([stuck, fine], 3) is None
    assert blocked([failing], 3) is None  # its tasks still end (failed): the drain moves
    assert blocked([stuck], 0) is None
    many = [ModelFacts(f"m{i}", enabled=False) for i in range(5)]
    assert blocked(many, 1) == "blocked: m0, m1, m2 and 2 more: quota disabled"  # one reason, said once
    mixed = [*many[:2], ModelFacts("p0", paused_s=3), ModelFacts("p1", paused_s=40), stuck]
    assert blocked(mixed, 1) == ("blocked: m0, m1: quota disabled; p0: paused by a 429 for 3.0 s more; "
                                 "p1: paused by a 429 for 40 s more; 1 more")


def test_assess_keeps_only_the_sources_with_a_reason() -> None:
    h = assess([], [SourceFacts("fine"), CASES["unreadable"]], unfinished=0)  # type: ignore[list-item]
    assert list(h.sources) == ["s"] and h.blocked is None
    assert h.as_dict()["sources"] == {"s": [{"kind": "unreadable", "text": 'table unreadable: relation "legacy" does not exist'}]}


def refused_url() -> tuple[str, socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused, and no one else takes the port
    return f"http://127.0.0.1:{sock.getsockname()[1]}", sock


@pytest.mark.timeout(180)
def test_a_backend_that_refuses_is_said_by_status_metrics_and_the_eta(migrated: dict[str, str], tmp_path: Path) -> None:
    from balancer.views.metrics import BalancerCollector

    url, sock = refused_url()
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("m1", 2, 60_000)], by="test")
    env = {**os.environ, "BALANCER_BACKEND_URL": url, "BALANCER_DISPATCH_TICK": "0.5", "BALANCER_HOME": str(tmp_path)}
    with sock, Supervisor(tmp_path / "logs", env=env) as supervisor:
        supervisor.start_plan(pipeline_plan(None))
        submit = subprocess.run([sys.executable, "-m", "balancer", "submit", "-"], input='{"prompt": "hello"}\n'
                                '{"prompt": "again"}\n', capture_output=True, text=True, env=env, timeout=60)
        assert submit.returncode == 0, submit.stderr
        deadline, status = time.monotonic() + 120, {}
        while time.monotonic() < deadline:
            supervisor.check_alive()
            done = subprocess.run([sys.executable, "-m", "balancer", "status", "--json"], capture_output=True, text=True,
                                  env=env, timeout=60)
            status = json.loads(done.stdout)
            if status["blocked"] and status["health"]["models"].get("m1"):
                break
            time.sleep(0.5)
        reasons = status["health"]["models"].get("m1")
        assert reasons and reasons[0]["kind"] == "unreachable", status
        assert "Connection refused" in reasons[0]["text"] or "ConnectError" in reasons[0]["text"], reasons
        assert status["blocked"].startswith("blocked: m1: backend unreachable") and status["eta_s"] is None
        text = subprocess.run([sys.executable, "-m", "balancer", "status"], capture_output=True, text=True, env=env,
                              timeout=60).stdout
        assert "eta: blocked: m1: backend unreachable" in text and "health m1: backend unreachable" in text, text
        families = {f.name: f for f in BalancerCollector(svc).collect()}
        health = {(s.labels["model"], s.labels["reason"]): s.value for s in families["balancer_model_health"].samples}
        assert health[("m1", "unreachable")] == 1 and health[("m1", "paused")] == 0
        assert families["balancer_drain_blocked"].samples[0].value == 1
        assert not families["balancer_drain_eta_seconds"].samples


def test_a_model_no_worker_consumes_is_no_capacity_and_its_own_tasks_are_said_apart(
        migrated: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An operator stopped the one worker of model b, to which 3 tasks are pinned: the ETA counted
    down beside "no worker consumes model.b", and metrics said nothing waits (an operator's probe).
    Now b is no capacity, its own tasks are left out of the ETA and said apart, as for a disabled
    model; the flexible work keeps its ETA on a."""
    import json as json_module

    from balancer.admission.quota import Quota
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks
    from balancer.cli import main
    from balancer.views.metrics import BalancerCollector

    monkeypatch.setenv("BALANCER_CONSUMERS_REQUIRED", "on")
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("a", 4, 600_000), Quota("b", 4, 600_000)], by="test")
    lines = [{"prompt": f"any {i}"} for i in range(5)] + [{"prompt": f"b {i}", "model": "b"} for i in range(3)]
    rows, errors = parse_tasks("\n".join(json_module.dumps(x) for x in lines), models={"a": 600_000, "b": 600_000})
    assert not errors
    with svc.engine.begin() as conn:
        insert_tasks(conn, rows)
    svc.core.note_consumers("worker-a", ["a"], 60_000)  # a's worker beats; none consumes b

    assert main(["status", "--json"]) == 0
    status = json_module.loads(capsys.readouterr().out)
    assert [r["kind"] for r in status["health"]["models"]["b"]] == ["no_consumer"] and status["blocked"] is None
    assert status["waiting_on_no_model"] == 3 and status["eta_s"] and status["eta_s"] > 0
    assert main(["status"]) == 0
    assert "3 pending task(s) may take only models removed, disabled or stopped (health), not in the eta" in \
        capsys.readouterr().out
    families = {f.name: f for f in BalancerCollector(svc).collect()}
    left_out = {s.labels["reason"]: s.value for s in families["balancer_drain_left_out_tasks"].samples}
    assert left_out == {"budget": 0, "no_model": 3}

    svc.core.note_consumers("worker-b", ["b"], 60_000)  # b's worker is back: its tasks are in the ETA again
    assert main(["status", "--json"]) == 0
    assert json_module.loads(capsys.readouterr().out)["waiting_on_no_model"] == 0
