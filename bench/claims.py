"""Claims: claim → commit cycles through the registry, next to the limit and the peer."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from baton_relay.client import Client
from baton_relay.kernel.errors import BatonError

from . import manifest_peer, pg_peer, profiling
from .agents import AgentArgs, RawArgs, baton_agent, double_claims, rate, raw_etcd_agent
from .harness import (
    BenchError,
    Daemon,
    Stack,
    cpu_seconds,
    ensure_package,
    etcd_kv_calls,
    filesystem_of,
    first_line,
    load_average,
    ms,
    ratio,
)
from .pool import Pool
from .profiles import Profile
from .report import Section, Table, fmt, line_plot

METHOD = """
At each number of agents (one process and one connection per agent), five runs
back to back, on one etcd and one PostgreSQL server:

* **Baton** — each agent opens a session and loops claim → commit on a fresh task.
* **raw etcd** (the limit) — each agent loops single create-only transactions
  through `registry._etcd.Etcd`, the client the registry itself uses.
* **JSON manifest, seed** and **JSON manifest + flock** (the peer) — seed 000 §3.2
  on a manifest of as many entries as Baton's task (`bench/manifest_peer.py`).
* **PostgreSQL** (the usual database queue) — a fresh table of as many rows as
  Baton's task (`id` primary key, `state`, `owner`; plus an index of the pending
  rows' ids), on a private server the bench starts (`initdb` in a temporary
  directory, a Unix socket, `fsync=on`, `synchronous_commit=on`: every commit
  waits for its WAL to reach the disk, as every etcd transaction does). Each agent
  (psycopg 3, autocommit, so one statement is one transaction) loops: claim with
  `UPDATE t SET state='writing', owner=$1 WHERE id = (SELECT id FROM t WHERE
  state='pending' ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id`, then
  commit with `UPDATE t SET state='written' WHERE id=$1 AND owner=$2`
  (`bench/pg_peer.py`).

