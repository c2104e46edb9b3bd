"""Migrated PostgreSQL schemas for the tests, reset and reused instead of migrated anew.

Replaying the migration's DDL costs about 0.3 s per test (a dozen tables and their indexes); emptying a
schema that a test used costs a few milliseconds: only the tables that hold pages are truncated, and
only the sequences that were used are restarted.

A schema goes back into the pool only if, once reset, it is the same as a fresh one: the same tables,
columns, defaults, constraints, indexes, triggers, functions, views and statistics, with no page in any
table and the same row in ``alembic_version``. Anything else (a test that made a table, changed a
trigger, ran ANALYZE or a downgrade) and the schema is dropped. A schema is renamed as soon as its
test ends, before the reset, so a process that the test left behind reaches no table of the next test.

Each pytest(-xdist) process keeps its own pool and drops it at the end of its session.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg2
import sqlalchemy as sa

#: One recorded statement of the migration: (SQL, DBAPI parameters, executemany).
Statement = tuple[str, Any, bool]

#: What a schema is made of, one line per object (the definitions name the schema: the reader takes
#: its name out). Table sizes and planner statistics are in it:
#: a test's plan must not depend on what ran before it.
DESCRIBE = """
SELECT string_agg(d, E'\\n' ORDER BY d) FROM (
  SELECT 'rel ' || c.relname || ' ' || c.relkind::text || ' ' || c.relpersistence::text || ' ' || c.relpages
         || ' ' || c.reltuples || ' ' || coalesce(array_to_string(c.reloptions, ','), '') || ' '
         || coalesce(c.relacl::text, '') || ' ' || c.relrowsecurity || ' ' || pg_relation_size(c.oid) AS d
    FROM pg_class c WHERE c.relnamespace = current_schema()::regnamespace
  UNION ALL
  SELECT 'col ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod) || ' '
         || a.attnotnull || ' ' || coalesce(pg_get_expr(ad.adbin, ad.adrelid), '')
    FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
    LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
   WHERE c.relnamespace = current_schema()::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
  SELECT 'con ' || conname || ' ' || pg_get_constraintdef(oid) FROM pg_constraint
   WHERE connamespace = current_schema()::regnamespace
  UNION ALL
  SELECT 'idx ' || pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
   WHERE c.relnamespace = current_schema()::regnamespace
  UNION ALL
  SELECT 'trg ' || t.tgenabled::text || ' ' || pg_get_triggerdef(t.oid) FROM pg_trigger t
    JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal
  UNION ALL
  SELECT 'fn ' || p.proname || ' ' || p.prokind::text || ' ' || md5(p.prosrc) FROM pg_proc p
   WHERE p.pronamespace = current_schema()::regnamespace
  UNION ALL
  SELECT 'type ' || typname FROM pg_type WHERE typnamespace = current_schema()::regnamespace
  UNION ALL
  SELECT 'view ' || c.relname || ' ' || pg_get_viewdef(c.oid) FROM pg_class c
   WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('v', 'm')
  UNION ALL
  SELECT 'stat ' || c.relname || ' ' || s.staattnum FROM pg_statistic s JOIN pg_class c ON c.oid = s.starelid
   WHERE c.relnamespace = current_schema()::regnamespace
  UNION ALL
  SELECT 'policy ' || p.polname FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid
   WHERE c.relnamespace = current_schema()::regnamespace
  UNION ALL
  SELECT 'seq ' || sequencename || ' ' || coalesce(last_value::text, 'unused') FROM pg_sequences
   WHERE schemaname = current_schema()
  UNION ALL
  SELECT 'version ' || version_num FROM alembic_version
) described
"""

#: Empty every table that holds a page (but ``alembic_version``), forget its changes (so that autovacuum
#: does not analyze it during a later test, on changes made by earlier ones), restart every sequence.
RESET = """
DO $$
DECLARE
  used text;
  sequence text;
BEGIN
  SELECT string_agg(format('%I', c.relname), ', ') INTO used FROM pg_class c
   WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r'
     AND c.relname <> 'alembic_version' AND (pg_relation_size(c.oid) > 0 OR {every_table});
  IF used IS NOT NULL THEN
    EXECUTE 'TRUNCATE ' || used || ' CASCADE';
  END IF;
  PERFORM pg_stat_reset_single_table_counters(c.oid) FROM pg_class c
   WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r';
  FOR sequence IN SELECT format('%I', sequencename) FROM pg_sequences WHERE schemaname = current_schema() LOOP
    EXECUTE 'ALTER SEQUENCE ' || sequence || ' RESTART';
  END LOOP;
END $$;
"""


def reset(*, every_table: bool = False) -> Statement:
    """The reset, of the tables that hold a page or of every table (a new schema: a truncated table's
    indexes keep no statistics, a new one's do, and every test must start from the same state)."""
    return RESET.format(every_table="true" if every_table else "false"), None, False


def with_schema(url: str, schema: str) -> str:
    """``url`` with its search_path set to ``schema``."""
    parsed = sa.engine.make_url(url).update_query_dict({"options": f"-csearch_path={schema}"})
    return parsed.render_as_string(hide_password=False)


def new_schema_name() -> str:
    return "t_" + uuid.uuid4().hex[:12]


class MigratedSchemas:
    """Schemas migrated to head by replaying ``script``, handed out one per test and reused when clean."""

    def __init__(self, base_url: str, script: list[Statement]) -> None:
        self.base_url = base_url
        self.script = script
        self.admin = sa.create_engine(base_url, poolclass=sa.pool.NullPool)
        self.fresh: str | None = None  # what a fresh schema looks like, once reset
        self.clean: list[str] = []

    def _run(self, schema: str, statements: list[Statement]) -> str | None:
        """Run ``statements`` in ``schema``, commit, and describe it afterwards."""
        engine = sa.create_engine(with_schema(self.base_url, schema), poolclass=sa.pool.NullPool)
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            for statement, parameters, many in statements:
                (cursor.executemany if many else cursor.execute)(statement, parameters)
            raw.commit()
            cursor.execute(DESCRIBE)
            description = cursor.fetchone()[0]
            raw.commit()
            return description.replace(f"{schema}.", "")  # the definitions name their tables with the schema
        finally:
            raw.close()
            engine.dispose()

    def take(self) -> str:
        """The name of a migrated, empty schema that no one else uses."""
        if self.clean:
            return self.clean.pop()
        name = new_schema_name()
        with self.admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
        self._run(name, self.script)
        # In a transaction of its own: TRUNCATE empties a table made in the same transaction in place,
        # keeping its indexes' statistics.
        description = self._run(name, [reset(every_table=True)])
        if self.fresh is None:
            self.fresh = description
        return name

    def give_back(self, name: str) -> bool:
        """Rename ``name`` at once (what its test left running reaches none of its tables any more),
        reset it, and keep it if it is now the same as a fresh schema, else drop it; whether it was kept."""
        renamed = new_schema_name()
        with self.admin.begin() as conn:
            conn.execute(sa.text(f'ALTER SCHEMA "{name}" RENAME TO "{renamed}"'))
        try:
            description = self._run(renamed, [reset()])
        except psycopg2.Error:  # a table the reset or the description reads is gone (a downgrade)
            description = None
        if description is not None and description == self.fresh:
            self.clean.append(renamed)
            return True
        self.drop(renamed)
        return False

    def drop(self, name: str) -> None:
        with self.admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))

    def close(self) -> None:
        while self.clean:
            self.drop(self.clean.pop())
        self.admin.dispose()
