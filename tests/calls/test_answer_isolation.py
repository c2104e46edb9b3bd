"""An answer that cannot be stored fails alone (issue 38 finding 6): the rest of its
batch is written once, and its task ends failed with the reason, never called again.
The production solve path (``solve_chain``, the answer writer) against the real
simulator over HTTP, real Redis and PostgreSQL."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from balancer.backends import Backend, Completion, make_backend
from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import parse_tasks
from balancer.backlog.transitions import mark_solved_many
from balancer.calls import answers
from balancer.calls.answers import AnswerWriter
from balancer.calls.solver import SolveMessage
from balancer.devtools.sim.config import Latency, SimModel
from balancer.devtools.sim.provider import Simulator
from balancer.devtools.sim.server import create_app
from balancer.dispatch.dispatcher import Assignment, dispatch
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import call_usage, tasks
from tests.servers import served
from tests.solving import chain

pytestmark = pytest.mark.usefixtures("migrated")

MODEL = SimModel("m", 8, 600_000, latency=Latency(0.01, 0.02, 0.0, 0.05))


@pytest.fixture
def sim() -> Iterator[tuple[str, Simulator]]:
    simulator = Simulator([MODEL], time_scale=1.0)
    with served(create_app(simulator)) as url:
        yield url, simulator


@pytest.fixture
def svc(sim, monkeypatch: pytest.MonkeyPatch) -> Services:  # noqa: ANN001
    monkeypatch.setenv("BALANCER_BACKEND_URL", sim[0])
    monkeypatch.setenv("BALANCER_LEASE_SECONDS", "60")
    monkeypatch.setenv("BALANCER_READY_PER_SLOT", "0")
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([dataclasses.replace(MODEL.quota(), slow_start=False)])  # all 8 slots at once
    return services


class Poisoning:
    """The real backend (the simulator over HTTP), with the answer to ``prompt`` spoiled by
    ``spoil``, and given last (so it goes out in a batch with others, not held alone first)."""

    def __init__(self, backend: Backend, prompt: str, spoil: Any) -> None:
        self.backend, self.prompt, self.spoil = backend, prompt, spoil

    def complete(self, model: str, prompt: str, max_tokens: int) -> Completion:
        completion = self.backend.complete(model, prompt, max_tokens)
        if prompt != self.prompt:
            return completion
        time.sleep(0.5)
        return self.spoil(completion)

    def close(self) -> None:
        self.backend.close()


def dispatched(svc: Services, prompts: list[str]) -> list[Assignment]:
    rows, errors = parse_tasks("".join(json.dumps({"prompt": p, "model": "m"}) + "\n" for p in prompts),
                               models={"m": MODEL.quota().burst})
    assert not errors
    with svc.engine.begin() as conn:
        insert_tasks(conn, rows)
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    assert len(sent) == len(prompts)
    return sent


def solve_together(svc: Services, backend: Backend, sent: list[Assignment],
                   monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], list[int]]:
    """Solve every assignment at once, on threads, through one answer writer whose
    first statement waits until every answer is handed over: the others go out
    together behind it. Each prompt's outcome, and the answers in each statement."""
    handed, count, lock = threading.Event(), [0], threading.Lock()
    batches: list[int] = []

    def held(engine, rows, usage=()):  # noqa: ANN001, ANN202
        batches.append(len(rows))
        if len(batches) == 1:
            assert handed.wait(30), "not every answer was handed over"
        return mark_solved_many(engine, rows, usage)

    class Counted(AnswerWriter):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            outcome = super().submit(*args, **kwargs)
            with lock:
                count[0] += 1
                if count[0] == len(sent):
                    handed.set()
            return outcome

    monkeypatch.setattr(answers, "mark_solved_many", held)
    writer = Counted(svc.engine)
    outcomes: dict[int, str] = {}

    def solve(a: Assignment) -> None:
        msg = SolveMessage(a.task_id, a.admission_id, a.model, a.estimated_tokens)
        try:
            outcomes[a.task_id] = chain(svc, backend, msg, writer=writer)[0]
        except Exception as exc:  # noqa: BLE001 - what the solve got, for the assertions
            outcomes[a.task_id] = f"raised {exc!r}"

    threads = [threading.Thread(target=solve, args=(a,)) for a in sent]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        writer.close()
    with svc.engine.connect() as conn:
        prompts = dict(conn.execute(sa.select(tasks.c.id, tasks.c.prompt)).all())
    return {prompts[task_id]: outcome for task_id, outcome in outcomes.items()}, batches


