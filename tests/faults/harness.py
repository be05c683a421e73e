"""A fault run from start to verdict.

1. A 3-member etcd cluster, two registry replicas (each given every member, or
   replica n only member n), two watchers sharing the staging root's shards (on
   both replicas; over TLS on the first, see ``cluster.watcher_proc``) and the
   agents: producers, and consumers in two consumer groups. They speak mutual TLS
   with identities from a CA made in ``OUT/pki`` (``cluster.make_pki``), unless
   the run is plaintext.
2. Load: a feeder creates tasks so that there is always work; nemeses are injected
   one after the other for ``duration`` seconds.
3. Heal and drain: everything broken is restarted, and the run waits (at most
   ``drain`` seconds) for every task to complete.
4. Stop the agents and the watcher, read the registry's state from etcd, and check it
   against every history (``checker.py``). The summary line goes to stdout and, with
   the violations and what each nemesis did, to ``OUT/report.txt``.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from baton_relay.client import Client, RetryPolicy
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import free_port
from baton_relay.local.stack import LocalPKI

from . import history as hist
from . import netns
from .checker import Report, check, leftover_temp_files
from .cluster import (
    OPERATOR,
    EtcdCluster,
    Proc,
    agent_node,
    agent_proc,
    confine,
    credentials,
    etcd_node,
    host_number,
    make_pki,
    pool_units_repaired,
    registry_node,
    registry_proc,
    watcher_node,
    watcher_proc,
)
from .nemesis import NEMESES, AgentSlot, World, run_nemeses
from .staging import StagingFs, staged_files, temp_files
from .state import read_snapshot

T = TypeVar("T")


@dataclass(frozen=True)
class RunConfig:
    seed: int
    #: seconds of load under nemeses (the drain and start-up come on top)
    duration: float
    out: Path
    producers: int = 2
    #: consumers per group
    consumers: int = 2
    groups: tuple[str, ...] = ("g1", "g2")
    ttl: int = 4
    #: watcher processes over the one staging root
    watchers: int = 2
    task_size: int = 40
    #: no new task while this many entries are unfinished (the consumers are behind)
    backlog: int = 160
    nemeses: tuple[str, ...] = tuple(NEMESES)
    #: seconds between two nemeses (uniform)
    gap: tuple[float, float] = (2.0, 5.0)
    #: go on past ``duration`` until every kind of nemesis has run once (the quick run)
    every_kind: bool = False
    #: at most this many seconds, after healing, for every task to complete
    drain: float = 120.0
    etcd_binary: str | None = None
    #: each replica is given every etcd member (else replica n only member n)
    all_members: bool = True
    prefix: str = "/baton-faults/"
    #: keep the staging directory (payloads) after the run
    keep_staging: bool = False
    #: plaintext and no identities (registries run ``--insecure``)
    insecure: bool = False
    #: each process in a network namespace of its own (``netns.py``), when this machine
    #: allows it (root, iproute2, nftables); else, or when False, all on loopback and
    #: the network nemeses are skipped
    network: bool = True
    #: the staging root is a tmpfs of this many MiB when the harness may mount one
    #: (root), so fill-staging can fill it (0: a plain directory). The feeder deletes
    #: completed tasks' files: a run holds the payloads of its open tasks (about 340
    #: KiB each on average, see agent.SIZES), at most 281 MiB with the command line's
    #: defaults (task size 200, backlog 400), under 90 MiB in the quick run
    staging_mib: int = 512
    #: etcd's ``--quota-backend-bytes`` in MiB (0: etcd's default), which etcd-quota
    #: fills. A run's database grows by about 100 KiB/s (entries, journals, request
    #: outcomes, 5 min of history): 43 MiB after 440 s with the command line's
    #: defaults, some 100 MiB after 1800 s; every etcd-quota compacts and defragments it
    etcd_quota_mib: int = 256
    #: etcd's ``--auto-compaction-retention`` (periodic mode; "": none)
    etcd_compaction: str = "5m"


@dataclass
class Result:
    report: Report
    out: Path
    nemeses: list[dict[str, Any]] = field(default_factory=list)


class Replicas:
    """One client per registry replica, as the operator; a call moves on to the next on
    ``Unavailable``."""

    def __init__(self, addresses: list[str], tls: LocalPKI | None) -> None:
        retry = RetryPolicy(attempts=2, initial=0.1, cap=0.5, deadline=5.0)
        self.clients = [Client(a, timeout=5.0, retry=retry, **credentials(tls, OPERATOR))
                        for a in addresses]
        self.current = 0

    def call(self, fn: Callable[[Client], T]) -> T:
        error: errors.BatonError | None = None
        for _ in range(2 * len(self.clients)):
            try:
                return fn(self.clients[self.current])
            except errors.Unavailable as e:
                error = e
                self.current = (self.current + 1) % len(self.clients)
        assert error is not None
        raise error

    def close(self) -> None:
        for c in self.clients:
            c.close()


#: seconds a consumed entry's file stays in staging in a run with the
#: ``staging-retention`` nemesis (else the registry's default, a day: nothing goes)
SHORT_RETENTION = 1.0


#: the concurrency pools of a run, and their limits: every other task's producers
#: take a unit of the first, its first consumer group's leases of the second (below
#: the agents' numbers, so the pools bind)
POOLS = {"faults-produce": 2, "faults-consume": 1}
#: the backlog limit of every third task's last consumer group (its producers are
#: held back by it)
BACKLOG_LIMIT = 6


def task_spec(task_id: str, size: int, groups: tuple[str, ...],
              retention: float | None = None, pooled: bool = False,
              limited: bool = False) -> dict[str, Any]:
    files = [f"f{i:04d}" for i in range(size)]
    more: dict[str, Any] = {} if retention is None else {"staging_retention_seconds": retention}
    if pooled:
        more["pools"] = {"produce": "faults-produce", "consume": {groups[0]: "faults-consume"}}
    if limited:
        # back-pressure: producers wait while the last group has this many in its backlog
        more["backlog_limits"] = {groups[-1]: {"entries": BACKLOG_LIMIT}}
    return {
        "task_id": task_id,
        **more,
        # A few subdirectories: the watcher must follow new directories too.
        "entries": [{"file_id": f, "path": f"d{i % 3}/{f}.bin"} for i, f in enumerate(files)],
        "consumers": list(groups),
        "max_retries": 12,
        "backoff": {"base_seconds": 0.2, "factor": 2.0, "cap_seconds": 2.0},
    }


class PoolSampler(threading.Thread):
    """Reads the pools a few times a second while the run goes on: the units each
    holds against its limit (the checker fails the run on one over it)."""

    def __init__(self, replicas: Replicas) -> None:
        super().__init__(name="faults-pools", daemon=True)
        self.replicas = replicas
        self.stop = threading.Event()
        #: (pool, units in use, limit) of each sample
        self.samples: list[tuple[str, int, int]] = []

    def run(self) -> None:
        while not self.stop.wait(0.25):
            try:
                pools = self.replicas.call(lambda c: c.operator.list_pools())
            except errors.BatonError:
                continue  # a nemesis: the next sample
            self.samples += [(p.name, p.in_use, p.limit) for p in pools]


class Feeder(threading.Thread):
    """Creates tasks so that the agents always have work; records each creation."""

    def __init__(self, cfg: RunConfig, replicas: Replicas, history: hist.History,
                 staging: Path) -> None:
        super().__init__(name="faults-feeder", daemon=True)
        self.cfg, self.replicas, self.history = cfg, replicas, history
        self.staging = staging
        self.removed: set[str] = set()
        self.created: dict[str, list[str]] = {}
        self.stop = threading.Event()
        self._next = 0
        self.newest = ""

    def run(self) -> None:
        self.define_pools()
        while not self.stop.wait(0.5):
            try:
                tasks = self.replicas.call(lambda c: c.operator.list_tasks())
            except errors.BatonError:
                continue
            self.remove_completed(tasks)
            active = {t.spec.task_id: t for t in tasks if t.status == pb.TASK_STATUS_ACTIVE}
            if sum(t.open for t in active.values()) >= self.cfg.backlog:
                continue  # the consumers are behind: let them catch up
            if self.newest in active:
                try:
                    newest = self.replicas.call(lambda c: c.operator.get_task(self.newest))
                except errors.BatonError:
                    continue
                if newest.states.get("pending", 0) >= self.cfg.task_size // 2:
                    continue  # the producers still have work
            self.create(f"t{self._next:04d}")

    @property
    def retention(self) -> float | None:
        """The tasks' staging retention: short when the watchers remove the files."""
        return SHORT_RETENTION if "staging-retention" in self.cfg.nemeses else None

    def remove_completed(self, tasks: list[pb.Task]) -> None:
        """Delete the files of completed tasks (consumers recorded what they read), so
        that a long run does not fill the disk; the watchers do it when the tasks have
        a short staging retention."""
        if self.cfg.keep_staging or self.retention is not None:
            return
        for t in tasks:
            task_id = t.spec.task_id
            if t.status == pb.TASK_STATUS_COMPLETED and task_id not in self.removed:
                shutil.rmtree(self.staging / task_id, ignore_errors=True)
                self.removed.add(task_id)

    def define_pools(self) -> None:
        """The run's concurrency pools, before any task names them."""
        for name, limit in POOLS.items():
            while not self.stop.is_set():
                try:
                    self.replicas.call(lambda c, n=name, lim=limit: c.operator.set_pool(
                        n, lim, reason="the fault run's pools"))
                    break
                except errors.BatonError:
                    self.stop.wait(0.5)

    def create(self, task_id: str) -> None:
        spec = task_spec(task_id, self.cfg.task_size, self.cfg.groups, self.retention,
                         pooled=self._next % 2 == 1, limited=self._next % 3 == 2)
        files = [e["file_id"] for e in spec["entries"]]
        while True:
            self.history.invoke("create-task", task=task_id, files=len(files))
            try:
                self.replicas.call(lambda c: c.operator.create_task(spec))
                break
            except errors.BatonError as e:
                # The same manifest again completes an interrupted creation.
                self.history.error("create-task", e, task=task_id)
                if self.stop.wait(0.5):
                    return
        self.history.ok("create-task", task=task_id, files=len(files))
        self.created[task_id] = files
        self.newest = task_id
        self._next += 1

    def done(self) -> bool:
        """Whether every task created so far has completed."""
        try:
            tasks = self.replicas.call(lambda c: c.operator.list_tasks())
        except errors.BatonError:
            return False
        status = {t.spec.task_id: t.status for t in tasks}
        return all(status.get(t) == pb.TASK_STATUS_COMPLETED for t in self.created)


