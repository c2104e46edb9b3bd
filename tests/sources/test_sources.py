"""Source tables (issue 25): task identity, the sources file, ingest past a
cursor, the write-back outbox and the results export, on real PostgreSQL
(a throwaway "legacy" database per test for the team's table)."""

from __future__ import annotations

import csv
import io
import json
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.services import Services
from balancer.sources.ingest import ingest_sources
from balancer.sources.reads import source_status
from balancer.sources.schema import source_outbox, sources
from balancer.sources.writeback import drain
from balancer.storage.schema import source_changes, tasks
from tests import legacy as legacy_fixtures
from tests.legacy import SOURCE_FILE, Legacy, counts, import_legacy, legacy_schema, run, solve_pending

# The team's table and balancer's services (tests/legacy.py).
svc, legacy_url, legacy = legacy_fixtures.svc, legacy_fixtures.legacy_url, legacy_fixtures.legacy


# -- task identity -----------------------------------------------------------------------

def test_the_same_jsonl_submitted_twice_inserts_once(svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "key": "k1", "metadata": {"row": 1}}\n{"prompt": "b", "key": "k2"}\n'
                    '{"prompt": "b", "key": "k2"}\n{"prompt": "no key"}\n')
    code, out, _ = run(capsys, "submit", str(path))
    assert code == 0 and "accepted 3 task(s), already present 1" in out
    code, out, _ = run(capsys, "submit", str(path))
    assert code == 0 and "accepted 1 task(s), already present 3" in out  # only the keyless task again
    with svc.engine.connect() as conn:
        rows = conn.execute(sa.select(tasks.c.key, tasks.c.metadata).order_by(tasks.c.id)).all()
    assert [r.key for r in rows] == ["k1", "k2", None, None]
    assert rows[0].metadata == {"row": 1}
    code, _, err = run(capsys, "submit", str(path), "--source", "other")
    assert code == 0  # another source: its own keys


# -- the sources file ---------------------------------------------------------------------

HOSTILE = {
    "bad identifier": ('key = "id; DROP TABLE prompts"', "not a plain SQL identifier"),
    "quoted identifier": ('prompt = "body\\" FROM prompts --"', "not a plain SQL identifier"),
    "a statement for where": ("where = \"true; DELETE FROM prompts\"", "may not contain"),
    "where not a condition": ('where = "body"', "where is not a condition"),
    "where a subquery writing": ('where = "(WITH d AS (DELETE FROM prompts RETURNING 1) SELECT true)"',
                                "where is not a condition"),
    "missing column": ('prompt = "nope"', "no column 'nope'"),
    "misspelled column": ('prompt = "bodyy"', "no column 'bodyy' (prompt) in "),  # and the hint, below
    "misspelled field": ('prompt = "body"\npromt = "body"', "unknown field(s): promt (did you mean 'prompt'?)"),
    "missing table": ('table = "public.nope"', "no table public.nope"),
    "key not unique": ('key = "priority"', "is not unique"),
    "status value not storable": ('status = "priority"\npriority = "id"',
                                  "solved = 'solved' for status column 'priority' (integer): invalid input syntax"),
    # A probe: an answer written into the team's prompt, its key, or a column another role sets.
    "answer into the prompt": ('answer = "body"', "answer and prompt name one column, 'body'"),
    "answer into the key": ('answer = "id"', "answer and key name one column, 'id'"),
    "model into the status": ('model = "status"', "model and status name one column, 'status'"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_source_definition_is_one_line_exit_2_and_stores_nothing(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys, case: str) -> None:  # noqa: ANN001
    change, message = HOSTILE[case]
    field, *others = [line.split(" = ")[0] for line in change.splitlines()]  # the change's lines replace theirs
    text = SOURCE_FILE.format(name="crm", env='database_url_env = "LEGACY_DATABASE_URL"\n', table=legacy.table,
                              batch=10)
    text = "\n".join(change if line.startswith(f"{field} = ") else line for line in text.splitlines()
                     if not any(line.startswith(f"{other} = ") for other in others))
    path = tmp_path / "s.toml"
    path.write_text(text)
    code, out, err = run(capsys, "source", "import", str(path))
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {path}: ")  # the file named, every time
    assert case != "misspelled column" or err.rstrip().endswith("(did you mean 'body'?)")
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sources)).scalar_one() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(source_changes)).scalar_one() == 0
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'unsolved'") == 0  # untouched, still there


