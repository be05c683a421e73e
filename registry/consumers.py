"""Consumer transitions: consume (lease a verified entry to one agent of a group), ack, nack."""

from __future__ import annotations

from client.errors import IllegalTransition, InvalidArgument, NothingToClaim, StaleToken
from client.v1 import baton_pb2 as pb

from ._etcd import KV, Compare, Delete, Get, Put, TxnOp, created_at, present, unchanged
from .core import (
    Core,
    Plan,
    Reads,
    Retry,
    check_session_id,
    claim_holder,
    claim_value,
    entry_replay,
    need_entry,
    need_session,
    need_task,
    release_slot,
    take_slot,
)
from .keys import ClaimRef
from .manifest import check_id
from .model import CONSUMED, VERIFIED, EntryRecord

PAGE = 64


class Consumers:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys

    async def consume(self, req: pb.ConsumeRequest) -> pb.ConsumeResponse:
        check_id("task_id", req.task_id)
        check_id("group", req.group)
        if req.file_id:
            check_id("file_id", req.file_id)
        check_session_id(req.session_id)
        agent_key = self.keys.agent(req.session_id)
        staging = self.core.staging_dir(req.task_id)

        def plan_for(kv: KV, rec: EntryRecord, session: KV, slots: list[KV],
                     agent: str) -> Plan[pb.ConsumeResponse]:
            ref = ClaimRef("c", rec.task_id, rec.file_id, req.group)
            cready = self.keys.cready(rec.task_id, req.group, rec.file_id)
            compares = [unchanged(kv), present(cready), present(agent_key)]
            ops: list[TxnOp] = []
            slot = take_slot(self.core, session, slots, compares, ops)
            value = claim_value(agent, req.session_id, slot)
            ops += [
                Delete(cready),
                Put(self.keys.claim(ref), value, lease=req.session_id),
                Put(self.keys.inflight(ref), value),
            ]
            self.core.journal_only(rec, "consuming", ops, who=agent, group=req.group)

            def reply(rev: int) -> pb.ConsumeResponse:
                entry = rec.to_pb(staging, revision=kv.mod_revision)
                return pb.ConsumeResponse(
                    entry=entry, token=rev, path=entry.abs_path, size=rec.size,
                    digest=rec.digest, group=req.group,
                )

            return Plan(compares, ops, reply)

        def consumable(rec: EntryRecord) -> bool:
            return (rec.state == VERIFIED and req.group in rec.consumers
                    and req.group not in rec.consumed_by)

        async def planner(reads: Reads) -> Plan[pb.ConsumeResponse]:
            prefix = self.keys.cready_all(req.task_id, req.group)
            if req.file_id:
                targets = [Get(self.keys.entry(req.task_id, req.file_id)),
                           Get(self.keys.cready(req.task_id, req.group, req.file_id))]
            else:
                targets = [Get(prefix, prefix=True, limit=PAGE, keys_only=True)]
            task_kvs, agent_kvs, slots, *found = await reads.read(
                Get(self.keys.task(req.task_id)), Get(agent_key),
                Get(self.keys.slots(req.session_id), prefix=True), *targets)
            need_task(task_kvs, req.task_id, active=True)  # paused: no new consume leases
            agent = need_session(agent_kvs, req.session_id)
            session = agent_kvs[0]
            if req.file_id:
                kv, rec = need_entry(found[0], req.task_id, req.file_id)
                if req.group not in rec.consumers:
                    raise InvalidArgument(
                        f"group {req.group!r} is not a consumer of {rec.file_id!r} "
                        f"(consumers: {rec.consumers})"
                    )
                if not consumable(rec) or not found[1]:
                    raise IllegalTransition(
                        f"entry {rec.file_id!r} is {rec.state} and not available to group "
                        f"{req.group!r} (consumed by {rec.consumed_by}, or held by another "
                        "agent)", task_id=rec.task_id, file_id=rec.file_id, state=rec.state,
                    )
                return plan_for(kv, rec, session, slots, agent)
            page = found[0]
            moved = False
            while True:
                order = list(page)
                self.core.rng.shuffle(order)
                for ready in order:
                    file_id = ready.key[len(prefix):].decode()
                    kv_ = await self.core.etcd.get(self.keys.entry(req.task_id, file_id))
                    rec_ = EntryRecord.load(kv_.value) if kv_ else None
                    if kv_ is not None and rec_ is not None and consumable(rec_):
                        return plan_for(kv_, rec_, session, slots, agent)
                    moved = True
                if len(page) < PAGE:
                    break
                page, _, _ = await self.core.etcd.range(
                    prefix, start=page[-1].key + b"\0", limit=PAGE, keys_only=True)
            if moved:
                raise Retry()
            raise NothingToClaim(
                f"nothing to consume for group {req.group!r} in task {req.task_id!r}",
                task_id=req.task_id, group=req.group,
            )

        def replay(raw: bytes, rev: int) -> pb.ConsumeResponse:
            resp = pb.ConsumeResponse.FromString(raw)
            resp.token = rev
            return resp

        return await self.core.apply(planner, req.request_id, replay)

    async def _live(
        self, reads: Reads, task_id: str, file_id: str, group: str, token: int
    ) -> tuple[KV, EntryRecord, list[Compare], list[TxnOp]]:
        """The live consume-claim for ``token``, the entry, and the guarded deletes."""
        check_id("task_id", task_id)
        check_id("file_id", file_id)
        check_id("group", group)
        ref = ClaimRef("c", task_id, file_id, group)
        claim_key = self.keys.claim(ref)
        found, claims = await reads.read(Get(self.keys.entry(task_id, file_id)), Get(claim_key))
        kv, rec = need_entry(found, task_id, file_id)
        if token <= 0 or not claims or claims[0].create_revision != token:
            raise StaleToken(
                f"token {token} is not the live consume-claim of group {group!r} on "
                f"{task_id}/{file_id} (lost, superseded or already acked)",
                task_id=task_id, file_id=file_id, group=group, token=token,
            )
        compares = [unchanged(kv), created_at(claim_key, token)]
        ops: list[TxnOp] = [Delete(claim_key), Delete(self.keys.inflight(ref))]
        release_slot(self.core, claims[0], ops)
        return claims[0], rec, compares, ops

    async def ack(self, req: pb.AckRequest) -> pb.Entry:
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.Entry]:
            claim, rec, compares, ops = await self._live(
                reads, req.task_id, req.file_id, req.group, req.token)
            if rec.state != VERIFIED:
                raise IllegalTransition(
                    f"entry {rec.file_id!r} is {rec.state}: its verified bytes are gone "
                    f"({rec.error or 'no reason recorded'})", task_id=rec.task_id,
                    file_id=rec.file_id, state=rec.state,
                )
            if req.group not in rec.consumed_by:
                rec.consumed_by.append(req.group)
            rec.remember("acked", who=claim_holder(claim), group=req.group, token=req.token)
            if all(g in rec.consumed_by for g in rec.consumers):
                rec.state = CONSUMED
            self.core.put_entry(rec, ops)
            return Plan(compares, ops, lambda rev: rec.to_pb(staging, revision=rev))

        return await self.core.apply(planner, req.request_id, entry_replay)

    async def nack(self, req: pb.NackRequest) -> pb.Entry:
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.Entry]:
            _claim, rec, compares, ops = await self._live(
                reads, req.task_id, req.file_id, req.group, req.token)
            rec.remember("nacked", group=req.group, token=req.token, reason=req.reason)
            self.core.put_entry(rec, ops)
            if rec.state == VERIFIED:
                ops.append(Put(self.keys.cready(rec.task_id, req.group, rec.file_id), b""))
            return Plan(compares, ops, lambda rev: rec.to_pb(staging, revision=rev))

        return await self.core.apply(planner, req.request_id, entry_replay)

