"""Issue 38 finding 11: polling a source costs in proportion to its new rows, not to its table,
measured with PostgreSQL's own counters (``pg_stat_user_tables``) on a team's table in a
database the test creates and drops; new rows of a uuid key are found within a stated bound."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.services import Services
from balancer.sources.definition import parse_source_file
from balancer.sources.ingest import ingest_source, quota_bursts
from balancer.storage.db import dispose_engines
from balancer.storage.schema import tasks
from tests.legacy import legacy_database
from tests.sources import test_sources as base
from tests.sources.test_sources import run

svc = base.svc

SOURCE = """
[sources.{name}]
database_url_env = "LEGACY_DATABASE_URL"
table = "{table}"
key = "id"
prompt = "body"
where = "status = 'unsolved'"
answer = "answer"
status = "status"
batch = {batch}
poll_seconds = 0.1
{extra}"""


@pytest.fixture
def team(service_urls, monkeypatch: pytest.MonkeyPatch) -> Iterator[sa.Engine]:  # noqa: ANN001
    with legacy_database(service_urls[1]) as url:
        monkeypatch.setenv("LEGACY_DATABASE_URL", url)
        engine = sa.create_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()


def execute(engine: sa.Engine, statement: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(statement)


def import_source(tmp_path: Path, capsys, name: str, table: str, batch: int, extra: str = "") -> tuple[int, str]:  # noqa: ANN001
    path = tmp_path / f"{name}.toml"
    path.write_text(SOURCE.format(name=name, table=table, batch=batch, extra=extra))
    code, out, err = run(capsys, "source", "import", str(path))
    return code, out + err


def definition(name: str, table: str, batch: int, extra: str = ""):  # noqa: ANN201
    [found] = parse_source_file(SOURCE.format(name=name, table=table, batch=batch, extra=extra))
    return found


def tuples_read(team: sa.Engine, table: str) -> int:
    """Rows the team's table has had read so far (sequential scans' and index scans' heap
    fetches), once every other session of its database has ended and so reported its counts."""
    dispose_engines()  # balancer's connections to the team's database end, and report their counts on the way out
    team.dispose()
    with team.connect() as conn:
        deadline = time.monotonic() + 30
        while conn.exec_driver_sql("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                   "AND backend_type = 'client backend' AND pid <> pg_backend_pid()").scalar_one():
            assert time.monotonic() < deadline, "the team's database still has other sessions"
            time.sleep(0.05)
        conn.exec_driver_sql("SELECT pg_stat_clear_snapshot()")
        return int(conn.exec_driver_sql("SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) "
                                        "FROM pg_stat_user_tables WHERE relname = %s", (table,)).scalar_one())


def source_tasks(svc: Services, source: str) -> int:
    with svc.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(tasks.c.source == source)).scalar_one())


ROWS = 1_000_000
BATCH = 5_000
POLLS = 10


def test_a_poll_reads_the_new_rows_and_one_window_not_the_table(svc: Services, team: sa.Engine, tmp_path: Path,
                                                                 capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 11: 1,000,000 rows that did not match ``where`` cost 6.0 M tuples read per
    minute with nothing to do: each poll read the whole table. Now a poll examines the rows past
    its cursor and one window of ``batch`` rows behind it: on 1,000,000 rows that match nothing,
    at most 2 x ``batch`` tuples a poll (the window's index entries' rows, then its rows); new
    rows of work cost about themselves."""
    execute(team, "CREATE TABLE prompts (id bigserial PRIMARY KEY, body text NOT NULL, "
                  "status text NOT NULL DEFAULT 'unsolved', answer text) WITH (autovacuum_enabled = false)")
    execute(team, f"INSERT INTO prompts (body, status) SELECT 'done ' || g, 'solved' FROM generate_series(1, {ROWS}) g")
    execute(team, "VACUUM ANALYZE prompts")
    code, out = import_source(tmp_path, capsys, "big", "public.prompts", BATCH)
    assert code == 0, out
    source = definition("big", "public.prompts", BATCH)
    models = quota_bursts(svc)
    deadline = time.monotonic() + 300
    while not ingest_source(svc, source, models, budget_s=60).caught_up:  # the first read examines every row, once
        assert time.monotonic() < deadline
    before = tuples_read(team, "prompts")
    for _ in range(POLLS):
        report = ingest_source(svc, source, models)
        assert report.caught_up and report.created == 0
    idle = tuples_read(team, "prompts") - before
    print(f"{POLLS} polls of {ROWS:,} rows matching nothing, batch {BATCH:,}: {idle:,} tuples read")
    assert idle <= POLLS * 2 * BATCH, idle  # before: POLLS x 1,000,000

    execute(team, "INSERT INTO prompts (body) SELECT 'new ' || g FROM generate_series(1, 100) g")
    before = tuples_read(team, "prompts")
    assert ingest_source(svc, source, models).created == 100
    assert source_tasks(svc, "big") == 100
    new = tuples_read(team, "prompts") - before
    print(f"one poll finding 100 new rows: {new:,} tuples read")
    assert new <= 2 * BATCH + 3 * 100, new


