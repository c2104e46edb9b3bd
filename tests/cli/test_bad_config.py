"""Config errors and secrets: one line naming the setting, passwords masked, never a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults

ROOT = Path(__file__).parents[2]


def balancer(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "balancer", *argv], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0]


def test_malformed_database_url(env: dict[str, str]) -> None:
    proc = balancer({"BALANCER_DATABASE_URL": "mysql://root:hunter2@db/x"}, "quota", "list")
    assert_one_line(proc, "BALANCER_DATABASE_URL", "***")
    assert "hunter2" not in proc.stderr
    proc = balancer({"BALANCER_DATABASE_URL": "postgresql://bob:hunter2@127.0.0.1:notaport/x"}, "quota", "list")
    assert_one_line(proc, "BALANCER_DATABASE_URL")
    assert "hunter2" not in proc.stderr


def test_malformed_redis_url_and_unknown_backend_kind(env: dict[str, str]) -> None:
    assert_one_line(balancer({"BALANCER_REDIS_URL": "http://x"}, "quota", "list"), "BALANCER_REDIS_URL")
    assert_one_line(balancer({"BALANCER_BACKEND_KIND": "carrier-pigeon"}, "quota", "list"), "BALANCER_BACKEND_KIND")
    assert_one_line(balancer({"BALANCER_LEASE_SECONDS": "soon"}, "quota", "list"), "BALANCER_LEASE_SECONDS")


def test_a_worker_needs_either_its_models_or_all_of_them(env: dict[str, str]) -> None:
    """Neither is an error, and so is both (--all-models would silently drop the --model)."""
    neither = balancer(env, "worker")
    assert_one_line(neither, "--model NAME", "--all-models")
    assert "not both" not in neither.stderr
    assert_one_line(balancer(env, "worker", "--all-models", "--model", "m"), "not both")


def test_wrong_redis_password(env: dict[str, str], tmp_path: Path) -> None:
    from balancer.devtools.embedded import free_port, redis_server_binary

    port = free_port()
    server = subprocess.Popen([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                               "--requirepass", "right-one", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        import time

        time.sleep(0.5)
        proc = balancer({"BALANCER_REDIS_URL": f"redis://:wrong-one@127.0.0.1:{port}/0"}, "quota", "list")
        assert_one_line(proc, "BALANCER_REDIS_URL", "redis://***@127.0.0.1")
        assert "wrong-one" not in proc.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.faults
@pytest.mark.parametrize("setting", ["BALANCER_DATABASE_URL", "BALANCER_REDIS_URL"])
def test_a_server_that_accepts_but_never_answers_fails_in_seconds(env: dict[str, str], setting: str, reliability) -> None:
    """Connect and reply timeouts: one line and exit 2, not a hang."""
    import socket
    import time

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel completes the handshake; nothing ever answers
        port = listener.getsockname()[1]
        url = (f"postgresql://bob:hunter2@127.0.0.1:{port}/x" if setting == "BALANCER_DATABASE_URL"
               else f"redis://:hunter2@127.0.0.1:{port}/0")
        started = time.monotonic()
        proc = balancer({setting: url}, "quota", "list")
        took = time.monotonic() - started
        assert took < 30
    assert_one_line(proc, setting)
    assert "hunter2" not in proc.stderr
    reliability({
        "fault": f"{setting} points at a port that accepts but never answers",
        "injected": "a listening socket that completes the handshake and never replies; `balancer quota list`",
        "tasks": 0, "lost": 0, "double_written": 0, "repeated_calls": 0,
        "bound": f"one-line error and exit {proc.returncode} after {took:.1f} s (connect/reply timeouts), no hang",
        "recovery_s": "-", "died": "the command, by design (exit 2)",
    })


def test_missing_migration(env: dict[str, str]) -> None:
    assert_one_line(balancer({}, "quota", "list"), "balancer db upgrade")
    assert_one_line(balancer({}, "status"), "balancer db upgrade")


def test_database_password_never_in_json_output(migrated: dict[str, str]) -> None:
    """Trust auth here accepts any password, so a canary password travels the whole way."""
    import sqlalchemy as sa

    canary = "pw-CANARY-51d2"
    url = sa.engine.make_url(migrated["BALANCER_DATABASE_URL"]).set(password=canary)
    env = {"BALANCER_DATABASE_URL": url.render_as_string(hide_password=False)}
    assert balancer(env, "quota", "set", "m", "--create", "--tpm", "10", "--concurrency", "1").returncode == 0
    for argv in (("quota", "list", "--json"), ("status", "--json"), ("quota", "export")):
        proc = balancer(env, *argv)
        assert proc.returncode == 0, proc.stderr
        assert canary not in proc.stdout + proc.stderr


def test_servers_bind_to_loopback_by_default() -> None:
    from balancer.cli.processes import sim

    host = next(p for p in sim.params if p.name == "host")
    assert host.default == "127.0.0.1"
    embedded = (ROOT / "balancer" / "devtools" / "embedded.py").read_text()
    assert '"--bind", "127.0.0.1"' in embedded


def test_sql_is_built_by_sqlalchemy_with_bound_parameters() -> None:
    """No SQL assembled from Python strings: no f-strings or % formatting inside text()."""
    offenders = []
    for path in (ROOT / "balancer").rglob("*.py"):
        source = path.read_text()
        for match in re.finditer(r"text\(\s*(f[\"']|[\"'][^\"']*[\"']\s*%|[\"'][^\"']*[\"']\s*\.format)", source):
            offenders.append(f"{path.relative_to(ROOT)}:{source[:match.start()].count(chr(10)) + 1}")
        # The backlog benchmark bulk-loads with COPY (a constant statement) through
        # psycopg2's cursor; it is harness code and never sees user input. status's
        # read-only connection (storage/dbapi.py) runs the read queries' constants, their
        # values bound by psycopg2 as the engine binds them (storage/rows.py).
        in_bench = path.is_relative_to(ROOT / "balancer" / "bench")
        reads_only = path == ROOT / "balancer" / "storage" / "dbapi.py"
        if ("cursor()" in source or ".raw_connection(" in source) and not (in_bench or reads_only):
            offenders.append(f"{path.relative_to(ROOT)}: raw DB-API cursor")
    assert offenders == []


def test_a_redis_url_pointing_at_an_http_server(env: dict[str, str]) -> None:
    """Not Redis at all: its reply is a protocol error, reported in one line."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = balancer({"BALANCER_REDIS_URL": f"redis://:pw@127.0.0.1:{server.server_address[1]}/0"}, "quota", "list")
        assert_one_line(proc, "BALANCER_REDIS_URL", "redis://***@127.0.0.1")
    finally:
        server.shutdown()