def test_a_source_url_of_another_database_names_its_own_variable(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                  capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A probe: a MySQL URL in the source's variable was refused as "BALANCER_DATABASE_URL must be
    a postgresql:// URL", a variable that was right."""
    monkeypatch.setenv("LEGACY_DATABASE_URL", "mysql://u@db.example/team")
    code, _, err = import_legacy(tmp_path, capsys, legacy.table)
    assert code == 2 and "LEGACY_DATABASE_URL must be a postgresql:// URL, got 'mysql://***@db.example/team'" in err, err
    assert "BALANCER_DATABASE_URL" not in err and len(err.strip().splitlines()) == 1


def test_a_source_naming_a_model_with_no_quota_is_refused(svc: Services, legacy: Legacy, tmp_path: Path,
                                                          capsys) -> None:  # noqa: ANN001
    """As ``submit`` refuses a task for an unknown model: the source's rows would never be tasks
    (they showed only later, in status, as rows not tasks)."""
    path = tmp_path / "s.toml"
    path.write_text(SOURCE_FILE.format(name="crm", env='database_url_env = "LEGACY_DATABASE_URL"\n', table=legacy.table,
                                       batch=10) + 'models = ["a", "nope"]\n')
    for dry_run in ((), ("--dry-run",)):
        code, _, err = run(capsys, "source", "import", str(path), *dry_run)
        assert code == 2 and err == (f"error: {path}: sources.crm.models: no model has the name nope (add its quota "
                                     "first: `balancer quota set NAME --create` or `balancer quota import FILE`)\n")
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sources)).scalar_one() == 0
    path.write_text(path.read_text().replace('"a", "nope"', '"a"'))
    assert run(capsys, "source", "import", str(path))[0] == 0


