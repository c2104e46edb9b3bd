"""The write-back to the team's own table (issue 38): ``where`` checked as one
condition, one refused row failing alone with a terminal state, a fence on
every write-back, and the command for the rows left unwritable. Real
PostgreSQL: the team's table in a throwaway database (or schema) per test."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.domain.quota import Quota
from balancer.services import Services
from balancer.settings import Settings
from balancer.sources.ingest import ingest_sources
from balancer.sources.schema import sources
from balancer.sources.writeback import drain
from tests.legacy import SOURCE_FILE, legacy_database, legacy_schema
from tests.test_sources import Legacy, import_legacy, run, solve_pending


@pytest.fixture
def svc(migrated) -> Services:  # noqa: ANN001
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([Quota("a", 4, 100_000)])
    return services


@pytest.fixture(scope="module")
def legacy_url(service_urls) -> Iterator[str]:  # noqa: ANN001
    with legacy_database(service_urls[1]) as url:
        yield url


@pytest.fixture
def legacy(legacy_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Legacy]:
    monkeypatch.setenv("LEGACY_DATABASE_URL", legacy_url)
    engine = sa.create_engine(legacy_url)
    yield Legacy(engine, legacy_schema(engine))
    engine.dispose()


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
])
def test_a_where_that_leaves_its_parentheses_or_is_not_one_side_effect_free_condition_is_refused_at_import(
        svc: Services, legacy: Legacy, tmp_path: Path, capsys, where: str, message: str) -> None:  # noqa: ANN001
    """Issue 38 finding 2: ``status = 'unsolved') OR (status = 'unsolved'`` passed every
    import check and its write-back wrote one answer into every row. It is refused at
    ``source import`` in one line, as is a where whose parentheses only balance when a
    string literal is misread, and one with a side effect."""
    legacy.add(3)
    path = source_file(tmp_path, legacy.table, where=json.dumps(where.format(schema=legacy.schema)))
    code, _, err = run(capsys, "source", "import", str(path))
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sources)).scalar_one() == 0


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
