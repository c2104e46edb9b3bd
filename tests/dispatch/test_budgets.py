"""Budgets per day: the pure rule on hand-made cases, then the dispatcher, the
CLI and ``status`` on real PostgreSQL and Redis (the end-to-end run is in
tests/dispatch/test_budgets_e2e.py)."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from balancer.costs.budget import Budget, BudgetError, Standing, check_money, check_tokens, day_start, held, standings
from balancer.costs.cost import Charged, Price, charge

# -- the rule, on hand-made cases ------------------------------------------------------------

PRICES = {"cheap": Price(1.0, 2.0), "free": None}


@pytest.mark.parametrize(("budget", "rows", "over"), [
    (Budget("s", 1.0), [("s", "cheap", 500_000, 250_000)], True),  # 0.5 + 0.5 = 1.0: reached is spent
    (Budget("s", 1.0), [("s", "cheap", 500_000, 249_999)], False),
    (Budget("s", None, 1_000), [("s", "cheap", 600, 400)], True),
    (Budget("s", None, 1_000), [("s", "cheap", 600, 399)], False),
    (Budget("s", None, 1_000), [("s", "free", 600, 400)], True),  # unpriced tokens count toward tokens
    (Budget("s", 0.5), [("s", "free", 10**9, 10**9)], False),  # ... but cost nothing that can be counted
    (Budget("s", 100.0, 10), [("s", "cheap", 5, 5)], True),  # either budget, once reached
    (Budget("s", 0.0), [], True),  # a budget of 0 holds every new call
    (Budget("s", 1.0), [("other", "cheap", 10**9, 0)], False),  # another source's spend is its own
])
def test_a_source_is_over_budget_once_either_budget_is_reached(budget: Budget, rows: list, over: bool) -> None:
    standing = standings([budget], charge(rows, PRICES, "USD"), "USD")[budget.source]
    assert standing.over is over
    assert held({budget.source: standing}) == (frozenset({budget.source}) if over else frozenset())
    assert (standing.waiting() is not None) is over


def test_the_wait_says_why_with_what_was_spent_against_the_budget() -> None:
    s = standings([Budget("crm", 5.0)], charge([("crm", "cheap", 3_000_000, 1_010_000)], PRICES, "USD"), "USD")["crm"]
    assert s.waiting() == "waiting: budget spent (5.02 of 5.00 USD today)"
    assert s.as_dict() == {"source": "crm", "budget_per_day": 5.0, "budget_tokens_per_day": None, "currency": "USD",
                           "spent_today": 5.02, "spent_tokens_today": 4_010_000, "unpriced_tokens_today": 0,
                           "over": True, "waiting": "waiting: budget spent (5.02 of 5.00 USD today)"}


def test_a_money_budget_says_what_it_cannot_count() -> None:
    """A money budget with the source's calls on models with no price: the wait's
    text said '0.00 of 5.00 today' for ever, as if nothing had been spent."""
    st = standings([Budget("s", 5.0)], charge([("s", "free", 600_000, 400_000), ("s", "cheap", 1_000_000, 0)],
                                              PRICES, "USD"), "USD")
    assert not st["s"].over
    assert st["s"].spent_text() == "1.00 of 5.00 USD today (and 1,000,000 tokens with no price in it, not counted)"


def test_a_budget_counts_each_call_at_its_own_price_and_never_adds_two_currencies() -> None:
    """Issue 38 finding 13: budgets were priced at today's prices, so cutting a price or removing a
    quota gave back what had been spent, and spends in two currencies were added together. Each
    call now counts at the price of its start: a 4.00 USD call stays 4.00 whatever the price is
    now; 9 EUR of calls made before the quotas moved to USD are not 9 USD."""
    rows = [Charged("s", "cheap", 1_000_000, 1_000_000, 4.0, "USD"), Charged("s", "gone", 10, 0, 9.0, "EUR")]
    st = standings([Budget("s", 5.0)], rows, "USD")["s"]
    assert st.money == 4.0 and st.unpriced_tokens == 10 and not st.over
    assert standings([Budget("s", 4.0)], rows, "USD")["s"].over  # reached, whatever today's prices say


def test_the_day_starts_at_midnight_utc() -> None:
    east = datetime(2026, 3, 2, 1, 30, tzinfo=UTC).astimezone(__import__("zoneinfo").ZoneInfo("Asia/Tokyo"))
    assert day_start(east) == datetime(2026, 3, 2, tzinfo=UTC)
    assert day_start(datetime(2026, 3, 1, 23, 59, 59, tzinfo=UTC)) == datetime(2026, 3, 1, tzinfo=UTC)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "abc", "", "1e10", True, -0.5, "1_000", "١٢", "1e400"])
def test_a_money_budget_is_a_finite_amount_in_range(value: object) -> None:
    with pytest.raises(BudgetError):
        check_money(value)


@pytest.mark.parametrize("value", ["-1", "1.5", "abc", "", "2e6", "١٢", 10**16, True])
def test_a_token_budget_is_a_whole_number_in_range(value: object) -> None:
    with pytest.raises(BudgetError):
        check_tokens(value)


def test_none_clears_and_good_values_pass() -> None:
    assert (check_money("none"), check_money("5.00"), check_tokens("none"), check_tokens("0")) == (None, 5.0, None, 0)
    assert Standing(Budget("s", None, 10), 3, 0.0, 0, None).waiting() is None


# -- on real services ------------------------------------------------------------------------------

@pytest.fixture
def svc(migrated):  # noqa: ANN001, ANN201
    from balancer.services import Services
    from balancer.settings import Settings

    return Services.connect(Settings.from_env())


def add(svc, source: str, count: int, model: str | None = None) -> list[int]:  # noqa: ANN001
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks

    text = "\n".join(json.dumps({"prompt": f"{source}-{i}", "source": source, **({"model": model} if model else {})})
                     for i in range(count))
    rows, errors = parse_tasks(text, models={q.name: q.burst for q in svc.quotas.all()})
    assert not errors
    with svc.engine.begin() as conn:
        return insert_tasks(conn, rows)


def solve(svc, ids: list[int], prompt: int, completion: int, at: str = "now()") -> None:  # noqa: ANN001
    """Solve ``ids`` on model m at ``at``, each by one answered call in the ledger (what spend counts),
    priced at m's price now, as a worker prices a call at its start."""
    from balancer.costs.cost import price_list

    prices, currency = price_list(svc.quotas.all())
    price = prices.get("m")
    cost = None if price is None else price.cost(prompt, completion)
    with svc.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE tasks SET status = 'solved', model = 'm', prompt_tokens = :p, "  # noqa: S608
                             f"completion_tokens = :c, solved_at = {at}, updated_at = {at} WHERE id = ANY(:ids)"),
                     {"p": prompt, "c": completion, "ids": ids})
        conn.execute(sa.text("INSERT INTO call_usage (call_id, task_id, source, model, admission_id, prompt_tokens,"  # noqa: S608
                             " completion_tokens, answered, hedge, ended_at, cost, currency) SELECT 'test-' || id, id,"
                             f" source, 'm', 'a' || id, :p, :c, true, false, {at}, :cost, :currency FROM tasks"
                             " WHERE id = ANY(:ids)"),
                     {"p": prompt, "c": completion, "ids": ids, "cost": cost, "currency": None if cost is None else currency})


