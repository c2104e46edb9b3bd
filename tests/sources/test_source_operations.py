"""Issue 38 finding 7: the operator commands around a source's life lose nothing (``tasks
prune``, ``tasks retry``, ``source remove``, importing again), on real PostgreSQL with the
team's table in a database the tests create and drop (tests/legacy.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

from balancer.services import Services
from balancer.sources.ingest import ingest_sources
from balancer.sources.schema import source_outbox, sources
from balancer.sources.writeback import drain
from balancer.storage.schema import source_changes, task_operations, tasks
from tests import legacy as legacy_fixtures
from tests.legacy import Legacy, import_legacy, legacy_database, run, solve_pending

# The team's table and balancer's services (tests/legacy.py).
svc, legacy_url, legacy = legacy_fixtures.svc, legacy_fixtures.legacy_url, legacy_fixtures.legacy

SOLVED = "SELECT count(*) FROM prompts WHERE status = 'solved'"


def counted(svc: Services, *where: sa.ColumnElement[bool]) -> int:
    with svc.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(tasks).where(*where)).scalar_one())


def waiting(svc: Services) -> int:
    with svc.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(source_outbox.c.state == "waiting")).scalar_one())


def later() -> str:
    return (datetime.now(UTC) + timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S")


def test_prune_keeps_a_task_whose_write_back_has_not_ended(svc: Services, legacy: Legacy, tmp_path: Path,
                                                           capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 7: ``tasks prune`` while write-backs waited deleted their tasks (20 of 20
    rows then paid twice, 20 orphan outbox rows). It keeps them, says how many, and prunes them
    once written; their rows are not read again."""
    legacy.add(20)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 20 and waiting(svc) == 20
    code, out, _ = run(capsys, "tasks", "prune", "--before", later(), "--yes")
    assert code == 0 and "deleted 0 finished task(s)" in out and "kept 20 whose write-back" in out, out
    assert counted(svc, tasks.c.source == "crm") == 20
    assert drain(svc).written == 20
    code, out, _ = run(capsys, "tasks", "prune", "--before", later(), "--yes")
    assert code == 0 and "deleted 20 finished task(s)" in out and "kept" not in out, out
    ingest_sources(svc)
    assert counted(svc, tasks.c.source == "crm") == 0  # written rows no longer match where: nothing asked twice
    assert legacy.count("SELECT count(*) FROM writes") == 20


