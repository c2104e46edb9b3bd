"""The migrated schemas the tests share (tests/schemas.py): reused only when a test left nothing behind."""

from __future__ import annotations

import sqlalchemy as sa

from tests.schemas import MigratedSchemas, with_schema


def run(schemas: MigratedSchemas, name: str, sql: str) -> list[tuple]:
    engine = sa.create_engine(with_schema(schemas.base_url, name), poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            result = conn.exec_driver_sql(sql)
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


def schema_exists(schemas: MigratedSchemas, name: str) -> bool:
    with schemas.admin.connect() as conn:
        return conn.execute(sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :n"), {"n": name}).first() is not None


def test_a_schema_comes_back_empty_with_its_ids_from_one_under_a_new_name(migrated_schemas: MigratedSchemas) -> None:
    first = migrated_schemas.take()
    run(migrated_schemas, first, "INSERT INTO tasks (prompt, max_tokens, estimated_tokens) VALUES ('a', 1, 1), ('b', 1, 1)")
    kept = len(migrated_schemas.clean)
    assert migrated_schemas.give_back(first), "a clean schema was dropped, not kept"
    assert len(migrated_schemas.clean) == kept + 1
    assert not schema_exists(migrated_schemas, first), "not renamed as its test ended"
    second = migrated_schemas.take()  # the same schema, under its new name
    try:
        assert second != first
        assert run(migrated_schemas, second, "SELECT count(*) FROM tasks") == [(0,)]
        assert run(migrated_schemas, second, "INSERT INTO tasks (prompt, max_tokens, estimated_tokens) "
                                             "VALUES ('c', 1, 1) RETURNING id") == [(1,)]
    finally:
        migrated_schemas.give_back(second)


def test_a_schema_whose_structure_a_test_changed_is_dropped_not_reused(migrated_schemas: MigratedSchemas) -> None:
    for change in ("CREATE TABLE team_prompts (id int)",
                   "DROP TRIGGER tasks_finished ON tasks",
                   "ALTER TABLE quotas ALTER COLUMN weight SET DEFAULT 2",
                   "INSERT INTO quotas (name, max_concurrent_requests, max_tokens_per_minute, max_requests_per_minute) "
                   "VALUES ('m', 1, 10, 10); ANALYZE quotas",
                   "UPDATE alembic_version SET version_num = '0001'"):
        name = migrated_schemas.take()
        run(migrated_schemas, name, change)
        kept = set(migrated_schemas.clean)
        assert not migrated_schemas.give_back(name), change
        assert set(migrated_schemas.clean) == kept, change
