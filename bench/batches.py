"""Batches: entries claimed per second with ClaimBatch against single claims."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from baton_relay.client import Client

from .agents import AgentArgs, baton_agent, double_claims, rate
from .harness import Stack, load_average, ms, ratio
from .pool import Pool
from .profiles import Profile
from .report import Section, Table, bar_plot

METHOD = """
At each number of agents (one process and one client each), two runs back to back
on the same registry, each on a fresh task: **single** — `Client.claim` then
`Client.commit` per entry; **batch** — `Client.claim_batch(max={size})` (one
transaction, all or nothing) then `Client.commit_batch` of what it got. Counted:
entries claimed and committed per second, and the latency of each claim call.
Each run stops after {seconds:g} s or when its task of {entries:,} entries is drained.
"""


@dataclass
class Run:
    per_s: float
    p50_ms: float
    p99_ms: float
    entries: int
    calls: int
    doubles: int


def one(pool: Pool, address: str, n: int, batch: int, p: Profile, label: str) -> Run:
    task = f"batch-{label}-{n}"
    with Client(address, timeout=120) as c:
        c.operator.create_task({"task_id": task, "digest_optional": True, "entries": [
            {"file_id": f"e{i:06d}", "path": f"e{i:06d}"} for i in range(p.batch_entries)]})
    args = [AgentArgs(address, task, f"agent-{i}", p.seconds, batch=batch) for i in range(n)]
    rnd = pool.run(baton_agent, args, p.seconds)
    entries = sum(len(r.claimed) for r in rnd.results)
    lat = [x for r in rnd.results for x in r.latencies]
    return Run(rate(entries, rnd.start, [r.end for r in rnd.results]), ms(lat, 0.5),
               ms(lat, 0.99), entries, sum(r.calls for r in rnd.results),
               double_claims([r.claimed for r in rnd.results]))


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    table = Table("Entries claimed (and committed) per second",
                  ["agents", "single: entries/s", "batch: entries/s", "batch ÷ single",
                   "single claim p50 ms", "single claim p99 ms", "batch claim p50 ms",
                   "batch claim p99 ms", "entries per batch (mean)", "double claims"])
    singles: list[float] = []
    batched: list[float] = []
    with Stack(root) as stack, Pool(max(p.batch_agents)) as pool:
        address = stack.registry(root / "staging").address
        for n in p.batch_agents:
            single = one(pool, address, n, 0, p, "single")
            batch = one(pool, address, n, p.batch_size, p, "batch")
            singles.append(single.per_s)
            batched.append(batch.per_s)
            table.rows.append([n, single.per_s, batch.per_s, ratio(batch.per_s, single.per_s),
                               single.p50_ms, single.p99_ms, batch.p50_ms, batch.p99_ms,
                               ratio(batch.entries, batch.calls),
                               single.doubles + batch.doubles])
    groups = [f"{n} agent{'s' if n > 1 else ''}" for n in p.batch_agents]
    plot = bar_plot(plot_dir / "batches.png", "Batches: entries claimed per second",
                    "entries/s", groups, {"single claims": singles,
                                          f"ClaimBatch (≤ {p.batch_size})": batched})
    best = max(range(len(p.batch_agents)), key=lambda i: ratio(batched[i], singles[i]))
    headline = (f"Batches: ClaimBatch claimed {batched[best]:,.0f} entries/s vs "
                f"{singles[best]:,.0f} with single claims at {p.batch_agents[best]} agent(s): "
                f"{ratio(batched[best], singles[best]):.1f}x.")
    intro = METHOD.format(size=p.batch_size, seconds=p.seconds, entries=p.batch_entries)
    return Section("batches", "Batches", intro, [table], [plot], headlines=[headline],
                   seconds=time.monotonic() - t0, load=load_average())