def run(cfg: RunConfig, say: Callable[[str], None] = print) -> Result:
    """Run the faults and check them; the report is returned, nothing is asserted."""
    out = cfg.out
    for sub in ("history", "logs", "staging"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    staging = out / "staging"
    driver = hist.History(out / "history" / "driver.jsonl", "driver")
    driver.write("run", "info", seed=cfg.seed, duration=cfg.duration,
                 nemeses=list(cfg.nemeses))
    rng = random.Random(cfg.seed)
    agent_count = cfg.producers + cfg.consumers * len(cfg.groups)
    network = open_network(cfg, agent_count, driver)
    try:
        return _run(cfg, out, staging, driver, rng, network, say)
    finally:
        if network is not None:
            network.close()


def open_network(cfg: RunConfig, agents: int, driver: hist.History) -> netns.Network | None:
    """A namespace per process of the run (None: loopback, and why is recorded)."""
    why = netns.available() if cfg.network else "not asked for"
    if why:
        driver.write("network", "info", namespaces=False, why=why)
        return None
    network = netns.Network()
    network.open()
    nodes = [*(etcd_node(n) for n in range(3)), *(registry_node(n) for n in range(2)),
             *(watcher_node(n) for n in range(cfg.watchers)),
             *(agent_node(i) for i in range(agents))]
    try:
        for node in nodes:
            network.add(node, host_number(node))
    except Exception:
        network.close()
        raise
    driver.write("network", "info", namespaces=True, subnet=str(network.subnet))
    return network


def _run(cfg: RunConfig, out: Path, staging: Path, driver: hist.History,
         rng: random.Random, network: netns.Network | None,
         say: Callable[[str], None]) -> Result:
    hosts = [network.address(registry_node(n)) if network else "127.0.0.1"
             for n in range(2)]
    tls = None if cfg.insecure else make_pki(out / "pki", hosts)
    cluster = EtcdCluster(out / "etcd", binary=cfg.etcd_binary, network=network,
                          quota=cfg.etcd_quota_mib << 20, compaction=cfg.etcd_compaction)
    staging_fs = StagingFs(staging, cfg.staging_mib)
    addresses = [f"{host}:{free_port()}" for host in hosts]
    metrics = [f"{host}:{free_port()}" for host in hosts]
    #: each registry's baton_pool_units_repaired_total at the end, and those not read
    repaired: dict[str, int] = {}
    unread: list[str] = []
    def etcd_for(n: int) -> str:
        if not cfg.all_members:
            return cluster.endpoint(n)
        return ",".join(cluster.endpoint((n + i) % 3) for i in range(3))

    registries = [confine(registry_proc(f"registry-{n}", etcd_for(n), addresses[n], staging,
                                        cfg.prefix, out / "logs" / f"registry-{n}.log", tls,
                                        cluster.version, metrics[n]),
                          network, registry_node(n))
                  for n in range(2)]
    watchers = [confine(watcher_proc(addresses, staging, out / f"watcher-{n}-state.sqlite",
                                     out / "logs" / f"watcher-{n}.log", tls, f"watcher-{n}",
                                     cfg.ttl),
                        network, watcher_node(n))
                for n in range(cfg.watchers)]

    def make_agent(slot: AgentSlot) -> Proc:
        return confine(agent_proc(slot.role, slot.name, addresses, slot.history, cfg.seed,
                                  cfg.ttl, slot.group, out / "logs" / f"{slot.name}.log", tls),
                       network, agent_node(slot.index))

    histories = out / "history"
    agents = [AgentSlot("producer", i, "", make_agent, histories)
              for i in range(cfg.producers)]
    agents += [AgentSlot("consumer", len(agents) + i, g, make_agent, histories)
               for i, g in enumerate(g for g in cfg.groups for _ in range(cfg.consumers))]
    replicas = Replicas(addresses, tls)
    world = World(cluster, registries, watchers, agents, staging, cfg.ttl, rng, driver,
                  operator=replicas.call, network=network, etcd_quota=cluster.quota,
                  registry_ports=tuple(int(a.rsplit(":", 1)[1]) for a in addresses))
    feeder = Feeder(cfg, replicas, driver, staging)
    sampler = PoolSampler(replicas)
    started = time.monotonic()
    released = ""
    try:
        world.staging_tmpfs = staging_fs.mount()
        cluster.start()
        for r in registries:
            r.start()
        for w in watchers:
            w.start()
        say(f"faults: up in {time.monotonic() - started:.1f} s (etcd {cluster.endpoint(0)}, "
            f"registries {', '.join(addresses)}, "
            f"{'plaintext' if tls is None else 'mutual TLS'}, "
            f"{'a network namespace each' if network else 'loopback'}); "
            f"load for {cfg.duration:g} s, seed {cfg.seed}")
        for slot in agents:
            slot.start()
        feeder.start()
        sampler.start()
        count = run_nemeses(world, list(cfg.nemeses), time.monotonic() + cfg.duration,
                            cfg.gap, cfg.every_kind)
        feeder.stop.set()
        feeder.join()
        world.heal()
        drained = _drain(feeder, cfg.drain)
        driver.write("drained", "info", complete=drained)
        for slot in agents:
            assert slot.proc is not None
            slot.proc.stop(15.0)
        for w in watchers:
            w.stop(15.0)
        for n, address in enumerate(metrics):
            try:
                repaired[f"registry-{n}"] = pool_units_repaired(address)
            except (OSError, ValueError) as e:
                unread.append(f"registry-{n}'s /metrics not read: {e}")
        for proc in registries:
            proc.stop(10.0)
        temps = temp_files(staging)
        staged = staged_files(staging)
        db_size = cluster.db_size(cluster.answering() or 0)
        diverged = cluster.divergence()
        member = cluster.leader()
        assert member is not None, "no etcd member leads after healing"
        snap = read_snapshot(cluster.endpoint(member), cfg.prefix)
    finally:
        world.stop.set()
        feeder.stop.set()
        sampler.stop.set()
        if sampler.is_alive():
            sampler.join(10)
        replicas.close()
        for slot in agents:
            if slot.proc is not None:
                slot.proc.stop(5.0)
        for proc in [*watchers, *registries]:
            proc.stop(10.0)
        cluster.stop()
        driver.close()
        released = staging_fs.release(keep=cfg.keep_staging)
    snap.dump(out / "journal.jsonl")
    records = hist.read_all(out / "history")
    report = check(records, snap, feeder.created, count,
                   staged=None if feeder.retention is None else staged,
                   pool_samples=sampler.samples, pool_repaired=repaired)
    report.notes += unread
    report.stats["pool_repaired_read"] = len(repaired)  # registries whose /metrics was read
    report.stats["pool_samples"] = len(sampler.samples)
    _count_temp_files(report, temps, records)
    report.stats["seed"] = cfg.seed
    report.stats["tls"] = int(tls is not None)
    report.stats["netns"] = int(network is not None)
    report.stats["tasks"] = len(feeder.created)
    report.stats["entries"] = len(snap.entries)
    report.stats["drained"] = int(drained)
    report.stats["seconds"] = round(time.monotonic() - started)
    if diverged:
        # The checker reads the leader's state; agents were served by every member.
        report.stats["etcd_diverged"] = 1
        report.notes.append(f"etcd {diverged}: the verdict is about etcd, not Baton "
                            "(etcd 3.5.0-3.5.2 lose applied writes after a crash: "
                            "etcd-io/etcd#13766)")
    report.notes.append(f"staging: {staging_fs.describe()}" + (f"; {released}" if released
                                                                 else ""))
    if db_size is not None and cluster.quota:
        report.notes.append(f"etcd's database at the end: {db_size / 2**20:.1f} MiB of its "
                            f"{cluster.quota / 2**20:g} MiB quota")
    driven = list(hist.read(out / "history" / "driver.jsonl"))
    _count_crashes(report, [d for d in driven if d["op"] == "crash"])
    nemeses = [d for d in driven if d["op"] == "nemesis" and d["phase"] != "invoke"]
    _write_report(out / "report.txt", report, nemeses)
    if not cfg.keep_staging:
        shutil.rmtree(staging, ignore_errors=True)
    say(report.summary())
    return Result(report, out, nemeses)


def _count_crashes(report: Report, crashes: list[dict[str, Any]]) -> None:
    """Processes that died by themselves: known bugs of others are noted, not counted."""
    report.stats["crashes"] = sum(1 for c in crashes if not c.get("known"))
    for c in crashes:
        if c.get("known"):
            report.stats[f"known:{c['known']}"] += 1
            report.notes.append(f"{c['name']} died of the known bug {c['known']}")
        else:
            report.notes.append(f"{c['name']} crashed (exit {c['status']}); see its log "
                                f"{c['log']}")


def _count_temp_files(report: Report, temps: list[str],
                      records: list[dict[str, Any]]) -> None:
    """Temp files left under the staging root: those of attempts a SIGKILL cut short
    are expected (noted), and so are the partials resumable attempts kept
    (``tmp_kept``); any other is counted (``tmp_left``) and fails the run."""
    left, killed, kept = leftover_temp_files(temps, records)
    report.stats["tmp_left"] = len(left)
    report.stats["tmp_kept"] = len(kept)
    for path in left:
        report.notes.append(f"temp file left behind by an attempt that ended: {path}")
    if killed:
        report.notes.append(f"{len(killed)} temp file(s) of attempts cut short by a SIGKILL "
                            f"(expected): {', '.join(killed[:5])}")
    if kept:
        report.notes.append(f"{len(kept)} partial file(s) kept by resumable attempts for "
                            f"the next one (expected): {', '.join(kept[:5])}")


def _drain(feeder: Feeder, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if feeder.done():
            return True
        time.sleep(1.0)
    return False


def _write_report(path: Path, report: Report, nemeses: list[dict[str, Any]]) -> None:
    lines = [report.summary(), "", f"violations ({len(report.violations)}):"]
    lines += [f"  {v}" for v in report.violations] or ["  none"]
    lines += ["", f"notes ({len(report.notes)}):"]
    lines += [f"  {n}" for n in report.notes] or ["  none"]
    lines += ["", f"nemeses ({len(nemeses)}):"]
    skip = {"t", "process", "pid", "op", "phase"}
    lines += ["  " + " ".join(f"{k}={v}" for k, v in r.items() if k not in skip)
              for r in nemeses]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
