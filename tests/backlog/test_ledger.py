"""The ledger: every call sent to the backend is in spend, a hedge that lost and a
call retried after a timeout included. Real simulator over HTTP (in a thread), real
Redis and PostgreSQL, the production solve path (a real answer writer)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from balancer.admission.values import Admitted, Candidate
from balancer.backends import make_backend
from balancer.backlog.hedges import mark_hedged
from balancer.backlog.retention import prune
from balancer.backlog.spend import charges, spend_so_far, token_usage
from balancer.calls.answers import AnswerWriter
from balancer.calls.heartbeat import Heartbeat
from balancer.calls.solver import SolveMessage
from balancer.estimates.tokens import heuristic_prompt_tokens
from balancer.services import Services
from balancer.storage.schema import call_usage, tasks
from tests.calls.test_call import in_thread, wait_for, with_settings
from tests.calls.test_solver import (  # noqa: F401 - fixtures
    an_answer_in_between,
    dispatch_one,
    faults,
    message,
    redispatch,
    sim,
    svc,
    task_row,
)
from tests.solving import chain, solve

pytestmark = pytest.mark.usefixtures("migrated")


def ledger(svc: Services, task_id: int) -> list[tuple[str, int, int, bool, bool]]:  # noqa: F811
    """(model, prompt tokens, completion tokens, answered, hedge) of the task's calls, in the order they ended."""
    with svc.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(  # type: ignore[misc]
            sa.select(call_usage.c.model, call_usage.c.prompt_tokens, call_usage.c.completion_tokens,
                      call_usage.c.answered, call_usage.c.hedge)
            .where(call_usage.c.task_id == task_id).order_by(call_usage.c.ended_at))]


def answered_tokens(simulator, model: str) -> list[tuple[int, int]]:  # noqa: ANN001
    return [(e["prompt_tokens"], e["completion_tokens"]) for e in simulator.log if e["model"] == model and e["status"] == 200]


