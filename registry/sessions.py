"""Agent sessions (one etcd lease each) and the reaper that recovers lost claims."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from client.errors import BatonError, InvalidArgument, SessionExpired
from client.v1 import baton_pb2 as pb

from ._etcd import Delete, Put, TxnOp, absent, created_at, unchanged
from .core import Core
from .keys import ClaimRef
from .manifest import check_id
from .model import VERIFIED, WRITING, EntryRecord, now

log = logging.getLogger("baton.registry")

MIN_TTL, MAX_TTL = 2, 3600


class Sessions:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys

    async def open(self, req: pb.OpenSessionRequest) -> pb.Session:
        check_id("agent", req.agent)
        ttl = req.ttl or 10
        if not MIN_TTL <= ttl <= MAX_TTL:
            raise InvalidArgument(f"ttl {ttl} not within {MIN_TTL}..{MAX_TTL} seconds")
        if not 0 <= req.slots <= 10_000:
            raise InvalidArgument(f"slots {req.slots} not within 0..10000 (0 = no limit)")
        lease, granted = await self.core.etcd.grant(ttl)
        info = {"agent": req.agent, "host": req.host, "pid": req.pid, "version": req.version,
                "ttl": granted, "slots": req.slots, "opened_at": now()}
        await self.core.etcd.txn([], [Put(self.keys.agent(lease), json.dumps(info).encode(),
                                          lease=lease)])
        log.info("session %x opened for %s (ttl %ds)", lease, req.agent, granted)
        return pb.Session(session_id=lease, agent=req.agent, ttl=granted, slots=req.slots)

    async def keepalive(self, req: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        if req.session_id <= 0:
            raise InvalidArgument("keepalive needs a session_id")
        ttl = await self.core.etcd.keepalive(req.session_id)
        if ttl <= 0:
            raise SessionExpired(f"session {req.session_id:x} has expired",
                                 session_id=req.session_id)
        return pb.KeepAliveResponse(ttl=ttl)

    async def close(self, req: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        if req.session_id <= 0:
            raise InvalidArgument("close needs a session_id")
        await self.core.etcd.revoke(req.session_id)
        return pb.CloseSessionResponse()


class Reaper:
    """Moves entries on when the lease behind their claim is gone.

    etcd deletes a claim key when its lease expires; its durable twin under
    ``inflight/`` stays. Every ``interval`` seconds the reaper pairs the two
    listings (both only as large as the number of claims in flight) and, for
    each twin left alone, runs one guarded transaction: the producer's entry
    takes the retry path, a consumer's entry goes back to its group. Replicas
    race safely: the compares let exactly one of them apply each move.
    """

    def __init__(self, core: Core, interval: float = 0.5) -> None:
        self.core = core
        self.keys = core.keys
        self.interval = interval
        self.reaped = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep()
            except BatonError as e:
                log.warning("reaper sweep failed: %s", e)
            except Exception:
                log.exception("reaper sweep crashed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    async def sweep(self) -> int:
        inflight, _, _ = await self.core.etcd.range(self.keys.inflight_all())
        if not inflight:
            return 0
        claims, _, _ = await self.core.etcd.range(self.keys.claims_all(), keys_only=True)
        live = {self.keys.parse_claim(kv.key): kv.create_revision for kv in claims}
        moved = 0
        for kv in inflight:
            ref = self.keys.parse_inflight(kv.key)
            if live.get(ref) == kv.create_revision:
                continue
            try:
                if await self._reap(ref, kv.create_revision):
                    moved += 1
                    self.reaped += 1
            except BatonError as e:
                log.warning("could not reap %s: %s", ref, e)
        return moved

    async def _reap(self, ref: ClaimRef, token: int) -> bool:
        """Move one entry on for a claim whose lease is gone; False if already done."""
        claim_key, twin_key = self.keys.claim(ref), self.keys.inflight(ref)
        entry_key = self.keys.entry(ref.task_id, ref.file_id)
        for _ in range(8):
            twin = await self.core.etcd.get(twin_key)
            if twin is None or twin.create_revision != token:
                return False  # another replica got there first
            kv = await self.core.etcd.get(entry_key)
            compares = [absent(claim_key), created_at(twin_key, token)]
            ops: list[TxnOp] = [Delete(twin_key)]
            holder = json.loads(twin.value).get("agent", "?")
            if kv is not None:
                rec = EntryRecord.load(kv.value)
                compares.append(unchanged(kv))
                if ref.kind == "p" and rec.state == WRITING:
                    self.core.retry_or_dead(
                        rec, f"lease of agent {holder} lost (token {token})", ops, token=token)
                    self.core.put_entry(rec, ops)
                elif (ref.kind == "c" and rec.state == VERIFIED
                      and ref.group not in rec.consumed_by):
                    rec.remember("consumer lost", group=ref.group, who=holder, token=token)
                    self.core.put_entry(rec, ops)
                    ops.append(Put(self.keys.cready(ref.task_id, ref.group, ref.file_id), b""))
            result = await self.core.etcd.txn(compares, ops)
            if result.succeeded:
                log.info("reaped %s-claim on %s/%s (token %d, agent %s)", ref.kind,
                         ref.task_id, ref.file_id, token, holder)
                return True
        return False
