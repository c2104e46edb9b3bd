"""The write-back to the team's own table (issue 38): ``where`` checked as one
condition, one refused row failing alone with a terminal state, a fence on
every write-back, and the command for the rows left unwritable. Real
PostgreSQL: the team's table in a throwaway database (or schema) per test."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.services import Services
from balancer.sources.ingest import ingest_sources
from balancer.sources.read_errors import read_errors
from balancer.sources.schema import source_outbox, sources
from balancer.sources.writeback import ROW_LOCKED, drain
from balancer.storage.schema import tasks
from tests import legacy as legacy_fixtures
from tests.legacy import (
    LEGACY_TABLE,
    SOURCE_FILE,
    Legacy,
    add_rows,
    counts,
    import_legacy,
    legacy_database,
    legacy_schema,
    run,
    solve_pending,
)

# The team's table and balancer's services (tests/legacy.py).
svc, legacy_url, legacy = legacy_fixtures.svc, legacy_fixtures.legacy_url, legacy_fixtures.legacy


def source_file(tmp_path: Path, table: str, **changes: str) -> Path:
    """The legacy source file with some of its lines replaced (``field="value"``, as TOML)."""
    text = SOURCE_FILE.format(name="crm", env='database_url_env = "LEGACY_DATABASE_URL"\n', table=table, batch=100)
    lines = [f"{k} = {changes[k]}" if (k := line.split(" = ")[0]) in changes else line for line in text.splitlines()]
    path = tmp_path / "s.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


# -- finding 2: where is one condition --------------------------------------------------------

ESCAPING = "status = 'unsolved') OR (status = 'unsolved'"


@pytest.mark.parametrize("where, message", [
    (ESCAPING, "closes a parenthesis it did not open"),
    ("status = E'x\\\\') OR (status = ''", "closes a parenthesis it did not open"),
    ("nextval('{schema}.prompts_id_seq') > 0", "where cannot be evaluated, read only"),
    # A probe: on balancer's own database this sent balancer's next statements to the team's schema.
    ("status = 'unsolved' AND set_config('search_path', 'x', false) IS NOT NULL", "where calls set_config, a volatile"),
    ('"random"() < 2', "where calls random, a volatile"),
    # A probe: an operator hid its volatile function from the plan's names.
    ("status OPERATOR({schema}.===) 'unsolved'", "where calls operator ===, a volatile"),
])
def test_a_where_that_leaves_its_parentheses_or_is_not_one_side_effect_free_condition_is_refused_at_import(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys, where: str, message: str) -> None:  # noqa: ANN001
    """Issue 38 finding 2: ``status = 'unsolved') OR (status = 'unsolved'`` passed every
    import check and its write-back wrote one answer into every row. It is refused at
    ``source import`` in one line, as is a where whose parentheses only balance when a
    string literal is misread, and one with a side effect."""
    legacy.add(3)
    legacy.execute("CREATE FUNCTION same(a text, b text) RETURNS boolean LANGUAGE plpgsql VOLATILE AS "
                   "'BEGIN RETURN a = b; END';"
                   "CREATE OPERATOR === (FUNCTION = same, LEFTARG = text, RIGHTARG = text)")
    path = source_file(tmp_path, legacy.table, where=json.dumps(where.format(schema=legacy.schema)))
    code, _, err = run(capsys, "source", "import", str(path))
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sources)).scalar_one() == 0


def test_a_read_leaves_no_session_setting_its_where_changed_on_the_connection(legacy: Legacy) -> None:
    """Behind the import's refusal of a volatile ``where`` (above): a read's READ ONLY transaction
    is rolled back, so a ``set_config(..., false)`` a stored ``where`` ran goes with it; before, it
    stayed on the pooled connection balancer's own statements used next."""
    from balancer.sources.catalog import read_one
    from balancer.sources.definition import SourceDef
    from balancer.sources.window import count_null_keys, read_window

    legacy.add(2)
    hijack = "set_config('application_name', 'hijacked', false) IS NOT NULL"
    definition = SourceDef(name="crm", table=legacy.table, key="id", prompt="body", answer="answer", where=hijack)
    with legacy.engine.connect() as conn:
        def application_name() -> str:
            with conn.begin():
                return str(conn.exec_driver_sql("SHOW application_name").scalar_one())

        before = application_name()
        assert len(read_window(conn, definition, None, None, 10).rows) == 2
        assert application_name() == before != "hijacked"
        found = read_one(conn, definition, "1")
        assert found is not None and found.prompt == "legacy prompt 0"
        assert count_null_keys(conn, definition) == 0
        assert application_name() == before


def test_a_stored_where_that_leaves_its_parentheses_writes_into_no_other_row(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 2: a definition stored before the check (here written straight
    into ``sources``) is not used: its write-backs wait, and no row but its own is touched."""
    legacy.add(20)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc, limit=1) == 1
    with svc.engine.begin() as conn:
        conn.execute(sa.update(sources).values(definition=sources.c.definition + sa.func.jsonb_build_object(
            "where", ESCAPING)))
    drain(svc)
    assert legacy.count("SELECT count(*) FROM writes") == 0
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'unsolved' AND answer IS NULL") == 20


# -- finding 5: one refused row fails alone, and ends unwritable ---------------------------------

def outbox_states(svc: Services) -> dict[str, int]:
    with svc.engine.connect() as conn:
        return dict(conn.execute(sa.select(source_outbox.c.state, sa.func.count()).group_by(source_outbox.c.state)).all())


def drain_past_backoff(svc: Services, times: int) -> list:
    """``drain`` ``times`` times, each after the back-off of the last (a test does not wait it out)."""
    reports = []
    for _ in range(times):
        with svc.engine.begin() as conn:
            conn.execute(sa.update(source_outbox).values(next_attempt_at=sa.func.now()))
        reports.append(drain(svc))
    return reports


def test_a_check_refusing_ten_of_fifty_rows_leaves_forty_written_and_ten_unwritable_with_the_error(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 5: one UPDATE the team's table refuses rolled its whole batch back,
    for ever. Now the 40 writable rows are written by the first drain; each of the 10 a CHECK
    refuses fails alone, is tried again after a back-off, and after BALANCER_WRITEBACK_ATTEMPTS
    refusals is left ``unwritable`` with its error."""
    legacy.add(50)  # 'legacy prompt 0' .. 'legacy prompt 49'
    legacy.execute("ALTER TABLE prompts ADD CONSTRAINT no_three_nor_seven "
                   "CHECK (answer IS NULL OR right(answer, 1) NOT IN ('3', '7'))")
    assert import_legacy(tmp_path, capsys, legacy.table, batch=100)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 50
    with svc.engine.connect() as conn:
        before = conn.execute(sa.select(sa.func.now())).scalar_one()
    first = drain(svc)
    assert (first.written, first.refused, first.unwritable) == (40, 10, 0)
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'solved' AND answer = 'answer to ' || body") == 40
    assert outbox_states(svc) == {"waiting": 10}
    with svc.engine.connect() as conn:
        due = conn.execute(sa.select(sa.func.min(source_outbox.c.next_attempt_at))).scalar_one()
    assert (due - before).total_seconds() >= 1  # tried again after a back-off, not on the next pass
    later = drain_past_backoff(svc, svc.settings.writeback_attempts - 1)
    assert sum(r.written for r in later) == 0 and later[-1].unwritable == 10
    assert outbox_states(svc) == {"unwritable": 10}
    with svc.engine.connect() as conn:
        errors = conn.execute(sa.select(source_outbox.c.last_error, source_outbox.c.refusals)).all()
    assert all("no_three_nor_seven" in e and n == svc.settings.writeback_attempts for e, n in errors)
    assert drain_past_backoff(svc, 1)[0].refused == 0  # unwritable: not tried again
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'unsolved'") == 10


def test_a_varchar_20_answer_column_refuses_the_long_answers_alone(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 5: an answer longer than a ``varchar(20)`` fails its own row, not its batch
    (and a value for a ``char(10)`` column is written whole, never cut to its type's default length)."""
    legacy.execute("ALTER TABLE prompts ALTER COLUMN answer TYPE varchar(20), ALTER COLUMN status TYPE char(10); "
                   "INSERT INTO prompts (body) SELECT CASE WHEN mod(g, 5) = 0 THEN 'a much longer prompt ' || g "
                   "ELSE 'q' || g END FROM generate_series(1, 20) g")
    assert import_legacy(tmp_path, capsys, legacy.table, batch=100)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 20
    drained = drain(svc)
    assert (drained.written, drained.refused) == (16, 4)
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'solved' AND answer = 'answer to ' || body") == 16
    with svc.engine.connect() as conn:
        errors = conn.execute(sa.select(source_outbox.c.last_error)).scalars().all()
    assert len(errors) == 4 and all("character varying(20)" in e for e in errors)


def test_a_source_away_with_a_thousand_tries_neither_overflows_nor_stops_the_next_source(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Issue 38 finding 5: the back-off ``power(2, attempts)`` overflowed PostgreSQL's float8
    after about 1,024 tries, and then ``drain()`` raised for every source after it. A
    transient failure is retried without limit (never unwritable), with a capped back-off."""
    legacy.add(3)
    other = legacy_schema(legacy.engine)
    add_rows(legacy.engine, 4, table=f"{other}.prompts")
    monkeypatch.setenv("AWAY_DATABASE_URL", legacy.engine.url.render_as_string(hide_password=False))
    path = tmp_path / "two.toml"
    path.write_text(SOURCE_FILE.format(name="aaa", env='database_url_env = "AWAY_DATABASE_URL"\n',
                                       table=f"{other}.prompts", batch=100)
                    + SOURCE_FILE.format(name="crm", env='database_url_env = "LEGACY_DATABASE_URL"\n',
                                         table=legacy.table, batch=100))
    assert run(capsys, "source", "import", str(path))[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 7
    with svc.engine.begin() as conn:
        conn.execute(sa.update(source_outbox).where(source_outbox.c.source == "aaa").values(attempts=1_100))
    good = legacy.engine.url.render_as_string(hide_password=False)
    monkeypatch.setenv("AWAY_DATABASE_URL", good.replace(f"/{legacy.engine.url.database}", "/no_such_database_here"))
    drained = drain(svc)
    assert (drained.written, drained.retrying) == (3, 4)
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'solved'") == 3
    with svc.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT state, attempts, refusals, extract(epoch FROM next_attempt_at - now()) "
                                    "FROM source_outbox WHERE source = 'aaa'")).all()
    assert all(state == "waiting" and attempts == 1_101 and refusals == 0 and 30 < wait <= 60
               for state, attempts, refusals, wait in rows)


# -- finding 3: a fence on every write-back ----------------------------------------------------------

def test_a_prompt_the_team_edits_after_it_was_read_gets_its_new_answer_never_the_old_one(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 3: the write-back's guard was only ``where``: the team edited the prompt
    of 30 pending rows and all 30 got the old prompt's answer. Now each is counted as changed,
    not overwritten, and asked again with its new prompt, whose answer is written."""
    legacy.add(30)
    assert import_legacy(tmp_path, capsys, legacy.table, batch=100)[0] == 0
    ingest_sources(svc)
    legacy.execute("UPDATE prompts SET body = 'edited ' || body")
    assert solve_pending(svc) == 30  # answered from the prompts as read
    drained = drain(svc)
    assert (drained.written, drained.changed, drained.conflicts) == (0, 30, 0)
    assert legacy.count("SELECT count(*) FROM prompts WHERE answer IS NOT NULL OR status <> 'unsolved'") == 0
    with svc.engine.connect() as conn:
        asked = conn.execute(sa.select(tasks.c.status, tasks.c.prompt)).all()
    assert sorted(asked) == sorted(("pending", f"edited legacy prompt {i}") for i in range(30))
    assert solve_pending(svc) == 30
    assert drain(svc).written == 30
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'solved' "
                        "AND answer = 'answer to edited legacy prompt ' || id - 1") == 30
    code, out, _ = run(capsys, "status", "--json")
    assert json.loads(out)["sources"][0]["changed"] == 30
    from datetime import UTC, datetime, timedelta

    from balancer.backlog.retention import prune

    # Written after they were asked again: their write-backs ended, a prune may take them.
    assert prune(svc.engine, datetime.now(UTC) + timedelta(hours=1), by="test", apply=True) == 30


def test_an_answer_the_team_writes_into_a_row_while_its_call_runs_is_never_overwritten(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A probe: with ``where = "status = 'unsolved'"``, a person typed an answer (or a model's name,
    or an error) into a row whose call was running, leaving its status; the fence read only
    ``where`` and the prompt, and balancer's answer replaced theirs. Now the columns a write-back
    sets are part of the fence: those rows are not overwritten (counted so), the others are
    written (a retried task still replaces its own written failure:
    tests/sources/test_source_operations.py::test_retry_of_a_failed_source_task_writes_its_new_answer_back)."""
    legacy.add(6)
    assert import_legacy(tmp_path, capsys, legacy.table, batch=100)[0] == 0
    ingest_sources(svc)
    legacy.execute("UPDATE prompts SET answer = 'a person''s answer' WHERE id = 1")
    legacy.execute("UPDATE prompts SET solved_by = 'a person' WHERE id = 2")
    legacy.execute("UPDATE prompts SET error = '' WHERE id = 3")  # an empty string is not the NULL read
    assert solve_pending(svc) == 6
    drained = drain(svc)
    assert (drained.written, drained.conflicts, drained.changed) == (3, 3, 0)
    assert legacy.count("SELECT count(*) FROM prompts WHERE id = 1 AND answer = 'a person''s answer' "
                        "AND status = 'unsolved'") == 1
    assert legacy.count("SELECT count(*) FROM prompts WHERE id IN (2, 3) AND answer IS NULL") == 2
    assert legacy.count("SELECT count(*) FROM prompts WHERE id > 3 AND status = 'solved'") == 3
    code, out, _ = run(capsys, "status", "--json")
    assert json.loads(out)["sources"][0]["conflicts"] == 3


def test_a_row_the_team_holds_locked_waits_alone_and_the_rest_of_its_batch_is_written(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A probe: the team held one row ``FOR UPDATE`` for 150 s; every write-back of its batch
    (another row never locked among them) waited on it, seven lock timeouts in a row. Now the
    rows another transaction holds are skipped (``SKIP LOCKED``) and tried again later, saying
    why; the others are written at once."""
    legacy.add(6)
    assert import_legacy(tmp_path, capsys, legacy.table, batch=100)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 6
    with legacy.engine.connect() as holder:
        holder.exec_driver_sql(f"SELECT 1 FROM {legacy.table} WHERE id = 3 FOR UPDATE")  # held until rolled back
        drained = drain(svc)
        assert (drained.written, drained.retrying) == (5, 1)
        with svc.engine.connect() as conn:
            waiting = conn.execute(sa.select(source_outbox.c.state, source_outbox.c.last_error)).all()
        assert [tuple(w) for w in waiting] == [("waiting", ROW_LOCKED)]
        assert ROW_LOCKED.startswith("its row could not be locked: another transaction holds it")
        holder.rollback()
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'solved'") == 5
    deadline = time.monotonic() + 30
    while legacy.count("SELECT count(*) FROM prompts WHERE id = 3 AND status = 'solved'") == 0:
        assert time.monotonic() < deadline, "the locked row was never written once let go"
        drain(svc)  # its back-off: a second
        time.sleep(0.1)


def test_a_column_renamed_after_the_import_is_named_in_the_write_back_error(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A probe: with the answer column renamed, every write-back failed with the error text
    ``'answer'`` (a KeyError's), shown as "will retry: 'answer'". It names the column now."""
    legacy.add(2)
    assert import_legacy(tmp_path, capsys, legacy.table, batch=100)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 2
    legacy.execute("ALTER TABLE prompts RENAME COLUMN answer TO answer_text")
    assert drain(svc).retrying == 2
    with svc.engine.connect() as conn:
        errors = set(conn.execute(sa.select(source_outbox.c.last_error)).scalars())
    assert errors == {f"column(s) answer (answer) of {legacy.table} are gone (renamed or dropped since the "
                      "source's import)"}, errors


def test_source_rows_names_each_row_without_an_answer_and_why(svc: Services, legacy: Legacy, tmp_path: Path,
                                                              capsys) -> None:  # noqa: ANN001
    """A probe: status and source list count the rows that are not tasks, not overwritten or
    waiting, but nothing named them. ``source rows NAME`` lists each by its key, with its reason."""
    legacy.add(4)
    legacy.execute("INSERT INTO prompts (id, body) VALUES (100, '   ')")
    assert import_legacy(tmp_path, capsys, legacy.table, batch=100)[0] == 0
    ingest_sources(svc)
    with svc.engine.begin() as conn:
        conn.execute(sa.update(tasks).where(tasks.c.key == "2").values(status="cancelled"))
    assert solve_pending(svc) == 3
    legacy.execute("UPDATE prompts SET status = 'closed by hand' WHERE id = 3")
    assert drain(svc).conflicts == 1
    code, out, _ = run(capsys, "source", "rows", "crm")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "key 100: not a task: empty prompt", out
    assert lines[1].startswith("key 2 (balancer task ") and "cancelled by an operator: `balancer tasks retry " \
        "--status cancelled --source crm` asks it again" in lines[1], out
    assert lines[2].startswith("key 3 (balancer task ") and "write-back not overwritten" in lines[2], out
    assert lines[3:] == ["crm: 3 row(s) without balancer's answer"], out
    code, out, _ = run(capsys, "source", "rows", "crm", "--json", "--limit", "1")
    assert code == 0 and [r["key"] for r in json.loads(out)] == ["100"]
    code, _, err = run(capsys, "source", "rows", "nope")
    assert code == 2 and err == "error: no source 'nope' (balancer source list)\n"


def scrape(svc: Services) -> str:
    """What ``balancer metrics`` serves now, in Prometheus' text format."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from balancer.views.metrics import BalancerCollector

    registry = CollectorRegistry()
    registry.register(BalancerCollector(svc))
    return generate_latest(registry).decode()


def written_then_reopened(svc: Services, legacy: Legacy, tmp_path: Path, capsys, rows: int,  # noqa: ANN001
                          body: str) -> None:
    """``rows`` rows answered and written back; then the team re-opens row 2 with the prompt ``body`` (SQL)."""
    legacy.add(rows)
    assert import_legacy(tmp_path, capsys, legacy.table, batch=100)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == rows
    assert drain(svc).written == rows
    legacy.execute(f"UPDATE prompts SET status = 'unsolved', answer = NULL, body = {body} WHERE id = 2")


def test_a_row_the_team_reopens_after_it_was_written_is_asked_again(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 3 (and 7): a row re-opened by the team (set back to match ``where``)
    after its answer was written was never asked again. The read behind the cursor finds it,
    reads it once more, and asks it again with its prompt as it is now."""
    written_then_reopened(svc, legacy, tmp_path, capsys, 5, body="'try again'")
    deadline = time.monotonic() + 30
    while counts(svc.engine, "SELECT count(*) FROM tasks WHERE status = 'pending'") == 0 and time.monotonic() < deadline:
        time.sleep(0.1)  # poll_seconds
        ingest_sources(svc)
    with svc.engine.connect() as conn:
        pending = conn.execute(sa.select(tasks.c.key, tasks.c.prompt).where(tasks.c.status == "pending")).all()
    assert [tuple(p) for p in pending] == [("2", "try again")]
    for _ in range(3):  # read again and again: asked once
        time.sleep(0.1)
        ingest_sources(svc)
    assert solve_pending(svc) == 1
    assert drain(svc).written == 1
    assert legacy.count("SELECT count(*) FROM prompts WHERE id = 2 AND status = 'solved' AND answer = 'answer to try again'") == 1
    for _ in range(3):  # written again: not asked a third time
        time.sleep(0.1)
        ingest_sources(svc)
    assert counts(svc.engine, "SELECT count(*) FROM tasks WHERE status <> 'solved'") == 0


def test_a_reopened_row_whose_prompt_is_no_task_is_said_once_and_named_in_source_rows(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys, caplog) -> None:  # noqa: ANN001
    """A probe: a written row the team re-opened with an empty prompt was not asked again (right),
    but the warning came at every rescan, and nothing else said it. Now it is a row that is not a
    task (`source rows`, the not-tasks counts), said once, and asked again once its prompt is one."""
    written_then_reopened(svc, legacy, tmp_path, capsys, 3, body="''")

    def rows() -> list[dict]:
        code, out, _ = run(capsys, "source", "rows", "crm", "--json")
        assert code == 0, out
        return json.loads(out)

    with caplog.at_level(logging.WARNING, logger="balancer.sources"):
        deadline = time.monotonic() + 30
        while not rows():
            assert time.monotonic() < deadline, "the re-opened row was never read again"
            time.sleep(0.1)  # poll_seconds
            ingest_sources(svc)
        for _ in range(4):  # read again at each rescan: said once
            time.sleep(0.1)
            ingest_sources(svc)
    said = [r.getMessage() for r in caplog.records if "row '2'" in r.getMessage()]
    assert said == ["source crm: row '2' is not a task: empty prompt"], said  # the read's own record, once
    assert [(r["key"], r["why"]) for r in rows()] == [("2", "not a task: empty prompt")]

    legacy.execute("UPDATE prompts SET body = 'fixed' WHERE id = 2")
    deadline = time.monotonic() + 30
    while counts(svc.engine, "SELECT count(*) FROM tasks WHERE status = 'pending'") == 0:
        assert time.monotonic() < deadline, "the fixed row was never asked again"
        time.sleep(0.1)
        ingest_sources(svc)
    assert rows() == []  # a task again: no longer counted as not one


# -- deliverable 4: the unwritable ones, shown and settled ---------------------------------------------

def test_unwritable_write_backs_are_shown_per_source_with_their_error_and_written_again_or_dropped(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 5 (deliverable 4): the rows left unwritable show per source, with the last
    error, in ``status``, ``top`` and the console (the source's health), and the metrics;
    ``balancer source unwritable NAME`` lists them, ``--retry`` writes them once the cause is
    fixed, ``--drop`` gives them up; both audited."""
    from balancer.cli.pipeline import health_lines
    from balancer.storage.schema import source_changes
    from balancer.views.overview import read_overview
    from balancer.web.sampler import take_sample

    legacy.add(10)  # 'legacy prompt 0' .. 'legacy prompt 9': 3 and 7 refused
    legacy.execute("ALTER TABLE prompts ADD CONSTRAINT no_three_nor_seven "
                   "CHECK (answer IS NULL OR right(answer, 1) NOT IN ('3', '7'))")
    assert import_legacy(tmp_path, capsys, legacy.table, batch=100)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 10
    drain_past_backoff(svc, svc.settings.writeback_attempts)
    code, out, _ = run(capsys, "source", "unwritable", "crm")
    lines = out.strip().splitlines()
    assert code == 0 and len(lines) == 3 and all("no_three_nor_seven" in line for line in lines[:2])
    refused = {legacy.count(f"SELECT id FROM prompts WHERE body = 'legacy prompt {n}'") for n in (3, 7)}
    keys = {int(line.removeprefix("key ").split()[0]) for line in lines[:2] if line.startswith("key ")}
    assert keys == refused, lines  # each row first by the team's table's key (balancer's task ids have gaps)
    assert lines[-1].startswith("crm: 2 unwritable write-back(s)")
    code, out, _ = run(capsys, "status", "--json")
    [crm] = json.loads(out)["sources"]
    assert crm["unwritable"] == 2 and "no_three_nor_seven" in crm["unwritable_error"] and crm["writebacks_waiting"] == 0
    code, out, _ = run(capsys, "status")
    assert "unwritable 2 (last: new row for relation" in out
    [line] = [line for line in health_lines(read_overview(svc).health) if line.startswith("health source crm")]  # top
    assert "2 write-back(s) refused by its table" in line and "no_three_nor_seven" in line
    why = take_sample(svc).health.sources["crm"]  # the console's Sources page
    assert [r.kind for r in why] == ["unwritable"] and "no_three_nor_seven" in why[0].text
    text = scrape(svc)
    assert 'balancer_source_unwritable{source="crm"} 2.0' in text
    assert 'balancer_source_health{reason="unwritable",source="crm"} 1.0' in text

    legacy.execute("ALTER TABLE prompts DROP CONSTRAINT no_three_nor_seven")  # the cause fixed
    code, out, _ = run(capsys, "source", "unwritable", "crm", "--retry", "--by", "ops")
    assert code == 0 and "2 unwritable write-back(s) waiting to be written again" in out
    assert drain(svc).written == 2
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'solved'") == 10
    code, out, _ = run(capsys, "source", "unwritable", "crm")
    assert out.strip() == "crm: 0 unwritable write-back(s)"

    legacy.add(1, 13)  # 'legacy prompt 13': refused by a new constraint, then dropped
    legacy.execute("ALTER TABLE prompts ADD CONSTRAINT no_13 CHECK (answer IS NULL OR right(answer, 2) <> '13')")
    # One read, one task; a read that failed says why (its error is kept for the displays).
    made = [(r.source, r.created) for r in ingest_sources(svc)]
    assert made == [("crm", 1)], (made, read_errors(svc.redis, svc.settings.namespace))
    assert solve_pending(svc) == 1
    drain_past_backoff(svc, svc.settings.writeback_attempts)
    code, out, _ = run(capsys, "source", "unwritable", "crm", "--drop", "--by", "ops")
    assert code == 0 and "1 unwritable write-back(s) dropped" in out
    for _ in range(3):  # its row still matches where: it is not asked again
        time.sleep(0.1)
        ingest_sources(svc)
    assert counts(svc.engine, "SELECT count(*) FROM tasks WHERE status <> 'solved'") == 0
    code, out, _ = run(capsys, "status", "--json")
    assert json.loads(out)["sources"][0]["unwritable"] == 0
    with svc.engine.connect() as conn:
        audit = conn.execute(sa.select(source_changes.c.action, source_changes.c.changed_by, source_changes.c.new_value)
                             .where(source_changes.c.action.like("% unwritable")).order_by(source_changes.c.id)).all()
    assert [(a, by, len(v["task_ids"])) for a, by, v in audit] == [("retry unwritable", "ops", 2),
                                                                   ("drop unwritable", "ops", 1)]
    code, _, err = run(capsys, "source", "unwritable", "nope")
    assert code == 2 and "no source 'nope'" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "source", "unwritable", "crm", "--retry", "--drop")
    assert code == 2 and "not both" in err


def test_a_latin1_table_refuses_an_emoji_alone_and_its_accented_prompts_are_not_taken_for_changed(
        svc: Services, service_urls, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Issue 38 finding 5: an answer a LATIN1 column cannot hold (an emoji) failed its whole batch.
    It fails alone; and the fence reads an accented LATIN1 prompt as the one it read (md5 over
    UTF-8 on both sides), so no row is taken for changed."""
    with legacy_database(service_urls[1], encoding="LATIN1") as url:
        team = sa.create_engine(url)
        try:
            with team.begin() as conn:
                conn.connection.cursor().execute(LEGACY_TABLE)
                conn.exec_driver_sql("INSERT INTO prompts (body) SELECT 'café crème ' || g FROM generate_series(1, 6) g")
            monkeypatch.setenv("LEGACY_DATABASE_URL", url)
            assert import_legacy(tmp_path, capsys, "prompts", batch=100)[0] == 0
            ingest_sources(svc)
            assert solve_pending(svc) == 6
            with svc.engine.begin() as conn:
                conn.execute(sa.update(tasks).where(tasks.c.key == "4").values(answer="answer with an emoji \N{GRINNING FACE}"))
            drained = drain(svc)
            assert (drained.written, drained.refused, drained.changed, drained.conflicts) == (5, 1, 0, 0)
            with team.connect() as conn:
                assert conn.exec_driver_sql("SELECT count(*) FROM prompts WHERE status = 'solved' "
                                            "AND answer = 'answer to ' || body").scalar_one() == 5
            with svc.engine.connect() as conn:
                [error] = conn.execute(sa.select(source_outbox.c.last_error)).scalars().all()
            assert "latin" in error.lower()
        finally:
            team.dispose()


def test_write_backs_that_keep_failing_are_said_in_status_source_list_and_tasks_show(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A tester renamed the team's answer column mid-run (or revoked UPDATE): every write-back
    failed and was retried, and only the dispatcher's log said so (`status`: "eta: done", no
    health line; `source list`: "write-backs waiting 4", no reason). Now the source's health says
    how many fail and the last error (`status`, its --json, `top`), the ETA is no longer "done"
    until they are written, `source list` says the error
    beside them, and `tasks show` of an ended table task says where its write-back stands: waiting
    (failed n times, the last error), written, not overwritten; after its row was re-opened and
    asked again, the new end's (not the first end's "not overwritten")."""
    from balancer.sources.ingest import ingest_source, quota_bursts
    from balancer.sources.store import all_sources
    from balancer.views.overview import read_overview

    legacy.add(4)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 4
    with svc.engine.connect() as conn:
        ids = dict(conn.execute(sa.select(tasks.c.key, tasks.c.id).where(tasks.c.source == "crm")).all())
    legacy.execute("ALTER TABLE prompts RENAME COLUMN answer TO reply")
    assert drain(svc).retrying == 4
    code, out, _ = run(capsys, "status", "--json")
    [reason] = json.loads(out)["health"]["sources"]["crm"]
    assert reason["kind"] == "writeback_failing" and reason["text"].startswith("4 write-back(s) failing, retried: "), out
    assert "answer" in reason["text"], reason  # (the column's name: the error is the write-back's own)
    code, out, _ = run(capsys, "status")
    assert code == 0 and "health source crm: 4 write-back(s) failing, retried: " in out, out
    assert "eta: nothing else to run; the answers of source crm wait to be written back (failing" in out, out
    assert [r.kind for r in read_overview(svc).health.sources["crm"]] == ["writeback_failing"]  # top's look
    assert 'balancer_source_writebacks_failing{source="crm"} 4.0' in scrape(svc)
    code, out, _ = run(capsys, "source", "list")
    assert code == 0 and "write-backs waiting 4 (4 failing, retried; last: " in out, out
    code, out, _ = run(capsys, "tasks", "show", str(ids["1"]))
    assert code == 0 and "write-back: waiting: failed 1 time(s), retried; last: " in out, out
    code, out, _ = run(capsys, "tasks", "show", str(ids["1"]), "--json")
    shown = json.loads(out)["writeback"]
    assert (shown["state"], shown["attempts"]) == ("waiting", 1) and "answer" in shown["last_error"], shown

    legacy.execute("ALTER TABLE prompts RENAME COLUMN reply TO answer; UPDATE prompts SET status = 'done' WHERE id = 2")
    with svc.engine.begin() as conn:  # the back-off over
        conn.execute(sa.update(source_outbox).values(next_attempt_at=sa.func.now()))
    drained = drain(svc)
    assert (drained.written, drained.conflicts) == (3, 1)
    code, out, _ = run(capsys, "status", "--json")
    assert "crm" not in json.loads(out)["health"]["sources"], out
    code, out, _ = run(capsys, "status")
    assert "eta: done" in out, out
    code, out, _ = run(capsys, "tasks", "show", str(ids["1"]))
    assert "write-back: written" in out, out
    code, out, _ = run(capsys, "tasks", "show", str(ids["2"]), "--json")
    assert json.loads(out)["writeback"]["state"] == "conflict"
    code, out, _ = run(capsys, "tasks", "show", str(ids["2"]))
    assert "write-back: not overwritten: " in out, out

    legacy.execute("UPDATE prompts SET status = 'unsolved' WHERE id = 2")  # re-opened: asked again, written
    with svc.engine.connect() as conn:
        [definition] = all_sources(conn)
    for _ in range(2):  # the second read's rescan goes round the table
        ingest_source(svc, definition, quota_bursts(svc))
    with svc.engine.begin() as conn:  # solved as the solve path does (solved_at set)
        assert conn.execute(sa.update(tasks).where(tasks.c.status == "pending").values(
            status="solved", answer="again", model="a", solved_at=sa.func.now())).rowcount == 1
    assert drain(svc).written == 1
    code, out, _ = run(capsys, "tasks", "show", str(ids["2"]), "--json")
    assert json.loads(out)["writeback"]["state"] == "written", out
