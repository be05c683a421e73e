"""Operator calls: pause, resume, cancel, requeue; the journal, explain, agents."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from client.errors import IllegalTransition, InvalidArgument
from client.v1 import baton_pb2 as pb

from ._etcd import KV, Delete, Get, Put, TxnOp, unchanged
from .core import Core, Plan, Reads, claim_holder, entry_replay, need_entry, need_task
from .keys import ClaimRef
from .manifest import check_id
from .model import (
    CONSUMED,
    DEAD,
    PENDING,
    VERIFIED,
    WRITING,
    WRITTEN,
    EntryRecord,
    TaskRecord,
)

#: a cancelled task's claims are deleted in chunks of this many keys per transaction
DELETE_CHUNK = 100

_ALLOWED = {
    "pause": ({"active"}, "paused"),
    "resume": ({"paused", "completed"}, "active"),
    "cancel": ({"active", "paused", "creating", "completed"}, "cancelled"),
}


class Operators:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys

    async def control(self, action: str, req: pb.TaskControlRequest) -> pb.Task:
        """Pause (no new claims, running ones finish), resume, or cancel a task.

        Cancel also deletes the task's claims, so their tokens die at once, and
        its claimable indexes, so nothing more is handed out. Every change is
        recorded on the task (``status_reason``) and logged.
        """
        check_id("task_id", req.task_id)
        allowed, target = _ALLOWED[action]

        async def planner(reads: Reads) -> Plan[pb.Task]:
            (found,) = await reads.read(Get(self.keys.task(req.task_id)))
            task = need_task(found, req.task_id)
            if task.status == target:
                return Plan([unchanged(found[0])], [], lambda _: task.to_pb())
            if task.status not in allowed:
                raise IllegalTransition(f"cannot {action} task {req.task_id!r}: it is "
                                        f"{task.status}", task_id=req.task_id)
            task.status = target
            task.status_reason = f"{action}: {req.reason}" if req.reason else action
            return Plan([unchanged(found[0])], [Put(found[0].key, task.dump())],
                        lambda _: task.to_pb())

        task = await self.core.apply(planner, req.request_id, _task_replay)
        if action == "cancel":
            await self._revoke_claims(req.task_id)
        return task

    async def _revoke_claims(self, task_id: str) -> None:
        """Delete a cancelled task's claims and twins (their tokens die) and its
        claimable indexes. The task is already cancelled, so nothing recreates them."""
        keys: list[bytes] = []
        for kind in ("p", "c"):
            for prefix in (self.keys.claims_of_task(kind, task_id),
                           self.keys.inflight_of_task(kind, task_id)):
                kvs, _, _ = await self.core.etcd.range(prefix)
                for kv in kvs:
                    keys.append(kv.key)
                    info = json.loads(kv.value) if kv.lease else {}
                    if int(info.get("slot", -1)) >= 0:
                        keys.append(self.keys.slot(kv.lease, int(info["slot"])))
        for prefix in (self.keys.ready_all(task_id), self.keys.delayed_of_task(task_id),
                       self.keys.cready_of_task(task_id)):
            kvs, _, _ = await self.core.etcd.range(prefix, keys_only=True)
            keys += [kv.key for kv in kvs]
        for i in range(0, len(keys), DELETE_CHUNK):
            await self.core.etcd.txn([], [Delete(k) for k in keys[i:i + DELETE_CHUNK]])

    async def requeue(self, req: pb.RequeueRequest) -> pb.Entry:
        """Bring a dead entry back to pending with a fresh retry budget."""
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.Entry]:
            task_kvs, found = await reads.read(Get(self.keys.task(req.task_id)),
                                               Get(self.keys.entry(req.task_id, req.file_id)))
            task = need_task(task_kvs, req.task_id)
            if task.status == "cancelled":
                raise IllegalTransition(f"task {req.task_id!r} is cancelled")
            kv, rec = need_entry(found, req.task_id, req.file_id)
            if rec.state != DEAD:
                raise IllegalTransition(f"entry {req.file_id!r} is {rec.state}; only dead "
                                        "entries can be requeued", state=rec.state)
            rec.state, rec.retry_count, rec.not_before = PENDING, 0, 0.0
            rec.remember("requeued", who="operator", reason=f"after: {rec.error}")
            ops: list[TxnOp] = []
            compares = [unchanged(kv)]
            if task.status == "completed":  # it has work again
                task.status, task.status_reason = "active", "entry requeued"
                compares.append(unchanged(task_kvs[0]))
                ops.append(Put(task_kvs[0].key, task.dump()))
            self.core.put_entry(rec, ops)
            return Plan(compares, ops, lambda rev: rec.to_pb(staging, revision=rev))

        return await self.core.apply(planner, req.request_id, entry_replay)

    async def journal(self, req: pb.JournalRequest) -> pb.JournalResponse:
        check_id("task_id", req.task_id)
        if req.file_id:
            check_id("file_id", req.file_id)
        if req.limit < 0:
            raise InvalidArgument("limit must be ≥ 0")
        await self.core.task(req.task_id)  # NotFound for an unknown task
        if req.file_id:
            await self.core.entry(req.task_id, req.file_id)
        kvs, _, _ = await self.core.etcd.range(self.keys.journal_all(req.task_id, req.file_id))
        records = []
        base = self.keys.journal_all(req.task_id)
        for kv in sorted(kvs, key=lambda kv: kv.create_revision):
            file_id = self.keys.parse_tail(kv.key, base)[0]
            data = json.loads(kv.value)
            if data.get("event") == "claimed" and not data.get("token"):
                data["token"] = kv.create_revision  # a claim's token is its revision
            records.append(pb.JournalRecord(
                task_id=req.task_id, file_id=file_id, revision=kv.create_revision,
                at=str(data.get("at", "")), event=str(data.get("event", "")),
                who=str(data.get("who") or data.get("owner") or data.get("reporter") or ""),
                token=int(data.get("token", 0) or 0), from_state=str(data.get("from", "")),
                to_state=str(data.get("to", "")), reason=str(data.get("reason", "")),
            ))
        return pb.JournalResponse(records=records[-req.limit:] if req.limit else records)

    async def explain(self, req: pb.GetEntryRequest) -> pb.Explanation:
        """One paragraph on where an entry is and what it waits for."""
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        task_kvs, found = await self.core.etcd.read(
            [Get(self.keys.task(req.task_id)), Get(self.keys.entry(req.task_id, req.file_id))])
        task = need_task(task_kvs, req.task_id)
        kv, rec = need_entry(found, req.task_id, req.file_id)
        text = await self._explain(task, kv, rec)
        entry = rec.to_pb(self.core.staging_dir(rec.task_id), revision=kv.mod_revision)
        return pb.Explanation(entry=entry, text=text)

    async def _explain(self, task: TaskRecord, kv: KV, rec: EntryRecord) -> str:
        s = [f"Entry {rec.file_id} of task {rec.task_id} is {rec.state}"
             f" (revision {kv.mod_revision}, attempt {rec.retry_count + 1} of "
             f"{rec.max_retries + 1})."]
        if task.status != "active":
            s.append(f"The task is {task.status}"
                     f"{f' ({task.status_reason})' if task.status_reason else ''}.")
        if rec.state == PENDING:
            if rec.parts:
                s.append(await self._waiting_for(rec, rec.parts, (VERIFIED,), "parts"))
            elif not rec.deps_ok:
                s.append(await self._waiting_for(rec, rec.depends_on, (VERIFIED, CONSUMED),
                                                 "dependencies"))
            elif rec.not_before > self.core.clock():
                until = datetime.fromtimestamp(rec.not_before, UTC).isoformat(
                    timespec="seconds")
                s.append(f"It is in retry backoff until {until} after: {rec.error}.")
            else:
                s.append(f"It is claimable (priority {rec.priority}) and waits for a "
                         "producer to claim it.")
        elif rec.state == WRITING:
            claim = await self.core.etcd.get(
                self.keys.claim(ClaimRef("p", rec.task_id, rec.file_id)))
            if task.status == "cancelled":
                s.append(f"Its claim by {rec.owner} was revoked when the task was "
                         "cancelled; nothing more will happen to it.")
            elif claim is None:
                s.append(f"Its producer {rec.owner} lost its lease; the reaper will send it "
                         "back for a retry within a moment.")
            else:
                ttl = await self.core.etcd.time_to_live(claim.lease)
                s.append(f"Agent {claim_holder(claim)} is producing it under token "
                         f"{claim.create_revision}; its lease has {ttl}s left.")
        elif rec.state == WRITTEN:
            s.append(f"The producer committed {rec.size} bytes; it waits for a watcher to "
                     "hash the file and confirm the digest.")
        elif rec.state == VERIFIED:
            waiting = [g for g in rec.consumers if g not in rec.consumed_by]
            held = []
            for g in waiting:
                c = await self.core.etcd.get(
                    self.keys.claim(ClaimRef("c", rec.task_id, rec.file_id, g)))
                if c is not None:
                    held.append(f"{g} (agent {claim_holder(c)}, token {c.create_revision})")
            s.append(f"Its bytes are verified (digest {rec.digest[:16]}…)." + (
                f" Consumer groups still to ack: {', '.join(waiting)}." if waiting else
                " It has no consumer groups, so it is done."))
            if held:
                s.append(f"Being consumed by: {'; '.join(held)}.")
        elif rec.state == CONSUMED:
            s.append(f"Every consumer group acked it ({', '.join(rec.consumed_by)}).")
        elif rec.state == DEAD:
            s.append(f"It used all {rec.max_retries} retries; last error: {rec.error}. "
                     "`baton requeue` brings it back.")
            if rec.dependents:
                s.append(f"Dependents blocked by it: {', '.join(rec.dependents)}.")
        return " ".join(s)

    async def _waiting_for(self, rec: EntryRecord, names: list[str],
                           good: tuple[str, ...], what: str) -> str:
        found = await self.core.etcd.read([Get(self.keys.entry(rec.task_id, n)) for n in names])
        missing = []
        dead = []
        for name, kvs in zip(names, found, strict=True):
            state = EntryRecord.load(kvs[0].value).state if kvs else "missing"
            if state == DEAD:
                dead.append(name)
            elif state not in good:
                missing.append(f"{name} ({state})")
        if dead:
            return (f"It is blocked: {what} {', '.join(dead)} dead; requeue to unblock "
                    "this entry.")
        return f"It waits for {what}: {', '.join(missing) or 'none (release imminent)'}."

    async def agents(self) -> pb.ListAgentsResponse:
        sessions, _, _ = await self.core.etcd.range(self.keys.agents())
        claims, _, _ = await self.core.etcd.range(self.keys.claims_all())
        by_session: dict[int, list[pb.ClaimInfo]] = {}
        for kv in claims:
            ref = self.keys.parse_claim(kv.key)
            by_session.setdefault(kv.lease, []).append(pb.ClaimInfo(
                task_id=ref.task_id, file_id=ref.file_id, group=ref.group,
                token=kv.create_revision))
        out = []
        for kv in sessions:
            info = json.loads(kv.value)
            ttl = await self.core.etcd.time_to_live(kv.lease)
            out.append(pb.AgentInfo(
                session_id=kv.lease, agent=str(info.get("agent", "")),
                host=str(info.get("host", "")), pid=int(info.get("pid", 0)),
                ttl_left=max(ttl, 0), granted_ttl=int(info.get("ttl", 0)),
                slots=int(info.get("slots", 0)), claims=by_session.get(kv.lease, []),
                opened_at=str(info.get("opened_at", "")),
            ))
        return pb.ListAgentsResponse(agents=out)


def _task_replay(raw: bytes, rev: int) -> pb.Task:
    return pb.Task.FromString(raw)
