"""What calls cost: prices per million tokens, and spend by model and by source.

Pure: token counts in, money out; and the one rule of what a call that got no
answer is counted for (:func:`billed_tokens`). A model's price is two optional numbers
from its quota (``price_per_million_input`` for prompt tokens,
``price_per_million_output`` for completion tokens) in the one currency the
quota file names. A model with no price costs nothing that can be counted:
its tokens are reported as unpriced rather than as free.

A call is priced when it is made, at the prices then in force, and the ledger
keeps its cost in that currency (:class:`Charged`): a later price change, or a
quota removed, does not change what was spent, and amounts in two currencies
are never added together.

>>> p = Price(input=3.0, output=15.0)
>>> p.cost(prompt_tokens=1_000_000, completion_tokens=200_000)
6.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from balancer.errors import QuotaError

#: Upper bound on a price per million tokens (a typo guard, as quotas have MAX_LIMIT).
MAX_PRICE = 1_000_000.0
#: A currency code as the quota file names it: three capital letters (ISO 4217 style).
CURRENCY_LENGTH = 3


def check_price(field_name: str, value: Any) -> float | None:
    """None, or a finite number from 0 to :data:`MAX_PRICE` (per million tokens).

    >>> check_price("p", 2), check_price("p", None)
    (2.0, None)
    >>> check_price("p", -1)
    Traceback (most recent call last):
    balancer.errors.QuotaError: p must be a number from 0 to 1000000 (per million tokens), got -1
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_PRICE:
        raise QuotaError(f"{field_name} must be a number from 0 to {MAX_PRICE:.0f} (per million tokens), got {value!r}")
    return float(value)


def check_currency(value: Any) -> str | None:
    """None, or a code of three capital letters.

    >>> check_currency("EUR")
    'EUR'
    >>> check_currency("euro")
    Traceback (most recent call last):
    balancer.errors.QuotaError: currency must be three capital letters such as USD or EUR, got 'euro'
    """
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != CURRENCY_LENGTH or not value.isascii() or not value.isupper() \
            or not value.isalpha():
        raise QuotaError(f"currency must be three capital letters such as USD or EUR, got {value!r}")
    return value


@dataclass(frozen=True)
class Price:
    """Per million tokens: ``input`` (prompt) and ``output`` (completion)."""

    input: float
    output: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """The cost of these tokens.

        >>> Price(0.5, 1.5).cost(2_000, 1_000)
        0.0025
        """
        return (prompt_tokens * self.input + completion_tokens * self.output) / 1_000_000


class Priced(Protocol):
    """What a price list reads of a quota (:class:`balancer.admission.quota.Quota`)."""

    @property
    def name(self) -> str: ...
    @property
    def price_per_million_input(self) -> float | None: ...
    @property
    def price_per_million_output(self) -> float | None: ...
    @property
    def currency(self) -> str | None: ...


def price_list(quotas: Iterable[Priced]) -> tuple[dict[str, Price | None], str | None]:
    """Each model's :class:`Price` (None: it has none), and the currency the quotas name (None if none does).

    >>> from balancer.admission.quota import Quota
    >>> price_list([Quota("a", 1, 1_000, price_per_million_input=2.0, currency="EUR"), Quota("b", 1, 1_000)])
    ({'a': Price(input=2.0, output=0.0), 'b': None}, 'EUR')
    """
    listed = list(quotas)
    prices = {q.name: price_of(q.price_per_million_input, q.price_per_million_output) for q in listed}
    return prices, next((q.currency for q in listed if q.currency), None)


def price_of(price_per_million_input: float | None, price_per_million_output: float | None) -> Price | None:
    """A model's price, or None when it has neither; one missing side counts as 0.

    >>> price_of(None, None) is None, price_of(2.0, None)
    (True, Price(input=2.0, output=0.0))
    """
    if price_per_million_input is None and price_per_million_output is None:
        return None
    return Price(price_per_million_input or 0.0, price_per_million_output or 0.0)


