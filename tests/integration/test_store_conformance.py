"""The in-memory store held to etcd's behaviour: every scenario here runs on a real etcd
(the session's, or a private one for compaction and progress notifications) and on a
``MemoryEtcd``, and what each returned is compared.

Revisions are compared as what they mean, not as numbers: the session's etcd is shared,
so a scenario's revisions there start wherever the suite has come to (and a lease of an
earlier test may end, moving the revision, while it runs). Each side follows the
scenario's prefix with a watch from the start; a revision is then told as the number of
changes under the prefix up to it (its place among them). Lease ids are told by order
of first appearance. Errors are compared by type and message (etcd's own words).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from aetcd import rpc
from compacting import start_etcd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton_relay.kernel.errors import BatonError
from baton_relay.local.etcdproc import EtcdProcess
from baton_relay.registry.store.etcd import (
    KV,
    Compare,
    Delete,
    Etcd,
    Get,
    Guarded,
    Put,
    TxnOp,
    TxnResult,
    Watched,
    WatchEvent,
    _translate,
    _txn_pb,
    absent,
    empty,
    present,
)
from baton_relay.registry.store.keys import prefix_end
from baton_relay.testing.store import MemoryEtcd

Store = Etcd | MemoryEtcd

#: the private etcd's (and the memory store's) progress notification interval, seconds
PROGRESS_INTERVAL = 0.25


# -- the harness ------------------------------------------------------------------------

@dataclass(frozen=True)
class Failed:
    """A request refused: the error's type and message."""

    error: str
    message: str


@dataclass(frozen=True)
class Rev:
    """A revision among a scenario's results (plain ints are compared as they are)."""

    value: int


@dataclass(frozen=True)
class Lease:
    """A lease id among a scenario's results."""

    id: int


class Side:
    """One store running a scenario: its keys, what it returned, the changes under
    the prefix (followed by a watch) that revisions are told by."""

    def __init__(self, store: Store, prefix: bytes, baseline: int) -> None:
        self.store = store
        self.prefix = prefix
        self.baseline = baseline
        self.results: list[tuple[str, Any]] = []
        self.events: list[WatchEvent] = []
        self._seen = asyncio.Event()
        self._marks = 0

    @property
    def memory(self) -> bool:
        return isinstance(self.store, MemoryEtcd)

    def k(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def note(self, label: str, value: Any) -> None:
        self.results.append((label, value))

    async def attempt(self, label: str, call: Awaitable[Any]) -> Any:
        """Await ``call`` and note what it returned, or the error it raised."""
        try:
            value = await call
        except BatonError as e:
            value = Failed(type(e).__name__, str(e))
        self.note(label, value)
        return value

    def _heard(self, batch: list[WatchEvent]) -> None:
        self.events.extend(batch)
        self._seen.set()

    async def mark(self) -> None:
        """Write a mark under the prefix and wait until the following watch has it: every
        change before it has then been followed (and the watch has caught up)."""
        self._marks += 1
        key = self.prefix + b"\xfe" + str(self._marks).encode()
        await self.store.txn([], [Put(key, b"")])
        while not any(ev.kv.key == key for ev in self.events):
            self._seen.clear()
            await asyncio.wait_for(self._seen.wait(), 10)

    def revisions(self) -> list[int]:
        return sorted({ev.kv.mod_revision for ev in self.events})


async def ranged(call: Awaitable[tuple[list[KV], int, bool]]) -> tuple[list[KV], Rev, bool]:
    """A range's result with its revision told as a revision."""
    kvs, revision, more = await call
    return kvs, Rev(revision), more


async def grouped(call: Awaitable[tuple[int, list[TxnResult]]]) -> tuple[Rev, list[TxnResult]]:
    """A group's result with its revision told as a revision."""
    revision, results = await call
    return Rev(revision), results


async def compact(store: Store, revision: int) -> None:
    """Compact either store at ``revision`` (etcd: physically, done when it returns)."""
    if isinstance(store, MemoryEtcd):
        store.compact(revision)
        return
    try:
        await store._pick().kv.Compact(rpc.CompactionRequest(revision=revision, physical=True),
                                       timeout=5)
    except grpc.aio.AioRpcError as e:
        raise _translate(e) from e


Scenario = Callable[[Side], Awaitable[None]]


async def run_side(store: Store, prefix: bytes, scenario: Scenario) -> list[tuple[str, Any]]:
    await store.connect()
    try:
        _, baseline, _ = await store.range(prefix, limit=1)
        side = Side(store, prefix, baseline)

        async def follow() -> None:
            async for batch in store.watch(prefix, baseline + 1):
                side._heard(batch)

        follower = asyncio.create_task(follow())
        try:
            await scenario(side)
            await side.mark()
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        return normalized(side)
    finally:
        await store.close()


def normalized(side: Side) -> list[tuple[str, Any]]:
    """The side's results (and the changes it followed) with revisions told by their
    place among the changes under the prefix, lease ids by order of appearance."""
    revisions = side.revisions()
    leases: dict[int, str] = {}

    def rev(r: int) -> int:
        return bisect.bisect_right(revisions, r) if r else 0

    def lease(lease_id: int) -> str:
        return leases.setdefault(lease_id, f"lease{len(leases)}") if lease_id else ""

    def norm(value: Any) -> Any:
        if isinstance(value, KV):
            return ("kv", value.key, value.value, rev(value.create_revision),
                    rev(value.mod_revision), value.version, lease(value.lease))
        if isinstance(value, TxnResult):
            return ("txn", value.succeeded, rev(value.revision), norm(value.gets))
        if isinstance(value, WatchEvent):
            return (value.kind, norm(value.kv))
        if isinstance(value, Rev):
            return ("rev", rev(value.value))
        if isinstance(value, Lease):
            return lease(value.id)
        if isinstance(value, list | tuple):
            return [norm(v) for v in value]
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items()}
        return value

    return [*((label, norm(value)) for label, value in side.results),
            ("history", norm(side.events))]