Runs are bounded by the task size and by `seconds`. Each agent records what it
claimed; an entry claimed twice is a double claim.
"""

SYSTEMS = ("Baton", "raw etcd", "JSON seed", "JSON + flock", "PostgreSQL")
COLOURS = dict(zip(SYSTEMS, ("C0", "C1", "C2", "C3", "C4"), strict=True))
#: functions listed from the registry's profile
PROFILE_TOP = 10
#: keys of the PostgreSQL facts for the notes: the filesystems of the two data directories
PG_FS, ETCD_FS = "postgres_fs", "etcd_fs"


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
    #: Baton: CPU seconds the registry process used during the run (all its threads)
    registry_cpu: float = 0.0
    #: CPU seconds the agent processes used from the common start to their end
    agents_cpu: float = 0.0
    #: Baton and raw etcd: CPU seconds etcd used during the run
    etcd_cpu: float = 0.0


@dataclass
class Point:
    """One system at one number of agents, over all rounds."""

    samples: list[Sample] = field(default_factory=list)

    @property
    def per_s(self) -> float:
        return median(x.per_s for x in self.samples) if self.samples else float("nan")

    def ms(self, q: float) -> float:
        return ms([v for x in self.samples for v in x.latencies], q)

    def total(self, name: str) -> int:
        return sum(getattr(x, name) for x in self.samples)


def new_task(address: str, task: str, p: Profile,
             credentials: tuple[str, str, str] = ("", "", "")) -> None:
    ca, cert, key = credentials
    with Client(address, timeout=120, ca=ca, cert=cert, key=key) as c:
        c.operator.create_task({"task_id": task, "digest_optional": True, "entries": [
            {"file_id": f"e{i:06d}", "path": f"e{i:06d}"} for i in range(p.claim_entries)]})


def baton_sample(stack: Stack, pool: Pool, registry: Daemon, n: int, p: Profile,
                 round_: int) -> Sample:
    task = f"claims-{n}-{round_}"
    new_task(registry.address, task, p, registry.credentials)
    before = etcd_kv_calls(stack.etcd)
    cpu_before = registry.cpu_seconds()
    etcd_before = etcd_cpu(stack)
    args = [AgentArgs(registry.address, task, f"agent-{i}", p.claim_seconds,
                      credentials=registry.credentials) for i in range(n)]
    rnd = pool.run(baton_agent, args, p.claim_seconds)
    cpu = registry.cpu_seconds() - cpu_before
    etcd_used = etcd_cpu(stack) - etcd_before
    after = etcd_kv_calls(stack.etcd)
    cycles = sum(r.calls for r in rnd.results)
    return Sample(rate(cycles, rnd.start, [r.end for r in rnd.results]),
                  [x for r in rnd.results for x in r.latencies], cycles,
                  doubles=double_claims([r.claimed for r in rnd.results]),
                  etcd_requests=sum(after.get(k, 0) - before.get(k, 0) for k in ("Txn", "Range")),
                  registry_cpu=cpu, agents_cpu=sum(rnd.cpu), etcd_cpu=etcd_used)


def etcd_cpu(stack: Stack) -> float:
    """CPU seconds etcd has used so far (0 when its process is not known)."""
    pid = stack.etcd.pid
    return cpu_seconds(pid) if pid else 0.0


def raw_sample(stack: Stack, pool: Pool, n: int, p: Profile, round_: int) -> Sample:
    args = [RawArgs(stack.etcd.endpoint, f"/bench-raw/{n}/{round_}/{i}/", p.claim_seconds)
            for i in range(n)]
    etcd_before = etcd_cpu(stack)
    rnd = pool.run(raw_etcd_agent, args, p.claim_seconds)
    etcd_used = etcd_cpu(stack) - etcd_before
    txns = sum(r.calls for r in rnd.results)
    return Sample(rate(txns, rnd.start, [r.end for r in rnd.results]),
                  [x for r in rnd.results for x in r.latencies], txns,
                  agents_cpu=sum(rnd.cpu), etcd_cpu=etcd_used)


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


def pg_sample(pg: pg_peer.Postgres, pool: Pool, n: int, p: Profile, round_: int) -> Sample:
    table = f"claims_{n}_{round_}"
    pg.new_table(table, p.claim_entries)
    args = [pg_peer.PgArgs(pg.conninfo, table, f"agent-{i}", p.claim_seconds)
            for i in range(n)]
    rnd = pool.run(pg_peer.agent, args, p.claim_seconds)
    cycles = sum(r.cycles for r in rnd.results)
    claimed = [r.claimed for r in rnd.results]
    committed = sorted({int(f[1:]) for ids in claimed for f in ids})
    return Sample(rate(cycles, rnd.start, [r.end for r in rnd.results]),
                  [x for r in rnd.results for x in r.latencies], cycles,
                  doubles=double_claims(claimed),
                  failed_commits=sum(r.failed_commits for r in rnd.results),
                  lost=pg.not_written(table, committed), agents_cpu=sum(rnd.cpu))


@dataclass
class Profiled:
    """The registry's profile during one extra Baton run (or why there is none)."""

    agents: int
    profile: profiling.Profile | None = None
    cycles: int = 0
    seconds: float = 0.0
    why_not: str = ""


def profile_registry(pool: Pool, registry: Daemon, n: int, p: Profile,
                     out: Path) -> Profiled:
    """One more Baton run at ``n`` agents, not counted above, with py-spy on the registry."""
    executable = profiling.py_spy()
    if executable is None:
        return Profiled(n, why_not="py-spy is not installed (pip install py-spy, or the "
                                   "bench extra)")
    task = f"claims-profiled-{n}"
    new_task(registry.address, task, p)
    args = [AgentArgs(registry.address, task, f"agent-{i}", p.claim_seconds) for i in range(n)]
    # py-spy's failures are reported, not fatal (the profile is optional); the agents' are.
    with profiling.Recorder(executable, registry.pid, out) as recorder:
        try:
            recorder.start()
        except (BatonError, BenchError, OSError) as e:
            return Profiled(n, why_not=f"py-spy could not attach: {first_line(e)}")
        rnd = pool.run(baton_agent, args, p.claim_seconds)
        try:
            profile = recorder.stop()
        except (BenchError, OSError) as e:
            return Profiled(n, why_not=f"py-spy failed: {first_line(e)}")
    cycles = sum(r.calls for r in rnd.results)
    return Profiled(n, profile, cycles, max(r.end for r in rnd.results) - rnd.start)


