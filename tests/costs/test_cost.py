"""Prices per model and spend so far: the maths on hand-made cases, the quota file, and `status`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.admission.quota import Quota
from balancer.cli import main
from balancer.costs.cost import Charged, Price, billed_tokens, charge, money, price_list, price_of, spend, spend_text
from balancer.errors import QuotaError
from balancer.quotas.file import format_quota_file, parse_quota_file

PRICED = """\
currency = "EUR"

[models.big]
max_concurrent_requests = 2
max_tokens_per_minute = 100000
price_per_million_input = 3
price_per_million_output = 15.0

[models.small]
max_concurrent_requests = 4
max_tokens_per_minute = 100000
price_per_million_input = 0.25

[models.free]
max_concurrent_requests = 1
max_tokens_per_minute = 1000
"""


@pytest.mark.parametrize("end, reported, expected", [
    ("answered", (98, 40), (98, 40)),   # the backend's own counts, whatever the estimate
    ("answered", (0, 0), (0, 0)),
    ("cut_off", None, (120, 0)),        # timed out or cancelled: the prompt was read, the output is unknown
    ("cut_off", (5, 5), (120, 0)),      # nothing reported counts for a call cut off
    ("refused", None, (0, 0)),          # 429, 4xx, 5xx: not billed
    ("unsent", None, None),             # never connected: no ledger row
])
def test_what_a_call_is_counted_for_in_spend(end: str, reported: tuple[int, int] | None,
                                             expected: tuple[int, int] | None) -> None:
    assert billed_tokens(end, 120, reported) == expected  # type: ignore[arg-type]


def test_an_answered_call_without_its_counts_is_a_bug_not_a_zero() -> None:
    with pytest.raises(ValueError, match="reported"):
        billed_tokens("answered", 120)


def test_spend_by_model_and_source_on_hand_made_counts() -> None:
    prices = {"big": Price(3.0, 15.0), "small": Price(0.25, 0.0), "free": None}
    usage = [
        ("crm", "big", 200_000, 100_000),     # 0.6 + 1.5 = 2.1
        ("crm", "small", 4_000_000, 999_999),  # 1.0 + 0 = 1.0
        ("etl", "big", 0, 20_000),             # 0.3
        ("etl", "free", 5_000, 5_000),         # unpriced: 10,000 tokens
    ]
    s = spend(charge(usage, prices, "EUR"), "EUR")
    assert s.total == pytest.approx(3.4)
    assert s.by_model == pytest.approx({"big": 2.4, "small": 1.0})
    assert s.by_source == pytest.approx({"crm": 3.1, "etl": 0.3})
    assert s.unpriced_tokens == {"free": 10_000}
    assert spend([], None).as_dict() == {"currency": None, "total": 0.0, "by_model": {}, "by_source": {},
                                         "unpriced_tokens": {}, "other_currencies": {}}


def test_spend_keeps_each_calls_own_price_and_other_currencies_apart() -> None:
    """Issue 38 finding 13: spend re-priced the whole ledger at today's prices and added two
    currencies together. Each row now carries what its calls cost when they were made."""
    rows = [Charged("crm", "big", 1_000, 0, 2.0, "USD"), Charged("crm", "big", 1_000, 0, 1.0, "USD"),
            Charged("crm", "big", 5, 0, 3.0, "EUR"), Charged("etl", "free", 7, 0)]
    s = spend(rows, "USD")
    assert (s.total, s.by_model, s.other_currencies, s.unpriced_tokens) == (3.0, {"big": 3.0}, {"EUR": 3.0}, {"free": 7})
    assert spend_text(s) == "spent: 3.00 USD (big 3.00 USD); unpriced: free 7 tokens; in other currencies, not added: 3.00 EUR"


def test_a_price_with_one_side_given_counts_the_other_as_zero() -> None:
    assert price_of(None, 8.0) == Price(0.0, 8.0)
    assert Price(0.0, 8.0).cost(1_000_000, 500_000) == 4.0
    assert money(4.0, "EUR") == "4.00 EUR" and money(0.004, "USD") == "0.0040 USD"


def test_the_quota_file_names_the_currency_once_and_round_trips() -> None:
    quotas = {q.name: q for q in parse_quota_file(PRICED)}
    assert quotas["big"].price_per_million_input == 3 and quotas["big"].price_per_million_output == 15.0
    assert quotas["small"].price_per_million_output is None
    assert {q.currency for q in quotas.values()} == {"EUR"}
    text = format_quota_file(list(quotas.values()))
    assert text.startswith('currency = "EUR"\n') and text.count("currency") == 1
    assert parse_quota_file(text) == sorted(quotas.values(), key=lambda q: q.name)
    unpriced = "[models.a]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\n"
    assert "currency" not in format_quota_file(parse_quota_file(unpriced))


@pytest.mark.parametrize(("text", "message"), [
    ("[models.a]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\nprice_per_million_input = 2\n",
     "models.a has a price: name its currency once, at the top of the file"),
    ('currency = "USD"\n[models.a]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\ncurrency = "EUR"\n',
     "line 5: models.a: the currency is named once, at the top of the file"),
    ('currency = "dollars"\n[models.a]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\n',
     "currency must be three capital letters"),
    ('currency = "USD"\n[models.a]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\nprice_per_million_output = -1\n',
     "price_per_million_output must be a number from 0 to 1000000"),
    ('currency = "USD"\n[models.a]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\nprice_per_million_input = nan\n',
     "price_per_million_input must be a number"),
])
def test_bad_prices_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(QuotaError, match=message):
        parse_quota_file(text)


def test_two_currencies_cannot_be_exported_into_one_file() -> None:
    with pytest.raises(QuotaError, match="2 currencies"):
        format_quota_file([Quota("a", 1, 5, currency="USD"), Quota("b", 1, 5, currency="EUR")])


@pytest.mark.usefixtures("migrated")
def test_status_shows_spend_so_far_per_model_and_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Prices imported from the quota file are stored (and audited); `status` prices the
    ledger's calls by the model called, per model and per source: a hedge that lost and
    a call cut off count too."""
    from datetime import UTC, datetime

    from balancer.services import Services
    from balancer.settings import Settings
    from balancer.storage.schema import call_usage

    (tmp_path / "quotas.toml").write_text(PRICED)
    assert main(["quota", "import", str(tmp_path / "quotas.toml")]) == 0
    svc = Services.connect(Settings.from_env())
    assert svc.quotas.get("big").price_per_million_output == 15.0  # type: ignore[union-attr]
    assert svc.quotas.history("big")[-1]["new_value"]["currency"] == "EUR"
    rows = [  # (source, model, answered, prompt tokens, completion tokens)
        ("crm", "big", True, 100_000, 50_000),      # 0.3 + 0.75
        ("crm", "big", True, 0, 50_000),            # 0.75: the same task's hedge, answered after the winner
        ("crm", "small", True, 2_000_000, 50_000),  # 0.5
        ("etl", "big", False, 0, 0),                # a 500: nothing
        ("etl", "big", False, 50_000, 0),           # cut off at the timeout, then retried: 0.15
        ("etl", "free", True, 7, 3),                # unpriced
    ]
    prices, currency = price_list(svc.quotas.all())  # each call priced as a worker prices it, at its start
    with svc.engine.begin() as conn:
        conn.execute(sa.insert(call_usage), [
            {"call_id": f"c{i}", "task_id": i, "source": s, "model": m, "admission_id": f"a{i}", "prompt_tokens": pt,
             "completion_tokens": ct, "answered": answered, "hedge": False, "ended_at": datetime.now(UTC),
             "cost": None if prices[m] is None else prices[m].cost(pt, ct),  # type: ignore[union-attr]
             "currency": None if prices[m] is None else currency}
            for i, (s, m, answered, pt, ct) in enumerate(rows)])
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    spent = json.loads(capsys.readouterr().out)["spend"]
    assert spent["currency"] == "EUR" and spent["total"] == pytest.approx(2.45)
    assert spent["by_model"] == pytest.approx({"big": 1.95, "small": 0.5})
    assert spent["by_source"] == pytest.approx({"crm": 2.3, "etl": 0.15})
    assert spent["unpriced_tokens"] == {"free": 10}
    assert main(["status"]) == 0
    assert "spent: 2.45 EUR (big 1.95 EUR, small 0.50 EUR); unpriced: free 10 tokens" in capsys.readouterr().out


