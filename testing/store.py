"""An in-memory etcd for tests: :class:`MemoryEtcd`, with the interface and behaviour of
the registry's etcd client (:class:`~baton_relay.registry.store.etcd.Etcd`).

The registry runs on it unchanged. It keeps etcd's multi-version store (one revision
per request that changes something, each key's create and mod revisions, its version,
its lease; the history of every key, so that reads at an older revision and watches
from one work until :meth:`MemoryEtcd.compact` drops it), etcd's transactions (compares
on one key or a range of keys, nested transactions whose compares all see the state
before the request, reads that see the request's earlier writes), leases that expire
on the event loop's clock, and watches with etcd's batches, filters and progress
notifications. It refuses what etcd refuses with the errors ``Etcd`` raises for it
(too many operations, a key written twice, a request too large, an unknown lease, a
revision compacted or in the future): the refusals are built as the gRPC errors etcd
sends and translated by ``Etcd``'s own translation. ``tests/integration/
test_store_conformance.py`` runs the same operations on a real etcd and on this store
and compares the results.

What it does not do: authentication, TLS, several members (one member, always up,
never leaderless), quotas (no ``StorageFull``), auto-compaction, the client's 4 MiB
limit on replies, and requests from several event loops or threads. The store belongs
to the event loop it is first used on: every method must be called on that loop, and a
lease's time is that loop's ``time()``, so a loop whose clock a test moves moves
leases and progress notifications with it (nothing here reads the wall clock, save
for the durations told to ``observe``). Its data outlives :meth:`~MemoryEtcd.close`:
a registry closed and connected again finds what it left, as with a real etcd.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import itertools
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import grpc
from sortedcontainers import SortedDict

from ..kernel.errors import BatonError, Compacted, Unavailable
from ..registry.store.etcd import (
    KV,
    READ_CHUNK,
    Compare,
    Delete,
    EtcdAuth,
    Get,
    Guarded,
    Kind,
    Member,
    Put,
    TxnOp,
    TxnResult,
    Watched,
    WatchEvent,
    _translate,
)
from ..registry.store.keys import prefix_end

__all__ = ["MAX_REQUEST_BYTES", "MAX_TXN_OPS", "MIN_LEASE_TTL", "VERSION", "MemoryEtcd"]

#: what :meth:`MemoryEtcd.status` reports by default: the etcd release the conformance
#: suite holds it to by default (the suite runs on 3.5 too); it passes the registry's
#: version check (``etcd_versions.KNOWN_BAD`` names only 3.5.0 to 3.5.4)
VERSION = "3.4.23"
#: etcd's default ``--max-txn-ops``
MAX_TXN_OPS = 128
#: etcd's default ``--max-request-bytes`` (1.5 MiB): the largest write it takes through
#: raft; gRPC refuses any request 512 KiB over it before etcd reads it
MAX_REQUEST_BYTES = 1024 * 1024 * 3 // 2
GRPC_OVERHEAD_BYTES = 512 * 1024
#: the shortest lease etcd grants with its default heartbeat and election timeout
#: (1.5 election timeouts, rounded up to whole seconds); shorter TTLs are raised to it
MIN_LEASE_TTL = 2
#: the longest TTL etcd grants
MAX_LEASE_TTL = 9_000_000_000
#: revisions of history one watch response carries at most (etcd's watchBatchMaxRevs)
WATCH_BATCH_REVISIONS = 1000
#: the member id :meth:`MemoryEtcd.member_statuses` reports: etcd's request ids start
#: with the lowest 16 bits of the member's id, and these (top bit set) make them take
#: 10 bytes, as they do on half of etcd's members (the other half's take 9)
MEMBER_ID = 0xC0DE
#: the bytes etcd adds around a write to make it a raft entry, besides the write's own
#: tag and length: a header field (2 bytes of tag, 1 of length) holding the request's
#: id (1 byte of tag, a 10-byte varint with ``MEMBER_ID``). Measured at the limit on
#: etcd 3.4 and 3.5: a member with 9-byte request ids takes writes 1 byte larger.
_RAFT_HEADER_BYTES = 2 + 1 + 1 + 10

# etcd's own words for what it refuses (the details of its gRPC errors)
_TOO_MANY_OPS = "etcdserver: too many operations in txn request"
_DUPLICATE_KEY = "etcdserver: duplicate key given in txn request"
_NO_KEY = "etcdserver: key is not provided"
_EMPTY_OP = "etcdserver: key not found"
_TOO_LARGE = "etcdserver: request is too large"
_LEASE_NOT_FOUND = "etcdserver: requested lease not found"
_TTL_TOO_LARGE = "etcdserver: too large lease TTL"
_COMPACTED = "etcdserver: mvcc: required revision has been compacted"
_FUTURE = "etcdserver: mvcc: required revision is a future revision"

#: a transaction's operation, a nested transaction (``Guarded``) included
_Op = Put | Delete | Get | Guarded


def _refused(code: grpc.StatusCode, details: str) -> BatonError:
    """What ``Etcd`` raises when etcd answers ``code`` with ``details``: the gRPC error
    itself, translated by ``Etcd``'s translation (raise it ``from`` its ``__cause__``)."""
    cause = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)
    error = _translate(cause)
    error.__cause__ = cause
    return error


