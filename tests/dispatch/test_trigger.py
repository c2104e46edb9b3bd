"""Dispatch requests: the flag that coalesces them across processes (real Redis)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from balancer.admission import keys
from balancer.dispatch.trigger import ROUND_HOLD_MS, request_dispatch, run_alone, take_round


def test_one_request_per_burst_until_a_run_clears_the_flag(redis_client: redis.Redis, namespace: str) -> None:
    sent: list[float] = []
    assert request_dispatch(redis_client, namespace, sent.append)
    assert not request_dispatch(redis_client, namespace, sent.append)  # one already on its way
    assert take_round(redis_client, namespace, "ask", "t1")  # the message's dispatch task asks for the round
    assert request_dispatch(redis_client, namespace, sent.append)
    assert sent == [0.0, 0.0]
    assert redis_client.pttl(keys.dispatch_flags(namespace)[0]) > 0  # it expires by itself if the message is lost


def test_a_delayed_request_due_sooner_than_the_one_on_its_way_is_sent(redis_client: redis.Redis, namespace: str) -> None:
    """A round slow start asks for in 60 ms is not held back by a token wait's 900 ms on its way."""
    sent: list[float] = []
    assert request_dispatch(redis_client, namespace, sent.append, delay_ms=900)
    assert not request_dispatch(redis_client, namespace, sent.append, delay_ms=900)  # the same: coalesced
    assert request_dispatch(redis_client, namespace, sent.append, delay_ms=60)
    assert not request_dispatch(redis_client, namespace, sent.append, delay_ms=60)  # no sooner: coalesced
    assert sent == [0.9, 0.06]
    assert 0 < redis_client.pttl(keys.dispatch_flags(namespace)[1]) <= 60  # the flag now expires with the sooner one


def test_the_flag_script_does_not_keep_a_client_alive(redis_client: redis.Redis, namespace: str) -> None:
    """The script runs by its digest, with no client kept: a cache of a script per client held up
    to eight clients, and their connection pools, alive."""
    import gc
    import weakref

    client = redis.Redis(connection_pool=redis.ConnectionPool(**redis_client.connection_pool.connection_kwargs))
    sent: list[float] = []
    assert request_dispatch(client, namespace, sent.append, delay_ms=900) and sent == [0.9]
    gone = weakref.ref(client)
    client.close()
    del client
    gc.collect()
    assert gone() is None


