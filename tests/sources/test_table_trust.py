"""The team's table, trusted (issue 38): only a source's own rows reach its table,
one table is one source, an unstorable answer fails alone, size limits with
one-line errors, and an export that never skips a row. Real PostgreSQL (a
throwaway "legacy" database for the team's table), real processes."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.services import Services
from balancer.sources.ingest import ingest_sources
from balancer.sources.schema import source_outbox, sources
from balancer.sources.writeback import drain
from balancer.storage.schema import tasks
from tests import legacy as legacy_fixtures
from tests.legacy import SOURCE_FILE, Legacy, import_legacy, legacy_schema, run, solve_pending

# The team's table and balancer's services (tests/legacy.py).
svc, legacy_url, legacy = legacy_fixtures.svc, legacy_fixtures.legacy_url, legacy_fixtures.legacy


def exportable(svc: Services, count: int) -> None:
    """Wait until ``count`` ended tasks are past every open transaction (another session's
    open transaction holds the export's horizon back)."""
    from balancer.backlog.results import START, page, parse_cursor

    deadline = time.monotonic() + 30
    while len(page(svc.engine, parse_cursor(START), source=None, size=count + 1)[0]) < count:
        assert time.monotonic() < deadline, "the ended tasks never became exportable"
        time.sleep(0.1)


# -- finding 8: export --------------------------------------------------------------------

def test_an_export_interrupted_mid_page_resumes_with_no_row_skipped(svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 8: Ctrl-C while a page is being written printed the cursor
    past the whole page, so resuming skipped the rows not yet written. Now the
    cursor printed is that of the last row written and flushed: an export killed
    (SIGINT) mid-page and resumed from its cursor gives every row, none twice."""
    count = 2500  # three pages of 1000; a page is ~300 KB, far more than a pipe holds
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"p{i} " + "x" * 200, "key": f"k{i}"}) + "\n" for i in range(count)))
    assert run(capsys, "submit", str(jsonl))[0] == 0
    assert solve_pending(svc) == count
    exportable(svc, count)
    export = subprocess.Popen([sys.executable, "-m", "balancer", "results", "export"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=os.environ.copy())
    try:
        assert export.stdout is not None
        first = [export.stdout.readline() for _ in range(50)]  # the export now waits on the full pipe, mid-page
        export.send_signal(signal.SIGINT)
        rest = export.stdout.read()  # (through the same buffer as the lines above: communicate() would skip it)
        assert export.stderr is not None
        err = export.stderr.read()
        export.wait(60)
    finally:
        if export.poll() is None:
            export.kill()
    lines = [line for line in b"".join(first).decode().splitlines() + rest.decode().splitlines() if line]
    assert 50 <= len(lines) < count, "the export was not interrupted mid-way"
    cursor = err.decode().strip().splitlines()[-1]
    assert cursor.startswith("cursor: "), err
    code, resumed, _ = run(capsys, "results", "export", "--since", cursor.split()[-1])
    assert code == 0
    keys = [json.loads(line)["key"] for line in lines + resumed.splitlines()]
    assert len(keys) == count and set(keys) == {f"k{i}" for i in range(count)}  # no row skipped, none twice


def test_csv_cells_are_escaped_against_formula_injection(svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 8: a CSV cell starting with '=' was written raw, so a spreadsheet
    ran it as a formula. Cells starting with = + - @ (or a tab or CR) now start with '."""
    hostile = ["=HYPERLINK(\"http://x\",\"y\")", "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": value, "key": f"k{i}"}) + "\n" for i, value in enumerate(hostile))
                     + json.dumps({"prompt": "a=b", "key": "-7"}) + "\n")
    assert run(capsys, "submit", str(jsonl))[0] == 0
    assert solve_pending(svc, answer="=1+2") == len(hostile) + 1
    exportable(svc, len(hostile) + 1)
    code, out, _ = run(capsys, "results", "export", "--format", "csv", "--prompt")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out, newline="")))
    assert sorted(r["prompt"] for r in rows) == sorted(["'" + v for v in hostile] + ["a=b"])
    assert {r["answer"] for r in rows} == {"'=1+2"} and "'-7" in {r["key"] for r in rows}
    assert not [r for r in rows if r["id"].startswith("'") or r["prompt_tokens"].startswith("'")]  # numbers as they are
    code, out, _ = run(capsys, "results", "export")  # JSONL is data, not a sheet: written as stored
    assert code == 0 and {json.loads(line)["answer"] for line in out.splitlines()} == {"=1+2"}


# -- finding 1: only a source's own rows reach its table ------------------------------------

