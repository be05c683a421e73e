"""The in-memory etcd where time matters (leases, progress notifications), on an event
loop whose clock the test sets; and what it shares with ``Etcd`` without any etcd (its
interface, the size of its requests). Its behaviour against a real etcd is held by
tests/integration/test_store_conformance.py."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from aetcd import rpc

from baton_relay.kernel.errors import Internal, SessionExpired, Unavailable
from baton_relay.registry.store.etcd import (
    Compare,
    Delete,
    Etcd,
    Get,
    Guarded,
    Put,
    Watched,
    WatchEvent,
    _txn_pb,
    absent,
    empty,
)
from baton_relay.testing.store import MemoryEtcd, _txn_size

T = TypeVar("T")


class ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock stands still until the test moves it."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def time(self) -> float:
        return self.now


async def at(loop: ClockLoop, when: float) -> None:
    """Move the clock to ``when`` and let the loop run what fell due (woken at once)."""
    loop.now = when
    loop.call_soon(lambda: None)
    for _ in range(3):
        await asyncio.sleep(0)


def run(body: Callable[[MemoryEtcd, ClockLoop], Awaitable[T]], **settings: Any) -> T:
    """``body`` with a connected store on a loop of its own whose clock the test owns."""
    loop = ClockLoop()
    try:
        async def main() -> T:
            store = MemoryEtcd(**settings)
            await store.connect()
            return await body(store, loop)

        return loop.run_until_complete(main())
    finally:
        # What the test left waiting (watches, their tasks) is closed on this loop.
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def kinds(batch: list[WatchEvent]) -> list[tuple[str, bytes, int]]:
    return [(ev.kind, ev.kv.key, ev.kv.mod_revision) for ev in batch]


# -- leases -------------------------------------------------------------------------------

def test_a_lease_ends_exactly_at_its_ttl_and_its_keys_go_in_one_revision() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        start = loop.now
        lease, ttl = await store.grant(10)
        assert ttl == 10
        await store.txn([], [Put(b"/l/b", b"1", lease), Put(b"/l/a", b"1", lease),
                             Put(b"/l/kept", b"1")])
        written = store.revision
        watch = store.watch(b"/l/", written + 1)
        pending = asyncio.ensure_future(anext(watch))
        assert await store.lease_times(lease) == (10, 10)
        await at(loop, start + 0.5)
        assert await store.time_to_live(lease) == 9  # whole seconds, rounded down
        await at(loop, start + 9.999)
        assert await store.lease_keys(lease) == (0, [b"/l/a", b"/l/b"])
        assert not pending.done() and store.revision == written
        await at(loop, start + 10)
        assert pending.done(), "the lease outlived its TTL"
        assert kinds(pending.result()) == [("delete", b"/l/a", written + 1),
                                           ("delete", b"/l/b", written + 1)]
        assert store.revision == written + 1
        assert await store.time_to_live(lease) == -1
        assert await store.keepalive(lease) == 0
        assert list(store.snapshot(b"/l/")) == [b"/l/kept"]
        await watch.aclose()  # type: ignore[attr-defined]

    run(body)


def test_a_request_at_the_deadline_never_sees_the_lease_alive() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        lease, _ = await store.grant(5)
        await store.txn([], [Put(b"/k", b"1", lease)])
        loop.now += 5  # no turn of the loop yet: the lease's timer has not run
        assert await store.get(b"/k") is None
        with pytest.raises(SessionExpired, match="lease not found"):
            await store.txn([], [Put(b"/k", b"2", lease)])

    run(body)


def test_keepalive_pushes_the_end_back_by_the_ttl() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        start = loop.now
        lease, _ = await store.grant(10)
        await store.txn([], [Put(b"/k", b"1", lease)])
        await at(loop, start + 6)
        assert await store.keepalive(lease) == 10
        await at(loop, start + 12)  # past the first deadline
        assert await store.get(b"/k") is not None
        assert await store.time_to_live(lease) == 4
        await at(loop, start + 15.999)
        assert store.snapshot() != {}
        await at(loop, start + 16)
        assert store.snapshot() == {}
        assert await store.lease_times(lease) == (-1, 0)

    run(body)


def test_short_leases_get_etcds_least_ttl_and_a_lease_without_keys_ends_quietly() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        start = loop.now
        lease, ttl = await store.grant(1)
        assert ttl == 2
        before = store.revision
        await at(loop, start + 2)
        assert await store.time_to_live(lease) == -1
        assert store.revision == before  # nothing deleted: no revision
        with pytest.raises(Internal, match="too large lease TTL"):
            await store.grant(10**10)

    run(body)


# -- watches -----------------------------------------------------------------------------------

def test_progress_notifications_while_a_watch_is_idle() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        start = loop.now
        await store.txn([], [Put(b"/w/a", b"1")])
        items = store.watch_progress(b"/w/", store.revision + 1)
        nxt = asyncio.ensure_future(anext(items))
        await asyncio.sleep(0)  # the watch opens: its ticks count from now
        await at(loop, start + 0.999)
        assert not nxt.done()
        await at(loop, start + 1)
        assert nxt.result() == store.revision
        # An event since the last tick: that tick says nothing.
        await store.txn([], [Put(b"/w/b", b"1")])
        assert kinds(await anext(items)) == [("put", b"/w/b", store.revision)]
        nxt = asyncio.ensure_future(anext(items))
        await at(loop, start + 2)
        assert not nxt.done()
        # A write elsewhere moves the revision it tells.
        await store.txn([], [Put(b"/x", b"1")])
        await at(loop, start + 3)
        assert nxt.result() == store.revision
        await items.aclose()  # type: ignore[attr-defined]

        # A plain watch, or a prefix that does not ask, is never told.
        plain = store.watch(b"/w/", store.revision + 1)
        quiet = store.watch_many([Watched(b"/w/", progress=False)], store.revision + 1)
        waiting = [asyncio.ensure_future(anext(plain)), asyncio.ensure_future(anext(quiet))]
        await at(loop, start + 10)
        assert not any(w.done() for w in waiting)
        await store.txn([], [Put(b"/w/c", b"1")])
        for w in waiting:
            assert kinds(await w) == [("put", b"/w/c", store.revision)]
        await plain.aclose()  # type: ignore[attr-defined]
        await quiet.aclose()

    run(body, progress_interval=1.0)


def test_a_watch_misses_nothing_and_repeats_nothing_written_while_it_opens() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        await store.txn([], [Put(b"/w/0", b"")])
        start = store.revision
        seen: list[list[tuple[str, bytes, int]]] = []

        async def follow() -> None:
            async for batch in store.watch(b"/w/", start):
                seen.append(kinds(batch))

        follower = asyncio.ensure_future(follow())
        # Written before the watch opens (the follower has not run yet), then after.
        await store.txn([], [Put(b"/w/1", b""), Put(b"/w/2", b"")])
        await asyncio.sleep(0)
        await store.txn([], [Delete(b"/w/1")])
        await store.txn([], [Put(b"/elsewhere", b"")])
        await store.txn([], [Put(b"/w/3", b"")])
        for _ in range(3):
            await asyncio.sleep(0)
        follower.cancel()
        revisions = [rev for batch in seen for _, _, rev in batch]
        assert revisions == [start, start + 1, start + 1, start + 2, start + 4]
        assert len(seen[-1]) == 1 and len(seen[-2]) == 1  # live: one batch per revision

    run(body)


def test_closing_or_cancelling_a_watch_leaves_nothing_behind() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        watch = store.watch_progress(b"/w/", 0)
        pending = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0)
        assert len(store._streams) == 1
        pending.cancel()
        await asyncio.sleep(0)
        await watch.aclose()  # type: ignore[attr-defined]
        assert not store._streams
        many = store.watch_many([Watched(b"/a/"), Watched(b"/b/")], 0)
        await store.txn([], [Put(b"/a/1", b"")])
        pending = asyncio.ensure_future(anext(many))
        await asyncio.sleep(0)
        await store.txn([], [Put(b"/b/1", b"")])
        assert kinds(await pending) == [("put", b"/b/1", store.revision)]
        await many.aclose()
        assert not store._streams
        assert not loop._scheduled or all(h.cancelled() for h in loop._scheduled)  # type: ignore[attr-defined]

    run(body)


def test_a_compacted_start_is_refused_and_older_reads_fail_as_etcds() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        for i in range(4):
            await store.txn([], [Put(b"/k", str(i).encode())])
        store.compact(store.revision - 1)
        from baton_relay.kernel.errors import Compacted
        with pytest.raises(Compacted, match=rf"revision {store.revision - 2} compacted"):
            await anext(store.watch(b"/k", store.revision - 2))
        with pytest.raises(Internal, match="required revision has been compacted"):
            await store.range(b"/k", revision=store.revision - 2)
        kvs, _, _ = await store.range(b"/k", revision=store.revision - 1)
        assert [kv.value for kv in kvs] == [b"2"]

    run(body)


# -- revisions, closing, loops --------------------------------------------------------------------

def test_a_request_that_changes_nothing_keeps_the_revision() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        await store.txn([], [Put(b"/a", b"1")])
        lease, _ = await store.grant(30)
        before = store.revision
        assert (await store.txn([], [Delete(b"/none")])).revision == before
        assert (await store.txn([absent(b"/a")], [Put(b"/a", b"2")], [Get(b"/a")])).revision \
            == before
        rev, results = await store.txn_group([Guarded([absent(b"/a")], [Put(b"/a", b"x")]),
                                              Guarded([], [Delete(b"/b")])])
        assert rev == before and [r.succeeded for r in results] == [False, True]
        await store.revoke(lease)
        assert store.revision == before

    run(body)


def test_a_request_lets_other_tasks_run_as_a_call_over_the_network_does() -> None:
    """Each request yields to the loop once before it applies: callers that await it
    in turn interleave (and the registry's group commit finds company)."""
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        order: list[str] = []

        async def put(name: str) -> None:
            order.append(f"{name} sent")
            await store.txn([], [Put(name.encode(), b"")])
            order.append(f"{name} applied")

        await asyncio.gather(put("/a"), put("/b"))
        assert order == ["/a sent", "/b sent", "/a applied", "/b applied"]

    run(body)


def test_close_ends_watches_and_requests_but_keeps_the_data() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        await store.txn([], [Put(b"/a", b"1")])
        watch = store.watch(b"/", store.revision + 1)
        pending = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0)
        await store.close()
        with pytest.raises(Unavailable):
            await pending
        with pytest.raises(Unavailable, match="call connect"):
            await store.get(b"/a")
        await store.connect()
        kv = await store.get(b"/a")
        assert kv is not None and kv.value == b"1"

    run(body)


