"""The answer writer: one thread per worker process that stores answers,
as many per statement as are waiting.

Why a thread of its own. An answer's commit must be durable, so it waits for
PostgreSQL's WAL flush, and on a busy disk a flush stalls every commit at once
for 100 to 700 ms (docs/benchmarks.md, the hot path, round 4). A chain (see
:func:`balancer.pipeline.solver.solve_chain`) hands its answer here and its
next call goes on the wire at once; a solve with no next call hands it here
and waits. Either way:

- **one commit for many answers.** The thread takes every answer waiting and
  writes them in one guarded ``UPDATE`` (:func:`balancer.storage.transitions.mark_solved_many`):
  one WAL flush however many calls ended during the last one;
- **a bounded pool.** At most one connection of the process's pool waits for
  a flush; the others stay free for the calls' starts, which do not wait for
  it. (When every thread wrote its own answer, 120 threads in one process
  held all five connections through a stall, and starts queued behind them.)

The guarantees are the inline write's: each answer under its own admission
guard (exactly once), retried while PostgreSQL is unreachable until the
earliest deadline of its batch, and a chain returns (and its message is
acknowledged) only after its answers are written. Answers handed over and not
yet written when the process dies are lost like a call in flight: their tasks'
deadlines pass and the sweep returns them to pending.

    >>> # writer = AnswerWriter(engine); outcome = writer.submit(answer, lambda written: "solved")
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from balancer.storage.retry import SOLVE_DEADLINE, with_db_retry
from balancer.storage.transitions import Answer, Written, mark_solved_many

#: Answers written in one statement at most.
MAX_BATCH = 100


@dataclass(frozen=True)
class _Pending:
    answer: Answer
    then: Callable[[Written | None], str]
    deadline: float | None
    outcome: Future[str]


class AnswerWriter:
    """Writes answers on one thread, several per statement; see the module docstring."""

    def __init__(self, engine: Engine, *, max_batch: int = MAX_BATCH) -> None:
        self.engine, self.max_batch = engine, max_batch
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._lock, self._closed = threading.Lock(), False
        self._thread = threading.Thread(target=self._run, name="balancer-answers", daemon=True)
        self._thread.start()

    def submit(self, answer: Answer, then: Callable[[Written | None], str]) -> Future[str]:
        """Write ``answer``; the future's result is ``then(what was written)``
        (``then`` runs on the writer's thread, None for a duplicate)."""
        outcome: Future[str] = Future()
        with self._lock:  # nothing is queued behind the closing mark, where no one would write it
            if self._closed:
                raise RuntimeError("the answer writer is closed")
            self._queue.put(_Pending(answer, then, SOLVE_DEADLINE.get(), outcome))
        return outcome

    def close(self) -> None:
        """Write everything handed over so far, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        carried: list[_Pending] = []  # a task's second answer waits for the next statement
        stop = False
        while not stop or carried:
            batch, carried = carried, []
            if not batch:
                first = self._queue.get()
                if first is None:
                    return
                batch = [first]
            tasks = {p.answer.task_id for p in batch}
            while not stop and len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                elif more.answer.task_id in tasks:
                    # One row per task in a statement: PostgreSQL would update the
                    # task from either row (unpredictably) and return it once.
                    carried.append(more)
                else:
                    tasks.add(more.answer.task_id)
                    batch.append(more)
            self._write(batch)

    def _write(self, batch: list[_Pending]) -> None:
        deadlines = [p.deadline for p in batch if p.deadline is not None]
        token = SOLVE_DEADLINE.set(min(deadlines) if deadlines else time.monotonic() + 120.0)
        try:
            written = with_db_retry(lambda: mark_solved_many(self.engine, [p.answer for p in batch]))
        except BaseException as exc:  # noqa: BLE001 - every waiting solve gets it
            for p in batch:
                p.outcome.set_exception(exc)
            return
        finally:
            SOLVE_DEADLINE.reset(token)
        for p, w in zip(batch, written, strict=True):
            try:
                p.outcome.set_result(p.then(w))
            except BaseException as exc:  # noqa: BLE001 - the solve that handed it over gets it
                p.outcome.set_exception(exc)