def test_a_jsonl_line_under_a_table_source_s_name_cannot_take_its_row(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 1: a JSONL line {"source": "crm", "key": "480"} submitted before
    row 480 existed took the row: its answer was written there and the row's own prompt
    was never asked. Now the line is refused (a per-line error naming the source), in
    `balancer submit` and in the inbox, and row 480's own prompt is asked and written."""
    from balancer.sources.inbox import ingest_inbox

    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    legacy.add(3)
    jsonl = tmp_path / "hijack.jsonl"
    jsonl.write_text(json.dumps({"source": "crm", "key": "480", "prompt": "hijack"}) + "\n"
                     + json.dumps({"source": "other", "key": "480", "prompt": "mine"}) + "\n")
    code, out, err = run(capsys, "submit", str(jsonl))
    assert code == 3 and "accepted 1 task(s)" in out, (out, err)
    assert "hijack.jsonl:line 1: source 'crm' is a table source" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "submit", str(jsonl), "--source", "crm")
    assert code == 2 and "--source: source 'crm' is a table source" in err
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "late.jsonl").write_text(json.dumps({"source": "crm", "key": "481", "prompt": "hijack"}) + "\n"
                                      + json.dumps({"prompt": "fine"}) + "\n")
    os.utime(inbox / "late.jsonl", (time.time() - 10, time.time() - 10))
    [report] = ingest_inbox(svc, inbox)
    assert (report.tasks, report.errors) == (1, 1)
    assert "source 'crm' is a table source" in (inbox / "done" / "late.jsonl.errors").read_text()
    legacy.execute("INSERT INTO prompts (id, body) VALUES (480, 'the row''s own prompt'), (481, 'row 481')")
    ingest_sources(svc)
    assert solve_pending(svc) == 3 + 2 + 1 + 1  # the three rows, 480 and 481, "other"'s and the inbox's line
    assert drain(svc).written == 5
    assert legacy.count("SELECT count(*) FROM prompts WHERE id = 480 AND answer = 'answer to the row''s own prompt'") == 1
    assert legacy.count("SELECT count(*) FROM prompts WHERE id = 481 AND answer = 'answer to row 481'") == 1
    assert legacy.count("SELECT count(*) FROM writes") == 5
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(tasks.c.prompt == "hijack")).scalar_one() == 0


def test_a_name_tasks_were_submitted_under_is_refused_as_a_new_table_source(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 1: tasks submitted under a name before a table source took it
    would share its keys (and take its rows' answers); such a name is refused at import."""
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(json.dumps({"source": "crm", "key": "1", "prompt": "early"}) + "\n")
    assert run(capsys, "submit", str(jsonl))[0] == 0
    code, _, err = import_legacy(tmp_path, capsys, legacy.table)
    assert code == 2 and "sources.crm: tasks were submitted under the name crm" in err
    assert len(err.strip().splitlines()) == 1
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sources)).scalar_one() == 0