def test_the_store_belongs_to_the_loop_it_was_first_used_on() -> None:
    store = MemoryEtcd()
    asyncio.run(store.connect())
    with pytest.raises(RuntimeError, match="one event loop"):
        asyncio.run(store.get(b"/a"))


def test_tracked_writes_and_observed_requests_as_etcds() -> None:
    async def body(store: MemoryEtcd, loop: ClockLoop) -> None:
        told: list[tuple[str, bool]] = []
        store.observe = lambda kind, seconds, ok: told.append((kind, ok))
        store.tracks = lambda key: key.startswith(b"/t/")
        await store.txn([], [Put(b"/u/1", b"")])
        assert store.wrote == 0
        result = await store.txn([], [Put(b"/t/1", b"")])
        assert store.wrote == result.revision
        await store.txn_group([Guarded([absent(b"/t/1")], [Put(b"/t/1", b"")]),
                               Guarded([], [Put(b"/u/2", b"")])])
        assert store.wrote == result.revision  # the tracked write did not run
        with pytest.raises(Internal, match="duplicate key"):
            await store.txn([], [Put(b"/t/1", b""), Put(b"/t/1", b"")])
        assert [kv.key async for kv in store.scan(b"/", page=1)] == [b"/t/1", b"/u/1",
                                                                      b"/u/2"]
        assert told == [("txn", True)] * 3 + [("txn", False)] + [("range", True)] * 3

    run(body)


