"""A team's own "legacy" table for the source-table tests: a throwaway database
per use (unique name, dropped afterwards: only what the test created), and a
table ``prompts`` whose trigger counts every write to a row."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from balancer.urls import normalize_database_url

LEGACY_TABLE = """
CREATE TABLE prompts (id bigserial PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT 'unsolved',
                      answer text, solved_by text, error text, priority int);
CREATE TABLE writes (row_id bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION count_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN EXECUTE format('INSERT INTO %I.writes (row_id) VALUES ($1)', TG_TABLE_SCHEMA) USING NEW.id; RETURN NEW; END $$;
CREATE TRIGGER prompts_written AFTER UPDATE ON prompts FOR EACH ROW EXECUTE FUNCTION count_write();
"""

SOURCE_FILE = """
[sources.{name}]
{env}table = "{table}"
key = "id"
prompt = "body"
where = "status = 'unsolved'"
answer = "answer"
status = "status"
error = "error"
model = "solved_by"
priority = "priority"
batch = {batch}
poll_seconds = 0.1
"""


@contextmanager
def legacy_database(base_url: str) -> Iterator[str]:
    """A new database, its URL; dropped afterwards."""
    base = normalize_database_url(base_url)
    name = "legacy_" + uuid.uuid4().hex[:12]
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.engine.make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        from balancer.storage.db import dispose_engines

        dispose_engines()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def legacy_schema(engine: sa.Engine) -> str:
    """A new schema in ``engine``'s database holding the legacy table; its name."""
    schema = "legacy_" + uuid.uuid4().hex[:12]
    with engine.begin() as conn:  # the DBAPI cursor: no parameters, so the trigger's '%I' stays as it is
        conn.connection.cursor().execute(f'CREATE SCHEMA "{schema}"; SET LOCAL search_path = "{schema}"; {LEGACY_TABLE}')
    return schema


def add_rows(engine: sa.Engine, count: int, start: int = 0, *, table: str) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f"INSERT INTO {table} (body, priority) SELECT 'legacy prompt ' || g, g %% 3 "  # noqa: S608
                             f"FROM generate_series({start}, {start + count - 1}) g")
