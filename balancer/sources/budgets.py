"""Setting a source's budget per day (:mod:`balancer.costs.budget`), with its audit (they are
read by :func:`balancer.sources.reads.budgets`).

A source with no row has no budget. Any source, JSONL and inbox ones
included, can be given one with ``balancer source set NAME --budget-per-day
AMOUNT`` or ``--budget-tokens-per-day N``; each change is a ``budget`` row in
``source_changes``, and the dispatcher reads it at its next dispatch run.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.engine import Connection

from balancer.costs.budget import Budget, check_money, check_tokens
from balancer.storage import audit
from balancer.storage.schema import source_budgets, source_changes


def set_budget(conn: Connection, budget: Budget, *, by: str) -> bool:
    """Set ``budget.source``'s budget (None clears that kind) in the caller's
    transaction, audited; False if it was already that."""
    check_money(budget.money_per_day)
    check_tokens(budget.tokens_per_day)
    row = conn.execute(sa.select(source_budgets.c.money_per_day, source_budgets.c.tokens_per_day)
                       .where(source_budgets.c.source == budget.source)).first()
    old = Budget(budget.source) if row is None else Budget(budget.source, row.money_per_day,
                                                           None if row.tokens_per_day is None else int(row.tokens_per_day))
    if old == budget:
        return False
    if budget.money_per_day is None and budget.tokens_per_day is None:
        conn.execute(sa.delete(source_budgets).where(source_budgets.c.source == budget.source))
    else:
        values = {"money_per_day": budget.money_per_day, "tokens_per_day": budget.tokens_per_day}
        conn.execute(insert(source_budgets).values(source=budget.source, **values)
                     .on_conflict_do_update(index_elements=[source_budgets.c.source],
                                            set_={**values, "updated_at": sa.func.now()}))
    audit.record(conn, source_changes, budget.source, by=by, action="budget",
                 old=None if row is None else old.as_dict(), new=budget.as_dict())
    return True