# -- what it shares with Etcd -------------------------------------------------------------------

def test_the_interface_is_etcds() -> None:
    """Every public method of ``Etcd`` is on the store, with the same parameters
    (names, kinds, defaults) and return annotation; and its public attributes."""
    for name, method in inspect.getmembers(Etcd, inspect.isfunction):
        if name.startswith("_"):
            continue
        mine = getattr(MemoryEtcd, name, None)
        assert mine is not None, f"MemoryEtcd has no {name}"
        want, got = inspect.signature(method), inspect.signature(mine)
        assert [(p.name, p.kind, p.default, p.annotation) for p in got.parameters.values()] \
            == [(p.name, p.kind, p.default, p.annotation) for p in want.parameters.values()], name
        assert got.return_annotation == want.return_annotation, name
        assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(method), name
        assert inspect.isasyncgenfunction(mine) == inspect.isasyncgenfunction(method), name
    etcd, store = Etcd("127.0.0.1:2379"), MemoryEtcd()
    for attribute in ("endpoint", "members", "auth", "full_at", "observe", "wrote", "tracks"):
        assert type(getattr(store, attribute)) is type(getattr(etcd, attribute)), attribute


def test_request_bytes_are_counted_as_protobuf_counts_them() -> None:
    """The store's arithmetic of a request's size, against the protobuf ``Etcd`` sends."""
    cases: list[tuple[list[Compare], list[Any], list[Any]]] = [
        ([], [], []),
        ([absent(b"k"), Compare(b"k", "value", "!=", b""), Compare(b"a", "mod", "<", 2**40),
          Compare(b"a", "create", ">", 7, b"b" * 200), empty(b"p/")],
         [Put(b"k", b"v" * 300, 2**62), Put(b"k2", b""), Delete(b"x"),
          Get(b"p/", prefix=True, limit=5, keys_only=True), Get(b"q")],
         [Get(b"k")]),
    ]
    for compares, success, failure in cases:
        assert _txn_size(compares, success, failure) == _txn_pb(
            compares, success, failure).ByteSize()
    group = [Guarded([absent(b"a" * 130)], [Put(b"a" * 130, b"v" * 5000)], [Get(b"a")]),
             Guarded([], [Delete(b"z")]), Guarded([], [])]
    request = rpc.TxnRequest()
    for g in group:
        g._fill(request.success.add().request_txn)
    assert _txn_size([], group, []) == request.ByteSize()
