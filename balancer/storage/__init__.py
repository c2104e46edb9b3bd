"""The database's plumbing: engines, ``status``'s SQLAlchemy-free connection, how a read query
runs, the schema and its migrations, the audit tables and the declared-set import that
quotas and sources share. What is stored lives with its concept (``backlog``,
``quotas``, ``sources``).

* ``db`` — engine creation, and the check that its database answers
* ``dbapi`` — ``status``'s one read-only psycopg2 connection, and what every connection shares
* ``rows`` — how a read query runs: SQL text declared once, on an engine, a connection or the snapshot
* ``schema`` — table definitions (SQLAlchemy Core), which the migrations create
* ``audit`` — the audit tables' one shape (``quota_changes``, ``source_changes``): who changed what, old → new, when
* ``declared`` — a set declared in TOML, stored and audited: the import ``quota import`` and ``source import`` share
* ``migrate`` — Alembic, driven from code: ``balancer db upgrade`` and the startup check
"""