def conform(endpoint: str, prefix: str, scenario: Scenario,
            memory: Callable[[], MemoryEtcd] = MemoryEtcd) -> None:
    """Run ``scenario`` on etcd at ``endpoint`` and on a new memory store; compare."""

    async def main() -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        real = await run_side(Etcd(endpoint), prefix.encode(), scenario)
        mine = await run_side(memory(), prefix.encode(), scenario)
        return real, mine

    real, mine = asyncio.run(main())
    assert [label for label, _ in mine] == [label for label, _ in real]
    for (label, want), (_, got) in zip(real, mine, strict=True):
        assert got == want, f"{label}: memory store differs from etcd"


@pytest.fixture(scope="module")
def private_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """An etcd of this module's own: nothing else writes to it (exact revisions), it may
    be compacted, and it sends progress notifications every ``PROGRESS_INTERVAL``."""
    process = start_etcd(tmp_path_factory.mktemp("conformance"),
                         "--experimental-watch-progress-notify-interval="
                         f"{int(PROGRESS_INTERVAL * 1000)}ms")
    try:
        yield process
    finally:
        process.stop()


def progressing() -> MemoryEtcd:
    return MemoryEtcd(progress_interval=PROGRESS_INTERVAL)


async def take(items: Any, count: int) -> list[Any]:
    """The first ``count`` items of a watch (then closed); 10 s at most."""
    got: list[Any] = []
    async with contextlib.aclosing(items):
        async with asyncio.timeout(10):
            async for item in items:
                got.append(item)
                if len(got) == count:
                    break
    return got


# -- keys, versions, revisions ------------------------------------------------------------