def test_a_hedged_task_s_losing_call_is_in_spend(svc: Services, sim, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The first call (on m) straggles; its hedge (on n) answers first and is written.
    The first call runs to its end (the provider would bill it: ``on_disconnect`` is
    ``continue``), its answer is a duplicate and is not written, but its call is in the
    ledger, and so in spend: both models' reported tokens, priced, per source. Without
    the ledger, spend counted the winner's tokens only."""
    url, simulator = sim
    for model, price in (("m", (1.0, 10.0)), ("n", (2.0, 20.0))):
        svc.quotas.set(model, {"price_per_million_input": price[0], "price_per_million_output": price[1],
                               "currency": "USD"}, by="test")
    faults(url, hang={"m": 1.5})
    a = dispatch_one(svc, {"prompt": "hedged " * 20, "model": "m", "max_tokens": 50})
    heartbeat, writer = Heartbeat(svc), AnswerWriter(svc.engine)
    backend = make_backend(svc.settings)
    try:
        first, first_out = in_thread(lambda: chain(svc, backend, message(a), heartbeat=heartbeat, writer=writer))
        wait_for(lambda: task_row(svc, a.task_id).status == "running", what="the first call's start")
        hedge = svc.core.admit([Candidate(a.estimated_tokens, allowed=("n",))])[0]
        assert isinstance(hedge, Admitted)
        with svc.engine.begin() as conn:
            assert mark_hedged(conn, a.task_id, a.admission_id, hedge.admission_id, "n", a.estimated_tokens)
        hedge_msg = SolveMessage(a.task_id, hedge.admission_id, "n", a.estimated_tokens, hedge=True)
        assert chain(svc, backend, hedge_msg, heartbeat=heartbeat, writer=writer) == ["hedge_won"]
        first.join(10)
        assert first_out == [["duplicate"]]
    finally:
        writer.close()
        heartbeat.close()
    row = task_row(svc, a.task_id)
    assert row.status == "solved" and row.model == "n"
    [(m_prompt, m_completion)], [(n_prompt, n_completion)] = answered_tokens(simulator, "m"), answered_tokens(simulator, "n")
    assert ledger(svc, a.task_id) == [("n", n_prompt, n_completion, True, True), ("m", m_prompt, m_completion, True, False)]
    assert sorted(token_usage(svc.engine)) == [("submit", "m", m_prompt, m_completion), ("submit", "n", n_prompt, n_completion)]
    spent = spend_so_far(svc.engine, svc.quotas.all())
    loser = (m_prompt * 1.0 + m_completion * 10.0) / 1e6
    assert spent.by_model["m"] == pytest.approx(loser) and loser > 0
    assert spent.total == pytest.approx(loser + (n_prompt * 2.0 + n_completion * 20.0) / 1e6)
    # Issue 38 finding 13: each call keeps the price of its start. Cutting m's price, or
    # removing n's quota, changes nothing of what was spent (it re-priced the ledger before).
    svc.quotas.set("m", {"price_per_million_input": 0.0, "price_per_million_output": 0.0}, by="test")
    svc.quotas.remove("n", by="test")
    again = spend_so_far(svc.engine, svc.quotas.all())
    assert again.total == pytest.approx(spent.total) and again.by_model == pytest.approx(spent.by_model)


def test_a_call_retried_after_a_5xx_and_a_timeout_is_in_spend(
    svc: Services, sim, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """Three calls for one task: a 500 (refused: billed nothing, but in the ledger), a
    timeout (the prompt reached the backend: its estimated prompt tokens, no completion),
    then the answer. Spend counts the last two; the task's row only the last."""
    quick = with_settings(svc, monkeypatch, BALANCER_BACKEND_TIMEOUT="1")
    url, simulator = sim
    prompt = "retried " * 30
    a = dispatch_one(quick, {"prompt": prompt, "model": "m", "max_tokens": 40})
    backend = make_backend(quick.settings)
    faults(url, status={"m": 500})
    assert solve(quick, backend, message(a)) == "retry"
    an_answer_in_between(quick)
    faults(url, status={}, hang={"m": 3.0})
    assert solve(quick, backend, message(redispatch(quick, a.task_id, clear_backoff=True))) == "retry"
    an_answer_in_between(quick)
    faults(url, hang={})
    assert solve(quick, backend, message(redispatch(quick, a.task_id, clear_backoff=True))) == "solved"
    row = task_row(quick, a.task_id)
    [(prompt_tokens, completion_tokens)] = answered_tokens(simulator, "m")
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("solved", prompt_tokens, completion_tokens)
    cut = heuristic_prompt_tokens(prompt)
    assert ledger(quick, a.task_id) == [("m", 0, 0, False, False), ("m", cut, 0, False, False),
                                        ("m", prompt_tokens, completion_tokens, True, False)]
    assert token_usage(quick.engine) == [("submit", "m", cut + prompt_tokens, completion_tokens)]
    since = charges(quick.engine, datetime.now(UTC) - timedelta(minutes=1))
    assert [(c.source, c.model, c.prompt_tokens, c.completion_tokens) for c in since] == \
        [("submit", "m", cut + prompt_tokens, completion_tokens)]
    assert charges(quick.engine, datetime.now(UTC) + timedelta(minutes=1)) == []
    # Pruning the task takes its calls' rows with it (calls of an earlier day: today's are budgets' spend).
    with quick.engine.begin() as conn:
        conn.execute(sa.update(tasks).where(tasks.c.id == a.task_id).values(updated_at=sa.func.now() - timedelta(days=2)))
        conn.execute(sa.update(call_usage).values(ended_at=call_usage.c.ended_at - timedelta(days=2)))
    assert prune(quick.engine, datetime.now(UTC) - timedelta(days=1), by="test", apply=True) == 1
    assert ledger(quick, a.task_id) == [] and token_usage(quick.engine) == []
