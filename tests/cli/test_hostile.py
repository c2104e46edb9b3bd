"""Operator mistakes and hostile settings: one line, exit 2, and no secret printed.

The settings are refused at start, each in one line naming the setting. A
password reaches no output whatever characters it holds: URLs in errors show
scheme, host, port and database only, and a client library's message is
scrubbed of every piece of the credentials.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from balancer.errors import ConfigError
from balancer.settings import Settings
from balancer.urls import mask_url, scrub

BAD_SETTINGS = [
    ("BALANCER_BACKEND_TIMEOUT", "nan"),
    ("BALANCER_BACKEND_TIMEOUT", "inf"),
    ("BALANCER_BACKEND_TIMEOUT", "0"),
    ("BALANCER_DISPATCH_TICK", "0.000001"),
    ("BALANCER_INGEST_TICK", "-1"),
    ("BALANCER_LEASE_SECONDS", "1000000000"),
    ("BALANCER_BACKEND_URL", "notaurl"),
    ("BALANCER_BACKEND_URL", "http://"),
    ("BALANCER_REDIS_URL", "redis://127.0.0.1:6379/abc"),
    ("BALANCER_BROKER_URL", "garbage://x"),
    ("BALANCER_DATABASE_URL", "mysql://u@h/db"),
    ("BALANCER_END_GAME", "\x1b[31msometimes"),
]


@pytest.mark.parametrize(("name", "value"), BAD_SETTINGS)
def test_a_bad_setting_is_refused_in_one_line_naming_it(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        Settings.from_env()
    message = str(caught.value)
    assert name in message and "\n" not in message and "\x1b" not in message


def test_a_bad_setting_stops_the_cli_with_exit_2_and_no_traceback() -> None:
    env = {**os.environ, "BALANCER_BACKEND_TIMEOUT": "nan"}
    done = subprocess.run([sys.executable, "-m", "balancer", "status"], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "BALANCER_BACKEND_TIMEOUT" in done.stderr


CANARY = "Kn4ry#?/@:%zz"
password_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), min_codepoint=0x21), min_size=1, max_size=20)


@given(password=password_text)
def test_mask_url_never_shows_the_password(password: str) -> None:
    secret = "SECRET" + password
    for url in (f"redis://:{secret}@db.example:6379/0", f"postgresql://bob:{secret}@db.example:5432/app?sslmode=require",
                f"amqp://bob:{quote(secret, safe='')}@mq.example:5672//"):
        masked = mask_url(url)
        assert "SECRET" not in masked and "bob" not in masked
        assert masked.split("@")[-1].startswith(("db.example:", "mq.example:"))


def test_scrub_removes_every_piece_of_the_credentials() -> None:
    url = f"postgresql://bob:{CANARY}@db:5432/app"
    messages = [f'could not translate host name "{CANARY.split("@")[-1]}" to address',
                f"Port could not be cast to integer value as '{CANARY[:6]}'", f"invalid dsn {url}"]
    for message in messages:
        assert "Kn4ry" not in scrub(message, url)


URL_SETTINGS = ["BALANCER_REDIS_URL", "BALANCER_DATABASE_URL", "BALANCER_BROKER_URL", "BALANCER_BACKEND_URL"]


def canary_url(setting: str, encoded: bool) -> str:
    secret = quote(CANARY, safe="") if encoded else CANARY
    scheme = {"BALANCER_REDIS_URL": "redis", "BALANCER_DATABASE_URL": "postgresql", "BALANCER_BROKER_URL": "redis",
              "BALANCER_BACKEND_URL": "http"}[setting]
    return f"{scheme}://user:{secret}@127.0.0.1:1/0"  # port 1: nothing listens, every connection fails


@pytest.mark.e2e
@pytest.mark.usefixtures("migrated")
@pytest.mark.parametrize("setting", URL_SETTINGS)
def test_a_canary_password_appears_in_no_output(tmp_path: Path, setting: str) -> None:
    """Each URL setting in turn holds a password with ``#?/@:%``, raw and
    percent-encoded, pointing where nothing listens; every command's output,
    error or not, is free of it."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "hello"}\n')
    commands = [["status"], ["status", "--json"], ["quota", "list", "--json"], ["submit", str(tasks)], ["db", "upgrade"]]
    for encoded in (False, True):
        env = {**os.environ, setting: canary_url(setting, encoded), "BALANCER_HOME": str(tmp_path)}
        for argv in commands:
            done = subprocess.run([sys.executable, "-m", "balancer", *argv], env=env, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL, timeout=120)
            output = done.stdout + done.stderr
            assert done.returncode in (0, 2, 3), (argv, output)
            assert "Traceback" not in output, (argv, output)
            for piece in ("Kn4ry", quote(CANARY, safe="")[:8]):
                assert piece not in output, (setting, encoded, argv, output)
    assert "Kn4ry" not in stored_text(), "the canary reached Redis or PostgreSQL"


def stored_text() -> str:
    """Everything this test's namespace holds in Redis and its schema holds in PostgreSQL, as text."""
    import redis
    import sqlalchemy as sa

    from balancer.admission import keys
    from balancer.storage.db import cached_engine
    from balancer.storage.schema import metadata

    client = redis.Redis.from_url(os.environ["BALANCER_REDIS_URL"])
    parts = []
    for pattern in keys.namespace_patterns(os.environ["BALANCER_NAMESPACE"]):
        for key in client.scan_iter(match=pattern):
            parts.append(repr(client.dump(key)))
    with cached_engine(os.environ["BALANCER_DATABASE_URL"]).connect() as conn:
        for table in metadata.sorted_tables:
            parts.extend(repr(row) for row in conn.execute(sa.select(table)))
    return "\n".join(parts)


def test_the_embedded_stack_stops_the_redis_it_started_when_postgres_cannot_start(tmp_path: Path) -> None:
    """pgserver cannot start (its data directory is a file): one error naming it,
    and the redis-server this call started is stopped, not left running."""
    from balancer.devtools.embedded import ensure_stack
    from balancer.errors import ServiceUnavailable

    (tmp_path / "pg").write_text("not a directory")
    with pytest.raises(ServiceUnavailable, match="embedded PostgreSQL"):
        ensure_stack(tmp_path)
    port = int((tmp_path / "redis" / "redis.port").read_text())
    deadline = time.monotonic() + 10
    while redis_answers(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not redis_answers(port)


def redis_answers(port: int) -> bool:
    import redis

    try:
        # from_url: a client with no retries (redis.Redis(port=...) retries a refused connection for ~4 s)
        return bool(redis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.5).ping())
    except redis.ConnectionError:
        return False
