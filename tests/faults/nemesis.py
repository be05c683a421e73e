"""Nemeses: the faults a run injects, one at a time, each healing what it broke.

Each nemesis is a function of the running :class:`World` that returns what it did
(recorded in the driver's history). The schedule is a seeded shuffle of the enabled
kinds, repeated, so a run long enough meets every kind and a seed always gives the
same sequence (the timing of the processes under it still varies).
"""

from __future__ import annotations

import errno
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
from baton_relay.kernel import errors

from . import sockets
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
    #: the staging root is a tmpfs the harness mounted (fill-staging may fill it)
    staging_tmpfs: bool = False
    #: etcd's ``--quota-backend-bytes`` (0: etcd's default, etcd-quota does nothing)
    etcd_quota: int = 0
    #: the ports the registry replicas serve agents on (cut-streams aborts agents'
    #: connections to them)
    registry_ports: tuple[int, ...] = ()
    #: what a nemesis left to clean up if it stopped half-way ("fill-staging",
    #: "etcd-quota"); :meth:`heal` cleans it
    mess: set[str] = field(default_factory=set)

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
        self._clean()

    def _clean(self) -> None:
        """Undo what a nemesis that failed half-way left behind: the staging filler,
        etcd's junk and its NOSPACE alarm. What cannot be undone now is tried again at
        the next healing."""
        cleaners = {"fill-staging": remove_filler, "etcd-quota": recover_etcd}
        for what in sorted(self.mess):
            try:
                done = cleaners[what](self)
            except Exception as e:
                self.history.write("heal", "fail", mess=what, error=f"{type(e).__name__}: {e}")
                continue
            self.mess.discard(what)
            self.history.write("heal", "ok", mess=what, **done)


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
            done = w.operator(lambda c: c.operator.rotate_leases(every=True))
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


def _removed(proc: Proc) -> int:
    """Files the watcher ``proc`` has removed from staging, from its log."""
    return proc.log_tail(1_000_000).count("removed from staging")


def staging_retention(w: World) -> dict[str, Any]:
    """SIGKILL a watcher while it removes consumed files from staging (the run's tasks
    keep their files 1 s once consumed), so that a removal recorded may not have been
    unlinked; keep it down a while, then start it again. Its shards move meanwhile, and
    whoever owns them next finishes what it left."""
    deadline = time.monotonic() + 15.0
    before = {p.name: _removed(p) for p in w.watchers}
    victim = None
    while victim is None and time.monotonic() < deadline and not w.stop.is_set():
        busy = [p for p in w.watchers if p.alive and _removed(p) > before[p.name]]
        victim = w.rng.choice(busy) if busy else None
        if victim is None:
            time.sleep(0.05)
    if victim is None:
        victim = w.rng.choice(w.watchers)
    removed = _removed(victim)
    victim.kill()
    down = w.rng.uniform(1.0, w.ttl + 3.0)
    w.sleep(down)
    victim.start()
    return {"watcher": victim.name, "removed_before": removed, "down_s": round(down, 2)}


def move_shard(w: World) -> dict[str, Any]:
    """Move a shard holding work to another watcher, as an operator would (two-phase:
    the owner hands it over with checks in hand), and wait for the move to finish."""
    if w.operator is None or len(w.watchers) < 2:
        return {"skipped": "needs an operator client and two watchers"}
    # A registration listed may run out before the move names it (a watcher killed
    # and started again has a new id; its old one lingers for a TTL): the registry
    # refuses the move with NotFound, and an operator lists again and picks another.
    for attempt in range(5):
        shards = [s for s in w.operator(lambda c: c.operator.list_shards().shards) if s.owner]
        ids = [x.watcher_id for x in w.operator(lambda c: c.operator.list_watchers())]
        if not shards or len(ids) < 2:
            return {"skipped": "fewer than two watchers registered"}
        busy = [s for s in shards if s.tasks] or shards
        shard = w.rng.choice(busy)
        to = w.rng.choice([i for i in ids if i != shard.owner])
        try:
            w.operator(lambda c, n=shard.shard, t=to: c.operator.move_shard(n, t))
            break
        except errors.NotFound:
            if attempt == 4:
                raise
            w.sleep(1.0)
    deadline = time.monotonic() + 40.0
    owner = shard.owner
    while time.monotonic() < deadline and not w.stop.is_set():
        now = {s.shard: s for s in w.operator(
            lambda c: c.operator.list_shards().shards)}[shard.shard]
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


