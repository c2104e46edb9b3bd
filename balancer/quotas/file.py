"""The quota file: a whole quota set as TOML, for ``balancer quota import/export``.

Format::

    [models.gpt-a]
    weight = 2
    max_concurrent_requests = 8
    max_tokens_per_minute = 120000
    max_requests_per_minute = 600   # optional
    burst_tokens = 120000           # optional, default one minute of TPM
    enabled = true                  # optional, default true
    learn = true                    # optional, default true: learn real limits below these
    slow_start = true               # optional, default true (with learn): open a new quota's slots gradually
    window_cap = false              # optional, default false: true caps every 60 s at the TPM (and RPM), no burst on top
    price_per_million_input = 2.5   # optional, in the file's currency
    price_per_million_output = 10.0 # optional

with, when any model has a price, the currency named once at the top::

    currency = "USD"

Parsing is pure and reports the line of the first problem, so a user can fix
the file without guessing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import tomli_w

from balancer.admission.quota import Quota, check_model_name
from balancer.costs.cost import check_currency
from balancer.errors import QuotaError
from balancer.toml_text import load_toml

#: A model's price fields; any of them needs the file's currency.
PRICES = ("price_per_million_input", "price_per_million_output")


def _line_of(text: str, model: str, key: str | None = None) -> int | None:
    """Best-effort line number of ``[models.<model>]`` or of ``key`` inside it."""
    header = re.compile(
        r"^\s*\[\s*models\s*\.\s*(\"?)" + re.escape(model) + r"\1\s*\]\s*(#.*)?$"
    )
    in_section = False
    for number, line in enumerate(text.splitlines(), start=1):
        if header.match(line):
            if key is None:
                return number
            in_section = True
            continue
        if in_section and key is not None:
            if line.lstrip().startswith("["):
                break
            if re.match(r"^\s*\"?" + re.escape(key) + r"\"?\s*=", line):
                return number
    return None


def parse_quota_file(text: str) -> list[Quota]:
    """Parse a quota file into quotas, sorted by name.

    Raises :class:`QuotaError` whose message starts with ``line N:`` when the
    line is known.

    >>> [q.name for q in parse_quota_file("[models.a]\\nmax_concurrent_requests=1\\nmax_tokens_per_minute=5\\n")]
    ['a']
    """
    data = load_toml(text, QuotaError)
    unknown_top = set(data) - {"models", "currency"}
    if unknown_top:
        raise QuotaError(f"unknown top-level key(s): {', '.join(sorted(unknown_top))}; expected [models.NAME] tables")
    currency = check_currency(data.get("currency"))
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise QuotaError("'models' must be a table of [models.NAME] sections")
    quotas = []
    for name, fields in models.items():
        at_header = _line_of(text, name)
        prefix = f"line {at_header}: " if at_header else ""
        try:
            check_model_name(name)
        except QuotaError as exc:
            raise QuotaError(f"{prefix}{exc}") from None
        if not isinstance(fields, dict):
            raise QuotaError(f"{prefix}models.{name} must be a table")
        if "currency" in fields:
            at = _line_of(text, name, "currency")
            raise QuotaError(f"{f'line {at}: ' if at else prefix}models.{name}: the currency is named once, at the top "
                             "of the file (currency = \"USD\")")
        if currency is None and any(k in fields for k in PRICES):
            raise QuotaError(f"{prefix}models.{name} has a price: name its currency once, at the top of the file "
                             "(currency = \"USD\")")
        try:
            quotas.append(Quota.from_dict({"name": name, **fields, **({"currency": currency} if currency else {})}))
        except (QuotaError, TypeError) as exc:
            bad_key = next((k for k in fields if k in str(exc)), None)
            at = _line_of(text, name, bad_key) if bad_key else at_header
            prefix = f"line {at}: " if at else ""
            raise QuotaError(f"{prefix}models.{name}: {exc}") from None
    return sorted(quotas, key=lambda q: q.name)


def in_the_files_currency(quota: Quota, others: Iterable[Quota]) -> Quota:
    """``quota`` as ``quota set`` and the console store it, so that ``quota export`` reads back: a
    quota file names one currency, at its top, for every price. A price with no currency takes the
    one the other models name; with none named anywhere it is refused, and so is another currency.

    >>> usd = Quota("a", 1, 10, price_per_million_input=2.0, currency="USD")
    >>> in_the_files_currency(Quota("b", 1, 10, price_per_million_input=1.0), [usd]).currency
    'USD'
    >>> in_the_files_currency(Quota("b", 1, 10, price_per_million_input=1.0), [])
    Traceback (most recent call last):
    balancer.errors.QuotaError: b has a price and no currency: name it once (three capital letters such as USD)
    >>> in_the_files_currency(Quota("b", 1, 10, price_per_million_output=1.0, currency="EUR"), [usd])
    Traceback (most recent call last):
    balancer.errors.QuotaError: b's prices are in EUR and the other models' in USD: a quota file names one currency
    """
    named = sorted({q.currency for q in others if q.currency and q.name != quota.name})
    if quota.currency is None and any(getattr(quota, k) is not None for k in PRICES):
        if len(named) != 1:
            raise QuotaError(f"{quota.name} has a price and no currency: name it once (three capital letters such as USD)")
        return quota.replace(currency=named[0])
    if quota.currency is not None and named and named != [quota.currency]:
        raise QuotaError(f"{quota.name}'s prices are in {quota.currency} and the other models' in {', '.join(named)}: "
                         "a quota file names one currency")
    return quota


def format_quota_file(quotas: list[Quota]) -> str:
    """Render quotas as TOML that :func:`parse_quota_file` reads back identically."""
    models: dict[str, Any] = {}
    currencies = sorted({q.currency for q in quotas if q.currency})
    if len(currencies) > 1:
        raise QuotaError(f"the models name {len(currencies)} currencies ({', '.join(currencies)}); a quota file has one")
    for quota in sorted(quotas, key=lambda q: q.name):
        fields = quota.as_dict()
        del fields["name"], fields["currency"]
        models[quota.name] = {k: v for k, v in fields.items() if v is not None}
    return tomli_w.dumps({**({"currency": currencies[0]} if currencies else {}), "models": models})
