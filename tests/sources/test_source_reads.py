"""Issue 38: the team's table read off the dispatch path and within its own time limits
(finding 9), on real PostgreSQL: the team's table in a database the test creates and drops."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.admission.quota import Quota
from balancer.cli import main
from balancer.services import Services
from balancer.settings import Settings
from balancer.sources.polling import SourcePoller
from balancer.storage.schema import tasks
from tests.legacy import SOURCE_FILE, add_rows, legacy_database, legacy_schema
from tests.pipeline_harness import Pipeline, prompt_lines

pytestmark = pytest.mark.usefixtures("migrated")


@pytest.fixture
def team_url(service_urls, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:  # noqa: ANN001
    with legacy_database(service_urls[1]) as url:
        monkeypatch.setenv("LEGACY_DATABASE_URL", url)
        yield url


def source_file(tmp_path: Path, sources: dict[str, str]) -> Path:
    path = tmp_path / "sources.toml"
    path.write_text("".join(SOURCE_FILE.format(name=name, env='database_url_env = "LEGACY_DATABASE_URL"\n',
                                               table=table, batch=50) for name, table in sources.items()))
    return path


def source_tasks(engine: sa.Engine, source: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(tasks.c.source == source)).scalar_one())


def wait_for(what: str, done, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_locked_source_table_delays_only_its_own_source(team_url: str, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Issue 38 finding 9: one source's table held under ACCESS EXCLUSIVE delays that source
    only: another source in the same database is read meanwhile, the locked one's read gives
    up within its lock timeout (no reader piles up behind it), and its rows come once the lock goes."""
    monkeypatch.setenv("BALANCER_SOURCE_LOCK_TIMEOUT", "0.5")
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("a", 4, 100_000)])
    team = sa.create_engine(team_url)
    locked, free = legacy_schema(team), legacy_schema(team)
    assert main(["source", "import", str(source_file(tmp_path, {"held": f"{locked}.prompts",
                                                                 "open": f"{free}.prompts"}))]) == 0
    poller = SourcePoller(svc)
    try:
        with team.connect() as holder:
            holder.exec_driver_sql(f'LOCK TABLE "{locked}".prompts IN ACCESS EXCLUSIVE MODE')
            add_rows(team, 30, table=f"{free}.prompts")

            def open_read() -> bool:
                poller.poll()
                return source_tasks(svc.engine, "open") == 30

            wait_for("the open source was not read while the other one's table was locked", open_read)
            # The locked read gives up within its lock timeout: no reader is left waiting on the lock.
            wait_for("a read waited on the team's lock beyond its time limit", lambda: "held" not in poller.reading(),
                     timeout=10)
            holder.rollback()
        add_rows(team, 20, table=f"{locked}.prompts")

        def held_read() -> bool:
            poller.poll()
            return source_tasks(svc.engine, "held") == 20

        wait_for("the held source was not read once its lock went", held_read)
    finally:
        poller.join(10)
        team.dispose()