def test_the_flag_script_is_sent_whole_to_a_redis_that_has_not_cached_it(redis_client: redis.Redis,
                                                                           namespace: str) -> None:
    """A Redis that has not seen the script (restarted, or failed over to a replica) answers its
    digest with NOSCRIPT: the script is sent whole, and the request goes out."""

    class Forgetful(redis.Redis):
        def evalsha(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise redis.exceptions.NoScriptError("NOSCRIPT No matching script")

    client = Forgetful(connection_pool=redis_client.connection_pool)
    sent: list[float] = []
    assert request_dispatch(client, namespace, sent.append, delay_ms=300) and sent == [0.3]
    assert not request_dispatch(client, namespace, sent.append, delay_ms=300)  # the flag it set holds the next
    assert 0 < redis_client.pttl(keys.dispatch_flags(namespace)[1]) <= 300


class HeldRun:
    """A run that holds the round at its first call until ``go_on`` is set (``holding`` says it
    holds it); every call's name goes to ``runs``."""

    def __init__(self, name: str, result: str | None = None) -> None:
        self.name, self.result = name, result
        self.holding, self.go_on, self.runs = threading.Event(), threading.Event(), []

    def __call__(self) -> str | None:
        self.runs.append(self.name)
        if len(self.runs) == 1:
            self.holding.set()
            self.go_on.wait(10)
        return self.result


def test_a_run_asked_for_while_another_holds_the_round_is_run_by_the_holder_once_it_ends(
        redis_client: redis.Redis, redis_url: str, namespace: str) -> None:
    """Two dispatch runs side by side lost a request (the second found the first's rows locked and
    ended with nothing): the second is left to the first, which runs again; no thread waits."""
    first = HeldRun("first", "ran")
    holding, go_on, runs = first.holding, first.go_on, first.runs
    holder = threading.Thread(target=lambda: runs.append(run_alone(redis_client, namespace, first)))
    holder.start()
    try:
        assert holding.wait(10)
        other = redis.Redis.from_url(redis_url)  # as another dispatcher process's client
        assert run_alone(other, namespace, lambda: runs.append("second")) == []  # left to the holder, at once
        assert run_alone(other, namespace, lambda: runs.append("third")) == []  # asks coalesce
        other.close()
    finally:
        go_on.set()
        holder.join(10)
    assert runs == ["first", "first", ["ran", "ran"]]  # once for it, once for the two asked meanwhile
    assert not any(redis_client.exists(k) for k in keys.dispatch_round(namespace))  # nothing held, nothing asked


def test_a_run_that_raises_lets_go_of_the_round_and_a_dead_holders_hold_expires(
        redis_client: redis.Redis, namespace: str) -> None:
    def fails() -> None:
        raise RuntimeError("PostgreSQL went away")

    with pytest.raises(RuntimeError):
        run_alone(redis_client, namespace, fails)
    assert run_alone(redis_client, namespace, lambda: "ran") == ["ran"]

    asked, running = keys.dispatch_round(namespace)
    redis_client.set(running, "a dispatcher killed mid-run", px=300)  # ROUND_HOLD_MS, shortened
    assert run_alone(redis_client, namespace, lambda: "ran") == []
    deadline = time.monotonic() + 10
    while not (done := run_alone(redis_client, namespace, lambda: "ran")):
        assert time.monotonic() < deadline, "the dead holder's round was never free again"
        time.sleep(0.05)
    assert done == ["ran"] and 0 < ROUND_HOLD_MS <= 1_000


def test_an_ask_outlives_a_hold_that_lapsed_during_a_long_run(
        redis_client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: the ask expired with the hold, so a run longer than the hold lost the ask made
    during it, and nothing ran for it until the next tick. The ask now waits longer than any run."""
    from balancer.dispatch import trigger

    monkeypatch.setattr(trigger, "ROUND_HOLD_MS", 300)
    long_run = HeldRun("run")
    holding, go_on, runs = long_run.holding, long_run.go_on, long_run.runs
    holder = threading.Thread(target=run_alone, args=(redis_client, namespace, long_run))
    holder.start()
    try:
        assert holding.wait(10)
        assert run_alone(redis_client, namespace, lambda: runs.append("asker")) == []  # left to the holder
        _, running = keys.dispatch_round(namespace)
        deadline = time.monotonic() + 10
        while redis_client.exists(running):  # the hold lapses while the run goes on
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        go_on.set()
        holder.join(10)
    assert runs == ["run", "run"]


def test_a_step_of_the_round_applied_twice_says_the_same(redis_client: redis.Redis, namespace: str) -> None:
    """A probe: a lost reply to the script that took the round, its command retried, answered "not
    taken" (the round was held, by this very call), so no run ran and the round stood held until it
    lapsed. Each step now says the same when applied again."""
    assert take_round(redis_client, namespace, "ask", "t1")
    assert take_round(redis_client, namespace, "ask", "t1")  # the retry of the same call: taken, by it
    assert not take_round(redis_client, namespace, "ask", "other")  # another's ask: left to t1
    assert take_round(redis_client, namespace, "next", "t2", "t1")  # t1 lets go, takes it again for "other"
    assert take_round(redis_client, namespace, "next", "t2", "t1")  # retried: t2 holds it, said again
    assert not take_round(redis_client, namespace, "next", "t3", "t2")  # no ask since: let go
    assert not any(redis_client.exists(k) for k in keys.dispatch_round(namespace))


def test_a_run_asked_for_in_the_holders_own_process_costs_no_redis_round_trip(
        redis_client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The round in Redis added two round trips to every dispatch run (fast.toml about 1 % slower);
    a run asked for while a thread of the same process holds the round is left to that thread,
    which runs again for it without asking Redis."""
    from balancer.dispatch import trigger

    steps: list[str] = []
    original = trigger.take_round
    monkeypatch.setattr(trigger, "take_round", lambda *args, **kw: steps.append(args[2]) or original(*args, **kw))
    local, first = trigger.LocalRound(), HeldRun("run")
    holding, go_on, runs = first.holding, first.go_on, first.runs
    holder = threading.Thread(target=run_alone, args=(redis_client, namespace, first, local))
    holder.start()
    try:
        assert holding.wait(10)
        assert run_alone(redis_client, namespace, lambda: runs.append("other"), local) == []
        assert steps == ["ask"]  # the holder's own ask: the other thread's asked nothing of Redis
    finally:
        go_on.set()
        holder.join(10)
    assert runs == ["run", "run"] and steps == ["ask", "next"]
