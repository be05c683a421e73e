"""Claims: claim → commit cycles through the registry, next to the limit and the peer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from client import Client

from . import manifest_peer
from .agents import AgentArgs, RawArgs, baton_agent, double_claims, rate, raw_etcd_agent
from .harness import Stack, etcd_kv_calls, load_average, ms, ratio
from .pool import Pool
from .profiles import Profile
from .report import Section, Table, line_plot

METHOD = """
At each number of agents (one process and one connection per agent), four runs
back to back, on one etcd:

* **Baton** — each agent opens a session and loops claim → commit on a fresh task.
* **raw etcd** (the limit) — each agent loops single create-only transactions
  through `registry._etcd.Etcd`, the client the registry itself uses.
* **JSON manifest, seed** and **JSON manifest + flock** (the peer) — seed 000 §3.2
  on a manifest of as many entries as Baton's task (`bench/manifest_peer.py`).

Runs are bounded by the task size and by `seconds`. Each agent records what it
claimed; an entry claimed twice is a double claim.
"""

SYSTEMS = ("Baton", "raw etcd", "JSON seed", "JSON + flock")
COLOURS = dict(zip(SYSTEMS, ("C0", "C1", "C2", "C3"), strict=True))


@dataclass
class Sample:
    """One system at one number of agents in one round."""

    per_s: float
    latencies: list[float]
    cycles: int
    doubles: int = 0
    #: JSON peer: commits whose update was refused (the seed carries on)
    failed_commits: int = 0
    #: JSON peer: entries committed by an agent but not ``ready`` in the final manifest
    lost: int = 0
    #: Baton: etcd KV requests (Txn, Range) during the run, background work included
    etcd_requests: int = 0


@dataclass
class Point:
    """One system at one number of agents, over all rounds."""

    samples: list[Sample] = field(default_factory=list)

    @property
    def per_s(self) -> float:
        return median(x.per_s for x in self.samples)

    def ms(self, q: float) -> float:
        return ms([v for x in self.samples for v in x.latencies], q)

    def total(self, name: str) -> int:
        return sum(getattr(x, name) for x in self.samples)


def baton_sample(stack: Stack, pool: Pool, address: str, n: int, p: Profile,
                 round_: int) -> Sample:
    task = f"claims-{n}-{round_}"
    with Client(address, timeout=120) as c:
        c.create_task({"task_id": task, "entries": [
            {"file_id": f"e{i:06d}", "path": f"e{i:06d}"} for i in range(p.claim_entries)]})
    before = etcd_kv_calls(stack.etcd)
    args = [AgentArgs(address, task, f"agent-{i}", p.claim_seconds) for i in range(n)]
    rnd = pool.run(baton_agent, args, p.claim_seconds)
    after = etcd_kv_calls(stack.etcd)
    cycles = sum(r.calls for r in rnd.results)
    return Sample(rate(cycles, rnd.start, [r.end for r in rnd.results]),
                  [x for r in rnd.results for x in r.latencies], cycles,
                  doubles=double_claims([r.claimed for r in rnd.results]),
                  etcd_requests=sum(after.get(k, 0) - before.get(k, 0) for k in ("Txn", "Range")))


def raw_sample(stack: Stack, pool: Pool, n: int, p: Profile, round_: int) -> Sample:
    args = [RawArgs(stack.etcd.endpoint, f"/bench-raw/{n}/{round_}/{i}/", p.claim_seconds)
            for i in range(n)]
    rnd = pool.run(raw_etcd_agent, args, p.claim_seconds)
    txns = sum(r.calls for r in rnd.results)
    return Sample(rate(txns, rnd.start, [r.end for r in rnd.results]),
                  [x for r in rnd.results for x in r.latencies], txns)


def peer_sample(root: Path, pool: Pool, variant: str, n: int, p: Profile,
                round_: int) -> Sample:
    where = root / f"manifest-{variant}-{n}-{round_}"
    where.mkdir(parents=True)
    path = where / "manifest.json"
    manifest_peer.new_manifest(path, f"claims-{n}", p.claim_entries)
    args = [manifest_peer.PeerArgs(str(path), variant, f"agent-{i}", p.claim_seconds)
            for i in range(n)]
    rnd = pool.run(manifest_peer.agent, args, p.claim_seconds)
    cycles = sum(r.cycles for r in rnd.results)
    claimed = [r.claimed for r in rnd.results]
    committed = {f for ids in claimed for f in ids}
    return Sample(rate(cycles, rnd.start, [r.end for r in rnd.results]),
                  [x for r in rnd.results for x in r.latencies], cycles,
                  doubles=double_claims(claimed),
                  failed_commits=sum(r.failed_commits for r in rnd.results),
                  lost=manifest_peer.not_ready(path, committed))


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    points = {(s, n): Point() for s in SYSTEMS for n in p.claim_agents}
    with Stack(root) as stack, Pool(max(p.claim_agents)) as pool:
        address = stack.registry(root / "staging").address
        measure: dict[str, Callable[[int, int], Sample]] = {
            "Baton": lambda n, r: baton_sample(stack, pool, address, n, p, r),
            "raw etcd": lambda n, r: raw_sample(stack, pool, n, p, r),
            "JSON seed": lambda n, r: peer_sample(root, pool, "seed", n, p, r),
            "JSON + flock": lambda n, r: peer_sample(root, pool, "flock", n, p, r),
        }
        for r in range(p.claim_rounds):
            # Each round starts with another system, so none always runs first.
            order = SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[:r % len(SYSTEMS)]
            for n in p.claim_agents:
                for system in order:
                    points[system, n].samples.append(measure[system](n, r))
    return section(p, points, plot_dir, time.monotonic() - t0)


def ratio_of(points: dict[tuple[str, int], Point], a: str, b: str, n: int) -> float:
    """The median over rounds of system ``a``'s rate over ``b``'s in the same round."""
    pairs = zip(points[a, n].samples, points[b, n].samples, strict=True)
    return median(ratio(x.per_s, y.per_s) for x, y in pairs)


def section(p: Profile, points: dict[tuple[str, int], Point], plot_dir: Path,
            seconds: float) -> Section:
    agents = list(p.claim_agents)
    rounds = "" if p.claim_rounds == 1 else f", medians of {p.claim_rounds} rounds"
    throughput = Table(
        f"Claim → commit cycles per second (raw etcd: transactions per second){rounds}",
        ["agents", "Baton", "raw etcd txn/s", "Baton ÷ raw etcd", "JSON seed", "JSON + flock",
         "Baton ÷ JSON+flock", "Baton ÷ JSON seed", "etcd requests per Baton cycle"])
    latency = Table("Claim latency, ms (raw etcd: one transaction)",
                    ["agents"] + [f"{s} {q}" for s in SYSTEMS for q in ("p50", "p99")])
    safety = Table(
        "Double claims (an entry handed to two agents) and lost commits, all rounds",
        ["agents", "Baton cycles", "Baton double claims", "seed cycles", "seed double claims",
         "seed commits refused (ignored)", "seed commits lost", "flock cycles",
         "flock double claims", "flock commits lost"])
    for n in agents:
        b, r, s, f = (points[x, n] for x in SYSTEMS)
        throughput.rows.append([
            n, b.per_s, r.per_s, ratio_of(points, "Baton", "raw etcd", n), s.per_s, f.per_s,
            ratio_of(points, "Baton", "JSON + flock", n),
            ratio_of(points, "Baton", "JSON seed", n),
            ratio(b.total("etcd_requests"), b.total("cycles"))])
        latency.rows.append([n] + [x.ms(q) for x in (b, r, s, f) for q in (0.5, 0.99)])
        safety.rows.append([n, b.total("cycles"), b.total("doubles"), s.total("cycles"),
                            s.total("doubles"), s.total("failed_commits"), s.total("lost"),
                            f.total("cycles"), f.total("doubles"), f.total("lost")])
    plots = [
        line_plot(plot_dir / "claims_throughput.png", "Claims: throughput vs agents",
                  "concurrent agents (one process each)", "claim→commit cycles/s (etcd: txn/s)",
                  {s: (agents, [points[s, n].per_s for n in agents]) for s in SYSTEMS},
                  logx=True, logy=True, colours=COLOURS),
        line_plot(plot_dir / "claims_latency.png", "Claims: claim latency percentiles",
                  "concurrent agents (one process each)", "ms",
                  {f"{s} p{round(q * 100)}": (agents, [points[s, n].ms(q) for n in agents])
                   for s in ("Baton", "JSON seed", "JSON + flock") for q in (0.5, 0.99)},
                  logx=True, logy=True, colours=COLOURS),
    ]
    vs_raw = [ratio_of(points, "Baton", "raw etcd", n) for n in agents]
    vs_flock = [ratio_of(points, "Baton", "JSON + flock", n) for n in agents]
    top = max(agents, key=lambda n: points["Baton", n].per_s)
    headlines = [
        f"Claims: Baton ÷ raw etcd single transactions at the same concurrency "
        f"{min(vs_raw):.2f}-{max(vs_raw):.2f} over {agents[0]}-{agents[-1]} agents; Baton ÷ "
        f"JSON manifest with flock {min(vs_flock):.1f}-{max(vs_flock):.1f}x; Baton's best "
        f"{points['Baton', top].per_s:,.0f} claim→commit cycles/s at {top} agents "
        f"(claim p99 {points['Baton', top].ms(0.99):.0f} ms).",
        f"Claims: double claims, all agent counts and rounds: Baton "
        f"{sum(points['Baton', n].total('doubles') for n in agents)}, the JSON manifest as the "
        f"seed writes it {sum(points['JSON seed', n].total('doubles') for n in agents)}, with "
        f"flock {sum(points['JSON + flock', n].total('doubles') for n in agents)}.",
    ]
    intro = f"""
{METHOD.strip()}

Each point: a task (and a manifest) of {p.claim_entries:,} entries, at most
{p.claim_seconds:g} s; {p.claim_rounds} round(s), each starting with another system.
Rates count from the common start to the last agent's finish; ratios are the median
of the ratios within a round. A Baton cycle is at least two etcd write transactions
(claim, commit) plus the reads they are guarded by, so Baton ÷ raw etcd cannot
exceed about 0.5; the last column of the first table counts the etcd requests per
cycle from etcd's own metrics (the reaper's and scheduler's sweeps included).
"""
    return Section("claims", "Claims", intro, [throughput, latency, safety], plots,
                   notes=[
                       "The JSON peer writes no fsync (as in the seed), Baton's etcd fsyncs "
                       "every transaction; neither run writes file bytes.",
                       "A JSON update rewrites the whole manifest, so its cost grows with the "
                       "number of entries; seed §5.1 suggests sharding when it becomes a "
                       "bottleneck.",
                       "JSON agents take the first pending entry; on a version conflict they "
                       "read again and pick again, as §4.1 says.",
                   ],
                   headlines=headlines, seconds=seconds, load=load_average())