@pytest.mark.e2e
def test_dispatch_goes_on_while_a_source_table_is_locked(team_url: str, tmp_path: Path) -> None:
    """Issue 38 finding 9: while the team holds ``LOCK TABLE ... ACCESS EXCLUSIVE`` on a
    source's table, an unrelated JSONL backlog is dispatched and answered (call starts go
    on: the control threads never wait on the team's table), and the source's own rows
    follow once the lock is released. Ready lists off, so every call needs a dispatch round."""
    team = sa.create_engine(team_url)
    schema = legacy_schema(team)
    add_rows(team, 5, table=f"{schema}.prompts")
    p = Pipeline(tmp_path / "logs", extra_env={"BALANCER_READY_PER_SLOT": "0", "BALANCER_INGEST_TICK": "0.2",
                                               "BALANCER_HEDGE_BUDGET": "0"})
    try:
        p.start()
        assert main(["source", "import", str(source_file(tmp_path, {"crm": f"{schema}.prompts"}))]) == 0

        def solved_rows() -> int:
            with team.connect() as conn:
                return int(conn.exec_driver_sql(
                    f"SELECT count(*) FROM \"{schema}\".prompts WHERE status = 'solved'").scalar_one())

        wait_for(f"the source's first rows were not answered; logs in {p.log_dir}", lambda: solved_rows() == 5, 60)
        with team.connect() as holder:
            holder.exec_driver_sql(f'LOCK TABLE "{schema}".prompts IN ACCESS EXCLUSIVE MODE')
            names = [m.name for m in p.models]
            backlog = p.submit([{**line, "source": "jsonl"} for line in prompt_lines(300, names, pinned_every=0)])

            def answered() -> int:
                with p.services.engine.connect() as conn:
                    return int(conn.execute(sa.select(sa.func.count()).where(
                        tasks.c.id.in_(backlog), tasks.c.status == "solved")).scalar_one())

            # On the old dispatcher both control threads sat in the locked read after two ingest
            # ticks, and no call started until the team's lock went (or 60 s of statement timeout).
            wait_for(f"dispatch stopped behind the locked source table: {answered()} of 300 answered; "
                     f"logs in {p.log_dir}", lambda: answered() == 300, 40)
            holder.rollback()
        add_rows(team, 5, 100, table=f"{schema}.prompts")
        wait_for(f"the source's rows after the lock were not answered; logs in {p.log_dir}",
                 lambda: solved_rows() == 10, 60)
    finally:
        p.stop()
        team.dispose()


def test_a_source_table_that_cannot_be_read_says_why_in_status(team_url: str, tmp_path: Path, monkeypatch,  # noqa: ANN001
                                                                capsys) -> None:  # noqa: ANN001
    """Issue 41 finding 3: with the dispatcher missing the table's URL variable, the source's
    read failed every tick and only the dispatcher's log said so; `status` showed a cursor
    lag. Now the read's error is the source's health ("table unreadable: ...") in `status`
    (and top, metrics, the console: one look, read_health), and it goes when a read succeeds."""
    import json

    from balancer.sources.ingest import quota_bursts
    from balancer.sources.store import all_sources

    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("a", 4, 100_000)])
    team = sa.create_engine(team_url)
    schema = legacy_schema(team)
    add_rows(team, 3, table=f"{schema}.prompts")
    assert main(["source", "import", str(source_file(tmp_path, {"legacy": f"{schema}.prompts"}))]) == 0
    capsys.readouterr()
    assert main(["status"]) == 0  # imported, never read: its rows are not tasks yet, so not "eta: done"
    assert "eta: nothing else to run; the rows of source legacy (not read to its end yet), not in the eta" in \
        capsys.readouterr().out
    monkeypatch.delenv("LEGACY_DATABASE_URL")
    poller = SourcePoller(svc)
    assert poller.poll() == ["legacy"]
    poller.join(30)
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    reasons = json.loads(capsys.readouterr().out)["health"]["sources"]["legacy"]
    assert [r["kind"] for r in reasons] == ["unreadable"] and "LEGACY_DATABASE_URL" in reasons[0]["text"], reasons
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "table unreadable" in out
    # Its rows were never read: the ETA is not "done" (a new user read "eta: done" beside it).
    assert "eta: nothing else to run; the rows of source legacy (its table could not be read), not in the eta" in out
    assert main(["source", "list"]) == 0  # source list says it too (a new user's probe found it silent)
    assert "; table unreadable: " in capsys.readouterr().out
    assert main(["source", "list", "--json"]) == 0
    assert "LEGACY_DATABASE_URL" in json.loads(capsys.readouterr().out)[0]["read_error"]

    monkeypatch.setenv("LEGACY_DATABASE_URL", team_url)
    with svc.engine.connect() as conn:
        [definition] = [d for d in all_sources(conn) if d.name == "legacy"]
    from balancer.sources.ingest import ingest_logged

    assert ingest_logged(svc, definition, quota_bursts(svc)) is not None
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    assert "legacy" not in json.loads(capsys.readouterr().out)["health"]["sources"]
    assert main(["status"]) == 0  # read to its end: its rows are tasks, in the eta
    assert "not in the eta" not in capsys.readouterr().out
    assert main(["source", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["read_error"] is None
    team.dispose()
