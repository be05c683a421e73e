"""etcd over TLS: the claim → commit cycle with the registry's etcd in plaintext and over TLS."""

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
Two stacks side by side, each a private etcd with one registry: one etcd serves its
client API in plaintext, the other over TLS with client certificates
(`--client-cert-auth`), and its registry connects with `--etcd-ca`, `--etcd-cert`
and `--etcd-key` (certificates from `client.pki`). At each number of agents, in
each round, the claims scenario's Baton loop (each agent opens a session and loops
claim → commit on a fresh task) runs on one stack and then on the other, each round
starting with the other one. Agents reach both registries the same way: only the
registry ↔ etcd hop differs.
"""

SYSTEMS = ("plaintext", "TLS")


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    points = {(s, n): claims.Point() for s in SYSTEMS for n in p.claim_agents}
    with contextlib.ExitStack() as daemons:
        stacks: dict[str, tuple[Stack, Daemon]] = {}
        for name, tls in zip(SYSTEMS, (False, True), strict=True):
            where = root / name.lower()
            where.mkdir()
            stack = daemons.enter_context(Stack(where, etcd_tls=tls))
            stacks[name] = stack, stack.registry(where / "staging")
        pool = daemons.enter_context(Pool(max(p.claim_agents)))
        for r in range(p.claim_rounds):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
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
        f"Claim → commit cycles per second with the registry's etcd in plaintext and over "
        f"TLS{rounds}; CPU per cycle in ms",
        ["agents", "plaintext cycles/s", "TLS cycles/s", "TLS ÷ plaintext",
         "plaintext claim p99 ms", "TLS claim p99 ms", "plaintext: registry CPU",
         "TLS: registry CPU", "plaintext: etcd CPU", "TLS: etcd CPU"])
    ratios = []
    facts: dict[str, float] = {}
    for n in p.claim_agents:
        plain, tls = points["plaintext", n], points["TLS", n]
        share = claims.ratio_of(points, "TLS", "plaintext", n)
        ratios.append(share)
        facts[f"etcd_tls.ratio.{n}"] = share

        def per(point: claims.Point, name: str) -> float:
            return 1000 * ratio(sum(getattr(x, name) for x in point.samples),
                                point.total("cycles"))

        table.rows.append([n, plain.per_s, tls.per_s, share, plain.ms(0.99), tls.ms(0.99),
                           per(plain, "registry_cpu"), per(tls, "registry_cpu"),
                           per(plain, "etcd_cpu"), per(tls, "etcd_cpu")])
    agents = list(p.claim_agents)
    headline = (f"etcd over TLS: Baton's claim → commit rate with TLS (client certificates) "
                f"to etcd ÷ with plaintext {min(ratios):.2f}-{max(ratios):.2f} over "
                f"{agents[0]}-{agents[-1]} agents.")
    intro = f"""
{METHOD.strip()}

Each point: a task of {p.claim_entries:,} entries, at most {p.claim_seconds:g} s;
{p.claim_rounds} round(s). The ratio is the median of the ratios within a round.
CPU per cycle: the registry process's and etcd's CPU time over the run ÷ cycles.
"""
    return Section("etcd-tls", "etcd over TLS", intro, [table], headlines=[headline],
                   seconds=seconds, load=load_average(), facts=facts)