def test_puts_deletes_versions_and_revisions(etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s, a, b, c, none = side.store, side.k("a"), side.k("b"), side.k("c"), side.k("none")
        await side.attempt("put a", s.txn([], [Put(a, b"1")]))
        await side.attempt("put a again", s.txn([], [Put(a, b"2")]))
        await side.attempt("b and c in one request", s.txn([], [Put(b, b"1"), Put(c, b"1")]))
        await side.attempt("get a", s.get(a))
        await side.attempt("delete a", s.txn([], [Delete(a)]))
        await side.attempt("delete what is not there", s.txn([], [Delete(none)]))
        await side.attempt("get a deleted", s.get(a))
        await side.attempt("a created again", s.txn([], [Put(a, b"3")]))
        await side.attempt("the same value again", s.txn([], [Put(a, b"3")]))
        await side.attempt("get a", s.get(a))
        await side.attempt("delete b, c and a missing key",
                           s.txn([], [Delete(b), Delete(c), Delete(none)]))
        await side.attempt("delete a twice in one request", s.txn([], [Delete(a), Delete(a)]))
        await side.attempt("everything", ranged(s.range(side.prefix)))
        await side.attempt("a read-only request", s.txn([], [Get(a), Get(b)]))

    conform(etcd.endpoint, prefix, scenario)


def test_every_compare_target_and_operator(etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s = side.store
        x, y, z = side.k("x"), side.k("y"), side.k("z")
        await s.txn([], [Put(x, b"5")])
        await s.txn([], [Put(y, b"4")])
        await s.txn([], [Put(y, b"6")])
        await s.txn([], [Put(side.k("r/1"), b"5"), Put(side.k("r/2"), b"6")])
        await s.txn([], [Put(side.k("r/2"), b"7")])
        kx, ky = await s.get(x), await s.get(y)
        assert kx is not None and ky is not None
        subjects = [(x, b""), (y, b""), (z, b""), (side.k("r/"), prefix_end(side.k("r/"))),
                    (side.k("e/"), prefix_end(side.k("e/")))]
        # Operands of create and mod are told by what they are (the revisions differ).
        labelled: list[tuple[str, Compare]] = []
        for key, end in subjects:
            name = key[len(side.prefix):].decode()
            for op in ("==", "!=", ">", "<"):
                for n in (0, 1, 2, 3):
                    labelled.append((f"{name} version {op} {n}",
                                     Compare(key, "version", op, n, end)))
                for value in (b"", b"4", b"5", b"6", b"7"):
                    labelled.append((f"{name} value {op} {value!r}",
                                     Compare(key, "value", op, value, end)))
                for target in ("create", "mod"):
                    labelled.append((f"{name} {target} {op} 0", Compare(key, target, op, 0, end)))
                    for what, m in (("x.create", kx.create_revision), ("y.mod", ky.mod_revision)):
                        # Off by one only with < and >: a revision of another test may
                        # fall between two of this one's on the shared etcd.
                        for delta in (-1, 0, 1) if op in "<>" else (0,):
                            labelled.append((f"{name} {target} {op} {what}{delta:+}",
                                             Compare(key, target, op, m + delta, end)))
        outcomes = []
        for i in range(0, len(labelled), 100):
            _, results = await s.txn_group(
                [Guarded([c], [Get(x)]) for _, c in labelled[i:i + 100]])
            outcomes += [r.succeeded for r in results]
        side.note("each compare alone",
                  [(label, held) for (label, _), held in zip(labelled, outcomes, strict=True)])
        # Several compares of one transaction: all must hold.
        await side.attempt("all hold", s.txn([present(x), absent(z), empty(side.k("e/"))],
                                             [Get(x)], [Get(y)]))
        await side.attempt("one fails", s.txn([present(x), present(z)], [Get(x)], [Get(y)]))

    conform(etcd.endpoint, prefix, scenario)


def test_branches_run_their_reads_and_writes_in_order(etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s, a, b = side.store, side.k("a"), side.k("b")
        await side.attempt("create a", s.txn([absent(a)], [Get(a), Put(a, b"1"), Get(a)],
                                             [Get(a)]))
        await side.attempt("create a again", s.txn([absent(a)], [Put(a, b"2")], [Get(a)]))
        await side.attempt("reads of a prefix", s.txn([], [
            Put(b, b"1"), Get(side.prefix, prefix=True), Get(side.prefix, prefix=True, limit=1),
            Get(side.prefix, prefix=True, keys_only=True), Delete(a), Get(a),
            Get(side.prefix, prefix=True)]))
        await side.attempt("failure branch writes", s.txn([present(a)], [Put(a, b"x")],
                                                          [Put(a, b"3"), Get(a)]))
        keys = [side.k(f"many/{i:03}") for i in range(250)]
        for i in range(0, 250, 100):
            await s.txn([], [Put(k, k[-3:]) for k in keys[i:i + 100]])
        await side.attempt("read", s.read([Get(keys[0]), Get(side.k("many/"), prefix=True,
                                                             limit=3), Get(side.k("nothing"))]))
        chunks = [(Rev(rev), found) async for rev, found in s.get_chunks(
            [*keys[::2], side.k("missing")])]
        side.note("get_chunks", chunks)

    conform(etcd.endpoint, prefix, scenario)


def test_nested_transactions_decide_alone_and_write_at_one_revision(
        etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s = side.store
        a, b, c, d = side.k("a"), side.k("b"), side.k("c"), side.k("d")
        await s.txn([], [Put(b, b"1")])
        await side.attempt("three callers", grouped(s.txn_group([
            Guarded([absent(a)], [Put(a, b"1"), Get(a)], [Get(a)]),
            Guarded([absent(b)], [Put(b, b"2")], [Get(b)]),
            Guarded([], [Put(c, b"1"), Get(a), Get(side.prefix, prefix=True)]),
        ])))
        # Every compare sees the state before the request: d is absent to the second
        # caller though the first writes it.
        await side.attempt("compares before writes", grouped(s.txn_group([
            Guarded([absent(d)], [Put(d, b"1")]),
            Guarded([absent(d)], [Get(d)], [Get(c)]),
            Guarded([empty(side.k("sub/"))], [Put(side.k("sub/1"), b"1")]),
            Guarded([empty(side.k("sub/"))], [Get(side.k("sub/"), prefix=True)]),
        ])))
        await side.attempt("all fail, only reads", grouped(s.txn_group([
            Guarded([absent(a)], [Put(a, b"x")], [Get(a)]),
            Guarded([absent(b)], [Put(b, b"x")], [Get(b)]),
        ])))
        await side.attempt("no caller", grouped(s.txn_group([])))
        await side.attempt("one writes, one deletes", grouped(s.txn_group([
            Guarded([present(a)], [Put(a, b"2")]), Guarded([], [Delete(c), Delete(d)])])))
        await side.attempt("everything", ranged(s.range(side.prefix)))

    conform(etcd.endpoint, prefix, scenario)


# -- etcd's limits -----------------------------------------------------------------------

def _largest(size: Callable[[int], int], limit: int) -> int:
    """The largest ``n`` whose request (of ``size(n)`` bytes) is at most ``limit``."""
    n = limit - size(0) - 16
    while size(n + 1) <= limit:
        n += 1
    assert size(n) <= limit < size(n + 1)
    return n


def _request_size(compares: Sequence[Compare], ops: Sequence[TxnOp],
                  group: Sequence[Guarded] = ()) -> int:
    """Bytes of the request ``Etcd`` sends (``txn``, or ``txn_group`` of ``group``)."""
    if not group:
        return _txn_pb(compares, ops, []).ByteSize()
    request = rpc.TxnRequest()
    for g in group:
        g._fill(request.success.add().request_txn)
    return request.ByteSize()


async def _id_bytes(store: Store) -> int:
    """Bytes of the ids etcd gives requests on their way through raft (a varint whose
    top 16 bits are the member id's lowest): they count towards the 1.5 MiB a write
    may take."""
    (member,) = await store.member_statuses()
    return -(-(48 + (member.id & 0xFFFF).bit_length()) // 7)


def _raft_size(size: int, id_bytes: int) -> int:
    """Bytes of the raft entry of a request of ``size`` bytes (etcd's limit is on it):
    the request, its tag and length, a header holding the request's id."""
    return size + 1 + len(_varint(size)) + 2 + 1 + 1 + id_bytes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_limits_refuse_the_same_requests(etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s = side.store

        def puts(n: int, tag: str = "") -> list[TxnOp]:
            return [Put(side.k(f"o/{tag}{i}"), b"v") for i in range(n)]

        gets = [Get(side.k(f"o/{i}")) for i in range(129)]
        compares = [absent(side.k(f"c/{i}")) for i in range(129)]
        await side.attempt("128 puts", s.txn([], puts(128)))
        await side.attempt("129 puts", s.txn([], puts(129)))
        await side.attempt("129 gets", s.txn([], gets))
        await side.attempt("129 compares", s.txn(compares, []))
        await side.attempt("128 of each", s.txn(compares[:128], puts(128), gets[:128]))
        for callers, each in ((64, 64), (64, 65), (100, 28), (100, 29), (127, 1), (128, 1),
                              (1, 127), (1, 128)):
            group = [Guarded([], puts(each, f"{i}/")) for i in range(callers)]
            await side.attempt(f"{callers} callers of {each} puts", grouped(s.txn_group(group)))
        await side.attempt("64 callers of 65 compares", grouped(s.txn_group(
            [Guarded(compares[:65], []) for _ in range(64)])))
        await side.attempt("a caller with nothing", grouped(s.txn_group([Guarded([], [])])))
        for what, call in (("put", s.txn([], [Put(b"", b"v")])),
                           ("delete", s.txn([], [Delete(b"")])),
                           ("compare", s.txn([absent(b"")], [])),
                           ("get in a txn", s.txn([], [Get(b"")])),
                           ("get", s.get(b"")), ("range", s.range(b""))):
            await side.attempt(f"no key: {what}", call)

        P, D, k = Put, Delete, side.k("dup")
        duplicates: dict[str, Sequence[TxnOp]] = {
            "put, put": [P(k, b"1"), P(k, b"2")],
            "put, delete": [P(k, b"1"), D(k)],
            "delete, put": [D(k), P(k, b"1")],
            "delete, delete": [D(k), D(k)],
            "get, put": [Get(k), P(k, b"1")],
        }
        for name, ops in duplicates.items():
            await side.attempt(f"one branch: {name}", s.txn([], ops))
        nested = {
            "put | put": [Guarded([], [P(k, b"1")]), Guarded([], [P(k, b"2")])],
            "put | delete": [Guarded([], [P(k, b"1")]), Guarded([], [D(k)])],
            "delete | put": [Guarded([], [D(k)]), Guarded([], [P(k, b"1")])],
            "delete | delete": [Guarded([], [D(k)]), Guarded([], [D(k)])],
            "put, else put": [Guarded([], [P(k, b"1")], [P(k, b"2")])],
            "else put | put": [Guarded([], [], [P(k, b"1")]), Guarded([], [P(k, b"2")])],
            "put | else put": [Guarded([], [P(k, b"1")]), Guarded([], [], [P(k, b"2")])],
            "put and delete": [Guarded([], [P(k, b"1"), D(k)])],
            "delete, else put": [Guarded([], [D(k)], [P(k, b"1")])],
            "put, else delete": [Guarded([], [P(k, b"1")], [D(k)])],
        }
        for name, group in nested.items():
            await side.attempt(f"nested: {name}", grouped(s.txn_group(group)))

        # The largest write: 1.5 MiB as a raft entry, which holds the request's id
        # (9 or 10 bytes, with the member id: etcd takes 1 byte more on one member than
        # on another). Its key is beside the prefix: the values differ as the ids do.
        big, id_bytes = side.prefix.rstrip(b"/") + b"-big", await _id_bytes(s)
        raft_limit = 1024 * 1024 * 3 // 2
        n = _largest(lambda n: _raft_size(_request_size([], [Put(big, b"v" * n)]), id_bytes),
                     raft_limit)
        await side.attempt("the largest write", s.txn([], [Put(big, b"v" * n)]))
        await side.attempt("a byte more", s.txn([], [Put(big, b"v" * (n + 1))]))
        n = _largest(lambda n: _raft_size(_request_size(
            [], [], [Guarded([], [Put(big, b"v" * n)])]), id_bytes), raft_limit)
        await side.attempt("the largest write in a group", grouped(s.txn_group(
            [Guarded([], [Put(big, b"v" * n)])])))
        await side.attempt("a byte more in a group", grouped(s.txn_group(
            [Guarded([], [Put(big, b"v" * (n + 1))])])))
        # gRPC takes 512 KiB more of etcd's clients: for reads, which raft does not see.
        n = _largest(lambda n: _request_size([Compare(big, "value", "==", b"v" * n)],
                                             [Get(big)]), 2 * 1024 * 1024)
        await side.attempt("a read as large as gRPC takes", s.txn(
            [Compare(big, "value", "==", b"v" * n)], [Get(big)]))
        await side.attempt("a byte more than gRPC takes", s.txn(
            [Compare(big, "value", "==", b"v" * (n + 1))], [Get(big)]))
        await side.attempt("a write over gRPC's limit", s.txn(
            [], [Put(big, b"v" * (2 * 1024 * 1024))]))
        await s.txn([], [Delete(big)])

    conform(etcd.endpoint, prefix, scenario)


# -- reading -------------------------------------------------------------------------------

def test_ranges_pages_counts_and_older_revisions(etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s, p = side.store, side.prefix
        keys = [side.k(f"k{i:02}") for i in range(12)]
        await s.txn([], [Put(k, b"first") for k in keys])
        old = (await s.range(p, limit=1))[1]
        await s.txn([], [Put(keys[3], b"second"), Put(keys[7], b"second")])
        since = (await s.txn([], [Put(keys[9], b"third")])).revision
        await s.txn([], [Delete(keys[0]), Delete(keys[5])])
        await s.txn([], [Put(side.k("other/1"), b"x")])
        for label, kwargs in (
                ("all", {}), ("limit 5", {"limit": 5}), ("limit 11", {"limit": 11}),
                ("limit 12", {"limit": 12}),
                ("from k04", {"start": keys[4], "limit": 3}),
                ("k02 to k06", {"start": keys[2], "end": keys[6]}),
                ("to k06, limit 2", {"end": keys[6], "limit": 2}),
                ("keys only", {"keys_only": True, "limit": 4}),
                ("written since", {"min_mod_revision": since - 1}),
                ("written since, limit 1", {"min_mod_revision": since - 1, "limit": 1}),
                ("written since, limit 3", {"min_mod_revision": since - 1, "limit": 3}),
                ("at an older revision", {"revision": old}),
                ("older, limit 4 from k03", {"revision": old, "limit": 4, "start": keys[3]}),
                ("older, written since", {"revision": old, "min_mod_revision": since - 1})):
            kvs, rev, more = await s.range(p, **kwargs)
            side.note(label, (kvs, Rev(rev), more))
        await side.attempt("a future revision", ranged(s.range(p, revision=old + 10**9)))
        side.note("scan", [kv async for kv in s.scan(p, page=5)])
        side.note("scan at an older revision, keys only",
                  [kv async for kv in s.scan(p, page=4, revision=old, keys_only=True)])
        side.note("scan k03 to k08", [kv async for kv in s.scan(p, page=2, start=keys[3],
                                                                 end=keys[8])])
        await side.attempt("count", s.count(p))
        await side.attempt("count of nothing", s.count(side.k("nothing/")))
        await side.attempt("counts", s.counts([p, side.k("k0"), side.k("other/"),
                                               side.k("nothing/")]))
        await side.attempt("a single key's range", ranged(s.range(keys[1], end=keys[1] + b"\0")))

    conform(etcd.endpoint, prefix, scenario)


# -- leases ----------------------------------------------------------------------------------

def test_leases(etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s, a, b, c = side.store, side.k("a"), side.k("b"), side.k("c")

        async def grant(label: str, ttl: int) -> int:
            lease_id, granted = await s.grant(ttl)
            side.note(label, (Lease(lease_id), granted))
            return lease_id

        async def times(label: str, lease_id: int) -> None:
            left, granted = await s.lease_times(lease_id)
            # Seconds left are whole seconds, rounded down: just granted, one less.
            side.note(label, (left if left <= 0 else granted - left <= 1, granted))

        short = await grant("grant 1 s: etcd's least", 1)
        await grant("grant 0", 0)
        await grant("grant -5", -5)
        one = await grant("grant 30", 30)
        two = await grant("grant 60", 60)
        await side.attempt("grant too long", s.grant(10**10))
        await side.attempt("put a, b on one", s.txn([], [Put(a, b"1", one), Put(b, b"1", one)]))
        await side.attempt("put c on two", s.txn([], [Put(c, b"1", two)]))
        # etcd gives a lease's keys in no order (a map's).
        side.note("keys of one", sorted((await s.lease_keys(one))[1]))
        await side.attempt("b put without a lease", s.txn([], [Put(b, b"2")]))
        await side.attempt("a moves to two", s.txn([], [Put(a, b"2", two)]))
        side.note("keys of one now", sorted((await s.lease_keys(one))[1]))
        side.note("keys of two", sorted((await s.lease_keys(two))[1]))
        await side.attempt("keepalive", s.keepalive(one))
        await times("times", one)
        await times("times of a short one", short)
        left = await s.time_to_live(two)
        side.note("time to live", 60 - left <= 1)
        await side.attempt("revoke two (a and c go, in one revision)", s.revoke(two))
        await side.attempt("keepalive of a revoked lease", s.keepalive(two))
        await side.attempt("its time to live", s.time_to_live(two))
        await times("its times", two)
        await side.attempt("its keys", s.lease_keys(two))
        await side.attempt("revoke it again", s.revoke(two))
        await side.attempt("revoke a lease with no key", s.revoke(one))
        await side.attempt("put on a revoked lease", s.txn([], [Put(a, b"3", two)]))
        await side.attempt("... in the branch that does not run",
                           s.txn([], [Get(a)], [Put(a, b"3", two)]))
        await side.attempt("... nested, in the branch that runs", grouped(s.txn_group(
            [Guarded([], [Put(a, b"3")]), Guarded([], [Put(b, b"3", two)])])))
        await side.attempt("... nested, in the branch that does not run", grouped(s.txn_group(
            [Guarded([present(c)], [Put(b, b"3", two)], [Get(c)])])))
        await side.attempt("keepalive of an unknown lease", s.keepalive(123456789))
        await side.attempt("everything", ranged(s.range(side.prefix)))

    conform(etcd.endpoint, prefix, scenario)


# -- watches -----------------------------------------------------------------------------------

def _batches(batches: list[list[WatchEvent]]) -> list[list[WatchEvent]]:
    """Batches of several prefixes of one stream in an order of their own (etcd sends
    each prefix's responses in order, the prefixes' in any order)."""
    return sorted(batches, key=lambda b: (b[0].kv.mod_revision, b[0].kv.key))


def test_watches_replay_history_as_etcd_sends_it(etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s, w = side.store, side.k("w/")
        a, b, c, v = side.k("w/a"), side.k("w/b"), side.k("w/c"), side.k("v/1")
        lease, _ = await s.grant(60)
        start = (await s.txn([], [Put(a, b"1"), Put(b, b"1", lease)])).revision
        await s.txn([], [Put(a, b"2")])
        middle = (await s.txn([], [Delete(a), Put(c, b"1", lease), Put(v, b"1")])).revision
        await s.txn([], [Put(a, b"3"), Put(side.k("w/z"), b"1", lease)])
        await s.revoke(lease)  # b, c and z deleted, in key order, at one revision
        await s.txn([], [Put(side.k("x"), b"1")])
        side.note("from the first write", await take(s.watch(w, start), 1))
        side.note("from the middle", await take(s.watch(w, middle), 1))
        heard: list[int] = []
        side.note("kept, with progress", await take(s.watch(
            w, start, keep=lambda key: key != a, progress=heard.append), 1))
        side.note("progress told", [Rev(r) for r in heard])
        side.note("two prefixes", _batches(await take(s.watch([w, side.k("v/")], start), 2)))
        side.note("deletes of one, puts of the other", _batches(await take(s.watch_many(
            [Watched(w, puts=False), Watched(side.k("v/"), deletes=False)], start), 2)))

        # Then one batch per prefix per revision, as the writes come.
        async with contextlib.aclosing(s.watch([w, side.k("v/")], start)) as live:
            history = [await anext(live) for _ in range(2)]
            await s.txn([], [Put(a, b"4"), Put(side.k("w/d"), b"1")])
            await s.txn([], [Put(a, b"5"), Put(v, b"2")])
            await s.txn([], [Delete(a)])
            batches = [await anext(live) for _ in range(4)]
        side.note("live", [_batches(history), _batches(batches)])

    conform(etcd.endpoint, prefix, scenario)


def test_a_long_history_comes_in_responses_of_1000_revisions(
        etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s = side.store
        start = (await s.txn([], [Put(side.k("w/0"), b"")])).revision
        for i in range(1, 1003):
            await s.txn([], [Put(side.k(f"w/{i % 5}"), b"%d" % i), Put(side.k(f"v/{i}"), b"")])
        batches = await take(s.watch(side.k("w/"), start), 2)
        side.note("batches", [(len(b), Rev(b[0].kv.mod_revision), Rev(b[-1].kv.mod_revision))
                              for b in batches])
        # A response whose events a filter drops entirely is not sent.
        await s.txn([], [Delete(side.k("w/1"))])
        side.note("deletes only", await take(s.watch_many(
            [Watched(side.k("w/"), puts=False)], start), 1))

    conform(etcd.endpoint, prefix, scenario)


def test_compaction(private_etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s, a, b, c = side.store, side.k("a"), side.k("b"), side.k("c")
        await s.txn([], [Put(a, b"1"), Put(b, b"1")])
        await s.txn([], [Put(a, b"2")])
        at = (await s.txn([], [Delete(b), Put(c, b"1"), Put(a, b"3")])).revision
        await s.txn([], [Put(b, b"2")])
        await side.mark()  # the following watch has caught up: compaction spares it
        await compact(s, at)
        side.note("compacted at", Rev(at))
        await side.attempt("range before it", ranged(s.range(side.prefix, revision=at - 1)))
        await side.attempt("range at it", ranged(s.range(side.prefix, revision=at)))
        await side.attempt("range now", ranged(s.range(side.prefix)))
        try:
            await take(s.watch(side.prefix, at - 1), 1)
            side.note("watch before it", "not refused")
        except BatonError as e:
            side.note("watch before it", (type(e).__name__,
                                          str(e) == f"revision {at - 1} compacted (now {at})"))
        # etcd drops the deletes of the compacted revision, and keeps its puts.
        side.note("watch from it", await take(s.watch(side.prefix, at), 1))
        await side.attempt("compact there again", compact(s, at))
        await side.attempt("compact before", compact(s, at - 1))
        await side.attempt("compact in the future", compact(s, at + 10**6))

    conform(private_etcd.endpoint, prefix, scenario, memory=progressing)


def test_a_watch_from_the_future_and_progress_notifications(
        private_etcd: EtcdProcess, prefix: str) -> None:
    async def scenario(side: Side) -> None:
        s, w = side.store, side.k("w/")
        await s.txn([], [Put(side.k("w/a"), b"1")])
        now = (await s.range(side.prefix, limit=1))[1]
        ahead = s.watch(w, now + 2)
        first = asyncio.ensure_future(anext(ahead))
        await s.txn([], [Put(side.k("w/b"), b"1")])  # now + 1: before the watch's start
        await s.txn([], [Put(side.k("w/c"), b"1")])  # now + 2
        side.note("from the future", await first)
        await ahead.aclose()

        # Progress: while nothing comes for an interval, the store's revision.
        items: list[Any] = []
        async with contextlib.aclosing(s.watch_progress(w, now)) as watch:
            async for item in watch:
                items.append(item if isinstance(item, list) else Rev(item))
                if len(items) == 2:
                    await s.txn([], [Put(side.k("elsewhere"), b"1")])
                elif len(items) == 3:
                    await s.txn([], [Put(side.k("w/d"), b"1")])
                elif len(items) == 6:
                    break
        side.note("progress", items)
        # Of two prefixes, only the one that asks is told: one notification per tick.
        ticks = []
        began = asyncio.get_running_loop().time()
        async with contextlib.aclosing(s.watch_many(
                [Watched(w), Watched(side.k("v/"), progress=False)], now + 100)) as watch:
            async for _ in watch:
                ticks.append(round((asyncio.get_running_loop().time() - began)
                                   / PROGRESS_INTERVAL))
                if len(ticks) == 2:
                    break
        side.note("only the prefix that asks", ticks)

    conform(private_etcd.endpoint, prefix, scenario, memory=progressing)


# -- random transactions -------------------------------------------------------------------------

KEYS = ("a", "b", "c", "d/1", "d/2")
VALUES = (b"", b"1", b"2")


@st.composite
def _compares(draw: st.DrawFn) -> tuple[str, str, str, Any, bool]:
    """(key, target, op, operand, over the key's range ``d/``): an operand of create or
    mod is a key's revision as read before the request, or 0."""
    key = draw(st.sampled_from(KEYS))
    target = draw(st.sampled_from(("version", "create", "mod", "value")))
    op = draw(st.sampled_from(("==", "!=", ">", "<")))
    if target == "value":
        operand: Any = draw(st.sampled_from(VALUES))
    elif target == "version":
        operand = draw(st.integers(0, 3))
    else:
        near = (-1, 0, 1) if op in "<>" else (0,)
        operand = (draw(st.sampled_from(KEYS)), draw(st.sampled_from(near)))
    return key, target, op, operand, draw(st.booleans())


_put = st.tuples(st.just("put"), st.sampled_from(KEYS), st.sampled_from(VALUES), st.booleans())
_ops = st.one_of(
    _put, _put,
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("get"), st.sampled_from(KEYS), st.booleans()),
)
_txns = st.tuples(st.lists(_compares(), max_size=3), st.lists(_ops, max_size=4),
                  st.lists(_ops, max_size=4))
_txn = st.tuples(st.just("txn"), _txns)
_group = st.tuples(st.just("group"), st.lists(_txns, max_size=3))
_requests = st.one_of(
    _txn, _txn, _txn, _group, _group,
    st.tuples(st.just("revoke"), st.just(())),
    st.tuples(st.just("grant"), st.just(())),
    st.tuples(st.just("watch"), st.integers(0, 20)),
)


def _random_scenario(requests: list[tuple[str, Any]]) -> Scenario:
    async def scenario(side: Side) -> None:
        s = side.store
        lease, _ = await s.grant(60)
        revisions = [side.baseline]

        def key(name: str) -> bytes:
            return side.k(f"r/{name}")

        async def build(spec: Any) -> tuple[list[Compare], list[TxnOp], list[TxnOp]]:
            compares, success, failure = spec
            now = {kv.key: kv for kv in (await s.range(side.k("r/")))[0]}

            def operand(value: Any, target: str) -> Any:
                if not isinstance(value, tuple):
                    return value
                kv = now.get(key(value[0]))
                if kv is None:
                    return 0
                return (kv.create_revision if target == "create" else kv.mod_revision) + value[1]

            def op(o: Any) -> TxnOp:
                if o[0] == "put":
                    return Put(key(o[1]), o[2], lease if o[3] else 0)
                if o[0] == "delete":
                    return Delete(key(o[1]))
                return Get(key(o[1]) if not o[2] else key("d/"), prefix=o[2])

            return ([Compare(key("d/") if ranged and name.startswith("d/") else key(name),
                             target, cmp_op, operand(value, target),
                             prefix_end(key("d/")) if ranged and name.startswith("d/") else b"")
                     for name, target, cmp_op, value, ranged in compares],
                    [op(o) for o in success], [op(o) for o in failure])

        for i, (kind, spec) in enumerate(requests):
            if kind == "txn":
                result = await side.attempt(f"{i} txn", s.txn(*await build(spec)))
                if isinstance(result, TxnResult):
                    revisions.append(result.revision)
            elif kind == "group":
                group = [Guarded(*await build(t)) for t in spec]
                result = await side.attempt(f"{i} group", grouped(s.txn_group(group)))
                if isinstance(result, tuple):
                    revisions.append(result[0].value)
            elif kind == "revoke":  # puts on it are refused until a new one is granted
                await side.attempt(f"{i} revoke", s.revoke(lease))
            elif kind == "grant":
                lease, _ = await s.grant(60)
            else:
                start = revisions[spec % len(revisions)] + 1
                await side.mark()  # the history followed so far is all there is
                if any(ev.kv.key.startswith(key("")) and ev.kv.mod_revision >= start
                       for ev in side.events):
                    side.note(f"{i} watch", await take(s.watch(key(""), start), 1))
        await side.attempt("the end", ranged(s.range(side.prefix)))

    return scenario


#: inputs of the random test: the same 60 at every run, unless BATON_FUZZ_EXAMPLES asks for
#: that many fresh ones (``make fuzz``'s long run)
EXAMPLES = int(os.environ.get("BATON_FUZZ_EXAMPLES", "0"))


@settings(max_examples=EXAMPLES or 60, derandomize=not EXAMPLES, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(_requests, min_size=1, max_size=12))
def test_random_transactions(etcd: EtcdProcess, requests: list[tuple[str, Any]]) -> None:
    conform(etcd.endpoint, f"/baton-test/{uuid.uuid4().hex}/", _random_scenario(requests))

