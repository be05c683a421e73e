"""The stack: what a user gets from `baton up` and the client's own loop, file work and
verification included, beside the PostgreSQL loop a careful engineer writes."""

from __future__ import annotations

import contextlib
import re
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from statistics import median
from typing import Any

from baton_relay.client import Client
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import free_port, terminate, wait_ready

from . import pg_peer
from .agents import double_claims
from .claims import postgres_bindir
from .harness import (
    BenchError,
    cpu_seconds,
    die_with_parent,
    ms,
    ratio,
    tree_env,
    worktree,
)
from .loops import PAYLOAD, Agents
from .profiles import Profile
from .report import Section, Table, bar_plot, line_plot

METHOD = """
Tried as a new user would: `baton up` (its own etcd, registry and watcher, mutual TLS
everywhere, the watcher verifying every file put into staging), then agent processes
running the client's own producer loop, `produce_each` as it runs by default (working
ahead on a kept-alive session), with the agent identity `baton up` made. Each step
writes one small file exactly as the helper does — a temp file, fsync, rename, fsync of
its directory, BLAKE3 of its bytes — and the watcher checksums it again and reports it,
so a file counts once it is *verified*. At each number of agents (one process and one
connection each), rounds back to back:

* **Baton** — files verified per second, from the common start to the later of the
  agents' end and the last verification.
* **PostgreSQL** — the same file work around the loop a careful engineer writes on
  PostgreSQL 15 (fsync and synchronous commit on): each step is one transaction that
  marks written, with their BLAKE3, the rows written since the last step (checking the
  agent still owns them) and claims up to 8 more with `FOR UPDATE SKIP LOCKED`.

Each run starts once the stack is quiet (the new task taken in by the registry and the
watcher). CPU per file is counted from /proc for every process: the agents (their own
`process_time`), and etcd, the registry and the watcher (or PostgreSQL's server and
its backends), over the run. Keys written per file are etcd's own counters (puts and
deletes) over the run. Write → verified runs from the instant the agent closed a file
to the entry's verified time as the registry stamps it (milliseconds). The run waits
for its last verification on the watcher's count of verified entries (its metrics,
kept as entries change), which costs the stack next to nothing — `GetTask` reads every
entry of the task and would be counted as the run's registry CPU — and then checks,
with one `ListEntries` not counted, that every file written is verified. Every id
claimed is checked for doubles; there must be none.
"""

SYSTEMS = ("Baton", "Baton before", "PostgreSQL")
COLOURS = dict(zip(SYSTEMS, ("C0", "C7", "C4"), strict=True))
PROCESSES = ("agents", "registry", "watcher", "etcd", "postgres")
#: entries claimed per PostgreSQL step
PG_BATCH = 8
READY_TIMEOUT = 90.0
#: seconds allowed for the last written files to turn verified
VERIFY_TIMEOUT = 120.0
#: seconds between two looks at the watcher's count of verified entries
VERIFY_POLL = 0.1
#: a stack is settled once its processes use at most SETTLE_BUSY of a core in two
#: consecutive samples of SETTLE_SAMPLE seconds
SETTLE_TIMEOUT = 300.0
SETTLE_SAMPLE = 0.5
SETTLE_BUSY = 0.1


