"""The answer writer: one thread per worker process that stores answers,
as many per statement as are waiting.

Why a thread of its own. An answer's commit must be durable, so it waits for
PostgreSQL's WAL flush, and on a busy disk a flush stalls every commit at once
for 100 to 700 ms (docs/benchmark-history.md, "The hot path"). A chain (see
:func:`balancer.calls.solver.solve_chain`) hands its answer here and its
next call goes on the wire at once; a solve with no next call hands it here
and waits. Either way:

- **one commit for many answers.** The thread takes every answer waiting and
  writes them in one guarded ``UPDATE`` (:func:`balancer.backlog.transitions.mark_solved_many`):
  one WAL flush however many calls ended during the last one. Every call's
  ledger row (:mod:`balancer.backlog.ledger`) rides in that statement: an
  answered call's with its answer, a call's that got no answer
  (:meth:`AnswerWriter.record`, waited for by no one) with the next batch;
- **a bounded pool.** At most one connection of the process's pool waits for
  a flush; the others stay free for the calls' starts, which do not wait for
  it. (When every thread wrote its own answer, 120 threads in one process
  held all five connections through a stall, and starts queued behind them.)

**One answer never fails the others.** An answer PostgreSQL cannot store (a NUL
character, a lone surrogate, tokens past an ``integer`` column:
:func:`~balancer.backlog.transitions.unstorable`) is kept out of its batch's
statement; a statement PostgreSQL refuses anyway is written again one answer at
a time. Either way the answer refused ends its task ``failed`` with the reason
(and its call's ledger row), under its own guard: the call was made and paid,
and the task is never called again for an answer that cannot be kept (nor
stored altered: a stripped answer would be written to a team's table as if it
were the model's). An outage is not a refusal: it is retried as before.

The guarantees: each answer under its own admission guard (exactly once),
retried while PostgreSQL is unreachable until the earliest deadline of its
batch, and a chain returns (and its message is acknowledged) only after its
answers are written, or once its solve's deadline has passed (:meth:`AnswerWriter.wait`:
no wait is unbounded). The writer is the only path an answer takes to
PostgreSQL: a hedge's answer too, in a statement of its own (its guard is the
hedge's). Answers handed over and not yet written when the process dies are
lost like a call in flight: their tasks' deadlines pass and the sweep returns
them to pending. A writer thread that dies fails every answer waiting on it,
and every later :meth:`AnswerWriter.submit`, loudly: no chain hangs on it.

    >>> # writer = AnswerWriter(engine); outcome = writer.submit(answer, lambda written: "solved")
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from balancer.backlog.ledger import Usage, record_usage
from balancer.backlog.retry import SOLVE_DEADLINE, with_db_retry
from balancer.backlog.transitions import Answer, Written, mark_solved, mark_solved_many, mark_unstorable, unstorable
from balancer.errors import printable

log = logging.getLogger(__name__)

#: Answers written in one statement at most.
MAX_BATCH = 100
#: How often a wait on an answer checks that the writer's thread is still alive (seconds).
ALIVE_CHECK_S = 1.0
#: An answer handed over with no deadline is retried this long (seconds).
DEFAULT_DEADLINE_S = 120.0
#: How long :meth:`AnswerWriter.close` waits past the latest deadline (seconds).
CLOSE_GRACE_S = 5.0


def _aligned(group: list[_Pending], written: list[Written | None]) -> list[Written | None]:
    """What was written for each of ``group``, ``written`` being its answers' in order (None for a row alone)."""
    answers = iter(written)
    return [next(answers) if p.answer is not None else None for p in group]


def _solved_one(engine: Engine, answer: Answer, usage: tuple[Usage, ...]) -> list[Written | None]:
    return [mark_solved(engine, answer, usage)]


def _rows_one(engine: Engine, usage: tuple[Usage, ...]) -> list[Written | None]:
    record_usage(engine, usage)
    return [None]


def _plain_one(engine: Engine, answer: Answer, usage: tuple[Usage, ...]) -> list[Written | None]:
    return mark_solved_many(engine, [answer], usage)


def _refused_one(engine: Engine, answer: Answer, reason: str, usage: tuple[Usage, ...]) -> list[Written | None]:
    return [mark_unstorable(engine, answer, reason, usage)]


def _log_unrecorded(outcome: Future[str]) -> None:
    if outcome.exception() is not None:
        log.error("a call's ledger row was not written (spend undercounts that call): %r", outcome.exception())


class WriterDied(RuntimeError):
    """The answer writer's thread is gone: nothing handed to it will be written."""


