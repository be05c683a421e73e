"""Operator calls: pause, resume, cancel, requeue; the journal, explain, agents."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from ...kernel.errors import IllegalTransition, InvalidArgument, NotFound
from ...kernel.v1 import baton_pb2 as pb
from ..records import access
from ..records.identity import Caller
from ..records.manifest import check_id
from ..records.model import (
    CONSUMED,
    DEAD,
    FINISHED,
    PENDING,
    VERIFIED,
    WRITING,
    WRITTEN,
    EntryRecord,
    TaskRecord,
    epoch_of,
    now,
)
from ..rules import lifecycle
from ..rules.checks import (
    SessionRecord,
    claim_holder,
    claim_session,
    claimed_at,
    entry_replay,
    need_entry,
    need_task,
)
from ..rules.claim import end_read, end_twins
from ..rules.core import Core, Gate
from ..rules.lifecycle import TaskEvent
from ..rules.machine import Event, apply
from ..store.etcd import KV, Delete, Get
from ..store.keys import ClaimRef
from ..store.txn import Txn, write
from . import attempts
from .checkpoints import CheckpointRecord
from .checkpoints import peek as last_checkpoint

log = logging.getLogger("baton.registry")

#: the requests of pause, resume and cancel: each names a task and says why
TaskControl = pb.PauseTaskRequest | pb.ResumeTaskRequest | pb.CancelTaskRequest

#: a cancelled task's keys are deleted in chunks of this many per transaction
DELETE_CHUNK = 100
#: seconds after a cancel from which, if the cancel stopped part-way (its replica died),
#: the leader's scheduler finishes it (``cancels/{due}/{task}``, registry.keys)
CANCEL_FINISHED_AFTER = 30.0
#: claims revoked per transaction: each read (pinned), deleted with its twin and slot
CLAIM_CHUNK = 40
#: keys read per request by listings (journal, agents, a cancelled task's claims)
LIST_PAGE = 1000
#: the most journal records one reply carries (the newest of them): a task's whole
#: journal grows with its entries and their retries, a reply must not
MAX_JOURNAL_RECORDS = 100_000
#: entries replayed at once by a requeue of a whole task for one group
REPLAY_PARALLEL = 16
#: lease lookups in flight while listing agents
TTL_PARALLEL = 32
#: journal events written by the transaction that made a claim (producer or consumer),
#: stored without the token: it is that transaction's revision, the record's own
TOKEN_IS_REVISION = frozenset({"claimed", "consuming"})

#: the lifecycle's event of each operator's action (registry/rules/lifecycle.py)
_EVENTS = {"pause": TaskEvent.PAUSE, "resume": TaskEvent.RESUME, "cancel": TaskEvent.CANCEL}


class Operators:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys

    async def control(self, action: str, req: TaskControl,
                      caller: Caller) -> pb.Task:
        """Pause (no new claims, running ones finish), resume, or cancel a task.

        Cancel also deletes the task's claims, so their tokens die at once, and
        its claimable indexes, so nothing more is handed out. Every change is
        recorded on the task (``status_reason``) and logged with who made it.
        """
        check_id("task_id", req.task_id)
        event = _EVENTS[action]
        target = lifecycle.target(event)
        who = caller.name or "operator"
        marker: list[bytes] = []  # the cancel's key, if this call cancelled the task

        async def planner(txn: Txn) -> Callable[[int], pb.Task]:
            kv = await txn.get(self.keys.task(req.task_id))
            task = need_task(kv, req.task_id)
            if task.status == target:
                return lambda _: task.to_pb()
            lifecycle.apply(task, event, lambda: IllegalTransition(
                f"cannot {action} task {req.task_id!r}: it is {task.status}",
                task_id=req.task_id))
            task.status_reason = f"{action}: {req.reason}" if req.reason else action
            if req.evidence:
                task.status_reason += f" (evidence: {req.evidence})"
            if target in FINISHED:
                task.finished_at = now()
            elif target == "active":
                task.finished_at = ""  # resumed: not finished any more
            txn.put(self.keys.task(req.task_id), task.dump())
            marker.clear()
            if target == "cancelled":
                # With the cancel: if this call stops before every claim and index key is
                # revoked, the leader's scheduler finishes it (``Scheduler.finish_cancels``).
                due = int((self.core.clock() + CANCEL_FINISHED_AFTER) * 1000)
                marker.append(self.keys.cancel(due, req.task_id))
                txn.put(marker[0], b"")
            txn.after(lambda: log.info("task %s: %s by %s, now %s (%s)", req.task_id,
                                       action, who, target, task.status_reason))
            return lambda _: task.to_pb()

        task = await self.core.txns.run(planner, req.request_id, _task_replay)
        if action == "cancel":
            await self._revoke_claims(req.task_id)
            if marker:  # all revoked: nothing left for the scheduler
                await self.core.etcd.txn([], [Delete(marker[0])])
        return task

    async def _revoke_claims(self, task_id: str) -> None:
        """Delete a cancelled task's claims (their tokens die; their slots are freed),
        their twins (and twins left by lost claims) and its indexes (``_revoked``), a page
        of keys at a time. The task is already cancelled, so nothing recreates them
        (and no token of it commits, fails, acks or nacks meanwhile: each of those
        reads the header in its own transaction). Stopped part-way, it is finished by
        the same cancel sent again, or by the scheduler (``finish_cancel``)."""
        for kind in ("p", "c"):
            await self._each_chunk(self.keys.claims_of_task(kind, task_id), CLAIM_CHUNK,
                                   self._revoke_chunk)
        for kind in ("p", "c"):
            await self._each_chunk(self.keys.inflight_of_task(kind, task_id), CLAIM_CHUNK,
                                   self._twins_chunk)
        for prefix in self._revoked(task_id)[4:]:
            await self._each_chunk(prefix, DELETE_CHUNK, self._delete_chunk)

    def _revoked(self, task_id: str) -> list[bytes]:
        """What cancel deletes, in order: claims, twins, claimable indexes, and the
        indexes of work the scheduler would otherwise still look at — entries waiting
        for dependencies (or parts), verifications that wake them, entries finished
        since its last look — though it does nothing for a cancelled task (it releases
        nothing and completes nothing): the task keeps only its entries, journal and
        history indexes."""
        k = self.keys
        return [k.claims_of_task("p", task_id), k.claims_of_task("c", task_id),
                k.inflight_of_task("p", task_id), k.inflight_of_task("c", task_id),
                k.ready_all(task_id), k.delayed_of_task(task_id), k.cready_of_task(task_id),
                k.cdelayed_of_task(task_id), k.waiting(task_id, ""),
                k.wakes_of_task(task_id), k.finishing_of_task(task_id)]

    async def finish_cancel(self, task_id: str) -> bool:
        """Revoke what a cancel stopped part-way left of a cancelled task (its holders
        keep their slots until then); one read when nothing is left. True if anything
        was."""
        left = await self.core.etcd.read([Get(p, prefix=True, limit=1, keys_only=True)
                                          for p in self._revoked(task_id)])
        if not any(left):
            return False
        await self._revoke_claims(task_id)
        return True

    async def _each_chunk(self, prefix: bytes, size: int,
                          handle: Callable[[list[bytes]], Awaitable[None]]) -> None:
        """``handle`` the keys under ``prefix``, ``size`` at a time, listed a page at a time."""
        chunk: list[bytes] = []
        pages = self.core.etcd.scan(prefix, page=LIST_PAGE, keys_only=True)
        async with contextlib.aclosing(pages):
            async for kv in pages:
                chunk.append(kv.key)
                if len(chunk) >= size:
                    await handle(chunk)
                    chunk = []
        if chunk:
            await handle(chunk)

    async def _revoke_chunk(self, keys: list[bytes]) -> None:
        """Delete claims as read at commit time (pinned), each with its twin and its
        slot: a claim finished meanwhile may have freed its slot for another claim of
        its session. Claim and twin go together, so the reaper never finds the twin
        alone (it would send the entry of a cancelled task back to its index)."""

        async def plan(txn: Txn) -> None:
            end_read(self.core, txn, zip(keys, await txn.get_many(keys), strict=True))

        await write(self.core.txns, plan)

    async def _twins_chunk(self, keys: list[bytes]) -> None:
        """End the claims whose twins are left (their lease ended before the cancel
        read them), each twin read pinned and deleted with the pool unit it names."""

        async def plan(txn: Txn) -> None:
            end_twins(self.core, txn, zip(keys, await txn.get_many(keys), strict=True))

        await write(self.core.txns, plan)

    async def _delete_chunk(self, keys: list[bytes]) -> None:
        async def plan(txn: Txn) -> None:
            for key in keys:
                txn.delete(key)

        await write(self.core.txns, plan)

    async def requeue(self, req: pb.RequeueRequest, caller: Caller) -> pb.Entry:
        """Bring a dead entry back to pending with a fresh retry budget, or, for one
        consumer group, hand an entry it acked to it again; the journal names the
        operator's identity."""
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        if req.group:
            check_id("group", req.group)
            plan = self._replay_plan(req.task_id, req.file_id, req.group,
                                     caller.name or "operator", req.reason, req.evidence)
            return await self.core.txns.run(plan, req.request_id, entry_replay)
        who = caller.name or "operator"
        staging = self.core.staging_dir(req.task_id)
        task_key = self.keys.task(req.task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.Entry]:
            task_kv, kv = await txn.get_many([task_key,
                                              self.keys.entry(req.task_id, req.file_id)])
            task = need_task(task_kv, req.task_id)
            if task.status in ("cancelled", "deleting", "archiving", "archived"):
                raise IllegalTransition(f"task {req.task_id!r} is {task.status}")
            rec = need_entry(kv, req.task_id, req.file_id)
            if rec.state != DEAD:
                raise IllegalTransition(f"entry {req.file_id!r} is {rec.state}; only dead "
                                        "entries can be requeued", state=rec.state)
            apply(rec, Event.REQUEUE)
            why = f"{req.reason} (after: {rec.error})" if req.reason else f"after: {rec.error}"
            rec.remember("requeued", who=who, reason=why,
                         **({"evidence": req.evidence} if req.evidence else {}))
            if lifecycle.allowed(task.status, TaskEvent.REOPEN):  # it has work again
                lifecycle.apply(task, TaskEvent.REOPEN)
                task.status_reason, task.finished_at = "entry requeued", ""
            # The header is written even when the task stays active: the entry is
            # open again, and the scheduler's completion of the task (planned on
            # the header, then on an open index it saw empty) must fail its compare.
            txn.put(task_key, task.dump())
            self.core.put_entry(rec, txn)
            return lambda rev: rec.to_pb(staging, revision=rev)

        return await self.core.txns.run(planner, req.request_id, entry_replay)

    async def replay_task(self, req: pb.RequeueRequest, caller: Caller) -> int:
        """Replay to ``req.group`` every entry of the task it acked whose file is still in
        staging, each in its own guarded transaction (the entries read a page at a
        time); how many were replayed. Sent again, it replays none twice: an entry
        replayed is no longer acked by the group."""
        check_id("task_id", req.task_id)
        check_id("group", req.group)
        _, task = await self.core.task(req.task_id)
        if req.group not in task.consumers:
            raise InvalidArgument(
                f"group {req.group!r} is not a consumer group of task {req.task_id!r} "
                f"(consumer groups: {', '.join(task.consumers) or 'none'})",
                field="group", task_id=req.task_id)
        who = caller.name or "operator"
        replayed = 0
        gate = Gate(REPLAY_PARALLEL)

        async def replay(file_id: str) -> None:
            nonlocal replayed
            try:
                await self.core.txns.run(self._replay_plan(req.task_id, file_id, req.group,
                                                           who, req.reason, req.evidence))
            except IllegalTransition:
                return  # moved on since it was listed (acked again, its file removed)
            replayed += 1

        pages = self.core.etcd.scan(self.keys.entries(req.task_id), page=LIST_PAGE)
        async with contextlib.aclosing(pages):
            async for kv in pages:
                rec = EntryRecord.load(kv.value)
                if _replayable(rec, req.group):
                    await gate.submit(replay(rec.file_id))
        await gate.drain()
        return replayed

    def _replay_plan(self, task_id: str, file_id: str, group: str, who: str,
                     reason: str = "", evidence: str = ""
                     ) -> Callable[[Txn], Awaitable[Callable[[int], pb.Entry]]]:
        """Hand a verified or consumed entry that ``group`` acked to that group again:
        its ack is forgotten and its claimable key put back; the other groups' acks
        stay, so none of them is handed it again. A consumed entry becomes verified
        again (and its task, if completed, active): its file must still be in
        staging."""
        staging = self.core.staging_dir(task_id)
        task_key = self.keys.task(task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.Entry]:
            task_kv, kv = await txn.get_many([task_key, self.keys.entry(task_id, file_id)])
            task = need_task(task_kv, task_id)
            if task.status in ("cancelled", "deleting", "archiving", "archived"):
                raise IllegalTransition(f"task {task_id!r} is {task.status}",
                                        task_id=task_id)
            rec = need_entry(kv, task_id, file_id)
            if group not in rec.consumers:
                raise InvalidArgument(
                    f"group {group!r} is not a consumer group of {rec.file_id!r} "
                    f"(consumer groups: {', '.join(rec.consumers) or 'none'})",
                    field="group", task_id=rec.task_id, file_id=rec.file_id)
            if rec.state not in (VERIFIED, CONSUMED) or group not in rec.consumed_by:
                raise IllegalTransition(
                    f"entry {rec.file_id!r} is {rec.state} and group {group!r} has not "
                    "acked it: there is nothing to hand it again (a dead entry is "
                    "requeued without --group)", task_id=rec.task_id,
                    file_id=rec.file_id, state=rec.state, group=group)
            if rec.staging_removed:
                raise IllegalTransition(
                    f"entry {rec.file_id!r}'s file was removed from staging at "
                    f"{rec.staging_removed.get('at', '?')} (its retention): there are no "
                    "bytes to hand again", task_id=rec.task_id, file_id=rec.file_id)
            if rec.state == CONSUMED:
                apply(rec, Event.REPLAY)
            rec.consumed_by.remove(group)
            why = f"handed to group {group} again"
            rec.remember("requeued", who=who, group=group,
                         reason=f"{reason} ({why})" if reason else why,
                         **({"evidence": evidence} if evidence else {}))
            txn.put(self.keys.cready(rec.task_id, group, rec.file_id), b"")
            if lifecycle.allowed(task.status, TaskEvent.REOPEN):  # it has work again
                lifecycle.apply(task, TaskEvent.REOPEN)
                task.status_reason, task.finished_at = "entry requeued", ""
            txn.put(task_key, task.dump())  # see requeue: a completion racing it fails
            self.core.put_entry(rec, txn)
            return lambda rev: rec.to_pb(staging, revision=rev)

        return planner

    async def journal(self, req: pb.JournalRequest) -> pb.JournalResponse:
        check_id("task_id", req.task_id)
        if req.file_id:
            check_id("file_id", req.file_id)
        if req.limit < 0:
            raise InvalidArgument("limit must be ≥ 0")
        _, task = await self.core.task(req.task_id)  # NotFound for an unknown task
        if task.status == "archived":
            return await self._archived_journal(req)
        if req.file_id:
            await self.core.entry(req.task_id, req.file_id)
        base = self.keys.journal_all(req.task_id)
        # Records in the order they were written (their create revision): only the
        # newest ``limit`` (at most MAX_JOURNAL_RECORDS) are kept while the pages go by.
        limit = _journal_limit(req)
        kept: list[tuple[int, int, KV]] = []
        total = 0
        pages = self.core.etcd.scan(self.keys.journal_all(req.task_id, req.file_id),
                                    page=LIST_PAGE)
        async with contextlib.aclosing(pages):
            async for n, kv in _numbered(pages):
                total = n + 1
                item = (kv.create_revision, n, kv)
                if len(kept) < limit:
                    heapq.heappush(kept, item)
                else:
                    heapq.heappushpop(kept, item)
        records = [self._journal_record(req.task_id, base, kv) for _, _, kv in sorted(kept)]
        return pb.JournalResponse(records=records, total=total)

    async def _archived_journal(self, req: pb.JournalRequest) -> pb.JournalResponse:
        archived = await self.core.archived(req.task_id)
        if req.file_id and not any(r.file_id == req.file_id for _, r in archived.entries):
            raise NotFound(f"no entry {req.file_id!r} in task {req.task_id!r}",
                           task_id=req.task_id, file_id=req.file_id)
        records = sorted((rev, n, file_id, data) for n, (file_id, rev, data)
                         in enumerate(archived.journal) if file_id == req.file_id or
                         not req.file_id)
        total = len(records)
        records = records[-_journal_limit(req):]
        return pb.JournalResponse(records=[self._record_pb(req.task_id, file_id, rev, data)
                                           for rev, _, file_id, data in records], total=total)

    def _journal_record(self, task_id: str, base: bytes, kv: KV) -> pb.JournalRecord:
        file_id = self.keys.parse_tail(kv.key, base)[0]
        try:
            data = json.loads(kv.value)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except ValueError:
            data = {"event": "unreadable", "reason": "the journal record is not valid JSON"}
        return self._record_pb(task_id, file_id, kv.create_revision, data)

    @staticmethod
    def _record_pb(task_id: str, file_id: str, revision: int,
                   data: dict[str, Any]) -> pb.JournalRecord:
        if data.get("event") in TOKEN_IS_REVISION and not data.get("token"):
            # A claim's token is the revision of the transaction that made it, which
            # wrote this record too.
            data["token"] = revision
        return pb.JournalRecord(
            task_id=task_id, file_id=file_id, revision=revision,
            at=str(data.get("at", "")), event=str(data.get("event", "")),
            # A record with a label names the identity in "who"; an older one the name
            # its client gave, which is all it has.
            who=str(data.get("who") or "") if "label" in data else str(
                data.get("who") or data.get("owner") or data.get("reporter") or ""),
            label=str(data.get("label") or ""),
            token=_int(data.get("token")), from_state=str(data.get("from", "")),
            to_state=str(data.get("to", "")), reason=_reason(data),
            group=str(data.get("group") or ""), evidence=str(data.get("evidence") or ""),
            routing_rule=_int(data["rule"]) if data.get("rule") is not None else None,
            routed_to=[str(g) for g in data.get("groups") or []],
        )

    async def explain(self, req: pb.ExplainRequest, caller: Caller) -> pb.ExplainResponse:
        """One paragraph on where an entry is and what it waits for, and what the
        task's access rules say about the caller."""
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        task_kv, kv = [found[0] if found else None for found in await self.core.etcd.read(
            [Get(self.keys.task(req.task_id)), Get(self.keys.entry(req.task_id, req.file_id))])]
        # No header: the task may have been archived while etcd refused writes.
        task = need_task(task_kv, req.task_id) if task_kv else (
            await self.core.task(req.task_id))[1]
        if task.status == "archived":
            return await self._explain_archived(task, req.file_id)
        rec = need_entry(kv, req.task_id, req.file_id)
        assert kv is not None
        text = await self._explain(task, kv, rec, tokens=caller.operator)
        rules = access.explain(caller, rec.producers, {
            g: access.consumers_of(task.access, g) for g in rec.consumers})
        if rules:
            text = f"{text} {rules}"
        entry = rec.to_pb(self.core.staging_dir(rec.task_id), revision=kv.mod_revision)
        await self.core.mark_blocked(rec.task_id, [(rec, entry)])
        tried = await attempts.read(self.core, rec.task_id, rec.file_id, page=LIST_PAGE)
        return attempts.explained(entry, text, tried, rec.state == DEAD)

    async def _explain_archived(self, task: TaskRecord, file_id: str) -> pb.ExplainResponse:
        archived = await self.core.archived(task.task_id)
        found = [(rev, r) for rev, r in archived.entries if r.file_id == file_id]
        if not found:
            raise NotFound(f"no entry {file_id!r} in task {task.task_id!r}",
                           task_id=task.task_id, file_id=file_id)
        rev, rec = found[0]
        last = rec.error if rec.state == DEAD else ""
        text = (f"Entry {file_id} of task {task.task_id} was {rec.state} (revision {rev}, "
                f"attempt {rec.retry_count + 1} of {rec.max_retries + 1})"
                f"{f'; last error: {last}' if last else ''} when the task "
                f"({archived.header.status}: {archived.header.status_reason or 'finished'}) "
                f"was archived at {task.archived_at}, to {task.archive}. Nothing more will "
                "happen to it; `baton log` shows its history from the archive.")
        entry = rec.to_pb(self.core.staging_dir(rec.task_id), revision=rev)
        await self.core.mark_blocked(rec.task_id, [(rec, entry)],
                                     known={r.file_id: r.state for _, r in archived.entries})
        tried = attempts.of([(r, data) for f, r, data in archived.journal if f == file_id])
        return attempts.explained(entry, text, tried, rec.state == DEAD)

    async def _explain(self, task: TaskRecord, kv: KV, rec: EntryRecord,
                       tokens: bool = True) -> str:
        """The paragraph; ``tokens``: name live claims' fencing tokens (operators only:
        a token names a live claim, and only its holder learns it from its reply)."""
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
                over = [b for b in await self.core.backlogs.count(
                    rec.task_id, task.backlog_limits) if b.over] if task.backlog_limits else []
                weight = task.fairness_weights.get(rec.fairness_key)
                fair = (f", fairness key {rec.fairness_key} of weight {weight}: it comes "
                        "up with its key's share of the claims" if weight else "")
                if over:
                    s.append(f"It is claimable (priority {rec.priority}{fair}), but the task "
                             "is back-pressured: " + "; ".join(
                                 f"consumer group {b.group} has a backlog of {b.backlog} "
                                 f"entries, at or over its limit of {b.limit}" for b in over)
                             + ". Producers' claims are refused (Backpressure) until it "
                             "consumes.")
                else:
                    s.append(f"It is claimable (priority {rec.priority}{fair}) and waits for "
                             "a producer to claim it.")
            if rec.checkpointed:
                s.append(await self._progress(rec, ClaimRef("p", rec.task_id, rec.file_id),
                                              None))
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
                under = f" under token {claim.create_revision}" if tokens else ""
                s.append(f"Agent {claim_holder(claim)} (session {claim_session(claim)}) is "
                         f"producing it{under}; its lease has {ttl}s left.")
                s.append(await self._progress(rec, ClaimRef("p", rec.task_id, rec.file_id),
                                              claim))
                if rec.claim_deadline:
                    s.append(f"Its claim is taken away if not committed within "
                             f"{rec.claim_deadline:g} s of the claim (claim_deadline).")
        elif rec.state == WRITTEN:
            s.append(f"The producer committed {rec.size} bytes; it waits for a watcher to "
                     "hash the file and confirm the digest.")
            waited = self.core.clock() - epoch_of(rec.updated_at)
            if epoch_of(rec.updated_at) and waited > self.core.stuck_written_after:
                s.append(f"It has waited {waited / 60:.0f} min, longer than "
                         f"{self.core.stuck_written_after / 60:g}: it is stuck. Is a "
                         "watcher running, owning the task's shard (`baton shard ls`), and "
                         "able to see the file on its host?")
        elif rec.state == VERIFIED:
            waiting = [g for g in rec.receivers if g not in rec.consumed_by]
            held = []
            for g in waiting:
                c = await self.core.etcd.get(
                    self.keys.claim(ClaimRef("c", rec.task_id, rec.file_id, g)))
                if c is not None:
                    ref = ClaimRef("c", rec.task_id, rec.file_id, g)
                    progress = (await self._progress(rec, ref, c)).rstrip(".")
                    held.append(f"{g} (agent {claim_holder(c)}"
                                f"{f', token {c.create_revision}' if tokens else ''}"
                                f"{f'; {progress}' if progress else ''})")
            s.append(f"Its bytes are verified (digest {rec.digest[:16]}…)." + (
                f" Consumer groups still to ack: {', '.join(waiting)}." if waiting else
                " It has no consumer groups, so it is done."))
            if held:
                s.append(f"Being consumed by: {'; '.join(held)}.")
            for g, back in sorted(rec.nacked_until.items()):
                at = datetime.fromtimestamp(back, UTC).isoformat(timespec="seconds")
                s.append(f"Group {g} nacked it with a delay: it is handed back to {g} at "
                         f"{at}.")
        elif rec.state == CONSUMED:
            s.append(f"Every consumer group acked it ({', '.join(rec.consumed_by)}).")
        elif rec.state == DEAD:
            if rec.retry_count < rec.max_retries:
                s.append(f"It was given up as permanent with "
                         f"{rec.max_retries - rec.retry_count} retries unspent: {rec.error}. "
                         "`baton requeue` brings it back.")
            else:
                s.append(f"It used all {rec.max_retries} retries; last error: {rec.error}. "
                         "`baton requeue` brings it back.")
            if rec.dependents:
                s.append(f"Dependents blocked by it: {_names(rec.dependents)}.")
        s += _routing(task, rec)
        return " ".join(part for part in s if part)

    async def _progress(self, rec: EntryRecord, ref: ClaimRef, claim: KV | None) -> str:
        """What the checkpoints say of the attempt holding ``claim`` (None: of the
        last attempt, for the next to resume from), and when it would stall."""
        kept = await last_checkpoint(self.core, rec, ref)
        now = self.core.clock()
        if claim is None:
            return ("" if kept is None else
                    f"The next attempt resumes from the checkpoint of attempt "
                    f"{kept.attempt} ({kept.progress:.0%}, {now - kept.at:.0f} s ago"
                    f"{f': {kept.message}' if kept.message else ''}).")
        stall = (f"It is taken back as stalled after {rec.stall_after:g} s without a "
                 "checkpoint (stall_after)." if rec.stall_after else "")
        if kept is not None and kept.token == claim.create_revision:
            text = (f"Its last checkpoint, {now - kept.at:.0f} s ago, says {kept.progress:.0%}"
                    f"{f' ({kept.message})' if kept.message else ''}.")
            return f"{text} {stall}".rstrip()
        # nothing to say of an attempt that may checkpoint and has not
        return f"It has not checkpointed yet. {stall}" if stall else ""

    async def _waiting_for(self, rec: EntryRecord, names: list[str],
                           good: tuple[str, ...], what: str) -> str:
        states = await self.core.dependency_states(rec.task_id, names)
        dead = rec.blocked_by(states)
        missing = [f"{n} ({states[n]})" for n in names if states[n] not in (DEAD, *good)]
        if dead:
            return (f"It is blocked: {what} {_names(dead)} dead; requeue to unblock "
                    "this entry.")
        return f"It waits for {what}: {_names(missing) or 'none (release imminent)'}."

    async def agents(self) -> pb.ListAgentsResponse:
        """Every live session with the claims it holds (both listings read a page at a
        time; every claim is in the answer, so the claims are held by session)."""
        by_session: dict[int, list[pb.ClaimInfo]] = {}
        refs: list[tuple[ClaimRef, pb.ClaimInfo]] = []
        claims = self.core.etcd.scan(self.keys.claims_all(), page=LIST_PAGE)
        async with contextlib.aclosing(claims):
            async for kv in claims:
                try:
                    ref = self.keys.parse_claim(kv.key)
                except ValueError:
                    continue
                # By the session the claim names: its lease changes with a rotation.
                by_session.setdefault(claim_session(kv), []).append(pb.ClaimInfo(
                    task_id=ref.task_id, file_id=ref.file_id, group=ref.group,
                    token=kv.create_revision, claimed_at=claimed_at(kv)))
                refs.append((ref, by_session[claim_session(kv)][-1]))
        # Each claim's progress: its checkpoint key, read a chunk per request.
        chunks = self.core.etcd.get_chunks([self.keys.checkpoint(ref) for ref, _ in refs])
        done = 0
        async with contextlib.aclosing(chunks):
            async for _, found in chunks:
                for _, value in found:
                    info = refs[done][1]
                    done += 1
                    kept = CheckpointRecord.load(value)
                    if kept is not None and kept.token == info.token:
                        info.progress = kept.progress
                        info.checkpoint_at = kept.stamp
        sessions: list[KV] = []
        pages = self.core.etcd.scan(self.keys.agents(), page=LIST_PAGE)
        async with contextlib.aclosing(pages):
            async for kv in pages:
                sessions.append(kv)
        gate = asyncio.Semaphore(TTL_PARALLEL)

        async def agent(kv: KV) -> pb.AgentInfo:
            async with gate:
                ttl = await self.core.etcd.time_to_live(kv.lease)
            record = SessionRecord.of(kv, self.keys.session_of(kv.key))
            info = record.info
            return pb.AgentInfo(
                session_id=record.session_id, agent=str(info.get("agent", "")),
                host=record.host, pid=_int(info.get("pid")),
                ttl_left=max(ttl, 0), granted_ttl=_int(info.get("ttl")),
                slots=_int(info.get("slots")), claims=by_session.get(record.session_id, []),
                opened_at=str(info.get("opened_at", "")), lease_id=kv.lease,
                draining=record.draining,
            )

        return pb.ListAgentsResponse(agents=await asyncio.gather(*map(agent, sessions)))