def test_the_urls_own_options_survive_the_engines_timeouts(database_url: str) -> None:
    """make_engine adds a statement timeout through libpq `options`; a URL's own
    `options` (the tests' search_path, a user's role settings) must still apply."""
    import sqlalchemy as sa

    from balancer.storage.db import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            schema = conn.execute(sa.text("SELECT current_schema()")).scalar_one()
            timeout = conn.execute(sa.text("SHOW statement_timeout")).scalar_one()
    finally:
        engine.dispose()
    assert schema == sa.engine.make_url(database_url).query["options"].split("=", 1)[1]
    assert timeout == "1min"


def test_a_port_in_use_is_one_line_before_any_line_that_says_it_serves(migrated: dict[str, str]) -> None:
    """`sim`, `web` and `router` bind their port before they say they serve (before: the line
    "... on http://127.0.0.1:PORT", then uvicorn's error, and exit 3)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for command in ("sim", "web", "router"):
            assert_one_line(balancer(migrated, command, "--port", port), f"127.0.0.1:{port}", "in use")


def test_a_balancer_home_that_cannot_hold_the_embedded_stack(tmp_path: Path) -> None:
    """Before: a traceback (NotADirectoryError, exit 1) from the embedded Redis's start."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for home in (afile, afile / "sub"):
        assert_one_line(balancer({"BALANCER_HOME": str(home), "BALANCER_REDIS_URL": "", "BALANCER_DATABASE_URL": ""},
                                 "status"), "BALANCER_HOME", str(home), "Not a directory")


def test_run_with_a_log_directory_it_cannot_create_is_one_line(migrated: dict[str, str], tmp_path: Path) -> None:
    """A file where the logs would go, or a path nobody may create: one line and exit 2, before any
    process starts (the supervisor's mkdir raised a traceback)."""
    assert balancer({}, "quota", "set", "m", "--create", "--tpm", "10", "--concurrency", "1").returncode == 0
    a_file = tmp_path / "tasks.jsonl"
    a_file.write_text("")
    assert_one_line(balancer({"BALANCER_HOME": str(a_file)}, "run"), "cannot create the log directory",
                    str(a_file / "logs"))
    assert_one_line(balancer({}, "run", "--log-dir", "/proc/balancer-nope"), "cannot create the log directory")
