"""The source tables (SQLAlchemy Core), created by migration 0013 (``relations``: 0021).

``sources``: each declared source (its TOML definition as JSON, never a
secret) and its read cursor. ``source_outbox``: the write-backs still to do,
one row per task that ended, inserted by the ``tasks_finished`` trigger in the
transaction that ended it, and those that ended otherwise than written
(:mod:`balancer.sources.outbox`).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Integer, Table, Text, func
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from balancer.storage.schema import metadata

sources = Table(
    "sources",
    metadata,
    Column("name", Text, primary_key=True),
    Column("definition", JSONB, nullable=False),
    Column("position", JSONB, nullable=True),
    Column("rescan", JSONB, nullable=True),
    Column("ingested", BigInteger, nullable=False, server_default="0"),
    Column("read_at", DateTime(timezone=True), nullable=True),
    Column("caught_up_at", DateTime(timezone=True), nullable=True),
    Column("null_keys", BigInteger, nullable=False, server_default="0"),  # rows of work with a NULL key (0022)
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("relations", ARRAY(Text), nullable=True),  # the tables it reads, resolved at import (migration 0021)
)

source_outbox = Table(
    "source_outbox",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("task_id", BigInteger, nullable=False),
    Column("source", Text, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("state", Text, nullable=False, server_default="waiting"),
    Column("attempts", Integer, nullable=False, server_default="0"),  # every try, the back-off's count
    Column("last_error", Text, nullable=True),
    Column("refusals", Integer, nullable=False, server_default="0"),  # tries the team's table refused (0020)
    Column("next_attempt_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

#: Each row of a source table that could not be a task (an empty or undecodable prompt, no
#: model configured, a bad key), with its reason: recorded in the transaction that moves the
#: cursor past it (migration 0022).
source_rejects = Table(
    "source_rejects",
    metadata,
    Column("source", Text, primary_key=True),
    Column("key", Text, primary_key=True),
    Column("reason", Text, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
