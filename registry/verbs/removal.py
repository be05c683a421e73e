"""DeleteTask: remove a task that never ran (or is stuck ``creating``), and every key of it.

A task *ran* once an entry of it was claimed: the claim wrote its first journal
record. A task that ran is history, kept for audit (cancelled, if it is to stop): its
delete is refused, unless it is cancelled and the caller says ``discard_history``.

Three steps, each safe to interrupt: a DeleteTask sent again finishes the job.

1. One guarded transaction marks the header ``deleting`` (from ``creating``, from any
   status if the task never ran, from ``cancelled`` with ``discard_history``, or from
   ``deleting`` itself). A task that never ran is marked only if its journal is still
   empty when the mark commits (a range compare): a claim racing the delete either
   committed first (its journal record fails the compare, and the delete, planned
   again, is refused) or fails its own compare on the header it pinned (and, planned
   again, finds the task ``deleting``). From then on nothing hands out work for
   the task: claims and consume leases need an active task, pause/resume/cancel and
   requeue refuse it, the scheduler completes only active tasks, CreateTask of it
   is refused, and a CreateTask still writing its chunks stops (each chunk requires
   the header still ``creating``).
2. The task's keys are deleted a page at a time, at most ``DELETE_CHUNK`` per
   transaction, through ``txn.write``: first its claims, each with its twin and the
   session slot it holds (read and pinned, as cancel does), so no token of the task
   survives and the reaper never finds a twin alone; then twins of lost claims, each
   with the pool unit it names (``claim.end_twins``); then
   the entries, so that any transition of an entry still under way (it pins the
   entry) fails; then the indexes and the journal, which nothing writes any more.
3. The header goes last, in a transaction that requires it still ``deleting`` and
   every prefix of the task empty; keys written meanwhile (a CreateTask of the
   same manifest still writing its chunks) send the sweep round again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from ...kernel.errors import Conflict, IllegalTransition, NotFound
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import Caller
from ..records.manifest import check_id
from ..records.model import TaskRecord
from ..rules import lifecycle
from ..rules.checks import need_task
from ..rules.claim import end_read, end_twins
from ..rules.core import Core
from ..rules.lifecycle import TaskEvent
from ..store.etcd import KV, Get, empty
from ..store.txn import Txn, write

log = logging.getLogger("baton.registry")

#: keys deleted per transaction (etcd allows 128 operations in one, and 128 compares:
#: one per key when pinned, and what a guard pins)
DELETE_CHUNK = 100
#: claims per transaction: each read (pinned), deleted with its twin and its slot
CLAIM_CHUNK = 40
#: keys listed per read request
LIST_PAGE = 1000
#: delete transactions in flight at once (the committer sends them together)
PARALLEL = 8
#: sweeps before giving up on a task whose keys keep being written
ROUNDS = 5


#: what a sweep's every chunk also requires: it reads (pins) it through the chunk's
#: transaction, or raises
Guard = Callable[[Txn], Awaitable[None]]


class _Leftovers(Exception):
    """Keys of the task appeared after the sweep: sweep again before the header goes."""


class Removal:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys

    async def delete(self, req: pb.DeleteTaskRequest, caller: Caller) -> pb.DeleteTaskResponse:
        """Remove a task that never ran, or a ``creating`` or half-deleted one, or (with
        ``discard_history``) a cancelled one, and its keys."""
        check_id("task_id", req.task_id)
        if req.request_id:
            # A retry of a delete that finished: the task is gone, its reply is not.
            done = await self.core.etcd.get(self.keys.request(req.request_id))
            if done is not None:
                return _reply_replay(done.value, done.create_revision)
        try:
            task = await write(self.core.txns, self._mark_plan(req))
        except NotFound:
            # No header: an archive made while etcd refused puts still answers for it.
            archive = self.core.archive
            if archive is not None and await archive.headerless(req.task_id) is not None:
                raise _archived(req.task_id, "archived") from None
            raise
        removed: Counter[str] = Counter()
        for _ in range(ROUNDS):
            removed += await self._sweep_task(req.task_id)
            try:
                reply = await self.core.txns.run(self._header_plan(task, removed),
                                                 req.request_id, _reply_replay)
            except _Leftovers:
                continue
            log.info("task %s deleted by %s: %d keys removed (%s)", req.task_id,
                     caller.name or "operator", reply.keys_removed,
                     req.reason or "no reason given")
            return reply
        raise Conflict(f"keys of task {req.task_id!r} kept being written while it was "
                       "deleted (is a CreateTask of it still running?); send the delete "
                       "again", task_id=req.task_id)

    def _mark_plan(self, req: pb.DeleteTaskRequest) -> Callable[[Txn], Awaitable[TaskRecord]]:
        key = self.keys.task(req.task_id)
        journal = self.keys.journal_all(req.task_id)

        async def plan(txn: Txn) -> TaskRecord:
            task = need_task(await txn.get(key), req.task_id)
            if task.status == "deleting":
                return task  # an interrupted delete: carry on
            if task.status in ("archiving", "archived"):
                raise _archived(req.task_id, task.status)
            if task.status != "creating":  # nothing is handed out before a task is active
                ran = await txn.scan(journal, limit=1, keys_only=True)
                if not ran:
                    txn.require(empty(journal))  # and still none when the mark commits
                else:
                    self._check_history(req, task, self.keys.parse_tail(ran[0].key,
                                                                        journal)[0])
            was = task.status
            lifecycle.apply(task, TaskEvent.DELETE)
            task.status_reason = f"delete ({was})" + (f": {req.reason}" if req.reason else "")
            txn.put(key, task.dump())
            return task

        return plan

    def prefixes_of(self, task_id: str) -> list[bytes]:
        """Every prefix naming the task (claims, twins, entries, indexes, journal)."""
        return [*self._claim_prefixes(task_id), *(p for _, p in self._prefixes(task_id))]

    async def sweep(self, task_id: str, before: int = 0, guard: Guard | None = None
                    ) -> Counter[str]:
        """Delete every key of the task but its header, a chunk per transaction. With
        ``before``, each key is deleted only as listed (pinned) and only if written
        before that revision, else ``IllegalTransition``: an archived task loses
        nothing written after its archive was read. ``guard`` reads (pins) what every
        chunk's transaction also requires, or raises."""
        return await self._sweep_task(task_id, before, guard)

    @staticmethod
    def _check_history(req: pb.DeleteTaskRequest, task: TaskRecord, file_id: str) -> None:
        """A task that ran is deleted only when asked to discard its history, and only
        once cancelled."""
        t = req.task_id
        if not req.discard_history:
            stop = ("" if task.status == "cancelled" else
                    f"; cancel it first (`baton task cancel {t}`) to stop it")
            raise IllegalTransition(
                f"cannot delete task {t!r}: it is {task.status} and has history (entry "
                f"{file_id!r} ran; `baton log {t}` shows it): a task that ran is kept for "
                f"audit, not deleted{stop}; once finished it is archived out of etcd "
                f"(`baton task archive {t}`); --discard-history deletes a cancelled task "
                "with its journal", task_id=t, status=task.status)
        if task.status != "cancelled":
            raise IllegalTransition(
                f"cannot delete task {t!r}: it is {task.status}; a task with history is "
                f"deleted only once cancelled: cancel it first (`baton task cancel {t}`)",
                task_id=t, status=task.status)

    def _prefixes(self, task_id: str) -> list[tuple[str, bytes]]:
        """Every prefix that names the task but its claims, in the order they are
        emptied (entries before the indexes their transitions would rewrite)."""
        k = self.keys
        return [
            ("inflight", k.inflight_of_task("p", task_id)),
            ("inflight", k.inflight_of_task("c", task_id)),
            ("entries", k.entries(task_id)),
            ("ready", k.ready_all(task_id)),
            ("delayed", k.delayed_of_task(task_id)),
            ("waiting", k.waiting(task_id, "")),  # waiting/{task}/: every file id
            ("cready", k.cready_of_task(task_id)),
            ("cdelayed", k.cdelayed_of_task(task_id)),
            ("open", k.open_all(task_id)),
            ("dead", k.dead_all(task_id)),
            ("finishing", k.finishing_of_task(task_id)),
            ("wakes", k.wakes_of_task(task_id)),
            ("checkpoints", k.checkpoints_of_task(task_id)),
            ("journal", k.journal_all(task_id)),
        ]

    def _claim_prefixes(self, task_id: str) -> list[bytes]:
        return [self.keys.claims_of_task("p", task_id), self.keys.claims_of_task("c", task_id)]

    async def _sweep_task(self, task_id: str, before: int = 0, guard: Guard | None = None
                          ) -> Counter[str]:
        removed: Counter[str] = Counter()
        for prefix in self._claim_prefixes(task_id):
            removed += await self._sweep(prefix, CLAIM_CHUNK,
                                         lambda kvs: self._claims_chunk(kvs, guard), before)
        for kind, prefix in self._prefixes(task_id):
            if kind == "inflight":  # twins of claims whose lease ended: with their units
                removed += await self._sweep(
                    prefix, CLAIM_CHUNK, lambda kvs: self._twins_chunk(kvs, before, guard),
                    before)
                continue
            removed += await self._sweep(prefix, DELETE_CHUNK,
                                         self._plain_chunk(kind, bool(before), guard), before)
        return removed

    async def _sweep(self, prefix: bytes, size: int,
                     handle: Callable[[list[KV]], Awaitable[Counter[str]]],
                     before: int = 0) -> Counter[str]:
        """``handle`` the keys under ``prefix`` ``size`` at a time, ``PARALLEL`` chunks
        at once, listed a page at a time (with ``before``: each written before it)."""
        removed: Counter[str] = Counter()
        chunks: list[list[KV]] = [[]]

        async def flush() -> None:
            results = await asyncio.gather(*(handle(c) for c in chunks if c),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
                removed.update(result)
            chunks[:] = [[]]

        pages = self.core.etcd.scan(prefix, page=LIST_PAGE, keys_only=True)
        async with contextlib.aclosing(pages):
            async for kv in pages:
                if len(chunks[-1]) >= size:
                    if len(chunks) >= PARALLEL:
                        await flush()
                    else:
                        chunks.append([])
                if before and kv.mod_revision >= before:
                    raise IllegalTransition(
                        f"{kv.key.decode(errors='replace')} was written at revision "
                        f"{kv.mod_revision}, after the archive (revision {before - 1}): "
                        "archive the task again")
                chunks[-1].append(kv)
        await flush()
        return removed

    def _plain_chunk(self, kind: str, pinned: bool = False, guard: Guard | None = None
                     ) -> Callable[[list[KV]], Awaitable[Counter[str]]]:
        """Deletes a chunk of keys of one kind: unread (nothing writes them any more),
        or, ``pinned``, each only if still as listed; and as ``guard`` requires."""

        async def handle(kvs: list[KV]) -> Counter[str]:
            async def plan(txn: Txn) -> Counter[str]:
                if guard is not None:
                    await guard(txn)
                for kv in kvs:
                    if pinned:
                        txn.pin(kv.key, kv)
                    txn.delete(kv.key)
                return Counter({kind: len(kvs)})

            return await write(self.core.txns, plan)

        return handle

    async def _claims_chunk(self, listed: list[KV], guard: Guard | None = None
                            ) -> Counter[str]:
        """Delete claims as read at commit time (pinned), each with its twin and its
        slot: a claim finished meanwhile may have freed its slot for another claim of
        its session, which keeps it. And as ``guard`` requires."""
        slots = self.keys.slots_all()
        keys = [kv.key for kv in listed]

        async def plan(txn: Txn) -> Counter[str]:
            if guard is not None:
                await guard(txn)
            counts: Counter[str] = Counter()
            claims = await txn.get_many(keys)
            twins = {k: self._twin(k) for k in keys}
            found = dict(zip(twins.values(), await txn.peek_many(list(twins.values())),
                             strict=True))
            for key, claim in zip(keys, claims, strict=True):
                if claim is not None:  # else finished (or revoked) meanwhile
                    counts["claims"] += 1
                    counts["inflight"] += twins[key] != key and found[twins[key]] is not None
            end_read(self.core, txn, zip(keys, claims, strict=True))
            counts["slots"] = sum(1 for k in txn.write_keys() if k.startswith(slots))
            return counts

        return await write(self.core.txns, plan)

    async def _twins_chunk(self, listed: list[KV], before: int = 0,
                           guard: Guard | None = None) -> Counter[str]:
        """Delete twins left by claims whose lease ended, each read (pinned) and deleted
        with the pool unit it names (``claim.end_twins``); with ``before``, each only
        if written before it. And as ``guard`` requires."""
        keys = [kv.key for kv in listed]

        async def plan(txn: Txn) -> Counter[str]:
            if guard is not None:
                await guard(txn)
            twins = await txn.get_many(keys)
            for twin in twins:
                if before and twin is not None and twin.mod_revision >= before:
                    raise IllegalTransition(
                        f"{twin.key.decode(errors='replace')} was written at revision "
                        f"{twin.mod_revision}, after the archive (revision {before - 1}): "
                        "archive the task again")
            return Counter({"inflight": end_twins(self.core, txn,
                                                  zip(keys, twins, strict=True))})

        return await write(self.core.txns, plan)

    def _twin(self, claim_key: bytes) -> bytes:
        """The twin of a claim key (the key itself if it names no claim: deleted once)."""
        try:
            return self.keys.inflight(self.keys.parse_claim(claim_key))
        except ValueError:
            return claim_key

    def _header_plan(self, task: TaskRecord, removed: Counter[str]
                     ) -> Callable[[Txn], Awaitable[Callable[[int], pb.DeleteTaskResponse]]]:
        """Delete the header, guarded: still ``deleting``, and nothing left of the task."""
        key = self.keys.task(task.task_id)
        prefixes = self.prefixes_of(task.task_id)

        async def plan(txn: Txn) -> Callable[[int], pb.DeleteTaskResponse]:
            kv = await txn.get(key)
            counts = Counter(removed)
            last = task
            if kv is not None:
                last = TaskRecord.load(kv.value)
                if last.status != "deleting":  # nothing moves a task out of deleting
                    raise IllegalTransition(f"task {task.task_id!r} is {last.status} "
                                            "again; not deleted", task_id=task.task_id)
                # Straight from etcd (the view may be behind); the compares below keep it so.
                left = await self.core.etcd.read(
                    [Get(p, prefix=True, limit=1, keys_only=True) for p in prefixes])
                if any(left):
                    raise _Leftovers()
                for p in prefixes:
                    txn.require(empty(p))
                txn.delete(key)
                counts["header"] += 1
            # else: a concurrent delete removed it; what this call removed is the answer.
            reply = pb.DeleteTaskResponse(task=last.to_pb(), keys_removed=counts.total(),
                                          removed={k: n for k, n in counts.items() if n})
            return lambda _rev: reply

        return plan


def _archived(task_id: str, status: str) -> IllegalTransition:
    return IllegalTransition(
        f"cannot delete task {task_id!r}: it is {status}; its archive is kept until "
        "--archive-retention, then it goes with its header", task_id=task_id, status=status)


def _reply_replay(raw: bytes, revision: int) -> pb.DeleteTaskResponse:
    return pb.DeleteTaskResponse.FromString(raw)
