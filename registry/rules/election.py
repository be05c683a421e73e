"""One replica at a time does a job: an election on etcd, as etcd's
``concurrency/election.go`` holds one.

Each candidate puts a key of its own under ``PREFIX/election/NAME/`` (the name of its
lease), attached to its lease, in a guarded transaction (``absent``: its campaign
never overwrites another's). The candidate whose key has the lowest create revision
leads; every other one watches the key created just before its own and looks again
when that key goes (no herd: one deletion wakes one candidate). A leader's key goes
when it resigns (stopping) or when its lease ends (it died, or lost etcd for a TTL),
so a dead leader is replaced within the lease's TTL.

A candidate stops believing it leads as soon as one refresh of its lease fails, not
only when etcd says the lease is gone: the lease may be ending while it cannot reach
etcd, and the next leader may then start before this one hears of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from ...kernel.errors import BatonError
from ..store.etcd import KV, Delete, Etcd, Get, Put, absent, created_at
from ..store.keys import Keys
from .core import sweep_once

log = logging.getLogger(__name__)


class Election:
    """Campaign for ``name`` under ``prefix`` until stopped; ``leading`` while this
    candidate leads."""

    def __init__(self, etcd: Etcd, prefix: str, name: str, ttl: int, who: str = "",
                 retry: float = 1.0) -> None:
        if ttl < 2:
            raise BatonError(f"an election's lease TTL must be at least 2 seconds, not {ttl}")
        self.etcd = etcd
        self._keys = Keys(prefix)
        self.name = name
        self.prefix = self._keys.election(name)
        self.ttl = ttl
        self.who = who
        self.retry = retry
        #: set while this candidate leads; cleared the moment it may not
        self.leading = asyncio.Event()
        #: the other way round: set while it does not lead
        self._idle = asyncio.Event()
        self._idle.set()
        #: times this candidate became the leader
        self.terms = 0
        self._lease = 0
        self._key = b""
        self._revision = 0

    @property
    def is_leader(self) -> bool:
        return self.leading.is_set()

    async def until_leading(self, stop: asyncio.Event) -> bool:
        """Wait until this candidate leads (True) or ``stop`` is set (False)."""
        if not self.leading.is_set():
            await _first(stop.wait(), self.leading.wait())
        return not stop.is_set()

    async def until_not_leading(self) -> None:
        """Return once this candidate does not lead (at once if it does not)."""
        await self._idle.wait()

    def _lead(self, leads: bool) -> None:
        if leads:
            self._idle.clear()
            self.leading.set()
        else:
            self.leading.clear()
            self._idle.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign, lead, campaign again after losing, until ``stop``; then resign."""
        while not stop.is_set():
            try:
                await self._term(stop)
            except BatonError as e:
                log.warning("election %s: %s; campaigning again", self.prefix.decode(), e)
            finally:
                self._lead(False)
                await self._resign()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.retry)

    async def _term(self, stop: asyncio.Event) -> None:
        """One lease: campaign on it, lead while it lives; returns when it is lost."""
        self._lease, _ = await self.etcd.grant(self.ttl)
        self._key = self._keys.candidate(self.name, self._lease)
        # Guarded: a candidate's key is its own lease's, never another's overwritten.
        result = await self.etcd.txn([absent(self._key)],
                                     [Put(self._key, self.who.encode(), self._lease)],
                                     [Get(self._key)])
        self._revision = result.revision if result.succeeded else result.gets[0][0].create_revision
        lost = asyncio.Event()
        keeper = asyncio.create_task(self._keep(lost))
        try:
            ended = asyncio.create_task(_first(stop.wait(), lost.wait()))
            waiting = asyncio.create_task(self._wait_for_turn())
            done, _ = await asyncio.wait({ended, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if waiting not in done:
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError, BatonError):
                    await waiting
                return
            waiting.result()  # its error, if it failed
            self._lead(True)
            self.terms += 1
            log.info("election %s: leading (lease %x)", self.prefix.decode(), self._lease)
            await ended
            log.info("election %s: no longer leading", self.prefix.decode())
        finally:
            self._lead(False)
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    async def _keep(self, lost: asyncio.Event) -> None:
        """Refresh the lease every TTL/3; the first refresh that fails ends the term."""
        while True:
            await asyncio.sleep(self.ttl / 3)
            started = time.monotonic()
            try:
                left = await self.etcd.keepalive(self._lease)
            except BatonError as e:
                log.warning("election %s: lease refresh failed after %.1fs: %s",
                            self.prefix.decode(), time.monotonic() - started, e)
                left = 0
            if left <= 0:
                self._lead(False)
                lost.set()
                return

    async def _wait_for_turn(self) -> None:
        """Return once no candidate's key was created before this one's."""
        while True:
            older, revision = await self._older()
            if not older:
                return
            predecessor = max(older, key=lambda kv: kv.create_revision).key

            def only(key: bytes, predecessor: bytes = predecessor) -> bool:
                return key == predecessor  # not a longer key it is a prefix of

            # From the revision read at: a deletion after the read is not missed.
            async for batch in self.etcd.watch(predecessor, revision + 1, keep=only):
                if any(e.kind == "delete" for e in batch):
                    break

    async def _older(self) -> tuple[list[KV], int]:
        """Every candidate's key created before this one's, read page by page at one
        revision, and that revision."""
        older: list[KV] = []
        start: bytes | None = None
        revision = 0
        while True:
            kvs, at, more = await self.etcd.range(self.prefix, start=start, limit=500,
                                                  keys_only=True, revision=revision)
            revision = revision or at
            older.extend(kv for kv in kvs if kv.create_revision < self._revision)
            if not more:
                return older, revision
            start = kvs[-1].key + b"\0"

    async def _resign(self) -> None:
        """Delete this candidate's key (if it is still this campaign's) and its lease."""
        if not self._lease:
            return
        lease, key, revision = self._lease, self._key, self._revision
        self._lease, self._key, self._revision = 0, b"", 0
        with contextlib.suppress(BatonError):
            if revision:
                await self.etcd.txn([created_at(key, revision)], [Delete(key)])
            await self.etcd.revoke(lease)


async def _first(*waits: Awaitable[object]) -> None:
    """Return when the first of ``waits`` does (the others are cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def while_leading(election: Election, interval: float, stop: asyncio.Event,
                        sweep: Callable[[], Awaitable[object]], what: str) -> None:
    """Run ``sweep`` every ``interval`` seconds while ``election`` leads, until ``stop``:
    at once when leadership is won, never while it is not held."""
    while await election.until_leading(stop):
        await sweep_once(sweep, what)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
