"""What watchers report: a file's digest (written → verified, or the retry path),
a verified file that changed or vanished (out of verified), a file that cannot be hashed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...kernel import tracing
from ...kernel.errors import InvalidArgument, StaleReport, TaskNotActive
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import ANONYMOUS, Caller
from ..records.manifest import DIGEST_RE, check_id, check_traceparent
from ..records.model import PENDING, VERIFIED, WRITING, WRITTEN, EntryRecord, Observation, now
from ..records.routing import Rule, route
from ..rules.checks import VOID, entry_replay, need_task, task_status
from ..rules.claim import end
from ..rules.core import Core
from ..rules.machine import Event, apply
from ..store.keys import ClaimRef
from ..store.txn import Txn
from .shards import check_reporter, reported_entry

#: the most observations of uncommitted attempts a replica keeps in memory (the oldest
#: go first: their commits then wait for the watcher's report after them)
EARLY_KEPT = 65_536


class Verifier:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys
        #: what a watcher saw of a live attempt's file before its commit, by entry: the
        #: observation (its ``token`` names the attempt). Kept here, not in etcd: it is
        #: a hint the commit of that very attempt on this replica takes; a commit
        #: elsewhere, or after a restart, waits for the watcher's report after it.
        self.early = core.early

    def keep_early(self, task_id: str, file_id: str, seen: dict[str, Any]) -> None:
        key = (task_id, file_id)
        self.early[key] = seen
        self.early.move_to_end(key)
        while len(self.early) > EARLY_KEPT:
            self.early.popitem(last=False)

    def early_of(self, txn: Txn, task_id: str, file_id: str, token: int
                 ) -> Observation | None:
        """For a commit's ``txn``: the observation kept of the attempt with ``token``,
        if any (no longer kept once the commit applies, whatever it decided). While the
        commit is on its way its entry is reserved: a report meanwhile goes the
        transactional way (``_keep_early``), whose write makes one of the two plan
        again and see the other, as a report kept on the entry always did."""
        key = (task_id, file_id)
        if self.core.view is not None and not txn.fresh:
            self.core.view.reserve(txn, self.keys.entry(task_id, file_id))
        seen = self.early.get(key)
        if seen is None:
            return None

        def taken() -> None:
            self.early.pop(key, None)

        txn.after(taken)
        return Observation(**seen) if seen["token"] == token else None

    def notify(self, rec: EntryRecord, txn: Txn) -> None:
        """In the transaction that makes ``rec`` verified: if anything waits for it
        (dependents, an assembly), its wake key (what the leader's scheduler reads to
        check them, whichever replica verified it), and a hook telling this replica's
        scheduler at once."""
        if not (rec.dependents or rec.assembly):
            return
        txn.put(self.core.keys.wake(rec.task_id, rec.file_id), b"")
        key = (rec.task_id, rec.file_id)
        txn.after(lambda: self.core.verified.put_nowait(key))

    async def settle(self, txn: Txn, rec: EntryRecord, size: int, digest: str,
                     who: str = "", label: str = "", traceparent: str = "") -> bool:
        """A written entry meets what is on disk: verified (True), or the retry path.
        ``who``: the identity of the watcher that reported it, ``label`` the name it
        gave itself, ``traceparent`` its verification span (kept on the entry: its
        consumers' spans follow it)."""
        expected = rec.committed_digest or rec.expected_digest
        if self.matches(rec, size, digest):
            apply(rec, Event.VERIFY)
            rec.digest = digest
            if traceparent:
                rec.traceparent = traceparent
            routed = await self.route(txn, rec)
            rec.remember("verified", who=who, label=label, digest=digest, **routed)
            self.open_to_consumers(rec, txn)
            return True
        self.core.retry_or_dead(
            rec,
            f"checksum mismatch: producer declared size {rec.size} digest "
            f"{expected or '-'}, file has size {size} digest {digest}", who=who,
        )
        return False

    @staticmethod
    def matches(rec: EntryRecord, size: int, digest: str) -> bool:
        """Whether a written entry's file, of ``size`` and ``digest``, is what its
        producer committed."""
        expected = rec.committed_digest or rec.expected_digest
        return size == rec.size and (not expected or expected == digest)

    async def route(self, txn: Txn, rec: EntryRecord) -> dict[str, object]:
        """Decide which consumer groups receive ``rec``, now verified: the first of the
        task's routing rules that holds over its attributes, or every group. What was
        decided, for the journal record of the verification ({} for an entry the
        rules do not route).

        The rules are on the task header, which the view mirrors: peeked at, not
        pinned (a manifest never changes), so routing costs no etcd request and no
        compare. Entries of tasks without rules never look.
        """
        rec.unroute()
        if not rec.routing:
            return {}
        (task_kv,) = await txn.peek_many([self.keys.task(rec.task_id)])
        task = need_task(task_kv, rec.task_id)
        rules = [Rule(r["condition"], list(r["groups"]), dict(r.get("pools", {})))
                 for r in task.routing_rules]
        decided = route(rules, rec.attributes)
        if decided is None:
            return {"rule": None, "groups": list(rec.consumers)}
        rec.rule, rec.routed_to = decided
        rec.routed_pools = dict(rules[rec.rule].pools)
        return {"rule": rec.rule, "groups": list(rec.routed_to)}

    def open_to_consumers(self, rec: EntryRecord, txn: Txn) -> None:
        """Make a verified entry claimable for the groups that receive it (and have not
        acked it yet); the others never see it."""
        for group in rec.receivers:
            if group not in rec.consumed_by:
                txn.put(self.keys.cready(rec.task_id, group, rec.file_id), b"")

    async def unverify(self, txn: Txn, rec: EntryRecord, reason: str) -> None:
        """The verified bytes are gone: nobody may be handed them any more, and
        consumers holding them lose their tokens (and slots); the entry takes the
        retry path."""
        await self.revoke_consumers(txn, rec)
        self.core.retry_or_dead(rec, reason)
        if rec.assembly:
            await self._unverify_assembly(txn, rec)

    async def revoke_consumers(self, txn: Txn, rec: EntryRecord, ended: str = "") -> None:
        """Nobody may be handed ``rec``'s bytes any more: its consume-claims die (their
        slots freed) and its groups' claimable keys go, the delayed ones of its nacks
        too, guarded on the claims read. ``ended``: a group whose claim the caller
        ended already (a nack that gives the entry up)."""
        refs = [ClaimRef("c", rec.task_id, rec.file_id, g) for g in rec.consumers]
        mine = [r for r in refs if r.group != ended]
        held = await txn.get_many([self.keys.claim(r) for r in mine])
        # a twin whose claim's lease ended names the pool unit it still holds
        twins = await txn.peek_many([self.keys.inflight(r) for r in mine
                                     if rec.consume_pool(r.group)])
        claims, lone = iter(held), iter(twins)
        for ref in refs:
            txn.delete(self.keys.cready(rec.task_id, ref.group, rec.file_id))
            if ref.group != ended:
                twin = next(lone) if rec.consume_pool(ref.group) else None
                # a lone twin goes too (with the unit it names)
                end(self.core, txn, ref, next(claims), guard=True, twin=twin)
        for group, until in rec.nacked_until.items():
            txn.delete(self.keys.cdelayed(rec.task_id, int(until * 1000), group,
                                          rec.file_id))

    async def _unverify_assembly(self, txn: Txn, part: EntryRecord) -> None:
        """A part left verified: its assembly learns of it in the same transaction.

        A verified assembly leaves verified too and waits for its parts again (the
        scheduler re-verifies it). An assembly still waiting is written anyway, so
        its mod revision moves: a release planned on the parts as they were (the
        scheduler pins only the assembly, not its hundreds of parts) then fails its
        compare and is planned again.
        """
        kv = await txn.get(self.keys.entry(part.task_id, part.assembly))
        if kv is None:
            return
        asm = EntryRecord.load(kv.value)
        if asm.state == VERIFIED:
            await self.revoke_consumers(txn, asm)
            apply(asm, Event.UNVERIFY)
            asm.error = f"part {part.file_id} left verified: {part.error}"
            asm.remember("unverified", reason=asm.error)
            self.core.put_entry(asm, txn)
        elif asm.state == PENDING:
            txn.put(kv.key, asm.dump())

    async def not_cancelled(self, txn: Txn, rec: EntryRecord, what: str) -> None:
        """Refuse a watcher's report that would change an entry of a cancelled task
        (``TaskNotActive``): its entries stay as they were, a file committed before the
        cancel stays written. The header is pinned in the report's own transaction, so
        a cancel applied meanwhile fails its compare and the report, planned again, is
        refused: whichever etcd applies first decides, never a read made earlier."""
        status = task_status(await txn.get(self.keys.task(rec.task_id)), rec.task_id)
        if status in VOID:
            raise TaskNotActive(
                f"task {rec.task_id!r} is {status}: its entries stay as they were; "
                f"the {what} of {rec.file_id!r} is not taken", task_id=rec.task_id,
                file_id=rec.file_id, status=status)

    @staticmethod
    def current(rec: EntryRecord, token: int) -> bool:
        """Whether the file of the attempt with ``token`` may be ``rec``'s bytes: once
        committed, only the committed attempt's; before, any but an attempt older than
        one already seen (the commit takes an observation of its own token only).
        Pending, no attempt is live: a file on disk is a dead attempt's. Token 0 (not
        said: a watcher always says) is taken as the current attempt's."""
        if not token:
            return True
        if rec.state in (WRITTEN, VERIFIED):
            return token == rec.committed_token
        if rec.state == WRITING:
            return token > 0 and token >= (rec.observed or {}).get("token", 0)
        return rec.state != PENDING

    async def problem(self, req: pb.ReportProblemRequest, caller: Caller = ANONYMOUS) -> pb.Entry:
        """A watcher cannot vouch for a file: corrupted, or missing after the commit."""
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        kinds = {pb.ReportProblemRequest.KIND_CORRUPTED: "corrupted",
                 pb.ReportProblemRequest.KIND_MISSING: "missing"}
        if req.kind not in kinds:
            raise InvalidArgument("a problem report needs kind CORRUPTED or MISSING")
        reason = f"{kinds[req.kind]}: {req.reason or 'no reason given'}"
        staging = self.core.staging_dir(req.task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.Entry]:
            _, rec = await reported_entry(txn, self.keys, req, caller)
            if not self.current(rec, req.token):
                pass  # another attempt's file: never the entry's bytes, nothing to undo
            elif rec.state == WRITTEN and not rec.parts:
                await self.not_cancelled(txn, rec, "problem report")
                self.core.retry_or_dead(rec, reason, who=caller.name)
            elif rec.state == VERIFIED and not rec.parts:
                await self.not_cancelled(txn, rec, "problem report")
                await self.unverify(txn, rec, reason)
            elif rec.state == WRITING and rec.observed is not None and (
                    req.token in (0, rec.observed.get("token", 0))):
                await self.not_cancelled(txn, rec, "problem report")
                rec.observed = None  # what was seen before the commit no longer holds
                rec.remember(kinds[req.kind], who=caller.name, label=req.reporter,
                             reason=req.reason)
            else:  # nothing on disk was vouched for: nothing to undo
                return lambda rev: rec.to_pb(staging, revision=rev)
            self.core.put_entry(rec, txn)
            return lambda rev: rec.to_pb(staging, revision=rev)

        return await self.core.txns.run(planner, req.request_id, entry_replay)

    async def _keep_early(self, req: pb.ReportVerificationRequest, caller: Caller,
                          staging: str) -> pb.Entry | None:
        """A report of an attempt's file before its commit, answered from this replica's
        view with no transaction: kept in memory (``early``) while the entry is being
        written, and nothing to do while it is pending (a dead attempt's file, or one
        whose claim another replica made: its commit then waits for the report after
        it). None when the report must go the transactional way: the view is not
        serving, or older than the entry the watcher saw (another replica moved it),
        the entry is in another state, its commit is on its way, or an attempt newer
        than this one was seen already. The watcher and its shard are checked as for
        any report."""
        txn, view = self.core.txns.peek(), self.core.view
        if txn is None or view is None:
            return None
        # The entry first: most reports come after the commit, and go the other way.
        (kv,) = await txn.peek_many([self.keys.entry(req.task_id, req.file_id)])
        if kv is None or kv.mod_revision < req.seen_revision or view.reserved(kv.key):
            return None
        rec = EntryRecord.load(kv.value)
        if rec.state not in (PENDING, WRITING) or rec.parts or rec.observed is not None:
            return None
        await check_reporter(txn, self.keys, req.task_id, req.watcher_id, req.shard_epoch,
                             caller)
        if view.reserved(kv.key):  # a commit of it began meanwhile
            return None
        if rec.state == PENDING:
            return rec.to_pb(staging, revision=kv.mod_revision)
        if rec.state != WRITING:
            return None
        key = (rec.task_id, rec.file_id)
        if (early := self.early.get(key)) is not None and early["token"] > req.token:
            return None  # an older attempt's file, reported late: the newer one counts
        self.keep_early(rec.task_id, rec.file_id, _observed(req, caller))
        return rec.to_pb(staging, revision=kv.mod_revision)

    async def report(self, req: pb.ReportVerificationRequest,
                     caller: Caller = ANONYMOUS) -> pb.Entry:
        if tracing.ENABLED and req.traceparent and tracing.valid(req.traceparent):
            # the watcher's verification span is the parent (a batch carries many)
            with tracing.using(tracing.start("baton.registry/ReportVerification",
                                             parent=req.traceparent,
                                             attributes=tracing.call_attributes(req))):
                return await self._report(req, caller)
        return await self._report(req, caller)

    async def _report(self, req: pb.ReportVerificationRequest, caller: Caller) -> pb.Entry:
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        if req.size < 0 or not DIGEST_RE.match(req.digest):
            raise InvalidArgument("a report needs size ≥ 0 and a 64-hex-digit BLAKE3 digest")
        check_traceparent(req.traceparent)
        staging = self.core.staging_dir(req.task_id)
        if req.token and (kept := await self._keep_early(req, caller, staging)) is not None:
            return kept

        async def planner(txn: Txn) -> Callable[[int], pb.Entry]:
            kv, rec = await reported_entry(txn, self.keys, req, caller)
            if rec.parts or not self.current(rec, req.token):
                # An assembly has no file of its own; another attempt's file is never
                # the entry's bytes, whatever it holds.
                return lambda rev: rec.to_pb(staging, revision=rev)
            moved = bool(req.seen_revision) and kv is not None and (
                kv.mod_revision != req.seen_revision)
            if moved and (
                    (rec.state == WRITTEN and not self.matches(rec, req.size, req.digest))
                    or (rec.state == VERIFIED and req.digest != rec.digest)):
                raise StaleReport(
                    f"{req.task_id}/{req.file_id} moved since the watcher read its file "
                    f"(revision {req.seen_revision}, now {kv.mod_revision if kv else 0}, "
                    f"{rec.state}): the report is not judged; look again",
                    task_id=req.task_id, file_id=req.file_id,
                    seen_revision=req.seen_revision)
            changes = rec.state in (PENDING, WRITING, WRITTEN) or (
                rec.state == VERIFIED and req.digest != rec.digest)
            if changes:
                await self.not_cancelled(txn, rec, "verification report")
            if rec.state in (PENDING, WRITING):
                rec.observed = _observed(req, caller)
            elif rec.state == WRITTEN:
                if await self.settle(txn, rec, req.size, req.digest, who=caller.name,
                                     label=req.reporter, traceparent=req.traceparent):
                    self.notify(rec, txn)
            elif rec.state == VERIFIED and req.digest != rec.digest:
                await self.unverify(txn, rec, f"verified file changed on disk (now size "
                                    f"{req.size} digest {req.digest})")
            else:  # consumed, dead, or a repeat of what is known: nothing to do
                return lambda rev: rec.to_pb(staging, revision=rev)
            self.core.put_entry(rec, txn)
            return lambda rev: rec.to_pb(staging, revision=rev)

        return await self.core.txns.run(planner, req.request_id, entry_replay)


def _observed(req: pb.ReportVerificationRequest, caller: Caller) -> dict[str, Any]:
    """What a report before the commit says was on disk (an ``Observation``'s fields)."""
    return {
        "size": req.size, "digest": req.digest, "inode": req.identity.inode,
        "device": req.identity.device, "mtime_ns": req.identity.mtime_ns,
        "reporter": req.reporter, "identity": caller.name, "at": now(),
        "token": req.token,
        **({"traceparent": req.traceparent} if req.traceparent else {}),
    }
