"""Source tables end to end (issue 25): a "legacy" table in a second database,
read by the real pipeline (beat, dispatcher, workers, the simulator), every
row answered and written back exactly once, through a kill -9 of the
dispatcher (the process that ingests and writes back)."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.cli import main
from balancer.storage.schema import tasks
from tests.legacy import SOURCE_FILE, add_rows, legacy_database, legacy_schema
from tests.pipeline_harness import Pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("migrated")]


def count(engine: sa.Engine, schema: str, query: str) -> int:
    with engine.connect() as conn:
        conn.exec_driver_sql(f'SET search_path = "{schema}"')
        return int(conn.exec_driver_sql(query).scalar_one())


@pytest.mark.parametrize("kill_during", ["ingest", "write-back"])
def test_every_row_is_answered_and_written_back_once_through_a_kill_9(
        service_urls, tmp_path: Path, kill_during: str) -> None:  # noqa: ANN001
    with legacy_database(service_urls[1]) as url:
        team = sa.create_engine(url)
        schema = legacy_schema(team)
        add_rows(team, 200, table=f"{schema}.prompts")
        # Short timings (as tests/pipeline/test_faults.py): tasks the killed dispatcher had queued come back in seconds.
        p = Pipeline(tmp_path / "logs", extra_env={
            "LEGACY_DATABASE_URL": url, "BALANCER_INGEST_TICK": "0.3", "BALANCER_BACKEND_TIMEOUT": "3",
            "BALANCER_WRITE_GRACE": "2", "BALANCER_LEASE_SECONDS": "8", "BALANCER_VISIBILITY_TIMEOUT": "10",
            "BALANCER_SWEEP_TICK": "1"})
        try:
            p.start()
            source_file = tmp_path / "sources.toml"
            source_file.write_text(SOURCE_FILE.format(name="crm", env='database_url_env = "LEGACY_DATABASE_URL"\n',
                                                      table=f"{schema}.prompts", batch=20))
            assert main(["source", "import", str(source_file)]) == 0

            def writer() -> None:  # a second writer: 50 more rows during the run
                for i in range(50):
                    add_rows(team, 1, 1000 + i, table=f"{schema}.prompts")
                    time.sleep(0.04)

            extra = threading.Thread(target=writer)
            extra.start()
            deadline = time.monotonic() + 60
            while True:  # the moment to kill: some rows read (ingest), or some answers written back
                done = (count(team, schema, "SELECT count(*) FROM writes") >= 30 if kill_during == "write-back"
                        else p.counts()["pending"] + p.counts()["solved"] > 0)
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            dispatcher = next(c for c in p.supervisor.children if c.name == "dispatcher")
            p.supervisor.kill(dispatcher, signal.SIGKILL)
            dispatcher.process.wait(timeout=10)
            p.supervisor.stop(dispatcher)
            p.supervisor.start("dispatcher", ["dispatcher", "--loglevel", "INFO"])
            extra.join()
            deadline = time.monotonic() + 150
            while count(team, schema, "SELECT count(*) FROM prompts WHERE status = 'solved'") < 250:
                p.supervisor.check_alive()
                assert time.monotonic() < deadline, f"not all written back: {p.counts()}; logs in {p.log_dir}"
                time.sleep(0.25)
            time.sleep(1.0)  # a write twice would land within a tick or two of the last one
            assert count(team, schema, "SELECT count(*) FROM writes") == 250
            assert count(team, schema, "SELECT count(DISTINCT row_id) FROM writes") == 250
            with p.services.engine.connect() as conn:
                rows = conn.execute(sa.select(tasks.c.key, tasks.c.answer, tasks.c.hedges)
                                    .where(tasks.c.source == "crm")).all()
            assert len(rows) == len({r.key for r in rows}) == 250
            with team.connect() as conn:
                conn.exec_driver_sql(f'SET search_path = "{schema}"')
                answers = dict(conn.exec_driver_sql("SELECT CAST(id AS text), answer FROM prompts").all())
            assert answers == {r.key: r.answer for r in rows}
            ok_calls = [e for e in p.sim_log() if e["status"] == 200]
            assert 250 <= len(ok_calls) <= 250 + sum(r.hedges for r in rows) + 5, Counter(e["status"] for e in p.sim_log())
        finally:
            p.stop()
            team.dispose()


def test_with_dedup_identical_tasks_pending_at_once_make_one_call(tmp_path: Path) -> None:
    p = Pipeline(tmp_path / "logs", extra_env={"BALANCER_DEDUP": "on"})
    try:
        p.start()
        jsonl = tmp_path / "t.jsonl"
        jsonl.write_text("".join(f'{{"prompt": "question {i % 6} ' + "word " * 40 + '"}\n' for i in range(30)))
        assert main(["submit", str(jsonl)]) == 0
        counts = p.wait_done(30, timeout=120)
        assert counts["solved"] == 30
        rows = p.rows()
        ok_calls = [e for e in p.sim_log() if e["status"] == 200]
        assert 6 <= len(ok_calls) <= 6 + sum(r.hedges for r in rows)  # one call per distinct task
        with p.services.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM tasks WHERE reused_from IS NOT NULL").scalar_one() == 24
    finally:
        p.stop()