def cut_streams(w: World) -> dict[str, Any]:
    """Abort an agent's TCP connections to the registries (most often while it holds a
    token), one to three times 0.05-1 s apart: its session stream breaks in the middle of
    a call. The session must live on (the client resumes it on a new stream, to either
    replica) and a call whose reply was lost must be answered from its request record:
    nothing applied twice, nothing lost, no token refused that was still good."""
    slot = w.rng.choice(w.agents)
    held = _while_holding(w, slot) if w.rng.random() < 0.75 else slot.holding()
    namespace = w.network.nodes[agent_node(slot.index)].namespace if w.network else ""
    cuts = []
    for _ in range(w.rng.randint(1, 3)):
        if slot.proc is None or slot.proc.pid is None or not slot.proc.alive:
            break
        cuts.append(sockets.destroy(slot.proc.pid, w.registry_ports, namespace))
        w.sleep(w.rng.uniform(0.05, 1.0))
    return {"agent": slot.name, "holding": held or None, "connections": cuts}


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


#: the staging filler (fill-staging), at the staging root: no task's, never hashed
FILLER = "junk-fill-staging"
#: etcd-quota's keys, outside the registry's prefix
JUNK = b"/nemesis-junk/"
#: etcd-quota's values: etcd takes requests of at most 1.5 MiB
JUNK_VALUE = 1 << 20
#: seconds the staging root is held full. An entry whose producers keep failing backs
#: off 0.2, 0.4, 0.8, 1.6, then 2 s (task_spec), so its fifth failure comes 3 s after
#: its first and its sixth 5 s after: a hold of at most 4 s (plus the fill) costs an
#: entry at most six of its twelve retries (max_retries)
STAGING_HOLD = (2.0, 4.0)
#: seconds etcd is held at NOSPACE after it first refused (recovery takes longer)
ETCD_HOLD = (2.0, 5.0)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _top_up(fd: int, chunk: bytes) -> int:
    """Write ``chunk`` to ``fd`` until the file system is full; the bytes written."""
    written = 0
    while True:
        try:
            n = os.write(fd, chunk)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                return written
            raise
        written += n


def fill_staging(w: World) -> dict[str, Any]:
    """Fill the staging file system until ENOSPC and keep it full for a few seconds
    (space a producer's failed attempt or the feeder frees is taken again at once),
    then remove the filler. Producers get ENOSPC: their entries are failed and retried;
    nothing unwritten may be committed, no temp file may stay behind."""
    if not w.staging_tmpfs:
        return {"skipped": "the staging root is not a tmpfs the harness mounted "
                "(that needs root and --staging-mib)"}
    hold = w.rng.uniform(*STAGING_HOLD)
    free_before = _free(w.staging)
    chunk = bytes(1 << 20)
    w.mess.add("fill-staging")
    fd = os.open(w.staging / FILLER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                 0o600)
    try:
        filled = _top_up(fd, chunk)
        full = time.monotonic()
        topped = tops = 0
        while time.monotonic() - full < hold and not w.stop.is_set():
            w.sleep(0.02)
            if more := _top_up(fd, chunk):
                topped, tops = topped + more, tops + 1
        held = time.monotonic() - full
        free_full = _free(w.staging)
    finally:
        os.close(fd)
    remove_filler(w)
    w.mess.discard("fill-staging")
    return {"free_before_mib": round(free_before / 2**20, 1),
            "filled_bytes": filled, "held_s": round(held, 2),
            "free_when_full": free_full, "topped_up_kib": topped >> 10,
            "top_ups": tops}


def remove_filler(w: World) -> dict[str, Any]:
    try:
        size = (w.staging / FILLER).stat().st_size
        (w.staging / FILLER).unlink()
    except FileNotFoundError:
        size = 0
    return {"filler_removed_mib": round(size / 2**20, 1)}


