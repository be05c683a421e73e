"""Agent sessions (one etcd lease each) and the reaper that recovers lost claims."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable

from ...kernel import logs
from ...kernel.errors import BatonError, InvalidArgument, SessionExpired
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import Caller
from ..records.manifest import ID_RE, check_id
from ..records.model import EntryRecord, now
from ..rules.checks import (
    SessionRecord,
    actor_of,
    check_owner,
    claim_holder,
    claim_session,
    voided,
)
from ..rules.claim import take_back
from ..rules.core import Core, Gate, every
from ..rules.pools import PoolAdmin
from ..rules.sweeping import Alarm, Complaints, SweepWatch
from ..store.etcd import KV, READ_CHUNK, Get, Watched, WatchEvent
from ..store.keys import ClaimRef
from ..store.txn import Txn, write

log = logging.getLogger("baton.registry")

MIN_TTL, MAX_TTL = 2, 3600
#: keys read per request when the reaper lists claims and their twins
REAP_PAGE = 1000
#: lost claims moved on at once (each its own guarded transaction)
REAP_PARALLEL = 32
#: sweeps between two repairs of pool units (a few seconds at the default interval)
REPAIR_EVERY = 10


class Sessions:
    def __init__(self, core: Core,
                 renew: Callable[[int], Awaitable[int]] | None = None) -> None:
        self.core = core
        self.keys = core.keys
        #: moves a session whose agent has just refreshed a rotation's lease (granted
        #: what the old one had left) onto a lease of its full TTL; its TTL then
        self.renew = renew
        #: sessions whose lease this replica revoked (for metrics: the others expired)
        self.closed = 0

    async def open(self, req: pb.OpenSessionRequest, caller: Caller) -> pb.Session:
        check_id("agent", req.agent)
        ttl = req.ttl or 10
        if not MIN_TTL <= ttl <= MAX_TTL:
            raise InvalidArgument(f"ttl {ttl} not within {MIN_TTL}..{MAX_TTL} seconds")
        if not 0 <= req.slots <= 10_000:
            raise InvalidArgument(f"slots {req.slots} not within 0..10000 (0 = no limit)")
        lease, granted = await self.core.etcd.grant(ttl)
        info: dict[str, object] = {
            "agent": req.agent, "host": req.host, "pid": req.pid, "version": req.version,
            "ttl": granted, "slots": req.slots, "opened_at": now()}
        if caller.name:
            info["identity"] = caller.name
        key = self.keys.agent(lease)  # the first lease's id is the session's for good

        async def plan(txn: Txn) -> None:
            # A session opened on a drained host opens draining; the drain key is
            # pinned, so a drain committed meanwhile makes this plan again.
            drained = bool(ID_RE.match(req.host)) and (
                await txn.get(self.keys.drain(req.host)) is not None)
            value = {**info, "draining": True} if drained else info
            txn.create(key, json.dumps(value).encode(), lease=lease)  # a fresh lease

        try:
            await write(self.core.txns, plan)
        except Exception:
            # Not opened after all: leave no lease behind (it would expire anyway).
            with contextlib.suppress(BatonError):
                await self.core.etcd.revoke(lease)
            raise
        log.info("session %x opened for %s (ttl %ds)", lease, req.agent, granted)
        return pb.Session(session_id=lease, agent=req.agent, ttl=granted, slots=req.slots)

    async def _record(self, session_id: int) -> KV:
        """The session's record (the view's mirror, else etcd); ``SessionExpired``."""
        key = self.keys.agent(session_id)
        kv = (await self.core.view.get_many([key]))[0] if self.core.view else None
        if kv is None:  # the view may not have seen a session another replica opened
            kv = await self.core.etcd.get(key)
        if kv is None:
            raise SessionExpired(f"session {session_id:x} has expired or never existed",
                                 session_id=session_id)
        return kv

    async def keepalive(self, req: pb.KeepAliveRequest, caller: Caller) -> pb.KeepAliveResponse:
        """Refresh the session's lease, the one its record is on now (and, while a
        rotation moves its keys, the old one too), so an agent follows a rotation
        without knowing. A session being revoked is refused: it is lost."""
        if req.session_id <= 0:
            raise InvalidArgument("keepalive needs a session_id")
        kv = await self._record(req.session_id)
        check_owner(caller, kv, f"session {req.session_id:x}")
        ttl = await self._refresh(SessionRecord.of(kv, req.session_id))
        if ttl <= 0:
            # The view may still show a lease a rotation (on another replica) has
            # just left: ask etcd which lease the session is on now.
            fresh = await self.core.etcd.get(self.keys.agent(req.session_id))
            if fresh is not None and fresh.lease != kv.lease:
                kv = fresh
                ttl = await self._refresh(SessionRecord.of(kv, req.session_id))
        if ttl <= 0:
            raise SessionExpired(f"session {req.session_id:x} has expired",
                                 session_id=req.session_id)
        record = SessionRecord.of(kv, req.session_id)
        if ttl < record.ttl and not record.rotating_from and self.renew is not None:
            # A rotation gave the lease only what the old one had left; the refresh
            # just made proves the agent lives, so it is owed its whole TTL again.
            try:
                ttl = await self.renew(req.session_id) or ttl
            except BatonError as e:
                # The refresh itself holds: the next keepalive tries the move again
                # (or, if it began, finds ``rotating_from`` and refreshes both leases).
                log.warning("session %x: its full TTL back after a rotation: %s",
                            req.session_id, e)
        return pb.KeepAliveResponse(ttl=ttl, draining=record.draining)

    async def _refresh(self, record: SessionRecord) -> int:
        """Refresh every lease of the session; the TTL of the one it is on (0: gone)."""
        if record.revoked:
            raise SessionExpired(f"session {record.session_id:x} is being revoked by an "
                                 "operator", session_id=record.session_id)
        if record.rotating_from:
            await self.core.etcd.keepalive(record.rotating_from)
        return await self.core.etcd.keepalive(record.lease)

    async def resume(self, session_id: int, caller: Caller) -> pb.Session:
        """A session taken up again on a new stream after its last one broke: it must
        still live and be the caller's, and is refreshed as a keepalive would."""
        kept = await self.keepalive(pb.KeepAliveRequest(session_id=session_id), caller)
        record = SessionRecord.of(await self._record(session_id), session_id)
        return pb.Session(session_id=session_id, agent=record.agent, ttl=kept.ttl,
                          slots=int(record.info.get("slots", 0) or 0))

    async def close(self, req: pb.CloseSessionRequest,
                    caller: Caller) -> pb.CloseSessionResponse:
        """Revoke a session's lease: its own identity may, and any operator."""
        if req.session_id <= 0:
            raise InvalidArgument("close needs a session_id")
        try:
            kv = await self._record(req.session_id)
        except SessionExpired:
            return pb.CloseSessionResponse()  # closing a closed session changes nothing
        if not caller.operator:
            check_owner(caller, kv, f"session {req.session_id:x}")
        else:
            log.info("session %x closed by operator %s", req.session_id, caller.name)
        for lease in SessionRecord.of(kv, req.session_id).leases:
            await self.core.etcd.revoke(lease)
        self.closed += 1
        return pb.CloseSessionResponse()


