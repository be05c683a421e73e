"""Clients' watch streams share one etcd watch per prefix per replica (registry.fanout)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from registry_fixtures import RegistryHandle

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import EtcdProcess
from baton_relay.registry.store.etcd import Etcd, Put
from baton_relay.registry.store.fanout import Fanout

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

DIGEST = "0" * 64


def run(etcd: EtcdProcess, body: Callable[[Etcd], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        client = Etcd(etcd.endpoint)
        await client.connect()
        try:
            return await body(client)
        finally:
            await client.close()
    return asyncio.run(main())


async def put(etcd: Etcd, key: str, value: str = "v") -> int:
    """Write ``key``; the revision of the write."""
    return (await etcd.txn([], [Put(key.encode(), value.encode())])).revision


async def take(stream: AsyncIterator[list[Any]], n: int) -> list[tuple[str, int]]:
    """The next ``n`` events of ``stream`` as (key, revision), within 10 s."""
    got: list[tuple[str, int]] = []

    async def collect() -> None:
        async for batch in stream:
            got.extend((ev.kv.key.decode(), ev.kv.mod_revision) for ev in batch)
            if len(got) >= n:
                return
    await asyncio.wait_for(collect(), 10)
    return got


def test_streams_on_one_prefix_share_one_watch_and_each_sees_every_event(
        etcd: EtcdProcess, prefix: str) -> None:
    """Three streams from now: one etcd watch between them, every event once to each, in
    order; the watch ends when the last stream leaves."""
    async def body(client: Etcd) -> None:
        fanout = Fanout(client)
        _, now, _ = await client.range(prefix.encode(), limit=1)
        streams = [fanout.follow(prefix.encode(), now + 1) for _ in range(3)]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0)  # each stream takes its first step: it joins the feed
        assert fanout.feeds == 1 and fanout.streams(prefix.encode()) == 3
        revisions = [await put(client, f"{prefix}k{i}") for i in range(5)]
        want = [(f"{prefix}k{i}", r) for i, r in enumerate(revisions)]
        for stream, first in zip(streams, firsts, strict=True):
            got = [(ev.kv.key.decode(), ev.kv.mod_revision) for ev in await first]
            if len(got) < len(want):
                got += await take(stream, len(want) - len(got))
            assert got == want
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
        assert fanout.feeds == 0 and fanout.private == 0

    run(etcd, body)


def test_a_stream_from_before_the_feed_is_served_by_a_watch_of_its_own(
        etcd: EtcdProcess, prefix: str) -> None:
    """A stream resuming from a revision the shared watch has passed gets the events
    from there (its own watch), and the shared stream is not disturbed."""
    async def body(client: Etcd) -> None:
        fanout = Fanout(client)
        _, now, _ = await client.range(prefix.encode(), limit=1)
        live = fanout.follow(prefix.encode(), now + 1)
        first = asyncio.ensure_future(take(live, 2))
        old = [await put(client, f"{prefix}a"), await put(client, f"{prefix}b")]
        assert [r for _, r in await first] == old
        late = fanout.follow(prefix.encode(), old[0])
        assert await take(late, 2) == [(f"{prefix}a", old[0]), (f"{prefix}b", old[1])]
        assert fanout.private == 1 and fanout.feeds == 1
        rev = await put(client, f"{prefix}c")
        assert await take(live, 1) == [(f"{prefix}c", rev)]
        await late.aclose()  # type: ignore[attr-defined]
        await live.aclose()  # type: ignore[attr-defined]

    run(etcd, body)


def test_a_slow_stream_leaves_the_feed_and_misses_nothing(
        etcd: EtcdProcess, prefix: str) -> None:
    """A stream that falls more than ``limit`` batches behind goes on with a watch of its
    own from where it was: every event once, in order; the prompt stream is not held."""
    async def body(client: Etcd) -> None:
        fanout = Fanout(client, limit=2)
        _, now, _ = await client.range(prefix.encode(), limit=1)
        prompt = fanout.follow(prefix.encode(), now + 1)
        slow = fanout.follow(prefix.encode(), now + 1)
        prompt_next = asyncio.ensure_future(prompt.__anext__())
        slow_first = asyncio.ensure_future(slow.__anext__())
        await asyncio.sleep(0)  # both take their first step: they join the feed
        assert fanout.streams(prefix.encode()) == 2
        want, got_prompt = [], []
        for i in range(8):
            # One batch per write: the next write waits until the prompt stream has it.
            want.append((f"{prefix}k{i}", await put(client, f"{prefix}k{i}")))
            batch = await (prompt_next if i == 0 else prompt.__anext__())
            got_prompt += [(ev.kv.key.decode(), ev.kv.mod_revision) for ev in batch]
        assert got_prompt == want
        got = [(ev.kv.key.decode(), ev.kv.mod_revision) for ev in await slow_first]
        got += await take(slow, 8 - len(got))
        assert got == want
        assert fanout.private == 1
        await prompt.aclose()  # type: ignore[attr-defined]
        await slow.aclose()  # type: ignore[attr-defined]

    run(etcd, body)


def test_client_watch_streams_on_a_task_share_the_replicas_one_watch(
        registry: RegistryHandle, client: Client) -> None:
    """Four clients watching one task hold one etcd watch on the replica between them,
    and each sees the task's changes."""
    client.operator.create_task({"task_id": "t", "digest_optional": True,
                                 "entries": [{"file_id": f"f{i}",
                                              "path": f"f{i}"} for i in range(3)]})
    fanout = registry._running.core.fanout
    seen: list[list[pb.TaskEvent]] = [[] for _ in range(4)]
    synced = [threading.Event() for _ in range(4)]

    def follow(i: int) -> None:
        with Client(registry.address) as c:
            for ev in c.watch("t", timeout=15):
                if ev.kind == pb.TaskEvent.KIND_SYNCED:
                    synced[i].set()
                elif ev.kind == pb.TaskEvent.KIND_CHANGED:
                    seen[i].append(ev)
                    if sum(e.entry.state == pb.ENTRY_STATE_WRITTEN for e in seen[i]) == 3:
                        return

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert all(s.wait(10) for s in synced)
    entries = registry._running.core.keys.entries("t")
    deadline = time.monotonic() + 10
    while fanout.streams(entries) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fanout.streams(entries) == 4 and fanout.private == 0
    with client.open_session("p", ttl=10) as s:
        for _ in range(3):
            claim = client.claim("t", session=s)
            client.commit("t", claim.file_id, claim.token, 1, DIGEST, session=s)
    for t in threads:
        t.join(20)
    for events in seen:
        states = [(e.entry.file_id, e.entry.state) for e in events]
        assert sorted(f for f, st in states if st == pb.ENTRY_STATE_WRITTEN) == ["f0", "f1", "f2"]
        assert [e.revision for e in events] == sorted(e.revision for e in events)
    deadline = time.monotonic() + 10
    while fanout.streams(entries) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fanout.streams(entries) == 0


