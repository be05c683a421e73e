"""Producer loops: what an agent's loop gets through the public client, file included,
now and at an earlier revision, next to PostgreSQL ``SKIP LOCKED`` doing the same work."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from baton_relay.client import Client

from . import pg_peer
from .agents import double_claims
from .claims import postgres_bindir
from .harness import (
    BenchError,
    Daemon,
    Stack,
    die_with_parent,
    etcd_kv_calls,
    ms,
    ratio,
    tree_env,
    worktree,
)
from .profiles import Profile
from .report import Section, Table, line_plot

METHOD = """
Every agent is a producer: each step takes an entry, writes its file (a few hundred
bytes: a temp file, fsync, rename, fsync of its directory) and publishes it — what a
real producer does, and the part of a cycle the registry does not see. At each number
of agents (one process and one connection per agent; the processes live for the whole
scenario and run one job per point), rounds back to back, one etcd, one PostgreSQL:

* **Baton, helper loop** — `produce_each` as it runs by default, on a kept-alive
  session: on the session's stream, one step (one message, one etcd transaction)
  commits what the loop wrote and claims what it works on next — several entries at
  once when the loop is quick (working ahead: as many as it writes within `linger`,
  at most `ahead`), one when it is slow.
* **Baton, one at a time** — the same helper with `ahead=1`: each step commits one
  entry and claims the next (one message, one transaction per entry).
* **Baton, checkpoint each step** — the helper loop with one checkpoint per step (a few
  bytes of data, after the write, before the commit): a third message on the stream,
  and one more etcd transaction per step, grouped with the others by group commit.
  Its extra etcd requests per step are the cost of a checkpoint (one, or fewer when
  grouped).
* **Baton, claim then commit** — a `produce` block per entry on the same kind of session:
  a claim, then a commit, two messages on the stream.
* **Baton before** — `produce_each` of the revision named below, its own registry on the
  same etcd (another prefix): the baseline the reshaping is measured against, in the same
  run and on the same machine state.
* **PostgreSQL** — the claims scenario's `SKIP LOCKED` claim and owner-checked commit
  around the same file write (`bench/loop_agent.py`).