def _fill_etcd(w: World, deadline: float) -> tuple[int, float, str]:
    """Put junk through every member at once until one refuses with NOSPACE: the
    bytes put, when NOSPACE was first answered, and the refusal."""
    stop = threading.Event()
    lock = threading.Lock()
    written = [0]
    refused: list[tuple[float, str]] = []
    value = bytes(JUNK_VALUE)

    def writer(n: int) -> None:
        i = 0
        while not stop.is_set() and not w.stop.is_set() and time.monotonic() < deadline:
            try:
                why = w.cluster.put(n, JUNK + b"m%d/%07d" % (n, i), value)
            except OSError as e:  # a member restarting, a timeout: another member goes on
                why = f"{type(e).__name__}: {e}"
            if "database space exceeded" in why:
                with lock:
                    refused.append((time.monotonic(), why))
                stop.set()
                return
            if why:
                time.sleep(0.1)
                continue
            i += 1
            with lock:
                written[0] += len(value)

    threads = [threading.Thread(target=writer, args=(n,), name=f"junk-m{n}", daemon=True)
               for n in range(len(w.cluster.members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not refused:
        raise RuntimeError(f"etcd took {written[0] >> 20} MiB of junk without refusing "
                           "(no NOSPACE)")
    first = min(refused)
    return written[0], first[0], first[1]


def etcd_quota(w: World) -> dict[str, Any]:
    """Fill etcd with junk keys (outside the registry's prefix) until it answers
    NOSPACE, hold it there a few seconds while the agents run (writes are refused with
    ``StorageFull``; reads go on, one is checked), then recover as an operator would:
    delete the junk, compact, defragment every member, disarm the alarms."""
    if not w.etcd_quota:
        return {"skipped": "etcd runs without --quota-backend-bytes"}
    hold = w.rng.uniform(*ETCD_HOLD)
    before = [w.cluster.db_size(n) for n in range(len(w.cluster.members))]
    w.mess.add("etcd-quota")
    written, full, why = _fill_etcd(w, time.monotonic() + 180.0)
    n = w.cluster.answering()
    alarms = w.cluster.alarms(n) if n is not None else []
    read = ""
    try:
        assert w.operator is not None
        tasks = w.operator(lambda c: c.operator.list_tasks())
        read = f"list_tasks: {len(tasks)} tasks"
    except Exception as e:  # reads must go on at the quota: a finding, raised below
        read = f"{type(e).__name__}: {e}"[:300]
    w.sleep(max(0.0, hold - (time.monotonic() - full)))
    recovered = recover_etcd(w)
    held = time.monotonic() - full
    w.mess.discard("etcd-quota")
    if not read.startswith("list_tasks"):
        raise RuntimeError(f"a read failed while etcd was at its quota: {read}")
    return {"quota_mib": round(w.etcd_quota / 2**20), "written_bytes": written,
            "db_before_mib": [_mib(b) for b in before], "nospace_s": round(held, 2),
            "alarms": len(alarms), "refusal": why[:80], "read": read, **recovered}


def _mib(size: int | None) -> float | None:
    return None if size is None else round(size / 2**20, 1)


def recover_etcd(w: World) -> dict[str, Any]:
    """What an operator does at the quota: delete the junk (etcd takes deletes under
    NOSPACE), compact, defragment every member, disarm each NOSPACE alarm (as
    ``alarm list`` names them, per member); then a write is accepted again."""
    c = w.cluster
    n = c.answering()
    if n is None:
        raise RuntimeError("no etcd member answers")
    deleted = c.delete_prefix(n, JUNK)
    refused = c.compact(c.revision())
    for m in range(len(c.members)):
        c.defragment(m)
    after = [_mib(c.db_size(m)) for m in range(len(c.members))]
    disarmed = 0
    probe = JUNK + b"probe"
    for _ in range(50):
        raised = [a for a in c.alarms(n) if a.get("alarm") == "NOSPACE"]
        for alarm in raised:
            c.disarm(n, alarm)
        disarmed += len(raised)
        if not raised and not c.put(n, probe, b""):
            c.delete_prefix(n, probe)
            break
        time.sleep(0.1)
    else:
        raise RuntimeError("etcd still refuses writes once its alarms are disarmed")
    return {"deleted": deleted, "compact_refused": refused or None, "disarmed": disarmed,
            "db_after_mib": after}

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
    "staging-retention": staging_retention,
    "inotify-overflow": inotify_overflow,
    "compact-etcd": compact_etcd,
    "partition-etcd": partition_etcd,
    "partition-registry": partition_registry,
    "partition-client": partition_client,
    "packet-loss": packet_loss,
    "cut-streams": cut_streams,
    "fill-staging": fill_staging,
    "etcd-quota": etcd_quota,
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
