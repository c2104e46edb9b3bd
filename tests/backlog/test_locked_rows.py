"""A worker cut off in the middle of a write (its host's cable pulled) holds nothing that stalls the
others: real PostgreSQL, a second connection standing in for the worker whose write never ended.

In a run of the real-hosts test a worker host was cut 0.7 s into a batch for 13 s, and no task
was dispatched anywhere from 2.8 s after the cut until 1 s after the heal: a heartbeat's ``UPDATE``
had reached PostgreSQL and its ``COMMIT`` had not, so the cut host's running rows stayed locked,
and the dispatcher's hedge of those very calls waited on them."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import parse_tasks
from balancer.backlog.leases import sweep_expired
from balancer.backlog.transitions import extend_deadlines
from balancer.storage.db import make_engine
from balancer.storage.schema import tasks

pytestmark = pytest.mark.usefixtures("migrated")

#: Far longer than any of these statements takes, far shorter than statement_timeout (60 s):
#: a statement still running then is waiting on the lock.
WAIT_S = 10.0


@pytest.fixture
def engine(migrated: dict[str, str]) -> Iterator[Engine]:
    engine = make_engine(migrated["BALANCER_DATABASE_URL"])
    yield engine
    engine.dispose()


def running(engine: Engine, n: int, *, expired: bool = False) -> list[int]:
    """``n`` tasks running under admissions ``a0``, ``a1``...; past their deadline if ``expired``."""
    lines = "\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(n))
    rows, errors = parse_tasks(lines, models={"m": 10_000})
    assert not errors
    with engine.begin() as conn:
        ids = insert_tasks(conn, rows)
        for i, task_id in enumerate(ids):
            conn.execute(sa.update(tasks).where(tasks.c.id == task_id).values(
                status="running", model="m", admission_id=f"a{i}", started_at=sa.func.now(),
                deadline=sa.func.now() + timedelta(seconds=-1 if expired else 60)))
    return ids


@contextmanager
def locked_by_a_cut_worker(engine: Engine, task_id: int) -> Iterator[None]:
    """The row locked by a transaction that neither commits nor ends, as a worker's write whose
    host was cut between its statement and its COMMIT."""
    with engine.connect() as holder:
        transaction = holder.begin()
        holder.execute(sa.select(tasks.c.id).where(tasks.c.id == task_id).with_for_update())
        try:
            yield
        finally:
            transaction.rollback()


def within(seconds: float, work: Callable[[], Any]) -> Any:
    """``work``'s result (or its exception, raised here), failing if it has not returned within
    ``seconds`` (then it is left to end by itself once the lock goes)."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: on the locked row"
    if errors:
        raise errors[0]
    return out[0]


def test_the_sweep_returns_every_expired_task_but_one_a_cut_worker_holds_locked(engine: Engine) -> None:
    locked, *others = running(engine, 3, expired=True)
    with locked_by_a_cut_worker(engine, locked):
        assert within(WAIT_S, lambda: sweep_expired(engine, (), 60)) == (2, 0)
    with engine.connect() as conn:
        status = dict(conn.execute(sa.select(tasks.c.id, tasks.c.status)).all())
    assert status == {locked: "running", **dict.fromkeys(others, "pending")}
    assert sweep_expired(engine, (), 60) == (1, 0)  # its turn comes once the lock is gone


def test_the_sweep_keeps_a_live_call_s_task_and_skips_a_locked_one(engine: Engine) -> None:
    locked, kept = running(engine, 2, expired=True)
    with locked_by_a_cut_worker(engine, locked):
        assert within(WAIT_S, lambda: sweep_expired(engine, {"a0", "a1"}, 60)) == (0, 1)


def test_a_heartbeat_holds_no_lock_once_its_statement_is_sent(engine: Engine) -> None:
    """The heartbeat's renewal is one statement, committed by PostgreSQL as it runs: a worker
    stopped right after sending it (here, held in the driver's hook after the statement) has
    left no row locked. As a transaction of its own, its COMMIT was one round trip more, and
    a cut before it left every running row of that worker locked until the cut healed."""
    ids = running(engine, 2)
    with engine.connect() as conn:
        before = dict(conn.execute(sa.select(tasks.c.id, tasks.c.deadline).where(tasks.c.id.in_(ids))).all())
    sent, go_on = threading.Event(), threading.Event()
    renewed: list[int] = []

    def held_after_the_statement(*_: object) -> None:
        if threading.current_thread() is renewal:
            sent.set()
            go_on.wait(WAIT_S)

    sa.event.listen(engine, "after_cursor_execute", held_after_the_statement)
    try:
        renewal = threading.Thread(target=lambda: renewed.append(extend_deadlines(engine, ["a0", "a1"], 120)),
                                   daemon=True)
        renewal.start()
        assert sent.wait(WAIT_S)
        with engine.connect() as other:
            free = other.execute(sa.select(tasks.c.id).where(tasks.c.id.in_(ids))
                                 .with_for_update(skip_locked=True)).scalars().all()
            other.rollback()
        assert sorted(free) == sorted(ids)
    finally:
        go_on.set()
        renewal.join(WAIT_S)
        sa.event.remove(engine, "after_cursor_execute", held_after_the_statement)
    with engine.connect() as conn:  # and the renewal was made: both deadlines a lease of 120 s on
        after = dict(conn.execute(sa.select(tasks.c.id, tasks.c.deadline).where(tasks.c.id.in_(ids))).all())
    assert renewed == [2] and all(after[i] > before[i] for i in ids)


def test_a_live_call_s_task_locked_while_the_sweep_looks_is_kept_when_the_lock_goes(engine: Engine) -> None:
    """A review's case: the sweep's two changes (keep a live call's task, return the rest) once read
    "past its deadline and not locked" each for itself. A live call's row locked during the first
    was not kept; unlocked by the second, it was returned to pending with its call alive. The rows
    are now locked once, before both."""
    (task,) = running(engine, 1, expired=True)
    first_done, go_on = threading.Event(), threading.Event()

    def after_the_first_statement(*_: object) -> None:
        if threading.current_thread() is sweeper and not first_done.is_set():
            first_done.set()
            go_on.wait(WAIT_S)

    out: list[tuple[int, int]] = []
    sweeper = threading.Thread(target=lambda: out.append(sweep_expired(engine, {"a0"}, 60)), daemon=True)
    sa.event.listen(engine, "after_cursor_execute", after_the_first_statement)
    try:
        with locked_by_a_cut_worker(engine, task):
            sweeper.start()
            assert first_done.wait(WAIT_S)
        go_on.set()  # the lock is gone before the sweep's next statement
        sweeper.join(WAIT_S)
    finally:
        go_on.set()
        sweeper.join(WAIT_S)
        sa.event.remove(engine, "after_cursor_execute", after_the_first_statement)
    with engine.connect() as conn:
        status = conn.execute(sa.select(tasks.c.status).where(tasks.c.id == task)).scalar_one()
    assert (out, status) == ([(0, 0)], "running")
