"""End to end: real Celery worker subprocesses, real Redis and PostgreSQL, the simulator."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from balancer.cli import main
from balancer.devtools.embedded import free_port
from balancer.devtools.sim.audit import Limits, audit
from balancer.supervisor import wait_for_http
from tests.pipeline_harness import Pipeline, prompt_lines

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("migrated")]


def assert_solved_exactly_once(p: Pipeline, total: int) -> None:
    rows = p.rows()
    assert len(rows) == total
    assert all(r.status == "solved" and r.answer for r in rows), Counter(r.status for r in rows)
    ok_calls = [e for e in p.sim_log() if e["status"] == 200]
    # One successful backend call per task, none repeated, except deliberate hedges
    # (a second call on another model for a straggler; the answer is still written once).
    hedges = sum(r.hedges for r in rows)
    assert total <= len(ok_calls) <= total + hedges
    assert all(r.hedges == 0 or r.hedge_model != r.model or r.hedges == 1 for r in rows)


@pytest.mark.parametrize("accounting", ["reserve", "settle"])
def test_each_accounting_mode_draws_no_429_at_full_load(pipeline, accounting: str) -> None:
    """Against a strict provider of each kind (no grace; `reserve` keeps prompt +
    max_tokens, `settle` refunds the unused part), with quotas set to exactly its
    limits and the matching token_accounting: every model saturated, no 429."""
    p = pipeline(accounting=accounting).start()
    assert {q.token_accounting for q in p.services.quotas.all()} == {accounting}
    ids = p.submit(prompt_lines(400, [m.name for m in p.models], pinned_every=0))
    counts = p.wait_done(len(ids), timeout=180)
    assert counts["solved"] == len(ids) and counts["failed"] == 0
    entries = p.sim_log()
    assert [e for e in entries if e["status"] == 429] == []
    assert p.violations() == []


def test_300_tasks_some_pinned_all_solved_once_within_limits(pipeline) -> None:
    p = pipeline().start()
    names = [m.name for m in p.models]
    lines = prompt_lines(300, names, pinned_every=7)
    ids = p.submit(lines)
    counts = p.wait_done(len(ids), timeout=180)
    assert counts["solved"] == 300 and counts["failed"] == 0
    assert_solved_exactly_once(p, 300)
    for row, line in zip(p.rows(), lines):
        if "model" in line:
            assert row.model == line["model"]  # pinned tasks ran on their model
        assert row.prompt_tokens is not None and row.completion_tokens is not None
    entries = p.sim_log()
    assert [e for e in entries if e["status"] == 429] == []
    assert p.violations() == []
    used = {e["model"] for e in entries}
    assert len(used) == len(names)  # work spread over every model


def test_quota_change_mid_run_is_obeyed_within_a_second(pipeline, capsys: pytest.CaptureFixture[str]) -> None:
    # Time scale 0.25 keeps demand (~60 calls/s) within what one 2-core machine
    # running every component can serve, so admitted calls start at once.
    p = pipeline(time_scale=0.25).start()
    names = [m.name for m in p.models]
    p.submit(prompt_lines(1500, names, pinned_every=0))
    throttled, disabled = "model-5", "model-8"
    deadline = time.monotonic() + 30  # both models serving before the change
    while not {throttled, disabled} <= {e["model"] for e in p.sim_log()}:
        assert time.monotonic() < deadline, "the run never reached both models"
        time.sleep(0.2)
    new_tpm, new_burst = 30_000, 1_000  # 500 tokens/s real time: far below what model-5 was doing
    assert main(["quota", "set", throttled, "--tpm", str(new_tpm), "--burst", str(new_burst)]) == 0
    assert main(["quota", "set", disabled, "--disable"]) == 0
    changed_at = time.time()
    time.sleep(6)
    entries = p.sim_log()
    after = [e for e in entries if e["start"] > changed_at + 1.0 and e["status"] != 429]
    late = sorted(e["start"] - changed_at for e in entries if e["model"] == disabled and e["start"] > changed_at)
    print("disabled model calls after change (s):", [round(x, 2) for x in late])
    assert not [e for e in after if e["model"] == disabled], "disabled model still got new calls"
    before_count = sum(1 for e in entries if e["model"] == throttled and e["start"] < changed_at)
    assert before_count > 0
    throttled_calls = [c for c in p.calls(after) if c.model == throttled]
    # The same rule as every audit here: calls reach the simulator a few ms after
    # admission, so the documented grace (0.5 s of refill) absorbs that jitter.
    limit = Limits(cap=1000, tpm=new_tpm, rpm=None, burst=new_burst, grace=p.grace)
    assert audit(throttled_calls, {throttled: limit}) == []
    assert sum(c.tokens for c in throttled_calls) > 0  # it still served, at the new rate
    assert [e for e in entries if e["status"] == 429] == []


def test_pool_follows_concurrency_changes_without_restart(pipeline) -> None:
    p = pipeline(time_scale=0.05).start(workers=[["--model", "model-2"]])
    app = p.control_app()
    worker = p.supervisor.children[2]
    pid = worker.process.pid

    def pool_size() -> int | None:
        stats = app.control.inspect(timeout=2.0).stats() or {}
        sizes = [s["pool"]["max-concurrency"] for name, s in stats.items() if name.startswith("model-2-")]
        return sizes[0] if sizes else None

    deadline = time.monotonic() + 20
    while pool_size() != 4:
        assert time.monotonic() < deadline, "worker never reported its initial pool"
        time.sleep(0.5)
    ids = p.submit([{"prompt": f"p{i} " + "x " * 50, "model": "model-2", "max_tokens": 64} for i in range(40)])
    for target in (9, 2):
        assert main(["quota", "set", "model-2", "--concurrency", str(target)]) == 0
        changed = time.monotonic()
        while pool_size() != target:
            assert time.monotonic() - changed < 5.0, f"pool did not reach {target} within 5 s"
            time.sleep(0.2)
    counts = p.wait_done(len(ids), timeout=120)
    assert counts["solved"] == 40
    assert worker.process.poll() is None and worker.process.pid == pid  # same process throughout
    assert p.violations() == []


def rabbitmq_url() -> str | None:
    url = os.environ.get("BALANCER_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
    try:
        import kombu

        with kombu.Connection(url, connect_timeout=2) as conn:
            conn.connect()
        return url
    except Exception:
        return None


def delete_queues(url: str, names: set[str]) -> None:
    """Remove the queues this test created (and only those)."""
    import kombu

    with kombu.Connection(url) as conn:
        for name in names:
            try:
                conn.channel().queue_delete(name)
            except Exception:
                pass


def test_same_run_with_rabbitmq_broker(pipeline, request: pytest.FixtureRequest) -> None:
    url = rabbitmq_url()
    if url is None:
        pytest.skip("no RabbitMQ reachable at 127.0.0.1:5672")
    import kombu

    queues = ["control"] + [f"model.model-{i}" for i in range(10)]

    def existing() -> set[str]:
        found = set()
        with kombu.Connection(url) as conn:
            for name in queues:
                try:
                    conn.channel().queue_declare(name, passive=True)
                    found.add(name)
                except Exception:
                    pass
        return found

    before = existing()
    p = pipeline(broker_url=url).start()
    # Stop the workers first: Celery re-declares a queue deleted under its consumer.
    request.addfinalizer(lambda: (p.stop(), delete_queues(url, set(queues) - before)))
    ids = p.submit(prompt_lines(80, [m.name for m in p.models], pinned_every=5))
    counts = p.wait_done(len(ids), timeout=180)
    assert counts == {**counts, "solved": 80, "failed": 0}
    assert_solved_exactly_once(p, 80)
    assert p.violations() == []
    banner = next(c for c in p.supervisor.children if c.name == "worker-0").log.read_text()
    assert "transport:   amqp://" in banner  # the workers really ran on RabbitMQ


def test_flower_lists_model_queues_and_workers(pipeline, tmp_path: Path) -> None:
    p = pipeline().start(workers=[["--model", "model-0", "--model", "model-1"]], beat=False)
    port = free_port()
    log = (tmp_path / "flower.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "balancer.pipeline.app", "flower", f"--port={port}",
         "--address=127.0.0.1", "--basic-auth=alice:s3cret"],
        env=p.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/healthcheck", timeout=30)
        assert httpx.get(f"http://127.0.0.1:{port}/api/workers", timeout=10).status_code == 401
        auth = ("alice", "s3cret")
        deadline = time.monotonic() + 30
        while True:
            workers = httpx.get(f"http://127.0.0.1:{port}/api/workers", params={"refresh": "1"}, auth=auth, timeout=20).json()
            queues = {q["name"] for w in workers.values() for q in w.get("active_queues", []) or []}
            if {"model.model-0", "model.model-1", "control"} <= queues:
                break
            assert time.monotonic() < deadline, f"flower saw workers {list(workers)} queues {queues}"
            time.sleep(1)
        assert any(name.startswith("dispatcher-") for name in workers)
        assert any("model-0" in name for name in workers)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=10)


@pytest.mark.smoke
def test_submit_dispatches_at_once_without_beat(pipeline, tmp_path: Path) -> None:
    """With beat down, nothing ticks: `submit` itself asks for a dispatch, and
    every freed slot asks for the next one, so the whole file is solved."""
    import json

    p = pipeline().start(beat=False)
    lines = prompt_lines(40, [m.name for m in p.models], pinned_every=0)
    file = tmp_path / "tasks.jsonl"
    file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # A process of its own, as a user runs it (this test process's Celery app keeps
    # the broker of the environment it was first imported in).
    proc = subprocess.run([sys.executable, "-m", "balancer", "submit", str(file)], env=p.env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "accepted 40 task(s)" in proc.stdout and "warning" not in proc.stderr
    counts = p.wait_done(40, timeout=120)
    assert counts["solved"] == 40


@pytest.mark.faults
def test_without_beat_the_dispatcher_ticks_and_status_says_so(
    pipeline, capsys: pytest.CaptureFixture[str], reliability
) -> None:
    """Beat never started. Tasks stored straight in PostgreSQL (no submit, so no
    dispatch is asked for) are dispatched by the dispatcher's fallback ticks,
    and `status` reports beat's absence."""
    p = pipeline(extra_env={"BALANCER_DISPATCH_TICK": "0.2"}).start(beat=False)
    started = time.monotonic()
    ids = p.submit(prompt_lines(30, [m.name for m in p.models]))
    counts = p.wait_done(len(ids), timeout=60)
    assert counts["solved"] == len(ids)
    reliability({
        "fault": "beat dead (never started), tasks stored with no dispatch asked for (dispatch tick 0.2 s)",
        "injected": "no beat process; rows inserted straight into PostgreSQL",
        "tasks": len(ids), "lost": len(ids) - counts["solved"], "double_written": "-",
        "repeated_calls": sum(1 for e in p.sim_log() if e["status"] == 200) - len(ids),
        "bound": "the dispatcher's fallback ticks after 5 missed beat ticks; `status` says beat is absent",
        "recovery_s": round(time.monotonic() - started, 1),
        "rate_limited": sum(1 for e in p.sim_log() if e["status"] == 429), "died": "none",
    })
    assert main(["status", "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["beat_last_tick_s"] is None
    # The fallback says so once its grace (5 ticks from the thread's start) is over: a loaded run may have
    # solved everything before, so the log is read until the line comes (a fresh-clone CI run read it first).
    deadline = time.monotonic() + 15
    while "beat has not ticked" not in (logs := (p.log_dir / "dispatcher.log").read_text(errors="replace")):
        assert time.monotonic() < deadline, logs[-2000:]
        time.sleep(0.1)


@pytest.mark.faults
def test_an_all_models_worker_takes_up_a_model_created_after_it_started(pipeline, reliability) -> None:
    p = pipeline()
    late, p.models = p.models[-1], p.models[:-1]  # the simulator serves it; no quota yet
    p.start()
    first = p.submit(prompt_lines(5, [m.name for m in p.models], pinned_every=1))
    p.wait_done(len(first), timeout=60)  # the worker is up, consuming the queues it started with
    quota = late.quota(time_scale=p.time_scale)
    p.services.quotas.set(late.name, {k: v for k, v in quota.as_dict().items() if k != "name"}, create=True)
    p.models.append(late)
    ids = p.submit(prompt_lines(20, [late.name], pinned_every=1))
    counts = p.wait_done(len(first) + len(ids), timeout=60)
    assert counts["solved"] == len(first) + len(ids)
    assert sum(1 for e in p.sim_log() if e["status"] == 200 and e["model"] == late.name) == len(ids)
    assert p.violations() == []
    reliability({
        "fault": "a model created while `worker --all-models` runs",
        "injected": "`quota set --create` after the worker started; 20 tasks pinned to the new model",
        "tasks": len(ids), "lost": len(ids) + len(first) - counts["solved"], "double_written": "-",
        "repeated_calls": sum(1 for e in p.sim_log() if e["status"] == 200) - len(ids) - len(first),
        "bound": "the worker consumes the new queue within a second (quota watcher)", "recovery_s": "-",
        "rate_limited": sum(1 for e in p.sim_log() if e["status"] == 429), "died": "none",
    })
