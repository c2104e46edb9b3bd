"""A Redis master, its replica and Sentinels, as real ``redis-server`` processes on
addresses and ports of a test's own: what the Sentinel tests fail over.

Each server runs in a directory of the test's (its config, which Sentinel rewrites)
and, given a ``launch`` prefix (``ip netns exec NAME``), inside a network namespace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import redis

from balancer.devtools.embedded import free_port, redis_server_binary

MASTER_NAME = "balancer-test"
#: Sentinel's failure detection: a master silent this long is down for each Sentinel.
DOWN_AFTER_MS = 1000


@dataclass
class Node:
    """One redis-server: where it listens and how it is started."""

    name: str
    host: str
    port: int
    launch: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None

    def client(self, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(self.host, self.port, socket_connect_timeout=timeout, socket_timeout=timeout)


def wait_until(check: Callable[[], object], timeout: float, what: str | Callable[[], str], step: float = 0.1) -> object:
    """Poll ``check`` until it returns something true (exceptions count as not yet). ``what`` names
    it in the error, or is called then to say it (with what a log holds by that time)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = check()
            if last:
                return last
        except (redis.RedisError, OSError) as exc:
            last = exc
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"{said}: not after {timeout:.0f}s (last: {last!r})")
        time.sleep(step)


@dataclass
class RedisGroup:
    """A master, a replica and ``len(sentinel_hosts)`` Sentinels (quorum 2)."""

    workdir: Path
    master: Node
    replica: Node
    sentinels: list[Node]
    #: Ports were picked free (on loopback, beside other tests): a server that could not bind its
    #: port because something took it in between is started again on another.
    ports_picked: bool = False

    @classmethod
    def on_loopback(cls, workdir: Path, sentinel_count: int = 3) -> RedisGroup:
        host = "127.0.0.1"
        return cls(workdir, Node("master", host, free_port()), Node("replica", host, free_port()),
                   [Node(f"sentinel-{i}", host, free_port()) for i in range(sentinel_count)], ports_picked=True)

    def url(self, db: int = 0) -> str:
        """The balancer's URL of this group: every Sentinel, the master's name, the database."""
        return f"sentinel://{','.join(f'{s.host}:{s.port}' for s in self.sentinels)}/{MASTER_NAME}/{db}"

    def _start(self, node: Node, config: list[str], sentinel: bool = False) -> None:
        folder = self.workdir / node.name
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "redis.conf"
        conf.write_text("\n".join([f"port {node.port}", f"bind {node.host}", "protected-mode no",
                                   f"dir {folder}", 'save ""', "appendonly no", *config]) + "\n")
        argv = [*node.launch, redis_server_binary(), str(conf), *(["--sentinel"] if sentinel else [])]
        node.process = subprocess.Popen(argv, stdout=(folder / "log").open("ab"), stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def _start_listening(self, node: Node, config: Callable[[], list[str]], sentinel: bool = False) -> None:
        """Start ``node`` and wait until it answers; a server that exits first (its port taken
        since it was picked) is started again on a new port when the ports were picked here."""
        for _attempt in range(5):
            self._start(node, config(), sentinel)
            wait_until(lambda: node.process.poll() is not None or self._answers_as_itself(node), 10,  # type: ignore[union-attr]
                       lambda: f"{node.name} listening on {node.port}\n{self.log_tail(node)}")
            if node.process.poll() is None:  # type: ignore[union-attr]
                return
            if not self.ports_picked:
                break
            node.port = free_port()
        raise AssertionError(f"{node.name} exited at start:\n{self.log_tail(node)}")

    @staticmethod
    def _answers_as_itself(node: Node) -> bool:
        """The server on the node's port is the node's own process (not another test's server)."""
        assert node.process is not None
        return int(node.client().info("server")["process_id"]) == node.process.pid

    def log_tail(self, node: Node, lines: int = 15) -> str:
        log = self.workdir / node.name / "log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"

    def start(self) -> RedisGroup:
        self._start_listening(self.master, lambda: [])
        self._start_listening(self.replica, lambda: [f"replicaof {self.master.host} {self.master.port}"])
        for node in self.sentinels:
            self._start_listening(node, lambda: [
                f"sentinel monitor {MASTER_NAME} {self.master.host} {self.master.port} 2",
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {MASTER_NAME} 10000",
                f"sentinel parallel-syncs {MASTER_NAME} 1"], sentinel=True)
        wait_until(lambda: self.replica.client().info("replication").get("master_link_status") == "up", 20,
                   lambda: f"the replica in sync; its log:\n{self.log_tail(self.replica)}\nthe master's:\n"
                   f"{self.log_tail(self.master)}")
        # Every Sentinel knows the replica and the other Sentinels: a failover can be agreed.
        for node in self.sentinels:
            wait_until(partial(self._sentinel_ready, node), 30, f"{node.name} ready")
        return self

    def _sentinel_ready(self, node: Node) -> bool:
        state = node.client().execute_command("SENTINEL", "MASTER", MASTER_NAME)
        fields = dict(zip(state[::2], state[1::2], strict=True)) if isinstance(state, list) else state
        value = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                 for k, v in fields.items()}
        return int(value["num-slaves"]) >= 1 and int(value["num-other-sentinels"]) >= len(self.sentinels) - 1

    def master_address(self) -> tuple[str, int]:
        """Where the Sentinels (the first that answers) say the master is now."""
        for node in self.sentinels:
            try:
                host, port = node.client().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
                return (host.decode() if isinstance(host, bytes) else host), int(port)
            except (redis.RedisError, OSError):
                continue
        raise AssertionError("no Sentinel answers")

    def kill_master(self) -> float:
        """SIGKILL the master (as a crash would); the monotonic time it died."""
        assert self.master.process is not None
        os.killpg(self.master.process.pid, signal.SIGKILL)
        self.master.process.wait(timeout=10)
        return time.monotonic()

    def wait_failover(self, timeout: float = 30.0) -> float:
        """Wait until the Sentinels name the replica as master and it takes writes; when."""
        wait_until(lambda: self.master_address() == (self.replica.host, self.replica.port), timeout,
                   "the Sentinels promote the replica")
        wait_until(lambda: self.replica.client().info("replication")["role"] == "master", timeout,
                   "the replica promoted")
        return time.monotonic()

    def stop(self) -> None:
        for node in [*self.sentinels, self.replica, self.master]:
            if node.process is not None and node.process.poll() is None:
                try:
                    os.killpg(node.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                node.process.wait(timeout=10)
