"""Nemeses: the faults a run injects, one at a time, each healing what it broke.

Each nemesis is a function of the running :class:`World` that returns what it did
(recorded in the driver's history). The schedule is a seeded shuffle of the enabled
kinds, repeated, so a run long enough meets every kind and a seed always gives the
same sequence (the timing of the processes under it still varies).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton_relay.client import Client

from .cluster import (
    EtcdCluster,
    Proc,
    agent_node,
    etcd_node,
    registry_node,
    watcher_node,
)
from .history import History
from .netns import Network

#: the last history record of an agent that holds a live token (claim or consume lease)
HOLDING = {("claim", "ok"), ("write", "ok"), ("commit", "invoke"),
           ("consume", "ok"), ("read", "ok"), ("ack", "invoke")}


@dataclass
class AgentSlot:
    """One agent position (role, index); a killed agent is replaced by a new incarnation."""

    role: str
    index: int
    group: str
    make: Callable[[AgentSlot], Proc]
    histories: Path
    incarnation: int = 0
    proc: Proc | None = None

    @property
    def name(self) -> str:
        return f"{self.role[0]}{self.index}.{self.incarnation}"

    @property
    def history(self) -> Path:
        return self.histories / f"{self.name}.jsonl"

    def holding(self) -> str:
        """What the agent holds a token for right now ("" if nothing), from its history."""
        try:
            with self.history.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 2048))
                lines = f.read().splitlines()
            last = json.loads(lines[-1]) if lines else {}
        except (OSError, ValueError):
            return ""
        step = (last.get("op"), last.get("phase"))
        return f"{step[0]} {step[1]}" if step in HOLDING else ""

    def start(self) -> None:
        self.proc = self.make(self)
        self.proc.spawn()

    def restart(self) -> None:
        self.incarnation += 1
        self.start()


@dataclass
class World:
    """Everything a nemesis may break."""

    cluster: EtcdCluster
    registries: list[Proc]
    #: watcher processes over the one staging root (they share its shards)
    watchers: list[Proc]
    agents: list[AgentSlot]
    staging: Path
    ttl: int
    rng: random.Random
    history: History
    stop: threading.Event = field(default_factory=threading.Event)
    #: runs a call of the client library as the operator, on a live replica (None: no
    #: operator client)
    operator: Callable[[Callable[[Client], Any]], Any] | None = None
    #: each process's network namespace (None: all on loopback, no network nemeses)
    network: Network | None = None

    def sleep(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def _crashed(self, proc: Proc) -> None:
        """Record a process that exited by itself (a finding: nothing should)."""
        if proc.crashed:
            assert proc.process is not None
            tail = proc.log_tail(400)
            self.history.write("crash", "info", name=proc.name, status=proc.process.poll(),
                               log=proc.log_path.name, known=known_crash(proc.name, tail),
                               tail="\n".join(tail.splitlines()[-15:]))

    def heal(self) -> None:
        """Mend the network, resume what is paused, restart what is dead; wait until
        etcd is whole again."""
        if self.network is not None:
            self.network.heal()
        for member in self.cluster.members:
            if member.paused:
                member.resume()
            if not member.alive:
                self._crashed(member)
                member.start()
        for proc in [*self.registries, *self.watchers]:
            if proc.paused:
                proc.resume()
            if not proc.alive:
                self._crashed(proc)
                proc.start()
        for slot in self.agents:
            assert slot.proc is not None
            if slot.proc.paused:
                slot.proc.resume()
            if not slot.proc.alive:
                self._crashed(slot.proc)
                slot.restart()
        deadline = time.monotonic() + 60
        while not self.cluster.healthy() and time.monotonic() < deadline:
            time.sleep(0.1)


Nemesis = Callable[[World], dict[str, Any]]


def known_crash(name: str, log_tail: str) -> str:
    """The known bug that a process's log shows it died of ("" if none is known).

    etcd before 3.5.5 panics when a read-only transaction's context ends while it is
    applied (etcd-io/etcd#14110, fixed by #14178 in 3.5.5); the registry's batched
    reads are read-only transactions, and a slow or paused member lets them time out.
    """
    if name.startswith("etcd") and "panic: unexpected error during txn" in log_tail:
        return "etcd-io/etcd#14110"
    return ""


def _while_holding(w: World, slot: AgentSlot, within: float = 5.0) -> str:
    """Wait (at most ``within`` s) until ``slot`` holds a token; what it holds, or ""."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not w.stop.is_set():
        if held := slot.holding():
            return held
        time.sleep(0.003)
    return ""


def kill_agent(w: World) -> dict[str, Any]:
    """SIGKILL an agent, most often while it holds a claim or a consume lease."""
    slot = w.rng.choice(w.agents)
    assert slot.proc is not None
    held = _while_holding(w, slot) if w.rng.random() < 0.75 else slot.holding()
    victim = slot.name
    slot.proc.kill()
    w.sleep(w.rng.uniform(0.2, 2.0))
    slot.restart()
    return {"agent": victim, "holding": held or None, "replacement": slot.name}


def pause_agent(w: World) -> dict[str, Any]:
    """SIGSTOP an agent for longer than its lease TTL, most often while it holds a
    token: it wakes up to finish its work with a dead token, which must be refused."""
    slot = w.rng.choice(w.agents)
    assert slot.proc is not None
    held = _while_holding(w, slot) if w.rng.random() < 0.75 else slot.holding()
    seconds = w.ttl * w.rng.uniform(1.5, 2.5)
    slot.proc.pause()
    w.sleep(seconds)
    slot.proc.resume()
    return {"agent": slot.name, "holding": held or None, "seconds": round(seconds, 2)}


def rotate_leases(w: World) -> dict[str, Any]:
    """Rotate every live session onto a fresh lease, as an operator, one to three times;
    half the time while an agent is SIGSTOPped, most often holding a token, for less
    than its TTL. No claim may be freed meanwhile and every token must stay good: the
    checker's counts stay zero, and the reaper has nothing to do."""
    assert w.operator is not None
    slot = w.rng.choice(w.agents) if w.rng.random() < 0.5 else None
    held = ""
    if slot is not None:
        assert slot.proc is not None
        held = _while_holding(w, slot) if w.rng.random() < 0.75 else slot.holding()
        slot.proc.pause()
    paused = time.monotonic()
    rounds, sessions = w.rng.randint(1, 3), []
    try:
        for _ in range(rounds):
            done = w.operator(lambda c: c.rotate_leases(every=True))
            sessions.append(len(done))
        if slot is not None:
            w.sleep(max(0.0, w.rng.uniform(0.2, 0.5) * w.ttl - (time.monotonic() - paused)))
    finally:
        if slot is not None:
            assert slot.proc is not None
            slot.proc.resume()
    return {"rounds": rounds, "sessions": sessions,
            "paused": slot.name if slot is not None else None, "holding": held or None,
            "paused_for": round(time.monotonic() - paused, 2) if slot is not None else None}


def kill_registry(w: World) -> dict[str, Any]:
    n = w.rng.randrange(len(w.registries))
    w.registries[n].kill()
    down = w.rng.uniform(1.0, 4.0)
    w.sleep(down)
    w.registries[n].start()
    return {"replica": n, "down": round(down, 2)}


def kill_etcd_leader(w: World) -> dict[str, Any]:
    leader = w.cluster.leader()
    if leader is None:
        return {"skipped": "no leader"}
    w.cluster.members[leader].kill()
    down = w.rng.uniform(2.0, 5.0)
    w.sleep(down)
    w.cluster.members[leader].start()
    return {"member": leader, "down": round(down, 2)}


def pause_etcd_leader(w: World) -> dict[str, Any]:
    """SIGSTOP the leader past the election timeout: the others elect a new one."""
    leader = w.cluster.leader()
    if leader is None:
        return {"skipped": "no leader"}
    seconds = w.rng.uniform(3.0, 6.0)
    w.cluster.members[leader].pause()
    w.sleep(seconds)
    new = w.cluster.leader()
    w.cluster.members[leader].resume()
    return {"member": leader, "seconds": round(seconds, 2), "new_leader": new}


def _open_staged(pid: int, staging: str) -> str:
    """A staged file (not a temp file) that ``pid`` or one of its children has open."""
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        return ""
    for p in pids:
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(staging) and ".baton-tmp-" not in target \
                    and not os.path.basename(target).startswith("junk-") \
                    and os.path.isfile(target):
                return target
    return ""


def kill_watcher_hashing(w: World) -> dict[str, Any]:
    """SIGKILL a watcher while it has a staged file open (hashing it), then restart it."""
    staging = os.path.realpath(w.staging) + os.sep
    deadline = time.monotonic() + 15.0
    caught, victim = "", w.watchers[0]
    while not caught and time.monotonic() < deadline and not w.stop.is_set():
        for proc in w.watchers:
            if proc.pid is not None and (caught := _open_staged(proc.pid, staging)):
                victim = proc
                break
        if not caught:
            time.sleep(0.002)
    victim.kill()
    w.sleep(w.rng.uniform(0.5, 2.0))
    victim.start()
    return {"watcher": victim.name, "hashing": caught.removeprefix(staging) or None}


def kill_watcher(w: World) -> dict[str, Any]:
    """SIGKILL one of the watchers and keep it down past its registration's TTL, so
    that its shards move to the others; then start it again (it takes shards back)."""
    victim = w.rng.choice(w.watchers)
    victim.kill()
    down = w.rng.uniform(w.ttl + 1.0, w.ttl + 4.0)
    w.sleep(down)
    victim.start()
    return {"watcher": victim.name, "down_s": round(down, 2)}


def move_shard(w: World) -> dict[str, Any]:
    """Move a shard holding work to another watcher, as an operator would (two-phase:
    the owner hands it over with checks in hand), and wait for the move to finish."""
    if w.operator is None or len(w.watchers) < 2:
        return {"skipped": "needs an operator client and two watchers"}
    shards = [s for s in w.operator(lambda c: c.list_shards().shards) if s.owner]
    ids = [x.watcher_id for x in w.operator(lambda c: c.list_watchers())]
    if not shards or len(ids) < 2:
        return {"skipped": "fewer than two watchers registered"}
    busy = [s for s in shards if s.tasks] or shards
    shard = w.rng.choice(busy)
    to = w.rng.choice([i for i in ids if i != shard.owner])
    w.operator(lambda c: c.move_shard(shard.shard, to))
    deadline = time.monotonic() + 40.0
    owner = shard.owner
    while time.monotonic() < deadline and not w.stop.is_set():
        now = {s.shard: s for s in w.operator(lambda c: c.list_shards().shards)}[shard.shard]
        owner = now.owner
        if not now.moving_to:
            break
        time.sleep(0.1)
    return {"shard": shard.shard, "tasks": shard.tasks, "from": shard.owner, "to": to,
            "owner": owner, "epoch": shard.epoch}


def _max_queued_events() -> int:
    try:
        return int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    except (OSError, ValueError):
        return 16384


def inotify_overflow(w: World) -> dict[str, Any]:
    """Overflow the kernel's inotify queue: pause the watcher, make more events than the
    queue holds in a watched task directory, resume it. It must reconcile."""
    dirs = sorted((d for d in w.staging.iterdir() if d.is_dir()),
                  key=lambda d: d.stat().st_mtime)
    if not dirs:
        return {"skipped": "no task directory yet"}
    target = dirs[-1]
    files = _max_queued_events() // 2 + 1000  # each file: a close-write and a delete
    for proc in w.watchers:
        proc.pause()
    try:
        for i in range(files):
            path = target / f"junk-{i}"
            with path.open("wb"):
                pass
            path.unlink()
    finally:
        for proc in w.watchers:
            proc.resume()
    return {"directory": target.name, "files": files}


def compact_etcd(w: World) -> dict[str, Any]:
    """Compact etcd up to its current revision while watches are open; the watcher is
    paused meanwhile, so its stream lags behind and must resume past the compaction."""
    for proc in w.watchers:
        proc.pause()
    try:
        w.sleep(w.rng.uniform(0.5, 2.0))
        revision = w.cluster.revision()
        refused = w.cluster.compact(revision)
    finally:
        for proc in w.watchers:
            proc.resume()
    return {"revision": revision, "refused": refused or None}


# --- the network (each process in a namespace of its own: netns.py) -------------------

NO_NETWORK = {"skipped": "no network namespaces (see the run's network record)"}


def partition_etcd(w: World) -> dict[str, Any]:
    """Cut one etcd member (the leader half the time) off from the other two for 3-8 s,
    and a third of the time from the registry replicas too. Cut off from its peers only,
    it still takes the replicas' calls but cannot commit them (nor, once it sees it has
    no leader, serve them); the majority elects a leader and goes on."""
    if w.network is None:
        return NO_NETWORK
    leader = w.cluster.leader()
    n = leader if leader is not None and w.rng.random() < 0.5 else w.rng.randrange(3)
    others = [etcd_node(m) for m in range(3) if m != n]
    whole = w.rng.random() < 1 / 3
    if whole:
        others += [registry_node(r) for r in range(len(w.registries))]
    seconds = w.rng.uniform(3.0, 8.0)
    w.network.cut([etcd_node(n)], others)
    w.sleep(seconds)
    new = w.cluster.leader()
    w.network.heal()
    return {"member": n, "was_leader": n == leader, "from_replicas": whole,
            "seconds": round(seconds, 2), "leader_during": new}


def partition_registry(w: World) -> dict[str, Any]:
    """Cut one registry replica off from every etcd member for 2-6 s: its calls to etcd
    time out. Its clients still reach it; they must get errors, not wrong answers, and
    move on (to the other replica, or by retrying once the link is back)."""
    if w.network is None:
        return NO_NETWORK
    r = w.rng.randrange(len(w.registries))
    seconds = w.rng.uniform(2.0, 6.0)
    w.network.cut([registry_node(r)], [etcd_node(m) for m in range(3)])
    w.sleep(seconds)
    w.network.heal()
    return {"replica": r, "seconds": round(seconds, 2)}


def partition_client(w: World) -> dict[str, Any]:
    """Cut an agent (most often while it holds a token) or a watcher off from both
    registry replicas, or from one of them, for 1.5-2.5 lease TTLs. The process runs
    on. Cut from both, its keepalives and calls hang and fail, its session (or the
    watcher's registration) ends and what it held goes back; when the link returns, a
    late commit or ack with the dead token must be refused. Cut from one, it must
    notice the silent replica and go on through the other."""
    if w.network is None:
        return NO_NETWORK
    replicas = [registry_node(r) for r in range(len(w.registries))]
    if w.rng.random() < 0.4:
        replicas = [w.rng.choice(replicas)]
    seconds = w.ttl * w.rng.uniform(1.5, 2.5)
    if w.rng.random() < 0.25:
        n = w.rng.randrange(len(w.watchers))
        w.network.cut([watcher_node(n)], replicas)
        w.sleep(seconds)
        w.network.heal()
        return {"watcher": w.watchers[n].name, "from": replicas,
                "seconds": round(seconds, 2)}
    slot = w.rng.choice(w.agents)
    held = _while_holding(w, slot) if w.rng.random() < 0.75 else slot.holding()
    w.network.cut([agent_node(slot.index)], replicas)
    w.sleep(seconds)
    w.network.heal()
    return {"agent": slot.name, "from": replicas, "holding": held or None,
            "seconds": round(seconds, 2)}


def packet_loss(w: World) -> dict[str, Any]:
    """Drop 5-30 % of the packets, at random, of one to three processes (etcd members,
    replicas, watchers, agents) for 4-10 s: calls slow down, time out and are retried."""
    if w.network is None:
        return NO_NETWORK
    nodes = sorted(n for n in w.network.nodes if n[0] != "a" or w.rng.random() < 0.3)
    chosen = w.rng.sample(nodes, w.rng.randint(1, min(3, len(nodes))))
    percent = w.rng.randint(5, 30)
    for node in chosen:
        w.network.lossy(node, percent)
    seconds = w.rng.uniform(4.0, 10.0)
    w.sleep(seconds)
    w.network.heal()
    return {"nodes": chosen, "percent": percent, "seconds": round(seconds, 2)}


NEMESES: dict[str, Nemesis] = {
    "kill-agent": kill_agent,
    "pause-agent": pause_agent,
    "rotate-leases": rotate_leases,
    "kill-registry": kill_registry,
    "kill-etcd-leader": kill_etcd_leader,
    "pause-etcd-leader": pause_etcd_leader,
    "kill-watcher-hashing": kill_watcher_hashing,
    "kill-watcher": kill_watcher,
    "move-shard": move_shard,
    "inotify-overflow": inotify_overflow,
    "compact-etcd": compact_etcd,
    "partition-etcd": partition_etcd,
    "partition-registry": partition_registry,
    "partition-client": partition_client,
    "packet-loss": packet_loss,
}


def schedule(rng: random.Random, kinds: list[str]) -> Iterator[str]:
    """Seeded shuffles of ``kinds``, one after the other, forever."""
    while True:
        order = list(kinds)
        rng.shuffle(order)
        yield from order


def run_nemeses(w: World, kinds: list[str], until: float,
                gap: tuple[float, float], every_kind: bool = False) -> int:
    """Inject nemeses until time.monotonic() passes ``until`` (with ``every_kind``, and
    until each kind has run once); how many ran."""
    count = 0
    for kind in schedule(random.Random(w.rng.random()), kinds):
        w.sleep(w.rng.uniform(*gap))
        if w.stop.is_set() or (time.monotonic() >= until
                               and not (every_kind and count < len(kinds))):
            return count
        w.history.invoke("nemesis", kind=kind)
        started = time.monotonic()
        try:
            what = NEMESES[kind](w)
        except Exception as e:  # a nemesis that cannot act is recorded, not fatal
            w.history.write("nemesis", "fail", kind=kind, error=f"{type(e).__name__}: {e}")
            w.heal()
            continue
        w.history.ok("nemesis", kind=kind, took=round(time.monotonic() - started, 2),
                     **what)
        count += 1
        w.heal()  # restarts (and records) anything that died by itself meanwhile
    return count
