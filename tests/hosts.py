"""Hosts for a test: Linux network namespaces on a bridge, on addresses of the test's own.

Every host is a namespace with one interface (``eth0``) on a bridge that lives in a
namespace of its own (the switch), so nothing is added to this machine's own
network but one veth into the switch: its end here gets the subnet's first
address, so that the hosts reach what runs here (the test's PostgreSQL proxy) and
the test reaches them. A host is cut off by taking its port off the bridge: its
link stays up, its sockets stay open and its packets go nowhere, as across a real partition.

Names carry the creating process's id (``b40-<pid>-<host>``, ``b40r<pid>``), so two
runs never collide, and :func:`remove_stale` removes what a run killed before its
clean-up left behind. The subnet is 10.213.<n>.0/24 with an <n> no interface here uses.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from balancer.devtools.embedded import pid_alive

PREFIX = "b40"


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=check, timeout=30)


def why_not() -> str | None:
    """Why this machine cannot run the hosts (None: it can)."""
    if not shutil.which("ip"):
        return "no `ip` command (iproute2): network namespaces cannot be made"
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs root (CI runs as root)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` refused: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Namespaces and interfaces of runs whose process is gone (a test killed before its clean-up)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        found = re.match(rf"^{PREFIX}-(\d+)-\S+", line)
        if found and not pid_alive(int(found.group(1))):
            _ip("netns", "del", line.split()[0], check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        found = re.match(rf"^\d+: ({PREFIX}r(\d+))[@:]", line)
        if found and not pid_alive(int(found.group(2))):
            _ip("link", "del", found.group(1), check=False)


@dataclass
class Network:
    """The switch, its hosts, and this machine's one port on it."""

    subnet: str = ""
    hosts: dict[str, str] = field(default_factory=dict)  # host name -> its address
    namespaces: list[str] = field(default_factory=list)
    root_link: str = ""

    def __post_init__(self) -> None:
        self.tag = f"{PREFIX}-{os.getpid()}"
        if not self.subnet:
            used = _ip("-4", "-o", "addr", "show", check=False).stdout
            free = [n for n in range(10, 250) if f" 10.213.{n}." not in used]
            self.subnet = f"10.213.{random.choice(free)}"  # noqa: S311 - not security

    @property
    def gateway(self) -> str:
        """This machine's address on the switch."""
        return f"{self.subnet}.1"

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def launch(self, host: str) -> list[str]:
        """The prefix that runs a command on ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def _switch(self, *argv: str) -> None:
        _ip("-n", self.namespace("switch"), *argv)

    def create(self) -> Network:
        switch = self.namespace("switch")
        _ip("netns", "add", switch)
        self.namespaces.append(switch)
        self._switch("link", "add", "br0", "type", "bridge")
        self._switch("link", "set", "br0", "up")
        self.root_link = f"{PREFIX}r{os.getpid()}"
        _ip("link", "add", self.root_link, "type", "veth", "peer", "name", "up0", "netns", switch)
        self._switch("link", "set", "up0", "master", "br0", "up")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.root_link)
        _ip("link", "set", self.root_link, "up")
        return self

    def add_host(self, host: str, last_octet: int) -> str:
        """A new host on the switch; its address."""
        ns = self.namespace(host)
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        address = f"{self.subnet}.{last_octet}"
        self._switch("link", "add", f"p-{host}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._switch("link", "set", f"p-{host}", "master", "br0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        self.hosts[host] = address
        return address

    def cut(self, host: str) -> None:
        """Cut ``host`` off: its cable is pulled from the switch (its own link stays up, its packets go nowhere)."""
        self._switch("link", "set", "dev", f"p-{host}", "nomaster")

    def heal(self, host: str) -> None:
        self._switch("link", "set", "dev", f"p-{host}", "master", "br0")

    def remove(self) -> None:
        """Every namespace and interface this network made (the processes in it must be stopped first)."""
        for ns in reversed(self.namespaces):
            _ip("netns", "del", ns, check=False)
        if self.root_link:
            _ip("link", "del", self.root_link, check=False)
        self.namespaces.clear()
