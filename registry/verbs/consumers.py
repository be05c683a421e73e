"""Consumer transitions: consume (lease a verified entry to one agent of a group), ack, nack."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...kernel.errors import IllegalTransition, InvalidArgument, NothingToClaim
from ...kernel.v1 import baton_pb2 as pb
from ..records.access import check_consumer, consumers_of
from ..records.identity import Caller
from ..records.manifest import check_delay, check_id
from ..records.model import VERIFIED, EntryRecord
from ..rules.checks import (
    Slots,
    actor_of,
    batch_replay,
    check_owner,
    check_session_id,
    entry_replay,
    need_entry,
    need_session,
    need_task,
)
from ..rules.claim import PAGE, Ask, Head, check_live, end, pick, take
from ..rules.core import Core
from ..rules.machine import Event, apply
from ..store.etcd import KV, present
from ..store.keys import ClaimRef
from ..store.txn import MAX_TXN_OPS, Txn
from .checkpoints import drop, resume
from .verify import Verifier

#: operations one ack adds to a transaction: the claim, its twin and its slot deleted,
#: the entry and its journal record written, its open key deleted once consumed
OPS_PER_ACK = 6
#: acks in one AckBatch: what fits in one transaction
MAX_ACKS = MAX_TXN_OPS // OPS_PER_ACK
#: operations one consume adds to a transaction: its claimable key deleted, its slot,
#: claim, twin, deadline and journal record written (compares: four)
OPS_PER_CONSUME = 6
#: leases in one ConsumeBatch: what fits in one transaction
MAX_CONSUMES = MAX_TXN_OPS // OPS_PER_CONSUME


def _consumable(group: str) -> Callable[[EntryRecord], bool]:
    """Whether an entry may be leased to ``group``: verified, routed to it, not yet
    consumed by it."""
    def consumable(rec: EntryRecord) -> bool:
        return (rec.state == VERIFIED and group in rec.receivers
                and group not in rec.consumed_by)
    return consumable


def _leased(rec: EntryRecord, staging: str, revision: int, token: int, group: str,
            checkpoint: pb.Checkpoint | None = None, attempt: int = 1) -> pb.ConsumeResponse:
    """The reply for one lease: the entry as read (at ``revision``), its token, and
    the checkpoint an earlier lease of the group left with this lease's number."""
    entry = rec.to_pb(staging, revision=revision)
    # The verified attempt's file; an assembly has none of its own (its parts do).
    path = entry.abs_attempt_path or entry.abs_path
    return pb.ConsumeResponse(entry=entry, token=token, path=path, size=rec.size,
                              digest=rec.digest, group=group, checkpoint=checkpoint,
                              attempt=attempt)