def _ignore(kind: Kind, seconds: float, ok: bool) -> None:
    pass


# -- key ranges ------------------------------------------------------------------------

def _bounds(key: bytes, range_end: bytes) -> tuple[bytes, bytes | None, bool]:
    """etcd's range of ``key``, ``range_end``: (first key, the key past the last or None
    for no end, whether it is ``key`` alone)."""
    if not range_end:
        return key, key, True
    return key, None if range_end == b"\0" else range_end, False


def _within(key: bytes, lo: bytes, hi: bytes | None, single: bool) -> bool:
    if single:
        return key == lo
    return lo <= key and (hi is None or key < hi)


def _irange(keys: SortedDict, lo: bytes, hi: bytes | None, single: bool) -> Iterator[bytes]:
    """The keys of a ``SortedDict`` in a range from :func:`_bounds`, in order."""
    if single:
        return iter([lo] if lo in keys else [])
    return cast(Iterator[bytes], keys.irange(lo, hi, inclusive=(True, False)))


# -- sizes of requests as protobuf encodes them ----------------------------------------

def _varint(n: int) -> int:
    """Bytes of ``n`` as a protobuf varint (a negative int64 takes ten)."""
    if n < 0:
        return 10
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _field(length: int, tag: int = 1) -> int:
    """Bytes of a length-delimited field whose content is ``length`` bytes."""
    return tag + _varint(length) + length


def _bytes(data: bytes) -> int:
    """Bytes of a ``bytes`` field of a small field number (omitted when empty)."""
    return _field(len(data)) if data else 0


def _int(n: int) -> int:
    """Bytes of an integer field of a small field number (omitted when 0)."""
    return 1 + _varint(n) if n else 0


_RESULT_CODES = {"==": 0, ">": 1, "<": 2, "!=": 3}
_TARGET_CODES = {"version": 0, "create": 1, "mod": 2, "value": 3}


def _compare_size(c: Compare) -> int:
    size = (2 if _RESULT_CODES[c.op] else 0) + (2 if _TARGET_CODES[c.target] else 0)
    size += _bytes(c.key)
    # The operand is a member of a oneof: sent even when it is 0 or empty.
    size += _field(len(c.operand)) if isinstance(c.operand, bytes) else 1 + _varint(c.operand)
    if c.range_end:
        size += _field(len(c.range_end), tag=2)  # field 64: a two-byte tag
    return size


def _op_size(op: _Op) -> int:
    """Bytes of a ``RequestOp`` holding ``op``."""
    if isinstance(op, Put):
        inner = _bytes(op.key) + _bytes(op.value) + _int(op.lease)
    elif isinstance(op, Delete):
        inner = _bytes(op.key)
    elif isinstance(op, Get):
        inner = _bytes(op.key) + (_bytes(prefix_end(op.key)) if op.prefix else 0)
        inner += _int(op.limit) + (2 if op.keys_only else 0)
    elif not (op.compares or op.success or op.failure):
        return 0  # an empty nested transaction leaves the operation empty
    else:
        inner = _txn_size(op.compares, op.success, op.failure)
    return _field(inner)


def _txn_size(compares: Sequence[Compare], success: Sequence[_Op],
              failure: Sequence[_Op]) -> int:
    """Bytes of the ``TxnRequest`` ``Etcd`` sends for this transaction."""
    return (sum(_field(_compare_size(c)) for c in compares)
            + sum(_field(_op_size(op)) for op in success)
            + sum(_field(_op_size(op)) for op in failure))


def _writes(ops: Iterable[_Op]) -> bool:
    """Whether a branch (or a transaction nested in it) has a put or a delete: etcd
    sends such a transaction through raft, and a read-only one around it."""
    return any(isinstance(op, Put | Delete)
               or (isinstance(op, Guarded) and (_writes(op.success) or _writes(op.failure)))
               for op in ops)


# -- what etcd checks before it runs a transaction ---------------------------------------

def _check_ops(compares: Sequence[Compare], success: Sequence[_Op], failure: Sequence[_Op],
               budget: int) -> None:
    """etcd's ``checkTxnReq``: no list of a transaction longer than ``budget``, what is
    left of it for the transactions nested in it; every key given."""
    count = max(len(compares), len(success), len(failure))
    if count > budget:
        raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _TOO_MANY_OPS)
    if any(not c.key for c in compares):
        raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _NO_KEY)
    for op in (*success, *failure):
        if not isinstance(op, Guarded):
            if not op.key:
                raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _NO_KEY)
        elif not (op.compares or op.success or op.failure):
            raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _EMPTY_OP)
        else:
            _check_ops(op.compares, op.success, op.failure, budget - count)


