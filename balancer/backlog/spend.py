"""Spend so far: the tokens of every call sent to the backend, and what each cost when it was made.

The tokens are the ledger's (``call_usage``, :mod:`balancer.backlog.ledger`):
one row per call, answered or not, so a hedge that lost, a call cut off and
retried, and a duplicate answer all count; a call that got no answer counts
what :func:`balancer.costs.cost.billed_tokens` says the provider likely
bills. Each row keeps its call's cost at the prices of its start, in their
currency; :func:`charges` sums them per source, model and currency
(:class:`balancer.costs.cost.Charged`) and :func:`balancer.costs.cost.spend`
adds those up, one currency at a time.

:func:`projected_cost` prices the backlog left from its token estimates and
what each model's answered calls used against theirs
(:func:`balancer.costs.cost.project`): the ratios stay on answered calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from balancer.admission.quota import Quota
from balancer.backlog.reads import Backlog, backlog
from balancer.costs.cost import Charged, Observed, Spend, price_list, project, spend
from balancer.storage.rows import RowSource, fetch

#: The ledger's calls per source, model and currency of their cost (priced apart from unpriced),
#: of the calls that ended at or after ``since`` (None: all).
_CHARGES = """
SELECT source, model, sum(prompt_tokens), sum(completion_tokens), sum(cost), currency FROM call_usage
WHERE %(since)s IS NULL OR ended_at >= %(since)s GROUP BY source, model, currency, cost IS NULL
"""


def charges(db: RowSource, since: datetime | None = None) -> list[Charged]:
    """The ledger's calls that ended at or after ``since`` (None: all, hedges and retries included),
    per source, model and currency, each at the prices of its call's start."""
    return [Charged(r[0], r[1], int(r[2]), int(r[3]), None if r[4] is None else float(r[4]), r[5])
            for r in fetch(db, _CHARGES, {"since": since})]


def token_usage(db: RowSource) -> list[tuple[str, str, int, int]]:
    """``(source, model, prompt tokens, completion tokens)`` of every call in the ledger, per source and model called."""
    tokens: dict[tuple[str, str], list[int]] = {}
    for row in charges(db):
        summed = tokens.setdefault((row.source, row.model), [0, 0])
        summed[0] += row.prompt_tokens
        summed[1] += row.completion_tokens
    return [(source, model, p, c) for (source, model), (p, c) in sorted(tokens.items())]


_USAGE_BY_TASK = """
SELECT task_id, model, sum(prompt_tokens), sum(completion_tokens), count(*),
       CASE WHEN bool_and(cost IS NOT NULL) AND count(DISTINCT currency) <= 1 THEN sum(cost) END, min(currency)
FROM call_usage
WHERE task_id = ANY(%(ids)s) GROUP BY task_id, model ORDER BY task_id, model
"""


#: One task's calls on one model: model, prompt tokens, completion tokens, calls, cost, currency.
TaskUsage = tuple[str, int, int, int, float | None, str | None]


def usage_by_task(db: RowSource, task_ids: Sequence[int]) -> dict[int, list[TaskUsage]]:
    """Each task's calls in the ledger, per model called: tokens, calls, and their cost at the prices of
    each call's start in its currency (None if one was made with no price, or in two currencies)."""
    out: dict[int, list[TaskUsage]] = {}
    for task_id, model, prompt_tokens, completion_tokens, calls, cost, currency in fetch(
            db, _USAGE_BY_TASK, {"ids": list(task_ids)}):
        out.setdefault(task_id, []).append((model, int(prompt_tokens), int(completion_tokens), int(calls),
                                            None if cost is None else float(cost), None if cost is None else currency))
    return out


def spend_so_far(db: RowSource, quotas: Sequence[Quota]) -> Spend:
    """Spend by model and by source, in the quotas' currency (None when no model names one), each call
    at the prices of its start; what was spent in another currency is kept apart."""
    return spend(charges(db), price_list(quotas)[1])


_OBSERVED = """
SELECT model, count(*), sum(prompt_tokens), sum(completion_tokens), sum(estimated_tokens - max_tokens), sum(max_tokens)
FROM tasks WHERE status = 'solved' AND model IS NOT NULL AND prompt_tokens IS NOT NULL AND completion_tokens IS NOT NULL
GROUP BY model
"""


def observed_usage(db: RowSource) -> dict[str, Observed]:
    """Per answering model: what its answered calls used against their tasks' estimates."""
    return {r[0]: Observed(int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5])) for r in fetch(db, _OBSERVED)}


def projected_cost(db: RowSource, quotas: Sequence[Quota], left: Backlog | None = None) -> Spend:
    """The backlog left's projected cost by model, over the enabled models, in the quotas' currency
    (``left``: the backlog, when the caller has read it)."""
    prices, currency = price_list(quotas)
    enabled = {q.name for q in quotas if q.enabled}
    return project((backlog(db) if left is None else left).estimates(), observed_usage(db),
                   {name: price for name, price in prices.items() if name in enabled}, currency)
