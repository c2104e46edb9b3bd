"""The fair share across sources: the pure rule on hand-made cases and
properties, then the dispatcher's window on real PostgreSQL and Redis."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.dispatch import shares as shared_state
from balancer.sources.fairshare import DEFAULT_QUANTUM, UNDECLARED, Shares, fill, refund


@dataclass(frozen=True)
class T:
    source: str
    n: int
    priority: int = 0
    estimated_tokens: int = 400


def backlog(source: str, count: int, *, priority: int = 0, tokens: int = 400, start: int = 0) -> list[T]:
    return [T(source, start + i, priority, tokens) for i in range(count)]


# -- hand-made cases ---------------------------------------------------------------------------

def test_a_live_source_takes_turns_with_a_backfill() -> None:
    """Today's rule (priority, then age) puts the whole backfill first; the fair
    window gives the live source every other place."""
    order, _ = fill({"backfill": backlog("backfill", 1_000), "live": backlog("live", 3)}, 8, {}, Shares())
    assert [t.source for t in order] == ["backfill", "live"] * 3 + ["backfill"] * 2


def test_turns_carry_over_rounds_through_the_state() -> None:
    """One task per round (a single free slot): without the state the first
    source in turn order would win every round; with it they alternate."""
    queues = {"a": backlog("a", 50), "b": backlog("b", 50)}
    state, taken = Shares(), []
    for _ in range(6):
        order, state = fill({s: [t for t in q if t not in taken] for s, q in queues.items()}, 1, {}, state)
        taken += order
    assert [t.source for t in taken] == ["a", "b"] * 3


def test_weights_set_the_shares_in_tokens() -> None:
    order, _ = fill({"a": backlog("a", 100), "b": backlog("b", 100)}, 60, {"a": 3}, Shares())
    assert Counter(t.source for t in order) == {"a": 45, "b": 15}


def test_shares_are_in_tokens_not_tasks() -> None:
    """A source of large prompts gets fewer tasks for the same tokens."""
    order, _ = fill({"big": backlog("big", 50, tokens=1_600), "small": backlog("small", 200, tokens=400)},
                    50, {}, Shares())
    got = Counter(t.source for t in order)
    assert got["small"] == 4 * got["big"]


def test_priority_comes_before_the_share() -> None:
    queues = {"a": [*backlog("a", 2, priority=9), *backlog("a", 5, start=2)], "b": backlog("b", 5, priority=5)}
    order, _ = fill(queues, 9, {"b": 100}, Shares())
    assert [(t.source, t.priority) for t in order[:7]] == [("a", 9)] * 2 + [("b", 5)] * 5
    assert [t.source for t in order[7:]] == ["a", "a"]


def test_a_source_alone_takes_the_whole_window_and_an_absent_one_banks_nothing() -> None:
    order, state = fill({"a": backlog("a", 10)}, 10, {}, Shares({"b": 50_000}, "b"))
    assert order == backlog("a", 10)
    assert "b" not in state.deficits  # b had nothing pending: its old deficit is dropped


def test_a_refund_gives_back_what_the_admission_did_not_take() -> None:
    order, charged = fill({"a": backlog("a", 5), "b": backlog("b", 5)}, 4, {}, Shares())
    unserved = [(t.source, t.estimated_tokens) for t in order if t.source == "b"]
    back = refund(charged, unserved)
    assert back.deficits["b"] == charged.deficits["b"] + 800 and back.deficits["a"] == charged.deficits["a"]
    # b's refused turns are not lost: next round b takes them back before a's turn comes again
    nxt, _ = fill({"a": backlog("a", 5, start=5), "b": backlog("b", 5)}, 2, {}, back)
    assert [t.source for t in nxt] == ["b", "b"]


# -- properties ------------------------------------------------------------------------------

sources = st.sampled_from(["a", "b", "c", "d"])
tasks_st = st.builds(lambda s, p, e: (s, p, e), sources, st.integers(0, 2), st.integers(1, 5_000))


def queues_of(raw: list[tuple[str, int, int]]) -> dict[str, list[T]]:
    out: dict[str, list[T]] = {}
    for n, (s, p, e) in enumerate(raw):
        out.setdefault(s, []).append(T(s, n, p, e))
    return {s: sorted(q, key=lambda t: (-t.priority, t.n)) for s, q in out.items()}


@settings(max_examples=200, deadline=None)
@given(st.lists(tasks_st, max_size=60), st.integers(0, 80),
       st.dictionaries(sources, st.integers(1, 10)), st.dictionaries(sources, st.integers(0, 20_000)))
def test_work_conserving_priority_ordered_and_each_source_in_its_order(raw, limit, weights, deficits) -> None:
    queues = queues_of(raw)
    order, _ = fill(queues, limit, weights, Shares(deficits))
    assert len(order) == min(limit, len(raw))  # never leaves a place empty while work is claimed
    assert len(set(order)) == len(order)
    assert [t.priority for t in order] == sorted((t.priority for t in order), reverse=True)
    for s, q in queues.items():
        mine = [t for t in order if t.source == s]
        assert mine == q[:len(mine)]  # a source's own order (priority, then age) is kept


@settings(max_examples=100, deadline=None)
@given(st.lists(st.builds(lambda p, e: (p, e), st.integers(0, 2), st.integers(1, 5_000)), max_size=40),
       st.integers(0, 50), st.integers(1, 10), st.integers(0, 20_000))
def test_a_lone_source_gets_everything(raw, limit, weight, deficit) -> None:
    queue = sorted((T("a", n, p, e) for n, (p, e) in enumerate(raw)), key=lambda t: (-t.priority, t.n))
    order, _ = fill({"a": queue}, limit, {"a": weight}, Shares({"a": deficit}))
    assert order == queue[:limit]


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(sources, st.integers(1, 8), min_size=2), st.integers(1, 12), st.integers(0, 2**32))
def test_shares_follow_weights_over_rounds(weights, limit, seed) -> None:
    """Every source always backlogged, one window after another: each source's
    tokens stay within a bounded distance of weight/Σweights of the total."""
    rng = random.Random(seed)
    served = Counter[str]()
    state = Shares()
    n = 0
    for _ in range(300):
        queues = {}
        for s in weights:
            queues[s] = [T(s, n + i, 0, rng.randint(50, 2_000)) for i in range(limit)]
            n += limit
        order, state = fill(queues, limit, weights, state)
        for t in order:
            served[t.source] += t.estimated_tokens
    total, w = sum(served.values()), sum(weights.values())
    slack = 2 * (2_000 + DEFAULT_QUANTUM * max(weights.values()))
    for s, weight in weights.items():
        assert abs(served[s] - total * weight / w) <= slack * len(weights), (s, served, weights)


# -- the dispatcher's window, on real PostgreSQL and Redis -----------------------------------------


@pytest.fixture
def svc(migrated):  # noqa: ANN001, ANN201
    from balancer.services import Services
    from balancer.settings import Settings

    return Services.connect(Settings.from_env())


def add(svc, source: str, count: int, priority: int = 0) -> list[int]:  # noqa: ANN001
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks

    text = "\n".join(json.dumps({"prompt": f"{source}-{i}", "source": source, "priority": priority})
                     for i in range(count))
    rows, errors = parse_tasks(text, models={q.name: q.burst for q in svc.quotas.all()})
    assert not errors
    with svc.engine.begin() as conn:
        return insert_tasks(conn, rows)


def test_the_dispatcher_gives_a_live_source_its_turns_behind_a_backfill(svc) -> None:  # noqa: ANN001
    from balancer.admission.quota import Quota
    from balancer.dispatch.dispatcher import Assignment, dispatch

    svc.quotas.replace_all([Quota("m", 6, 10**9, slow_start=False)])
    add(svc, "backfill", 500)
    live = add(svc, "live", 3)
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    assert {a.task_id for a in sent} >= set(live)  # 6 slots: 3 for each source, not 6 for the backfill
    # Neither has a weight set: they share the undeclared names' flow, taking turns by name.
    state = shared_state.load(svc.redis, svc.settings.namespace)
    assert state.deficits.keys() == {UNDECLARED} and state.inner in {"backfill", "live"}


def test_with_fairness_off_the_window_is_priority_then_age(svc, monkeypatch) -> None:  # noqa: ANN001
    from balancer.admission.quota import Quota
    from balancer.dispatch.dispatcher import Assignment, dispatch
    from balancer.services import Services
    from balancer.settings import Settings

    monkeypatch.setenv("BALANCER_SOURCE_FAIRNESS", "off")
    off = Services.connect(Settings.from_env())
    off.quotas.replace_all([Quota("m", 6, 10**9, slow_start=False)])
    backfill = add(off, "backfill", 500)
    add(off, "live", 3)
    sent: list[Assignment] = []
    dispatch(off, sent.extend)
    assert [a.task_id for a in sent] == backfill[:6]


def test_weights_from_the_table_set_the_window(svc) -> None:  # noqa: ANN001
    from balancer.admission.quota import Quota
    from balancer.dispatch.dispatcher import Assignment, dispatch
    from balancer.sources.weights import set_weight

    svc.quotas.replace_all([Quota("m", 8, 10**9, slow_start=False)])
    heavy = add(svc, "heavy", 50)
    add(svc, "light", 50)
    with svc.engine.begin() as conn:
        set_weight(conn, "heavy", 3, by="test")
    sent: list[Assignment] = []
    dispatch(svc, sent.extend)
    assert sum(a.task_id in set(heavy) for a in sent) == 6  # 3:1 of 8 slots


def test_claim_by_source_reads_each_source_head_not_the_backlog(svc) -> None:  # noqa: ANN001
    from balancer.admission.quota import Quota
    from balancer.backlog import claims

    svc.quotas.replace_all([Quota("m", 8, 10**9)])
    add(svc, "a", 2_000)
    with svc.engine.begin() as conn:
        conn.execute(sa.text("ANALYZE tasks"))  # statistics that know one source only
    b = add(svc, "b", 3, priority=2)
    with svc.engine.begin() as conn:
        queues = claims.claim_by_source(conn, claims.pending_sources(conn), 5, ["m"])
        assert {s: len(q) for s, q in queues.items()} == {"a": 5, "b": 3}
        assert [t.id for t in queues["b"]] == b
        plan = "\n".join(r[0] for r in conn.execute(sa.text("EXPLAIN " + claims._CLAIM_BY_SOURCE.text),
                                                     {"sources": ["a", "b"], "open_models": ["m"], "ks": [5, 5]}))
    assert "Index Scan using tasks_pending_source" in plan and "Index Cond" in plan, plan


def test_source_set_sets_the_weight_with_an_audit_and_refuses_bad_input(svc) -> None:  # noqa: ANN001
    from balancer.cli import main
    from balancer.storage.schema import source_changes, source_weights

    assert main(["source", "set", "crm", "--weight", "4", "--by", "ops", "--new"]) == 0
    assert main(["source", "set", "crm", "--weight", "0"]) == 2
    assert main(["source", "set", "bad\x07name", "--weight", "2"]) == 2
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(source_weights.c.source, source_weights.c.weight)).all() == [("crm", 4)]
        audit = conn.execute(sa.select(source_changes.c.changed_by, source_changes.c.new_value)).all()
    assert audit == [("ops", {"weight": 4})]


@pytest.mark.parametrize(("sources", "stocked"), [(("backfill",), 8), (("backfill", "live"), 4)])
def test_ready_lists_stay_shallow_while_sources_share(svc, sources: tuple[str, ...], stocked: int) -> None:  # noqa: ANN001
    """A model of 8 slots keeps one ready task per slot (latency not measured
    yet); with two sources pending, half a slot, so a live source's next task
    is never stocked behind 8 of the backfill's."""
    from balancer.admission.quota import Quota
    from balancer.dispatch.dispatcher import Assignment, dispatch

    svc.quotas.replace_all([Quota("m", 8, 10**9, slow_start=False)])
    for source in sources:
        add(svc, source, 100)
    sent: list[Assignment] = []
    report = dispatch(svc, sent.extend)
    assert len(sent) == 8
    assert report.stocked == svc.core.live()["m"].ready == stocked
