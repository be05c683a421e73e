"""Scale: a task of 100,000 entries — creating it, claiming from it, the registry's memory."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

from client import Client, RetryPolicy, errors, parse_manifest

from .agents import AgentArgs, baton_agent, double_claims, rate
from .harness import BenchError, Stack, load_average, ms, ratio, rss_kib
from .pool import Pool
from .profiles import Profile
from .report import Cell, Section, Table

METHOD = """
One registry process on a fresh etcd. A task of {big:,} entries is created with one
`CreateTask` call (timed from the call to its reply; the manifest is built
beforehand), next to a task of {small:,}. Then {agents} agents (one process each)
claim → commit {claims} entries from the small task, then as many from the large
one ({rounds} round(s), alternating, so both see the same machine); a claim reads
one page of the task's ready index however large the task is. The last column
times that read alone, straight from etcd (`registry._etcd.Etcd.range`, limit 64),
after the claims. Memory is the `VmRSS` of the registry process (and of etcd) from
`/proc/PID/status`.
"""

#: CreateTask is sent again (that completes an interrupted creation) at most this often
CREATE_ATTEMPTS = 3
#: if the large task cannot be created, these fractions of it are tried (each on a fresh
#: etcd and registry, so that memory is weighed without the failed attempts' remains)
FALLBACKS = (1, 4, 10)


@dataclass
class Created:
    task: str
    entries: int
    seconds: float
    calls: int
    error: str = ""
    ok: bool = True


def create(address: str, task: str, entries: int) -> Created:
    """Create a task of ``entries``, sending it up to ``CREATE_ATTEMPTS`` times."""
    spec = parse_manifest({"task_id": task, "entries": [
        {"file_id": f"e{i:06d}", "path": f"d{i % 100:02d}/e{i:06d}"} for i in range(entries)]})
    error = ""
    # One try per call, so that every call the creation needed is counted here.
    with Client(address, timeout=600, retry=RetryPolicy(attempts=1)) as c:
        t0 = time.perf_counter()
        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                c.create_task(spec)
                return Created(task, entries, time.perf_counter() - t0, attempt, error)
            except errors.BatonError as e:
                error = f"{type(e).__name__}: {e}"
        return Created(task, entries, time.perf_counter() - t0, CREATE_ATTEMPTS, error, False)


def head_read_ms(endpoint: str, task: str, reads: int = 50) -> float:
    """Median ms of the read a claim starts with: the first 64 keys of the ready index."""
    from registry._etcd import Etcd
    from registry.keys import Keys

    async def go() -> list[float]:
        etcd = Etcd(endpoint)
        await etcd.connect()
        try:
            times = []
            for _ in range(reads):
                t0 = time.perf_counter()
                await etcd.range(Keys().ready_all(task), limit=64)
                times.append(time.perf_counter() - t0)
            return times
        finally:
            await etcd.close()

    return ms(asyncio.run(go()), 0.5)


def memory(stack: Stack, registry_pid: int, when: str) -> list[Cell]:
    db = stack.etcd.data_dir / "member" / "snap" / "db"
    db_mib = db.stat().st_size / 2**20 if db.exists() else None
    return [when, rss_kib(registry_pid) / 1024, rss_kib(stack.etcd.pid or 0) / 1024, db_mib]


@dataclass
class Claimed:
    rates: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    cycles: int = 0
    claimed: list[list[str]] = field(default_factory=list)
    #: etcd's time for the first page (64 keys) of the task's ready index, median ms
    head_ms: float = float("nan")


@dataclass
class Measured:
    small: Created
    big: Created
    runs: dict[str, Claimed]
    #: the registry's VmRSS once both tasks exist
    rss_mib: float


def measure(p: Profile, root: Path, big_entries: int, pool: Pool, section: Section,
            creates: Table, mem: Table) -> Measured | None:
    """On a fresh etcd and registry: create the two tasks, claim from both, weigh."""
    with Stack(root) as stack:
        registry = stack.registry(root / "staging")
        with Client(registry.address) as c:
            c.list_tasks()  # the registry has served one call before it is weighed
        mem.rows.append(memory(stack, registry.pid, "idle, empty"))
        small = create(registry.address, f"small-{p.scale_small}", p.scale_small)
        big = create(registry.address, f"big-{big_entries}", big_entries)
        for x in (small, big):
            creates.rows.append([x.entries, x.seconds, ratio(x.entries, x.seconds), x.calls,
                                 "created" if x.ok else "FAILED"])
        if not (small.ok and big.ok):
            failed = big if small.ok else small
            mem.rows.append(memory(stack, registry.pid,
                                   f"after {failed.calls} failed creations of "
                                   f"{failed.entries:,} entries"))
            section.notes.append(f"Creating the task of {failed.entries:,} entries failed "
                                 f"{failed.calls} times in a row ({failed.error}); the next "
                                 "size was tried on a fresh etcd and registry.")
            return None
        rss_mib = rss_kib(registry.pid) / 1024
        mem.rows.append(memory(stack, registry.pid,
                               f"after creating {small.entries:,} + {big.entries:,} entries"))
        per = max(1, p.scale_claims // p.scale_agents)
        runs = {small.task: Claimed(), big.task: Claimed()}
        for r in range(p.scale_rounds):
            for task, out in runs.items():
                args = [AgentArgs(registry.address, task, f"agent-{r}-{i}", p.seconds,
                                  max_entries=per) for i in range(p.scale_agents)]
                rnd = pool.run(baton_agent, args, p.seconds)
                n = sum(x.calls for x in rnd.results)
                out.rates.append(rate(n, rnd.start, [x.end for x in rnd.results]))
                out.latencies += [v for x in rnd.results for v in x.latencies]
                out.cycles += n
                out.claimed += [x.claimed for x in rnd.results]
        mem.rows.append(memory(stack, registry.pid, "after the claims"))
        for task, out in runs.items():
            out.head_ms = head_read_ms(stack.etcd.endpoint, task)
    return Measured(small, big, runs, rss_mib)


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    per = max(1, p.scale_claims // p.scale_agents)
    intro = METHOD.format(big=p.scale_big, small=p.scale_small, agents=p.scale_agents,
                          claims=per * p.scale_agents, rounds=p.scale_rounds)
    section = Section("scale", "Scale", intro)
    mem = Table("Memory", ["when", "registry VmRSS MiB", "etcd VmRSS MiB", "etcd db file MiB"])
    creates = Table("Creating a task (one CreateTask call)",
                    ["entries", "seconds", "entries/s", "calls", "result"])
    done = None
    with Pool(p.scale_agents) as pool:
        for i, cut in enumerate(FALLBACKS):
            done = measure(p, root / f"try-{i}", p.scale_big // cut, pool, section, creates,
                           mem)
            if done is not None:
                break
    if done is None:
        raise BenchError(f"no task of {p.scale_big // FALLBACKS[-1]:,} entries or more could "
                         "be created")
    small, big, runs = done.small, done.big, done.runs
    claims = Table(f"Claim → commit with {p.scale_agents} agents, by task size",
                   ["entries in the task", "cycles/s", "claim p50 ms", "claim p99 ms",
                    "cycles measured", "double claims",
                    "etcd: first 64 keys of the ready index, ms"])
    for created in (small, big):
        out = runs[created.task]
        claims.rows.append([created.entries, mean(out.rates), ms(out.latencies, 0.5),
                            ms(out.latencies, 0.99), out.cycles, double_claims(out.claimed),
                            out.head_ms])
    slowdown = ratio(mean(runs[big.task].rates), mean(runs[small.task].rates))
    big_rss = done.rss_mib
    if big.entries != p.scale_big:
        section.headlines.append(f"Scale: a task of {p.scale_big:,} entries could NOT be "
                                 f"created (see the notes); the numbers are for "
                                 f"{big.entries:,}.")
    section.headlines.append(
        f"Scale: creating a task of {big.entries:,} entries took {big.seconds:.1f} s "
        f"({big.calls} call{'s' if big.calls > 1 else ''}); claim throughput at "
        f"{big.entries:,} entries is {slowdown:.2f}x that at {small.entries:,}; registry RSS "
        f"with both tasks {big_rss:.0f} MiB.")
    section.tables = [creates, claims, mem]
    section.seconds = time.monotonic() - t0
    section.load = load_average()
    return section
