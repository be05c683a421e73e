"""What TLS costs: the claim → commit cycle in plaintext, with the registry's etcd over
TLS, and with mutual TLS between agents and the registry as well (``baton up``'s way)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from . import claims
from .harness import Daemon, Stack, load_average, ratio
from .pool import Pool
from .profiles import Profile
from .report import Section, Table

METHOD = """
Three stacks side by side, each a private etcd with one registry: *plaintext*
everywhere (`--insecure`); *etcd TLS*, whose etcd serves its client API over TLS with
client certificates (`--client-cert-auth`) and whose registry connects with
`--etcd-ca`, `--etcd-cert` and `--etcd-key`; and *mutual TLS*, which adds TLS with
client certificates between the agents and the registry (`--tls-ca`, `--tls-cert`,
`--tls-key`; every call checked against the access table), as `baton up` runs it.
Certificates come from `kernel.pki`. At each number of agents, in each round, the
claims scenario's Baton loop (each agent opens a session and loops claim → commit on
a fresh task) runs on each stack in turn, each round in another order.
"""

#: each system and its Stack settings
SYSTEMS = {"plaintext": {}, "etcd TLS": {"etcd_tls": True},
           "mutual TLS": {"registry_tls": True}}


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    points = {(s, n): claims.Point() for s in SYSTEMS for n in p.claim_agents}
    with contextlib.ExitStack() as daemons:
        stacks: dict[str, tuple[Stack, Daemon]] = {}
        for name, settings in SYSTEMS.items():
            where = root / name.lower().replace(" ", "-")
            where.mkdir()
            stack = daemons.enter_context(Stack(where, **settings))
            stacks[name] = stack, stack.registry(where / "staging")
        pool = daemons.enter_context(Pool(max(p.claim_agents)))
        names = list(SYSTEMS)
        for r in range(p.claim_rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in p.claim_agents:
                for name in order:
                    stack, registry = stacks[name]
                    points[name, n].samples.append(
                        claims.baton_sample(stack, pool, registry, n, p, r))
    return section(p, points, time.monotonic() - t0)


def section(p: Profile, points: dict[tuple[str, int], claims.Point],
            seconds: float) -> Section:
    rounds = "" if p.claim_rounds == 1 else f", medians of {p.claim_rounds} rounds"
    table = Table(
        f"Claim → commit cycles per second in plaintext, with etcd over TLS, and with "
        f"mutual TLS to clients as well{rounds}; registry CPU per cycle in ms",
        ["agents", "plaintext cycles/s", "etcd TLS cycles/s", "mutual TLS cycles/s",
         "etcd TLS ÷ plaintext", "mutual TLS ÷ plaintext", "plaintext claim p99 ms",
         "mutual TLS claim p99 ms", "plaintext: registry CPU", "mutual TLS: registry CPU"])
    ratios: dict[str, list[float]] = {"etcd TLS": [], "mutual TLS": []}
    facts: dict[str, float] = {}
    for n in p.claim_agents:
        plain, etcd, mutual = (points[name, n] for name in SYSTEMS)
        shares = {}
        for name, key in (("etcd TLS", "etcd_tls"), ("mutual TLS", "mutual_tls")):
            shares[name] = claims.ratio_of(points, name, "plaintext", n)
            ratios[name].append(shares[name])
            facts[f"{key}.ratio.{n}"] = shares[name]

        def per(point: claims.Point, name: str) -> float:
            return 1000 * ratio(sum(getattr(x, name) for x in point.samples),
                                point.total("cycles"))

        table.rows.append([n, plain.per_s, etcd.per_s, mutual.per_s, shares["etcd TLS"],
                           shares["mutual TLS"], plain.ms(0.99), mutual.ms(0.99),
                           per(plain, "registry_cpu"), per(mutual, "registry_cpu")])
    agents = list(p.claim_agents)
    span = f"over {agents[0]}-{agents[-1]} agents"

    def spread(values: list[float]) -> str:
        return f"{min(values):.2f}-{max(values):.2f}"

    headline = (f"TLS: Baton's claim → commit rate with etcd over TLS ÷ plaintext "
                f"{spread(ratios['etcd TLS'])}, with mutual TLS to clients as well "
                f"(baton up's way) ÷ plaintext {spread(ratios['mutual TLS'])}, {span}.")
    intro = f"""
{METHOD.strip()}

Each point: a task of {p.claim_entries:,} entries, at most {p.claim_seconds:g} s;
{p.claim_rounds} round(s). The ratio is the median of the ratios within a round.
CPU per cycle: the registry process's CPU time over the run ÷ cycles.
"""
    return Section("etcd-tls", "TLS", intro, [table], headlines=[headline],
                   seconds=seconds, load=load_average(), facts=facts)