def postgres_bindir(p: Profile) -> tuple[Path | None, str]:
    """PostgreSQL's binaries (installed with apt-get when the profile allows); else why not."""
    missing = pg_peer.driver_missing()
    if missing:
        return None, missing

    def find() -> str | None:
        bindir, _ = pg_peer.find_postgres()
        return str(bindir) if bindir else None

    found, why = ensure_package("postgresql", find, p.install)
    if found is None:
        _, not_found = pg_peer.find_postgres()
        return None, f"{not_found}; {why}"
    return Path(found), ""


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    points = {(s, n): Point() for s in SYSTEMS for n in p.claim_agents}
    bindir, no_pg = postgres_bindir(p)
    systems = SYSTEMS if bindir else tuple(s for s in SYSTEMS if s != "PostgreSQL")
    pg_settings: dict[str, str] = {}
    with contextlib.ExitStack() as daemons:
        stack = daemons.enter_context(Stack(root))
        pool = daemons.enter_context(Pool(max(p.claim_agents)))
        registry = stack.registry(root / "staging")
        measure: dict[str, Callable[[int, int], Sample]] = {
            "Baton": lambda n, r: baton_sample(stack, pool, registry, n, p, r),
            "raw etcd": lambda n, r: raw_sample(stack, pool, n, p, r),
            "JSON seed": lambda n, r: peer_sample(root, pool, "seed", n, p, r),
            "JSON + flock": lambda n, r: peer_sample(root, pool, "flock", n, p, r),
        }
        if bindir:
            pg = daemons.enter_context(pg_peer.Postgres(bindir, max(p.claim_agents) + 10))
            pg_settings = pg.settings()
            pg_settings[PG_FS] = filesystem_of(pg.root)
            pg_settings[ETCD_FS] = filesystem_of(stack.etcd.data_dir)
            measure["PostgreSQL"] = lambda n, r: pg_sample(pg, pool, n, p, r)
        for r in range(p.claim_rounds):
            # Each round starts with another system, so none always runs first.
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for n in p.claim_agents:
                for system in order:
                    points[system, n].samples.append(measure[system](n, r))
        profiled = profile_registry(pool, registry, min(p.profile_agents, max(p.claim_agents)),
                                    p, root / "profile" / "registry.txt")
    return section(p, points, plot_dir, time.monotonic() - t0, profiled,
                   pg_settings, no_pg)


def ratio_of(points: dict[tuple[str, int], Point], a: str, b: str, n: int) -> float:
    """The median over rounds of system ``a``'s rate over ``b``'s in the same round."""
    if not (points[a, n].samples and points[b, n].samples):
        return float("nan")
    pairs = zip(points[a, n].samples, points[b, n].samples, strict=True)
    return median(ratio(x.per_s, y.per_s) for x, y in pairs)


def profile_table(profiled: Profiled) -> Table | None:
    prof = profiled.profile
    if prof is None or not prof.samples:
        return None
    table = Table(
        f"Where the registry's CPU went: py-spy, {prof.samples:,} samples at "
        f"{profiling.RATE}/s in one extra Baton run at {profiled.agents} agents "
        f"({profiled.cycles:,} cycles), top {PROFILE_TOP} functions by own samples",
        ["function (file)", "own samples %", "total samples %"])
    for f in prof.top(PROFILE_TOP):
        table.rows.append([f"`{f.name.replace('|', '/')}`", 100 * f.own / prof.samples,
                           100 * f.total / prof.samples])
    return table


