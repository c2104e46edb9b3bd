"""Start and stop the pipeline's processes (demo, benchmarks, end-to-end tests).

Each child runs in its own process group so stopping it also stops anything
it spawned; :meth:`Supervisor.stop_all` sends SIGTERM, waits, then SIGKILLs,
and runs on normal exit, on exceptions and on Ctrl-C (the caller uses it as a
context manager). Children also get SIGTERM if the supervisor itself is
killed outright (Linux parent-death signal), so nothing is orphaned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGTERM this child when the supervisor dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the supervisor's own cleanup still runs
        return


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path
    argv: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass
class Supervisor:
    log_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    children: list[Child] = field(default_factory=list)
    #: Like docker's ``restart: unless-stopped``: bring back a child that exits on its own.
    restart_dead: bool = False
    restarts: list[str] = field(default_factory=list)

    def __enter__(self) -> Supervisor:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str], extra_env: Mapping[str, str] | None = None) -> Child:
        """Run ``python -m balancer <argv>`` in its own process group, logging to ``<name>.log``."""
        log = self.log_dir / f"{name}.log"
        command = [sys.executable, "-m", "balancer", *argv]
        proc = subprocess.Popen(
            command,
            env={**self.env, **(extra_env or {})},
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        child = Child(name, proc, log, list(argv), dict(extra_env or {}))
        self.children.append(child)
        return child

    def check_alive(self) -> None:
        for child in list(self.children):
            code = child.process.poll()
            if code is None:
                continue
            if self.restart_dead:
                self.children.remove(child)
                self.restarts.append(f"{child.name} (exit {code})")
                self.start(child.name, child.argv, child.extra_env)
                continue
            tail = child.log.read_text(errors="replace")[-2000:] if child.log.exists() else ""
            raise RuntimeError(f"{child.name} exited with code {code}:\n{tail}")

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(child.process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, child: Child, timeout: float = 5.0) -> None:
        if child.process.poll() is None:
            self.kill(child, signal.SIGTERM)
            try:
                child.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill(child, signal.SIGKILL)
                child.process.wait(timeout=5)
        else:
            self.kill(child, signal.SIGKILL)  # stray grandchildren
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        for child in reversed(list(self.children)):
            self.stop(child)


def wait_for_http(url: str, timeout: float = 30.0, child: Child | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.TransportError:
            if child is not None and child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited: {child.log.read_text(errors='replace')[-2000:]}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
