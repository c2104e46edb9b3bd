"""Connection URLs: every broker URL kombu takes for Redis or AMQP is accepted,
and a query option the client does not understand is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from balancer.errors import ConfigError
from balancer.settings import Settings


def balancer(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "balancer", *argv], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def with_option(url: str, option: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{option}"


@pytest.mark.parametrize(("setting", "option"), [
    ("BALANCER_REDIS_URL", "foo=bar"),
    ("BALANCER_REDIS_URL", "ssl_cert_reqs=none"),
    ("BALANCER_DATABASE_URL", "foo=bar"),
    ("BALANCER_BROKER_URL", "foo=bar"),
])
def test_an_unknown_url_option_is_one_line_and_exit_2(migrated: dict[str, str], setting: str, option: str) -> None:
    base = {"BALANCER_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672//"}.get(setting) or migrated[setting]
    proc = balancer({setting: with_option(base, option)}, "quota", "list")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and setting in lines[0], proc.stderr
    assert option.partition("=")[0] in lines[0]
    # The same URL without the option works: the option alone was refused.
    assert balancer({setting: base}, "quota", "list").returncode == 0


@pytest.mark.parametrize("url", [
    "redis+socket:///run/redis/redis.sock",
    "redis+socket:///run/redis/redis.sock?virtual_host=2",
    "sentinel://h1:26379,h2:26379/mymaster/0",
    "rediss://:pw@h:6380/0?ssl_cert_reqs=required",
    "redis://h:6379/0;redis://h2:6379/0",
    "amqp://guest:guest@h:5672//",
    "amqps://u:p@h:5671/vhost?heartbeat=10",
    "pyamqp://u:p@h//",
])
def test_every_redis_and_amqp_broker_url_kombu_accepts_is_accepted(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("BALANCER_BROKER_URL", url)
    assert Settings.from_env().broker_url == url


@pytest.mark.parametrize("url", ["redis://h:6379/0?foo=1", "amqp://h//?bogus=1", "kafka://h:9092",
                                 "redis://h:6379/abc"])
def test_broker_urls_kombu_would_refuse_are_refused(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("BALANCER_BROKER_URL", url)
    with pytest.raises(ConfigError, match="BALANCER_BROKER_URL"):
        Settings.from_env()


def test_a_redis_broker_on_a_unix_socket_carries_messages(env: dict[str, str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``redis+socket://`` to a real Redis on a unix socket: accepted, and a
    message sent through it lands there under the namespace's prefix."""
    from celery import Celery

    from balancer.admission import keys
    from balancer.devtools.embedded import redis_server_binary
    from celeryconfig import from_settings

    sock = tmp_path / "redis.sock"
    server = subprocess.Popen([redis_server_binary(), "--port", "0", "--unixsocket", str(sock), "--save", "",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(unix_socket_path=str(sock))
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        monkeypatch.setenv("BALANCER_BROKER_URL", f"redis+socket://{sock}")
        settings = Settings.from_env()
        conf = from_settings(settings)
        assert conf["broker_transport_options"]["global_keyprefix"] == keys.broker_prefix(env["BALANCER_NAMESPACE"])
        app = Celery("probe")
        app.conf.update(conf)
        app.send_task("balancer.dispatch", queue="control")
        deadline = time.monotonic() + 10
        while not client.keys(keys.broker_prefix(env["BALANCER_NAMESPACE"]) + "*"):
            assert time.monotonic() < deadline, "no message reached the Redis on the socket"
            time.sleep(0.05)
        client.close()
    finally:
        server.terminate()
        server.wait(timeout=10)
