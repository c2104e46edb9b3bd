"""A source's budget per day, and whether it is spent.

Pure: a budget, what the source spent today, and the rule. A source may have
a budget in money (in the quotas' currency, priced by :mod:`balancer.costs.cost`),
in tokens (prompt + completion), or both; it is *over budget* once either is
reached (spent >= budget), and its pending tasks then wait: the dispatcher
claims none of them (:mod:`balancer.dispatch.budgets`) until the budget is
raised or the day turns. A budget of 0 holds every new call of the source.

The day is the UTC day: it starts at 00:00 UTC (:func:`day_start`).

Tokens of a model with no price count toward a token budget but cannot count
toward a money budget: they are shown as unpriced, as in the spend so far.

>>> b = Budget("crm", money_per_day=5.0, tokens_per_day=None)
>>> Standing(b, tokens=1_200_000, money=5.02, unpriced_tokens=0, currency="USD").over
True
>>> Standing(b, tokens=1_200_000, money=4.99, unpriced_tokens=0, currency="USD").over
False
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from balancer.costs.cost import Charged, money
from balancer.errors import BalancerError

#: The largest money budget per day (a typo guard, as prices have MAX_PRICE).
MAX_MONEY_PER_DAY = 1_000_000_000.0
#: The largest token budget per day.
MAX_TOKENS_PER_DAY = 10**15
#: What a budget option takes to clear that budget.
CLEAR = "none"


class BudgetError(BalancerError):
    """A budget value is invalid."""


def check_money(value: Any) -> float | None:
    """A money budget per day: a finite number from 0 to :data:`MAX_MONEY_PER_DAY`
    (text as typed on the command line too), or None (:data:`CLEAR`: no money budget).

    >>> check_money("5.00"), check_money(0), check_money("none")
    (5.0, 0.0, None)
    >>> check_money("-1")
    Traceback (most recent call last):
    balancer.costs.budget.BudgetError: a budget per day is an amount from 0 to 1000000000 (or none), not '-1'
    """
    if value is None or value == CLEAR:
        return None
    number: float | None = None
    if isinstance(value, str):
        try:  # as a token count is read: ASCII, no '_' (which float() would take, and other scripts' digits)
            number = float(value) if value.isascii() and "_" not in value else None
        except ValueError:
            number = None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if number is None or not math.isfinite(number) or not 0 <= number <= MAX_MONEY_PER_DAY:
        raise BudgetError(f"a budget per day is an amount from 0 to {MAX_MONEY_PER_DAY:.0f} (or {CLEAR}), not {value!r}")
    return number


def check_tokens(value: Any) -> int | None:
    """A token budget per day: a whole number from 0 to :data:`MAX_TOKENS_PER_DAY`, or None (:data:`CLEAR`).

    >>> check_tokens("2000000"), check_tokens(None)
    (2000000, None)
    >>> check_tokens("1.5")
    Traceback (most recent call last):
    balancer.costs.budget.BudgetError: a token budget per day is a whole number from 0 to 1000000000000000 (or none), not '1.5'
    """
    if value is None or value == CLEAR:
        return None
    number: int | None = None
    if isinstance(value, str):
        number = int(value) if value.isascii() and value.isdigit() else None
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    if number is None or not 0 <= number <= MAX_TOKENS_PER_DAY:
        raise BudgetError(f"a token budget per day is a whole number from 0 to {MAX_TOKENS_PER_DAY} (or {CLEAR}), "
                          f"not {value!r}")
    return number


def day_start(now: datetime) -> datetime:
    """The start of ``now``'s day: 00:00 UTC, when every budget starts again.

    >>> day_start(datetime(2026, 3, 1, 23, 59, tzinfo=UTC)).isoformat()
    '2026-03-01T00:00:00+00:00'
    """
    return now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class Budget:
    """A source's budget per day: money (the quotas' currency), tokens, or both (None: not set)."""

    source: str
    money_per_day: float | None = None
    tokens_per_day: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"budget_per_day": self.money_per_day, "budget_tokens_per_day": self.tokens_per_day}

    def text(self, currency: str | None) -> str:
        """The budget for a person.

        >>> Budget("crm", 5.0, 2_000_000).text("USD")
        '5.00 USD and 2,000,000 tokens per day'
        """
        parts = ([money(self.money_per_day, currency)] if self.money_per_day is not None else []) + \
                ([f"{self.tokens_per_day:,} tokens"] if self.tokens_per_day is not None else [])
        return " and ".join(parts or ["none"]) + " per day"


@dataclass(frozen=True)
class Standing:
    """A source's budget against what it spent today."""

    budget: Budget
    tokens: int  # prompt + completion tokens today, priced or not
    money: float  # today's spend at the models' prices
    unpriced_tokens: int  # today's tokens of calls made with no price, or priced in another currency (not in ``money``)
    currency: str | None

    @property
    def money_spent(self) -> bool:
        return self.budget.money_per_day is not None and self.money >= self.budget.money_per_day

    @property
    def tokens_spent(self) -> bool:
        return self.budget.tokens_per_day is not None and self.tokens >= self.budget.tokens_per_day

    @property
    def over(self) -> bool:
        """Whether the source's new calls wait: either budget is reached."""
        return self.money_spent or self.tokens_spent

    def spent_text(self) -> str:
        """What was spent today against the budget, as ``X of Y today`` per kind set.

        >>> Standing(Budget("crm", 5.0, 2_000_000), 2_100_000, 4.2, 0, "USD").spent_text()
        '4.20 of 5.00 USD today; 2,100,000 of 2,000,000 tokens today'

        Tokens of calls with no price in the budget's currency cannot reach a money budget: they are
        said so, not hidden.

        >>> Standing(Budget("crm", 5.0), 900_000, 0.0, 900_000, None).spent_text()
        '0.00 of 5.00 today (and 900,000 tokens with no price in it, not counted)'
        """
        parts = []
        if self.budget.money_per_day is not None:
            unpriced = f" (and {self.unpriced_tokens:,} tokens with no price in it, not counted)" \
                if self.unpriced_tokens else ""
            parts.append(f"{money(self.money, None)} of {money(self.budget.money_per_day, self.currency)} today{unpriced}")
        if self.budget.tokens_per_day is not None:
            parts.append(f"{self.tokens:,} of {self.budget.tokens_per_day:,} tokens today")
        return "; ".join(parts)

    def waiting(self) -> str | None:
        """Why the source's tasks wait ('waiting: budget spent (X of Y today)'), or None if they do not.

        >>> Standing(Budget("crm", 5.0), 9, 5.02, 0, "USD").waiting()
        'waiting: budget spent (5.02 of 5.00 USD today)'
        >>> Standing(Budget("crm", 5.0, 100), 120, 1.0, 0, "USD").waiting()
        'waiting: budget spent (1.00 of 5.00 USD today; 120 of 100 tokens today)'
        >>> Standing(Budget("crm", 5.0), 9, 4.0, 0, "USD").waiting() is None
        True
        """
        return f"waiting: budget spent ({self.spent_text()})" if self.over else None

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.budget.source, **self.budget.as_dict(), "currency": self.currency,
                "spent_today": round(self.money, 6), "spent_tokens_today": self.tokens,
                "unpriced_tokens_today": self.unpriced_tokens, "over": self.over, "waiting": self.waiting()}


