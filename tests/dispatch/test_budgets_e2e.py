"""Budgets end to end: real workers on the simulator; a source whose budget is
spent mid-run stops taking calls within a dispatch run, waits with its reason
shown, and resumes when the budget is raised, with nothing lost."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.backlog.spend import usage_by_task
from balancer.devtools.sim.provider import prompt_key
from tests.dispatch.test_fair_e2e import MODELS
from tests.pipeline_harness import prompt_lines, scenario_file

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("migrated")]

#: A dispatch run that began before the budget was reached may still claim
#: (it read the budgets at its start), as may the answer writer's commit lag
#: behind ``solved_at``: generous, for a loaded machine. Without the budget the
#: source's tasks are claimed for the whole run, over 10 s beyond it.
ONE_RUN = timedelta(seconds=3)
BUDGET_TOKENS = 20_000


def source_counts(p, source: str) -> dict[str, int]:  # noqa: ANN001
    with p.services.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM tasks WHERE source = :s GROUP BY status"),
                            {"s": source}).all()
    return {status: int(n) for status, n in rows}


def test_a_source_over_budget_stops_taking_calls_waits_visibly_and_resumes_when_raised(
        pipeline, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from balancer.cli import main

    p = pipeline(scenario=scenario_file(tmp_path / "two-models.toml", MODELS)).start()
    names = [m.name for m in p.models]
    assert main(["source", "set", "capped", "--budget-tokens-per-day", str(BUDGET_TOKENS), "--by", "test", "--new"]) == 0
    capped = p.submit([{**line, "source": "capped", "prompt": "capped " + line["prompt"]}
                       for line in prompt_lines(300, names, pinned_every=10, seed=5)])
    free = p.submit([{**line, "source": "free", "prompt": "free " + line["prompt"]}
                     for line in prompt_lines(600, names, pinned_every=10, seed=6)])

    # (a) The budget is reached mid-run; the rest of the run goes on without the capped source.
    deadline = time.monotonic() + 240
    while True:
        p.supervisor.check_alive()
        mine, theirs = source_counts(p, "capped"), source_counts(p, "free")
        if theirs.get("solved", 0) + theirs.get("failed", 0) >= len(free) \
                and not any(mine.get(s) for s in ("ready", "queued", "running")):
            break
        assert time.monotonic() < deadline, (mine, theirs, p.log_dir)
        time.sleep(0.25)
    assert mine.get("pending", 0) > 0 and not mine.get("failed"), mine
    rows = {r.id: r for r in p.rows()}
    solved = sorted((rows[i] for i in capped if rows[i].status == "solved"), key=lambda r: (r.solved_at, r.id))
    total, crossed = 0, None
    for r in solved:
        total += r.prompt_tokens + r.completion_tokens
        if total >= BUDGET_TOKENS and crossed is None:
            crossed = r.solved_at
    assert crossed is not None, total  # the budget was reached (and overshot by the calls in flight then)
    claimed_late = [i for i in capped if rows[i].queued_at is not None and rows[i].queued_at > crossed + ONE_RUN]
    assert not claimed_late, [(i, rows[i].queued_at - crossed) for i in claimed_late]
    # The pipeline kept dispatching long after: without the budget, the capped source would have been claimed too.
    assert max(rows[i].queued_at for i in free) > crossed + 3 * ONE_RUN
    by_key = {prompt_key(rows[i].prompt): i for i in capped}
    started_after = [e for e in p.sim_log() if e.get("prompt_key") in by_key and e["start"] > crossed.timestamp()]
    late_tasks = {by_key[e["prompt_key"]] for e in started_after}
    # Calls started after the budget was reached are those already claimed (in flight or on a ready list) by then.
    assert all(rows[i].queued_at <= crossed + ONE_RUN for i in late_tasks)
    with capsys.disabled():
        print(f"\nbudget {BUDGET_TOKENS} tokens reached at {crossed}: {total} tokens spent, "
              f"{len(started_after)} call(s) started after it, none claimed later than {ONE_RUN}")

    # The wait is visible, with its reason.
    # What the budget counts is every call the source paid (the ledger: a retried or hedged call's
    # tokens too), so at least the answered calls' tokens; read the ledger around status, as a
    # cancelled hedge's call may be recorded meanwhile.
    def paid() -> int:
        return sum(u[1] + u[2] for usage in usage_by_task(p.services.engine, capped).values() for u in usage)

    capsys.readouterr()
    paid_before = paid()
    assert main(["status", "--json"]) == 0
    budget = {b["source"]: b for b in json.loads(capsys.readouterr().out)["budgets"]}["capped"]
    assert budget["over"] and budget["waiting"].startswith("waiting: budget spent (")
    assert total <= paid_before <= budget["spent_tokens_today"] <= paid(), (total, paid_before, budget)

    # (b) Raised: its tasks resume at the next dispatch run; (c) nothing is lost.
    assert main(["source", "set", "capped", "--budget-tokens-per-day", "1000000000", "--by", "test"]) == 0
    counts = p.wait_done(len(capped) + len(free), timeout=240)
    assert counts["solved"] == len(capped) + len(free) and counts["failed"] == 0, counts
