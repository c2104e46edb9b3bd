"""Table definitions (SQLAlchemy Core). Alembic migrations create them; this
module is what the code queries through.

Tables live in the connection's ``search_path``, which is how tests give each
test its own schema.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Integer,
    MetaData,
    Table,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from balancer.storage.audit import audit_table

metadata = MetaData()

quotas = Table(
    "quotas",
    metadata,
    Column("name", Text, primary_key=True),
    Column("weight", Integer, nullable=False, server_default="1"),
    Column("max_concurrent_requests", Integer, nullable=False),
    Column("max_tokens_per_minute", Integer, nullable=False),
    Column("max_requests_per_minute", Integer, nullable=True),
    Column("burst_tokens", Integer, nullable=True),
    Column("enabled", Boolean, nullable=False, server_default="true"),
    Column("token_accounting", Text, nullable=False, server_default="reserve"),
    Column("burst_requests", Integer, nullable=True),
    Column("expected_latency_s", Float, nullable=True),
    Column("on_disconnect", Text, nullable=False, server_default="continue"),
    Column("price_per_million_input", Float, nullable=True),
    Column("price_per_million_output", Float, nullable=True),
    Column("currency", Text, nullable=True),
    Column("learn", Boolean, nullable=False, server_default="true"),
    Column("slow_start", Boolean, nullable=False, server_default="true"),
    Column("window_cap", Boolean, nullable=False, server_default="false"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

#: Every change to a model's quota, by an operator or learned (action create | update | remove | learn).
quota_changes = audit_table("quota_changes", "model", metadata)
#: Every change to a source: its definition (import | update | remove), weight, budget, or
#: unwritable write-backs retried or dropped.
source_changes = audit_table("source_changes", "source", metadata)

#: A task's ``status`` is one of ``balancer.backlog.statuses.TASK_STATUSES``.
tasks = Table(
    "tasks",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("source", Text, nullable=False, server_default="submit"),
    Column("prompt", Text, nullable=False),
    Column("status", Text, nullable=False, server_default="pending"),
    Column("priority", Integer, nullable=False, server_default="0"),
    Column("allowed_models", ARRAY(Text), nullable=True),
    Column("max_tokens", Integer, nullable=False),
    Column("model", Text, nullable=True),
    Column("admission_id", Text, nullable=True),
    Column("estimated_tokens", Integer, nullable=False),
    Column("prompt_tokens", Integer, nullable=True),
    Column("completion_tokens", Integer, nullable=True),
    Column("answer", Text, nullable=True),
    Column("error", Text, nullable=True),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("rate_limited", Integer, nullable=False, server_default="0"),
    Column("avoid_model", Text, nullable=True),  # the model whose transient failure sent it back
    # A hedge: a second call on another model for a straggling running task (dispatch.dispatcher).
    Column("hedge_admission_id", Text, nullable=True),  # the hedge in flight; cleared on return to pending
    Column("hedge_model", Text, nullable=True),
    Column("hedges", Integer, nullable=False, server_default="0"),
    # estimated tokens hedges were admitted with (the hedge budget's spend; a hedge of a call no worker serves: 0)
    Column("hedge_tokens", Integer, nullable=False, server_default="0"),
    Column("not_before", DateTime(timezone=True), nullable=True),
    Column("deadline", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("queued_at", DateTime(timezone=True), nullable=True),
    Column("started_at", DateTime(timezone=True), nullable=True),
    Column("solved_at", DateTime(timezone=True), nullable=True),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # Identity: unique within its source when set (``tasks_source_key``); metadata is kept and returned with the answer.
    Column("key", Text, nullable=True),
    Column("metadata", JSONB, nullable=True),
    # A source task's fence: md5 of the prompt it was read with, as UTF-8 (balancer.sources.catalog).
    Column("source_fingerprint", Text, nullable=True),
    Column("from_table", Boolean, nullable=False, server_default="false"),  # ingested from its source's table
    # What the task's failure wrote to its row before a ``tasks retry`` ({"error": ...}): its
    # next write-back may replace exactly that (balancer.sources.catalog, migration 0022).
    Column("source_replaces", JSONB, nullable=True),
)

#: The ledger: one row per call sent to the backend, answered or not (a hedge that
#: lost, a call cut off, refused or retried), with the tokens it is counted for
#: (:func:`balancer.costs.cost.billed_tokens`). ``call_id`` is the call's own,
#: so a write retried after an unknown commit adds no second row.
call_usage = Table(
    "call_usage",
    metadata,
    Column("call_id", Text, primary_key=True),
    Column("task_id", BigInteger, nullable=False),
    Column("source", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("admission_id", Text, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("answered", Boolean, nullable=False),
    Column("hedge", Boolean, nullable=False),
    Column("ended_at", DateTime(timezone=True), nullable=False),
    # What the call cost at the prices in force when it was made (NULL: its model had no price).
    Column("cost", Float, nullable=True),
    Column("currency", Text, nullable=True),
)

#: Every source's share of the dispatch window (weighted deficit round robin
#: across sources); a source with no row has weight 1.
source_weights = Table(
    "source_weights",
    metadata,
    Column("source", Text, primary_key=True),
    Column("weight", Integer, nullable=False, server_default="1"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

#: A source's budget per day (balancer.costs.budget): money in the quotas'
#: currency, tokens, or both; a source with no row (or NULLs) has none.
source_budgets = Table(
    "source_budgets",
    metadata,
    Column("source", Text, primary_key=True),
    Column("money_per_day", Float, nullable=True),
    Column("tokens_per_day", BigInteger, nullable=True),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

#: Operator actions on tasks (``balancer tasks retry|cancel``), audited as quota changes are.
task_operations = Table(
    "task_operations",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("done_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("done_by", Text, nullable=False),
    Column("action", Text, nullable=False),  # retry | cancel
    Column("filter", JSONB, nullable=False),
    Column("task_ids", ARRAY(BigInteger), nullable=False),
)

ingested_files = Table(
    "ingested_files",
    metadata,
    Column("name", Text, primary_key=True),
    Column("sha256", Text, primary_key=True),
    Column("tasks", Integer, nullable=False),
    Column("ingested_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