def _check_keys(ops: Sequence[_Op]) -> tuple[set[bytes], set[bytes]]:
    """etcd's ``checkIntervals``: refuse a key put twice, or put and deleted, in one
    branch and the transactions nested in it; the keys put and deleted there.

    As etcd does it, to the letter: both branches of one nested transaction may put a
    key (only one runs), two deletes of a key pass, and a nested transaction's put
    is checked against the deletes of the transactions before it, not after it.
    """
    deletes = {op.key for op in ops if isinstance(op, Delete)}
    puts: set[bytes] = set()
    for op in ops:
        if not isinstance(op, Guarded):
            continue
        puts_then, deletes_then = _check_keys(op.success)
        puts_else, deletes_else = _check_keys(op.failure)
        for key in puts_then:
            if key in puts or key in deletes:
                raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _DUPLICATE_KEY)
            puts.add(key)
        for key in puts_else:
            if (key in puts and key not in puts_then) or key in deletes:
                raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _DUPLICATE_KEY)
            puts.add(key)
        deletes |= deletes_then | deletes_else
    for op in ops:
        if isinstance(op, Put):
            if op.key in puts or op.key in deletes:
                raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _DUPLICATE_KEY)
            puts.add(op.key)
    return puts, deletes


def _compare(op: str, actual: int | bytes, operand: int | bytes) -> bool:
    if op == "==":
        return actual == operand
    if op == "!=":
        return actual != operand
    if type(actual) is not type(operand):
        raise TypeError(f"cannot compare {actual!r} with {operand!r}")
    if op == ">":
        return actual > operand  # type: ignore[operator]
    return actual < operand  # type: ignore[operator]


def _target(kv: KV, target: str) -> int | bytes:
    if target == "version":
        return kv.version
    if target == "create":
        return kv.create_revision
    if target == "mod":
        return kv.mod_revision
    return kv.value


# -- the parts of the store ----------------------------------------------------------------

@dataclass(eq=False)
class _Branch:
    """The branch one transaction of a request takes, decided before anything is written."""

    succeeded: bool
    ops: Sequence[_Op]
    #: the branches of the transactions nested in ``ops``, in order
    nested: list[_Branch]
    #: what its reads found, one list per ``Get`` (filled as it runs)
    gets: list[list[KV]] = field(default_factory=list)

    def walk(self) -> Iterator[_Branch]:
        yield self
        for branch in self.nested:
            yield from branch.walk()


@dataclass(eq=False)
class _Lease:
    id: int
    #: the TTL granted, which each refresh gives it again
    ttl: int
    #: when it ends, on the loop's clock
    deadline: float
    keys: set[bytes] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


@dataclass(frozen=True, slots=True)
class _Events:
    """A watch response with events; ``revision`` is its header's."""

    events: list[WatchEvent]
    revision: int


@dataclass(frozen=True, slots=True)
class _Progress:
    """A progress notification: the watch has come to ``revision``."""

    revision: int


class _Closed:
    """The store was closed under the watch."""


_CLOSED = _Closed()
_Response = _Events | _Progress | _Closed


@dataclass(eq=False)
class _Watcher:
    """One prefix of a watch stream (one etcd watcher)."""

    watched: Watched
    #: the first revision it wants
    start: int
    #: whether it asked for progress notifications
    notify: bool
    #: no events sent since the last tick of the stream (etcd then sends progress)
    idle: bool = True

    def __post_init__(self) -> None:
        self.lo, self.hi, self.single = _bounds(self.watched.prefix,
                                                prefix_end(self.watched.prefix))

    def select(self, events: Iterable[WatchEvent]) -> list[WatchEvent]:
        """The events this watcher is sent: under its prefix, from its start, of the
        kinds it asked for."""
        w = self.watched
        return [ev for ev in events
                if ev.kv.mod_revision >= self.start
                and _within(ev.kv.key, self.lo, self.hi, self.single)
                and (w.puts if ev.kind == "put" else w.deletes)]


@dataclass(eq=False)
class _Stream:
    """One watch (one gRPC stream of ``Etcd``): its watchers and their responses."""

    watchers: list[_Watcher]
    responses: asyncio.Queue[_Response] = field(default_factory=asyncio.Queue)
    ticker: asyncio.TimerHandle | None = None

    def send(self, watcher: _Watcher, events: list[WatchEvent], revision: int) -> None:
        if events:
            self.responses.put_nowait(_Events(events, revision))
            watcher.idle = False