@pytest.mark.usefixtures("migrated")
def test_quota_set_changes_a_price_with_the_same_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from balancer.services import Services
    from balancer.settings import Settings

    (tmp_path / "quotas.toml").write_text(PRICED)
    assert main(["quota", "import", str(tmp_path / "quotas.toml")]) == 0
    assert main(["quota", "set", "big", "--price-output", "20"]) == 0
    svc = Services.connect(Settings.from_env())
    big = svc.quotas.get("big")
    assert big is not None and (big.price_per_million_input, big.price_per_million_output, big.currency) == (3, 20, "EUR")
    capsys.readouterr()
    assert main(["quota", "set", "big", "--price-input", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: price_per_million_input must be a number from 0 to 1000000 (per million tokens), got -1.0"]
    assert svc.quotas.get("big") == big


def test_the_projection_splits_free_work_by_the_models_observed_mix_and_output_ratio() -> None:
    """Hand-made: model a answered 3 calls in 4 and used 20 % of its max_tokens;
    b used half of its. 40 free tasks (2M prompt tokens estimated, 1M max_tokens)
    and 10 pinned to b (1M max_tokens)."""
    from balancer.costs.cost import Observed, project

    seen = {"a": Observed(30, 3_000, 600, 3_000, 3_000), "b": Observed(10, 1_000, 500, 1_000, 1_000)}
    prices = {"a": Price(1.0, 10.0), "b": Price(2.0, 20.0)}
    p = project([(None, 40, 2_000_000, 1_000_000), (["b"], 10, 0, 1_000_000)], seen, prices, "USD")
    # a: 3/4 × (2M × $1 + 1M × 0.2 × $10) = 3.0; b: 1/4 × (2M × $2 + 1M × 0.5 × $20) + 1M × 0.5 × $20 = 3.5 + 10
    assert p.by_model == pytest.approx({"a": 3.0, "b": 13.5})
    assert p.total == pytest.approx(16.5) and p.currency == "USD"
    # A prompt estimate that ran 10 % high on a: its prompt tokens shrink with it.
    high = {**seen, "a": Observed(30, 2_700, 600, 3_000, 3_000)}
    assert project([(None, 40, 2_000_000, 1_000_000)], high, prices, "USD").by_model["a"] == pytest.approx(
        0.75 * (2_000_000 * 0.9 * 1.0 + 1_000_000 * 0.2 * 10.0) / 1e6)
    # Nothing answered yet: an equal split, at the estimates and the whole max_tokens (the ceiling).
    fresh = project([(None, 10, 1_000_000, 1_000_000)], {}, prices, "USD")
    assert fresh.by_model == pytest.approx({"a": 0.5 * (1 + 10), "b": 0.5 * (2 + 20)})
    # A model with no price: its share is counted as unpriced tokens, not as free.
    unpriced = project([(["c"], 5, 1_000, 2_000)], seen, {**prices, "c": None}, "USD")
    assert unpriced.total == 0 and unpriced.unpriced_tokens == {"c": round(1_000 * 1.0 + 2_000 * (1_100 / 4_000))}


@pytest.mark.usefixtures("migrated")
def test_status_projects_the_cost_of_the_backlog_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two solved tasks teach the output ratio (big used 40 % of its max_tokens,
    small 10 %); four tasks pending, two pinned to big, two to small."""
    from balancer.services import Services
    from balancer.settings import Settings
    from balancer.storage.schema import tasks

    (tmp_path / "quotas.toml").write_text(PRICED)
    assert main(["quota", "import", str(tmp_path / "quotas.toml")]) == 0
    svc = Services.connect(Settings.from_env())
    solved = [("big", 1_000, 400), ("small", 1_000, 100)]  # (model, prompt tokens, completion tokens) of max 1,000
    pending = [["big"], ["big"], ["small"], ["small"]]
    with svc.engine.begin() as conn:
        conn.execute(sa.insert(tasks), [
            {"source": "s", "prompt": "p", "status": "solved", "model": m, "max_tokens": 1_000,
             "estimated_tokens": 2_000, "prompt_tokens": pt, "completion_tokens": ct} for m, pt, ct in solved])
        conn.execute(sa.insert(tasks), [
            {"source": "s", "prompt": "p", "status": "pending", "allowed_models": allowed, "max_tokens": 100_000,
             "estimated_tokens": 1_100_000} for allowed in pending])
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    projected = json.loads(capsys.readouterr().out)["projected"]
    # big: 2 × (1M × 3 + 100k × 0.4 × 15) / 1M = 7.2; small: 2 × (1M × 0.25 + 100k × 0.1 × 0) / 1M = 0.5
    assert projected["by_model"] == pytest.approx({"big": 7.2, "small": 0.5})
    assert projected["total"] == pytest.approx(7.7) and projected["currency"] == "EUR"
    assert main(["status"]) == 0
    assert "backlog left, projected: 7.70 EUR" in capsys.readouterr().out