def test_a_nul_in_one_answer_fails_only_its_task_and_calls_nothing_again(
        svc: Services, sim, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Issue 38 finding 6: one answer with a NUL byte failed the writer's whole batch; the
    poisoned task was swept back and called again past MAX_ATTEMPTS, and the seven innocent
    tasks of its batch were paid again. Now the seven are written once, the poisoned task
    ends failed with the reason, and the backend is called eight times in all."""
    _, simulator = sim
    prompts = [f"prompt {i}" for i in range(8)]
    backend = Poisoning(make_backend(svc.settings), "prompt 3",
                        lambda c: dataclasses.replace(c, answer=c.answer + "\x00 and more"))
    outcomes, batches = solve_together(svc, backend, dispatched(svc, prompts), monkeypatch)
    assert outcomes == {p: "unstorable" if p == "prompt 3" else "solved" for p in prompts}
    assert sum(batches) == 7 and len(batches) == 2  # the seven in two statements (the first held), the NUL one apart
    with svc.engine.connect() as conn:
        rows = {r.prompt: r for r in conn.execute(sa.select(tasks.c.prompt, tasks.c.status, tasks.c.error,
                                                            tasks.c.answer, tasks.c.attempts))}
        ledger = conn.execute(sa.select(sa.func.count()).select_from(call_usage)).scalar_one()
    assert {p: r.status for p, r in rows.items()} == {p: "failed" if p == "prompt 3" else "solved" for p in prompts}
    assert "NUL character" in rows["prompt 3"].error and rows["prompt 3"].answer is None
    assert all(r.attempts == 1 for r in rows.values())
    assert ledger == 8  # every call paid is in the ledger, the refused one's too
    calls = [e for e in simulator.log if e["status"] == 200]
    assert len(calls) == 8 and len({e["prompt_key"] for e in calls}) == 8  # each prompt called once


def test_an_answer_postgresql_refuses_is_written_alone_and_fails_only_its_task(
        svc: Services, sim, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Issue 38 finding 6: a batch PostgreSQL refuses for one answer's sake (here a CHECK
    on the answer, standing in for any refusal nobody foresaw) is written again one answer
    at a time: the others are solved once, the refused one's task fails with PostgreSQL's reason."""
    with svc.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE tasks ADD CONSTRAINT no_poison CHECK (answer NOT LIKE '%%poison%%')")
    prompts = [f"prompt {i}" for i in range(6)]
    backend = Poisoning(make_backend(svc.settings), "prompt 4", lambda c: dataclasses.replace(c, answer="poison"))
    outcomes, batches = solve_together(svc, backend, dispatched(svc, prompts), monkeypatch)
    assert outcomes == {p: "unstorable" if p == "prompt 4" else "solved" for p in prompts}
    first, refused, *alone = batches  # the first statement (held), then the one refused, then each of it alone
    assert first + refused == 6 and refused > 1 and alone == [1] * refused
    with svc.engine.connect() as conn:
        rows = {r.prompt: r for r in conn.execute(sa.select(tasks.c.prompt, tasks.c.status, tasks.c.error))}
    assert {p: r.status for p, r in rows.items()} == {p: "failed" if p == "prompt 4" else "solved" for p in prompts}
    assert 'the answer could not be stored: new row for relation "tasks" violates check constraint "no_poison"' \
        in rows["prompt 4"].error


def test_reported_tokens_past_an_integer_column_fail_only_their_task(svc: Services) -> None:
    """Issue 38 finding 6: a reported usage above 2^31 - 1 failed the writer's whole batch.
    Such an answer is kept out of the statement: its task fails with the reason, the
    answer beside it is written."""
    from balancer.backlog.transitions import Answer

    big, fine = dispatched(svc, ["big usage", "fine"])
    writer = AnswerWriter(svc.engine)
    try:
        named = lambda w: "duplicate" if w is None else (f"refused: {w.refused}" if w.refused else "solved")  # noqa: E731
        outcomes = [writer.submit(Answer(big.task_id, big.admission_id, "ok", 2**31, 5), named),
                    writer.submit(Answer(fine.task_id, fine.admission_id, "ok", 10, 5), named)]
        got = [o.result(30) for o in outcomes]
    finally:
        writer.close()
    assert got == ["refused: the backend reported 2,147,483,648 prompt tokens, more than a task can record "
                   "(2,147,483,647)", "solved"]
    with svc.engine.connect() as conn:
        statuses = dict(conn.execute(sa.select(tasks.c.prompt, tasks.c.status)).all())
    assert statuses == {"big usage": "failed", "fine": "solved"}