class MemoryEtcd:
    """An etcd of one member in memory, with the public interface of ``Etcd``.

    ``progress_interval``: seconds of the loop's clock between the progress
    notifications of an idle watch (etcd's ``--experimental-watch-progress-notify-
    interval``). ``max_txn_ops``, ``max_request_bytes`` and ``min_lease_ttl`` are etcd's
    limits (defaults as etcd's); ``version`` is what :meth:`status` reports.
    """

    def __init__(self, endpoint: str = "memory", *, progress_interval: float = 1.0,
                 version: str = VERSION, max_txn_ops: int = MAX_TXN_OPS,
                 max_request_bytes: int = MAX_REQUEST_BYTES,
                 min_lease_ttl: int = MIN_LEASE_TTL) -> None:
        if progress_interval <= 0:
            raise ValueError(f"progress_interval must be positive, not {progress_interval}")
        self.endpoint = endpoint
        #: no network members
        self.members: list[tuple[str, int]] = []
        self.auth = EtcdAuth()
        #: never set: the store has no quota (kept for the interface)
        self.full_at = -math.inf
        #: told the kind, duration and success of every request, as by ``Etcd``
        self.observe: Callable[[Kind, float, bool], None] = _ignore
        #: as ``Etcd.wrote``: the highest revision a transaction through this store
        #: produced that changed a key ``tracks`` accepts (0: none yet)
        self.wrote = 0
        #: as ``Etcd.tracks``: which written keys count for ``wrote`` (None: none)
        self.tracks: Callable[[bytes], bool] | None = None
        self.progress_interval = progress_interval
        self.version = version
        self.max_txn_ops = max_txn_ops
        self.max_request_bytes = max_request_bytes
        self.min_lease_ttl = min_lease_ttl
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected = False
        #: the revision of the last change (etcd starts at 1, with nothing in it)
        self._revision = 1
        #: the revision compacted at (0: none); history before it is gone
        self._compacted = 0
        #: key -> its value now (live keys only)
        self._live: SortedDict = SortedDict()
        #: key -> its changes still in history, oldest first: (revision, the value then,
        #: or None for a delete); a key changed twice at one revision has two entries
        self._history: SortedDict = SortedDict()
        #: every change still in history: (revision, its events in the request's order)
        self._log: list[tuple[int, list[WatchEvent]]] = []
        self._leases: dict[int, _Lease] = {}
        #: (deadline, lease id) of every lease's deadline as set (stale ones skipped)
        self._deadlines: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        self._streams: set[_Stream] = set()

    # -- the loop, connecting, requests ----------------------------------------------

    def _bind(self) -> asyncio.AbstractEventLoop:
        """The loop the store belongs to: the running one, the first time."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("MemoryEtcd is used on one event loop only: it was first "
                               "used on another")
        return loop

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _check_connected(self) -> None:
        if not self._connected:
            raise Unavailable(f"not connected to etcd at {self.endpoint} (call connect())")

    @contextlib.asynccontextmanager
    async def _request(self, kind: Kind) -> AsyncIterator[None]:
        """One request of ``kind``: it yields to the loop once, as a call over the
        network does, then runs at once; its time and success are told to ``observe``."""
        start, ok = time.perf_counter(), False
        try:
            self._bind()
            await asyncio.sleep(0)
            self._check_connected()
            self._expire_due()
            yield
            ok = True
        finally:
            self.observe(kind, time.perf_counter() - start, ok)

    async def connect(self) -> None:
        """Bind the store to the running loop (if it is not yet) and take requests."""
        self._bind()
        self._connected = True

    async def close(self) -> None:
        """Take no more requests until :meth:`connect`; every open watch ends with
        ``Unavailable``. What the store holds is kept, and its leases run on."""
        self._connected = False
        for stream in list(self._streams):
            stream.responses.put_nowait(_CLOSED)

    async def status(self) -> str:
        """The version the store reports (``version``)."""
        async with self._request("status"):
            return self.version

    async def member_statuses(self) -> list[Member]:
        """The one member, running ``version``."""
        async with self._request("status"):
            return [Member(MEMBER_ID, "memory", (f"memory://{self.endpoint}",), self.version)]

    # -- debugging aids ------------------------------------------------------------------

    @property
    def revision(self) -> int:
        """The store's current revision."""
        return self._revision

    def snapshot(self, prefix: bytes = b"") -> dict[bytes, KV]:
        """Every key under ``prefix`` now, in order (no request: nothing observed)."""
        if self._loop is not None:
            self._expire_due()
        lo, hi, single = _bounds(prefix, prefix_end(prefix))
        return {k: self._live[k] for k in _irange(self._live, lo, hi, single)}

    # -- reading -------------------------------------------------------------------------

    def _kvs(self, key: bytes, range_end: bytes, revision: int = 0) -> Iterator[KV]:
        """The keys of a range as they are now, or as they were at ``revision``."""
        lo, hi, single = _bounds(key, range_end)
        if not revision or revision == self._revision:
            for k in _irange(self._live, lo, hi, single):
                yield cast(KV, self._live[k])
            return
        for k in _irange(self._history, lo, hi, single):
            changes: list[tuple[int, KV | None]] = self._history[k]
            at = bisect.bisect_right(changes, revision, key=lambda c: c[0]) - 1
            if at >= 0 and (kv := changes[at][1]) is not None:
                yield kv

    def _check_revision(self, revision: int) -> None:
        if revision > self._revision:
            raise _refused(grpc.StatusCode.OUT_OF_RANGE, _FUTURE)
        if 0 < revision < self._compacted:
            raise _refused(grpc.StatusCode.OUT_OF_RANGE, _COMPACTED)

    async def get(self, key: bytes) -> KV | None:
        async with self._request("range"):
            if not key:
                raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _NO_KEY)
            return cast(KV | None, self._live.get(key))

    async def range(
        self,
        prefix: bytes,
        *,
        start: bytes | None = None,
        limit: int = 0,
        keys_only: bool = False,
        revision: int = 0,
        end: bytes = b"",
        min_mod_revision: int = 0,
    ) -> tuple[list[KV], int, bool]:
        """As ``Etcd.range``: keys under ``prefix`` from ``start``, before ``end``; at
        ``revision`` (0: now); only those written at or after ``min_mod_revision``.
        Returns (kvs, the store's revision now, whether more keys follow); as etcd's,
        the revision is the current one even for a read at an older revision."""
        async with self._request("range"):
            key = start or prefix
            if not key:
                raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _NO_KEY)
            self._check_revision(revision)
            kvs: Iterable[KV] = self._kvs(key, end or prefix_end(prefix), revision)
            if min_mod_revision:
                kvs = (kv for kv in kvs if kv.mod_revision >= min_mod_revision)
            found = list(itertools.islice(kvs, limit + 1) if limit else kvs)
            more = bool(limit) and len(found) > limit
            if more:
                found = found[:limit]
            if keys_only:
                found = [KV(kv.key, b"", kv.create_revision, kv.mod_revision, kv.version,
                            kv.lease) for kv in found]
            return found, self._revision, more

    def _count(self, prefix: bytes) -> int:
        if not prefix:
            raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _NO_KEY)
        lo, hi, _ = _bounds(prefix, prefix_end(prefix))
        first = self._live.bisect_left(lo)
        last = len(self._live) if hi is None else self._live.bisect_left(hi)
        return max(0, cast(int, last) - cast(int, first))

    async def count(self, prefix: bytes) -> int:
        async with self._request("range"):
            return self._count(prefix)

    async def counts(self, prefixes: Sequence[bytes]) -> list[int]:
        """How many keys are under each prefix, at one revision (one request)."""
        async with self._request("txn"):
            if len(prefixes) > self.max_txn_ops:
                raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _TOO_MANY_OPS)
            return [self._count(p) for p in prefixes]

    async def scan(
        self,
        prefix: bytes,
        *,
        page: int = 1000,
        keys_only: bool = False,
        revision: int = 0,
        start: bytes | None = None,
        end: bytes = b"",
    ) -> AsyncGenerator[KV, None]:
        """As ``Etcd.scan``: every key under ``prefix``, ``page`` per request, all at
        one revision."""
        while True:
            kvs, rev, more = await self.range(prefix, start=start, limit=page,
                                              keys_only=keys_only, revision=revision, end=end)
            revision = revision or rev
            for kv in kvs:
                yield kv
            if not more or not kvs:
                return
            start = kvs[-1].key + b"\0"

    async def read(self, gets: Sequence[Get]) -> list[list[KV]]:
        """Several reads in one request, all at the same revision."""
        return (await self.txn([], gets)).gets

    async def get_chunks(
        self, keys: Sequence[bytes]
    ) -> AsyncGenerator[tuple[int, list[tuple[bytes, KV | None]]], None]:
        """As ``Etcd.get_chunks``: ``READ_CHUNK`` keys per request."""
        for i in range(0, len(keys), READ_CHUNK):
            chunk = keys[i:i + READ_CHUNK]
            result = await self.txn([], [Get(k) for k in chunk])
            yield result.revision, [(k, kvs[0] if kvs else None)
                                    for k, kvs in zip(chunk, result.gets, strict=True)]

    # -- transactions ----------------------------------------------------------------------

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
    ) -> TxnResult:
        async with self._request("txn"):
            revision, branch = self._run(compares, success, failure)
        self._note(branch.ops, revision)
        return TxnResult(branch.succeeded, revision, branch.gets)

    async def txn_group(self, group: Sequence[Guarded]) -> tuple[int, list[TxnResult]]:
        """Several callers' transactions in one request (one revision): each with its
        own compares, all evaluated before anything is written."""
        async with self._request("txn"):
            revision, branch = self._run((), group, ())
        for g, nested in zip(group, branch.nested, strict=True):
            self._note(g.success if nested.succeeded else g.failure, revision)
        return revision, [TxnResult(b.succeeded, revision, b.gets) for b in branch.nested]

    def _note(self, ops: Sequence[_Op], revision: int) -> None:
        """As ``Etcd._note``: record ``revision`` in ``wrote`` if the branch that ran
        changed a tracked key."""
        tracks = self.tracks
        if tracks is not None and revision > self.wrote and any(
                isinstance(op, Put | Delete) and tracks(op.key) for op in ops):
            self.wrote = revision

    def _run(self, compares: Sequence[Compare], success: Sequence[_Op],
             failure: Sequence[_Op]) -> tuple[int, _Branch]:
        """Check a transaction as etcd does, in etcd's order, then run it; the revision
        of its response and the branch it took."""
        size = _txn_size(compares, success, failure)
        limit = self.max_request_bytes + GRPC_OVERHEAD_BYTES
        if size > limit:
            raise _refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"grpc: received message larger than max ({size} vs. {limit})")
        _check_ops(compares, success, failure, self.max_txn_ops)
        _check_keys(success)
        _check_keys(failure)
        if (_writes(success) or _writes(failure)) and (
                size + 1 + _varint(size) + _RAFT_HEADER_BYTES > self.max_request_bytes):
            raise _refused(grpc.StatusCode.INVALID_ARGUMENT, _TOO_LARGE)
        branch = self._decide(compares, success, failure)
        for taken in branch.walk():
            for op in taken.ops:
                if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                    raise _refused(grpc.StatusCode.NOT_FOUND, _LEASE_NOT_FOUND)
        changes: list[WatchEvent] = []
        self._apply(branch, self._revision + 1, changes)
        return self._commit(changes), branch

    def _decide(self, compares: Sequence[Compare], success: Sequence[_Op],
                failure: Sequence[_Op]) -> _Branch:
        """The branches of a transaction and of those nested in it, every compare
        evaluated on the state before the request."""
        succeeded = all(self._holds(c) for c in compares)
        ops = success if succeeded else failure
        nested = [self._decide(op.compares, op.success, op.failure)
                  for op in ops if isinstance(op, Guarded)]
        return _Branch(succeeded, ops, nested)

    def _holds(self, c: Compare) -> bool:
        """etcd's ``applyCompare``: every key of the range satisfies it; a range with no
        key compares as one key with every number 0, and never on its value."""
        kvs = list(self._kvs(c.key, c.range_end))
        if not kvs:
            return c.target != "value" and _compare(c.op, 0, c.operand)
        return all(_compare(c.op, _target(kv, c.target), c.operand) for kv in kvs)

    def _apply(self, branch: _Branch, revision: int, changes: list[WatchEvent]) -> None:
        """Run a branch's operations in order (reads see the writes before them), its
        changes at ``revision``."""
        nested = iter(branch.nested)
        for op in branch.ops:
            if isinstance(op, Put):
                self._put(op.key, op.value, op.lease, revision, changes)
            elif isinstance(op, Delete):
                self._delete(op.key, revision, changes)
            elif isinstance(op, Get):
                end = prefix_end(op.key) if op.prefix else b""
                kvs = self._kvs(op.key, end)
                found = list(itertools.islice(kvs, op.limit) if op.limit else kvs)
                if op.keys_only:
                    found = [KV(kv.key, b"", kv.create_revision, kv.mod_revision, kv.version,
                                kv.lease) for kv in found]
                branch.gets.append(found)
            else:
                self._apply(next(nested), revision, changes)

    def _put(self, key: bytes, value: bytes, lease: int, revision: int,
             changes: list[WatchEvent]) -> None:
        old: KV | None = self._live.get(key)
        if old is not None:
            kv = KV(key, value, old.create_revision, revision, old.version + 1, lease)
            self._detach(old)
        else:
            kv = KV(key, value, revision, revision, 1, lease)
        if lease:
            self._leases[lease].keys.add(key)
        self._live[key] = kv
        self._history.setdefault(key, []).append((revision, kv))
        changes.append(WatchEvent("put", kv))

    def _delete(self, key: bytes, revision: int, changes: list[WatchEvent]) -> None:
        old: KV | None = self._live.pop(key, None)
        if old is None:
            return  # deleting what is not there changes nothing
        self._detach(old)
        self._history[key].append((revision, None))
        # etcd's delete event: the key and the revision of the delete, nothing else
        changes.append(WatchEvent("delete", KV(key, b"", 0, revision, 0, 0)))

    def _detach(self, kv: KV) -> None:
        lease = self._leases.get(kv.lease) if kv.lease else None
        if lease is not None:
            lease.keys.discard(kv.key)

    def _commit(self, changes: list[WatchEvent]) -> int:
        """Close a request: with changes, the store moves to the next revision (theirs)
        and every watch is told; the revision of the response."""
        if not changes:
            return self._revision
        self._revision += 1
        self._log.append((self._revision, changes))
        for stream in list(self._streams):
            for watcher in stream.watchers:
                stream.send(watcher, watcher.select(changes), self._revision)
        return self._revision

    # -- compaction ------------------------------------------------------------------------

    def compact(self, revision: int) -> None:
        """etcd's compaction at ``revision`` (physical: done when this returns).

        History before ``revision`` is gone: a read at an older revision fails as
        etcd's does (``Internal``, "required revision has been compacted") and a watch
        from one raises ``Compacted``. As in etcd, a watch from ``revision`` itself
        still gets that revision's puts but not its deletes (etcd drops a key's
        tombstone with the key). Compacting at or below the last compaction, or past
        the current revision, raises ``Internal`` with etcd's words."""
        self._bind()
        if revision <= self._compacted:
            raise _refused(grpc.StatusCode.OUT_OF_RANGE, _COMPACTED)
        if revision > self._revision:
            raise _refused(grpc.StatusCode.OUT_OF_RANGE, _FUTURE)
        for key in list(self._history):
            changes: list[tuple[int, KV | None]] = self._history[key]
            at = bisect.bisect_right(changes, revision, key=lambda c: c[0]) - 1
            if at < 0:
                continue
            kept = changes[at:] if changes[at][1] is not None else changes[at + 1:]
            if kept:
                self._history[key] = kept
            else:
                del self._history[key]
        first = bisect.bisect_left(self._log, revision, key=lambda entry: entry[0])
        self._log = self._log[first:]
        if self._log and self._log[0][0] == revision:
            # Of the compacted revision's events, only puts that are still the key's
            # value at that revision survive (its last change then).
            events, last = self._log[0][1], {}
            for ev in events:
                last[ev.kv.key] = ev
            kept_events = [ev for ev in events if ev.kind == "put" and last[ev.kv.key] is ev]
            self._log[0] = (revision, kept_events)
            if not kept_events:
                del self._log[0]
        self._compacted = revision

    # -- leases ------------------------------------------------------------------------------

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease of ``ttl`` seconds (at least ``min_lease_ttl``): (id, TTL)."""
        async with self._request("lease"):
            if ttl > MAX_LEASE_TTL:
                raise _refused(grpc.StatusCode.OUT_OF_RANGE, _TTL_TOO_LARGE)
            ttl = max(ttl, self.min_lease_ttl)
            lease = _Lease(next(self._lease_ids), ttl, 0.0)
            self._leases[lease.id] = lease
            self._refresh(lease)
            return lease.id, ttl

    async def keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; its TTL, or 0 if it is gone."""
        async with self._request("lease"):
            lease = self._leases.get(lease_id)
            if lease is None:
                return 0
            self._refresh(lease)
            return lease.ttl

    def _left(self, lease: _Lease) -> int:
        """Whole seconds left on a lease, rounded down (as etcd counts them)."""
        return max(0, math.floor(lease.deadline - self._now()))

    async def time_to_live(self, lease_id: int) -> int:
        """Seconds left on a lease; -1 if it does not exist."""
        async with self._request("lease"):
            lease = self._leases.get(lease_id)
            return -1 if lease is None else self._left(lease)

    async def lease_times(self, lease_id: int) -> tuple[int, int]:
        """(seconds left, TTL granted); (-1, 0) if the lease does not exist."""
        async with self._request("lease"):
            lease = self._leases.get(lease_id)
            return (-1, 0) if lease is None else (self._left(lease), lease.ttl)

    async def lease_keys(self, lease_id: int) -> tuple[int, list[bytes]]:
        """Seconds left on a lease (-1 if it does not exist) and its keys (etcd gives
        them in no order; here sorted)."""
        async with self._request("lease"):
            lease = self._leases.get(lease_id)
            if lease is None:
                return -1, []
            return self._left(lease), sorted(lease.keys)

    async def revoke(self, lease_id: int) -> None:
        """End a lease now: its keys are deleted (one revision); a lease that does not
        exist is no error."""
        async with self._request("lease"):
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._end(lease)

    def hold(self, lease_id: int, until: float) -> None:
        """Keep a lease alive up to ``until`` (the loop's time), as if its holder
        refreshed it then (a test's clock moving on while the lease's holder lives);
        a lease gone or already running longer is left as it is. Called on the loop."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.deadline < until + lease.ttl:
            self._refresh(lease, since=until)

    def _refresh(self, lease: _Lease, since: float | None = None) -> None:
        """Give a lease its whole TTL again from now (or ``since``), and set its timer."""
        loop = self._loop
        assert loop is not None
        lease.deadline = (self._now() if since is None else since) + lease.ttl
        if lease.timer is not None:
            lease.timer.cancel()
        lease.timer = loop.call_at(lease.deadline, self._on_deadline, lease, lease.deadline)
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))

    def _on_deadline(self, lease: _Lease, deadline: float) -> None:
        """A lease's timer: it ends if that is still its deadline (not refreshed since)."""
        if self._leases.get(lease.id) is lease and lease.deadline == deadline:
            self._end(lease)

    def _expire_due(self) -> None:
        """End every lease whose deadline has come, its timer run or not (a request made
        in the same turn of the loop as the timer never sees the lease alive)."""
        now = self._now()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                self._end(lease)

    def _end(self, lease: _Lease) -> None:
        """Revoke a lease: its keys deleted in key order, at one revision (none if it
        holds no key)."""
        del self._leases[lease.id]
        if lease.timer is not None:
            lease.timer.cancel()
        changes: list[WatchEvent] = []
        for key in sorted(lease.keys):
            self._delete(key, self._revision + 1, changes)
        self._commit(changes)

    # -- watches -----------------------------------------------------------------------------

    async def watch(
        self,
        prefix: bytes | Sequence[bytes],
        start_revision: int,
        keep: Callable[[bytes], bool] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> AsyncIterator[list[WatchEvent]]:
        """As ``Etcd.watch``: batches of events under ``prefix`` (or several prefixes)
        from ``start_revision`` (inclusive). History comes as etcd sends it, in batches
        of up to 1000 revisions, then one batch per prefix per revision. Raises
        ``Compacted`` if that revision is gone."""
        async with contextlib.aclosing(
                self._watch(prefix, start_revision, keep, progress, notify=False)) as items:
            async for item in items:
                if isinstance(item, list):
                    yield item

    async def watch_progress(
        self, prefix: bytes, start_revision: int,
    ) -> AsyncIterator[list[WatchEvent] | int]:
        """As :meth:`watch` of one prefix, with progress notifications (an ``int``:
        the store's revision, every event under ``prefix`` up to it yielded) every
        ``progress_interval`` seconds of the loop's clock while no event came."""
        async with contextlib.aclosing(
                self._watch(prefix, start_revision, None, None, notify=True)) as items:
            async for item in items:
                yield item

    async def watch_many(
        self, watched: Sequence[Watched], start_revision: int,
        keep: Callable[[bytes], bool] | None = None,
    ) -> AsyncGenerator[list[WatchEvent] | int, None]:
        """As :meth:`watch_progress`, of several prefixes on one stream, each with the
        events and the progress notifications it asks for (:class:`Watched`)."""
        async with contextlib.aclosing(
                self._watch(watched, start_revision, keep, None, notify=True)) as items:
            async for item in items:
                yield item

    async def _watch(
        self,
        prefix: bytes | Sequence[bytes] | Sequence[Watched],
        start_revision: int,
        keep: Callable[[bytes], bool] | None,
        progress: Callable[[int], None] | None,
        notify: bool,
    ) -> AsyncGenerator[list[WatchEvent] | int, None]:
        watched = [p if isinstance(p, Watched) else Watched(p)
                   for p in ([prefix] if isinstance(prefix, bytes) else prefix)]
        # Opened in the same step as the first item is asked for: nothing written in
        # between can be missed or seen twice.
        stream = self._open(watched, start_revision, notify)
        try:
            while True:
                response = await stream.responses.get()
                if isinstance(response, _Closed):
                    raise Unavailable("etcd unavailable: the store was closed")
                if isinstance(response, _Progress):
                    yield response.revision
                    continue
                batch = [ev for ev in response.events if keep is None or keep(ev.kv.key)]
                if batch:
                    yield batch
                if progress is not None:
                    progress(response.revision)
        finally:
            self._streams.discard(stream)
            if stream.ticker is not None:
                stream.ticker.cancel()

    def _open(self, watched: list[Watched], start_revision: int, notify: bool) -> _Stream:
        """Register a watch stream and queue the history it asks for."""
        started = time.perf_counter()
        loop = self._bind()
        self._check_connected()
        self._expire_due()
        start = start_revision if start_revision > 0 else self._revision + 1
        stream = _Stream([_Watcher(w, start, notify and w.progress) for w in watched])
        self.observe("watch", time.perf_counter() - started, True)
        if start < self._compacted:
            raise Compacted(f"revision {start_revision} compacted (now {self._compacted})")
        first = bisect.bisect_left(self._log, start, key=lambda entry: entry[0])
        for watcher in stream.watchers:
            for events in self._history_batches(watcher, first):
                stream.send(watcher, watcher.select(events), self._revision)
        self._streams.add(stream)
        if any(w.notify for w in stream.watchers):
            self._tick(stream, loop.time() + self.progress_interval)
        return stream

    def _history_batches(self, watcher: _Watcher, first: int) -> Iterator[list[WatchEvent]]:
        """The watcher's events of the log from entry ``first`` on, in responses of at
        most ``WATCH_BATCH_REVISIONS`` revisions (its filters not applied yet)."""
        batch: list[WatchEvent] = []
        revisions = 0
        for _, events in itertools.islice(self._log, first, None):
            mine = [ev for ev in events
                    if _within(ev.kv.key, watcher.lo, watcher.hi, watcher.single)]
            if not mine:
                continue
            if revisions == WATCH_BATCH_REVISIONS:
                yield batch
                batch, revisions = [], 0
            batch += mine
            revisions += 1
        if batch:
            yield batch

    def _tick(self, stream: _Stream, when: float) -> None:
        """Set the stream's next progress tick at ``when``."""
        assert self._loop is not None
        stream.ticker = self._loop.call_at(when, self._on_tick, stream, when)

    def _on_tick(self, stream: _Stream, when: float) -> None:
        """etcd's progress ticker: each watcher that asked for progress notifications and
        was sent no event since the last tick is told the store's revision. (etcd tells
        only watchers that have caught up with the history; here every watcher has: its
        events are queued as they are written.)"""
        if stream not in self._streams:
            return
        for watcher in stream.watchers:
            if watcher.notify and watcher.idle:
                stream.responses.put_nowait(_Progress(self._revision))
            watcher.idle = True
        self._tick(stream, when + self.progress_interval)
