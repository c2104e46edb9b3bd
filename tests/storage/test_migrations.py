"""``balancer db upgrade`` builds the very schema the ``migrated`` fixture replays.

The fixture records one real upgrade per test session and replays its statements
into each new migrated schema (tests/schemas.py); this test holds the two equal,
catalog entry for entry.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from balancer.cli import main
from balancer.storage.db import dispose_engines
from balancer.storage.migrate import head_revision
from tests.schemas import new_schema_name, with_schema


@pytest.fixture
def fresh_schema_engine(service_urls: tuple[str, str]) -> Iterator[sa.Engine]:
    """An engine on a new, empty schema (its URL's search_path); afterwards that
    schema, and only it, is dropped (the package's own engines disposed first)."""
    from balancer.urls import normalize_database_url

    base = normalize_database_url(service_urls[1])
    schema = new_schema_name()
    admin = sa.create_engine(base, poolclass=sa.pool.NullPool)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    engine = sa.create_engine(with_schema(base, schema), poolclass=sa.pool.NullPool)
    try:
        yield engine
    finally:
        engine.dispose()
        dispose_engines()
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def catalog(url: str) -> dict[str, object]:
    """Tables, columns, indexes, constraints and sequences of the URL's schema, and its revision."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        def rows(sql: str) -> list[tuple]:
            return sorted(tuple(r) for r in conn.execute(sa.text(sql)))

        found = {
            "columns": rows("SELECT table_name, column_name, data_type, column_default, is_nullable"
                            " FROM information_schema.columns WHERE table_schema = current_schema()"),
            "indexes": rows("SELECT tablename, indexname, replace(indexdef, current_schema() || '.', '')"
                            " FROM pg_indexes WHERE schemaname = current_schema()"),
            "constraints": rows("SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid)"
                                " FROM pg_constraint c WHERE c.connamespace = current_schema()::regnamespace"),
            "sequences": rows("SELECT sequence_name FROM information_schema.sequences"
                              " WHERE sequence_schema = current_schema()"),
            "version": conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one(),
        }
    engine.dispose()
    return found


def test_db_upgrade_builds_the_schema_the_fixture_replays(
    migrated: dict[str, str], fresh_schema_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    replayed = catalog(migrated["BALANCER_DATABASE_URL"])
    assert replayed["version"] == head_revision() and replayed["columns"] and replayed["indexes"]
    upgraded_url = fresh_schema_engine.url.render_as_string(hide_password=False)
    monkeypatch.setenv("BALANCER_DATABASE_URL", upgraded_url)
    assert main(["db", "upgrade"]) == 0
    capsys.readouterr()
    assert catalog(upgraded_url) == replayed


def test_0016_makes_ready_list_entries_ready_and_keeps_published_tasks_queued(fresh_schema_engine: sa.Engine) -> None:
    """Before 0016 a ready-list entry was ``queued`` under an ``r...`` admission id;
    after it, that task is ``ready`` and a published one stays ``queued``."""
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks
    from balancer.storage.migrate import upgrade

    engine = fresh_schema_engine
    assert upgrade(engine, "0015") == "0015"
    rows, _ = parse_tasks('{"prompt": "a"}\n{"prompt": "b"}\n', models={"m": 100_000})
    with engine.begin() as conn:
        stocked, published = insert_tasks(conn, rows)
        for task_id, lid in ((stocked, "r0123abcd"), (published, "1700000000-7")):
            conn.execute(sa.text("UPDATE tasks SET status = 'queued', model = 'm', admission_id = :lid WHERE id = :id"),
                         {"lid": lid, "id": task_id})
    assert upgrade(engine, "0016") == "0016"
    with engine.connect() as conn:
        status = dict(conn.execute(sa.text("SELECT id, status FROM tasks")).all())
    assert status == {stocked: "ready", published: "queued"}


def test_0018_puts_each_solved_task_s_answering_call_in_the_ledger(fresh_schema_engine: sa.Engine) -> None:
    """Spend reads the ledger from 0018 on: the history before it, each solved task's
    answering call (all it recorded), is carried over, so spend so far does not drop."""
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks
    from balancer.storage.migrate import upgrade

    engine = fresh_schema_engine
    assert upgrade(engine, "0016") == "0016"
    rows, _ = parse_tasks('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n', models={"m": 100_000})
    with engine.begin() as conn:
        solved, failed, pending = insert_tasks(conn, rows)
        conn.execute(sa.text("UPDATE tasks SET status = 'solved', model = 'm', admission_id = 'a1', prompt_tokens = 7,"
                             " completion_tokens = 3, solved_at = now() WHERE id = :id"), {"id": solved})
        conn.execute(sa.text("UPDATE tasks SET status = 'failed', model = 'm' WHERE id = :id"), {"id": failed})
    assert upgrade(engine, "0018") == "0018"
    with engine.connect() as conn:
        ledger = conn.execute(sa.text("SELECT task_id, model, admission_id, answered FROM call_usage")).all()
    assert ledger == [(solved, "m", "a1", True)]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT source, model, prompt_tokens, completion_tokens FROM call_usage")).all() \
            == [("submit", "m", 7, 3)]


def test_0026_prices_the_calls_already_in_the_ledger_at_their_models_prices(fresh_schema_engine: sa.Engine) -> None:
    """From 0026 each ledger row keeps its call's cost (issue 38 finding 13); the rows written
    before it are priced once, at the prices their models have then; a model with no price stays
    unpriced (NULL), and spend reads the stored costs from then on."""
    from balancer.backlog.spend import charges
    from balancer.costs.cost import Charged
    from balancer.storage.migrate import upgrade

    engine = fresh_schema_engine
    assert upgrade(engine, "0019") == "0019"
    with engine.begin() as conn:
        for name, price in (("m", "2.0"), ("free", "NULL")):
            conn.execute(sa.text("INSERT INTO quotas (name, max_concurrent_requests, max_tokens_per_minute,"  # noqa: S608
                                 f" price_per_million_input, price_per_million_output, currency) VALUES (:n, 1, 1000,"
                                 f" {price}, {price}, CASE WHEN {price} IS NULL THEN NULL ELSE 'EUR' END)"), {"n": name})
            conn.execute(sa.text("INSERT INTO call_usage (call_id, task_id, source, model, admission_id, prompt_tokens,"
                                 " completion_tokens, answered, hedge, ended_at) VALUES (:n, 1, 's', :n, 'a', 500000,"
                                 " 250000, true, false, now())"), {"n": name})
    assert upgrade(engine, "0026") == "0026"
    assert sorted(charges(engine)) == [Charged("s", "free", 500_000, 250_000, None, None),
                                       Charged("s", "m", 500_000, 250_000, 1.5, "EUR")]
