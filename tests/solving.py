"""The production solve path for tests: a message through ``solve_chain`` with a
real lease heartbeat and a real answer writer (the only way an answer is written),
and a task's start made to stall while a test changes what is around it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine

from balancer.backends import Backend
from balancer.backlog.transitions import SolveContext, start_solve
from balancer.calls import solver
from balancer.calls.answers import AnswerWriter
from balancer.calls.cancellation import CancelListener
from balancer.calls.heartbeat import Heartbeat
from balancer.calls.solver import SolveMessage, solve_chain
from balancer.services import Services


def chain(services: Services, backend: Backend, msg: SolveMessage, listener: CancelListener | None = None, *,
          writer: AnswerWriter | None = None, heartbeat: Heartbeat | None = None, **kwargs: Any) -> list[str]:
    """``solve_chain`` as a worker runs it; the writer and heartbeat are made (and
    closed afterwards) unless given."""
    own_writer, own_heartbeat = writer is None, heartbeat is None
    writer = writer or AnswerWriter(services.engine)
    heartbeat = heartbeat or Heartbeat(services)
    try:
        return solve_chain(services, backend, msg, listener, heartbeat, writer, **kwargs)
    finally:
        if own_writer:
            writer.close()
        if own_heartbeat:
            heartbeat.close()


def solve(services: Services, backend: Backend, msg: SolveMessage, listener: CancelListener | None = None,
          **kwargs: Any) -> str:
    """One message's outcome, through the production path (no next call taken)."""
    (outcome,) = chain(services, backend, msg, listener, **kwargs)
    return outcome


def stall_start(monkeypatch: pytest.MonkeyPatch, task_id: int, action: Callable[[], object]) -> None:
    """The solver's start of ``task_id`` runs ``action`` first (a stalled start: it
    waits, or the test changes the lease, the cap or Redis meanwhile), then starts
    as usual; every other task starts as usual."""
    def stalled(engine: Engine, started: int, *args: Any) -> SolveContext | None:
        if started == task_id:
            action()
        return start_solve(engine, started, *args)

    monkeypatch.setattr(solver, "start_solve", stalled)


def priced(services: Services, row: dict[str, Any]) -> dict[str, Any]:
    """A ``call_usage`` row with the cost and currency a worker records for it: its tokens at its
    model's price now (:meth:`balancer.calls.call.Call.usage` prices a call at its start)."""
    from balancer.costs.cost import price_list

    prices, currency = price_list(services.quotas.all())
    price = prices.get(row["model"])
    cost = None if price is None else price.cost(row["prompt_tokens"], row["completion_tokens"])
    return {**row, "cost": cost, "currency": None if cost is None else currency}
