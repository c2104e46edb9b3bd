"""``balancer source set NAME ...``: a source's weight and its budget per day.

Any source has a weight, JSONL and inbox ones included (default 1); the
dispatcher fills its window across sources in proportion
(:mod:`balancer.sources.fairshare`). Any source may also have a budget per day,
in the quotas' currency (``--budget-per-day``) or in tokens
(``--budget-tokens-per-day``), each cleared with ``none`` (``--no-budget``
clears both): once it is spent, the source's tasks wait
(:mod:`balancer.costs.budget`, :mod:`balancer.dispatch.budgets`). Each change
is audited in ``source_changes`` and applies to the next dispatch run. A name
that no task carries, no source table has and nothing was set for is an error
(a typo would otherwise pass unseen): ``--new`` sets it for tasks still to come.
"""

from __future__ import annotations

import click

from balancer.cli.startwait import migrated
from balancer.errors import BalancerError, ConfigError, printable
from balancer.sources.fairshare import MAX_WEIGHT

#: The longest source name (as a task's ``key``).
MAX_SOURCE_NAME = 256


def check_source_name(name: str) -> str:
    """A source name: 1 to 256 printable characters, not only spaces."""
    if not name.strip() or len(name) > MAX_SOURCE_NAME or not name.isprintable():
        raise ConfigError(f"a source name is 1 to {MAX_SOURCE_NAME} printable characters, not {printable(name)!r}")
    return name


@click.command("set")
@click.argument("name")
@click.option("--weight", type=click.IntRange(1, MAX_WEIGHT),
              help=f"The source's share relative to others (1 to {MAX_WEIGHT:,}; a source with none set has 1).")
@click.option("--budget-per-day", "money", metavar="AMOUNT|none",
              help="Spend per UTC day, in the quotas' currency, after which the source's tasks wait; none clears it.")
@click.option("--budget-tokens-per-day", "tokens", metavar="N|none",
              help="Prompt + completion tokens per UTC day after which the source's tasks wait; none clears it.")
@click.option("--no-budget", is_flag=True, help="Clear both budgets.")
@click.option("--new", "new_source", is_flag=True,
              help="The source has no task and no table yet: keep the setting for its tasks still to come.")
@click.option("--by", help="Who made the change (default: the OS user).")
def set_command(name: str, weight: int | None, money: str | None, tokens: str | None, no_budget: bool,
                new_source: bool, by: str | None) -> None:
    """Set a source's weight (its share of the dispatch window within a priority) and its budget per day."""
    from balancer.costs.budget import Budget, check_money, check_tokens
    from balancer.costs.cost import price_list
    from balancer.quotas.rows import all_quotas
    from balancer.sources.budgets import set_budget
    from balancer.sources.reads import budgets, has_tasks
    from balancer.sources.store import read_cursor
    from balancer.sources.weights import set_weight, weights
    from balancer.storage.audit import default_actor

    check_source_name(name)
    if no_budget and (money is not None or tokens is not None):
        raise BalancerError("--no-budget clears both budgets: give it without --budget-per-day or --budget-tokens-per-day")
    if weight is None and money is None and tokens is None and not no_budget:
        raise BalancerError("nothing to set: give --weight, --budget-per-day, --budget-tokens-per-day or --no-budget")
    new_money, new_tokens = check_money(money), check_tokens(tokens)  # before anything changes
    svc = migrated()
    actor = by or default_actor()
    lines = []
    with svc.engine.begin() as conn:  # one transaction: every change, or none
        known = (has_tasks(conn, name) or read_cursor(conn, name) is not None or name in weights(conn)
                 or any(b.source == name for b in budgets(conn)))
        if not known and not new_source:
            raise BalancerError(f"unknown source {printable(name)!r}: no task carries it, no source table has this "
                                "name and nothing was set for it (give --new to set it for tasks still to come)")
        if weight is not None:
            changed = set_weight(conn, name, weight, by=actor)
            lines.append(f"{name}: weight {weight}" if changed else f"{name}: unchanged (weight {weight})")
        if money is not None or tokens is not None or no_budget:
            old = next((b for b in budgets(conn) if b.source == name), Budget(name))
            budget = Budget(name) if no_budget else Budget(
                name, new_money if money is not None else old.money_per_day,
                new_tokens if tokens is not None else old.tokens_per_day)
            changed = set_budget(conn, budget, by=actor)
            prices, currency = price_list(all_quotas(conn))  # in this transaction
            text = f"budget {budget.text(currency)}" if budget != Budget(name) else "no budget"
            lines.append(f"{name}: {text}" if changed else f"{name}: unchanged ({text})")
            if budget.money_per_day is not None and all(p is None for p in prices.values()):
                lines.append(f"{name}: note: no model has a price, so the money budget counts nothing until "
                             "the quotas name prices (balancer quota set MODEL --price-input P --price-output P)")
        if not known:
            lines.append(f"{name}: new source: the setting is kept for its tasks when they come")
    for line in lines:
        click.echo(printable(line, limit=400))