@dataclass(frozen=True)
class _Pending:
    answer: Answer | None  # None: only ledger rows (calls that got no answer)
    then: Callable[[Written | None], str]
    deadline: float | None
    outcome: Future[str]
    usage: tuple[Usage, ...] = ()


class AnswerWriter:
    """Writes answers on one thread, several per statement; see the module docstring."""

    def __init__(self, engine: Engine, *, max_batch: int = MAX_BATCH) -> None:
        self.engine, self.max_batch = engine, max_batch
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._lock, self._closed = threading.Lock(), False
        self._died: BaseException | None = None
        self._latest = 0.0  # the latest deadline handed over (monotonic): close() waits that long at most
        self._thread = threading.Thread(target=self._run, name="balancer-answers", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._died is None

    def submit(self, answer: Answer, then: Callable[[Written | None], str], *,
               deadline: float | None = None, usage: Usage | None = None) -> Future[str]:
        """Write ``answer`` (and its call's ledger row, ``usage``, in the same statement,
        written even for a duplicate); the future's result is ``then(what was written)``
        (``then`` runs on the writer's thread, None for a duplicate). Its
        retries give up at ``deadline`` (monotonic; the running solve's by default)."""
        return self._put(answer, then, deadline, (usage,) if usage is not None else ())

    def record(self, usage: Usage, *, deadline: float | None = None) -> Future[str]:
        """Write the ledger row of a call that got no answer, in the next batch; nothing
        waits for it (the future's result is ``recorded``; a failure is logged)."""
        outcome = self._put(None, lambda _: "recorded", deadline, (usage,))
        outcome.add_done_callback(_log_unrecorded)
        return outcome

    def _put(self, answer: Answer | None, then: Callable[[Written | None], str], deadline: float | None,
             usage: tuple[Usage, ...]) -> Future[str]:
        outcome: Future[str] = Future()
        with self._lock:  # nothing is queued behind the closing mark, where no one would write it
            if self._died is not None:
                raise WriterDied(f"the answer writer died: {self._died!r}")
            if self._closed:
                raise RuntimeError("the answer writer is closed")
            deadline = deadline if deadline is not None else SOLVE_DEADLINE.get()
            self._latest = max(self._latest, deadline if deadline is not None else time.monotonic() + DEFAULT_DEADLINE_S)
            self._queue.put(_Pending(answer, then, deadline, outcome, usage))
        return outcome

    def wait(self, outcome: Future[str], deadline: float) -> str | None:
        """``outcome``'s result, waited for until ``deadline`` (monotonic) at most:
        None if it is not written by then (the write goes on). Raises
        :class:`WriterDied` at once if the writer's thread is gone, and what
        the write raised if it failed."""
        while True:
            left = deadline - time.monotonic()
            try:
                return outcome.result(timeout=max(0.0, min(ALIVE_CHECK_S, left)))
            except FutureTimeout:
                if not self.alive and not outcome.done():
                    raise WriterDied(f"the answer writer died: {self._died!r}") from None
                if left <= 0:
                    return None

    def close(self) -> None:
        """Write everything handed over so far, then stop the thread. Waits until the
        latest deadline of what was handed over at most (a write hung on a stalled
        connection is left behind, and logged)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(max(0.0, self._latest - time.monotonic()) + CLOSE_GRACE_S)
        if self._thread.is_alive():
            log.error("the answer writer did not finish by its answers' deadlines; closing with answers unwritten")

    def _run(self) -> None:
        batch: list[_Pending] = []
        try:
            self._loop(batch)
        except BaseException as exc:  # noqa: BLE001 - a bug or a kill: fail loudly, never leave a solve waiting
            log.critical("the answer writer died; failing every answer waiting on it", exc_info=True)
            with self._lock:
                self._died = exc
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    batch.append(item)
            for p in batch:
                if not p.outcome.done():
                    p.outcome.set_exception(WriterDied(f"the answer writer died: {exc!r}"))

    def _loop(self, batch: list[_Pending]) -> None:
        """Write batches until the closing mark. ``batch`` is the one in hand (for :meth:`_run`)."""
        carried: list[_Pending] = []  # a task's second answer waits for the next statement
        stop = False
        while not stop or carried:
            batch[:], carried = carried, []
            if not batch:
                first = self._queue.get()
                if first is None:
                    return
                batch.append(first)
            tasks = {p.answer.task_id for p in batch if p.answer is not None}
            while not stop and len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                elif more.answer is None:
                    batch.append(more)
                elif more.answer.task_id in tasks:
                    # One row per task in a statement: PostgreSQL would update the
                    # task from either row (unpredictably) and return it once.
                    carried.append(more)
                else:
                    tasks.add(more.answer.task_id)
                    batch.append(more)
            self._write(batch)
            batch.clear()

    def _write(self, batch: list[_Pending]) -> None:
        """The plain answers in one statement, with every ledger row of theirs and of the
        calls that got no answer (alone in a statement when no plain answer waits);
        each hedge's answer in a statement of its own, with its row. An answer PostgreSQL
        cannot store (:func:`~balancer.backlog.transitions.unstorable`) is kept out of the
        statement: its task ends failed with the reason, in a statement of its own."""
        refused: set[int] = set()
        for p in batch:
            if p.answer is not None and (reason := unstorable(p.answer)) is not None:
                refused.add(id(p))
                self._write_group([p], partial(_refused_one, self.engine, p.answer, reason, p.usage), isolate=False)
        batch = [p for p in batch if id(p) not in refused]
        plain = [p.answer for p in batch if p.answer is not None and p.answer.hedge_model is None]
        rows = [p for p in batch if p.answer is None or p.answer.hedge_model is None]
        usage = [u for p in rows for u in p.usage]
        if plain:
            self._write_group(rows, lambda: _aligned(rows, mark_solved_many(self.engine, plain, usage)))
        elif rows:
            def rows_alone() -> list[Written | None]:
                record_usage(self.engine, usage)
                return [None] * len(rows)

            self._write_group(rows, rows_alone)
        for hedge in batch:  # each under the hedge's guard
            if hedge.answer is not None and hedge.answer.hedge_model is not None:
                self._write_group([hedge], partial(_solved_one, self.engine, hedge.answer, hedge.usage))

    def _write_one(self, p: _Pending) -> None:
        """One answer (or one call's ledger rows) in a statement of its own."""
        if p.answer is None:
            self._write_group([p], partial(_rows_one, self.engine, p.usage))
        elif p.answer.hedge_model is not None:
            self._write_group([p], partial(_solved_one, self.engine, p.answer, p.usage))
        else:
            self._write_group([p], partial(_plain_one, self.engine, p.answer, p.usage))

    def _write_group(self, group: list[_Pending], write: Callable[[], list[Written | None]], *,
                     isolate: bool = True) -> None:
        """One statement for ``group``, retried until its earliest deadline; each solve gets its outcome.

        A statement PostgreSQL refuses (not an outage) fails none of the others: a group
        is written again one answer at a time, and an answer refused alone ends its task
        failed with the reason (:func:`~balancer.backlog.transitions.mark_unstorable`),
        so it is never called again; only what even that cannot write reaches its solve."""
        deadlines = [p.deadline for p in group if p.deadline is not None]
        token = SOLVE_DEADLINE.set(min(deadlines) if deadlines else time.monotonic() + DEFAULT_DEADLINE_S)
        try:
            written = with_db_retry(write)
        except Exception as exc:  # noqa: BLE001 - every waiting solve gets it, or its own write
            refused = _refused_by_database(exc) if isolate else None
            if refused is not None and len(group) > 1:
                log.warning("a batch of %d answers was refused (%s); writing each alone", len(group), refused)
                for p in group:
                    self._write_one(p)
            elif refused is not None and group[0].answer is not None:
                answer = group[0].answer
                log.error("task %d: its answer could not be stored (%s); the task fails", answer.task_id, refused)
                self._write_group(group, partial(_refused_one, self.engine, answer,
                                                 f"the answer could not be stored: {refused}", group[0].usage),
                                  isolate=False)
            else:
                for p in group:
                    p.outcome.set_exception(exc)
            return
        finally:
            SOLVE_DEADLINE.reset(token)
        for p, w in zip(group, written, strict=True):
            try:
                p.outcome.set_result(p.then(w))
            except Exception as exc:  # noqa: BLE001 - the solve that handed it over gets it
                p.outcome.set_exception(exc)


def _refused_by_database(exc: BaseException) -> str | None:
    """What PostgreSQL (or the driver, before sending) refused in a write, in one line; None for
    an outage (the write was retried until its deadline: the answer may still be storable)."""
    if isinstance(exc, (OperationalError, PoolTimeout)) or (isinstance(exc, DBAPIError) and exc.connection_invalidated):
        return None
    if not isinstance(exc, (DBAPIError, ValueError, UnicodeError)):
        return None  # a bug, not the data: the solve gets it
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return printable(lines[0] if lines else type(exc).__name__, 200)
