"""Producer transitions: claim (pending → writing), commit, fail, and watcher reports."""

from __future__ import annotations

from collections.abc import Callable

from client.errors import (
    AlreadyClaimed,
    IllegalTransition,
    InvalidArgument,
    NothingToClaim,
    StaleToken,
)
from client.v1 import baton_pb2 as pb

from ._etcd import KV, Compare, Delete, Get, Put, TxnOp, created_at, present, unchanged
from .core import (
    Core,
    Plan,
    Reads,
    Retry,
    check_session_id,
    claim_value,
    entry_replay,
    need_entry,
    need_session,
    need_task,
)
from .keys import ClaimRef
from .manifest import DIGEST_RE, check_id
from .model import CONSUMED, PENDING, VERIFIED, WRITING, WRITTEN, EntryRecord, now

#: ready keys read per page when looking for the next claimable entry
PAGE = 64


class Producers:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys

    # dependencies ----------------------------------------------------------

    async def _deps_ready(self, rec: EntryRecord) -> bool:
        for dep in rec.depends_on:
            _, d = await self.core.entry(rec.task_id, dep)
            if d.state not in (VERIFIED, CONSUMED):
                return False
        return True

    # claim -----------------------------------------------------------------

    async def claim(self, req: pb.ClaimRequest) -> pb.ClaimResponse:
        check_id("task_id", req.task_id)
        if req.file_id:
            check_id("file_id", req.file_id)
        check_session_id(req.session_id)
        staging = self.core.staging_dir(req.task_id)
        agent_key = self.keys.agent(req.session_id)

        def plan_for(kv: KV, rec: EntryRecord, agent: str) -> Plan[pb.ClaimResponse]:
            ref = ClaimRef("p", rec.task_id, rec.file_id)
            rec.state, rec.owner, rec.session = WRITING, agent, req.session_id
            rec.observed, rec.error = None, ""
            rec.remember("claimed", owner=agent, attempt=rec.retry_count)
            value = claim_value(agent, req.session_id)
            ready = self.keys.ready(rec.task_id, rec.file_id)
            compares = [unchanged(kv), present(ready), present(agent_key)]
            ops: list[TxnOp] = [
                Put(kv.key, rec.dump()),
                Delete(ready),
                Put(self.keys.claim(ref), value, lease=req.session_id),
                Put(self.keys.inflight(ref), value),
            ]

            def reply(rev: int) -> pb.ClaimResponse:
                entry = rec.to_pb(staging, revision=rev, token=rev)
                return pb.ClaimResponse(entry=entry, token=rev, path=entry.abs_path)

            return Plan(compares, ops, reply)

        async def planner(reads: Reads) -> Plan[pb.ClaimResponse]:
            # One round trip: the task, the session, and the entry or a page of
            # the ready index (and, in Reads, this call's request record).
            target = (Get(self.keys.entry(req.task_id, req.file_id)) if req.file_id else
                      Get(self.keys.ready_all(req.task_id), prefix=True, limit=PAGE,
                          keys_only=True))
            task_kvs, agent_kvs, found = await reads.read(
                Get(self.keys.task(req.task_id)), Get(agent_key), target)
            need_task(task_kvs, req.task_id, active=True)
            agent = need_session(agent_kvs, req.session_id)
            if not req.file_id:
                return await self._next(req.task_id, found, lambda kv, rec:
                                        plan_for(kv, rec, agent))
            kv, rec = need_entry(found, req.task_id, req.file_id)
            if rec.state != PENDING:
                cls = AlreadyClaimed if rec.state == WRITING else IllegalTransition
                raise cls(
                    f"entry {rec.file_id!r} is {rec.state}, not pending",
                    task_id=rec.task_id, file_id=rec.file_id, state=rec.state,
                )
            if not await self._deps_ready(rec):
                raise IllegalTransition(
                    f"entry {rec.file_id!r} waits for its dependencies {rec.depends_on}",
                    task_id=rec.task_id, file_id=rec.file_id,
                )
            return plan_for(kv, rec, agent)

        def replay(raw: bytes, rev: int) -> pb.ClaimResponse:
            resp = pb.ClaimResponse.FromString(raw)
            resp.token = resp.entry.token = resp.entry.revision = rev
            return resp

        return await self.core.apply(planner, req.request_id, replay)

    async def _next(
        self,
        task_id: str,
        page: list[KV],
        plan_for: Callable[[KV, EntryRecord], Plan[pb.ClaimResponse]],
    ) -> Plan[pb.ClaimResponse]:
        """Pick a claimable entry from the ready index, never scanning the task.

        Concurrent claimers read the same first page; each tries it in a random
        order so they rarely collide on one entry. Later pages are read only
        when every entry of a page waits for dependencies.
        """
        prefix = self.keys.ready_all(task_id)
        moved = False
        while True:
            order = list(page)
            self.core.rng.shuffle(order)
            for ready in order:
                file_id = ready.key[len(prefix) :].decode()
                entry_kv = await self.core.etcd.get(self.keys.entry(task_id, file_id))
                rec = EntryRecord.load(entry_kv.value) if entry_kv else None
                if entry_kv is None or rec is None or rec.state != PENDING:
                    moved = True  # taken while we looked
                    continue
                if await self._deps_ready(rec):
                    return plan_for(entry_kv, rec)
            if len(page) < PAGE:
                break
            page, _, _ = await self.core.etcd.range(
                prefix, start=page[-1].key + b"\0", limit=PAGE, keys_only=True)
        if moved:
            raise Retry()  # every candidate moved while we looked; look again
        raise NothingToClaim(f"nothing to claim in task {task_id!r}", task_id=task_id)

    # commit and fail -------------------------------------------------------------

    async def _live_claim(
        self, reads: Reads, task_id: str, file_id: str, token: int
    ) -> tuple[KV, EntryRecord]:
        """The entry, if ``token`` is the live producer claim on it."""
        check_id("task_id", task_id)
        check_id("file_id", file_id)
        found, claims = await reads.read(
            Get(self.keys.entry(task_id, file_id)),
            Get(self.keys.claim(ClaimRef("p", task_id, file_id))),
        )
        kv, rec = need_entry(found, task_id, file_id)
        if token <= 0 or not claims or claims[0].create_revision != token:
            raise StaleToken(
                f"token {token} is not the live claim on {task_id}/{file_id} "
                "(the claim was lost, superseded or already finished)",
                task_id=task_id, file_id=file_id, token=token,
            )
        if rec.state != WRITING:  # cannot happen while the claim lives; refuse anyway
            raise IllegalTransition(f"entry {file_id!r} is {rec.state}, not writing")
        return kv, rec

    def _finish_claim(
        self, kv: KV, rec: EntryRecord, token: int
    ) -> tuple[list[Compare], list[TxnOp]]:
        ref = ClaimRef("p", rec.task_id, rec.file_id)
        claim = self.keys.claim(ref)
        compares = [unchanged(kv), created_at(claim, token)]
        ops: list[TxnOp] = [Delete(claim), Delete(self.keys.inflight(ref))]
        return compares, ops

    async def commit(self, req: pb.CommitRequest) -> pb.Entry:
        if req.size < 0:
            raise InvalidArgument(f"size {req.size} is negative")
        if req.digest and not DIGEST_RE.match(req.digest):
            raise InvalidArgument("digest must be 64 lower-case hex digits (BLAKE3)")
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.Entry]:
            kv, rec = await self._live_claim(reads, req.task_id, req.file_id, req.token)
            if rec.expected_size and req.size != rec.expected_size:
                raise InvalidArgument(
                    f"size {req.size} differs from the manifest's expected_size "
                    f"{rec.expected_size}", task_id=rec.task_id, file_id=rec.file_id,
                )
            if rec.expected_digest and req.digest and req.digest != rec.expected_digest:
                raise InvalidArgument(
                    "digest differs from the manifest's expected_digest",
                    task_id=rec.task_id, file_id=rec.file_id,
                )
            compares, ops = self._finish_claim(kv, rec, req.token)
            rec.state, rec.size, rec.committed_digest = WRITTEN, req.size, req.digest
            rec.remember("committed", size=req.size, token=req.token)
            obs = rec.observation()
            if obs is not None and obs.size == req.size:
                # The watcher's report came first; settle it now.
                self._settle(rec, obs.size, obs.digest, ops)
            ops.insert(0, Put(kv.key, rec.dump()))
            return Plan(compares, ops, lambda rev: rec.to_pb(staging, revision=rev))

        return await self.core.apply(planner, req.request_id, entry_replay)

    async def fail(self, req: pb.FailRequest) -> pb.Entry:
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.Entry]:
            kv, rec = await self._live_claim(reads, req.task_id, req.file_id, req.token)
            compares, ops = self._finish_claim(kv, rec, req.token)
            self.core.retry_or_dead(rec, f"producer failed: {req.reason or 'no reason given'}",
                                    ops)
            ops.insert(0, Put(kv.key, rec.dump()))
            return Plan(compares, ops, lambda rev: rec.to_pb(staging, revision=rev))

        return await self.core.apply(planner, req.request_id, entry_replay)

    # verification ------------------------------------------------------------------

    def _settle(self, rec: EntryRecord, size: int, digest: str, ops: list[TxnOp]) -> None:
        """A written entry meets what is on disk: verified, or the retry path."""
        expected = rec.committed_digest or rec.expected_digest
        if size == rec.size and (not expected or expected == digest):
            rec.state, rec.digest = VERIFIED, digest
            rec.remember("verified", digest=digest)
            for group in rec.consumers:
                if group not in rec.consumed_by:
                    ops.append(Put(self.keys.cready(rec.task_id, group, rec.file_id), b""))
        else:
            self.core.retry_or_dead(
                rec,
                f"checksum mismatch: producer declared size {rec.size} digest "
                f"{expected or '-'}, file has size {size} digest {digest}",
                ops,
            )

    def _unverify(self, rec: EntryRecord, reason: str, ops: list[TxnOp]) -> None:
        """The verified bytes are gone: nobody may be handed them any more, and
        consumers holding them lose their tokens; the entry takes the retry path."""
        for group in rec.consumers:
            ref = ClaimRef("c", rec.task_id, rec.file_id, group)
            ops.append(Delete(self.keys.cready(rec.task_id, group, rec.file_id)))
            ops.append(Delete(self.keys.claim(ref)))
            ops.append(Delete(self.keys.inflight(ref)))
        self.core.retry_or_dead(rec, reason, ops)

    async def problem(self, req: pb.ProblemReport) -> pb.Entry:
        """A watcher cannot vouch for a file: corrupted, or missing after the commit."""
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        kinds = {pb.ProblemReport.CORRUPTED: "corrupted", pb.ProblemReport.MISSING: "missing"}
        if req.kind not in kinds:
            raise InvalidArgument("a problem report needs kind CORRUPTED or MISSING")
        reason = f"{kinds[req.kind]}: {req.reason or 'no reason given'}"
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.Entry]:
            (found,) = await reads.read(Get(self.keys.entry(req.task_id, req.file_id)))
            kv, rec = need_entry(found, req.task_id, req.file_id)
            ops: list[TxnOp] = []
            if rec.state == WRITTEN:
                self.core.retry_or_dead(rec, reason, ops)
            elif rec.state == VERIFIED:
                self._unverify(rec, reason, ops)
            elif rec.state == WRITING and rec.observed is not None:
                rec.observed = None  # what was seen before the commit no longer holds
                rec.remember(kinds[req.kind], reason=req.reason, reporter=req.reporter)
            else:  # nothing on disk was vouched for: nothing to undo
                return Plan([unchanged(kv)], [], lambda rev: rec.to_pb(staging, revision=rev))
            ops.insert(0, Put(kv.key, rec.dump()))
            return Plan([unchanged(kv)], ops, lambda rev: rec.to_pb(staging, revision=rev))

        return await self.core.apply(planner, req.request_id, entry_replay)

    async def report(self, req: pb.VerificationReport) -> pb.Entry:
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        if req.size < 0 or not DIGEST_RE.match(req.digest):
            raise InvalidArgument("a report needs size ≥ 0 and a 64-hex-digit BLAKE3 digest")
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.Entry]:
            (found,) = await reads.read(Get(self.keys.entry(req.task_id, req.file_id)))
            kv, rec = need_entry(found, req.task_id, req.file_id)
            ops: list[TxnOp] = []
            if rec.state in (PENDING, WRITING):
                rec.observed = {
                    "size": req.size, "digest": req.digest, "inode": req.identity.inode,
                    "device": req.identity.device, "mtime_ns": req.identity.mtime_ns,
                    "reporter": req.reporter, "at": now(),
                }
            elif rec.state == WRITTEN:
                self._settle(rec, req.size, req.digest, ops)
            elif rec.state == VERIFIED and req.digest != rec.digest:
                self._unverify(rec, f"verified file changed on disk (now size {req.size} "
                               f"digest {req.digest})", ops)
            else:  # consumed, dead, or a repeat of what is known: nothing to do
                return Plan([unchanged(kv)], [], lambda rev: rec.to_pb(staging, revision=rev))
            ops.insert(0, Put(kv.key, rec.dump()))
            return Plan([unchanged(kv)], ops, lambda rev: rec.to_pb(staging, revision=rev))

        return await self.core.apply(planner, req.request_id, entry_replay)