class Reaper:
    """Moves entries on when the lease behind their claim is gone.

    etcd deletes a claim key when its lease expires; its durable twin under
    ``inflight/`` stays. A full look (``sweep``) walks the two listings side by
    side, ``REAP_PAGE`` keys per request and both at one revision: a claim key
    and its twin name the same claim after their prefixes, so both listings come
    in the same order and a merge pairs them with only a page of each in memory,
    however many claims are in flight. For each twin left alone it runs one
    guarded transaction: the producer's entry takes the retry path, a consumer's
    entry goes back to its group. Replicas race safely: the compares let exactly
    one of them apply each move.

    The elected replica looks whole only when it becomes the leader (a lease may
    have died while none led), when its watch of the indexes breaks, and every few
    minutes (``sweeps``); in between, the watch tells it of every claim key deleted
    (``claims_gone``). A claim that ended (committed, acked, failed, taken back)
    goes with its twin in one transaction, so a twin deleted at the same revision
    says it was not lost; the others (a lease expired or revoked: etcd deleted the
    claim alone) are read, claim and twin, and moved on if lost (``reap_lost``):
    a look proportional to the claims lost, not to the claims in flight.
    """

    def __init__(self, core: Core, interval: float = 0.5) -> None:
        self.core = core
        self.keys = core.keys
        self.interval = interval
        self.reaped = 0
        self._complain = Complaints("reaper")
        #: frees pool units held without a claim, every ``REPAIR_EVERY`` sweeps (a
        #: safety net: it should find none)
        self.pools = PoolAdmin(core)
        self._sweeps = 0
        #: claim keys deleted (after ``claims/``) and twins deleted (after
        #: ``inflight/``) since the last look, each at the revision it went
        self._lost: dict[bytes, int] = {}
        self._ended: dict[bytes, int] = {}
        #: whether twins went since the last repair of pool units, and when it ran
        self._twins_went = False
        self._repaired = -math.inf
        self.alarm: Alarm | None = None

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.interval, stop, self.sweep, "reaper")

    def follow(self, watch: SweepWatch) -> Alarm:
        """Follow the claim keys and twins deleted, on the leader's watch; the alarm
        its sweeps run on (``woken``)."""
        self.alarm = watch.alarm()
        watch.follow(Watched(self.keys.claims_all(), puts=False), self.claims_gone)
        watch.follow(Watched(self.keys.inflight_all(), puts=False), self.twins_gone)
        return self.alarm

    def claims_gone(self, batch: list[WatchEvent]) -> None:
        """Claim keys deleted: lost, unless their twin went in the same transaction."""
        base = self.keys.claims_all()
        for ev in batch:
            tail, revision = ev.kv.key[len(base):], ev.kv.mod_revision
            if self._ended.get(tail) == revision:
                del self._ended[tail]  # ended with its twin: not lost
            else:
                self._lost[tail] = revision
        if self._lost and self.alarm is not None:
            self.alarm.ring()

    def twins_gone(self, batch: list[WatchEvent]) -> None:
        """Twins deleted: their claims ended (or were reaped)."""
        base = self.keys.inflight_all()
        for ev in batch:
            tail, revision = ev.kv.key[len(base):], ev.kv.mod_revision
            if self._lost.get(tail) == revision:
                del self._lost[tail]
            else:
                self._ended[tail] = revision
        self._twins_went = True
        if self.alarm is not None:
            self.alarm.ring()  # a unit may be held without a claim now (``_repair``)

    async def woken(self, whole: bool) -> int:
        """One sweep of the elected replica: a full look, or the claims lost since."""
        loop = asyncio.get_running_loop()
        if whole:
            self._lost.clear()
            self._ended.clear()
            self._twins_went = False
            self._repaired = loop.time()
            return await self.sweep(repair=True)
        moved = await self.reap_lost()
        if self._twins_went:
            due = self._repaired + REPAIR_EVERY * self.interval
            if loop.time() >= due:
                self._twins_went = False
                self._repaired = loop.time()
                await self._repair()
            elif self.alarm is not None:
                self.alarm.wake_at(self.core.clock() + due - loop.time())
        return moved

    async def reap_lost(self) -> int:
        """Each claim key deleted since the last look without its twin: read with its
        twin, and its entry moved on if the twin is left alone. A claim that could not
        be handled is kept for the next look."""
        lost, self._lost = self._lost, {}
        self._ended.clear()
        base = self.keys.claims_all()
        refs: list[ClaimRef] = []
        for tail in lost:
            try:
                refs.append(self.keys.parse_claim(base + tail))
            except ValueError as e:
                self._complain(f"claim key {(base + tail).decode(errors='replace')}", e)
        moved = 0
        gate = Gate(REAP_PARALLEL)

        async def one(ref: ClaimRef, token: int, item: str) -> None:
            nonlocal moved
            try:
                if await self._reap(ref, token):
                    moved += 1
                    self.reaped += 1
            except Exception as e:
                self._complain(item, e)
                self._retry(ref)

        pair = READ_CHUNK // 2  # a claim and its twin read together, at one revision
        try:
            for i in range(0, len(refs), pair):
                chunk = refs[i:i + pair]
                try:
                    found = await self.core.etcd.read(
                        [Get(k) for ref in chunk for k in (self.keys.inflight(ref),
                                                           self.keys.claim(ref))])
                except BatonError:
                    for ref in refs[i:]:
                        self._retry(ref)
                    raise
                for n, ref in enumerate(chunk):
                    twins, claims = found[2 * n], found[2 * n + 1]
                    if not twins or (claims and claims[0].create_revision
                                     == twins[0].create_revision):
                        continue  # ended, or the claim lives (taken again)
                    twin = twins[0]
                    item = (f"twin {twin.key.decode(errors='replace')} "
                            f"(token {twin.create_revision})")
                    await gate.submit(one(ref, twin.create_revision, item))
        finally:
            await gate.drain()
        return moved

    def _retry(self, ref: ClaimRef) -> None:
        """Look at a claim again next time (its reap failed)."""
        self._lost[self.keys.claim(ref)[len(self.keys.claims_all()):]] = 0
        if self.alarm is not None:
            self.alarm.ring()

    async def orphans(self) -> AsyncIterator[tuple[KV, ClaimRef | None]]:
        """Every twin whose claim is gone (or is another claim), with what it names
        (None: a key that names no claim)."""
        twins_base, claims_base = self.keys.inflight_all(), self.keys.claims_all()
        # One revision for both listings (a claim and its twin are written together).
        _, rev, _ = await self.core.etcd.range(twins_base, limit=1, keys_only=True)
        twins = self.core.etcd.scan(twins_base, page=REAP_PAGE, revision=rev)
        claims = self.core.etcd.scan(claims_base, page=REAP_PAGE, keys_only=True, revision=rev)
        async with contextlib.aclosing(twins), contextlib.aclosing(claims):
            claim: KV | None = None
            claims_done = False
            async for twin in twins:
                tail = twin.key[len(twins_base):]
                # The claims listing is read only as far as the twins reach.
                while not claims_done and (claim is None
                                           or claim.key[len(claims_base):] < tail):
                    claim = await anext(claims, None)
                    claims_done = claim is None
                if (claim is not None and claim.key[len(claims_base):] == tail
                        and claim.create_revision == twin.create_revision):
                    continue  # the claim lives
                try:
                    ref: ClaimRef | None = self.keys.parse_inflight(twin.key)
                except ValueError:
                    ref = None
                yield twin, ref

    async def sweep(self, repair: bool = False) -> int:
        """Move on every entry whose claim's lease is gone, ``REAP_PARALLEL`` at a time
        (their transactions share requests through group commit); pool units are
        repaired every ``REPAIR_EVERY`` sweeps (``repair``: this one)."""
        moved = 0
        gate = Gate(REAP_PARALLEL)

        async def one(twin: KV, ref: ClaimRef, item: str) -> None:
            nonlocal moved
            try:  # one bad entry never stops the reaper for the others
                if await self._reap(ref, twin.create_revision):
                    moved += 1
                    self.reaped += 1
            except Exception as e:
                self._complain(item, e)

        async for twin, ref in self.orphans():
            item = f"twin {twin.key.decode(errors='replace')} (token {twin.create_revision})"
            if ref is None:
                self._complain(item, ValueError("names no claim; left alone"))
                continue
            await gate.submit(one(twin, ref, item))
        await gate.drain()
        self._sweeps += 1
        if repair or self._sweeps % REPAIR_EVERY == 0:
            await self._repair()
        return moved

    async def _repair(self) -> None:
        try:
            await self.pools.repair()
        except Exception as e:  # the reaper goes on; the next repair tries again
            self._complain("pool units", e)

    async def _reap(self, ref: ClaimRef, token: int) -> bool:
        """Move one entry on for a claim whose lease is gone; False if already done."""
        claim_key, twin_key = self.keys.claim(ref), self.keys.inflight(ref)
        entry_key = self.keys.entry(ref.task_id, ref.file_id)

        task_key = self.keys.task(ref.task_id)

        async def plan(txn: Txn) -> str:
            twin, claim, kv, task = await txn.get_many([twin_key, claim_key, entry_key,
                                                        task_key])
            if twin is None or twin.create_revision != token:
                return ""  # another replica got there first
            if claim is not None:
                return ""  # the claim lives (the listing was behind)
            holder = claim_holder(twin) or "?"
            # the claim key went with its lease: the twin is what is left to end
            take_back(self.core, txn, ref, None,
                      EntryRecord.load(kv.value) if kv is not None else None,
                      twin=twin, cancelled=voided(task), actor=actor_of(twin), spend=True,
                      event="failed", consumer_event="consumer lost",
                      reason=f"lease of agent {holder} (session "
                      f"{claim_session(twin):x}) lost (token {token})")
            if voided(task):
                # A cancelled task's entries stay as they were: its cancel deletes the
                # claims a chunk at a time, and a lease may end meanwhile: the twin goes.
                return ""
            txn.after(lambda: logs.log(
                log, logging.INFO, "reaped a lost claim", task=ref.task_id,
                file_id=ref.file_id, revision=txn.revision, kind=ref.kind,
                group=ref.group or None, token=token, agent=holder))
            return holder

        return bool(await write(self.core.txns, plan))
