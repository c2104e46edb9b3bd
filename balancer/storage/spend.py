"""Spend so far: the token counts of answered calls, priced by each model's quota.

The tokens are those the backend reported for the call that answered each
solved task (``prompt_tokens`` and ``completion_tokens``), grouped by source
and by the model that answered; :func:`balancer.domain.cost.spend` prices
them. Calls that did not answer (a failed attempt, a hedge that lost) left no
token counts in PostgreSQL, so they are not in this figure.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from balancer.domain.cost import Spend, price_of, spend
from balancer.domain.quota import Quota
from balancer.storage.schema import tasks


def token_usage(engine: Engine) -> list[tuple[str, str, int, int]]:
    """``(source, model, prompt tokens, completion tokens)`` of solved tasks, per source and answering model."""
    query = (sa.select(tasks.c.source, tasks.c.model, sa.func.coalesce(sa.func.sum(tasks.c.prompt_tokens), 0),
                       sa.func.coalesce(sa.func.sum(tasks.c.completion_tokens), 0))
             .where(tasks.c.status == "solved", tasks.c.model.is_not(None)).group_by(tasks.c.source, tasks.c.model))
    with engine.connect() as conn:
        return [(r[0], r[1], int(r[2]), int(r[3])) for r in conn.execute(query)]


def spend_so_far(engine: Engine, quotas: Sequence[Quota]) -> Spend:
    """Spend by model and by source, in the quotas' currency (None when no model names one)."""
    prices = {q.name: price_of(q.price_per_million_input, q.price_per_million_output) for q in quotas}
    currency = next((q.currency for q in quotas if q.currency), None)
    return spend(token_usage(engine), prices, currency)
