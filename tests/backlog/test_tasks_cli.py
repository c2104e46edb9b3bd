"""``balancer tasks list|show|retry|cancel``: filters, dry runs, the audit, and never a held task."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import parse_tasks
from balancer.backlog.operations import operations
from balancer.backlog.reads import status_counts
from balancer.cli import main
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import tasks


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def backlog(migrated: dict[str, str]) -> tuple[Services, dict[str, list[int]]]:
    """Twelve tasks: 3 failed on "a", 3 running on "a", 3 pending from "crm", 3 solved."""
    svc = Services.connect(Settings.from_env())
    svc.quotas.set("a", {"max_concurrent_requests": 2, "max_tokens_per_minute": 60_000}, create=True, by="test")
    svc.quotas.set("b", {"max_concurrent_requests": 2, "max_tokens_per_minute": 60_000}, create=True, by="test")
    lines = [{"prompt": f"p{i}", "models": ["a", "b"], "source": "crm" if i >= 6 else "web"} for i in range(12)]
    rows, errors = parse_tasks("\n".join(json.dumps(line) for line in lines), models={"a": 60_000, "b": 60_000})
    assert not errors
    with svc.engine.begin() as conn:
        ids = insert_tasks(conn, rows)
    groups = {"failed": ids[0:3], "running": ids[3:6], "pending": ids[6:9], "solved": ids[9:12]}
    with svc.engine.begin() as conn:
        for status in ("failed", "running", "solved"):
            conn.execute(sa.update(tasks).where(tasks.c.id.in_(groups[status])).values(
                status=status, model="a", attempts=5 if status == "failed" else 1, admission_id=f"lease-{status}",
                error="after 5 attempts: 500" if status == "failed" else None))
    return svc, groups


def statuses(svc: Services) -> dict[int, str]:
    with svc.engine.connect() as conn:
        return dict(conn.execute(sa.select(tasks.c.id, tasks.c.status)).all())


def test_list_and_show_filter_by_status_model_and_source(backlog, capsys: pytest.CaptureFixture[str]) -> None:
    svc, groups = backlog
    code, out, _ = run(capsys, "tasks", "list", "--status", "failed", "--json")
    assert code == 0 and sorted(r["id"] for r in json.loads(out)) == groups["failed"]
    code, out, _ = run(capsys, "tasks", "list", "--source", "crm", "--status", "pending", "--json")
    assert sorted(r["id"] for r in json.loads(out)) == groups["pending"]
    code, out, _ = run(capsys, "tasks", "list", "--model", "b", "--json")  # b is allowed on every task
    assert len(json.loads(out)) == 12
    code, out, _ = run(capsys, "tasks", "show", str(groups["failed"][0]))
    assert code == 0 and "after 5 attempts: 500" in out and "p0" in out and "attempts: 5" in out
    shown = {line.split(":", 1)[0].strip() for line in out.splitlines()}
    assert {"key", "metadata", "max_tokens"} <= shown  # as --json has them (they were left out)
    fields = {k.strip(): v for k, v in (line.split(": ", 1) for line in out.splitlines() if ": " in line)}
    assert (fields["hedge_model"], fields["allowed_models"][:2]) == ("-", '["')  # "-" and JSON, not Python's repr
    code, out, _ = run(capsys, "tasks", "list")
    assert code == 0 and "failed" in out and "running" in out


@pytest.mark.parametrize("argv, message", [
    (["tasks", "list", "--status", "bogus"], "unknown status 'bogus'"),
    (["tasks", "retry", "--status", "running", "--yes"], "retry acts on failed or cancelled tasks only"),
    (["tasks", "cancel", "--status", "running", "--yes"], "cancel acts on pending tasks only"),
    (["tasks", "list", "--created-after", "2026-01-02", "--created-before", "2026-01-01"], "--created-after"),
    (["tasks", "list", "--created-after", "yesterday"], "--created-after"),
    (["tasks", "show", "999999999"], "no task 999999999"),
])
def test_a_bad_filter_is_one_line_and_changes_nothing(backlog, capsys: pytest.CaptureFixture[str], argv: list[str],
                                                      message: str) -> None:
    svc, _ = backlog
    before = statuses(svc)
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert statuses(svc) == before and operations(svc.engine) == []


def test_a_filter_naming_what_no_task_has_says_so_on_stderr(backlog, capsys: pytest.CaptureFixture[str]) -> None:
    """A typo in --model or --source matched nothing, which read as "nothing to do" (a new user's
    probe): the command still succeeds, and a note names what no task has."""
    code, out, err = run(capsys, "tasks", "list", "--model", "nope", "--json")
    assert code == 0 and json.loads(out) == []
    assert err == "note: no task has run on, or may use, a model named 'nope'\n"
    code, out, err = run(capsys, "tasks", "cancel", "--source", "nosuch", "--yes")
    assert code == 0 and out.startswith("cancelled 0 task(s)") and err == "note: no task has the source 'nosuch'\n"
    code, out, err = run(capsys, "tasks", "list", "--source", "crm", "--status", "cancelled")
    assert code == 0 and err == ""  # crm has tasks, none cancelled: nothing to note
    code, _, err = run(capsys, "results", "export", "--source", "nosuch")
    assert code == 0 and "note: no task has the source 'nosuch'" in err


def test_show_says_what_a_pending_task_waits_on(backlog, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing said why a given task waits (an operator's probe): `tasks show` of a pending task
    names each model it may take, its calls in flight against its cap and the limit that binds it
    now, and its source's budget when spent."""
    from balancer.costs.budget import Budget
    from balancer.sources.budgets import set_budget

    svc, groups = backlog
    pending = groups["pending"][0]  # of crm, on a or b
    code, out, _ = run(capsys, "tasks", "show", str(pending))
    waits = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("waits on:")]
    assert code == 0 and waits == ["a: 0/2 in flight, binds now: none", "b: 0/2 in flight, binds now: none"]
    with svc.engine.begin() as conn:
        set_budget(conn, Budget("crm", None, 0), by="test")  # spent however the day turns
    code, out, _ = run(capsys, "tasks", "show", str(pending), "--json")
    assert json.loads(out)["waits_on"][0] == "its source crm's budget per day is spent"
    code, out, _ = run(capsys, "tasks", "show", str(groups["solved"][0]), "--json")
    assert "waits_on" not in json.loads(out)  # only a pending task waits