#: where a function's file puts it, for the by-layer table (first match wins)
LAYERS = (
    ("Baton's registry (`registry/`)", ("(registry/",)),
    ("Baton's contract and models (`client/`)", ("(client/",)),
    ("callbacks run by the event loop: gRPC's compiled core and asyncio's C tasks "
     "(`Handle._run` itself)", ("Handle._run (asyncio/events.py)",)),
    ("grpc's Python layer (`grpc/`)", ("(grpc/",)),
    ("asyncio and the selector (Python)", ("(asyncio/", "(selectors.py")),
    ("dataclass constructors generated for Baton's records (`<string>`)", ("(<string>)",)),
    ("json", ("(json/",)),
    ("protobuf", ("(google/",)),
)


def layers_table(profiled: Profiled) -> Table | None:
    """Own samples summed by layer: Baton's code against the machinery under it."""
    prof = profiled.profile
    if prof is None or not prof.samples:
        return None
    sums = dict.fromkeys([name for name, _ in LAYERS] + ["other"], 0)
    for f in prof.functions:
        layer = next((name for name, marks in LAYERS
                      if any(f.name.startswith(m) or m in f.name for m in marks)), "other")
        sums[layer] += f.own
    table = Table("Where the registry's CPU went, by layer (own samples of the same profile)",
                  ["layer", "own samples %"])
    for name, n in sums.items():
        table.rows.append([name, 100 * n / prof.samples])
    return table


