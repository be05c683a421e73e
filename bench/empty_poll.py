"""What an idle poller's empty claim costs: etcd key-value requests and time per claim.

    python -m bench.empty_poll ENDPOINT [--polls 200]

One registry core on ``ENDPOINT`` (an etcd, ``host:port``) creates a task of one entry,
claims and commits it, waits until its view has seen its own writes, then asks for a
claim ``--polls`` times; each is answered "nothing to claim". Printed: etcd requests
(ranges and transactions, counted on the client) and milliseconds per empty claim.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import blake3

from baton_relay.kernel.errors import NothingToClaim
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.identity import ANONYMOUS
from baton_relay.registry.rules.core import Core
from baton_relay.registry.store.etcd import KV, Compare, Etcd, Guarded, TxnOp, TxnResult
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.verbs.producers import Producers
from baton_relay.registry.verbs.sessions import Sessions
from baton_relay.registry.verbs.tasks import Tasks


class _Counting(Etcd):
    """The real etcd client, counting the key-value requests it sends."""

    requests = 0

    async def get(self, key: bytes) -> KV | None:
        self.requests += 1
        return await super().get(key)

    async def range(self, prefix: bytes, **kw: Any) -> tuple[list[KV], int, bool]:
        self.requests += 1
        return await super().range(prefix, **kw)

    async def txn(self, compares: Sequence[Compare], success: Sequence[TxnOp],
                  failure: Sequence[TxnOp] = ()) -> TxnResult:
        self.requests += 1
        return await super().txn(compares, success, failure)

    async def txn_group(self, group: Sequence[Guarded]) -> tuple[int, list[TxnResult]]:
        self.requests += 1
        return await super().txn_group(group)


async def run(endpoint: str, polls: int) -> tuple[float, float]:
    """Requests and milliseconds per empty claim."""
    etcd = _Counting(endpoint, timeout=60)
    await etcd.connect()
    core = Core(etcd, Keys(f"/bench-empty-poll-{time.time_ns()}/"), "/staging")
    await core.start()
    try:
        await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(
            task_id="t", entries=[pb.EntrySpec(file_id="e", path="e")])))
        opened = await Sessions(core).open(pb.OpenSessionRequest(agent="a", ttl=30), ANONYMOUS)
        producers = Producers(core)
        claim = pb.ClaimRequest(task_id="t", session_id=opened.session_id)
        got = await producers.claim(claim, ANONYMOUS)
        await producers.commit(pb.CommitRequest(
            task_id="t", file_id="e", token=got.token,
            digest=blake3.blake3(b"").hexdigest()), ANONYMOUS)
        assert core.view is not None
        for _ in range(1000):  # 10 s at most: the view has no event for its progress
            if core.view.current():
                break
            await asyncio.sleep(0.01)
        etcd.requests = 0
        start = time.perf_counter()
        for _ in range(polls):
            with contextlib.suppress(NothingToClaim):
                await producers.claim(claim, ANONYMOUS)
        elapsed = time.perf_counter() - start
        return etcd.requests / polls, elapsed / polls * 1000
    finally:
        await core.stop()
        await etcd.close()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (exits on an unknown option)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("endpoint")
    parser.add_argument("--polls", type=int, default=200)
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    requests, ms = asyncio.run(run(args.endpoint, args.polls))
    print(f"etcd requests per empty claim: {requests:.2f}; {ms:.3f} ms each")


if __name__ == "__main__":
    main()