The agents' code is `bench/loop_agent.py`, run as a file so that the same code drives
both trees. Registry CPU and etcd requests are counted over each run (both registries
run throughout; the idle one's background requests are counted too).
"""

SYSTEMS = ("helper loop", "one at a time", "checkpoint each step", "claim then commit",
           "before", "PostgreSQL")
COLOURS = dict(zip(SYSTEMS, ("C0", "C3", "C1", "C2", "C7", "C4"), strict=True))
#: bytes each step writes
PAYLOAD = 512
#: seconds a round may take beyond its own length
SLACK = 120.0
AGENT_FILE = Path(__file__).resolve().with_name("loop_agent.py")


class Worker:
    """One agent process speaking ``loop_agent``'s line protocol."""

    def __init__(self, env: dict[str, str] | None, log: Path) -> None:
        with log.open("ab") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-u", str(AGENT_FILE)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env=env, preexec_fn=die_with_parent)
        self.log = log
        self._buffer = b""

    def send(self, message: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        self.process.stdin.flush()

    def line(self, deadline: float) -> str:
        """The next line it prints; it must come before ``deadline``."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise BenchError(f"a loop agent did not answer in time (its log: {self.log})")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise BenchError(f"a loop agent exited: {tail}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send(None)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Agents:
    """``size`` workers importing one tree's ``baton_relay``."""

    def __init__(self, size: int, env: dict[str, str] | None, logs: Path) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.workers = [Worker(env, logs / f"agent-{i}.log") for i in range(size)]
        #: the environment naming the tree the agents import (None: this one)
        self.env = env

    def __enter__(self) -> Agents:
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.workers:
            w.close()

    def run(self, jobs: list[dict[str, Any]], seconds: float) -> tuple[float, list[Any]]:
        """Run one job per worker from one common start; the start and the results."""
        prepare = time.monotonic() + SLACK
        for w, job in zip(self.workers, jobs, strict=False):
            w.send(job)
        for w in self.workers[:len(jobs)]:
            if (said := w.line(prepare)) != "ready":
                raise BenchError(f"a loop agent said {said!r}, not ready")
        start = time.monotonic() + 0.1
        for w in self.workers[:len(jobs)]:
            w.send(start)
        done = start + seconds + SLACK
        return start, [json.loads(w.line(done)) for w in self.workers[:len(jobs)]]


@dataclass
class Sample:
    per_s: float
    cycles: int
    latencies: list[float]
    doubles: int = 0
    registry_cpu: float = 0.0
    etcd_requests: int = 0
    agents_cpu: float = 0.0


@dataclass
class Point:
    samples: list[Sample] = field(default_factory=list)

    @property
    def per_s(self) -> float:
        return median(x.per_s for x in self.samples) if self.samples else float("nan")

    def per_cycle(self, name: str) -> float:
        return ratio(sum(getattr(x, name) for x in self.samples),
                     sum(x.cycles for x in self.samples))


def sample(start: float, results: list[dict[str, Any]]) -> Sample:
    cycles = sum(len(r["claimed"]) for r in results)
    elapsed = max(r["end"] for r in results) - start
    return Sample(cycles / elapsed if elapsed > 0 else float("nan"), cycles,
                  [x for r in results for x in r["latencies"]],
                  doubles=double_claims([r["claimed"] for r in results]),
                  agents_cpu=sum(r["cpu"] for r in results))


def create_task(address: str, spec: dict[str, Any], env: dict[str, str] | None) -> None:
    """Create the task with the client of the tree the agents import (an earlier tree's
    registry speaks only its own contract)."""
    if env is None:
        with Client(address, timeout=120) as c:
            c.operator.create_task(spec)
        return
    code = ("import json, sys\n"
            "from baton_relay.client import Client\n"
            "with Client(sys.argv[1], timeout=120) as c:\n"
            "    c.operator.create_task(json.loads(sys.stdin.read()))\n")
    done = subprocess.run([sys.executable, "-c", code, address], input=json.dumps(spec),
                          env=env, capture_output=True, text=True, timeout=SLACK, check=False)
    if done.returncode != 0:
        raise BenchError(f"creating {spec['task_id']} with the earlier tree failed: "
                         f"{done.stderr[-2000:]}")


def baton_run(stack: Stack, agents: Agents, registry: Daemon, loop: str, n: int,
              p: Profile, name: str) -> Sample:
    spec = {"task_id": name, "entries": [
        {"file_id": f"e{i:06d}", "path": f"e{i:06d}"} for i in range(p.loop_entries)]}
    create_task(registry.address, spec, agents.env)
    jobs = [{"runner": "baton", "loop": loop, "address": registry.address, "task": name,
             "agent": f"{name}-{i}", "seconds": p.loop_seconds, "size": PAYLOAD}
            for i in range(n)]
    calls, cpu = etcd_kv_calls(stack.etcd), registry.cpu_seconds()
    start, results = agents.run(jobs, p.loop_seconds)
    out = sample(start, results)
    out.registry_cpu = registry.cpu_seconds() - cpu
    after = etcd_kv_calls(stack.etcd)
    out.etcd_requests = sum(after.get(k, 0) - calls.get(k, 0) for k in ("Txn", "Range"))
    return out


def pg_run(pg: pg_peer.Postgres, agents: Agents, root: Path, n: int, p: Profile,
           name: str) -> Sample:
    table = name.replace("-", "_")
    pg.new_table(table, p.loop_entries)
    jobs = [{"runner": "postgres", "conninfo": pg.conninfo, "table": table,
             "claim_sql": pg_peer.CLAIM_SQL, "commit_sql": pg_peer.COMMIT_SQL,
             "agent": f"agent-{i}", "seconds": p.loop_seconds, "size": PAYLOAD,
             "staging": str(root / "pg-staging" / table)} for i in range(n)]
    start, results = agents.run(jobs, p.loop_seconds)
    return sample(start, results)


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    points = {(s, n): Point() for s in SYSTEMS for n in p.loop_agents}
    bindir, no_pg = postgres_bindir(p)
    size = max(p.loop_agents)
    with contextlib.ExitStack() as stack_:
        stack = stack_.enter_context(Stack(root))
        now = stack_.enter_context(Agents(size, None, root / "agents-now"))
        registry = stack.registry(root / "staging-now", prefix="/baton/now/")
        runs: dict[str, Any] = {
            "helper loop": lambda n, name: baton_run(stack, now, registry, "each", n, p, name),
            "one at a time": lambda n, name: baton_run(stack, now, registry, "single", n, p,
                                                       name),
            "checkpoint each step": lambda n, name: baton_run(stack, now, registry,
                                                               "checkpoint", n, p, name),
            "claim then commit": lambda n, name: baton_run(stack, now, registry, "plain", n,
                                                            p, name),
        }
        if p.loop_before:
            tree = stack_.enter_context(worktree(p.loop_before))
            env = tree_env(tree)
            before = stack_.enter_context(Agents(size, env, root / "agents-before"))
            old = stack.registry(root / "staging-before", prefix="/baton/before/", tree=tree)
            runs["before"] = lambda n, name: baton_run(stack, before, old, "each", n, p, name)
        if bindir:
            pg = stack_.enter_context(pg_peer.Postgres(bindir, size + 10))
            runs["PostgreSQL"] = lambda n, name: pg_run(pg, now, root, n, p, name)
        systems = [s for s in SYSTEMS if s in runs]
        for r in range(p.loop_rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for n in p.loop_agents:
                for system in order:
                    name = f"loop-{system.split()[0].lower()}-{n}-{r}"
                    points[system, n].samples.append(runs[system](n, name))
    return section(p, points, plot_dir, time.monotonic() - t0, no_pg)


def median_ratio(points: dict[tuple[str, int], Point], a: str, b: str, n: int) -> float:
    """The median over rounds of ``a``'s rate over ``b``'s in the same round."""
    xs, ys = points[a, n].samples, points[b, n].samples
    if not xs or not ys:
        return float("nan")
    return median(ratio(x.per_s, y.per_s) for x, y in zip(xs, ys, strict=True))


def section(p: Profile, points: dict[tuple[str, int], Point], plot_dir: Path,
            seconds: float, no_pg: str) -> Section:
    agents = list(p.loop_agents)
    rounds = "" if p.loop_rounds == 1 else f", medians of {p.loop_rounds} rounds"
    before = f"before ({p.loop_before})" if p.loop_before else "before (not run)"
    rate = Table(f"Producer steps per second (claim, write a {PAYLOAD}-byte file, publish)"
                 f"{rounds}",
                 ["agents", "helper loop", "one at a time", "claim then commit", before,
                  "PostgreSQL", "helper ÷ before", "one at a time ÷ before",
                  "claim+commit ÷ before", "helper ÷ PostgreSQL",
                  "claim+commit ÷ PostgreSQL", "before ÷ PostgreSQL"])
    cost = Table("Per step: the registry's CPU (ms) and etcd requests (Txn + Range)",
                 ["agents", "registry ms: helper", "registry ms: one at a time",
                  "registry ms: claim+commit", "registry ms: before", "etcd req.: helper",
                  "etcd req.: one at a time", "etcd req.: claim+commit",
                  "etcd req.: before", "agent CPU ms: helper", "agent CPU ms: before",
                  "agent CPU ms: PostgreSQL"])
    checkpoints = Table("One checkpoint per step: its cost beside the plain helper loop",
                        ["agents", "helper steps/s", "with checkpoint steps/s",
                         "checkpoint ÷ helper", "etcd req./step: helper",
                         "etcd req./step: with checkpoint", "etcd req. per checkpoint",
                         "registry ms per checkpoint"])
    latency = Table("Step latency, ms (p50 / p99)",
                    ["agents", *(f"{s} {q}" for s in SYSTEMS for q in ("p50", "p99"))])
    safety = Table("Entries handed out twice, all rounds",
                   ["agents", *(f"{s}: steps" for s in SYSTEMS), "double claims"])
    for n in agents:
        h, o, k, c, b, g = (points[s, n] for s in SYSTEMS)
        checkpoints.rows.append([
            n, h.per_s, k.per_s, median_ratio(points, "checkpoint each step", "helper loop", n),
            h.per_cycle("etcd_requests"), k.per_cycle("etcd_requests"),
            k.per_cycle("etcd_requests") - h.per_cycle("etcd_requests"),
            1000 * (k.per_cycle("registry_cpu") - h.per_cycle("registry_cpu"))])
        rate.rows.append([n, h.per_s, o.per_s, c.per_s, b.per_s, g.per_s,
                          median_ratio(points, "helper loop", "before", n),
                          median_ratio(points, "one at a time", "before", n),
                          median_ratio(points, "claim then commit", "before", n),
                          median_ratio(points, "helper loop", "PostgreSQL", n),
                          median_ratio(points, "claim then commit", "PostgreSQL", n),
                          median_ratio(points, "before", "PostgreSQL", n)])
        cost.rows.append([n, 1000 * h.per_cycle("registry_cpu"),
                          1000 * o.per_cycle("registry_cpu"),
                          1000 * c.per_cycle("registry_cpu"),
                          1000 * b.per_cycle("registry_cpu"), h.per_cycle("etcd_requests"),
                          o.per_cycle("etcd_requests"),
                          c.per_cycle("etcd_requests"), b.per_cycle("etcd_requests"),
                          1000 * h.per_cycle("agents_cpu"), 1000 * b.per_cycle("agents_cpu"),
                          1000 * g.per_cycle("agents_cpu")])
        lat = []
        for s in SYSTEMS:
            values = [v for x in points[s, n].samples for v in x.latencies]
            lat += [ms(values, 0.5), ms(values, 0.99)]
        latency.rows.append([n, *lat])
        safety.rows.append([n, *(sum(x.cycles for x in points[s, n].samples) for s in SYSTEMS),
                            sum(x.doubles for s in SYSTEMS for x in points[s, n].samples)])
    plot = line_plot(plot_dir / "loops_throughput.png", "Producer loops: steps per second",
                     "concurrent agents (one process each)", "steps/s",
                     {s: (agents, [points[s, n].per_s for n in agents]) for s in SYSTEMS
                      if any(points[s, n].samples for n in agents)},
                     logx=True, colours=COLOURS)
    headlines = []
    for n in agents:
        parts = [f"helper loop {points['helper loop', n].per_s:,.0f}/s"]
        if p.loop_before:
            parts.append(f"{median_ratio(points, 'helper loop', 'before', n):.2f}x before")
        if any(points["PostgreSQL", n].samples):
            parts.append(f"{median_ratio(points, 'helper loop', 'PostgreSQL', n):.2f}x "
                         f"PostgreSQL")
        parts.append(f"registry {1000 * points['helper loop', n].per_cycle('registry_cpu'):.2f}"
                     f" ms CPU/step")
        headlines.append(f"Producer loops at {n} agents: " + ", ".join(parts) + ".")
    notes = [] if not no_pg else [f"The PostgreSQL peer did not run: {no_pg}."]
    if not p.loop_before:
        notes.append("The earlier revision was not run (this profile names none).")
    facts: dict[str, float] = {}
    for n in agents:
        if p.loop_before:
            facts[f"loops.vs_before.{n}"] = median_ratio(points, "helper loop", "before", n)
        if any(points["PostgreSQL", n].samples):
            facts[f"loops.vs_pg.{n}"] = median_ratio(points, "helper loop", "PostgreSQL", n)
        facts[f"loops.registry_ms.{n}"] = 1000 * points["helper loop", n].per_cycle(
            "registry_cpu")
    return Section("loops", "Producer loops", METHOD.strip(),
                   [rate, cost, checkpoints, latency, safety], [plot], notes, headlines,
                   seconds, facts=facts)