def test_a_table_without_a_unique_key_is_refused(svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    legacy.execute("CREATE TABLE loose (id bigint, body text, status text, answer text, solved_by text, error text, "
                   "priority int)")
    code, _, err = import_legacy(tmp_path, capsys, f"{legacy.schema}.loose")
    assert code == 2 and "is not unique" in err and len(err.strip().splitlines()) == 1


def test_the_same_table_imported_twice_is_the_same_source_or_refused(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    code, out, _ = import_legacy(tmp_path, capsys, legacy.table)
    assert code == 0 and "1 unchanged" in out
    code, _, err = import_legacy(tmp_path, capsys, legacy.table, name="crm2")
    assert code == 2 and "read the same table" in err
    code, out, _ = run(capsys, "source", "list", "--json")
    assert [s["name"] for s in json.loads(out)] == ["crm"]
    code, out, _ = run(capsys, "source", "export")
    assert code == 0 and "[sources.crm]" in out and "LEGACY_DATABASE_URL" in out
    assert "postgresql" not in out  # the URL is never stored nor printed
    with svc.engine.connect() as conn:
        stored = json.dumps([dict(r._mapping) for r in conn.execute(sa.select(sources.c.definition))])
    assert "postgresql" not in stored


# -- ingest and write-back ----------------------------------------------------------------

def test_rows_become_tasks_once_with_two_ingesters_and_a_writer_then_are_written_back_once(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    legacy.add(200)
    assert import_legacy(tmp_path, capsys, legacy.table, batch=15)[0] == 0
    stop = threading.Event()

    def writer() -> None:  # a second writer: 50 more rows, one per transaction, while ingest runs
        for i in range(50):
            legacy.add(1, 1000 + i)
            time.sleep(0.005)
        stop.set()

    def ingester() -> None:
        while not stop.is_set():
            ingest_sources(svc, budget_s=0.2)

    threads = [threading.Thread(target=writer), threading.Thread(target=ingester), threading.Thread(target=ingester)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    deadline = time.monotonic() + 60
    while counts(svc.engine, "SELECT count(*) FROM tasks") < 250 and time.monotonic() < deadline:
        time.sleep(0.1)  # poll_seconds: each source is read at most every 0.1 s
        ingest_sources(svc)
    with svc.engine.connect() as conn:
        keys = conn.execute(sa.select(tasks.c.key).where(tasks.c.source == "crm")).scalars().all()
    assert len(keys) == len(set(keys)) == 250
    assert solve_pending(svc, limit=100) == 100
    with svc.engine.connect() as conn:  # the trigger queued one write-back per ended task, in the same transaction
        assert conn.execute(sa.select(sa.func.count()).select_from(source_outbox)).scalar_one() == 100
    assert drain(svc).written == 100
    solve_pending(svc)
    assert drain(svc).written == 150
    assert drain(svc).written == 0
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'solved' AND answer = 'answer to ' || body "
                          "AND solved_by = 'a'") == 250
    assert legacy.count("SELECT count(*) FROM writes") == 250
    assert legacy.count("SELECT count(DISTINCT row_id) FROM writes") == 250
    [status] = source_status(svc.engine)
    assert (status.solved, status.writebacks_waiting, status.conflicts) == (250, 0, 0)


def test_a_row_changed_by_someone_else_is_not_overwritten(svc: Services, legacy: Legacy, tmp_path: Path,
                                                          capsys) -> None:  # noqa: ANN001
    legacy.add(5)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    legacy.execute("UPDATE prompts SET status = 'taken by hand', answer = 'theirs' WHERE id = 3")
    solve_pending(svc)
    drained = drain(svc)
    assert (drained.written, drained.conflicts) == (4, 1)
    assert legacy.count("SELECT count(*) FROM prompts WHERE id = 3 AND answer = 'theirs' AND status = 'taken by hand'") == 1
    [status] = source_status(svc.engine)
    assert status.conflicts == 1 and status.writebacks_waiting == 0
    code, out, _ = run(capsys, "status", "--json")
    assert json.loads(out)["sources"][0]["conflicts"] == 1
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from balancer.views.metrics import BalancerCollector

    registry = CollectorRegistry()
    registry.register(BalancerCollector(svc))
    text = generate_latest(registry).decode()
    assert 'balancer_source_not_overwritten{source="crm"} 1.0' in text
    assert 'balancer_source_tasks{source="crm",state="solved"} 5.0' in text


def test_a_write_back_committed_before_a_crash_is_not_written_again(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                     capsys) -> None:  # noqa: ANN001
    """The team's database committed the write, balancer died before removing the
    outbox row: the retry finds the row already holding the answer, writes nothing."""
    from balancer.sources.batchwrite import column_types, write_many
    from balancer.sources.catalog import team_connection
    from balancer.sources.store import all_sources

    legacy.add(3)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    solve_pending(svc)
    with svc.engine.connect() as conn:
        [definition] = all_sources(conn)
        task = dict(conn.execute(sa.select(tasks.c.key, tasks.c.answer, tasks.c.model, tasks.c.error,
                                           tasks.c.source_fingerprint.label("fingerprint"))
                                 .where(tasks.c.key == "2")).one()._mapping)
    with team_connection(definition, svc.engine) as team, team.begin():  # the write that committed before the crash
        assert write_many(team, definition, "solved", [task], column_types(team, definition), {}) == {0: False}
    drained = drain(svc)
    assert (drained.written, drained.conflicts) == (3, 0)
    assert legacy.count("SELECT count(*) FROM writes") == 3


def test_the_team_database_away_is_retried_until_it_succeeds(svc: Services, legacy: Legacy, tmp_path: Path,
                                                             capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    legacy.add(4)
    assert import_legacy(tmp_path, capsys, legacy.table)[0] == 0
    ingest_sources(svc)
    solve_pending(svc)
    good = legacy.engine.url.render_as_string(hide_password=False)
    monkeypatch.setenv("LEGACY_DATABASE_URL", good.replace(f"/{legacy.engine.url.database}", "/no_such_database_here"))
    drained = drain(svc)
    assert drained.written == 0 and drained.retrying == 4
    with svc.engine.begin() as conn:
        row = conn.execute(sa.select(source_outbox.c.attempts, source_outbox.c.last_error)).first()
        assert row.attempts == 1 and "no_such_database_here" in row.last_error
        conn.execute(sa.update(source_outbox).values(next_attempt_at=sa.func.now()))  # skip the back-off
    monkeypatch.setenv("LEGACY_DATABASE_URL", good)
    assert drain(svc).written == 4
    assert legacy.count("SELECT count(*) FROM writes") == 4


def test_a_source_in_balancers_own_database(svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    schema = legacy_schema(svc.engine)
    own = Legacy(svc.engine, schema)
    own.add(30)
    assert import_legacy(tmp_path, capsys, f"{schema}.prompts", env=False, name="own")[0] == 0
    ingest_sources(svc)
    assert solve_pending(svc) == 30
    own.execute("INSERT INTO prompts (id, body) VALUES (31, 'x')")  # failed for good: its status and error go back
    with svc.engine.begin() as conn:
        conn.execute(sa.insert(tasks).values(source="own", key="31", prompt="x", max_tokens=5, estimated_tokens=6,
                                             from_table=True))  # as the source's ingest inserts it
        conn.execute(sa.update(tasks).where(tasks.c.key == "31").values(status="failed", error="too long"))
    assert drain(svc).written == 31
    assert own.count("SELECT count(*) FROM prompts WHERE status = 'solved' AND answer = 'answer to ' || body") == 30
    assert own.count("SELECT count(*) FROM prompts WHERE status = 'failed' AND error = 'too long'") == 1
    assert own.count("SELECT count(*) FROM writes") == 31


# -- results export -----------------------------------------------------------------------

def test_export_resumes_from_its_cursor_with_no_gap_and_no_repeat_while_tasks_are_solved(
        svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from balancer.backlog.results import START, page, parse_cursor

    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"p{i}", "key": f"k{i}", "metadata": {"i": i}}) + "\n"
                             for i in range(300)))
    assert run(capsys, "submit", str(jsonl))[0] == 0
    assert solve_pending(svc, limit=100) == 100
    # A transaction that ends a task and has not committed yet: no export may pass it.
    held = svc.engine.connect()
    held_tx = held.begin()
    held.execute(sa.update(tasks).where(tasks.c.key == "k299").values(status="solved", answer="late"))

    def solver() -> None:  # 150 more tasks end, each batch its own transaction, while the export reads
        for _ in range(30):
            solve_pending(svc, limit=5)
            time.sleep(0.005)

    thread = threading.Thread(target=solver)
    thread.start()
    seen: list[str] = []
    cursor = parse_cursor(START)
    while thread.is_alive() or not seen:
        rows, cursor = page(svc.engine, cursor, source=None, size=13)
        seen += [r["key"] for r in rows]
    thread.join()
    first = {f"k{i}" for i in range(100)}
    deadline = time.monotonic() + 30
    while set(seen) != first and time.monotonic() < deadline:  # (another session's open transaction holds it back too)
        rows, cursor = page(svc.engine, cursor, source=None, size=1000)
        seen += [r["key"] for r in rows]
    assert sorted(seen) == sorted(first)  # nothing ended after the open transaction began, however long we read
    held_tx.commit()
    held.close()
    assert solve_pending(svc) == 49
    out = tmp_path / "out.jsonl"
    since = str(cursor)
    deadline = time.monotonic() + 30
    while True:  # each export resumes from the cursor the last one printed, appending to the same file
        code, _, err = run(capsys, "results", "export", "--since", since, "--out", str(out))
        assert code == 0 and err.strip().splitlines()[-1].startswith("cursor: ")
        since = err.strip().splitlines()[-1].split()[-1]
        if len(out.read_text().splitlines()) >= 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    # metadata comes back as the JSON object it was submitted as (before: its text, a string to decode again)
    assert all(r["metadata"] == {"i": int(r["key"][1:])} for r in exported)
    seen += [r["key"] for r in exported]
    assert sorted(seen) == sorted(f"k{i}" for i in range(300)) and len(seen) == 300  # no gap, no repeat
    again = tmp_path / "again.jsonl"
    code, _, _ = run(capsys, "results", "export", "--since", since, "--out", str(again))
    assert code == 0 and again.read_text() == ""
    code, out_text, _ = run(capsys, "results", "export", "--format", "csv", "--source", "submit")
    assert code == 0 and out_text.splitlines()[0].startswith("id,source,key,metadata") and len(out_text.splitlines()) == 301
    code, _, err = run(capsys, "results", "export", "--since", "yesterday")
    assert code == 2 and "--since" in err


def test_export_writes_the_prompt_only_when_asked(svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"question {i}, with a comma", "key": f"k{i}"}) + "\n"
                             for i in range(3)))
    assert run(capsys, "submit", str(jsonl))[0] == 0
    assert solve_pending(svc) == 3
    deadline = time.monotonic() + 30
    while True:  # (another session's open transaction holds the export's horizon back: wait it out)
        code, out, _ = run(capsys, "results", "export")
        if len(out.splitlines()) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == 0 and all("prompt" not in json.loads(line) for line in out.splitlines())
    code, out, _ = run(capsys, "results", "export", "--prompt")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and {r["key"]: r["prompt"] for r in rows} == {f"k{i}": f"question {i}, with a comma" for i in range(3)}
    assert list(rows[0])[:4] == ["id", "source", "key", "prompt"]
    code, out, _ = run(capsys, "results", "export", "--prompt", "--format", "csv")
    parsed = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and sorted(r["prompt"] for r in parsed) == [f"question {i}, with a comma" for i in range(3)]