class Up:
    """`baton up` in ``root`` (mutual TLS, one watcher), until closed: its address, the
    agent and operator identities' settings, and its processes' ids."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.data = root / "up"
        self.staging = root / "staging"
        port, self._etcd_port = free_port(), free_port()
        self.address = f"127.0.0.1:{port}"
        self.log = root / "up.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "baton_relay.client.cli", "up", "--data-dir",
                 str(self.data), "--staging", str(self.staging), "--etcd-port",
                 str(self._etcd_port), "--registry-port", str(port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=die_with_parent)
        try:
            wait_ready(self._ready, self.process, daemon="baton up", log_path=self.log,
                       timeout=READY_TIMEOUT)
            self.pids = self._children()
        except BaseException:
            self.close()
            raise
        pki = self.data / "pki"
        self.agent_env = {"BATON_REGISTRY": self.address, "BATON_CA": str(pki / "ca.crt"),
                          "BATON_CERT": str(pki / "agent.crt"),
                          "BATON_KEY": str(pki / "agent.key")}
        self.operator = (str(pki / "ca.crt"), str(pki / "operator.crt"),
                         str(pki / "operator.key"))
        self._ssl = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self._ssl.load_cert_chain(str(pki / "etcd-client.crt"), str(pki / "etcd-client.key"))

    def _ready(self) -> bool:
        text = self.log.read_text(errors="replace")
        return any(line.startswith("ready") for line in text.splitlines())

    def _children(self) -> dict[str, int]:
        """etcd's, the registry's and the watcher's process ids, by their command lines."""
        found: dict[str, int] = {}
        todo = [self.process.pid]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
            if pid == self.process.pid:
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"baton_relay.registry" in argv:
                found["registry"] = pid
            elif b"baton_relay.watcher" in argv:
                found["watcher"] = pid
            elif argv and argv[0].endswith(b"etcd"):
                found["etcd"] = pid
        missing = {"etcd", "registry", "watcher"} - set(found)
        if missing:
            raise BenchError(f"baton up runs no {', '.join(sorted(missing))} (log: {self.log})")
        return found

    def keys_written(self) -> int:
        """Keys etcd has put and deleted so far (its own counters)."""
        url = f"https://127.0.0.1:{self._etcd_port}/metrics"
        with urllib.request.urlopen(url, context=self._ssl, timeout=10) as response:
            text = response.read().decode()
        total = 0
        for name in ("put", "delete"):
            m = re.search(rf"^etcd_mvcc_{name}_total (\S+)$", text, re.MULTILINE) or re.search(
                rf"^etcd_debugging_mvcc_{name}_total (\S+)$", text, re.MULTILINE)
            total += int(float(m.group(1))) if m else 0
        return total

    def _metrics(self, process: str) -> str:
        """The metrics page of ``process`` (its ``--metrics`` address, from /proc)."""
        argv = Path(f"/proc/{self.pids[process]}/cmdline").read_bytes().split(b"\0")
        where = argv[argv.index(b"--metrics") + 1].decode()
        with urllib.request.urlopen(f"http://{where}/metrics", timeout=10) as response:
            return response.read().decode()

    def verified(self) -> int:
        """Entries the watcher knows verified, every task it serves: its census, kept
        as entries change, so asking costs the stack next to nothing (a ``GetTask``
        reads every entry of the task, and that would be counted as the run's)."""
        m = re.search(r'^baton_watcher_entries\{state="verified"\} (\S+)$',
                      self._metrics("watcher"), re.MULTILINE)
        return int(float(m.group(1))) if m else 0

    def registry_calls(self) -> dict[str, int]:
        """Calls (and agent stream messages) the registry has handled so far, by method."""
        text = self._metrics("registry")
        calls: dict[str, int] = {}
        for method, value in re.findall(
                r'^baton_grpc_calls_total\{[^}]*method="([^"]+)"[^}]*\} (\S+)$', text,
                re.MULTILINE):
            calls[method] = calls.get(method, 0) + int(float(value))
        return calls

    def cpu(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def settle(self, timeout: float = SETTLE_TIMEOUT) -> None:
        """Wait until the stack is quiet (a new task's entries taken in by the registry's
        view and the watcher's table), so that a run counts the hand-offs only."""
        deadline = time.monotonic() + timeout
        quiet, last = 0, sum(self.cpu().values())
        while quiet < 2:
            if time.monotonic() > deadline:
                raise BenchError(f"the stack did not settle within {timeout:.0f} s")
            time.sleep(SETTLE_SAMPLE)
            now = sum(self.cpu().values())
            quiet = quiet + 1 if now - last <= SETTLE_BUSY * SETTLE_SAMPLE else 0
            last = now

    def client(self) -> Client:
        ca, cert, key = self.operator
        return Client(self.address, timeout=120, ca=ca, cert=cert, key=key)

    def close(self) -> None:
        terminate(self.process, timeout=30)


@dataclass
class Sample:
    files: int
    per_s: float
    doubles: int
    cpu: dict[str, float] = field(default_factory=dict)
    keys: int = 0
    #: write → verified, seconds
    verified: list[float] = field(default_factory=list)
    #: the registry's calls (agent stream messages included) by method, over the run
    calls: dict[str, int] = field(default_factory=dict)


@dataclass
class Point:
    samples: list[Sample] = field(default_factory=list)

    @property
    def per_s(self) -> float:
        return median(x.per_s for x in self.samples) if self.samples else float("nan")

    def per_file(self, name: str) -> float:
        """CPU seconds of process ``name`` (or keys) per file, over every round."""
        total = sum(x.cpu.get(name, 0.0) if name != "keys" else x.keys for x in self.samples)
        return ratio(total, sum(x.files for x in self.samples))


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def baton_run(up: Up, agents: Agents, n: int, p: Profile, name: str) -> Sample:
    with up.client() as c:
        c.operator.create_task({"task_id": name, "entries": [
            {"file_id": f"e{i:06d}", "path": f"{name}/e{i:06d}"}
            for i in range(p.stack_entries)]})
        jobs = [{"runner": "baton", "loop": "each", "address": up.address, "task": name,
                 "agent": f"{name}-{i}", "seconds": p.stack_seconds, "size": PAYLOAD,
                 "times": True} for i in range(n)]
        up.settle()
        cpu, keys, calls = up.cpu(), up.keys_written(), up.registry_calls()
        seen = up.verified()
        start, results = agents.run(jobs, p.stack_seconds)
        written = {f: t for r in results for f, t in r["written"].items()}
        deadline = time.monotonic() + VERIFY_TIMEOUT
        while up.verified() - seen < len(written):
            if time.monotonic() > deadline:
                states = c.operator.get_task(name).states
                raise BenchError(f"{name}: {len(written)} written, only "
                                 f"{states.get('verified', 0)} verified "
                                 f"in {VERIFY_TIMEOUT:.0f} s: {dict(states)}")
            time.sleep(VERIFY_POLL)
        used = {k: v - cpu[k] for k, v in up.cpu().items()}
        keys = up.keys_written() - keys
        after = up.registry_calls()
        calls = {m: after[m] - calls.get(m, 0) for m in after if after[m] > calls.get(m, 0)}
        entries = c.operator.list_entries(name, state=pb.ENTRY_STATE_VERIFIED)
    verified = {e.file_id: _stamp(e.updated_at) for e in entries if e.file_id in written}
    if missing := sorted(set(written) - set(verified)):
        raise BenchError(f"{name}: {len(missing)} files written and not verified, e.g. "
                         f"{missing[0]} (the watcher counted them verified)")
    latencies = [t - written[f] for f, t in verified.items()]
    # the last verification, on the agents' clock (the registry stamps wall-clock time)
    last = max(verified.values(), default=0.0) - (time.time() - time.monotonic())
    end = max([last, *(r["end"] for r in results)]) if written else start
    elapsed = end - start
    return Sample(len(written), len(written) / elapsed if elapsed > 0 else float("nan"),
                  double_claims([r["claimed"] for r in results]),
                  {**used, "agents": sum(r["cpu"] for r in results)}, keys, latencies,
                  calls)


def pg_run(pg: pg_peer.Postgres, agents: Agents, root: Path, n: int, p: Profile,
           name: str) -> Sample:
    table = name.replace("-", "_")
    pg.new_table(table, p.stack_entries)
    jobs = [{"runner": "postgres-batched", "conninfo": pg.conninfo, "table": table,
             "claim_sql": pg_peer.BATCH_CLAIM_SQL, "commit_sql": pg_peer.BATCH_COMMIT_SQL,
             "batch": PG_BATCH, "agent": f"agent-{i}", "seconds": p.stack_seconds,
             "size": PAYLOAD, "staging": str(root / "pg-staging" / table)} for i in range(n)]
    before = pg.cpu()
    start, results = agents.run(jobs, p.stack_seconds)
    used = pg.cpu() - before
    files = sum(len(r["claimed"]) for r in results)
    elapsed = max(r["end"] for r in results) - start
    ids = [int(f[1:]) for r in results for f in r["claimed"]]
    if pg.not_written(table, ids):
        raise BenchError(f"{table}: rows an agent committed are not written")
    return Sample(files, files / elapsed if elapsed > 0 else float("nan"),
                  double_claims([r["claimed"] for r in results]),
                  {"postgres": used, "agents": sum(r["cpu"] for r in results)})


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    points = {(s, n): Point() for s in SYSTEMS for n in p.stack_agents}
    bindir, no_pg = postgres_bindir(p)
    size = max(p.stack_agents)
    with contextlib.ExitStack() as stack:
        up = Up(root / "now")
        stack.callback(up.close)
        agents = stack.enter_context(Agents(size, {**_env(), **up.agent_env},
                                            root / "agents"))
        runs: dict[str, Any] = {
            "Baton": lambda n, name: baton_run(up, agents, n, p, name)}
        if p.stack_before:
            env = tree_env(stack.enter_context(worktree(p.stack_before)))
            old = Up(root / "before", env)
            stack.callback(old.close)
            olds = stack.enter_context(Agents(size, {**_env(), **env, **old.agent_env},
                                              root / "agents-before"))
            runs["Baton before"] = lambda n, name: baton_run(old, olds, n, p, name)
        if bindir:
            pg = stack.enter_context(pg_peer.Postgres(bindir, size + 10))
            # Agents of its own, as each Baton side has: a Baton side whose workers
            # also ran the PostgreSQL loop ran slower than the other side running the
            # very same tree (0.81x in 3 rounds at 16 agents; 1.01x once apart).
            pg_agents = stack.enter_context(Agents(size, _env(), root / "agents-pg"))
            runs["PostgreSQL"] = lambda n, name: pg_run(pg, pg_agents, root, n, p, name)
        systems = [s for s in SYSTEMS if s in runs]
        for r in range(p.stack_rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for n in p.stack_agents:
                for system in order:
                    name = f"stack-{system[0].lower()}-{n}-{r}"
                    points[system, n].samples.append(runs[system](n, name))
    return section(p, points, plot_dir, time.monotonic() - t0, no_pg)


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items()
            if k not in ("BATON_REGISTRY", "BATON_CA", "BATON_CERT", "BATON_KEY")}


def median_ratio(points: dict[tuple[str, int], Point], n: int, a: str = "Baton",
                 b: str = "PostgreSQL") -> float:
    """The median over rounds of ``a``'s rate over ``b``'s in the same round."""
    xs, ys = points[a, n].samples, points[b, n].samples
    if not xs or not ys:
        return float("nan")
    return median(ratio(x.per_s, y.per_s) for x, y in zip(xs, ys, strict=True))


def section(p: Profile, points: dict[tuple[str, int], Point], plot_dir: Path,
            seconds: float, no_pg: str) -> Section:
    agents = list(p.stack_agents)
    rounds = "" if p.stack_rounds == 1 else f", medians of {p.stack_rounds} rounds"
    before = f"Baton before ({p.stack_before})" if p.stack_before else "Baton before (not run)"
    rate = Table(f"Files per second (claim, write a {PAYLOAD}-byte file, publish; Baton: "
                 f"until verified){rounds}",
                 ["agents", "Baton", "PostgreSQL", "Baton ÷ PostgreSQL", before,
                  "before ÷ PostgreSQL", "Baton ÷ before"])
    cost = Table("CPU per file (ms), every process, over all rounds",
                 ["agents", "system", "agents' CPU", "registry", "watcher",
                  "etcd / PostgreSQL server", "all", "etcd keys written"])
    latency = Table("Write → verified (ms)",
                    ["agents", "system", "p50", "p99", "max", "files"])
    calls = Table("The registry's calls and agent stream messages per file, by method "
                  "(all rounds)", ["agents", "system", "method", "per file"])
    safety = Table("Entries handed out twice, all rounds",
                   ["agents", *(f"{s} files" for s in SYSTEMS), "double claims"])
    for n in agents:
        b, g = points["Baton", n], points["PostgreSQL", n]
        o = points["Baton before", n]
        rate.rows.append([n, b.per_s, g.per_s, median_ratio(points, n), o.per_s,
                          median_ratio(points, n, "Baton before"),
                          median_ratio(points, n, "Baton", "Baton before")])
        for system in SYSTEMS:
            point = points[system, n]
            if not point.samples:
                continue
            if system == "PostgreSQL":
                used = [1000 * g.per_file("agents"), float("nan"), float("nan"),
                        1000 * g.per_file("postgres")]
                keys = float("nan")
            else:
                used = [1000 * point.per_file(k)
                        for k in ("agents", "registry", "watcher", "etcd")]
                keys = point.per_file("keys")
            cost.rows.append([n, system, *used, sum(u for u in used if u == u), keys])
            if system == "PostgreSQL":
                continue
            files = sum(x.files for x in point.samples)
            by_method: dict[str, int] = {}
            for x in point.samples:
                for m, k in x.calls.items():
                    by_method[m] = by_method.get(m, 0) + k
            for m, k in sorted(by_method.items(), key=lambda mk: -mk[1]):
                if k >= files / 100:
                    calls.rows.append([n, system, m, ratio(k, files)])
            values = [v for x in point.samples for v in x.verified]
            latency.rows.append([n, system, ms(values, 0.5), ms(values, 0.99),
                                 1000 * max(values, default=float("nan")), len(values)])
        safety.rows.append([n, *(sum(x.files for x in points[s, n].samples) for s in SYSTEMS),
                            sum(x.doubles for s in SYSTEMS for x in points[s, n].samples)])
    plots = [
        line_plot(plot_dir / "stack_throughput.png",
                  "The stack: files per second (Baton: verified)",
                  "concurrent agents (one process each)", "files/s",
                  {s: (agents, [points[s, n].per_s for n in agents]) for s in SYSTEMS
                   if any(points[s, n].samples for n in agents)},
                  logx=True, colours=COLOURS),
        bar_plot(plot_dir / "stack_cpu.png", "The stack: CPU per file (ms)", "ms",
                 [str(n) + " agents" for n in agents],
                 {k: [1000 * points["Baton", n].per_file(k) for n in agents]
                  for k in ("agents", "registry", "watcher", "etcd")}
                 | {"PostgreSQL (all)": [1000 * (points["PostgreSQL", n].per_file("agents")
                                                 + points["PostgreSQL", n].per_file(
                                                     "postgres")) for n in agents]}),
    ]
    headlines, facts = [], {}
    best = max(agents, key=lambda n: points["Baton", n].per_s
               if points["Baton", n].samples else -1.0)
    if points["Baton", best].samples:
        facts["stack.best_per_s"] = points["Baton", best].per_s
        facts["stack.best_p99"] = ms([v for x in points["Baton", best].samples
                                      for v in x.verified], 0.99)
    for n in agents:
        b = points["Baton", n]
        parts = [f"Baton {b.per_s:,.0f} files/s verified"]
        if points["PostgreSQL", n].samples:
            parts.append(f"{median_ratio(points, n):.2f}x PostgreSQL")
            facts[f"stack.vs_pg.{n}"] = median_ratio(points, n)
        parts.append(f"registry {1000 * b.per_file('registry'):.2f} ms, watcher "
                     f"{1000 * b.per_file('watcher'):.2f} ms CPU/file")
        facts[f"stack.registry_ms.{n}"] = 1000 * b.per_file("registry")
        facts[f"stack.watcher_ms.{n}"] = 1000 * b.per_file("watcher")
        headlines.append(f"The stack at {n} agents: " + ", ".join(parts) + ".")
    notes = [] if not no_pg else [f"The PostgreSQL peer did not run: {no_pg}."]
    return Section("stack", "The stack", METHOD.strip(), [rate, cost, latency, calls, safety],
                   plots, notes, headlines, seconds, facts=facts)
