"""A private network for a fault run: one network namespace per process, so that the
nemeses can cut links and drop packets between them.

::

    root namespace (the harness)          hub namespace              node namespaces
    veth "btNNNNNh" 10.231.X.1  <-->  bridge br0  <-->  veth eth0 10.231.X.10 (etcd m0)
                                                  <-->  veth eth0 10.231.X.20 (registry-0)
                                                  <-->  ...

The addresses exist only on these interfaces: the root namespace gets one veth end
with the subnet's first address (the harness's clients reach every node through
it), nothing else of the host's network is touched, and :meth:`Network.close`
deletes it all (deleting a namespace deletes its interfaces). The bridge lives in a
namespace of its own, whose firewall is empty, so the host's rules for bridged
traffic (``br_netfilter``) do not apply to it.

Faults are nftables rules inside a node's namespace (table ``inet baton``), so each
node's view is its own: :meth:`Network.cut` drops every packet between two sets of
nodes (a partition; TCP connections hang rather than reset, as on a real network),
:meth:`Network.lossy` drops a share of a node's packets at random, and
:meth:`Network.heal` flushes every rule. Needs root, ``ip`` (iproute2) and ``nft``
(nftables); :func:`available` says whether this machine has them.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: where node addresses come from: one free /24 of it per run
POOL = ipaddress.ip_network("10.231.0.0/16")


def available() -> str:
    """"" when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, nftables)"
    probe = f"baton-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        table = subprocess.run(["ip", "netns", "exec", probe, "nft", "add", "table", "inet",
                                "probe"], capture_output=True, text=True)
        if table.returncode != 0:
            return f"nft failed in a namespace: {table.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return ""


def _run(*argv: str, namespace: str = "") -> None:
    command = ["ip", "netns", "exec", namespace, *argv] if namespace else list(argv)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


def _used_subnets() -> set[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True,
                         text=True).stdout
    nets = set()
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.add(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return nets


@dataclass
class Node:
    name: str
    namespace: str
    address: str


@dataclass
class Network:
    """The namespaces of one run; ``tag`` keeps the names of concurrent runs apart."""

    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    nodes: dict[str, Node] = field(default_factory=dict)
    subnet: ipaddress.IPv4Network | None = None
    #: the root namespace's own address on the network (the harness's clients)
    gateway: str = ""
    #: the rules in force, per node, for the record (``describe``)
    faults: dict[str, list[str]] = field(default_factory=dict)

    @property
    def hub(self) -> str:
        return f"baton-{self.tag}-hub"

    @property
    def _root_veth(self) -> str:
        return f"bt{self.tag}h"

    def open(self) -> None:
        """Make the hub (a bridge in its namespace) and the root namespace's link to it."""
        used = _used_subnets()
        self.subnet = next(n for n in POOL.subnets(new_prefix=24)
                           if not any(n.overlaps(u) for u in used))
        self.gateway = str(self.subnet[1])
        _run("ip", "netns", "add", self.hub)
        try:
            _run("ip", "link", "set", "lo", "up", namespace=self.hub)
            _run("ip", "link", "add", "br0", "type", "bridge", namespace=self.hub)
            _run("ip", "link", "set", "br0", "up", namespace=self.hub)
            _run("ip", "link", "add", self._root_veth, "type", "veth", "peer", "name", "root",
                 "netns", self.hub)
            _run("ip", "link", "set", "root", "master", "br0", namespace=self.hub)
            _run("ip", "link", "set", "root", "up", namespace=self.hub)
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self._root_veth)
            _run("ip", "link", "set", self._root_veth, "up")
        except Exception:
            self.close()
            raise

    def add(self, name: str, host: int) -> str:
        """A namespace for node ``name`` with address ``host`` of the subnet; the address."""
        assert self.subnet is not None, "open() first"
        namespace = f"baton-{self.tag}-{name}"
        address = str(self.subnet[host])
        port = f"n{host}"  # the node's end in the hub (names are at most 15 bytes)
        _run("ip", "netns", "add", namespace)
        self.nodes[name] = Node(name, namespace, address)
        _run("ip", "link", "set", "lo", "up", namespace=namespace)
        _run("ip", "link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name",
             port, "netns", self.hub)
        _run("ip", "link", "set", port, "master", "br0", namespace=self.hub)
        _run("ip", "link", "set", port, "up", namespace=self.hub)
        _run("ip", "addr", "add", f"{address}/24", "dev", "eth0", namespace=namespace)
        _run("ip", "link", "set", "eth0", "up", namespace=namespace)
        _run("nft", "add", "table", "inet", "baton", namespace=namespace)
        for chain, hook in (("in", "input"), ("out", "output")):
            _run("nft", "add", "chain", "inet", "baton", chain,
                 f"{{ type filter hook {hook} priority 0; policy accept; }}",
                 namespace=namespace)
        return address

    def wrap(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``name``'s namespace (``ip netns exec`` execs it:
        the process keeps the pid the harness signals)."""
        return ["ip", "netns", "exec", self.nodes[name].namespace, *argv]

    def address(self, name: str) -> str:
        return self.nodes[name].address

    def _rule(self, name: str, rule: str) -> None:
        namespace = self.nodes[name].namespace
        for chain, direction in (("in", "saddr"), ("out", "daddr")):
            _run("nft", "add", "rule", "inet", "baton", chain,
                 *rule.format(dir=direction).split(), namespace=namespace)
        self.faults.setdefault(name, []).append(rule.format(dir="addr"))

    def cut(self, side: Iterable[str], other: Iterable[str]) -> None:
        """Drop every packet between the nodes of ``side`` and those of ``other`` (both
        ways; each node drops on its own side, so either set may hold the harness's
        peers too)."""
        side, other = list(side), list(other)
        for a in side:
            peers = ", ".join(self.address(b) for b in other)
            self._rule(a, f"ip {{dir}} {{{{ {peers} }}}} drop")
        for b in other:
            peers = ", ".join(self.address(a) for a in side)
            self._rule(b, f"ip {{dir}} {{{{ {peers} }}}} drop")

    def cut_harness(self, name: str) -> None:
        """Drop every packet between node ``name`` and the harness (the root namespace's
        address), in ``name``'s namespace."""
        self._rule(name, f"ip {{dir}} {self.gateway} drop")

    def lossy(self, name: str, percent: int) -> None:
        """Drop ``percent`` % of node ``name``'s packets (in and out) at random, to and
        from every peer but the harness's own address."""
        self._rule(name, f"ip {{dir}} != {self.gateway} numgen random mod 100 < {percent} drop")

    def heal(self) -> None:
        """Flush every rule: every link carries every packet again."""
        for name in list(self.faults):
            namespace = self.nodes[name].namespace
            for chain in ("in", "out"):
                _run("nft", "flush", "chain", "inet", "baton", chain, namespace=namespace)
        self.faults.clear()

    def describe(self) -> dict[str, list[str]]:
        return {name: list(rules) for name, rules in self.faults.items()}

    def close(self) -> None:
        """Delete every namespace (their interfaces go with them) and the root's veth."""
        for node in self.nodes.values():
            subprocess.run(["ip", "netns", "delete", node.namespace], capture_output=True)
        self.nodes.clear()
        subprocess.run(["ip", "link", "delete", self._root_veth], capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.hub], capture_output=True)