def _replayable(rec: EntryRecord, group: str) -> bool:
    """Whether ``requeue --group`` may hand ``rec`` to ``group`` again."""
    return (rec.state in (VERIFIED, CONSUMED) and group in rec.consumed_by
            and not rec.staging_removed)


def _task_replay(raw: bytes, rev: int) -> pb.Task:
    return pb.Task.FromString(raw)


def _reason(data: dict[str, Any]) -> str:
    """A record's reason; for a routed verification, with what routing decided."""
    reason = str(data.get("reason", ""))
    if "groups" not in data:
        return reason
    groups = ", ".join(str(g) for g in data["groups"])
    routed = (f"routing rule {data['rule']} held: to {groups}" if data.get("rule") is not None
              else f"no routing rule held: to every group ({groups})")
    return f"{reason}; {routed}" if reason else routed


def _routing(task: TaskRecord, rec: EntryRecord) -> list[str]:
    """What the attributes are and what the task's routing rules made of them."""
    s = [f"Its producer committed the attributes {rec.attributes}."] if (
        rec.attributes) else []
    if not rec.routing:
        return s
    if rec.rule >= 0:
        condition = task.routing_rules[rec.rule]["condition"]
        others = [g for g in rec.consumers if g not in rec.routed_to]
        s.append(f"Routing rule {rec.rule} ({condition}) held: it goes to "
                 f"{', '.join(rec.routed_to)} only" + (
                     f", not to {', '.join(others)}." if others else "."))
    elif rec.state in (VERIFIED, CONSUMED):
        s.append(f"None of the task's {len(task.routing_rules)} routing rules held over its "
                 "attributes: every consumer group receives it.")
    else:
        s.append("The task's routing rules decide which consumer groups receive it once "
                 "it is verified.")
    return s


def _state(kv: KV) -> str:
    try:
        return EntryRecord.load(kv.value).state
    except (ValueError, TypeError):
        return "unreadable"


def _int(value: object) -> int:
    """A number from a JSON record (0 when absent or not a number)."""
    if isinstance(value, int | float | str):
        with contextlib.suppress(ValueError):
            return int(value)
    return 0


def _names(names: Sequence[str], shown: int = 20) -> str:
    """A list of names for a sentence: the first ``shown`` and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _journal_limit(req: pb.JournalRequest) -> int:
    """How many of the newest records a journal reply keeps: the limit asked for (0: all),
    at most MAX_JOURNAL_RECORDS."""
    return min(req.limit or MAX_JOURNAL_RECORDS, MAX_JOURNAL_RECORDS)


async def _numbered(kvs: AsyncIterator[KV]) -> AsyncIterator[tuple[int, KV]]:
    n = 0
    async for kv in kvs:
        yield n, kv
        n += 1