def test_remove_refuses_with_the_counts_and_cancel_cancels_audited(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                  capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 7: ``source remove`` mid-run was accepted and its rows were never
    written. By default it is refused, saying what is left; ``--cancel`` cancels the pending
    tasks and drops the waiting write-backs, audited, and says so."""
    legacy.add(20)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc, limit=5) == 5
    code, _, err = run(capsys, "source", "remove", "crm")
    assert code != 0 and "15 pending task(s), 0 in flight and 5 write-back(s) waiting" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    code, out, _ = run(capsys, "source", "remove", "crm", "--cancel", "--by", "ops")
    assert code == 0 and "cancelled 15 pending task(s), dropped 5 waiting write-back(s)" in out, out
    assert counted(svc, tasks.c.source == "crm", tasks.c.status == "cancelled") == 15
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sources)).scalar_one() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(source_outbox)).scalar_one() == 0
        audit = conn.execute(sa.select(source_changes.c.changed_by, source_changes.c.new_value)
                             .where(source_changes.c.action == "remove")).one()
        assert audit.changed_by == "ops" and len(audit.new_value["cancelled_tasks"]) == 15
        assert len(audit.new_value["dropped_writebacks"]) == 5
        cancel = conn.execute(sa.select(task_operations.c.task_ids).where(task_operations.c.action == "cancel")).one()
        assert len(cancel.task_ids) == 15


def test_a_source_whose_table_is_gone_can_be_removed(svc: Services, legacy: Legacy, tmp_path: Path,
                                                    capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 7: a source whose table was dropped, its write-backs failing for ever,
    could never be removed. ``--cancel`` removes it without touching its table."""
    legacy.add(4)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    solve_pending(svc)
    legacy.execute("DROP TABLE prompts CASCADE")
    assert drain(svc).written == 0
    code, _, err = run(capsys, "source", "remove", "crm")
    assert code != 0 and "4 write-back(s) waiting" in err
    code, out, _ = run(capsys, "source", "remove", "crm", "--cancel")
    assert code == 0 and "dropped 4 waiting write-back(s)" in out, out
    assert waiting(svc) == 0


def test_a_removed_source_leaves_no_weight_behind_and_its_budget_says_what_it_is(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """The import set the source's weight; removing it left the weight's row, so `source list`
    still showed the source (as a JSONL source with a weight) that `source remove` then said did
    not exist (a new user's probe). A budget per day is a source name's own setting, set apart:
    it stays, and a second remove says so."""
    import json

    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    assert run(capsys, "source", "set", "crm", "--weight", "3")[0] == 0
    assert run(capsys, "source", "remove", "crm")[0] == 0
    code, out, _ = run(capsys, "source", "list", "--json")
    assert code == 0 and json.loads(out) == []
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    assert run(capsys, "source", "set", "crm", "--budget-tokens-per-day", "1000")[0] == 0
    assert run(capsys, "source", "remove", "crm")[0] == 0
    code, out, _ = run(capsys, "source", "list", "--json")
    assert [(s["name"], s["weight"]) for s in json.loads(out)] == [("crm", 1)]
    code, _, err = run(capsys, "source", "remove", "crm")
    assert code == 2 and err == ("error: no source table 'crm': it has a budget per day, which stays for its JSONL "
                                 "tasks (`balancer source set crm --no-budget` clears it)\n")


def test_importing_a_removed_source_again_resumes_its_keys(svc: Services, legacy: Legacy, tmp_path: Path,
                                                         capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 7: re-importing a removed source did not bring back the rows its removal
    left: its cancelled tasks go back to pending and its write-backs dropped (or of tasks that
    ended meanwhile) are queued again; every row answered and written once, no task twice."""
    legacy.add(20)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc, limit=10) == 10
    with svc.engine.begin() as conn:  # one in flight when the source is removed
        conn.execute(sa.update(tasks).where(tasks.c.key == "20").values(status="running"))
    assert run(capsys, "source", "remove", "crm", "--cancel")[0] == 0
    with svc.engine.begin() as conn:  # ... which ends while the source is not declared: no write-back queued
        conn.execute(sa.update(tasks).where(tasks.c.key == "20").values(status="solved", answer="late", model="a",
                                                                          updated_at=sa.func.now()))
    assert waiting(svc) == 0
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    assert counted(svc, tasks.c.source == "crm", tasks.c.status == "pending") == 9
    assert waiting(svc) == 11
    ingest_sources(svc)
    assert counted(svc, tasks.c.source == "crm") == 20
    solve_pending(svc)
    assert drain(svc).written == 20
    assert legacy.count(SOLVED) == 20
    assert legacy.count("SELECT count(DISTINCT row_id) FROM writes") == legacy.count("SELECT count(*) FROM writes") == 20


def test_retry_of_a_failed_source_task_writes_its_new_answer_back(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                 capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 7: ``tasks retry`` of a source task whose failure was written back turned
    its new answer into a "conflict" (the row no longer matched ``where``). The new answer
    replaces balancer's own failed write; a failed row the team changed since is still not
    overwritten, and a failure not yet written is never written."""
    legacy.add(4)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    with svc.engine.begin() as conn:
        conn.execute(sa.update(tasks).where(tasks.c.key.in_(["1", "2"]))
                     .values(status="failed", error="backend said no", updated_at=sa.func.now()))
    assert drain(svc).written == 2
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'failed' AND error = 'backend said no'") == 2
    legacy.execute("UPDATE prompts SET error = 'looked at by hand' WHERE id = 2")
    with svc.engine.begin() as conn:  # a failure whose write-back still waits: the retry drops it
        conn.execute(sa.update(tasks).where(tasks.c.key == "3").values(status="failed", error="later"))
    code, out, _ = run(capsys, "tasks", "retry", "--source", "crm", "--yes")
    assert code == 0 and "retried 3 task(s)" in out, out
    assert waiting(svc) == 0
    assert solve_pending(svc) == 4
    drained = drain(svc)
    assert (drained.written, drained.conflicts) == (3, 1)
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'solved' AND left(answer, 9) = 'answer to'") == 3
    assert legacy.count("SELECT count(*) FROM prompts WHERE id = 2 AND status = 'failed' "
                        "AND error = 'looked at by hand'") == 1
    assert legacy.count("SELECT count(*) FROM writes WHERE row_id = 3") == 1  # its failure never written


def ingest_twice(svc: Services) -> None:
    """Two reads of every source, regardless of poll_seconds: the second one's rescan goes round the table."""
    from balancer.sources.ingest import ingest_source, quota_bursts
    from balancer.sources.store import all_sources

    with svc.engine.connect() as conn:
        definitions = all_sources(conn)
    for _ in range(2):
        for definition in definitions:
            ingest_source(svc, definition, quota_bursts(svc))


KEYED_SOURCE = """
[sources.keyed]
database_url_env = "LEGACY_DATABASE_URL"
table = "{table}"
key = "k"
prompt = "body"
where = "status = 'unsolved'"
answer = "answer"
status = "status"
"""


def keyed_source(legacy: Legacy, tmp_path: Path, capsys, rows: str) -> None:  # noqa: ANN001
    """The team's table ``keyed`` (a text key that may be NULL) holding ``rows`` (``(k, body)`` values),
    imported as source keyed."""
    legacy.execute("CREATE TABLE keyed (k text UNIQUE, body text, status text NOT NULL DEFAULT 'unsolved', answer text);"
                   f"INSERT INTO keyed (k, body) VALUES {rows}")
    path = tmp_path / "keyed.toml"
    path.write_text(KEYED_SOURCE.format(table=f"{legacy.schema}.keyed"))
    assert run(capsys, "source", "import", str(path))[0] == 0


def test_rows_with_a_null_key_or_an_empty_prompt_are_counted_with_their_reason(svc: Services, legacy: Legacy,
                                                                             tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 7: rows with a NULL key were never ingested, silently (and sent the cursor
    back to the start). They are counted per source with their reason, beside the rows that are
    not tasks for another reason (recorded before the cursor moves past them), in ``source list``,
    ``status``, ``top``, the metrics and the console's Sources page; the other rows are tasks."""
    keyed_source(legacy, tmp_path, capsys, "('a', 'first'), (NULL, 'no key'), (NULL, 'none either'), ('b', 'second'), ('c', '   ')")
    ingest_twice(svc)
    with svc.engine.connect() as conn:
        assert sorted(conn.execute(sa.select(tasks.c.key).where(tasks.c.source == "keyed")).scalars()) == ["a", "b"]
        assert conn.execute(sa.select(sources.c.position)).scalar_one() == "c"
    code, out, _ = run(capsys, "source", "list")
    assert code == 0 and "rows not tasks 3 (NULL key 2, empty prompt 1)" in out, out
    code, out, _ = run(capsys, "status", "--json")
    assert code == 0
    import json

    assert json.loads(out)["sources"][0]["not_tasks"] == {"NULL key": 2, "empty prompt": 1}
    shown = "3 (NULL key 2, empty prompt 1)"
    assert shown in top_sources_text(svc), top_sources_text(svc)
    from prometheus_client import CollectorRegistry, generate_latest

    from balancer.views.metrics import BalancerCollector

    registry = CollectorRegistry()
    registry.register(BalancerCollector(svc))
    text = generate_latest(registry).decode()
    assert 'balancer_source_rows_not_tasks{reason="NULL key",source="keyed"} 2.0' in text, text
    assert 'balancer_source_rows_not_tasks{reason="empty prompt",source="keyed"} 1.0' in text
    from balancer.web.app import environment
    from balancer.web.sampler import take_sample

    sample = take_sample(svc)  # the console's Sources page, rendered as the page renders it
    assert sample.not_tasks == {"keyed": {"NULL key": 2, "empty prompt": 1}}
    page = environment().get_template("_sources.html").render(sample=sample, sources=sample.sources, in_flight=0)
    assert "keyed: 3\n(NULL key 2, empty prompt 1)" in page, page


def test_a_row_not_a_task_that_is_deleted_or_stops_matching_where_is_no_longer_counted(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A probe: ``rows not tasks 2 (empty prompt 2)`` stayed after the team deleted both rows, and
    rows set to match ``where`` no more stayed counted too. Once a round of the rescan, the rows
    recorded are looked up again: those gone or not matching are forgotten, the others kept."""
    keyed_source(legacy, tmp_path, capsys, "('a', 'first'), ('b', ''), ('c', '   '), ('d', ' ')")
    recorded = sa.select(sa.text("key FROM source_rejects WHERE source = 'keyed' ORDER BY key"))
    ingest_twice(svc)
    with svc.engine.connect() as conn:
        assert list(conn.execute(recorded).scalars()) == ["b", "c", "d"]
    legacy.execute("DELETE FROM keyed WHERE k = 'b'; UPDATE keyed SET status = 'skipped' WHERE k = 'c'")
    ingest_twice(svc)  # the second read's rescan goes round the table
    with svc.engine.connect() as conn:
        assert list(conn.execute(recorded).scalars()) == ["d"]
    code, out, _ = run(capsys, "source", "list")
    assert code == 0 and "rows not tasks 1 (empty prompt 1)" in out, out


def test_a_row_with_a_long_key_recorded_as_not_a_task_is_forgotten_once_it_is_one(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A review: a key is recorded with its first 200 characters, but a row that became a task was
    forgotten by its whole key, so a longer key stayed counted as not a task for good."""
    key = "k" * 230
    keyed_source(legacy, tmp_path, capsys, f"('{key}', '')")
    recorded = sa.select(sa.text("key FROM source_rejects WHERE source = 'keyed'"))
    ingest_twice(svc)
    with svc.engine.connect() as conn:
        assert list(conn.execute(recorded).scalars()) == [key[:200]]
    legacy.execute(f"UPDATE keyed SET body = 'a prompt now' WHERE k = '{key}'")
    ingest_twice(svc)  # the rescan reads it again: a task now
    with svc.engine.connect() as conn:
        assert list(conn.execute(sa.select(tasks.c.key).where(tasks.c.source == "keyed")).scalars()) == [key]
        assert list(conn.execute(recorded).scalars()) == []


def top_sources_text(svc: Services) -> str:
    """``balancer top``'s table of sources, as it draws it."""
    from rich.console import Console

    from balancer.cli.pipeline import _source_table
    from balancer.sources.reads import source_status

    console = Console(width=200, record=True)
    console.print(_source_table(source_status(svc.engine), {}, {}, 1))
    return console.export_text()


def test_an_undecodable_prompt_fails_its_row_alone(service_urls, tmp_path: Path, capsys, monkeypatch,  # noqa: ANN001
                                                   svc: Services) -> None:
    """Issue 38 finding 7: a SQL_ASCII table holding a LATIN1 ``\\xe9`` failed the batch read on
    every tick, and the 11 rows after it were never ingested. That row is recorded with its
    reason, the cursor moves past it only with that record, and every other row is a task
    (a UTF-8 ``é`` in the same table included)."""
    with legacy_database(service_urls[1], encoding="SQL_ASCII") as url:
        team = sa.create_engine(url)
        try:
            monkeypatch.setenv("LEGACY_DATABASE_URL", url)
            with team.begin() as conn:
                conn.exec_driver_sql(
                    "CREATE TABLE prompts (id bigint PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT "
                    "'unsolved', answer text, solved_by text, error text, priority int);"
                    "INSERT INTO prompts (id, body) VALUES (1, 'plain'), "
                    "(2, convert_from('\\x6361666ee9'::bytea, 'SQL_ASCII')), "
                    "(3, convert_from('\\x636166c3a9'::bytea, 'SQL_ASCII'));"
                    "INSERT INTO prompts (id, body) SELECT g, 'later ' || g FROM generate_series(4, 14) g")
            assert import_legacy(tmp_path, capsys, "prompts", batch=40)[0] == 0
            ingest_twice(svc)
            with svc.engine.connect() as conn:
                keys = sorted(conn.execute(sa.select(tasks.c.key).where(tasks.c.source == "crm")).scalars(), key=int)
                assert keys == ["1", *map(str, range(3, 15))]
                assert conn.execute(sa.select(tasks.c.prompt).where(tasks.c.key == "3")).scalar_one() == "café"
                assert conn.execute(sa.select(sources.c.position)).scalar_one() == "14"
                assert conn.execute(sa.text("SELECT key, reason FROM source_rejects")).all() == [
                    ("2", "prompt is not valid UTF-8 text")]
            code, out, _ = run(capsys, "source", "list")
            assert "rows not tasks 1 (prompt is not valid UTF-8 text 1)" in out, out
        finally:
            team.dispose()


def _team_table(url: str, statement: str) -> None:
    team = sa.create_engine(url)
    try:
        with team.begin() as conn:
            conn.exec_driver_sql(statement)
    finally:
        team.dispose()


def _read_solved_written(svc: Services, tmp_path: Path, capsys, rows: int, answer: str) -> None:  # noqa: ANN001
    """Import table ``prompts`` of ``LEGACY_DATABASE_URL`` a row a read, read it to its end, answer
    every row with ``answer`` and write them back: each row one task, each written, none taken for
    changed or refused."""
    from balancer.sources.ingest import ingest_source, quota_bursts
    from balancer.sources.store import all_sources

    assert import_legacy(tmp_path, capsys, "prompts", batch=1)[0] == 0
    with svc.engine.connect() as conn:
        [definition] = all_sources(conn)
    for _ in range(rows):  # not waiting for poll_seconds
        ingest_source(svc, definition, quota_bursts(svc))
    assert solve_pending(svc, answer) == rows
    drained = drain(svc)
    assert (drained.written, drained.refused, drained.changed, drained.conflicts) == (rows, 0, 0, 0), drained


def test_a_sql_ascii_table_s_utf8_key_and_answer_are_read_and_written(service_urls, tmp_path: Path, capsys,  # noqa: ANN001
                                                                       monkeypatch, svc: Services) -> None:
    """A probe: a SQL_ASCII database was read through the driver's ASCII codec. A key ``clé``
    stopped the source's reads for good (the cursor stayed before it; 'z' was never read) and an
    answer ``réponse`` was refused ("'ascii' codec can't encode"). Its bytes are UTF-8 to us."""
    with legacy_database(service_urls[1], encoding="SQL_ASCII") as url:
        monkeypatch.setenv("LEGACY_DATABASE_URL", url)
        _team_table(url, "CREATE TABLE prompts (id text PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT "
                         "'unsolved', answer text, solved_by text, error text, priority int);"
                         "INSERT INTO prompts (id, body) VALUES ('a', 'one'), "
                         "(convert_from('\\x636cc3a9'::bytea, 'SQL_ASCII'), 'two'), ('z', 'three')")
        _read_solved_written(svc, tmp_path, capsys, 3, "réponse")
        team = sa.create_engine(url)
        try:
            with team.connect() as conn:
                assert conn.exec_driver_sql("SELECT count(*) FROM prompts WHERE convert_to(answer, 'SQL_ASCII') "
                                            "= '\\x72c3a9706f6e7365'::bytea").scalar_one() == 3
        finally:
            team.dispose()


def test_a_float_key_is_read_exactly_whatever_the_database_s_extra_float_digits(
        service_urls, tmp_path: Path, capsys, monkeypatch, svc: Services) -> None:  # noqa: ANN001
    """A probe: a database set to ``extra_float_digits = 0`` printed float8 keys in 15 digits, so
    a key read back named another row: the cursor stood still before 1.0000000000000002 (never
    read after it) and 0.1 + 0.2's write-back was taken for a row someone else changed."""
    with legacy_database(service_urls[1]) as url:
        monkeypatch.setenv("LEGACY_DATABASE_URL", url)
        database = sa.engine.make_url(url).database
        _team_table(url, f'ALTER DATABASE "{database}" SET extra_float_digits = 0;'
                         "CREATE TABLE prompts (id float8 PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT "
                         "'unsolved', answer text, solved_by text, error text, priority int);"
                         "INSERT INTO prompts (id, body) VALUES (0.1::float8 + 0.2::float8, 'a'), "
                         "(1.0000000000000002, 'b'), (1.0000000000000004, 'c'), (2, 'd')")
        _read_solved_written(svc, tmp_path, capsys, 4, "answer")


def test_a_removed_source_s_read_error_is_said_no_more(svc: Services, legacy: Legacy, tmp_path: Path,
                                                      capsys) -> None:  # noqa: ANN001
    """A tester dropped the team's table mid-run (`status`: "table unreadable"), then removed the
    source with --cancel: `status` and `top` still said its read error and left "the rows of source
    crm (its table could not be read)" out of the eta, even after a restart (its Redis entry was
    never cleared, and the displays took every name in it for a source). The removal clears it, and
    a read error is said only of a source still declared (a read that failed as it was removed
    notes its error after the removal)."""
    import json

    from balancer.sources.ingest import ingest_logged, quota_bursts
    from balancer.sources.read_errors import note_read_error
    from balancer.sources.store import all_sources
    from balancer.views.overview import read_overview

    legacy.add(3)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    legacy.execute("DROP TABLE prompts CASCADE")
    with svc.engine.connect() as conn:
        [definition] = all_sources(conn)
    assert ingest_logged(svc, definition, quota_bursts(svc)) is None
    code, out, _ = run(capsys, "status", "--json")
    assert code == 0 and [r["kind"] for r in json.loads(out)["health"]["sources"]["crm"]] == ["unreadable"], out
    assert run(capsys, "source", "remove", "crm", "--cancel")[0] == 0
    for _ in range(2):
        code, out, _ = run(capsys, "status", "--json")
        assert code == 0 and json.loads(out)["health"]["sources"] == {}, out
        code, out, _ = run(capsys, "status")
        assert code == 0 and "table unreadable" not in out and "could not be read" not in out, out
        assert read_overview(svc).health.sources == {}  # top's, the console's and the metrics' look
        note_read_error(svc.redis, svc.settings.namespace, "crm", 'relation "crm" does not exist')



def cancelled_rows(svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Four rows of source crm, their tasks cancelled; row 1's failure was written back before its
    task was retried, then cancelled."""
    legacy.add(4)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    with svc.engine.begin() as conn:
        conn.execute(sa.update(tasks).where(tasks.c.key == "1").values(status="failed", error="backend said no"))
    assert drain(svc).written == 1
    assert run(capsys, "tasks", "retry", "--source", "crm", "--yes")[1].startswith("retried 1 task(s)")
    code, out, _ = run(capsys, "tasks", "cancel", "--source", "crm", "--status", "pending", "--yes")
    assert code == 0 and out.startswith("cancelled 4 task(s)"), out


def test_cancelled_table_tasks_are_counted_per_source(svc: Services, legacy: Legacy, tmp_path: Path,
                                                      capsys) -> None:  # noqa: ANN001
    """A tester cancelled a table source's pending tasks: their rows stayed as they were, for ever,
    and nothing said why (`source list`: "pending 0, in flight 0, solved 0, failed 0"). The
    cancelled tasks are counted per source: `source list`, `status`, its --json, `top`."""
    cancelled_rows(svc, legacy, tmp_path, capsys)
    code, out, _ = run(capsys, "source", "list")
    assert code == 0 and "pending 0, in flight 0, solved 0, failed 0, cancelled 4, " in out, out
    code, out, _ = run(capsys, "status")
    assert code == 0 and "source crm: pending 0, in flight 0, solved 0, failed 0, cancelled 4, " in out, out
    code, out, _ = run(capsys, "status", "--json")
    assert code == 0 and json.loads(out)["sources"][0]["cancelled"] == 4
    top = top_sources_text(svc)
    assert "cancelled" in top and [line.replace("│", " ").split()[1:6] for line in top.splitlines() if "crm" in line] == [
        ["0", "0", "0", "0", "4"]], top


def test_a_retry_of_cancelled_table_tasks_asks_their_rows_again(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                capsys) -> None:  # noqa: ANN001
    """A tester's `tasks retry --status cancelled` of a table source's cancelled tasks said "retry
    acts on failed tasks only", and nothing else asks such a row again (its key is a task). It now
    sends them back to pending as a failed task's retry does (audited; a plain retry still takes
    the failed ones only, a cancel stands); answered, every row is written back, row 1 included,
    whose failure was written before its task was retried and cancelled."""
    cancelled_rows(svc, legacy, tmp_path, capsys)
    code, out, _ = run(capsys, "tasks", "retry", "--source", "crm", "--yes")
    assert code == 0 and out.startswith("retried 0 task(s)"), out
    code, out, _ = run(capsys, "tasks", "retry", "--source", "crm", "--status", "cancelled")
    assert code == 0 and out.startswith("would retry 4 task(s)"), out
    code, out, _ = run(capsys, "tasks", "retry", "--source", "crm", "--status", "cancelled", "--yes", "--by", "ops")
    assert code == 0 and out.startswith("retried 4 task(s)"), out
    assert counted(svc, tasks.c.source == "crm", tasks.c.status == "pending") == 4
    with svc.engine.connect() as conn:
        audit = conn.execute(sa.select(task_operations.c.done_by, task_operations.c.filter)
                             .where(task_operations.c.action == "retry").order_by(task_operations.c.id.desc())).first()
    assert audit is not None and audit.done_by == "ops" and audit.filter["status"] == "cancelled"
    assert solve_pending(svc) == 4
    drained = drain(svc)
    assert (drained.written, drained.conflicts) == (4, 0)
    assert legacy.count(SOLVED) == 4