@dataclass
class Spend:
    """Money spent, by model and by source, in one currency; the tokens of calls made with no price;
    and what was spent in other currencies (kept apart, never added to ``total``)."""

    currency: str | None
    total: float = 0.0
    by_model: dict[str, float] = field(default_factory=dict)
    by_source: dict[str, float] = field(default_factory=dict)
    unpriced_tokens: dict[str, int] = field(default_factory=dict)  # model -> prompt + completion tokens
    other_currencies: dict[str, float] = field(default_factory=dict)  # currency -> amount, not in total

    def as_dict(self) -> dict[str, Any]:
        return {"currency": self.currency, "total": round(self.total, 6),
                "by_model": {k: round(v, 6) for k, v in sorted(self.by_model.items())},
                "by_source": {k: round(v, 6) for k, v in sorted(self.by_source.items())},
                "unpriced_tokens": dict(sorted(self.unpriced_tokens.items())),
                "other_currencies": {k: round(v, 6) for k, v in sorted(self.other_currencies.items())}}


class Charged(NamedTuple):
    """Calls of one source on one model: their tokens, and what they cost at the prices in force
    when each was made (``cost`` None: the model had no price then), in ``currency``."""

    source: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost: float | None = None
    currency: str | None = None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def charge(usage: Iterable[tuple[str, str, int, int]], prices: Mapping[str, Price | None],
           currency: str | None) -> list[Charged]:
    """``(source, model, prompt tokens, completion tokens)`` rows priced at ``prices``: what
    they would cost now (a what-if, such as a benchmark's two sides priced alike).

    >>> charge([("crm", "a", 1_000_000, 0), ("crm", "b", 5, 0)], {"a": Price(2.0, 0.0)}, "USD")
    [Charged(source='crm', model='a', prompt_tokens=1000000, completion_tokens=0, cost=2.0, currency='USD'), \
Charged(source='crm', model='b', prompt_tokens=5, completion_tokens=0, cost=None, currency=None)]
    """
    out = []
    for source, model, prompt_tokens, completion_tokens in usage:
        price = prices.get(model)
        out.append(Charged(source, model, prompt_tokens, completion_tokens,
                           None if price is None else price.cost(prompt_tokens, completion_tokens),
                           None if price is None else currency))
    return out


def spend(charged: Iterable[Charged], currency: str | None) -> Spend:
    """Spend in ``currency`` from :class:`Charged` rows; calls made with no price are unpriced
    tokens, calls priced in another currency are kept apart.

    >>> s = spend([Charged("crm", "a", 1_000_000, 0, 1.0, "USD"), Charged("crm", "b", 0, 1_000_000),
    ...            Charged("web", "a", 0, 2_000_000, 8.0, "USD"), Charged("web", "a", 10, 0, 0.5, "EUR")], "USD")
    >>> s.total, s.by_model, s.by_source, s.unpriced_tokens, s.other_currencies
    (9.0, {'a': 9.0}, {'crm': 1.0, 'web': 8.0}, {'b': 1000000}, {'EUR': 0.5})
    """
    out = Spend(currency)
    for row in charged:
        if row.cost is None:
            out.unpriced_tokens[row.model] = out.unpriced_tokens.get(row.model, 0) + row.tokens
        elif row.currency != currency:
            key = row.currency or "no currency"
            out.other_currencies[key] = out.other_currencies.get(key, 0.0) + row.cost
        else:
            out.total += row.cost
            out.by_model[row.model] = out.by_model.get(row.model, 0.0) + row.cost
            out.by_source[row.source] = out.by_source.get(row.source, 0.0) + row.cost
    return out


def task_cost(usage: Iterable[tuple[str, int, int, float | None]]) -> float | None:
    """What one task's calls cost, from ``(model, prompt tokens, completion tokens, cost when
    called)`` per model called; None when a call made with no price took tokens (not free: unpriced).

    >>> task_cost([("a", 1_000_000, 0, 1.0), ("b", 0, 0, None)])
    1.0
    >>> task_cost([("a", 0, 1_000_000, 4.0), ("b", 10, 0, None)]) is None
    True
    """
    total = 0.0
    for _model, prompt_tokens, completion_tokens, cost in usage:
        if cost is None:
            if prompt_tokens or completion_tokens:
                return None
            continue
        total += cost
    return total


