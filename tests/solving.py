"""The production solve path for tests: a message through ``solve_chain`` with a
real lease heartbeat and a real answer writer (the only way an answer is written)."""

from __future__ import annotations

from typing import Any

from balancer.backends import Backend
from balancer.pipeline.answers import AnswerWriter
from balancer.pipeline.cancellation import CancelListener
from balancer.pipeline.heartbeat import Heartbeat
from balancer.pipeline.solver import SolveMessage, solve_chain
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