def test_only_the_rows_a_source_ingested_are_written_back(svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 1: the outbox trigger queued a write-back for any keyed task whose
    source is declared; now only for the tasks its ingest inserted (``from_table``)."""
    schema = legacy_schema(svc.engine)
    own = Legacy(svc.engine, schema)
    own.add(2)
    assert import_legacy(tmp_path, capsys, f"{schema}.prompts", env=False, name="own")[0] == 0
    ingest_sources(svc)
    with svc.engine.begin() as conn:  # a keyed task under its name that its ingest did not insert
        conn.execute(sa.insert(tasks).values(source="own", key="7", prompt="not a row's", max_tokens=5,
                                             estimated_tokens=6))
    own.execute("INSERT INTO prompts (id, body) VALUES (7, 'row 7')")
    assert solve_pending(svc) == 3
    assert drain(svc).written == 2
    assert own.count("SELECT count(*) FROM prompts WHERE id = 7 AND answer IS NULL") == 1


# -- finding 4: one table is one source ------------------------------------------------------

def _import(tmp_path: Path, capsys, name: str, table: str, *, env: bool = True,  # noqa: ANN001
            without: tuple[str, ...] = (), **fields: str) -> tuple[int, str, str]:
    """SOURCE_FILE's source ``name`` on ``table``, with ``fields`` in place of its own and the
    optional fields ``without`` left out."""
    text = SOURCE_FILE.format(name=name, env='database_url_env = "LEGACY_DATABASE_URL"\n' if env else "",
                              table=table, batch=10)
    text = "\n".join(line for line in text.splitlines() if not line.startswith(tuple(f"{k} = " for k in without)))
    for key, value in fields.items():
        text = "\n".join(f"{key} = {value}" if line.startswith(f"{key} = ") else line for line in text.splitlines())
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return run(capsys, "source", "import", str(path))


def test_one_table_is_one_source_whatever_its_spelling(svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 4: ``s3`` and ``public.s3`` were accepted as two sources (every row
    paid twice), and so was a view over a source's table. Both are refused, naming the first."""
    table = "s3_" + legacy.schema.removeprefix("legacy_")
    legacy.execute(f"CREATE TABLE public.{table} (LIKE prompts INCLUDING ALL)")
    legacy.execute(f"CREATE VIEW open_prompts AS SELECT id, body, status, answer, solved_by, error, priority "
                   f"FROM public.{table} WHERE priority IS NOT NULL")
    try:
        assert _import(tmp_path, capsys, "s3", table)[0] == 0
        code, _, err = _import(tmp_path, capsys, "s3b", f"public.{table}")
        assert code == 2 and f"sources s3 and s3b read the same table public.{table}" in err, err
        assert len(err.strip().splitlines()) == 1
        code, _, err = _import(tmp_path, capsys, "s3v", f"{legacy.schema}.open_prompts")
        assert code == 2 and "sources s3 and s3v read the same table" in err, err
        code, _, err = _import(tmp_path, capsys, "s3", f"public.{table}")  # the same source, respelled: fine
        assert code == 0, err
        with svc.engine.connect() as conn:
            assert conn.execute(sa.select(sources.c.name)).scalars().all() == ["s3"]
    finally:
        legacy.execute(f"DROP TABLE public.{table} CASCADE")


def test_a_view_is_a_source_only_when_its_key_is_a_unique_column_of_the_one_table_it_reads(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 4: a view with a duplicate key was accepted, and gave the second
    row the first row's answer. A view is refused unless it reads one table and its key
    is a column of that table with a unique index."""
    columns = "id, body, status, answer, solved_by, error, priority"
    legacy.execute(f"CREATE TABLE others (LIKE prompts INCLUDING ALL);"
                   f"CREATE VIEW doubled AS SELECT {columns} FROM prompts UNION ALL SELECT {columns} FROM others;"
                   f"CREATE VIEW twice AS SELECT {columns} FROM prompts UNION ALL SELECT {columns} FROM prompts;"
                   f"CREATE VIEW renamed AS SELECT priority AS id, body, status, answer, solved_by, error, priority "
                   f"FROM prompts;"
                   f"CREATE VIEW plain AS SELECT {columns} FROM prompts WHERE body <> '';"
                   f"CREATE VIEW open_only AS SELECT {columns} FROM prompts WHERE status = 'unsolved' WITH CHECK OPTION")
    for view, message in (("doubled", "reads 2 tables"), ("twice", "is not a column of"),
                          ("renamed", "is not a column of")):
        code, _, err = _import(tmp_path, capsys, "v", f"{legacy.schema}.{view}")
        assert code == 2 and message in err, (view, err)
        assert len(err.strip().splitlines()) == 1
    code, out, _ = _import(tmp_path, capsys, "v", f"{legacy.schema}.plain")
    assert code == 0 and "WITH CHECK OPTION" not in out
    # A probe: a view WITH CHECK OPTION over the open rows refused each write-back (unwritable): said at import.
    code, out, _ = _import(tmp_path, capsys, "v", f"{legacy.schema}.open_only")  # (its table is source v's)
    assert code == 0 and "note: sources.v: view" in out and "has WITH CHECK OPTION: a written row must" in out, out


def test_a_bytea_prompt_or_a_table_others_inherit_from_is_refused(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                   capsys) -> None:  # noqa: ANN001
    """A probe: one task wrote two rows, in a parent table and in a child holding the same key
    (its primary key is the parent's alone): refused at import; a partitioned table, whose key is
    unique across its partitions, is not. A bytea prompt went out as hex: refused."""
    columns = "id bigint, body text NOT NULL, status text, answer text, solved_by text, error text, priority int"
    legacy.execute(f"CREATE TABLE parent ({columns}, PRIMARY KEY (id));"
                   "CREATE TABLE child (PRIMARY KEY (id)) INHERITS (parent);"
                   f"CREATE TABLE parted ({columns}, PRIMARY KEY (id)) PARTITION BY RANGE (id);"
                   "CREATE TABLE parted_all PARTITION OF parted FOR VALUES FROM (MINVALUE) TO (MAXVALUE)")
    legacy.execute("CREATE TABLE raw (id bigint PRIMARY KEY, body bytea NOT NULL, status text, answer text, "
                   "solved_by text, error text, priority int)")
    code, _, err = _import(tmp_path, capsys, "r", f"{legacy.schema}.raw")  # its prompts went out as hex
    assert code == 2 and "prompt column 'body' is bytea" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _import(tmp_path, capsys, "p", f"{legacy.schema}.parent")
    assert code == 2 and "has tables that inherit from it" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _import(tmp_path, capsys, "c", f"{legacy.schema}.child")
    assert code == 0, err  # a child alone: its own rows
    assert _import(tmp_path, capsys, "d", f"{legacy.schema}.parted")[0] == 0


def test_a_foreign_table_is_refused(svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A probe: a foreign table over a table holding its key twice; one task wrote both rows. Its key's
    uniqueness cannot be seen here: refused at import. (Skipped where ``postgres_fdw`` is missing,
    as on the embedded PostgreSQL.)"""
    columns = "id bigint, body text NOT NULL, status text, answer text, solved_by text, error text, priority int"
    try:
        legacy.execute("CREATE EXTENSION IF NOT EXISTS postgres_fdw")
    except sa.exc.DBAPIError as exc:
        pytest.skip(f"postgres_fdw cannot be created here: {exc.orig}")
    legacy.execute("CREATE SERVER IF NOT EXISTS balancer_test_loop FOREIGN DATA WRAPPER postgres_fdw;"
                   f"CREATE FOREIGN TABLE far ({columns}) SERVER balancer_test_loop")
    code, _, err = _import(tmp_path, capsys, "f", f"{legacy.schema}.far")
    assert code == 2 and "is a foreign table" in err and len(err.strip().splitlines()) == 1, err


def test_a_source_on_balancer_s_own_tables_is_refused(svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 4: a source declared on balancer's own ``tasks`` table was accepted
    (47 tasks became 94 in 21 s). Balancer's own tables and views are refused at import."""
    for table, where in (("tasks", "status = 'pending'"), ("balancer_results", "status = 'failed'")):
        path = tmp_path / "own.toml"
        path.write_text(f'[sources.loop]\ntable = "{table}"\nkey = "id"\nprompt = "error"\nanswer = "answer"\n'
                        f'where = "{where}"\n')
        code, _, err = run(capsys, "source", "import", str(path))
        assert code == 2 and "is balancer's own table tasks" in err, (table, err)
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sources)).scalar_one() == 0


# -- finding 10: size limits ------------------------------------------------------------------

def test_a_long_source_name_or_prompt_fails_its_line_with_a_clear_error(
        svc: Services, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Issue 38 finding 10: a 10,000-character source name in a JSONL file failed the whole
    file with a misleading "cannot reach PostgreSQL". Now that line fails with what is wrong,
    as does a prompt over BALANCER_MAX_PROMPT_BYTES, and the other lines are accepted."""
    monkeypatch.setenv("BALANCER_MAX_PROMPT_BYTES", "1000")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(json.dumps({"source": "s" * 10_000, "prompt": "a"}) + "\n"
                     + json.dumps({"prompt": "é" * 600}) + "\n" + json.dumps({"prompt": "fine"}) + "\n")
    code, out, err = run(capsys, "submit", str(jsonl))
    assert code == 3 and "accepted 1 task(s), rejected 2 line(s)" in out, (out, err)
    assert err.splitlines() == [
        f"{jsonl}:line 1: source is 10,000 characters, more than BALANCER_MAX_SOURCE_CHARS (256)",
        f"{jsonl}:line 2: prompt is 1,200 bytes, more than BALANCER_MAX_PROMPT_BYTES (1,000)"]
    code, _, err = run(capsys, "submit", str(jsonl), "--source", "x" * 300)
    assert code == 2 and "--source: source is 300 characters" in err


def test_a_source_row_over_the_prompt_limit_is_refused_with_its_reason_unread(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys, caplog) -> None:  # noqa: ANN001
    """Issue 38 finding 10: 40 rows of 10 MB took the dispatcher from 95 MB to 3,007 MB.
    A row whose prompt is over BALANCER_MAX_PROMPT_BYTES is now measured by the team's
    database and never read: it is refused with its reason, the other rows become tasks."""
    import tracemalloc

    legacy.add(2)
    legacy.execute("INSERT INTO prompts (id, body) SELECT g, repeat('x', 10 * 1024 * 1024) FROM generate_series(10, 12) g")
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    tracemalloc.start()
    try:
        [report] = ingest_sources(svc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (report.created, report.skipped) == (2, 3)
    assert peak < 8 * 1024 * 1024, f"{peak:,} bytes held while reading three 10 MB prompts"
    assert "prompt is 10,485,760 bytes, more than BALANCER_MAX_PROMPT_BYTES (1,048,576)" in caplog.text
    with svc.engine.connect() as conn:
        assert sorted(conn.execute(sa.select(tasks.c.key)).scalars()) == ["1", "2"]
        recorded = dict(conn.exec_driver_sql("SELECT key, reason FROM source_rejects WHERE source = 'crm'").all())
    assert recorded == {k: "prompt is 10,485,760 bytes, more than BALANCER_MAX_PROMPT_BYTES (1,048,576)"
                        for k in ("10", "11", "12")}


def test_a_status_value_the_table_refuses_is_refused_at_import(svc: Services, legacy: Legacy, tmp_path: Path,
                                                              capsys) -> None:  # noqa: ANN001
    """A probe: ``solved = "finished"`` against a CHECK that allows 'solved' only was imported (exit 0);
    every write-back then failed, each row left unwritable. The solved and failed values are checked
    at import against the status column: its type, its length, a domain's checks and every CHECK on
    that column alone (evaluated in a SELECT: nothing is written)."""
    rest = "id bigint PRIMARY KEY, body text NOT NULL, answer text, solved_by text, error text, priority int"
    legacy.execute(f"CREATE TABLE checked ({rest}, status text CONSTRAINT known_status "
                   "CHECK (status IN ('unsolved', 'solved', 'failed')));"
                   f"CREATE TABLE short ({rest}, status varchar(8));"
                   f"CREATE TABLE numbered ({rest}, status int);"
                   "CREATE DOMAIN state AS text CHECK (VALUE <> 'finished');"
                   f"CREATE TABLE domained ({rest}, status state);"
                   f"CREATE TABLE paired ({rest}, status text, CHECK (status <> 'finished' OR answer IS NOT NULL));"
                   # A review: a % in a CHECK crashed the import; a CHECK that fails, or a domain over
                   # varchar(8), went through.
                   f"CREATE TABLE liked ({rest}, status text CHECK (status LIKE 'un%%' OR length(status) %% 2 = 0));"  # %% for %
                   f"CREATE TABLE casting ({rest}, status text CHECK (status::int >= 0 OR status = 'unsolved'));"
                   "CREATE DOMAIN short_state AS varchar(8);"
                   f"CREATE TABLE short_domain ({rest}, status short_state);"
                   f"CREATE TABLE jsoned ({rest}, status jsonb);"
                   # A probe: a partition by status as the source, then each write-back violated its constraint.
                   "CREATE TABLE parted (id bigint, body text NOT NULL, answer text, solved_by text, error text, "
                   "priority int, status text NOT NULL) PARTITION BY LIST (status);"
                   "CREATE TABLE parted_open PARTITION OF parted (PRIMARY KEY (id)) FOR VALUES IN ('unsolved');"
                   "CREATE TABLE parted_done PARTITION OF parted FOR VALUES IN ('solved', 'failed');"
                   "CREATE TABLE lone (id bigint, body text NOT NULL, answer text, solved_by text, error text, "
                   "priority int, status text NOT NULL) PARTITION BY LIST (status);"  # (a review) no constraint
                   "CREATE TABLE lone_all PARTITION OF lone (PRIMARY KEY (id)) DEFAULT")

    def imported(table: str, solved: str, where: str = "status = 'unsolved'", status: str = "status") -> tuple[int, str]:
        text = SOURCE_FILE.format(name=table, env='database_url_env = "LEGACY_DATABASE_URL"\n',
                                  table=f"{legacy.schema}.{table}", batch=10)
        text = text.replace("where = \"status = 'unsolved'\"", f"where = \"{where}\"") + f'solved = "{solved}"\n'
        text = text.replace('status = "status"', f'status = "{status}"')
        path = tmp_path / f"{table}.toml"
        path.write_text(text)
        code, _, err = run(capsys, "source", "import", str(path))
        assert code == 0 or len(err.strip().splitlines()) == 1, err
        return code, err

    code, err = imported("checked", "finished")
    assert code == 2 and "solved = 'finished' for status column 'status' (text): refused by its table's CHECK " \
                         "known_status" in err, err
    code, err = imported("short", "completed")
    assert code == 2 and "the column stores it as 'complete'" in err, err
    code, err = imported("numbered", "done", where="status = 0")
    assert code == 2 and "solved = 'done' for status column 'status' (integer): invalid input syntax" in err, err
    code, err = imported("domained", "finished")
    assert code == 2 and ".state): value for domain " in err and "violates check constraint" in err, err
    assert imported("paired", "finished")[0] == 0  # a CHECK over two columns: left to the write-back
    code, err = imported("liked", "solved")  # 'solved' and 'failed': six letters each, even: allowed
    assert code == 0, err
    code, err = imported("liked", "finished1")
    assert code == 2 and "refused by its table's CHECK liked_status_check" in err, err
    code, err = imported("casting", "solved")
    assert code == 2 and "its table's CHECK casting_status_check: invalid input syntax for type integer" in err, err
    code, err = imported("short_domain", "completed")
    assert code == 2 and "the column stores it as 'complete'" in err, err
    code, err = imported("numbered", "02", where="status = 0")  # a retried task's failure is found by its text
    assert code == 2 and "the column stores it as '2'" in err, err
    code, err = imported("jsoned", '{\\"s\\":\\"solved\\"}', where="status IS NULL")
    assert code == 2 and 'the column stores it as \'{"s": "solved"}\'' in err, err
    assert imported("lone_all", "solved")[0] == 0  # a lone DEFAULT partition holds any row
    code, err = imported("parted_open", "solved")
    assert code == 2 and "refused by its table's partition constraint: " in err and "declare its partitioned" in err, err
    code, err = imported("numbered", "2", where="status = 0")  # solved fits now; failed is checked too
    assert code == 2 and "failed = 'failed' for status column 'status' (integer): invalid input syntax" in err, err
    assert imported("checked", "solved")[0] == 0
    assert imported("short", "resolved")[0] == 0  # eight characters: it fits
    legacy.execute("CREATE VIEW open_checked AS SELECT id, body, answer, solved_by, error, priority, status AS state "
                   "FROM checked")  # a view: the CHECK of the table it updates, on the column its own reads
    code, err = imported("open_checked", "finished", where="state = 'unsolved'", status="state")
    assert code == 2 and "for status column 'state' (text): refused by its table's CHECK known_status" in err, err


def test_a_table_dropped_and_created_again_is_neither_read_nor_written_until_imported_again(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A probe: the team's table dropped and created again under its name, its key no longer unique
    (three rows with id 2): one task's write-back wrote all three, and its rows were read, though
    nothing was checked of the new table. Now each read and each write-back compares the tables the
    name reads with those its import recorded: both stop, saying why, until it is imported again."""
    columns = "body text NOT NULL, status text NOT NULL DEFAULT 'unsolved', answer text, solved_by text, error text, " \
              "priority int"
    legacy.execute(f"CREATE TABLE redone (id bigint PRIMARY KEY, {columns});"
                   "INSERT INTO redone (id, body) VALUES (1, 'q1'), (2, 'q2'), (3, 'q3')")
    assert _import(tmp_path, capsys, "redone", f"{legacy.schema}.redone")[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 3
    legacy.execute(f"DROP TABLE redone; CREATE TABLE redone (id bigint, {columns});"
                   "INSERT INTO redone (id, body) VALUES (1, 'q1'), (2, 'q2'), (2, 'q2'), (2, 'q2'), (3, 'q3'), (4, 'q4')")
    drained = drain(svc)
    assert (drained.written, drained.retrying) == (0, 3), drained
    assert legacy.count("SELECT count(*) FROM redone WHERE answer IS NOT NULL") == 0
    code, out, _ = run(capsys, "status")
    assert "is not the table the source's import checked" in out, out  # the write-backs' health line
    with svc.engine.begin() as conn:
        conn.execute(sa.update(sources).values(read_at=None))  # due again
    ingest_sources(svc)
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(tasks).where(tasks.c.key == "4")).scalar_one() == 0
    code, out, _ = run(capsys, "status")
    assert "table unreadable: table" in out and "balancer source import" in out, out
    code, _, err = _import(tmp_path, capsys, "redone", f"{legacy.schema}.redone")
    assert code == 2 and "is not unique" in err, err  # imported again, it is checked: refused


def test_a_row_refused_by_a_privilege_check_or_a_deferred_trigger_fails_alone(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A probe: one row refused with an SQLSTATE of no row's class (a row-level security policy's
    WITH CHECK, or a trigger, raising insufficient_privilege) kept its whole batch waiting for ever,
    and so did a deferred constraint trigger refusing one row at COMMIT. Now such a row fails alone;
    a privilege balancer's role lacks (revoked after the import) is the table's: every row waits."""
    columns = "id bigint PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT 'unsolved', answer text, " \
              "solved_by text, error text, priority int"
    legacy.execute(
        f"CREATE TABLE guarded ({columns}); CREATE TABLE deferred ({columns});"
        "INSERT INTO guarded (id, body) SELECT g, 'q' || g FROM generate_series(1, 4) g;"
        "INSERT INTO deferred (id, body) SELECT g, 'q' || g FROM generate_series(1, 4) g;"
        "CREATE FUNCTION refuse_two() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN IF NEW.id = 2 THEN "
        "RAISE EXCEPTION 'not yours' USING ERRCODE = 'insufficient_privilege'; END IF; RETURN NEW; END $$;"
        "CREATE TRIGGER refuse BEFORE UPDATE ON guarded FOR EACH ROW EXECUTE FUNCTION refuse_two();"
        "CREATE FUNCTION refuse_three() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN IF NEW.id = 3 THEN "
        "RAISE EXCEPTION 'audit says no' USING ERRCODE = 'check_violation'; END IF; RETURN NEW; END $$;"
        "CREATE CONSTRAINT TRIGGER audit AFTER UPDATE ON deferred DEFERRABLE INITIALLY DEFERRED "
        "FOR EACH ROW EXECUTE FUNCTION refuse_three()")
    for table in ("guarded", "deferred"):
        assert _import(tmp_path, capsys, table, f"{legacy.schema}.{table}")[0] == 0
    ingest_sources(svc)
    with svc.engine.begin() as conn:  # (a review) guarded's row 2 ends failed: alone in its outcome's statement
        conn.execute(sa.update(tasks).where(tasks.c.source == "guarded", tasks.c.key == "2")
                     .values(status="failed", error="backend said no"))
    assert solve_pending(svc) == 7
    drained = drain(svc)
    assert (drained.written, drained.refused, drained.retrying) == (6, 2, 0), drained
    assert legacy.count("SELECT count(*) FROM guarded WHERE status = 'solved'") == 3
    assert legacy.count("SELECT count(*) FROM deferred WHERE status = 'solved'") == 3
    code, out, _ = run(capsys, "source", "rows", "guarded")
    assert "write-back waiting: failed 1 time(s), retried; last: not yours" in out, out
    code, out, _ = run(capsys, "source", "rows", "deferred")
    assert "audit says no" in out, out

    # A role that may UPDATE the answer alone: the table's error, said, every row waiting (not refused one by one).
    legacy.execute(f"CREATE TABLE shut ({columns}); INSERT INTO shut (id, body) SELECT g, 'q' || g FROM generate_series(1, 4) g")
    out = _four_wait_as_role(svc, legacy, tmp_path, capsys, monkeypatch, "shut", "GRANT SELECT ON shut TO {role}; "
                             "GRANT UPDATE (answer) ON shut TO {role}")
    assert "source shut: 4 write-back(s) failing, retried: balancer's role may not UPDATE column(s) error, " \
           "solved_by, status of" in out, out


def _four_wait_as_role(svc: Services, legacy: Legacy, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                       table: str, grants: str, **fields: str) -> str:
    """Import ``table`` (4 rows) as source ``table``, answer its rows, and write them back as a role
    holding ``grants`` alone: all 4 wait (none written or refused). `balancer status`'s output; the
    team's own URL again after."""
    role = "balancer_test_" + legacy.schema.removeprefix("legacy_")
    legacy.execute(f"CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {legacy.schema} TO {role}; "
                   + grants.format(role=role))
    try:
        assert _import(tmp_path, capsys, table, f"{legacy.schema}.{table}", **fields)[0] == 0
        ingest_sources(svc)
        assert solve_pending(svc) == 4
        monkeypatch.setenv("LEGACY_DATABASE_URL", legacy.engine.url.set(username=role).render_as_string(False))
        drained = drain(svc)
        assert (drained.written, drained.refused, drained.retrying) == (0, 0, 4), drained
        return run(capsys, "status")[1]
    finally:
        monkeypatch.setenv("LEGACY_DATABASE_URL", legacy.engine.url.render_as_string(False))
        legacy.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


def test_a_privilege_only_where_needs_is_the_tables_error(svc: Services, legacy: Legacy, tmp_path: Path, capsys,  # noqa: ANN001
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The privilege check named the columns a write-back sets and those its guard reads, not those
    only ``where`` reads: a role that may not SELECT one had every row refused alone, as if each
    row's value were wrong. It is the table's error: every row waits, saying so."""
    legacy.execute("CREATE TABLE narrow (id bigint PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT "
                   "'unsolved', answer text, solved_by text, error text, priority int, tenant text);"
                   "INSERT INTO narrow (id, body) SELECT g, 'q' || g FROM generate_series(1, 4) g")
    out = _four_wait_as_role(svc, legacy, tmp_path, capsys, monkeypatch, "narrow",
                             "GRANT SELECT (id, body, status, answer, solved_by, error, priority) ON narrow TO {role}; "
                             "GRANT UPDATE (status, answer, solved_by, error) ON narrow TO {role}",
                             where="\"status = 'unsolved' AND coalesce(tenant, '') NOT LIKE 'x%'\"")
    assert "source narrow: 4 write-back(s) failing, retried: balancer's role may not read what the source's " \
           "where reads in" in out, out
    with svc.engine.begin() as conn:  # skip the back-off
        conn.execute(sa.update(source_outbox).where(source_outbox.c.source == "narrow")
                     .values(next_attempt_at=sa.func.now()))
    assert drain(svc).written == 4  # as the team's role; the where's % reaches PostgreSQL as written


def test_a_key_no_longer_unique_refuses_its_row_and_writes_neither(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                   capsys) -> None:  # noqa: ANN001
    """A probe: the key's primary key dropped after the import and a second row of key 3 inserted
    with the same prompt: the one task of key 3 wrote its answer into both rows (4 rows written,
    5 changed). Now that write is undone and refused alone, saying why; the other rows are written."""
    legacy.execute("CREATE TABLE dup (id bigint PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT "
                   "'unsolved', answer text, solved_by text, error text, priority int);"
                   "INSERT INTO dup (id, body) SELECT g, 'q' || g FROM generate_series(1, 4) g")
    assert _import(tmp_path, capsys, "dup", f"{legacy.schema}.dup")[0] == 0
    legacy.execute("ALTER TABLE dup DROP CONSTRAINT dup_pkey; INSERT INTO dup (id, body) VALUES (3, 'q3')")
    ingest_sources(svc)
    assert solve_pending(svc) == 4
    drained = drain(svc)
    assert (drained.written, drained.refused) == (3, 1), drained
    assert legacy.count("SELECT count(*) FROM dup WHERE answer IS NOT NULL") == 3
    assert legacy.count("SELECT count(*) FROM dup WHERE id = 3 AND answer IS NULL") == 2
    code, out, _ = run(capsys, "source", "rows", "dup")
    assert "key 3 (balancer task" in out and "matches several rows of" in out, out


def test_an_answer_too_long_for_a_domain_over_varchar_is_refused_not_cut(svc: Services, legacy: Legacy,
                                                                        tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A probe: an answer column of a domain over ``varchar(20)`` had its answer cut to 20 characters
    and counted written (the write-back cast to the domain, which cuts); a plain ``varchar(20)``
    refused it. Now both refuse it; the domain's CHECK still holds."""
    legacy.execute("CREATE DOMAIN short_text AS varchar(20) CHECK (VALUE <> 'answer to q2');"
                   "CREATE TABLE dom (id bigint PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT "
                   "'unsolved', answer short_text, solved_by text, error text, priority int);"
                   "INSERT INTO dom (id, body) VALUES (1, 'a prompt long enough to overflow'), (2, 'q2'), (3, 'q3')")
    assert _import(tmp_path, capsys, "dom", f"{legacy.schema}.dom")[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 3
    drained = drain(svc)
    assert (drained.written, drained.refused) == (1, 2), drained
    assert legacy.count("SELECT count(*) FROM dom WHERE answer IS NOT NULL") == 1
    code, out, _ = run(capsys, "source", "rows", "dom")
    assert "value too long for type character varying(20)" in out and "violates check constraint" in out, out


def test_a_malformed_team_url_is_named_by_its_own_variable(svc: Services, legacy: Legacy, tmp_path: Path, capsys,  # noqa: ANN001
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe: a source's malformed URL (an unclosed IPv6 bracket) was said to be
    BALANCER_DATABASE_URL's, which was fine."""
    monkeypatch.setenv("LEGACY_DATABASE_URL", "postgresql://postgres@[::1:5432/team")
    code, _, err = _import(tmp_path, capsys, "bad_url", "prompts")
    assert code == 2 and err.startswith("error: LEGACY_DATABASE_URL is malformed"), err
    assert len(err.strip().splitlines()) == 1


def test_the_import_plans_the_write_back_a_batch_runs(svc: Services, legacy: Legacy, tmp_path: Path,
                                                     capsys) -> None:  # noqa: ANN001
    """A probe: a team's column named like one of the batch statement's own (``balancer_i``) in
    ``where`` passed the import, which planned a one-row statement no write-back runs; every
    write-back then failed for ever ("column reference is ambiguous"). The import plans the
    batch's statement, and says so in one line."""
    legacy.execute("CREATE TABLE clash (id bigint PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT "
                   "'unsolved', answer text, solved_by text, error text, priority int, balancer_i int DEFAULT 0)")
    code, _, err = _import(tmp_path, capsys, "clash", f"{legacy.schema}.clash",
                           where="\"status = 'unsolved' AND balancer_i = 0\"")
    assert code == 2 and "the write-back of a solved task would fail" in err and "ambiguous" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_read_only_database_is_refused_at_import(svc: Services, service_urls, tmp_path: Path, capsys,  # noqa: ANN001
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe: a source on a read-only database (a standby's URL, or one set
    ``default_transaction_read_only``) was imported, and its write-backs then waited for ever."""
    with legacy_fixtures.legacy_database(service_urls[1]) as url:
        monkeypatch.setenv("LEGACY_DATABASE_URL", url)
        team = sa.create_engine(url)
        try:
            with team.begin() as conn:
                conn.exec_driver_sql("CREATE TABLE ro (id bigint PRIMARY KEY, body text NOT NULL, status text NOT NULL "
                                     "DEFAULT 'unsolved', answer text, solved_by text, error text, priority int);"
                                     f'ALTER DATABASE "{sa.engine.make_url(url).database}" '
                                     "SET default_transaction_read_only = on")
        finally:
            team.dispose()
        code, _, err = _import(tmp_path, capsys, "ro", "ro")
        assert code == 2 and "its database is read only" in err, err
        assert len(err.strip().splitlines()) == 1


def test_a_key_of_a_composite_type_is_refused_at_import(svc: Services, legacy: Legacy, tmp_path: Path,
                                                        capsys) -> None:  # noqa: ANN001
    """A probe: a key of a composite type was imported (exit 0), then every read failed ("input of
    anonymous composite types is not implemented": a read's position is bound as text)."""
    legacy.execute("CREATE TYPE pair AS (a int, b text); CREATE TABLE comp (id pair PRIMARY KEY, body text NOT NULL, "
                   "status text, answer text, solved_by text, error text, priority int)")
    code, _, err = _import(tmp_path, capsys, "comp", f"{legacy.schema}.comp")
    assert code == 2 and "which orders its reads, is of the composite type" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_table_whose_update_a_rule_does_instead_is_refused_at_import(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                      capsys) -> None:  # noqa: ANN001
    """A probe: an unconditional DO INSTEAD rule with RETURNING sent each write-back to another table,
    counted as written, while the row kept matching ``where``, no one told."""
    columns = "id bigint PRIMARY KEY, body text NOT NULL, status text, answer text, solved_by text, error text, priority int"
    legacy.execute(f"CREATE TABLE asked ({columns}); CREATE TABLE elsewhere ({columns});"
                   "CREATE RULE redirect AS ON UPDATE TO asked DO INSTEAD UPDATE elsewhere SET answer = NEW.answer, "
                   "status = NEW.status WHERE elsewhere.id = OLD.id RETURNING elsewhere.*")
    code, _, err = _import(tmp_path, capsys, "asked", f"{legacy.schema}.asked")
    assert code == 2 and "has the rule 'redirect' doing its UPDATE instead" in err, err
    assert len(err.strip().splitlines()) == 1
    assert _import(tmp_path, capsys, "elsewhere", f"{legacy.schema}.elsewhere")[0] == 0


def test_a_write_back_the_table_skips_is_said_so_not_taken_for_someone_elses_change(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A probe: a BEFORE UPDATE trigger returning NULL for one row made its write-back "not
    overwritten: its row no longer matched where (someone else changed or answered it)", though no
    one had. A row as it was read that the write-back still missed was skipped by its table: said
    so, and tried again until it is left unwritable."""
    columns = "id bigint PRIMARY KEY, body text NOT NULL, status text NOT NULL DEFAULT 'unsolved', answer text, " \
              "solved_by text, error text, priority int"
    legacy.execute(f"CREATE TABLE skipping ({columns}); INSERT INTO skipping (id, body) SELECT g, 'q' || g "
                   "FROM generate_series(1, 3) g;"
                   "CREATE FUNCTION skip_two() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN IF NEW.id = 2 THEN "
                   "RETURN NULL; END IF; RETURN NEW; END $$;"
                   "CREATE TRIGGER skip BEFORE UPDATE ON skipping FOR EACH ROW EXECUTE FUNCTION skip_two()")
    assert _import(tmp_path, capsys, "skipping", f"{legacy.schema}.skipping")[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 3
    drained = drain(svc)
    assert (drained.written, drained.conflicts, drained.refused) == (2, 0, 1), drained
    code, out, _ = run(capsys, "source", "rows", "skipping")
    assert "its table skipped the update of a row as it was read (a BEFORE UPDATE trigger returning NULL" in out, out


def test_a_failure_its_source_has_no_column_for_is_not_asked_again_and_is_named_in_source_rows(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A probe: with no ``status`` and no ``error`` column (both optional) and ``where = "answer IS
    NULL"``, a failed task had nothing to write; its outbox row was deleted as if written (drain
    counted it written), so the rescan found its row still matching ``where``, took it for
    re-opened and asked it again, attempts reset, for ever, said nowhere. Its outbox row is kept
    now, as a written row's that still matches ``where`` is: the row is left as it was, not asked
    again, named by ``source rows`` with the task's error; ``tasks retry`` asks it again."""
    legacy.execute("CREATE TABLE bare (id bigint PRIMARY KEY, body text NOT NULL, answer text, solved_by text, "
                   "priority int); INSERT INTO bare (id, body) VALUES (1, 'one'), (2, 'two')")
    code, _, err = _import(tmp_path, capsys, "bare", f"{legacy.schema}.bare", without=("status", "error"),
                           where='"answer IS NULL"')
    assert code == 0, err
    ingest_sources(svc)
    assert solve_pending(svc, limit=1) == 1
    with svc.engine.begin() as conn:
        failed = conn.execute(sa.update(tasks).where(tasks.c.status == "pending").values(
            status="failed", error="context length exceeded (permanent)", attempts=3).returning(tasks.c.id)).scalar_one()
    drained = drain(svc)
    assert drained.written == 1, drained  # the failure: nothing written, not counted written
    assert drained.unrecorded == 1, drained
    for _ in range(4):  # the rescan reads row 2 again and again, still matching where
        time.sleep(0.15)  # poll_seconds
        ingest_sources(svc)
        assert drain(svc).written == 0
    with svc.engine.connect() as conn:
        task = conn.execute(sa.select(tasks.c.status, tasks.c.attempts).where(tasks.c.id == failed)).one()
    assert tuple(task) == ("failed", 3)  # not asked again
    assert legacy.count("SELECT count(*) FROM bare WHERE answer IS NULL") == 1  # nothing written to row 2
    code, out, _ = run(capsys, "source", "rows", "bare")
    assert code == 0 and out.splitlines()[-1] == "bare: 1 row(s) without balancer's answer", out
    assert out.startswith(f"key 2 (balancer task {failed}): task failed: context length exceeded (permanent); "
                          "write-back none: its source declares no column for a failure"), out
    assert run(capsys, "tasks", "retry", "--source", "bare", "--yes")[0] == 0  # asked again when asked to
    assert solve_pending(svc) == 1
    assert drain(svc).written == 1
    assert legacy.count("SELECT count(*) FROM bare WHERE answer = 'answer to two'") == 1
