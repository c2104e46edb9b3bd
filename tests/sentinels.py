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


def wait_until(check: Callable[[], object], timeout: float, what: str, step: float = 0.1) -> object:
    """Poll ``check`` until it returns something true (exceptions count as not yet)."""
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
            raise AssertionError(f"{what}: not after {timeout:.0f}s (last: {last!r})")
        time.sleep(step)


@dataclass
class RedisGroup:
    """A master, a replica and ``len(sentinel_hosts)`` Sentinels (quorum 2)."""

    workdir: Path
    master: Node
    replica: Node
    sentinels: list[Node]

    @classmethod
    def on_loopback(cls, workdir: Path, sentinel_count: int = 3) -> RedisGroup:
        host = "127.0.0.1"
        return cls(workdir, Node("master", host, free_port()), Node("replica", host, free_port()),
                   [Node(f"sentinel-{i}", host, free_port()) for i in range(sentinel_count)])

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

    def start(self) -> RedisGroup:
        self._start(self.master, [])
        self._start(self.replica, [f"replicaof {self.master.host} {self.master.port}"])
        for node in self.sentinels:
            self._start(node, [f"sentinel monitor {MASTER_NAME} {self.master.host} {self.master.port} 2",
                               f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
                               f"sentinel failover-timeout {MASTER_NAME} 10000",
                               f"sentinel parallel-syncs {MASTER_NAME} 1"], sentinel=True)
        wait_until(lambda: self.replica.client().info("replication").get("master_link_status") == "up", 20,
                   "the replica in sync")
        # Every Sentinel knows the replica and the other Sentinels: a failover can be agreed.
        for node in self.sentinels:
            wait_until(lambda node=node: self._sentinel_ready(node), 30, f"{node.name} ready")
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