def test_export_says_what_each_task_s_calls_cost_and_the_export_s_spend_by_model_and_source(
        svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A task's cost counts every call the ledger holds for it (a hedge's loser too),
    each at the price of its start (the ledger's cost, as a worker records it); a task on a model
    with no price has no cost (unpriced, not free)."""
    from datetime import UTC, datetime

    from balancer.storage.schema import call_usage

    svc.quotas.set("a", {"price_per_million_input": 2.0, "price_per_million_output": 8.0, "currency": "USD"}, by="test")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"p{i}", "key": f"c{i}", "source": src}) + "\n"
                             for i, src in enumerate(["crm", "etl"])))
    assert run(capsys, "submit", str(jsonl))[0] == 0
    assert solve_pending(svc) == 2
    with svc.engine.begin() as conn:
        ids = dict(conn.execute(sa.select(tasks.c.key, tasks.c.id)).all())
        conn.execute(sa.delete(call_usage))  # only the calls below: a hedged task and an unpriced one
        conn.execute(sa.insert(call_usage), [
            {"call_id": call, "task_id": ids[key], "source": src, "model": model, "admission_id": call,
             "prompt_tokens": p, "completion_tokens": c, "answered": True, "hedge": hedge, "ended_at": datetime.now(UTC),
             "cost": cost, "currency": None if cost is None else "USD"}
            for call, key, src, model, p, c, hedge, cost in [
                ("x", "c0", "crm", "a", 500_000, 125_000, False, 2.0),  # 1.00 + 1.00
                ("y", "c0", "crm", "a", 500_000, 0, True, 1.0),         # the hedge that lost: 1.00
                ("z", "c1", "etl", "free", 1_000, 10, False, None)]])   # no price
    deadline = time.monotonic() + 30
    while True:  # an export holds back tasks ended after any open transaction began (another session's too)
        code, out, err = run(capsys, "results", "export")
        assert code == 0
        rows = {r["key"]: r for r in map(json.loads, out.splitlines())}
        if {"c0", "c1"} <= rows.keys() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (rows["c0"]["calls"], rows["c0"]["billed_prompt_tokens"], rows["c0"]["billed_completion_tokens"]) == \
        (2, 1_000_000, 125_000)
    assert rows["c0"]["cost"] == pytest.approx(3.0) and rows["c1"]["cost"] is None and rows["c1"]["calls"] == 1
    assert "exported tasks' calls, spent: 3.00 USD (a 3.00 USD); unpriced: free 1,010 tokens; by source: crm 3.00 USD" \
        in err


def test_a_row_committed_behind_the_cursor_is_found_by_the_rescan(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                  capsys) -> None:  # noqa: ANN001
    """A writer whose transaction took a smaller id commits after the cursor passed
    it: the rescan behind the cursor makes it a task all the same, once."""
    legacy.execute("INSERT INTO prompts (id, body) SELECT g, 'p' || g FROM generate_series(1, 10) g WHERE g <> 5")
    assert import_legacy(tmp_path, capsys, legacy.table, batch=3)[0] == 0
    ingest_sources(svc)
    with svc.engine.connect() as conn:
        assert sorted(conn.execute(sa.select(tasks.c.key)).scalars(), key=int) == ["1", "2", "3", "4", "6", "7", "8",
                                                                                  "9", "10"]
        assert conn.execute(sa.select(sources.c.position)).scalar_one() == "10"
    legacy.execute("INSERT INTO prompts (id, body) VALUES (5, 'late')")
    deadline = time.monotonic() + 30
    while counts(svc.engine, "SELECT count(*) FROM tasks") < 10 and time.monotonic() < deadline:
        time.sleep(0.1)  # poll_seconds
        ingest_sources(svc)
    for _ in range(5):  # more rescans, round and round: nothing twice
        time.sleep(0.1)
        ingest_sources(svc)
    with svc.engine.connect() as conn:
        keys = conn.execute(sa.select(tasks.c.key)).scalars().all()
    assert sorted(keys, key=int) == [str(i) for i in range(1, 11)]


def test_a_where_with_a_percent_and_the_cli_round_trip(svc: Services, legacy: Legacy, tmp_path: Path,
                                                       capsys) -> None:  # noqa: ANN001
    legacy.add(6)
    text = SOURCE_FILE.format(name="crm", env='database_url_env = "LEGACY_DATABASE_URL"\n', table=legacy.table, batch=10)
    text = text.replace("where = \"status = 'unsolved'\"", "where = \"status = 'unsolved' AND body LIKE '%prompt 1%'\"")
    path = tmp_path / "s.toml"
    path.write_text(text)
    code, out, _ = run(capsys, "source", "import", str(path), "--dry-run")
    assert code == 0 and "would create crm" in out
    assert run(capsys, "source", "list", "--json")[1].strip() == "[]"
    assert run(capsys, "source", "import", str(path))[0] == 0
    ingest_sources(svc)
    with svc.engine.connect() as conn:  # rows 0..5 are 'legacy prompt 0'..'legacy prompt 5': only 1 matches
        assert conn.execute(sa.select(tasks.c.prompt)).scalars().all() == ["legacy prompt 1"]
    exported = tmp_path / "exported.toml"
    assert run(capsys, "source", "export", str(exported))[0] == 0
    code, out, _ = run(capsys, "source", "import", str(exported))
    assert code == 0 and "1 unchanged" in out
    solve_pending(svc)
    code, _, err = run(capsys, "source", "remove", "crm")
    assert code == 2 and "1 write-back(s) waiting" in err
    drain(svc)
    assert run(capsys, "source", "remove", "crm")[0] == 0
    assert run(capsys, "source", "remove", "crm")[0] == 2
    with svc.engine.connect() as conn:
        actions = conn.execute(sa.select(source_changes.c.action).order_by(source_changes.c.id)).scalars().all()
    assert [a for a in actions if a != "weight"] == ["import", "remove"]


# -- answers reused (dedup) -----------------------------------------------------------------

def test_dedup_an_identical_task_takes_the_answer_and_a_waiting_one_is_freed_by_a_failure(
        svc: Services, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from balancer.backlog.transitions import Answer, mark_failed, mark_solved_many

    monkeypatch.setenv("BALANCER_DEDUP", "on")
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "same"}\n{"prompt": "same"}\n{"prompt": "same", "max_tokens": 7}\n'
                    '{"prompt": "other"}\n{"prompt": "other"}\n')
    assert run(capsys, "submit", str(path))[0] == 0

    def rows() -> list:
        with svc.engine.connect() as conn:
            return conn.execute(sa.text("SELECT id, status, answer, reused_from, not_before > now() AS waits "
                                        "FROM tasks ORDER BY id")).all()

    first, twin, other_tokens, other, other_twin = rows()
    assert [r.waits for r in rows()] == [None, True, None, None, True]  # identical to one in flight: they wait

    def run_and(task_id: int, finish: str) -> None:
        with svc.engine.begin() as conn:
            conn.execute(sa.update(tasks).where(tasks.c.id == task_id).values(status="running", admission_id=f"a{task_id}"))
        if finish == "solved":
            mark_solved_many(svc.engine, [Answer(task_id, f"a{task_id}", "the answer", 3, 2)])
        else:
            mark_failed(svc.engine, task_id, f"a{task_id}", "bad request")

    run_and(first.id, "solved")
    after = {r.id: r for r in rows()}
    assert (after[twin.id].status, after[twin.id].answer, after[twin.id].reused_from) == ("solved", "the answer", first.id)
    assert after[other_tokens.id].status == "pending"  # another max_tokens: not the same task
    run_and(other.id, "failed")
    assert rows()[4].status == "pending" and not rows()[4].waits  # its original failed: it is dispatched after all
    code, out, _ = run(capsys, "submit", str(path))  # the same again: "same" reused at once, no call
    assert code == 0
    again = rows()[5:]
    assert [r.status for r in again] == ["solved", "solved", "pending", "pending", "pending"]
    assert [r.reused_from for r in again[:2]] == [first.id, first.id]
    assert [r.waits for r in again[2:]] == [True, True, True]  # identical to tasks still pending: they wait
    code, out, _ = run(capsys, "status", "--json")
    assert json.loads(out)["reused"] == 3


def test_dedup_on_a_source_writes_every_row_back_from_one_answer(svc: Services, legacy: Legacy, tmp_path: Path,
                                                                 capsys) -> None:  # noqa: ANN001
    legacy.execute("INSERT INTO prompts (body) SELECT 'the same question' FROM generate_series(1, 4)")
    path = tmp_path / "s.toml"
    path.write_text(SOURCE_FILE.format(name="crm", env='database_url_env = "LEGACY_DATABASE_URL"\n',
                                       table=legacy.table, batch=10) + "dedup = true\n")
    assert run(capsys, "source", "import", str(path))[0] == 0
    ingest_sources(svc)
    with svc.engine.connect() as conn:
        ready = conn.execute(sa.text("SELECT count(*) FROM tasks WHERE status = 'pending' "
                                     "AND (not_before IS NULL OR not_before <= now())")).scalar_one()
    assert ready == 1  # one call to make; the other three wait on it
    with svc.engine.begin() as conn:  # that one call answered
        conn.execute(sa.text("UPDATE tasks SET status = 'solved', answer = 'one answer', model = 'a' "
                             "WHERE status = 'pending' AND not_before IS NULL"))
    assert drain(svc).written == 4
    assert legacy.count("SELECT count(*) FROM prompts WHERE status = 'solved' AND answer = 'one answer'") == 4