def standings(budgets: Iterable[Budget], charged: Iterable[Charged], currency: str | None) -> dict[str, Standing]:
    """Every budgeted source's :class:`Standing`, from today's :class:`Charged` rows: each call
    at the price it was made at. A money budget is in ``currency`` (the quotas'); calls made
    with no price, or priced in another currency, are not counted in it (they are said so).

    >>> rows = [Charged("crm", "a", 600_000, 400_000, 1.0, "USD"), Charged("crm", "b", 1_000, 0),
    ...         Charged("web", "a", 5, 5, 0.0, "USD"), Charged("crm", "a", 10, 0, 9.0, "EUR")]
    >>> out = standings([Budget("crm", 1.0, None), Budget("idle", None, 10)], rows, "USD")
    >>> out["crm"].money, out["crm"].tokens, out["crm"].unpriced_tokens, out["crm"].over
    (1.0, 1001010, 1010, True)
    >>> out["idle"].over, sorted(out)
    (False, ['crm', 'idle'])
    """
    by_source = {b.source: b for b in budgets}
    tokens = dict.fromkeys(by_source, 0)
    spent = dict.fromkeys(by_source, 0.0)
    unpriced = dict.fromkeys(by_source, 0)
    for row in charged:
        if row.source not in by_source:
            continue
        tokens[row.source] += row.tokens
        if row.cost is None or row.currency != currency:
            unpriced[row.source] += row.tokens
        else:
            spent[row.source] += row.cost
    return {s: Standing(b, tokens[s], spent[s], unpriced[s], currency) for s, b in by_source.items()}


def held(all_standings: Mapping[str, Standing]) -> frozenset[str]:
    """The sources whose new calls wait: those over budget.

    >>> held({"a": Standing(Budget("a", None, 0), 0, 0.0, 0, None), "b": Standing(Budget("b", None, 5), 1, 0.0, 0, None)})
    frozenset({'a'})
    """
    return frozenset(s for s, st in all_standings.items() if st.over)
