"""A replica's view of the keys the hot path reads, kept fresh by an etcd watch.

Three kinds of keys are held:

* **mirrored** — task headers, agent sessions, claim slots (watchers, shards, pools,
  drained hosts): every key, loaded
  at start and then followed by the watch, so a key missing here is absent;
* **cached** — entries and claims this replica read or wrote (a bounded LRU),
  not watched: this replica makes most of their changes and takes its own
  writes at once; one another replica changed fails its compare, and the
  failure branch brings it back fresh; a miss reads etcd;
* **windows** — the head of each task's ready index, of its retry-backoff
  (delayed) index and of each consumer group's claimable index: the first keys
  in order, refilled a page at a time when drained, so a claim never reads (or
  makes etcd count) the whole index.

The view may be behind etcd; it is never trusted blindly. A ``Txn`` that
read from it commits with compares pinning every value it used, so a stale
read costs a retry, not a wrong write, and the failure branch of that retry
brings the fresh values back (``refreshed``).

The view is **current** (``current``) when its watch has come as far as the
last revision at which a write of this replica changed a watched key
(``Etcd.wrote``): every such write is then in it. A "nothing to claim" decided
on a current view is final (``txn.Transactions.run``); writes of other replicas
not yet seen are the bound, as with a poll made a moment earlier.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from sortedcontainers import SortedDict

from ...kernel.backoff import Backoff
from ...kernel.errors import BatonError
from .etcd import KV, Delete, Etcd, Put, TxnOp
from .keys import Keys

log = logging.getLogger("baton.registry")


class Txn(Protocol):
    """What the view reads of a transaction of this replica (``txn.Txn`` is one; declared
    here so that the transaction module may use the view and not the other way round)."""

    #: keys this transaction holds in the view's reservations
    reserved: list[bytes]
    #: whether its writes of cached (not watched) keys go into the view's cache
    cache_writes: bool

    def ops(self) -> list[TxnOp]: ...

    def read_state(self, key: bytes) -> tuple[bool, KV | None]: ...

#: cached entries and claims kept (least recently used go first)
CACHE_MAX = 50_000
#: index windows kept (one per task, and per consumer group, claimed from lately)
WINDOWS_MAX = 1024
#: task statuses nothing is claimed in any more: their index windows are dropped (a
#: task that comes back, requeued, has its windows read again when claimed from)
_DONE = frozenset({"completed", "cancelled", "archiving", "archived", "deleting"})
#: index keys read per window refill (also the entries prefetched with them)
WINDOW_PAGE = 128
#: seconds before a broken watch is set up again: the bound after the first break in
#: a row, and the largest (kernel/backoff.py, spread over half the bound and the bound)
REWATCH_DELAY = 0.2
REWATCH_CAP = 2.0
REWATCH = Backoff(REWATCH_DELAY, REWATCH_CAP, floor=0.5)

_MIRROR, _CACHE, _WINDOW, _OTHER = range(4)


class _Window:
    """The first keys of one index, in order: every key below ``end`` is here."""

    def __init__(self) -> None:
        self.keys: SortedDict = SortedDict()  # key -> mod revision
        self.end: bytes | None = b""  # b"": nothing loaded yet; None: the whole index
        self.lock = asyncio.Lock()

    def covers(self, key: bytes) -> bool:
        return self.end is None or (bool(self.end) and key < self.end)


class View:
    """What this replica knows of the hot keys; also a ``txn.Source``."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self.etcd = etcd
        self.keys = keys
        self.ready = False
        #: the revision the view has caught up with
        self.revision = 0
        self._root = keys.prefix.encode()
        self._mirror_bases = (keys.tasks(), keys.agents(), keys.slots_all(), keys.watchers(),
                              keys.shards(), keys.shardmap(), keys.pools(),
                              keys.pool_units_all(), keys.drains())
        self._agents = keys.agents()
        self._cache_bases = (keys.entries_all(), keys.claims_all())
        self._tasks_base = keys.tasks()
        self._ready_base = keys.ready_root()
        self._delayed_base = keys.delayed_all()
        self._cready_base = keys.cready_root()
        #: the indexes held as windows (the first two keyed by task, as ``ready/{task}/``)
        self._index_bases = (self._ready_base, self._delayed_base, self._cready_base)
        self._mirror: dict[bytes, KV] = {}
        #: the mirrored keys again, by the prefix a planner scans (a session's slots)
        self._groups: dict[bytes, dict[bytes, KV]] = {}
        self._cache: OrderedDict[bytes, tuple[KV | None, int]] = OrderedDict()
        self._gone: dict[bytes, int] = {}
        self._windows: OrderedDict[bytes, _Window] = OrderedDict()
        self._reserved: set[bytes] = set()
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        #: session records seen deleted on the watch: closed or expired (for metrics)
        self.sessions_ended = 0
        #: who is told of changes to mirrored keys, by prefix (``listen``)
        self._listeners: list[tuple[bytes, Callable[[], None]]] = []
        # This replica's writes of watched keys set the revision ``current`` waits for.
        watched = tuple(self._watched)
        etcd.tracks = lambda key: key.startswith(watched)

    # lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Load the mirrored keys and follow the watch from there (in the background)."""
        self._task = asyncio.create_task(self._follow())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), 10)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _load(self) -> int:
        self.ready = False
        self._mirror.clear()
        self._groups.clear()
        self._cache.clear()
        self._gone.clear()
        self._windows.clear()
        _, at, _ = await self.etcd.range(self.keys.tasks(), limit=1)
        for base in self._mirror_bases:
            async for kv in self.etcd.scan(base, revision=at):
                self._mirror_put(kv)
        self.revision = at
        self.ready = True
        self._synced.set()
        for _, tell in self._listeners:  # anything may have changed while it was away
            tell()
        return at

    def listen(self, prefix: bytes, tell: Callable[[], None]) -> None:
        """Call ``tell`` whenever a mirrored key under ``prefix`` changes (the watch
        brought it, or this replica wrote it) and whenever the view loads again: for
        loops that act on what the mirror holds (the shard assigner, drains), so that
        they run when it changes, not every so often."""
        self._listeners.append((prefix, tell))

    async def _follow(self) -> None:
        broken = 0  # breaks in a row: none once a watch delivered
        while True:
            try:
                at = await self._load()
                # Only the prefixes the view holds, on one stream; of the indexes,
                # only keys of windows it holds are decoded (task creation writes
                # hundreds of thousands of ready keys nobody claims from yet).
                async for batch in self.etcd.watch(self._watched, at + 1, keep=self._wanted,
                                                   progress=self._progress):
                    broken = 0
                    for ev in batch:
                        self._apply(ev.kv.key, ev.kv if ev.kind == "put" else None,
                                    ev.kv.mod_revision, watched=True)
                        if ev.kind == "delete" and ev.kv.key.startswith(self._agents):
                            self.sessions_ended += 1
                        self.revision = max(self.revision, ev.kv.mod_revision)
                    self._prune()
            except asyncio.CancelledError:
                self.ready = False
                raise
            except BatonError as e:
                log.warning("view: watch broken (%s); loading again", e)
            except Exception:
                log.exception("view: watch crashed; loading again")
            self.ready = False
            broken += 1
            await asyncio.sleep(REWATCH.delay(broken))

    def _progress(self, revision: int) -> None:
        """The watch has delivered (and the view applied) everything up to ``revision``."""
        self.revision = max(self.revision, revision)

    def current(self) -> bool:
        """Whether every write of this replica to a watched key is in the view: its
        watch is live and has come as far as the last one (``Etcd.wrote``)."""
        return self.ready and self.revision >= self.etcd.wrote

    # classification --------------------------------------------------------

    @property
    def _watched(self) -> list[bytes]:
        # Not the cached kinds: entries and claims change at every step, mostly by this
        # replica (which takes its own writes at once), and a cached value another
        # replica changed fails its compare and comes back fresh from the failure
        # branch. Watching them would cost a watch response per transaction.
        return [*self._mirror_bases, *self._index_bases]

    def _wanted(self, key: bytes) -> bool:
        if key.startswith(self._index_bases):
            return self._window_base(key) in self._windows
        return True

    def _kind(self, key: bytes) -> int:
        if key.startswith(self._cache_bases):
            return _CACHE
        if key.startswith(self._mirror_bases):
            return _MIRROR
        if key.startswith(self._index_bases):
            return _WINDOW
        return _OTHER

    def _window_base(self, key: bytes) -> bytes:
        """The index (window) a ready, delayed or cready key belongs to: for the first
        two the task's part (``ready/{task}/``), for cready all but its last part."""
        if key.startswith(self._cready_base):
            return key[: key.rindex(b"/", 0, len(key) - 1) + 1]
        root = self._ready_base if key.startswith(self._ready_base) else self._delayed_base
        return key[: key.index(b"/", len(root)) + 1]

    def _last(self, key: bytes, kind: int) -> int:
        """The revision the view last knew ``key`` at (0: never)."""
        if key in self._gone:
            return self._gone[key]
        if kind == _MIRROR:
            kv = self._mirror.get(key)
            return kv.mod_revision if kv else 0
        if kind == _CACHE:
            known = self._cache.get(key)
            return known[1] if known else 0
        if kind == _WINDOW:
            window = self._windows.get(self._window_base(key))
            return int(window.keys.get(key, 0)) if window else 0
        return 0

    # applying changes -------------------------------------------------------

    def _apply(self, key: bytes, kv: KV | None, rev: int, watched: bool) -> None:
        kind = self._kind(key)
        if kind == _OTHER or rev <= self._last(key, kind):
            return
        if kv is None:
            self._gone[key] = rev
        else:
            self._gone.pop(key, None)
        if kind == _MIRROR:
            if kv is None:
                self._mirror_pop(key)
            else:
                self._mirror_put(kv)
            for prefix, tell in self._listeners:
                if key.startswith(prefix):
                    tell()
            if self._group_of(key) == self._tasks_base and (kv is None or _done(kv.value)):
                self._drop_windows(key[len(self._tasks_base):].decode())
        elif kind == _CACHE:
            if watched and key not in self._cache:
                return
            self._cache[key] = (kv, rev)
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_MAX:
                self._cache.popitem(last=False)
        else:
            window = self._windows.get(self._window_base(key))
            if window is None:
                return
            if kv is None:
                window.keys.pop(key, None)
            elif window.covers(key):
                window.keys[key] = rev

    def _group_of(self, key: bytes) -> bytes:
        return key[: key.rindex(b"/") + 1]

    def _is_group(self, prefix: bytes) -> bool:
        """Whether ``prefix`` is the parent of mirrored keys (``slots/{session}/``,
        ``poolunits/{pool}/``, ``agents/``, ``tasks/``, ``pools/``): then the keys under
        it are exactly one group."""
        for parent in (self.keys.slots_all(), self.keys.pool_units_all()):
            if prefix.startswith(parent):
                return prefix.endswith(b"/") and prefix.count(b"/") == parent.count(b"/") + 1
        return prefix in (self.keys.tasks(), self.keys.agents(), self.keys.pools(),
                          self.keys.drains())

    def _mirror_put(self, kv: KV) -> None:
        self._mirror[kv.key] = kv
        self._groups.setdefault(self._group_of(kv.key), {})[kv.key] = kv

    def _mirror_pop(self, key: bytes) -> None:
        self._mirror.pop(key, None)
        group = self._groups.get(self._group_of(key))
        if group is not None:
            group.pop(key, None)
            if not group:
                del self._groups[self._group_of(key)]

    def _prune(self) -> None:
        """Tombstones only guard against older events; once the watch is past them, drop."""
        if len(self._gone) > 10_000:
            self._gone = {k: r for k, r in self._gone.items() if r > self.revision}

    def written(self, txn: Txn, revision: int) -> None:
        """A transaction of this replica applied at ``revision``: take its writes now,
        before the watch brings them."""
        for op in txn.ops():
            kind = self._kind(op.key)
            if kind == _OTHER or (kind == _CACHE and not txn.cache_writes):
                continue
            if isinstance(op, Delete):
                self._apply(op.key, None, revision, watched=False)
                continue
            assert isinstance(op, Put)
            read, before = txn.read_state(op.key)
            known = self._cache.get(op.key)
            if kind == _CACHE and not read and known is None:
                continue  # neither read nor held: its create revision is unknown
            prior = before if read else (known[0] if known else None)
            create = prior.create_revision if prior else revision
            version = prior.version + 1 if prior else 1
            self._apply(op.key, KV(op.key, op.value, create, revision, version, op.lease),
                        revision, watched=False)

    def refreshed(self, keys: Sequence[bytes], gets: Sequence[list[KV]], revision: int) -> None:
        """A transaction failed its compares; its failure branch read ``keys`` at ``revision``."""
        for key, found in zip(keys, gets, strict=False):
            kind = self._kind(key)
            if kind == _WINDOW:
                continue  # an index key read alone says nothing of its neighbours
            self._apply(key, found[0] if found else None, revision, watched=kind != _CACHE)
            if kind == _MIRROR and not found:
                self._mirror_pop(key)

    def _drop_windows(self, task_id: str) -> None:
        """Forget the index windows of a task nothing is claimed in any more: else they
        stay (about 2 KB each, emptied) until ``WINDOWS_MAX`` windows push them out."""
        mine = (self.keys.ready_all(task_id), self.keys.delayed_of_task(task_id),
                self.keys.cready_of_task(task_id))
        for base in [b for b in self._windows if b.startswith(mine)]:
            del self._windows[base]

    def invalidate(self, base: bytes) -> None:
        """An index window proved behind etcd: read it again from its start."""
        self._windows.pop(base, None)

    def session_count(self) -> int:
        """Agent sessions in the mirror."""
        return len(self._groups.get(self._agents, ()))

    # reservations -----------------------------------------------------------

    def reserve(self, txn: Txn, key: bytes) -> bool:
        """Hold ``key`` for ``txn`` so other planners of this replica pass it by."""
        if key in self._reserved:
            return False
        self._reserved.add(key)
        txn.reserved.append(key)
        return True

    def release(self, keys: Sequence[bytes]) -> None:
        self._reserved.difference_update(keys)

    def reserved(self, key: bytes) -> bool:
        """Whether a planner of this replica holds ``key`` while its transaction is on
        its way."""
        return key in self._reserved

    def taken(self, key: bytes) -> bool:
        """Whether an index key a planner listed is no longer free to it: another
        planner of this replica reserved it since, or it left its window (a write of
        this replica or the watch took it). Passing such a key over says nothing of the
        window being behind."""
        if key in self._reserved:
            return True
        window = self._windows.get(self._window_base(key))
        return window is None or key not in window.keys

    # reading (txn.Source) ----------------------------------------------------

    async def get_many(self, keys: Sequence[bytes]) -> list[KV | None]:
        out: dict[bytes, KV | None] = {}
        missing: list[bytes] = []
        for key in keys:
            kind = self._kind(key)
            if kind == _MIRROR:
                out[key] = self._mirror.get(key)
            elif kind == _CACHE and key in self._cache:
                self._cache.move_to_end(key)
                out[key] = self._cache[key][0]
            else:
                missing.append(key)
        if missing:
            async for revision, found in self.etcd.get_chunks(missing):
                for key, kv in found:
                    out[key] = kv
                    if self._kind(key) == _CACHE:
                        self._apply(key, kv, revision, watched=False)
        return [out[k] for k in keys]

    async def scan(self, prefix: bytes, limit: int, keys_only: bool) -> list[KV]:
        if prefix.startswith(self._mirror_bases):
            if self._is_group(prefix):
                group = self._groups.get(prefix, {})
            else:
                group = {k: kv for k, kv in self._mirror.items() if k.startswith(prefix)}
            kvs = sorted(group.values(), key=lambda kv: kv.key)
            return kvs[:limit] if limit else kvs
        if prefix.startswith(self._index_bases) and keys_only:
            return await self._head(prefix, limit or WINDOW_PAGE)
        kvs, _, _ = await self.etcd.range(prefix, limit=limit, keys_only=keys_only)
        return kvs

    async def _head(self, base: bytes, limit: int) -> list[KV]:
        """The first ``limit`` keys of an index not reserved by a planner in flight."""
        window = self._windows.get(base)
        if window is None:
            window = self._windows[base] = _Window()
            while len(self._windows) > WINDOWS_MAX:  # tasks nobody claims from any more
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(base)
        if not self._unreserved(window, 1):
            async with window.lock:
                if not self._unreserved(window, 1) and window.end is not None:
                    await self._refill(base, window)
        return [KV(k, b"", 0, rev, 0, 0) for k, rev in self._unreserved(window, limit)]

    def _unreserved(self, window: _Window, limit: int) -> list[tuple[bytes, int]]:
        out = []
        for key, rev in window.keys.items():
            if key not in self._reserved:
                out.append((key, int(rev)))
                if len(out) >= limit:
                    break
        return out

    async def _refill(self, base: bytes, window: _Window) -> None:
        """Read the next page of the index after what the window covered, and its entries."""
        start = window.end or None
        kvs, rev, more = await self.etcd.range(base, start=start, limit=WINDOW_PAGE,
                                               keys_only=True)
        for kv in kvs:
            if self._gone.get(kv.key, 0) < kv.mod_revision:
                window.keys.setdefault(kv.key, kv.mod_revision)
        window.end = kvs[-1].key + b"\0" if more and kvs else None
        root = next(b for b in self._index_bases if base.startswith(b))
        task_id = base[len(root):].split(b"/", 1)[0].decode()
        wanted = [self.keys.entry(task_id, self.keys.last_segment(kv.key)) for kv in kvs]
        if wanted:
            for key in wanted:  # read them again: a cached entry may be behind
                self._cache.pop(key, None)
            await self.get_many(wanted)
        log.debug("view: window %s refilled with %d keys at revision %d", base, len(kvs), rev)


def _done(header: bytes) -> bool:
    """Whether a task header's status is one nothing is claimed in any more."""
    try:
        return json.loads(header).get("status") in _DONE
    except (ValueError, AttributeError):
        return False