def section(p: Profile, points: dict[tuple[str, int], Point], plot_dir: Path,
            seconds: float, profiled: Profiled, pg_settings: dict[str, str],
            no_pg: str) -> Section:
    agents = list(p.claim_agents)
    rounds = "" if p.claim_rounds == 1 else f", medians of {p.claim_rounds} rounds"
    throughput = Table(
        f"Claim → commit cycles per second (raw etcd: transactions per second){rounds}",
        ["agents", "Baton", "raw etcd txn/s", "Baton ÷ raw etcd", "JSON seed", "JSON + flock",
         "PostgreSQL", "Baton ÷ JSON+flock", "Baton ÷ JSON seed", "Baton ÷ PostgreSQL",
         "etcd requests per Baton cycle", "registry CPU ms per Baton cycle"])
    latency = Table("Claim latency, ms (raw etcd: one transaction)",
                    ["agents"] + [f"{s} {q}" for s in SYSTEMS for q in ("p50", "p99")])
    safety = Table(
        "Double claims (an entry handed to two agents) and lost commits, all rounds",
        ["agents", "Baton cycles", "Baton double claims", "seed cycles", "seed double claims",
         "seed commits refused (ignored)", "seed commits lost", "flock cycles",
         "flock double claims", "flock commits lost", "PostgreSQL cycles",
         "PostgreSQL double claims", "PostgreSQL commits lost"])
    cpu = Table(
        "CPU per cycle, ms (each process's CPU over the run ÷ cycles; raw etcd: ÷ "
        "transactions); the machine has " f"{os.cpu_count()} cores",
        ["agents", "Baton: agents", "Baton: registry", "Baton: etcd", "Baton: total",
         "raw etcd: agents", "raw etcd: etcd", "raw etcd: total", "PostgreSQL: agents"])
    have_pg = any(points["PostgreSQL", n].samples for n in agents)

    def pg_total(n: int, name: str) -> int | None:
        return points["PostgreSQL", n].total(name) if have_pg else None

    for n in agents:
        b, r, s, f, g = (points[x, n] for x in SYSTEMS)
        throughput.rows.append([
            n, b.per_s, r.per_s, ratio_of(points, "Baton", "raw etcd", n), s.per_s, f.per_s,
            g.per_s, ratio_of(points, "Baton", "JSON + flock", n),
            ratio_of(points, "Baton", "JSON seed", n),
            ratio_of(points, "Baton", "PostgreSQL", n),
            ratio(b.total("etcd_requests"), b.total("cycles")),
            1000 * ratio(sum(x.registry_cpu for x in b.samples), b.total("cycles"))])
        latency.rows.append([n] + [x.ms(q) for x in (b, r, s, f, g) for q in (0.5, 0.99)])

        def per(point: Point, name: str) -> float:
            return 1000 * ratio(sum(getattr(x, name) for x in point.samples),
                                point.total("cycles"))

        baton_parts = [per(b, "agents_cpu"), per(b, "registry_cpu"), per(b, "etcd_cpu")]
        raw_parts = [per(r, "agents_cpu"), per(r, "etcd_cpu")]
        cpu.rows.append([n, *baton_parts, sum(baton_parts), *raw_parts, sum(raw_parts),
                         per(g, "agents_cpu") if have_pg else None])
        safety.rows.append([n, b.total("cycles"), b.total("doubles"), s.total("cycles"),
                            s.total("doubles"), s.total("failed_commits"), s.total("lost"),
                            f.total("cycles"), f.total("doubles"), f.total("lost"),
                            pg_total(n, "cycles"), pg_total(n, "doubles"), pg_total(n, "lost")])
    plots = [
        line_plot(plot_dir / "claims_throughput.png", "Claims: throughput vs agents",
                  "concurrent agents (one process each)", "claim→commit cycles/s (etcd: txn/s)",
                  {s: (agents, [points[s, n].per_s for n in agents]) for s in SYSTEMS
                   if s != "PostgreSQL" or have_pg},
                  logx=True, logy=True, colours=COLOURS),
        line_plot(plot_dir / "claims_latency.png", "Claims: claim latency percentiles",
                  "concurrent agents (one process each)", "ms",
                  {f"{s} p{round(q * 100)}": (agents, [points[s, n].ms(q) for n in agents])
                   for s in ("Baton", "JSON seed", "JSON + flock", "PostgreSQL")
                   if s != "PostgreSQL" or have_pg for q in (0.5, 0.99)},
                  logx=True, logy=True, colours=COLOURS),
    ]
    vs_raw = [ratio_of(points, "Baton", "raw etcd", n) for n in agents]
    vs_flock = [ratio_of(points, "Baton", "JSON + flock", n) for n in agents]
    top = max(agents, key=lambda n: points["Baton", n].per_s)
    cpu_ms = [1000 * ratio(sum(x.registry_cpu for x in points["Baton", n].samples),
                           points["Baton", n].total("cycles")) for n in agents]
    headlines = [
        f"Claims: Baton ÷ raw etcd single transactions at the same concurrency "
        f"{min(vs_raw):.2f}-{max(vs_raw):.2f} over {agents[0]}-{agents[-1]} agents; Baton ÷ "
        f"JSON manifest with flock {min(vs_flock):.1f}-{max(vs_flock):.1f}x; Baton's best "
        f"{points['Baton', top].per_s:,.0f} claim→commit cycles/s at {top} agents "
        f"(claim p99 {points['Baton', top].ms(0.99):.0f} ms); the registry's CPU per cycle "
        f"{min(cpu_ms):.2f}-{max(cpu_ms):.2f} ms.",
    ]
    if have_pg:
        vs_pg = [ratio_of(points, "Baton", "PostgreSQL", n) for n in agents]
        best_pg = max(agents, key=lambda n: points["PostgreSQL", n].per_s)
        headlines.append(
            f"Claims: Baton ÷ PostgreSQL (FOR UPDATE SKIP LOCKED, fsync on) "
            f"{min(vs_pg):.2f}-{max(vs_pg):.2f} over {agents[0]}-{agents[-1]} agents; "
            f"PostgreSQL's best {points['PostgreSQL', best_pg].per_s:,.0f} cycles/s at "
            f"{best_pg} agents (claim p99 {fmt(points['PostgreSQL', best_pg].ms(0.99))} ms).")
    else:
        headlines.append(f"Claims: the PostgreSQL peer did not run ({no_pg}).")
    pg_doubles = (f", PostgreSQL {sum(points['PostgreSQL', n].total('doubles') for n in agents)}"
                  if have_pg else "")
    headlines.append(
        f"Claims: double claims, all agent counts and rounds: Baton "
        f"{sum(points['Baton', n].total('doubles') for n in agents)}, the JSON manifest as the "
        f"seed writes it {sum(points['JSON seed', n].total('doubles') for n in agents)}, with "
        f"flock {sum(points['JSON + flock', n].total('doubles') for n in agents)}"
        f"{pg_doubles}.")
    intro = f"""
{METHOD.strip()}

Each point: a task (and a manifest, and a table) of {p.claim_entries:,} entries, at most
{p.claim_seconds:g} s; {p.claim_rounds} round(s), each starting with another system.
Rates count from the common start to the last agent's finish; ratios are the median
of the ratios within a round. A Baton cycle is two etcd transactions (claim,
commit), planned from the registry's watch-fed view with no read before them; with
several agents, group commit carries several callers' transactions in one request,
so a cycle may cost less than two requests. A column of the first table counts the
etcd requests per cycle from etcd's own metrics (the reaper's and scheduler's sweeps
and the view's window refills included). The CPU table adds up, per cycle, the CPU
of the agent processes (from the common start to their end), of the registry and of
etcd, next to the same for a raw etcd transaction: on a machine this small every
process shares the same cores, so the sum bounds the rate. The last
column is the registry process's CPU time (user + system, all threads, from
`/proc/PID/stat` before and after each Baton run) per cycle; it too includes the
background sweeps. After the rounds, one more Baton run at {profiled.agents} agents
(not counted above) is sampled with `py-spy record --format raw` when py-spy is
installed: the last table lists where the registry's CPU went.
"""
    notes = [
        "The JSON peer writes no fsync (as in the seed), Baton's etcd fsyncs "
        "every transaction; neither run writes file bytes.",
        "A JSON update rewrites the whole manifest, so its cost grows with the "
        "number of entries; seed §5.1 suggests sharding when it becomes a "
        "bottleneck.",
        "JSON agents take the first pending entry; on a version conflict they "
        "read again and pick again, as §4.1 says.",
    ]
    if have_pg:
        settings = dict(pg_settings)
        pg_fs, etcd_fs = settings.pop(PG_FS, "?"), settings.pop(ETCD_FS, "?")
        version = settings.pop("server_version", "?")
        shown = ", ".join(f"{k} {v}" for k, v in settings.items())
        notes.append(
            f"PostgreSQL {version} ran with {shown}; its data directory was on {pg_fs}, "
            f"etcd's on {etcd_fs}. A PostgreSQL "
            "claim is one transaction; like the JSON peer it has no leases (an agent that "
            "dies leaves its rows `writing`), no fencing tokens beyond the owner check, and "
            "no journal.")
    else:
        notes.append(f"PostgreSQL: not available in this run ({no_pg}).")
    tables = [throughput, latency, safety, cpu]
    table = profile_table(profiled)
    if table is not None:
        tables.append(table)
        by_layer = layers_table(profiled)
        if by_layer is not None:
            tables.append(by_layer)
        notes.append("Registry profile: a sample is a thread of the registry seen holding "
                     "the GIL (`py-spy record --gil`), so the shares are of its Python work; "
                     "own samples are those in which the function itself was running, total "
                     "samples those in which it was on the stack.")
    else:
        notes.append(f"Registry profile: not available ({profiled.why_not or 'no samples'}).")
    facts: dict[str, float] = {
        "claims.doubles": sum(points["Baton", n].total("doubles") for n in agents)}
    for n in agents:
        facts[f"claims.vs_raw.{n}"] = ratio_of(points, "Baton", "raw etcd", n)
        if have_pg:
            facts[f"claims.vs_pg.{n}"] = ratio_of(points, "Baton", "PostgreSQL", n)
        facts[f"claims.p99.{n}"] = points["Baton", n].ms(0.99)
        facts[f"claims.raw_p99.{n}"] = points["raw etcd", n].ms(0.99)
        facts[f"claims.requests.{n}"] = ratio(points["Baton", n].total("etcd_requests"),
                                              points["Baton", n].total("cycles"))
    return Section("claims", "Claims", intro, tables, plots, notes=notes,
                   headlines=headlines, seconds=seconds, load=load_average(), facts=facts)