class Consumers:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys
        self.verifier = Verifier(core)

    async def consume(self, req: pb.ConsumeRequest, caller: Caller) -> pb.ConsumeResponse:
        check_id("task_id", req.task_id)
        check_id("group", req.group)
        if req.file_id:
            check_id("file_id", req.file_id)
        check_session_id(req.session_id)
        staging = self.core.staging_dir(req.task_id)

        consumable = _consumable(req.group)

        async def planner(txn: Txn) -> Callable[[int], pb.ConsumeResponse]:
            slots = await self._session(txn, req.task_id, req.group, req.session_id, caller)
            if req.file_id:
                entry_kv, cready = await txn.get_many([
                    self.keys.entry(req.task_id, req.file_id),
                    self.keys.cready(req.task_id, req.group, req.file_id)])
                rec = need_entry(entry_kv, req.task_id, req.file_id)
                if req.group not in rec.consumers:
                    raise InvalidArgument(
                        f"group {req.group!r} is not a consumer of {rec.file_id!r} "
                        f"(consumers: {rec.consumers})"
                    )
                if rec.state == VERIFIED and req.group not in rec.receivers:
                    raise IllegalTransition(
                        f"entry {rec.file_id!r} was routed to {rec.receivers} by the task's "
                        f"routing rule {rec.rule}, not to group {req.group!r}",
                        task_id=rec.task_id, file_id=rec.file_id, state=rec.state)
                if not consumable(rec) or cready is None:
                    raise IllegalTransition(
                        f"entry {rec.file_id!r} is {rec.state} and not available to group "
                        f"{req.group!r} (consumed by {rec.consumed_by}, or held by another "
                        "agent)", task_id=rec.task_id, file_id=rec.file_id, state=rec.state,
                    )
                assert entry_kv is not None
            else:
                ((entry_kv, rec),) = await self._pick(txn, req.task_id, req.group,
                                                      consumable, slots)
            resumed = await self._lease(txn, rec, req.group, slots, caller)
            revision = entry_kv.mod_revision

            return lambda rev: _leased(rec, staging, revision, rev, req.group, *resumed)

        def replay(raw: bytes, rev: int) -> pb.ConsumeResponse:
            resp = pb.ConsumeResponse.FromString(raw)
            resp.token = rev
            return resp

        return await self.core.txns.run(planner, req.request_id, replay)

    async def _session(self, txn: Txn, task_id: str, group: str, session_id: int,
                       caller: Caller) -> Slots:
        """The session's slots, once the task is active (paused: no new leases), the
        session the caller's and the caller one of the group's consumers."""
        task_kv, agent_kv = await txn.get_many([self.keys.task(task_id),
                                                self.keys.agent(session_id)])
        task = need_task(task_kv, task_id, active=True)
        record = need_session(agent_kv, session_id)
        check_owner(caller, agent_kv, f"session {session_id:x}")
        check_consumer(caller, task_id, group, consumers_of(task.access, group))
        return await Slots.read(txn, self.keys, record)

    async def _lease(self, txn: Txn, rec: EntryRecord, group: str, slots: Slots,
                     caller: Caller) -> tuple[pb.Checkpoint | None, int]:
        """Add one consume-claim (a lease of a verified entry to the session) to a
        transaction being planned: guarded on the entry's claimable key for ``group``.
        Returns the checkpoint an earlier lease of the group left, and this lease's
        number."""
        ref = ClaimRef("c", rec.task_id, rec.file_id, group)
        # first: a session without a free slot is refused before anything is written
        await take(self.core, txn, ref, slots, caller.name, rec.consume_deadline,
                   rec.stall_after, pool=rec.consume_pool(group))
        cready_key = self.keys.cready(rec.task_id, group, rec.file_id)
        txn.require(present(cready_key))
        txn.delete(cready_key)
        self.core.journal_only(rec, "consuming", txn, who=caller.name, label=slots.agent,
                               group=group)
        return await resume(self.core, txn, rec, ref)

    async def consume_batch(self, req: pb.ConsumeBatchRequest,
                            caller: Caller) -> pb.ConsumeBatchResponse:
        """Lease up to ``max`` verified entries to one session for ``group`` in one
        transaction (as many as etcd's operation limit allows), all or nothing; each
        lease's token is that transaction's revision."""
        check_id("task_id", req.task_id)
        check_id("group", req.group)
        check_session_id(req.session_id)
        if req.max < 1:
            raise InvalidArgument("max must be at least 1")
        want = min(req.max, MAX_CONSUMES)
        staging = self.core.staging_dir(req.task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.ConsumeBatchResponse]:
            slots = await self._session(txn, req.task_id, req.group, req.session_id, caller)
            free = slots.free
            picked = await self._pick(txn, req.task_id, req.group, _consumable(req.group),
                                      slots, want if free is None else max(1, min(want, free)))
            resumed = [await self._lease(txn, rec, req.group, slots, caller)
                       for _, rec in picked]

            def reply(rev: int) -> pb.ConsumeBatchResponse:
                return pb.ConsumeBatchResponse(leases=[
                    _leased(rec, staging, kv.mod_revision, rev, req.group, *r)
                    for (kv, rec), r in zip(picked, resumed, strict=True)])

            return reply

        def replay(raw: bytes, rev: int) -> pb.ConsumeBatchResponse:
            resp = pb.ConsumeBatchResponse.FromString(raw)
            for lease in resp.leases:
                lease.token = rev
            return resp

        return await self.core.txns.run(planner, req.request_id, replay)

    async def _pick(self, txn: Txn, task_id: str, group: str,
                    consumable: Callable[[EntryRecord], bool], slots: Slots,
                    want: int = 1) -> list[tuple[KV, EntryRecord]]:
        """Up to ``want`` consumable entries from the head of the group's claimable
        index, in a random order (concurrent consumers read the same head)."""
        base = self.keys.cready_all(task_id, group)
        page = await txn.scan(base, PAGE, keys_only=True)
        head = Head(task_id, page, len(page), base,
                    current=lambda rec, _key: consumable(rec),
                    nothing=lambda _denied: NothingToClaim(
                        f"nothing to consume for group {group!r} in task {task_id!r}",
                        task_id=task_id, group=group),
                    pool_of=lambda rec: rec.consume_pool(group), pools=slots.pools)
        return await pick(self.core, txn, head, want)

    async def _live(
        self, txn: Txn, acks: Sequence[pb.AckRequest | pb.NackRequest], caller: Caller,
    ) -> list[tuple[KV, EntryRecord]]:
        """The live consume-claim of each (task, file, group, token) and its entry, held
        by the caller (and by ``session_id`` when not 0), in a task not cancelled; read
        in one round trip. Deletes the claims (with their twins, freeing their slots)
        in ``txn``, guarded on the tokens. Acks of one entry share its record, so that
        each sees the groups the others acked."""
        for a in acks:
            check_id("task_id", a.task_id)
            check_id("file_id", a.file_id)
            check_id("group", a.group)
        asks = [Ask(ClaimRef("c", a.task_id, a.file_id, a.group), a.token, a.session_id)
                for a in acks]
        out = await check_live(self.core, txn, asks, caller)
        for ask, (claim, _) in zip(asks, out, strict=True):
            end(self.core, txn, ask.ref, claim, guard=True)  # guarded on the token
        return out

    def _ack(self, txn: Txn, rec: EntryRecord, claim: KV, req: pb.AckRequest) -> None:
        """One group's ack of a verified entry (the caller writes the entry); the
        group's checkpoint is moot from then on."""
        if rec.state != VERIFIED:
            raise IllegalTransition(
                f"entry {rec.file_id!r} is {rec.state}: its verified bytes are gone "
                f"({rec.error or 'no reason recorded'})", task_id=rec.task_id,
                file_id=rec.file_id, state=rec.state,
            )
        if req.group not in rec.consumed_by:
            rec.consumed_by.append(req.group)
        drop(self.core, txn, rec, ClaimRef("c", rec.task_id, rec.file_id, req.group))
        rec.remember("acked", **actor_of(claim), group=req.group, token=req.token)
        if all(g in rec.consumed_by for g in rec.receivers):
            apply(rec, Event.CONSUME)

    async def ack(self, req: pb.AckRequest, caller: Caller) -> pb.Entry:
        staging = self.core.staging_dir(req.task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.Entry]:
            ((claim, rec),) = await self._live(txn, [req], caller)
            self._ack(txn, rec, claim, req)
            self.core.put_entry(rec, txn)
            return lambda rev: rec.to_pb(staging, revision=rev)

        return await self.core.txns.run(planner, req.request_id, entry_replay)

    async def ack_batch(self, req: pb.AckBatchRequest,
                        caller: Caller) -> pb.AckBatchResponse:
        """Ack many consume-claims in one transaction, all or nothing; as many as fit
        etcd's operation limit by construction, as CommitBatch."""
        if not req.acks:
            raise InvalidArgument("a batch needs at least one ack")
        if len(req.acks) > MAX_ACKS:
            raise InvalidArgument(
                f"{len(req.acks)} acks in one batch; at most {MAX_ACKS} (etcd's operation "
                "limit per transaction)")
        seen: dict[tuple[str, str, str], int] = {}
        for i, a in enumerate(req.acks):
            key = (a.task_id, a.file_id, a.group)
            if key in seen:
                raise InvalidArgument(
                    f"acks [{seen[key]}] and [{i}] both ack {a.task_id}/{a.file_id} for "
                    f"group {a.group!r}")
            seen[key] = i

        async def planner(txn: Txn) -> Callable[[int], pb.AckBatchResponse]:
            live = await self._live(txn, req.acks, caller)
            for (claim, rec), a in zip(live, req.acks, strict=True):
                self._ack(txn, rec, claim, a)
            written = list({id(rec): rec for _, rec in live}.values())
            for rec in written:
                self.core.put_entry(rec, txn)

            def reply(rev: int) -> pb.AckBatchResponse:
                return pb.AckBatchResponse(entries=[
                    rec.to_pb(self.core.staging_dir(rec.task_id), revision=rev)
                    for _, rec in live])

            return reply

        return await self.core.txns.run(planner, req.request_id,
                                        batch_replay(pb.AckBatchResponse))

    async def nack(self, req: pb.NackRequest, caller: Caller) -> pb.Entry:
        """Hand a consume-claim back: the entry is the group's to take again, at once or
        after ``delay_seconds``; ``permanent``: it can never be consumed, and goes dead
        for every group. Bad delays are refused before anything is read."""
        check_delay("delay_seconds", req.delay_seconds, permanent=req.permanent)
        staging = self.core.staging_dir(req.task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.Entry]:
            ((claim, rec),) = await self._live(txn, [req], caller)
            details = {"permanent": True} if req.permanent else (
                {"delay": req.delay_seconds} if req.delay_seconds else {})
            rec.remember("nacked", **actor_of(claim), group=req.group, token=req.token,
                         reason=req.reason, **details)
            if rec.state == VERIFIED and req.permanent:
                await self.verifier.revoke_consumers(txn, rec, ended=req.group)
                rec.error = (f"consumer group {req.group} gave it up: "
                             f"{req.reason or 'no reason given'}")
                apply(rec, Event.GIVE_UP)
            elif rec.state == VERIFIED and req.delay_seconds:
                until = self.core.clock() + req.delay_seconds
                rec.nacked_until[req.group] = until
                txn.put(self.keys.cdelayed(rec.task_id, int(until * 1000), req.group,
                                           rec.file_id), b"")
            elif rec.state == VERIFIED:
                txn.put(self.keys.cready(rec.task_id, req.group, rec.file_id), b"")
            self.core.put_entry(rec, txn)
            return lambda rev: rec.to_pb(staging, revision=rev)

        return await self.core.txns.run(planner, req.request_id, entry_replay)
