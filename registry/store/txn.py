"""The one way Baton writes to etcd: a guarded transaction whose reads become its compares.

A planner is an async function of a ``Txn``. It reads through the ``Txn``
(``get``), decides, and writes through it (``put``, ``delete``); it never
builds compare or op lists by hand. ``Transactions.run`` then commits what
it wrote guarded by what it read: every key read must still be at the
revision it was read at (or still absent). If one is not, someone moved
first: the planner runs again on fresh values, up to ``MAX_ATTEMPTS`` times.
This is the shape of etcd's ``concurrency/stm.go``.

Reads come from the replica's watch-fed ``View`` when it has the key, so the
happy path makes no read request at all; a stale view only costs a retry,
because the compares pin what was read. A planner that raises a domain
error after reading from the view is run once more on reads straight from
etcd, so the error it finally raises is never the product of a stale view —
with one exception, the commonest answer of an idle poller: "nothing to claim
(or consume)" decided on a view that was *current* when the plan began (its
watch had seen every write of this replica) is final. Another replica's write
the watch has not brought yet may then be missed, exactly as by a poll made a
moment earlier; a view that may be behind this replica's own writes still
decides again on etcd.

Commits go through the ``Committer``, which writes the transactions of
concurrent callers together as nested transactions of one etcd request
(group commit): each keeps its own compares and its own outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from google.protobuf.message import Message

from ...kernel.backoff import Backoff
from ...kernel.errors import Backpressure, BatonError, Conflict, Internal, NothingToClaim
from .etcd import (
    KV,
    READ_CHUNK,
    Compare,
    Delete,
    Etcd,
    Get,
    Guarded,
    Put,
    TxnOp,
    TxnResult,
    absent,
    unchanged,
)

if TYPE_CHECKING:
    from .view import View

log = logging.getLogger("baton.registry")

M = TypeVar("M")
R = TypeVar("R")

#: guarded attempts before a call gives up with ``Conflict``
MAX_ATTEMPTS = 32
#: etcd's default ``--max-txn-ops``: the longest list of compares along one nesting
#: path, and of operations in one branch; also the most callers one group carries
MAX_TXN_OPS = 128
#: bytes one group request may carry (etcd refuses requests over 1.5 MiB by default)
MAX_GROUP_BYTES = 1024 * 1024
#: seconds after etcd last refused a request for want of space during which every
#: transaction goes alone, so that etcd's quota sees (and refuses) its puts
ALONE_AFTER_FULL = 30.0
#: how long the outcome of a mutating call is kept for retries of that call (a client
#: retries for 30 s by default; ten minutes covers a registry restart in between)
REQUEST_TTL = 600
#: seconds of request outcomes one lease holds: a new lease every 15 s, so that an
#: expiry deletes a quarter-minute of outcomes (some 10,000 keys at 700 calls/s), never
#: millions in one apply
REQUEST_LEASE_SPAN = 15.0


class Retry(Exception):
    """Raised by a planner when what it read changed under it: plan again."""


class Replayed(Exception):
    """The call already applied: its recorded reply is ``record``."""

    def __init__(self, record: KV) -> None:
        self.record = record


class Source(Protocol):
    """Where a ``Txn`` reads from: the view (cached) or etcd itself."""

    async def get_many(self, keys: Sequence[bytes]) -> list[KV | None]: ...

    async def scan(self, prefix: bytes, limit: int, keys_only: bool) -> list[KV]: ...


class EtcdSource:
    """Reads straight from etcd. The first read of a call with a request id also
    reads the request record in the same round trip, and stops planning with
    ``Replayed`` if the call already applied."""

    def __init__(self, etcd: Etcd, request_key: bytes = b"") -> None:
        self.etcd = etcd
        self._request_key = request_key

    async def _check(self, gets: list[Get]) -> list[list[KV]]:
        check, self._request_key = self._request_key, b""
        if check:
            gets.append(Get(check))
        results = await self.etcd.read(gets)
        if check:
            record = results.pop()
            if record:
                raise Replayed(record[0])
        return results

    async def get_many(self, keys: Sequence[bytes]) -> list[KV | None]:
        out: list[KV | None] = []
        # Chunked as Etcd.get_chunks, but the first chunk carries the request check.
        for i in range(0, len(keys), READ_CHUNK):
            found = await self._check([Get(k) for k in keys[i:i + READ_CHUNK]])
            out += [kvs[0] if kvs else None for kvs in found]
        return out

    async def scan(self, prefix: bytes, limit: int, keys_only: bool) -> list[KV]:
        (kvs,) = await self._check([Get(prefix, prefix=True, limit=limit, keys_only=keys_only)])
        return kvs


class Txn:
    """One transaction being planned: what it read (its compares) and what it writes."""

    def __init__(self, source: Source, fresh: bool) -> None:
        self._source = source
        #: True when reads come straight from etcd (not from the view)
        self.fresh = fresh
        self._reads: dict[bytes, KV | None] = {}
        self._writes: dict[bytes, Put | Delete] = {}
        self._guards: list[Compare] = []
        self._hooks: list[Callable[[], None]] = []
        #: the revision the transaction applied at (0 until then; read by hooks)
        self.revision = 0
        #: keys planners of this replica should leave alone while this commits
        self.reserved: list[bytes] = []
        #: whether the view should hold what this writes (False for bulk writes)
        self.cache_writes = True
        #: planned on a current view: a "nothing to claim" from it needs no re-check
        self.settled = False

    # reading ---------------------------------------------------------------

    async def get(self, key: bytes) -> KV | None:
        """The key's value; the commit then requires it unchanged (or still absent)."""
        (kv,) = await self.get_many([key])
        return kv

    async def get_many(self, keys: Sequence[bytes]) -> list[KV | None]:
        """Several keys, those not read yet in one round trip; each is pinned as ``get``."""
        found = await self.peek_many(keys)
        for key, kv in zip(keys, found, strict=True):
            self.pin(key, kv)
        return found

    async def peek_many(self, keys: Sequence[bytes]) -> list[KV | None]:
        """Keys read without pinning them (candidates a planner may pass over)."""
        missing = [k for k in dict.fromkeys(keys) if k not in self._reads]
        fetched = dict(zip(missing, await self._source.get_many(missing), strict=True)) if (
            missing) else {}
        return [self._reads[k] if k in self._reads else fetched[k] for k in keys]

    def pin(self, key: bytes, kv: KV | None) -> None:
        """Require ``key`` to be as ``kv`` shows it when the transaction commits."""
        self._reads.setdefault(key, kv)

    async def scan(self, prefix: bytes, limit: int = 0, keys_only: bool = False) -> list[KV]:
        """Keys under ``prefix`` (an index head): not pinned; pin what the plan relies on."""
        return await self._source.scan(prefix, limit, keys_only)

    # writing ---------------------------------------------------------------

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self._writes[key] = Put(key, value, lease)

    def create(self, key: bytes, value: bytes, lease: int = 0) -> None:
        """Put a key that must not exist yet (a claim, its twin, a slot)."""
        self.pin(key, None)
        self.put(key, value, lease)

    def delete(self, key: bytes) -> None:
        self._writes[key] = Delete(key)

    def deletes(self, key: bytes) -> bool:
        """Whether this transaction deletes ``key`` (as planned so far)."""
        return isinstance(self._writes.get(key), Delete)

    def require(self, compare: Compare) -> None:
        """A condition beyond the reads (e.g. a claim key's create revision = the token)."""
        self._guards.append(compare)

    def after(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once the transaction has applied (``revision`` is then its
        revision)."""
        self._hooks.append(hook)

    # what it amounts to ----------------------------------------------------

    @property
    def writes(self) -> bool:
        return bool(self._writes)

    def compares(self) -> list[Compare]:
        out = [absent(k) if kv is None else unchanged(kv) for k, kv in self._reads.items()]
        return out + self._guards

    def ops(self) -> list[TxnOp]:
        return list(self._writes.values())

    def read_keys(self) -> list[bytes]:
        return list(self._reads) + [c.key for c in self._guards]

    def write_keys(self) -> Iterable[bytes]:
        return self._writes.keys()

    def read_state(self, key: bytes) -> tuple[bool, KV | None]:
        """Whether the key was read (pinned), and what it held then."""
        return key in self._reads, self._reads.get(key)

    def run_hooks(self) -> None:
        for hook in self._hooks:
            hook()


Planner = Callable[[Txn], Awaitable[Callable[[int], R]]]


@dataclass
class _Pending:
    txn: Txn
    compares: list[Compare]
    ops: list[TxnOp]
    refresh: list[bytes]
    done: asyncio.Future[TxnResult] = field(default_factory=lambda: (
        asyncio.get_running_loop().create_future()))

    @property
    def size(self) -> int:
        """Roughly the bytes this adds to a request."""
        return sum(len(op.key) + len(getattr(op, "value", b"")) + 16 for op in self.ops) + sum(
            len(c.key) + 16 for c in self.compares) + sum(len(k) + 8 for k in self.refresh)

    def conflicts(self, reads: set[bytes], ranges: list[tuple[bytes, bytes]],
                  writes: set[bytes]) -> bool:
        """Whether this must not share a request with callers that read ``reads`` (and
        every key in ``ranges``) and write ``writes``."""
        mine_w = {op.key for op in self.ops if not isinstance(op, Get)}
        if mine_w & (reads | writes):
            return True
        if any(lo <= k < hi for k in mine_w for lo, hi in ranges):
            return True
        for c in self.compares:
            if c.key in writes or (c.range_end and any(
                    c.key <= k < c.range_end for k in writes)):
                return True
        return False


class Committer:
    """Group commit: transactions queued while a request is in flight go out together.

    Each caller's transaction becomes one nested transaction of a single etcd
    request, with its own compares and its own outcome; its failure branch
    reads back what it relied on, so a retry starts from fresh values at no
    extra round trip. etcd evaluates every compare of a request before any
    write, so two callers of one group must not write a key the other reads
    or writes: such a caller waits for the next group. A lone transaction
    goes out at once, as a plain transaction.
    """

    def __init__(self, etcd: Etcd, in_flight: int = 2, group_max: int = 64) -> None:
        self.etcd = etcd
        self.group_max = min(group_max, MAX_TXN_OPS)
        self._queue: list[_Pending] = []
        self._slots = asyncio.Semaphore(in_flight)
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[None]] = set()
        #: requests sent and transactions carried (for metrics and tests)
        self.requests = 0
        self.carried = 0

    async def commit(self, txn: Txn, compares: list[Compare], ops: list[TxnOp],
                     refresh: list[bytes]) -> TxnResult:
        item = _Pending(txn, compares, ops, refresh)
        if not self._queue and not self._slots.locked():
            # Nothing to group with and a request slot free: send it from here, with
            # no hop through the runner (the common case with few callers).
            await self._slots.acquire()
            await self._send([item])
            return await item.done
        self._queue.append(item)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        self._wake.set()
        return await item.done

    async def close(self) -> None:
        for item in self._queue:
            if not item.done.done():
                item.done.set_exception(asyncio.CancelledError())
        self._queue = []
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._slots.acquire()
            group = self._take()
            task = asyncio.create_task(self._send(group))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    def _take(self) -> list[_Pending]:
        if time.monotonic() - self.etcd.full_at < ALONE_AFTER_FULL:
            # etcd charges a request's own puts against its quota, not those of the
            # transactions nested in it: grouped, writes would land past the quota.
            return [self._queue.pop(0)]
        group: list[_Pending] = []
        reads: set[bytes] = set()
        ranges: list[tuple[bytes, bytes]] = []
        writes: set[bytes] = set()
        rest: list[_Pending] = []
        size = 0
        for item in self._queue:
            if group and (len(group) >= self.group_max
                          or item.conflicts(reads, ranges, writes)
                          or size + item.size > MAX_GROUP_BYTES):
                rest.append(item)
                continue
            size += item.size
            group.append(item)
            reads.update(c.key for c in item.compares)
            ranges += [(c.key, c.range_end) for c in item.compares if c.range_end]
            writes.update(op.key for op in item.ops if not isinstance(op, Get))
        self._queue = rest
        return group

    async def _send(self, group: list[_Pending]) -> None:
        try:
            outcomes: list[TxnResult | BaseException]
            try:
                outcomes = list(await self._request(group))
            except Internal:
                if len(group) == 1:
                    raise
                # etcd refused the request as a whole (one caller's transaction too
                # large, say): each caller alone, so only that one gets the error.
                alone = await asyncio.gather(*(self._request([i]) for i in group),
                                             return_exceptions=True)
                outcomes = [r if isinstance(r, BaseException) else r[0] for r in alone]
            for item, outcome in zip(group, outcomes, strict=True):
                if item.done.done():
                    continue
                if isinstance(outcome, BaseException):
                    item.done.set_exception(outcome)
                else:
                    item.done.set_result(outcome)
        except BaseException as e:
            for item in group:
                if not item.done.done():
                    item.done.set_exception(e)
            if not isinstance(e, Exception):
                raise
        finally:
            self._slots.release()
            if self._queue:
                self._wake.set()

    async def _request(self, group: list[_Pending]) -> list[TxnResult]:
        self.requests += 1
        self.carried += len(group)
        if len(group) == 1:
            item = group[0]
            return [await self.etcd.txn(item.compares, item.ops,
                                        [Get(k) for k in item.refresh])]
        _, results = await self.etcd.txn_group([
            Guarded(i.compares, i.ops, [Get(k) for k in i.refresh]) for i in group])
        return results


class Transactions:
    """Runs planners until their transaction applies: the registry's only writer."""

    def __init__(
        self,
        etcd: Etcd,
        request_key: Callable[[str], bytes],
        view: View | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.etcd = etcd
        self.view = view
        self.committer = Committer(etcd)
        self._request_key = request_key
        self.sleep = sleep
        self.rng = rng or random.Random()
        #: between attempts of one transaction: up to 2 ms doubling, at most 50 ms
        self.retry_backoff = Backoff(0.002, 0.05, jitter=self.rng.uniform)
        self._request_lease = 0
        self._request_lease_until = 0.0
        self._lease_lock = asyncio.Lock()
        #: plans made again: after a failed compare, a moved candidate, or an error
        #: first seen on the view (for metrics and the log at shutdown)
        self.replans = {"compare": 0, "moved": 0, "confirm": 0}
        #: calls that gave up with ``Conflict`` (for metrics)
        self.gave_up = 0
        #: "nothing to claim" answered from a current view, with no read of etcd
        self.settled = 0

    async def _lease_for_requests(self) -> int:
        """A lease for request-outcome keys, replaced every ``REQUEST_LEASE_SPAN``."""
        clock = asyncio.get_running_loop().time  # the lease's time: the loop's (a test's)
        if clock() <= self._request_lease_until:
            return self._request_lease
        async with self._lease_lock:
            if clock() > self._request_lease_until:
                self._request_lease, ttl = await self.etcd.grant(REQUEST_TTL)
                self._request_lease_until = clock() + min(REQUEST_LEASE_SPAN,
                                                                   ttl / 2)
            return self._request_lease

    async def run(
        self,
        planner: Planner[M],
        request_id: str = "",
        replay: Callable[[bytes, int], M] | None = None,
        attempts: int = MAX_ATTEMPTS,
        fresh: bool = False,
    ) -> M:
        """Plan and commit until it applies; with a ``request_id`` the reply is
        recorded by the same transaction, and a retry of the call gets
        ``replay(record, revision)`` (the original reply) instead of applying twice.

        ``fresh``: read straight from etcd, not from the view. For planners that may
        decide there is nothing to do from values they did not pin (peeked): no
        commit then checks those values, so they must not come from a view that may
        be behind (entries changed by another replica are not watched)."""
        req_key = self._request_key(request_id) if request_id and replay else b""
        fresh = fresh or self.view is None or not self.view.ready
        for attempt in range(attempts):
            txn = self._txn(fresh, req_key)
            # Taken before planning: what the plan reads then includes every write of
            # this replica made before the call (those made during it are concurrent).
            txn.settled = not fresh and self.view is not None and self.view.current()
            try:
                reply = await planner(txn)
            except Replayed as done:
                assert replay is not None
                return replay(done.record.value, done.record.create_revision)
            except Retry:
                self._release(txn)
                self.replans["moved"] += 1
                await self._backoff(attempt)
                continue
            except BatonError as e:
                self._release(txn)
                if fresh:
                    raise
                if txn.settled and isinstance(e, NothingToClaim):
                    self.settled += 1
                    raise
                if isinstance(e, Backpressure):
                    raise  # counted on etcd itself (registry.backlog), never on the view
                self.replans["confirm"] += 1
                fresh = True  # the view may be behind: decide again on etcd's own state
                continue
            except BaseException:
                self._release(txn)
                raise
            try:
                if not txn.writes and not req_key and not txn.compares():
                    return reply(0)
                result, refresh, stored = await self._commit(txn, reply, req_key)
            finally:
                self._release(txn)
            if result.succeeded:
                if self.view is not None:
                    self.view.written(txn, result.revision)
                txn.revision = result.revision
                txn.run_hooks()
                if stored:
                    # The reply is built once: the one recorded for a retry of the call,
                    # given the commit's revision as a retry would be (no record is
                    # converted to a message twice).
                    assert replay is not None
                    return replay(stored, result.revision)
                return reply(result.revision)
            if req_key and result.gets and result.gets[-1]:
                record = result.gets[-1][0]
                assert replay is not None
                return replay(record.value, record.create_revision)
            if self.view is not None:
                self.view.refreshed(refresh, result.gets, result.revision)
            self.replans["compare"] += 1
            await self._backoff(attempt)
        self.gave_up += 1
        raise Conflict("gave up after repeated concurrent changes; retry the call")

    def peek(self) -> Txn | None:
        """A transaction to read from the view and never commit, for a decision that
        changes nothing in etcd and may rest on what this replica wrote (its own writes
        are in the view at once) but not on what other replicas wrote since (entries
        are not watched); None while the view is not serving."""
        if self.view is None or not self.view.ready:
            return None
        return Txn(self.view, fresh=False)

    def _txn(self, fresh: bool, req_key: bytes) -> Txn:
        if fresh or self.view is None:
            return Txn(EtcdSource(self.etcd, req_key), fresh=True)
        return Txn(self.view, fresh=False)

    def _release(self, txn: Txn) -> None:
        if self.view is not None and txn.reserved:
            self.view.release(txn.reserved)

    async def _commit(self, txn: Txn, reply: Callable[[int], M],
                      req_key: bytes) -> tuple[TxnResult, list[bytes], bytes]:
        """Commit ``txn`` (and the call's request record); the result, the keys its
        failure branch reads back, and the reply as recorded ("" without a request)."""
        compares, ops = txn.compares(), txn.ops()
        refresh = txn.read_keys()
        stored = b""
        if req_key:
            # The reply may name the commit revision, unknown until the
            # transaction applies: record it as of revision 0; ``replay``
            # substitutes the request key's create revision, the same one.
            record = reply(0)
            assert isinstance(record, Message), "a call with a request id replies a message"
            compares.append(absent(req_key))
            lease = await self._lease_for_requests()
            stored = record.SerializeToString()
            ops.append(Put(req_key, stored, lease=lease))
            refresh = [*refresh, req_key]
        if len(refresh) > MAX_TXN_OPS:
            refresh = refresh[-MAX_TXN_OPS:]
        return await self.committer.commit(txn, compares, ops, refresh), refresh, stored

    async def _backoff(self, attempt: int) -> None:
        if attempt:
            await self.sleep(self.retry_backoff.delay(attempt))


async def write(txns: Transactions, planner: Callable[[Txn], Awaitable[R]],
                attempts: int = MAX_ATTEMPTS, fresh: bool = False) -> R:
    """``Transactions.run`` for writers whose result is the planner's own value
    (reaper, scheduler, operators) rather than a reply naming the revision."""

    async def wrapped(txn: Txn) -> Callable[[int], R]:
        value = await planner(txn)
        return lambda _rev: value

    return await txns.run(wrapped, attempts=attempts, fresh=fresh)
