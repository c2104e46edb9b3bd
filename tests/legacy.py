"""A team's own "legacy" table for the source-table tests: a throwaway database
per use (unique name, dropped afterwards: only what the test created), and a
table ``prompts`` whose trigger counts every write to a row; the fixtures and
helpers the source-table test modules share (a module takes the fixtures with
``svc, legacy_url, legacy = legacy_fixtures.svc, ...``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.admission.quota import Quota
from balancer.cli import main
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import tasks
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
def legacy_database(base_url: str, encoding: str | None = None) -> Iterator[str]:
    """A new database (in ``encoding``, with the C locale, when given), its URL; dropped afterwards."""
    base = normalize_database_url(base_url)
    name = "legacy_" + uuid.uuid4().hex[:12]
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    encoded = f" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0" if encoding else ""
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"{encoded}'))
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


@dataclass
class Legacy:
    """The team's database, and this test's own copy of the legacy table in it."""

    engine: sa.Engine
    schema: str

    @property
    def table(self) -> str:
        return f"{self.schema}.prompts"

    def count(self, query: str) -> int:
        with self.engine.connect() as conn:
            conn.exec_driver_sql(f'SET search_path = "{self.schema}"')
            return int(conn.exec_driver_sql(query).scalar_one())

    def execute(self, statement: str) -> None:
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f'SET LOCAL search_path = "{self.schema}"; {statement}')

    def add(self, count: int, start: int = 0) -> None:
        add_rows(self.engine, count, start, table=self.table)


@pytest.fixture
def svc(migrated) -> Services:  # noqa: ANN001
    """balancer's services on this test's schema, with one model ``a``."""
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([Quota("a", 4, 100_000)])
    return services


@pytest.fixture(scope="module")
def legacy_url(service_urls) -> Iterator[str]:  # noqa: ANN001
    """The team's database, one per test module."""
    with legacy_database(service_urls[1]) as url:
        yield url


@pytest.fixture
def legacy(legacy_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Legacy]:
    """This test's legacy table, its database's URL in ``LEGACY_DATABASE_URL``."""
    monkeypatch.setenv("LEGACY_DATABASE_URL", legacy_url)
    engine = sa.create_engine(legacy_url)
    yield Legacy(engine, legacy_schema(engine))
    engine.dispose()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``balancer *argv``: its exit code, stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def import_legacy(tmp_path: Path, capsys, table: str, *, name: str = "crm", batch: int = 40,  # noqa: ANN001
                  env: bool = True) -> tuple[int, str, str]:
    path = tmp_path / f"{name}.toml"
    path.write_text(SOURCE_FILE.format(name=name, env='database_url_env = "LEGACY_DATABASE_URL"\n' if env else "",
                                       table=table, batch=batch))
    return run(capsys, "source", "import", str(path))


def solve_pending(svc: Services, answer: sa.ColumnElement | str | None = None, *, limit: int | None = None) -> int:
    """Stand-in for the solver: pending tasks (the first ``limit`` by id) straight to solved, with
    ``answer`` (default "answer to <prompt>"); the status change fires the trigger."""
    with svc.engine.begin() as conn:
        pick = sa.select(tasks.c.id).where(tasks.c.status == "pending").order_by(tasks.c.id).limit(limit)
        return conn.execute(sa.update(tasks).where(tasks.c.id.in_(pick)).values(
            status="solved", answer=answer if answer is not None else "answer to " + tasks.c.prompt, model="a")).rowcount


def counts(engine: sa.Engine, query: str) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(query).scalar_one())