def test_new_rows_of_a_uuid_key_are_found_at_the_next_poll_with_a_cursor_column(
        svc: Services, team: sa.Engine, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 11: new rows with uuid keys waited 73-143 s for the rescan. A source
    declaring ``cursor`` (a NOT NULL column that grows with each new row) finds them at the next
    poll; without one, the import says so and when: within about rows / batch polls of the rescan."""
    rows, batch = 20_000, 1_000
    for table in ("keyed", "plain"):
        execute(team, f"CREATE TABLE {table} (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), "
                      "seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE, made timestamptz, body text NOT NULL, "
                      "status text NOT NULL DEFAULT 'unsolved', answer text)")
        execute(team, f"INSERT INTO {table} (body, status) SELECT 'done ' || g, 'solved' "
                      f"FROM generate_series(1, {rows}) g; ANALYZE {table}")
    code, out = import_source(tmp_path, capsys, "nullable", "public.keyed", batch, 'cursor = "made"\n')
    assert code == 2 and "cursor column 'made' of public.keyed may be NULL" in out, out
    code, out = import_source(tmp_path, capsys, "keyed", "public.keyed", batch, 'cursor = "seq"\n')
    assert code == 0 and "note:" not in out, out
    code, out = import_source(tmp_path, capsys, "plain", "public.plain", batch)
    assert code == 0 and "note: sources.plain: key id (uuid) does not grow" in out, out
    assert "within about 2 s" in out and 'cursor = "COLUMN"' in out, out  # 20 windows of a poll of 0.1 s
    models = quota_bursts(svc)
    keyed = definition("keyed", "public.keyed", batch, 'cursor = "seq"\n')
    plain = definition("plain", "public.plain", batch)
    for source in (keyed, plain):
        while not ingest_source(svc, source, models).caught_up:
            pass
    for table in ("keyed", "plain"):
        execute(team, f"INSERT INTO {table} (body) SELECT 'new ' || g FROM generate_series(1, 30) g")
    assert ingest_source(svc, keyed, models).created == 30  # the next poll
    # A new row just behind the rescan waits one round: the windows left of this pass (floor(a /
    # batch) + 1, its last one short or empty) and those of the next up to the row (ceil(b / batch)),
    # at most ceil((a + b) / batch) + 1 polls, a + b the table's rows.
    bound = -(-(rows + 30) // batch) + 1
    polls = 0
    while source_tasks(svc, "plain") < 30:
        ingest_source(svc, plain, models)
        polls += 1
        assert polls <= bound, f"{source_tasks(svc, 'plain')} of 30 found in {polls} polls"
    print(f"uuid key without a cursor column: 30 new rows found in {polls} polls (bound {bound})")