def set_budget(svc, source: str, money: float | None = None, tokens: int | None = None) -> None:  # noqa: ANN001
    from balancer.sources.budgets import set_budget as store

    with svc.engine.begin() as conn:
        store(conn, Budget(source, money, tokens), by="test")


def test_spent_since_counts_solved_tasks_from_that_time_on(svc) -> None:  # noqa: ANN001
    from balancer.admission.quota import Quota
    from balancer.backlog.spend import charges

    def spent_by_source_since(db, since):  # noqa: ANN001, ANN202 - the tokens of charges(db, since)
        return sorted((c.source, c.model, c.prompt_tokens, c.completion_tokens) for c in charges(db, since))

    svc.quotas.replace_all([Quota("m", 4, 10**9)])
    today, yesterday = add(svc, "crm", 2), add(svc, "crm-old", 1)
    solve(svc, today, 100, 50)
    solve(svc, yesterday, 7, 7, at="now() - interval '1 day'")
    add(svc, "crm", 1)  # pending: nothing spent
    since = day_start(datetime.now(UTC)) - timedelta(hours=1) if datetime.now(UTC).hour == 0 else \
        day_start(datetime.now(UTC))
    rows = spent_by_source_since(svc.engine, since)
    assert rows == [("crm", "m", 200, 100)]
    with svc.engine.connect() as conn:
        assert spent_by_source_since(conn, since - timedelta(days=2)) == sorted([("crm", "m", 200, 100),
                                                                                  ("crm-old", "m", 7, 7)])


