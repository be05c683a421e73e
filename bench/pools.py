"""Pools: claims through a concurrency pool against the same claims without one."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from baton_relay.client import Client

from .agents import AgentArgs, baton_agent, double_claims, rate
from .harness import Stack, load_average, ms, ratio
from .pool import Pool
from .profiles import Profile
from .report import Section, Table

METHOD = """
At each number of agents (one process and one client each), {rounds} rounds of two
runs back to back on one registry, each on a fresh task of {entries:,} entries and
{seconds:g} s: **unpooled** — the claims scenario's loop (`Client.claim` then
`Client.commit`); **pooled** — the same loop on a task whose entries name a pool whose
limit is the number of agents, so every claim takes a unit of it and its commit gives
it back. The order of the two alternates between rounds. Counted: claim → commit
cycles per second (all rounds of each kind together), claim latency, and double
claims (an entry handed to two agents, which must be 0). The pool must not become a
hot key: its units are separate keys chosen at random, mirrored by the registry's
view (docs/architecture.md, "Concurrency pools").
"""


@dataclass
class Run:
    cycles: int
    seconds: float
    latencies: list[float]
    doubles: int


def one(pool: Pool, address: str, n: int, p: Profile, label: str, pooled: bool) -> Run:
    task = f"pools-{label}-{n}"
    spec: dict[str, object] = {"task_id": task, "digest_optional": True, "entries": [
        {"file_id": f"e{i:06d}", "path": f"e{i:06d}"} for i in range(p.batch_entries)]}
    with Client(address, timeout=120) as c:
        if pooled:
            c.operator.set_pool(task, n, reason="benchmark")
            spec["pools"] = {"produce": task}
        c.operator.create_task(spec)
    args = [AgentArgs(address, task, f"agent-{i}", p.seconds) for i in range(n)]
    rnd = pool.run(baton_agent, args, p.seconds)
    cycles = sum(r.calls for r in rnd.results)
    per_s = rate(cycles, rnd.start, [r.end for r in rnd.results])
    return Run(cycles, cycles / per_s if per_s else 0.0,
               [x for r in rnd.results for x in r.latencies],
               double_claims([r.claimed for r in rnd.results]))


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    table = Table("Claim → commit cycles per second, with and without a pool (limit = agents)",
                  ["agents", "unpooled: cycles/s", "pooled: cycles/s", "pooled ÷ unpooled",
                   "unpooled claim p50 ms", "pooled claim p50 ms", "unpooled claim p99 ms",
                   "pooled claim p99 ms", "double claims"])
    headlines = []
    facts: dict[str, float] = {}
    with Stack(root) as stack, Pool(max(p.pool_agents)) as pool:
        address = stack.registry(root / "staging").address
        for n in p.pool_agents:
            runs: dict[bool, list[Run]] = {False: [], True: []}
            for r in range(p.pool_rounds):
                for pooled in ((False, True) if r % 2 == 0 else (True, False)):
                    runs[pooled].append(one(pool, address, n, p,
                                            f"{'p' if pooled else 'u'}{r}", pooled))
            per_s = {k: sum(x.cycles for x in v) / max(sum(x.seconds for x in v), 1e-9)
                     for k, v in runs.items()}
            lat = {k: [x for run in v for x in run.latencies] for k, v in runs.items()}
            share = ratio(per_s[True], per_s[False])
            table.rows.append([n, per_s[False], per_s[True], share, ms(lat[False], 0.5),
                               ms(lat[True], 0.5), ms(lat[False], 0.99), ms(lat[True], 0.99),
                               sum(x.doubles for v in runs.values() for x in v)])
            facts[f"pooled_ratio_{n}"] = share
            headlines.append(f"Pools: claims through a pool of limit {n} ran at "
                             f"{share:.2f}x unpooled claims at {n} agents "
                             f"({per_s[True]:,.0f} vs {per_s[False]:,.0f} cycles/s).")
    intro = METHOD.format(rounds=p.pool_rounds, entries=p.batch_entries, seconds=p.seconds)
    return Section("pools", "Pools", intro, [table], headlines=headlines,
                   seconds=time.monotonic() - t0, load=load_average(), facts=facts)
