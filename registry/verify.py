"""What watchers report: a file's digest (written → verified, or the retry path),
a verified file that changed or vanished (out of verified), a file that cannot be hashed."""

from __future__ import annotations

from collections.abc import Callable

from client.errors import InvalidArgument
from client.v1 import baton_pb2 as pb

from ._etcd import Compare, Delete, Get, Put, TxnOp, absent, created_at, unchanged
from .core import Core, Plan, Reads, entry_replay, need_entry, release_slot
from .keys import ClaimRef
from .manifest import DIGEST_RE, check_id
from .model import PENDING, VERIFIED, WRITING, WRITTEN, EntryRecord, now


class Verifier:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys

    def notify(self, rec: EntryRecord) -> Callable[[], None]:
        """A hook telling the scheduler ``rec`` became verified (dependents, assembly)."""
        key = (rec.task_id, rec.file_id)
        return lambda: self.core.verified.put_nowait(key)

    def settle(self, rec: EntryRecord, size: int, digest: str, ops: list[TxnOp],
               who: str = "") -> bool:
        """A written entry meets what is on disk: verified (True), or the retry path."""
        expected = rec.committed_digest or rec.expected_digest
        if size == rec.size and (not expected or expected == digest):
            rec.state, rec.digest, rec.error = VERIFIED, digest, ""
            rec.remember("verified", who=who or str((rec.observed or {}).get("reporter", "")),
                         digest=digest)
            self.open_to_consumers(rec, ops)
            return True
        self.core.retry_or_dead(
            rec,
            f"checksum mismatch: producer declared size {rec.size} digest "
            f"{expected or '-'}, file has size {size} digest {digest}",
            ops,
        )
        return False

    def open_to_consumers(self, rec: EntryRecord, ops: list[TxnOp]) -> None:
        for group in rec.consumers:
            if group not in rec.consumed_by:
                ops.append(Put(self.keys.cready(rec.task_id, group, rec.file_id), b""))

    async def unverify(self, rec: EntryRecord, reason: str, compares: list[Compare],
                       ops: list[TxnOp]) -> None:
        """The verified bytes are gone: nobody may be handed them any more, and
        consumers holding them lose their tokens (and slots); the entry takes the
        retry path."""
        await self._revoke_consumers(rec, compares, ops)
        self.core.retry_or_dead(rec, reason, ops)
        if rec.assembly:
            await self._unverify_assembly(rec, compares, ops)

    async def _revoke_consumers(self, rec: EntryRecord, compares: list[Compare],
                                ops: list[TxnOp]) -> None:
        """Nobody may be handed ``rec``'s bytes any more: its consume-claims die (their
        slots freed) and its groups' claimable keys go, guarded on the claims read."""
        refs = [ClaimRef("c", rec.task_id, rec.file_id, g) for g in rec.consumers]
        held = await self.core.etcd.read([Get(self.keys.claim(r)) for r in refs])
        for ref, claims in zip(refs, held, strict=True):
            ops.append(Delete(self.keys.cready(rec.task_id, ref.group, rec.file_id)))
            ops.append(Delete(self.keys.inflight(ref)))
            if claims:
                compares.append(created_at(claims[0].key, claims[0].create_revision))
                ops.append(Delete(claims[0].key))
                release_slot(self.core, claims[0], ops)
            else:
                compares.append(absent(self.keys.claim(ref)))

    async def _unverify_assembly(self, part: EntryRecord, compares: list[Compare],
                                 ops: list[TxnOp]) -> None:
        """A part left verified: its verified assembly does too, in the same transaction,
        and waits for its parts again (the scheduler re-verifies it)."""
        kv = await self.core.etcd.get(self.keys.entry(part.task_id, part.assembly))
        if kv is None:
            return
        asm = EntryRecord.load(kv.value)
        compares.append(unchanged(kv))
        if asm.state != VERIFIED:
            return
        await self._revoke_consumers(asm, compares, ops)
        asm.state, asm.deps_ok, asm.size, asm.digest = PENDING, False, 0, ""
        asm.error = f"part {part.file_id} left verified: {part.error}"
        asm.remember("unverified", reason=asm.error)
        self.core.put_entry(asm, ops)

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
            compares = [unchanged(kv)]
            if rec.state == WRITTEN and not rec.parts:
                self.core.retry_or_dead(rec, reason, ops)
            elif rec.state == VERIFIED and not rec.parts:
                await self.unverify(rec, reason, compares, ops)
            elif rec.state == WRITING and rec.observed is not None:
                rec.observed = None  # what was seen before the commit no longer holds
                rec.remember(kinds[req.kind], who=req.reporter, reason=req.reason)
            else:  # nothing on disk was vouched for: nothing to undo
                return Plan([unchanged(kv)], [], lambda rev: rec.to_pb(staging, revision=rev))
            self.core.put_entry(rec, ops)
            return Plan(compares, ops, lambda rev: rec.to_pb(staging, revision=rev))

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
            compares = [unchanged(kv)]
            applied = None
            if rec.parts:  # an assembly has no file of its own
                return Plan([unchanged(kv)], [], lambda rev: rec.to_pb(staging, revision=rev))
            if rec.state in (PENDING, WRITING):
                rec.observed = {
                    "size": req.size, "digest": req.digest, "inode": req.identity.inode,
                    "device": req.identity.device, "mtime_ns": req.identity.mtime_ns,
                    "reporter": req.reporter, "at": now(),
                }
            elif rec.state == WRITTEN:
                if self.settle(rec, req.size, req.digest, ops, who=req.reporter):
                    applied = self.notify(rec)
            elif rec.state == VERIFIED and req.digest != rec.digest:
                await self.unverify(rec, f"verified file changed on disk (now size {req.size} "
                                    f"digest {req.digest})", compares, ops)
            else:  # consumed, dead, or a repeat of what is known: nothing to do
                return Plan([unchanged(kv)], [], lambda rev: rec.to_pb(staging, revision=rev))
            self.core.put_entry(rec, ops)
            return Plan(compares, ops, lambda rev: rec.to_pb(staging, revision=rev), applied)

        return await self.core.apply(planner, req.request_id, entry_replay)
