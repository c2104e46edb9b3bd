"""The chaos run's hands: start and end each fault of the schedule (I/O).

Overlapping faults of one kind compose: a process killed twice is restarted
once, at the later end; the backend's injected statuses are the union of the
faults active; the proxy forwards again when the last stall ends; a quota
returns to its original limits when no lowering or removal of it remains.
Every action is noted, in seconds from the fault window's start, for the report;
kills keep their Unix time, for the witness. An operator command that could not
reach a service is run again, as a person would after its one-line error.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from balancer.admission.quota import Quota
from balancer.bench.chaos.plan import Fault
from balancer.devtools.embedded import RedisProcess, start_redis
from balancer.devtools.tcpproxy import StallProxy
from balancer.storage.dbapi import MAY_COME_BACK
from balancer.supervisor import Child, Supervisor

#: How long the injector, as an operator, keeps running again a command that could not reach a service.
OPERATOR_PATIENCE_S = 60.0
#: How long one run of an operator command may take.
COMMAND_TIMEOUT_S = 60.0


def may_come_back(output: str) -> bool:
    """Whether a ``balancer`` command's output says a service is out of reach for now
    (down, restarting: the signs of :data:`MAY_COME_BACK`, or a Redis timeout), not
    refused for good (a bad URL or password) or for another reason.

    >>> may_come_back("error: cannot reach Redis at redis://h:1/0 (BALANCER_REDIS_URL): Error 111 connecting"
    ...               " to h:1. Connection refused.")
    True
    >>> may_come_back("error: lost Redis at redis://h:1/0: Timeout reading from socket")
    True
    >>> may_come_back("error: cannot reach Redis at redis://h:1/0 (BALANCER_REDIS_URL): invalid password")
    False
    >>> may_come_back("error: unknown model 'x': add it with --create")
    False
    """
    for line in output.splitlines():
        said = line.lower()
        if said.startswith("error: ") and ("cannot reach" in said or "lost redis at" in said):
            if any(sign in said for sign in (*MAY_COME_BACK, "timeout")):
                return True
    return False


@dataclass
class Injector:
    supervisor: Supervisor
    redis_servers: list[RedisProcess]  # the current one last
    redis_port: int
    redis_dir: Path
    proxy: StallProxy
    backend_url: str
    quotas: Mapping[str, Quota]  # the original limits
    inbox: Path
    cli_env: dict[str, str]
    inbox_lines: Callable[[int, int], list[str]]  # (file number, lines) -> JSONL lines
    kills: list[tuple[str, float]] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    inbox_tasks: int = 0
    _down: dict[str, Child] = field(default_factory=dict)  # killed, awaiting restart
    _stalls: int = 0
    _backend: list[Fault] = field(default_factory=list)
    _quota_faults: list[Fault] = field(default_factory=list)
    _removed: set[str] = field(default_factory=set)  # models whose quota a fault removed, not yet created again
    _redis_down: int = 0
    _files: int = 0
    # one operator: commands run in the order issued (a re-creation never overtakes a removal still retried)
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1))
    _pending: list[Future] = field(default_factory=list)
    t0: float = field(default_factory=time.time)  # the fault window's start: actions are noted from it

    @property
    def removing(self) -> frozenset[str]:
        """Models a `quota remove` fault was issued for and that are not yet created again."""
        return frozenset(self._removed)

    def note(self, text: str) -> None:
        self.actions.append(f"+{time.time() - self.t0:7.1f}s  {text}")

    # -- start and end -----------------------------------------------------------
    def begin(self, fault: Fault) -> None:
        kind = fault.kind
        if kind.startswith("kill_"):
            self._kill({"kill_worker": f"worker-{fault.model}", "kill_dispatcher": "dispatcher", "kill_beat": "beat"}[kind])
        elif kind == "redis_restart":
            self._redis_down += 1
            if self._redis_down == 1:
                os.kill(self.redis_servers[-1].pid, signal.SIGKILL)
                self.note("redis killed")
        elif kind == "redis_drop":
            self._drop_clients()
        elif kind == "pg_stall":
            self._stalls += 1
            self.proxy.stall()
            self.note("workers' PostgreSQL stalled")
        elif kind in ("backend_outage", "backend_500"):
            self._backend.append(fault)
            self._post_backend_faults()
        elif kind in ("quota_lower", "quota_remove"):
            self._quota_faults.append(fault)
            assert fault.model is not None
            if kind == "quota_remove":
                self._removed.add(fault.model)
                self._cli(["quota", "remove", fault.model, "--force", "--by", "chaos"])
            else:
                q = self.quotas[fault.model]
                self._cli(["quota", "set", fault.model, "--by", "chaos",
                           "--concurrency", str(max(1, int(q.max_concurrent_requests * fault.share))),
                           "--tpm", str(max(1, int(q.max_tokens_per_minute * fault.share)))])
        elif kind == "inbox_file":
            self._drop_inbox_file(fault.lines)

    def end(self, fault: Fault) -> None:
        kind = fault.kind
        if kind.startswith("kill_"):
            name = {"kill_worker": f"worker-{fault.model}", "kill_dispatcher": "dispatcher", "kill_beat": "beat"}[kind]
            self._restart(name)
        elif kind == "redis_restart":
            self._redis_down -= 1
            if self._redis_down == 0:
                self.redis_servers.append(
                    start_redis(self.redis_dir / f"after-{int(time.time() * 1000)}", port=self.redis_port))
                self.note("redis restarted empty")
        elif kind == "pg_stall":
            self._stalls -= 1
            if self._stalls == 0:
                self.proxy.resume()
                self.note("workers' PostgreSQL forwarding again")
        elif kind in ("backend_outage", "backend_500"):
            self._backend.remove(fault)
            self._post_backend_faults()
        elif kind in ("quota_lower", "quota_remove"):
            self._quota_faults.remove(fault)
            assert fault.model is not None
            if not any(f.model == fault.model for f in self._quota_faults):
                # whichever of overlapping faults on the model ends last restores it: created
                # again if one of them removed it (seed 438828233: a lowering that outlasted a
                # removal restored with a plain `quota set`, refused, and the model never came back)
                self._restore_quota(fault.model, removed=fault.model in self._removed)
                self._removed.discard(fault.model)

    # -- processes ---------------------------------------------------------------
    def _kill(self, name: str) -> None:
        if name in self._down:
            self.note(f"{name} already down")
            return
        child = next((c for c in self.supervisor.children if c.name == name), None)
        if child is None:
            self.note(f"{name} not running")
            return
        self.supervisor.kill(child, signal.SIGKILL)
        self.kills.append((name, time.time()))
        child.process.wait(timeout=10)
        self.supervisor.children.remove(child)
        self._down[name] = child
        self.note(f"kill -9 {name} (pid {child.process.pid})")

    def _restart(self, name: str) -> None:
        child = self._down.pop(name, None)
        if child is None:
            return
        self.supervisor.start(child.name, child.argv, child.extra_env)
        self.note(f"{name} restarted")

    def is_down(self, name: str) -> bool:
        return name in self._down

    def restart_all(self) -> None:
        for name in list(self._down):
            self._restart(name)

    # -- Redis, the backend, quotas, the inbox ------------------------------------
    def _drop_clients(self) -> None:
        if self._redis_down:
            self.note("client kill skipped: Redis is down")
            return
        client = redis.Redis.from_url(self.redis_servers[-1].url, socket_timeout=5)
        try:
            dropped = sum(int(client.execute_command("CLIENT", "KILL", "TYPE", kind, "SKIPME", "yes"))
                          for kind in ("normal", "pubsub"))
            self.note(f"CLIENT KILL dropped {dropped} connections")
        except redis.RedisError as exc:
            self.note(f"client kill failed: {exc}")
        finally:
            client.close()

    def _post_backend_faults(self) -> None:
        status: dict[str, int] = {}
        if any(f.kind == "backend_outage" for f in self._backend):
            status["*"] = 503
        for f in self._backend:
            if f.kind == "backend_500" and f.model is not None:
                status[f.model] = 500
        httpx.post(f"{self.backend_url}/admin/faults", json={"status": status}, timeout=10).raise_for_status()
        self.note(f"backend faults now {status}")

    def _restore_quota(self, model: str, *, removed: bool) -> None:
        q = self.quotas[model]
        argv = ["quota", "set", model, "--by", "chaos", "--concurrency", str(q.max_concurrent_requests),
                "--tpm", str(q.max_tokens_per_minute), "--burst", str(q.burst)]
        if q.max_requests_per_minute is not None:
            argv += ["--rpm", str(q.max_requests_per_minute)]
        if q.burst_requests is not None:
            argv += ["--burst-requests", str(q.burst_requests)]
        self._cli([*argv, "--create"] if removed else argv)

    def _cli(self, argv: list[str]) -> None:
        """Run ``balancer <argv>`` as an operator would, off the chaos loop's thread: a
        command that could not reach a service (Redis killed meanwhile) is run again each
        second while OPERATOR_PATIENCE_S lasts, as its one-line error invites."""
        command = f"`balancer {' '.join(argv)}` (issued +{time.time() - self.t0:.1f}s)"

        def run() -> None:
            give_up_at = time.monotonic() + OPERATOR_PATIENCE_S
            for attempt in itertools.count(1):
                try:
                    done = subprocess.run([sys.executable, "-m", "balancer", *argv], env=self.cli_env,
                                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                                          stdin=subprocess.DEVNULL)
                except subprocess.TimeoutExpired:
                    self.note(f"{command} timed out after {COMMAND_TIMEOUT_S:.0f} s (attempt {attempt})")
                    return
                output = done.stdout + done.stderr
                errors = [line for line in output.splitlines() if line.startswith("error: ")]
                said = (errors or output.strip().splitlines()[-1:] or [""])[0]
                self.note(f"{command} exit {done.returncode} (attempt {attempt}): {said[:160]}")
                if done.returncode == 0 or not may_come_back(output):
                    return
                if time.monotonic() + 1.0 >= give_up_at:
                    self.note(f"{command} given up after {attempt} attempts")
                    return
                time.sleep(1.0)

        self._pending.append(self._pool.submit(run))

    def _drop_inbox_file(self, lines: int) -> None:
        self._files += 1
        self.inbox.mkdir(parents=True, exist_ok=True)
        temp = self.inbox / f".chaos-{self._files}.part"
        temp.write_text("\n".join(self.inbox_lines(self._files, lines)) + "\n")
        temp.rename(self.inbox / f"chaos-{self._files}.jsonl")
        self.inbox_tasks += lines
        self.note(f"inbox file chaos-{self._files}.jsonl with {lines} tasks")

    def settle(self) -> None:
        """Wait for the operator commands still queued or running (one at a time, each
        within its patience and its last attempt's timeout); a failure is noted, not raised."""
        for future in self._pending:
            try:
                future.result(timeout=OPERATOR_PATIENCE_S + COMMAND_TIMEOUT_S + 5.0)
            except Exception as exc:  # noqa: BLE001 - the run's report says what the operator could not do
                self.note(f"an operator command failed: {type(exc).__name__}: {exc}")
        self._pool.shutdown(wait=False, cancel_futures=True)


class RouterCallers:
    """Callers outside Celery: each takes a slot from ``balancer router``, calls the
    backend itself with a prompt of its own, and completes the slot, one call after
    another until :meth:`stop`. Faults hit them as they hit the pipeline; what
    fails is counted, never retried beyond the client's own retries."""

    def __init__(self, router_url: str, backend_url: str, seed: int, callers: int = 2) -> None:
        self.router_url, self.backend_url, self.seed = router_url, backend_url, seed
        self.answered = self.failed = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), name=f"router-caller-{n}", daemon=True)
                         for n in range(callers)]

    def start(self) -> RouterCallers:
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, caller: int) -> None:
        from balancer.client import RouterClient
        from balancer.estimates.tokens import heuristic_prompt_tokens

        count = 0
        with RouterClient(self.router_url) as client, httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                count += 1
                prompt = f"router-{self.seed}-{caller}-{count} " + "word " * 40
                try:
                    with client.slot(heuristic_prompt_tokens(prompt) + 64, timeout=20) as slot:
                        reply = http.post(f"{self.backend_url}/single",
                                          json={"model": slot.model, "prompt": prompt, "max_tokens": 64})
                        usage = reply.json().get("usage") or {}
                        slot.actual_tokens = sum(usage.values()) or None
                    self.answered += reply.status_code == 200
                    self.failed += reply.status_code != 200
                except Exception:  # noqa: BLE001 - the router or the backend is down: count it, go on
                    self.failed += 1
                    self._stop.wait(1.0)
                self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def refused_inbox_lines(inbox: Path) -> list[str]:
    """The lines of the chaos run's inbox files in ``inbox`` that intake refused, each with its reason as the
    inbox reports it (``<file>.errors`` beside a file in ``done/``; a whole file in
    ``rejected/``): a line pinned to a model a `quota remove` fault had taken away, say.
    They are no task, and no task lost: the operator is told."""
    refused = []
    for report in sorted((inbox / "done").glob("chaos-*.errors")):
        refused += [f"{report.stem}: {line}" for line in report.read_text().splitlines() if line.startswith("line ")]
    for whole in sorted((inbox / "rejected").glob("chaos-*.jsonl")):
        reason = whole.with_name(whole.name + ".errors")
        why = reason.read_text().strip() if reason.exists() else "rejected"
        refused += [f"{whole.name}: {why}"] * len(whole.read_text().splitlines())
    return refused
