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

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from balancer.domain.cost import Observed, Spend, price_list, project, spend
from balancer.domain.quota import Quota
from balancer.storage.schema import call_usage, tasks


def _usage(conn_or_engine: Connection | Engine, *where: sa.ColumnElement[bool]) -> list[tuple[str, str, int, int]]:
    query = (sa.select(call_usage.c.source, call_usage.c.model, sa.func.sum(call_usage.c.prompt_tokens),
                       sa.func.sum(call_usage.c.completion_tokens))
             .where(*where).group_by(call_usage.c.source, call_usage.c.model))
    if isinstance(conn_or_engine, Connection):
        return [(r[0], r[1], int(r[2]), int(r[3])) for r in conn_or_engine.execute(query)]
    with conn_or_engine.connect() as conn:
        return [(r[0], r[1], int(r[2]), int(r[3])) for r in conn.execute(query)]


def token_usage(engine: Engine) -> list[tuple[str, str, int, int]]:
    """``(source, model, prompt tokens, completion tokens)`` of every call in the ledger, per source and model called."""
    return _usage(engine)


def spent_by_source_since(conn_or_engine: Connection | Engine, since: datetime) -> list[tuple[str, str, int, int]]:
    """``(source, model, prompt tokens, completion tokens)`` of the calls that ended at or after ``since``
    (hedges and retries included), per source and model called."""
    return _usage(conn_or_engine, call_usage.c.ended_at >= since)


def usage_by_task(conn: Connection, task_ids: Sequence[int]) -> dict[int, list[tuple[str, int, int, int]]]:
    """Each task's calls in the ledger: ``(model, prompt tokens, completion tokens, calls)`` per model called."""
    query = (sa.select(call_usage.c.task_id, call_usage.c.model, sa.func.sum(call_usage.c.prompt_tokens),
                       sa.func.sum(call_usage.c.completion_tokens), sa.func.count())
             .where(call_usage.c.task_id.in_(task_ids)).group_by(call_usage.c.task_id, call_usage.c.model)
             .order_by(call_usage.c.task_id, call_usage.c.model))
    out: dict[int, list[tuple[str, int, int, int]]] = {}
    for task_id, model, prompt_tokens, completion_tokens, calls in conn.execute(query):
        out.setdefault(task_id, []).append((model, int(prompt_tokens), int(completion_tokens), int(calls)))
    return out


def spend_so_far(engine: Engine, quotas: Sequence[Quota]) -> Spend:
    """Spend by model and by source, in the quotas' currency (None when no model names one)."""
    prices, currency = price_list(quotas)
    return spend(token_usage(engine), prices, currency)


#: Task statuses whose tokens are still to be spent.
LEFT = ("pending", "ready", "queued", "running")


def backlog_estimates(engine: Engine) -> list[tuple[list[str] | None, int, int, int]]:
    """The tasks left by allowed models: (allowed or None, tasks, estimated prompt tokens, ``max_tokens``)."""
    prompt = tasks.c.estimated_tokens - tasks.c.max_tokens
    query = (sa.select(tasks.c.allowed_models, sa.func.count(), sa.func.coalesce(sa.func.sum(prompt), 0),
                       sa.func.coalesce(sa.func.sum(tasks.c.max_tokens), 0))
             .where(tasks.c.status.in_(LEFT)).group_by(tasks.c.allowed_models))
    with engine.connect() as conn:
        return [(r[0], int(r[1]), int(r[2]), int(r[3])) for r in conn.execute(query)]


def observed_usage(engine: Engine) -> dict[str, Observed]:
    """Per answering model: what its answered calls used against their tasks' estimates."""
    query = (sa.select(tasks.c.model, sa.func.count(), sa.func.sum(tasks.c.prompt_tokens),
                       sa.func.sum(tasks.c.completion_tokens), sa.func.sum(tasks.c.estimated_tokens - tasks.c.max_tokens),
                       sa.func.sum(tasks.c.max_tokens))
             .where(tasks.c.status == "solved", tasks.c.model.is_not(None), tasks.c.prompt_tokens.is_not(None),
                    tasks.c.completion_tokens.is_not(None))
             .group_by(tasks.c.model))
    with engine.connect() as conn:
        return {r[0]: Observed(int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5])) for r in conn.execute(query)}


def projected_cost(engine: Engine, quotas: Sequence[Quota]) -> Spend:
    """The backlog left's projected cost by model, over the enabled models, in the quotas' currency."""
    prices, currency = price_list(quotas)
    enabled = {q.name for q in quotas if q.enabled}
    return project(backlog_estimates(engine), observed_usage(engine),
                   {name: price for name, price in prices.items() if name in enabled}, currency)