#: How a call sent to the backend ended, as far as what the provider bills goes:
#: ``answered`` (a reply with its token counts), ``cut_off`` (the request reached the
#: backend and no readable reply came back: the client's timeout, a hedge's loser
#: cancelled, the connection dropped mid-call, a reply that could not be read),
#: ``refused`` (an error status: 429, 4xx, 5xx) or ``unsent`` (no connection was made).
CallEnd = Literal["answered", "cut_off", "refused", "unsent"]


def billed_tokens(end: CallEnd, estimated_prompt: int, reported: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """``(prompt tokens, completion tokens)`` a call is counted in spend for, or None
    for a call that never reached the backend (it gets no ledger row).

    The one rule of what the provider likely bills, for every call sent:

    - ``answered``: what the backend reported, as it bills it;
    - ``cut_off``: the prompt reached the provider, which read it, so the estimated
      prompt tokens; its output is unknown (a provider that keeps working after its
      client went bills it, one that stops bills part of it), so 0 completion
      tokens. A floor, never a guess above what was seen;
    - ``refused``: providers do not bill a request they answer with an error
      status (a 429 is turned away before any work), so nothing.

    >>> billed_tokens("answered", 120, (98, 40)), billed_tokens("cut_off", 120), billed_tokens("refused", 120)
    ((98, 40), (120, 0), (0, 0))
    >>> billed_tokens("unsent", 120) is None, billed_tokens("cut_off", -3)
    (True, (0, 0))
    """
    if end == "answered":
        if reported is None:
            raise ValueError("an answered call has the token counts its backend reported")
        return reported
    if end == "cut_off":
        return max(0, estimated_prompt), 0
    if end == "refused":
        return 0, 0
    return None


def money(amount: float, currency: str | None) -> str:
    """An amount for a person: two decimals, four below one cent (so small runs do not read as 0).

    >>> money(1234.5, "USD"), money(0.00123, "EUR"), money(0, None)
    ('1,234.50 USD', '0.0012 EUR', '0.00')
    """
    text = f"{amount:,.4f}" if 0 < abs(amount) < 0.01 else f"{amount:,.2f}"
    return f"{text} {currency}" if currency else text


def spend_text(s: Spend) -> str:
    """One line for ``balancer status``: the total, then per model, then the models with no price.

    >>> spend_text(Spend("USD", 3.5, {"a": 3.0, "b": 0.5}, {"crm": 3.5}, {"c": 1200}))
    'spent: 3.50 USD (a 3.00 USD, b 0.50 USD); unpriced: c 1,200 tokens'
    >>> spend_text(Spend(None, 0.0, {}, {}, {"c": 1200}))   # none priced: no 0.00 that reads as money
    'spent: nothing on a priced model; unpriced: c 1,200 tokens'
    """
    text = f"spent: {money(s.total, s.currency) if s.by_model or s.other_currencies else 'nothing on a priced model'}"
    if s.by_model:
        text += " (" + ", ".join(f"{m} {money(v, s.currency)}" for m, v in sorted(s.by_model.items())) + ")"
    if s.unpriced_tokens:
        text += "; unpriced: " + ", ".join(f"{m} {n:,} tokens" for m, n in sorted(s.unpriced_tokens.items()))
    if s.other_currencies:
        text += "; in other currencies, not added: " + ", ".join(
            money(v, c) for c, v in sorted(s.other_currencies.items()))
    return text


@dataclass(frozen=True)
class Observed:
    """What one model's answered calls used so far, against what was estimated
    for their tasks: the heuristic prompt estimate and the ``max_tokens`` sent."""

    calls: int
    prompt_tokens: int
    completion_tokens: int
    estimated_prompt: int
    max_tokens: int


def ratios(seen: Observed | None, fleet: Observed | None) -> tuple[float, float]:
    """(prompt tokens used per prompt token estimated, completion tokens per ``max_tokens``) of a
    model: its own, else the fleet's, else (1, 1), the estimate and the budget themselves.

    >>> ratios(Observed(10, 900, 300, 1_000, 1_000), None)
    (0.9, 0.3)
    >>> ratios(None, Observed(10, 1_000, 500, 1_000, 1_000)), ratios(None, None)
    ((1.0, 0.5), (1.0, 1.0))
    """
    for usage in (seen, fleet):
        if usage is not None and usage.calls and usage.estimated_prompt and usage.max_tokens:
            return usage.prompt_tokens / usage.estimated_prompt, usage.completion_tokens / usage.max_tokens
    return 1.0, 1.0


def project(
    backlog: Iterable[tuple[Iterable[str] | None, int, int, int]],
    observed: Mapping[str, Observed],
    prices: Mapping[str, Price | None],
    currency: str | None,
) -> Spend:
    """What the backlog left will cost, by model, as a :class:`Spend` (``by_source`` is left empty).

    ``backlog``: (allowed models or None for any, tasks, their estimated prompt
    tokens, their ``max_tokens``), per group. ``prices`` names the models that may
    run work. A group's tasks split over the models it may run in proportion to
    the calls each answered so far (equally when none answered yet); on each
    model, its tokens are the estimates times that model's observed :func:`ratios`.

    >>> seen = {"a": Observed(30, 3_000, 600, 3_000, 3_000), "b": Observed(10, 1_000, 500, 1_000, 1_000)}
    >>> p = project([(None, 40, 2_000_000, 1_000_000), (["b"], 10, 0, 1_000_000)], seen,
    ...             {"a": Price(1.0, 10.0), "b": Price(2.0, 20.0)}, "USD")
    >>> round(p.total, 2), {m: round(v, 2) for m, v in p.by_model.items()}   # a: 3/4 of the free work at 0.2 out
    (16.5, {'a': 3.0, 'b': 13.5})
    """
    fleet = Observed(*(sum(getattr(u, f) for u in observed.values()) for f in
                       ("calls", "prompt_tokens", "completion_tokens", "estimated_prompt", "max_tokens")))
    out = Spend(currency)
    for allowed, count, prompt_estimate, max_tokens in backlog:
        usable = [m for m in (prices if allowed is None else allowed) if m in prices]
        if not count or not usable:
            continue
        weights = {m: observed[m].calls if m in observed else 0 for m in usable}
        total_weight = sum(weights.values())
        for model in usable:
            share = weights[model] / total_weight if total_weight else 1 / len(usable)
            if share == 0:
                continue
            prompt_ratio, output_ratio = ratios(observed.get(model), fleet)
            prompt_tokens, completion_tokens = share * prompt_estimate * prompt_ratio, share * max_tokens * output_ratio
            price = prices[model]
            if price is None:
                out.unpriced_tokens[model] = out.unpriced_tokens.get(model, 0) + round(prompt_tokens + completion_tokens)
                continue
            amount = (prompt_tokens * price.input + completion_tokens * price.output) / 1_000_000
            out.total += amount
            out.by_model[model] = out.by_model.get(model, 0.0) + amount
    return out


def projection_text(p: Spend) -> str:
    """One line for ``balancer status`` and ``top``: the backlog left's projected cost.

    >>> projection_text(Spend("USD", 12.0, {"a": 12.0}, {}, {"c": 5_000}))
    'backlog left, projected: 12.00 USD; unpriced: c 5,000 tokens'
    >>> projection_text(Spend(None, 0.0, {}, {}, {"c": 5_000}))
    'backlog left, projected: nothing on a priced model; unpriced: c 5,000 tokens'
    """
    text = f"backlog left, projected: {money(p.total, p.currency) if p.by_model else 'nothing on a priced model'}"
    if p.unpriced_tokens:
        text += "; unpriced: " + ", ".join(f"{m} {n:,} tokens" for m, n in sorted(p.unpriced_tokens.items()))
    return text