def test_a_watch_of_some_states_is_sent_only_entries_in_them(
        registry: RegistryHandle, client: Client) -> None:
    """``states=[WRITTEN]``: the snapshot lists only written entries and the changes
    only moves into ``written`` (no claim's event); an unknown state is refused."""
    client.operator.create_task({"task_id": "t", "digest_optional": True,
                                 "entries": [{"file_id": f"f{i}",
                                              "path": f"f{i}"} for i in range(4)]})
    with client.open_session("p", ttl=10) as s:
        first = client.claim("t", "f0", session=s)
        client.commit("t", "f0", first.token, 1, DIGEST, session=s)
    snapshot: list[pb.TaskEvent] = []
    changes: list[pb.TaskEvent] = []
    synced = threading.Event()

    def follow() -> None:
        with Client(registry.address) as c:
            for ev in c.watch("t", start_revision=0, timeout=15,
                              states=[pb.ENTRY_STATE_WRITTEN]):
                if ev.kind == pb.TaskEvent.KIND_SNAPSHOT:
                    snapshot.append(ev)
                elif ev.kind == pb.TaskEvent.KIND_SYNCED:
                    synced.set()
                else:
                    changes.append(ev)
                    if len(changes) == 3:
                        return

    thread = threading.Thread(target=follow)
    thread.start()
    assert synced.wait(10)
    with client.open_session("p", ttl=10) as s:
        for _ in range(3):
            claim = client.claim("t", session=s)
            client.commit("t", claim.file_id, claim.token, 1, DIGEST, session=s)
    thread.join(20)
    assert [e.entry.file_id for e in snapshot] == ["f0"]
    assert sorted(e.entry.file_id for e in changes) == ["f1", "f2", "f3"]
    assert {e.entry.state for e in snapshot + changes} == {pb.ENTRY_STATE_WRITTEN}
    with pytest.raises(errors.InvalidArgument, match="not an entry state"):
        next(client.watch("t", timeout=5, states=[pb.EntryState.ValueType(42)]))
