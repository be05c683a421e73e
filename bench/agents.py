"""Jobs that run in the agent processes of :class:`bench.harness.Pool`.

Each job is one agent with its own connection: a :class:`client.Client` and
session through the registry, or a :class:`registry._etcd.Etcd` straight to etcd
(the limit: the registry's own etcd client library, one transaction per call).
Jobs prepare, call ``ready()`` (which returns the shared start instant), run until
their time is up or the work runs out, and return what they measured.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from baton_relay.client import Client
from baton_relay.kernel import errors

from .pool import Ready


@dataclass(frozen=True)
class AgentArgs:
    address: str
    task: str
    agent: str
    seconds: float
    #: claims per call: 0 = single claims (Claim + Commit), else ClaimBatch + CommitBatch
    batch: int = 0
    #: stop after this many entries (0 = no limit)
    max_entries: int = 0
    #: (ca, cert, key) of the identity to call as; empty: plaintext
    credentials: tuple[str, str, str] = ("", "", "")


@dataclass
class AgentResult:
    #: claim calls made (each followed by its commit)
    calls: int = 0
    #: seconds each claim call took
    latencies: list[float] = field(default_factory=list)
    #: file ids claimed, in order
    claimed: list[str] = field(default_factory=list)
    end: float = 0.0


def baton_agent(args: AgentArgs, ready: Ready) -> AgentResult:
    """Claim → commit through the registry (size 0: coordination only, no bytes, so no
    digest either: the benchmark's tasks set ``digest_optional``)."""
    out = AgentResult()
    ca, cert, key = args.credentials
    with Client(args.address, timeout=30, ca=ca, cert=cert, key=key) as c, \
            c.open_session(args.agent, ttl=30) as s:
        deadline = ready() + args.seconds
        while time.monotonic() < deadline:
            if args.max_entries and len(out.claimed) >= args.max_entries:
                break
            t0 = time.perf_counter()
            try:
                if args.batch:
                    claims = c.claim_batch(args.task, args.batch, session=s)
                else:
                    claims = [c.claim(args.task, session=s)]
            except errors.NothingToClaim:
                break
            if not claims:
                break
            out.latencies.append(time.perf_counter() - t0)
            if args.batch:
                c.commit_batch([(args.task, cl.file_id, cl.token, 0, "") for cl in claims])
            else:
                c.commit(args.task, claims[0].file_id, claims[0].token, 0)
            out.calls += 1
            out.claimed.extend(cl.file_id for cl in claims)
        out.end = time.monotonic()
    return out


@dataclass(frozen=True)
class RawArgs:
    endpoint: str
    prefix: str
    seconds: float


def raw_etcd_agent(args: RawArgs, ready: Ready) -> AgentResult:
    """Create-only transactions (compare version == 0, put) back to back."""
    from baton_relay.registry.store.etcd import Etcd, Put, absent

    out = AgentResult()

    async def run() -> None:
        etcd = Etcd(args.endpoint, timeout=30)
        await etcd.connect()
        try:
            await etcd.status()  # the channel is up before the clock starts
            deadline = ready() + args.seconds
            i = 0
            while time.monotonic() < deadline:
                key = f"{args.prefix}{i:08d}".encode()
                t0 = time.perf_counter()
                result = await etcd.txn([absent(key)], [Put(key, b"x")])
                out.latencies.append(time.perf_counter() - t0)
                if not result.succeeded:
                    raise RuntimeError(f"{key!r} existed already")
                out.calls += 1
                i += 1
            out.end = time.monotonic()
        finally:
            await etcd.close()

    asyncio.run(run())
    return out


def double_claims(claimed: list[list[str]]) -> int:
    """Entries that were handed out more than once (to two agents, or twice to one)."""
    seen: dict[str, int] = {}
    for ids in claimed:
        for file_id in ids:
            seen[file_id] = seen.get(file_id, 0) + 1
    return sum(1 for n in seen.values() if n > 1)


def rate(count: int, start: float, ends: list[float]) -> float:
    """``count`` per second between the common start and the last agent's end."""
    elapsed = max(ends, default=start) - start
    return count / elapsed if elapsed > 0 else float("nan")