def test_retrying_tasks_larger_than_every_burst_says_they_fail_again(backlog, capsys: pytest.CaptureFixture[str]) -> None:
    """Failed for needing more tokens than any burst, retried as they were, they fail again within
    seconds, and the retry said nothing of it (an operator's probe)."""
    svc, groups = backlog
    with svc.engine.begin() as conn:
        conn.execute(sa.update(tasks).where(tasks.c.id == groups["failed"][0]).values(estimated_tokens=70_000))
    code, out, err = run(capsys, "tasks", "retry")  # the dry run says it too
    assert code == 0 and out.startswith("would retry 3 task(s)")
    assert err == ("note: 1 of them need more tokens than any of their models' burst_tokens: they fail again at once "
                   "(raise a model's --burst first)\n")
    svc.quotas.set("b", {"burst_tokens": 80_000}, by="test")
    code, _, err = run(capsys, "tasks", "retry", "--yes")
    assert code == 0 and err == ""


def test_retry_is_a_dry_run_until_yes_then_resets_failed_tasks_only(backlog, capsys: pytest.CaptureFixture[str]) -> None:
    svc, groups = backlog
    before = statuses(svc)
    code, out, _ = run(capsys, "tasks", "retry", "--model", "a")  # matches running and solved tasks too
    assert code == 0 and "would retry 3 task(s)" in out and statuses(svc) == before
    code, out, _ = run(capsys, "tasks", "retry", "--model", "a", "--yes", "--by", "alice")
    assert code == 0 and "retried 3 task(s)" in out
    after = statuses(svc)
    assert [after[i] for i in groups["failed"]] == ["pending"] * 3
    assert {i: s for i, s in after.items() if i not in groups["failed"]} == {
        i: s for i, s in before.items() if i not in groups["failed"]}  # running and solved untouched
    with svc.engine.connect() as conn:
        reset = conn.execute(sa.select(tasks.c.attempts, tasks.c.error, tasks.c.model, tasks.c.admission_id)
                             .where(tasks.c.id.in_(groups["failed"]))).all()
    assert set(reset) == {(0, None, None, None)}
    [audit] = operations(svc.engine)
    assert (audit["action"], audit["done_by"], audit["task_ids"], audit["filter"]) == (
        "retry", "alice", groups["failed"], {"model": "a"})


def test_cancel_takes_pending_tasks_out_and_never_a_held_one(backlog, capsys: pytest.CaptureFixture[str]) -> None:
    svc, groups = backlog
    code, out, _ = run(capsys, "tasks", "cancel", "--source", "crm", "--yes")
    assert code == 0 and "cancelled 3 task(s)" in out
    after = statuses(svc)
    assert [after[i] for i in groups["pending"]] == ["cancelled"] * 3
    assert [after[i] for i in groups["running"]] == ["running"] * 3
    assert status_counts(svc.engine)["cancelled"] == 3
    code, out, _ = run(capsys, "status", "--json")
    assert code == 0 and json.loads(out)["cancelled"] == 3


@pytest.mark.e2e
@pytest.mark.usefixtures("migrated")
def test_retried_failed_tasks_are_solved_exactly_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every call to model-0 answers 400 (permanent): its pinned tasks fail.
    With the fault lifted, `tasks retry --yes` sends them back, and each is
    solved by exactly one successful call."""
    from tests.pipeline_harness import Pipeline, prompt_lines

    p = Pipeline(tmp_path / "logs", model_count=2)
    try:
        p.start()
        httpx.post(f"{p.backend_url}/admin/faults", json={"status": {"model-0": 400}}, timeout=5).raise_for_status()
        ids = p.submit([{**line, "model": "model-0"} for line in prompt_lines(6, ["model-0"], pinned_every=0)])
        assert p.wait_done(len(ids), timeout=60)["failed"] == 6
        httpx.post(f"{p.backend_url}/admin/faults", json={}, timeout=5).raise_for_status()
        code, out, err = run(capsys, "tasks", "retry", "--model", "model-0", "--yes")
        assert code == 0 and "retried 6 task(s)" in out, err
        assert p.wait_done(len(ids), timeout=60)["solved"] == 6
        answered = [e for e in p.sim_log() if e["status"] == 200]
        assert len(answered) == 6  # one successful call per task: none repeated
        assert {r.status for r in p.rows()} == {"solved"}
        assert p.violations() == []
    finally:
        p.stop()
