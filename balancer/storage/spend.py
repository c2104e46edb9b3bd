"""Spend so far: the tokens of every call sent to the backend, priced by each model's quota.

The tokens are the ledger's (``call_usage``, :mod:`balancer.storage.ledger`):
one row per call, answered or not, so a hedge that lost, a call cut off and
retried, and a duplicate answer all count; a call that got no answer counts
what :func:`balancer.domain.cost.billed_tokens` says the provider likely
bills. Grouped by source and by the model called;
:func:`balancer.domain.cost.spend` prices them.

:func:`projected_cost` prices the backlog left from its token estimates and
what each model's answered calls used against theirs
(:func:`balancer.domain.cost.project`): the ratios stay on answered calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from balancer.domain.cost import Observed, Spend, price_list, project, spend
from balancer.domain.quota import Quota
from balancer.storage.reads import Backlog, backlog
from balancer.storage.rows import RowSource, fetch

#: The ledger's tokens per source and model called, of the calls that ended at or after ``since`` (None: all).
_USAGE = """
SELECT source, model, sum(prompt_tokens), sum(completion_tokens) FROM call_usage
WHERE %(since)s IS NULL OR ended_at >= %(since)s GROUP BY source, model
"""


def _usage(db: RowSource, since: datetime | None) -> list[tuple[str, str, int, int]]:
    return [(r[0], r[1], int(r[2]), int(r[3])) for r in fetch(db, _USAGE, {"since": since})]


def token_usage(db: RowSource) -> list[tuple[str, str, int, int]]:
    """``(source, model, prompt tokens, completion tokens)`` of every call in the ledger, per source and model called."""
    return _usage(db, None)


def spent_by_source_since(db: RowSource, since: datetime) -> list[tuple[str, str, int, int]]:
    """``(source, model, prompt tokens, completion tokens)`` of the calls that ended at or after ``since``
    (hedges and retries included), per source and model called."""
    return _usage(db, since)


_USAGE_BY_TASK = """
SELECT task_id, model, sum(prompt_tokens), sum(completion_tokens), count(*) FROM call_usage
WHERE task_id = ANY(%(ids)s) GROUP BY task_id, model ORDER BY task_id, model
"""


def usage_by_task(db: RowSource, task_ids: Sequence[int]) -> dict[int, list[tuple[str, int, int, int]]]:
    """Each task's calls in the ledger: ``(model, prompt tokens, completion tokens, calls)`` per model called."""
    out: dict[int, list[tuple[str, int, int, int]]] = {}
    for task_id, model, prompt_tokens, completion_tokens, calls in fetch(db, _USAGE_BY_TASK, {"ids": list(task_ids)}):
        out.setdefault(task_id, []).append((model, int(prompt_tokens), int(completion_tokens), int(calls)))
    return out


def spend_so_far(db: RowSource, quotas: Sequence[Quota]) -> Spend:
    """Spend by model and by source, in the quotas' currency (None when no model names one)."""
    prices, currency = price_list(quotas)
    return spend(token_usage(db), prices, currency)


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