@pytest.mark.parametrize("fairness", ["on", "off"])
def test_the_dispatcher_claims_nothing_of_a_source_over_budget_until_it_is_raised(
        svc, fairness: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Over budget: none of its tasks, flexible or pinned, is admitted, stocked or
    hedged, and a model whose pinned work is all held still takes other work.
    Raised: the next dispatch run takes them."""
    from balancer.admission.quota import Quota
    from balancer.dispatch.dispatcher import Assignment, dispatch
    from balancer.services import Services
    from balancer.settings import Settings

    monkeypatch.setenv("BALANCER_SOURCE_FAIRNESS", fairness)
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("m", 6, 10**9, slow_start=False), Quota("n", 6, 10**9, slow_start=False)])
    spent = add(svc, "capped", 3)
    solve(svc, spent, 400, 200)
    capped = set(add(svc, "capped", 20) + add(svc, "capped", 5, model="m"))
    other = add(svc, "other", 40)
    set_budget(svc, "capped", tokens=1_800)  # 3 × 600 spent: reached
    sent: list[Assignment] = []
    report = dispatch(svc, sent.extend)
    assert report.held == frozenset({"capped"})
    assert len(sent) == 12 and not {a.task_id for a in sent} & capped
    assert {a.model for a in sent} == {"m", "n"}  # m's pinned tasks wait: they reserve nothing
    with svc.engine.connect() as conn:
        taken = set(conn.execute(sa.text("SELECT id FROM tasks WHERE status <> 'pending' AND source = 'capped'"))
                    .scalars())
    assert not taken & capped  # nothing of it queued nor stocked on a ready list
    assert any(t in other for t in (a.task_id for a in sent))

    set_budget(svc, "capped", tokens=10**6)
    again: list[Assignment] = []
    for _ in range(4):  # the calls end (their slots free), and the next run takes ready tasks, then the window
        svc.core.withdraw([a.admission_id for a in sent + again])
        report = dispatch(svc, again.extend)
        assert report.held == frozenset()
        if {a.task_id for a in again} & capped:
            break
    assert {a.task_id for a in again} & capped


def test_source_set_sets_and_clears_a_budget_with_an_audit_and_refuses_bad_input(svc, capsys) -> None:  # noqa: ANN001
    from balancer.cli import main
    from balancer.storage.schema import source_budgets, source_changes

    assert main(["source", "set", "crm", "--budget-per-day", "5.00", "--by", "ops", "--new"]) == 0
    assert main(["source", "set", "crm", "--budget-tokens-per-day", "2000000", "--by", "ops"]) == 0
    assert "crm: budget 5.00 and 2,000,000 tokens per day" in capsys.readouterr().out
    for bad in (["--budget-per-day", "-1"], ["--budget-per-day", "nan"], ["--budget-per-day", "5 USD"],
                ["--budget-tokens-per-day", "1.5"], ["--budget-tokens-per-day", "-3"],
                ["--no-budget", "--budget-per-day", "1"], []):
        capsys.readouterr()
        assert main(["source", "set", "crm", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, (bad, err)
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(source_budgets.c.source, source_budgets.c.money_per_day,
                                      source_budgets.c.tokens_per_day)).all() == [("crm", 5.0, 2_000_000)]
    assert main(["source", "set", "crm", "--budget-per-day", "none"]) == 0
    assert main(["source", "set", "crm", "--no-budget", "--by", "ops"]) == 0
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(source_budgets)).scalar() == 0
        audit = conn.execute(sa.select(source_changes.c.action, source_changes.c.changed_by, source_changes.c.new_value)
                             .order_by(source_changes.c.id)).all()
    assert [a[0] for a in audit] == ["budget"] * 4
    assert audit[0][1:] == ("ops", {"budget_per_day": 5.0, "budget_tokens_per_day": None})
    assert audit[1][2] == {"budget_per_day": 5.0, "budget_tokens_per_day": 2_000_000}
    assert audit[3][2] == {"budget_per_day": None, "budget_tokens_per_day": None}


def test_status_and_source_list_show_the_budget_spent_today_and_the_wait(svc, capsys) -> None:  # noqa: ANN001
    from balancer.admission.quota import Quota
    from balancer.cli import main

    svc.quotas.replace_all([Quota("m", 4, 10**9, price_per_million_input=1.0, price_per_million_output=2.0,
                                  currency="USD")])
    solve(svc, add(svc, "crm", 2), 1_000_000, 500_000)  # 2 × (1.00 + 1.00)
    add(svc, "crm", 3)
    add(svc, "web", 1)
    assert main(["source", "set", "crm", "--budget-per-day", "3.50"]) == 0
    assert main(["source", "set", "web", "--budget-tokens-per-day", "100"]) == 0
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    budgets = {b["source"]: b for b in json.loads(capsys.readouterr().out)["budgets"]}
    assert budgets["crm"]["over"] and budgets["crm"]["spent_today"] == 4.0 and budgets["crm"]["currency"] == "USD"
    assert budgets["crm"]["waiting"] == "waiting: budget spent (4.00 of 3.50 USD today)"
    assert budgets["web"]["waiting"] is None and budgets["web"]["spent_tokens_today"] == 0
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "budget crm: 3.50 USD per day; waiting: budget spent (4.00 of 3.50 USD today)" in out
    assert "budget web: 100 tokens per day; spent 0 of 100 tokens today" in out
    assert main(["source", "set", "web", "--weight", "3"]) == 0
    assert main(["source", "set", "api", "--weight", "2", "--new"]) == 0  # a weight and no budget: listed too (was not)
    capsys.readouterr()
    assert main(["source", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert "crm: budget 3.50 USD per day; waiting: budget spent (4.00 of 3.50 USD today)" in listed
    assert "web: weight 3; budget 100 tokens per day; spent 0 of 100 tokens today" in listed
    assert "api: weight 2" in listed
    from balancer.views.metrics import BalancerCollector

    scraped = {m.name: {s.labels.get("source"): s.value for s in m.samples} for m in BalancerCollector(svc).collect()}
    assert scraped["balancer_source_over_budget"] == {"crm": 1, "web": 0}
    assert scraped["balancer_source_spent_tokens_today"] == {"crm": 3_000_000, "web": 0}


def test_status_leaves_the_tasks_waiting_on_a_budget_out_of_the_eta(svc, capsys) -> None:  # noqa: ANN001
    """60 tasks of a source over budget and 20 of another, on one model of 2 slots whose prior says
    3 s a call: the ETA is the 20 tasks' (as if the 60 were not there), and the 60 are said to wait."""
    from balancer.admission.quota import Quota
    from balancer.cli import main

    svc.quotas.replace_all([Quota("m", 2, 10_000_000, expected_latency_s=3.0)])
    add(svc, "web", 20)
    assert main(["status", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    add(svc, "capped", 60)
    set_budget(svc, "capped", tokens=0)
    assert main(["status", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pending"] == 80 and report["eta_s"] == pytest.approx(alone["eta_s"], abs=0.2)
    assert report["waiting_on_budget"] == 60 and alone["waiting_on_budget"] == 0
    assert main(["status"]) == 0
    assert "; 60 pending task(s) wait on a budget, not in the eta" in capsys.readouterr().out
    set_budget(svc, "capped", tokens=None)  # cleared: the 60 are work again
    assert main(["status", "--json"]) == 0
    raised = json.loads(capsys.readouterr().out)
    assert raised["waiting_on_budget"] == 0 and raised["eta_s"] > 3 * alone["eta_s"]


def test_pruning_today_s_tasks_does_not_give_their_spend_back_to_the_budget(svc) -> None:  # noqa: ANN001
    """`tasks prune` deleted the pruned tasks' ledger rows, today's too: pruning the day's
    solved tasks un-spent the day's budget, and the held source resumed, past its budget.
    Today's rows stay until a prune after the day turns (older ones go with their tasks)."""
    from balancer.admission.quota import Quota
    from balancer.backlog.ledger import calls_recorded
    from balancer.backlog.retention import prune
    from balancer.dispatch.budgets import held_sources

    svc.quotas.replace_all([Quota("m", 4, 10**9)])
    today, old = add(svc, "crm", 2), add(svc, "crm", 3)
    solve(svc, today, 600, 400)
    solve(svc, old, 10, 10, at="now() - interval '2 days'")
    set_budget(svc, "crm", tokens=2_000)
    assert held_sources(svc) == {"crm"}
    assert prune(svc.engine, datetime.now(UTC) + timedelta(seconds=1), by="test", apply=True) == 5
    assert held_sources(svc) == {"crm"}  # still spent: 2,000 tokens today
    assert calls_recorded(svc.engine) == 2  # the 3 calls of 2 days ago went with their tasks
    with svc.engine.begin() as conn:  # the day turns
        conn.execute(sa.text("UPDATE call_usage SET ended_at = ended_at - interval '1 day'"))
    assert prune(svc.engine, datetime.now(UTC), by="test", apply=True) == 0
    assert calls_recorded(svc.engine) == 0 and held_sources(svc) == frozenset()  # the kept rows went then


def test_a_money_budget_with_no_model_priced_says_it_counts_nothing(svc, capsys) -> None:  # noqa: ANN001
    from balancer.admission.quota import Quota
    from balancer.cli import main

    svc.quotas.replace_all([Quota("m", 4, 10**9)])
    add(svc, "crm", 1)
    assert main(["source", "set", "crm", "--budget-per-day", "5"]) == 0
    assert "note: no model has a price, so the money budget counts nothing" in capsys.readouterr().out
    assert main(["source", "set", "crm", "--budget-per-day", "none", "--budget-tokens-per-day", "10"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_a_setting_for_an_unknown_source_is_an_error_unless_new(svc, capsys) -> None:  # noqa: ANN001
    """A typo ("crn" for "crm") is one line and exit 2, and nothing is stored; ``--new`` keeps it for
    tasks to come, and then the name is known; a source with tasks needs no flag."""
    from balancer.admission.quota import Quota
    from balancer.cli import main
    from balancer.sources.reads import budgets
    from balancer.sources.weights import weights

    svc.quotas.replace_all([Quota("m", 4, 10**9)])
    add(svc, "crm", 1)
    assert main(["source", "set", "crn", "--weight", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unknown source 'crn': no task carries it"), err
    with svc.engine.connect() as conn:
        assert "crn" not in weights(conn)
    assert main(["source", "set", "crn", "--budget-tokens-per-day", "100", "--new"]) == 0
    assert "crn: new source: the setting is kept for its tasks when they come" in capsys.readouterr().out
    assert [b.source for b in budgets(svc.engine)] == ["crn"]
    assert main(["source", "set", "crn", "--weight", "3"]) == 0  # known now: it has a setting
    assert main(["source", "set", "crm", "--weight", "2"]) == 0
    assert "new source" not in capsys.readouterr().out


def test_top_shows_each_source_with_its_tasks_weight_and_budget(svc) -> None:  # noqa: ANN001
    """``top``'s per-source block: a source table's tasks by state and weight, and its budget's wait;
    a JSONL source with a budget, its weight and budget alone. Without the block no row names them."""
    import subprocess
    import sys

    from balancer.admission.quota import Quota
    from balancer.cli import main
    from balancer.sources.definition import parse_source_file
    from balancer.sources.store import import_sources

    svc.quotas.replace_all([Quota("m", 4, 10**9, price_per_million_input=1.0, price_per_million_output=2.0,
                                  currency="USD")])
    import_sources(svc.engine, parse_source_file('[sources.crm]\ntable = "t"\nkey = "id"\nprompt = "p"\n'
                                                 'answer = "a"\nwhere = "a IS NULL"\nweight = 3\n'),
                   by="test", replace=False, dry_run=False)
    ids = add(svc, "crm", 6)
    solve(svc, ids[:2], 1_000_000, 500_000)  # 2 × (1.00 + 1.00): over a 3.50 budget
    with svc.engine.begin() as conn:
        conn.execute(sa.text("UPDATE tasks SET status = 'failed' WHERE id = :id"), {"id": ids[2]})
        conn.execute(sa.text("UPDATE tasks SET status = 'running' WHERE id = :id"), {"id": ids[3]})
    assert main(["source", "set", "crm", "--budget-per-day", "3.50"]) == 0
    assert main(["source", "set", "web", "--budget-tokens-per-day", "100", "--new"]) == 0
    done = subprocess.run([sys.executable, "-m", "balancer", "top", "--count", "1"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})  # wide enough that no budget cell wraps
    assert done.returncode == 0, done.stderr
    rows = {cells[0]: cells[1:] for line in done.stdout.splitlines()
            if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 9}
    assert rows["crm"] == ["2", "1", "2", "1", "0", "3", "3.50 USD per day; waiting: budget spent (4.00 of 3.50 USD "
                           "today)", "0"]
    assert rows["web"] == ["-", "-", "-", "-", "-", "1", "100 tokens per day; spent 0 of 100 tokens today", "-"]
