"""Start, watch and stop the pipeline's processes: ``balancer run``, the demo, benchmarks, tests.

:func:`pipeline_plan` says which processes make the pipeline (the dispatcher, the
workers: one process for every model or one per model, and beat); a
:class:`Supervisor` starts them, each logging to a file of its own. Each child
runs in its own process group so stopping it also stops anything it spawned;
:meth:`Supervisor.stop_all` sends SIGTERM, waits, then SIGKILLs, and runs on
normal exit, on exceptions and on Ctrl-C (the caller uses it as a context
manager). Children also get SIGTERM if the supervisor itself is killed outright
(Linux parent-death signal), so nothing is orphaned. With ``restart_dead``, a
child that exits on its own is started again, after a pause that doubles while
it keeps dying within a minute of its start (:func:`restart_delay`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
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


@dataclass(frozen=True)
class Planned:
    """One process of the pipeline: its name (and log file's) and its ``balancer`` arguments."""

    name: str
    argv: tuple[str, ...]


def pipeline_plan(models: list[str] | None, loglevel: str = "INFO") -> list[Planned]:
    """The pipeline's processes: the dispatcher, the workers (``models`` None: one
    process for every model, which also takes models created later; else one process
    per model named) and beat, in the order they start.

    >>> [p.name for p in pipeline_plan(None)]
    ['dispatcher', 'workers', 'beat']
    >>> [" ".join(p.argv) for p in pipeline_plan(["a", "b"], "WARNING")][1:3]
    ['worker --model a --loglevel WARNING', 'worker --model b --loglevel WARNING']
    """
    level = ("--loglevel", loglevel)
    workers = ([Planned("workers", ("worker", "--all-models", *level))] if models is None
               else [Planned(f"worker-{m}", ("worker", "--model", m, *level)) for m in models])
    return [Planned("dispatcher", ("dispatcher", *level)), *workers, Planned("beat", ("beat", *level))]


#: A child that lived this long before it exited is restarted at once; one that died sooner waits.
STEADY_S = 60.0


def restart_delay(restarts_in_a_row: int, *, first: float = 1.0, cap: float = 30.0) -> float:
    """Seconds to wait before starting a child again that died within :data:`STEADY_S`
    of its start, ``restarts_in_a_row`` times so far (a bad setting must not spin).

    >>> [restart_delay(n) for n in (0, 1, 2, 5, 9)]
    [0.0, 1.0, 2.0, 16.0, 30.0]
    """
    return 0.0 if restarts_in_a_row <= 0 else min(cap, first * 2 ** (restarts_in_a_row - 1))


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path
    argv: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    launch: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)
    #: Restarts after short lives in a row (reset by a life of STEADY_S or more).
    quick_deaths: int = 0


@dataclass
class Supervisor:
    log_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    children: list[Child] = field(default_factory=list)
    #: Like docker's ``restart: unless-stopped``: bring back a child that exits on its own.
    restart_dead: bool = False
    restarts: list[str] = field(default_factory=list)
    #: Dead children waiting for their restart: (when, the child that died).
    waiting: list[tuple[float, Child]] = field(default_factory=list)
    #: The children's working directory (None: this process's). ``python -m`` puts it first on
    #: sys.path, so a child runs the ``balancer`` found there ahead of PYTHONPATH's.
    cwd: Path | None = None

    def __enter__(self) -> Supervisor:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str], extra_env: Mapping[str, str] | None = None,
              launch: Sequence[str] = ()) -> Child:
        """Run ``python -m balancer <argv>`` in its own process group, logging to ``<name>.log``;
        ``launch`` goes before it (``ip netns exec NAME``: on a host of a test's network)."""
        log = self.log_dir / f"{name}.log"
        command = [*launch, sys.executable, "-m", "balancer", *argv]
        proc = subprocess.Popen(  # noqa: S603 - an argv list this module builds: no shell, no user input
            command,
            env={**self.env, **(extra_env or {})},
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        child = Child(name, proc, log, list(argv), dict(extra_env or {}), list(launch))
        self.children.append(child)
        return child

    def check_alive(self) -> list[str]:
        """Raise if a child died (unless ``restart_dead``: then restart it when its pause is
        over); returns what happened this time, one line each (for a supervisor's output)."""
        events = []
        for child in list(self.children):
            code = child.process.poll()
            if code is None:
                continue
            if self.restart_dead:
                self.children.remove(child)
                self.kill(child)  # stray grandchildren
                quick = time.monotonic() - child.started_at < STEADY_S
                child.quick_deaths = child.quick_deaths + 1 if quick else 0
                pause = restart_delay(child.quick_deaths if quick else 0)
                self.waiting.append((time.monotonic() + pause, child))
                self.restarts.append(f"{child.name} (exit {code})")
                events.append(f"{child.name} exited (code {code}); restarting it "
                              f"{f'in {pause:g} s' if pause else 'now'} (log: {child.log})")
                continue
            tail = child.log.read_text(errors="replace")[-2000:] if child.log.exists() else ""
            raise RuntimeError(f"{child.name} exited with code {code}:\n{tail}")
        now = time.monotonic()
        for due, dead in [w for w in self.waiting if w[0] <= now]:
            self.waiting.remove((due, dead))
            child = self.start(dead.name, dead.argv, dead.extra_env, dead.launch)
            child.quick_deaths = dead.quick_deaths
            events.append(f"{child.name} started again (pid {child.process.pid})")
        return events

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
        self.waiting.clear()
        for child in reversed(list(self.children)):
            self.stop(child)

    def stop_gracefully(self, grace: float, cut: threading.Event) -> list[Child]:
        """SIGTERM every child at once (a worker then starts no new call and finishes those in
        flight), wait until all have exited, ``grace`` seconds have passed or ``cut`` is set, then
        SIGKILL the rest. Returns those killed."""
        self.waiting.clear()
        for child in self.children:
            self.kill(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.process.poll() is None for c in self.children) and time.monotonic() < deadline \
                and not cut.wait(0.2):
            pass
        killed = [c for c in self.children if c.process.poll() is None]
        for child in list(self.children):
            self.stop(child, timeout=0)
        return killed

    def start_plan(self, plan: list[Planned], extra_env: Mapping[str, str] | None = None) -> list[Child]:
        """Start each planned process (:func:`pipeline_plan`), in order."""
        return [self.start(p.name, list(p.argv), extra_env) for p in plan]


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
