"""Claiming never scans a task: the keys read per claim do not grow with the task."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.identity import ANONYMOUS
from baton_relay.registry.rules.core import Core
from baton_relay.registry.store.etcd import KV, Etcd
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.verbs.producers import Producers
from baton_relay.registry.verbs.sessions import Sessions
from baton_relay.registry.verbs.tasks import Tasks


class CountingEtcd(Etcd):
    """The real etcd client, counting every key-value it reads."""

    kvs_read = 0

    async def get(self, key: bytes) -> KV | None:
        kv = await super().get(key)
        self.kvs_read += kv is not None
        return kv

    async def range(self, prefix: bytes, **kw: Any) -> tuple[list[KV], int, bool]:
        kvs, rev, more = await super().range(prefix, **kw)
        self.kvs_read += len(kvs)
        return kvs, rev, more


async def keys_read_per_claim(endpoint: str, prefix: str, size: int, claims: int) -> int:
    etcd = CountingEtcd(endpoint, timeout=60)  # creating the task is heavy on a busy CI box
    await etcd.connect()
    try:
        core = Core(etcd, Keys(prefix), "/staging")
        spec = pb.TaskSpec(task_id="big", entries=[
            pb.EntrySpec(file_id=f"e{i:06d}", path=f"e{i:06d}") for i in range(size)])
        await Tasks(core).create(pb.CreateTaskRequest(spec=spec))
        session = await Sessions(core).open(pb.OpenSessionRequest(agent="a", ttl=30),
                                            ANONYMOUS)
        producers = Producers(core)
        etcd.kvs_read = 0
        for _ in range(claims):
            await producers.claim(pb.ClaimRequest(task_id="big", session_id=session.session_id),
                                  ANONYMOUS)
        return etcd.kvs_read // claims
    finally:
        await etcd.close()


def test_claim_reads_a_bounded_number_of_keys(etcd: Any, tmp_path: Path) -> None:
    """Keys read per claim are the same in a task of 100 and of 10,000 entries."""
    small = asyncio.run(keys_read_per_claim(etcd.endpoint, "/scale-small/", 100, 20))
    large = asyncio.run(keys_read_per_claim(etcd.endpoint, "/scale-large/", 10_000, 20))
    assert large <= 2 * 64 + 8  # one page of the ready index and a few point reads
    assert large <= small + 64
