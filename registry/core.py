"""Shared machinery of the state machine: guarded retries, request outcomes, retry path.

Every transition follows one pattern: read what the decision depends on,
decide, then write with ONE etcd transaction whose compares pin every key the
decision read (entry mod revision, claim create revision = fencing token). If
the compares fail, someone else moved first: read again and decide again. The
decision is never applied unguarded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from client.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    SessionExpired,
    SlotsExhausted,
    TaskNotActive,
)
from client.v1 import baton_pb2 as pb

from ._etcd import KV, Compare, Delete, Etcd, Get, Put, TxnOp, TxnResult, absent
from .keys import Keys
from .model import CONSUMED, DEAD, PENDING, VERIFIED, EntryRecord, TaskRecord, now

log = logging.getLogger("baton.registry")

M = TypeVar("M", bound=Message)

#: how long the outcome of a mutating call is kept for retries of that call
REQUEST_TTL = 3600
#: guarded attempts before a call gives up with ``Conflict``
MAX_ATTEMPTS = 32


@dataclass
class Plan(Generic[M]):
    """One guarded write: what must still hold, what to write, what to answer."""

    compares: list[Compare]
    ops: list[TxnOp]
    #: builds the reply from the revision the transaction commits at
    reply: Callable[[int], M]
    #: runs once the transaction applied (e.g. to wake the scheduler)
    applied: Callable[[], None] | None = None


class Retry(Exception):
    """Raised by a planner when what it read changed under it: read again."""


class _Replayed(Exception):
    def __init__(self, record: KV) -> None:
        self.record = record


class Reads:
    """A planner's reads. The first one also fetches the call's request record
    (same round trip): if the call already applied, planning stops there and
    the recorded reply is returned instead."""

    def __init__(self, etcd: Etcd, request_key: bytes) -> None:
        self._etcd = etcd
        self._request_key = request_key

    async def read(self, *gets: Get) -> list[list[KV]]:
        ops = list(gets)
        check, self._request_key = self._request_key, b""
        if check:
            ops.append(Get(check))
        results = await self._etcd.read(ops)
        if check:
            record = results.pop()
            if record:
                raise _Replayed(record[0])
        return results

    async def one(self, key: bytes) -> KV | None:
        (kvs,) = await self.read(Get(key))
        return kvs[0] if kvs else None


class Core:
    """State shared by every handler of one registry replica."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        staging_root: str,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.staging_root = staging_root.rstrip("/") or "/"
        self.sleep = sleep
        self.rng = rng or random.Random()
        #: wall clock (UTC epoch seconds) for backoff and ordering; leases use etcd's
        self.clock = clock
        #: entries that just became verified, for the scheduler (dependents, assemblies)
        self.verified: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._request_lease = 0
        self._request_lease_until = 0.0
        self._lease_lock = asyncio.Lock()

    def staging_dir(self, task_id: str) -> str:
        return f"{self.staging_root}/{task_id}"

    # reading -------------------------------------------------------------

    async def task(self, task_id: str) -> tuple[KV, TaskRecord]:
        kv = await self.etcd.get(self.keys.task(task_id))
        if kv is None:
            raise NotFound(f"no task {task_id!r}", task_id=task_id)
        return kv, TaskRecord.load(kv.value)

    async def active_task(self, task_id: str) -> TaskRecord:
        _, task = await self.task(task_id)
        if task.status != "active":
            raise TaskNotActive(
                f"task {task_id!r} is {task.status}", task_id=task_id, status=task.status
            )
        return task

    async def entry(self, task_id: str, file_id: str) -> tuple[KV, EntryRecord]:
        kv = await self.etcd.get(self.keys.entry(task_id, file_id))
        if kv is None:
            raise NotFound(f"no entry {file_id!r} in task {task_id!r}", task_id=task_id,
                           file_id=file_id)
        return kv, EntryRecord.load(kv.value)

    # writing -------------------------------------------------------------

    async def _lease_for_requests(self) -> int:
        """A lease for request-outcome keys, replaced well before it expires."""
        async with self._lease_lock:
            if time.monotonic() > self._request_lease_until:
                self._request_lease, ttl = await self.etcd.grant(REQUEST_TTL)
                self._request_lease_until = time.monotonic() + ttl / 2
            return self._request_lease

    async def apply(
        self,
        planner: Callable[[Reads], Awaitable[Plan[M]]],
        request_id: str = "",
        replay: Callable[[bytes, int], M] | None = None,
    ) -> M:
        """Run ``planner`` and its transaction until it applies (or must give up).

        With a ``request_id``, the reply is recorded by the same transaction;
        a retry of the same call finds it and gets ``replay(record, revision)``
        (the original reply) instead of applying a second time.
        """
        req_key = self.keys.request(request_id) if request_id and replay else b""
        for attempt in range(MAX_ATTEMPTS):
            try:
                plan = await planner(Reads(self.etcd, req_key))
            except _Replayed as done:
                assert replay is not None
                return replay(done.record.value, done.record.create_revision)
            except Retry:
                await self._backoff(attempt)
                continue
            compares, ops = list(plan.compares), list(plan.ops)
            if req_key:
                # The reply may name the commit revision, unknown until the
                # transaction applies: record it as of revision 0; ``replay``
                # substitutes the request key's create revision, the same one.
                compares.append(absent(req_key))
                lease = await self._lease_for_requests()
                ops.append(Put(req_key, plan.reply(0).SerializeToString(), lease=lease))
            result = await self.etcd.txn(compares, ops)
            if result.succeeded:
                if plan.applied is not None:
                    plan.applied()
                return plan.reply(result.revision)
            await self._backoff(attempt)
        raise Conflict("gave up after repeated concurrent changes; retry the call")

    async def _backoff(self, attempt: int) -> None:
        if attempt:
            await self.sleep(min(0.05, 0.001 * (2**attempt)) * self.rng.random())

    async def txn(self, compares: Sequence[Compare], ops: Sequence[TxnOp]) -> TxnResult:
        return await self.etcd.txn(compares, ops)

    # the retry path --------------------------------------------------------

    def retry_or_dead(self, rec: EntryRecord, reason: str, ops: list[TxnOp],
                      token: int = 0) -> None:
        """Send an entry back to ``pending`` (retry_count + 1, after a backoff) or ``dead``.

        The caller's ``put_entry`` writes it, with its index and journal.
        """
        rec.remember("failed", reason=reason, who=rec.owner, token=token,
                     attempt=rec.retry_count)
        rec.error = reason
        rec.owner, rec.session = "", 0
        rec.size, rec.digest, rec.committed_digest, rec.observed = 0, "", "", None
        if rec.retry_count < rec.max_retries:
            rec.retry_count += 1
            rec.state = PENDING
            base, factor, cap = rec.backoff
            delay = min(cap, base * factor ** (rec.retry_count - 1))
            # Jitter spreads retries of entries that failed together.
            rec.not_before = self.clock() + delay * (0.5 + 0.5 * self.rng.random())
        else:
            rec.state = DEAD
            log.warning("entry dead: %s/%s after %d retries: %s", rec.task_id, rec.file_id,
                        rec.retry_count, reason)

    def _index_for(self, rec: EntryRecord, t: float) -> str:
        """The index key a pending entry belongs under ("" when not pending)."""
        if rec.state != PENDING:
            return ""
        if not rec.deps_ok:
            return self.keys.waiting(rec.task_id, rec.file_id).decode()
        if rec.not_before > t:
            return self.keys.delayed(rec.task_id, int(rec.not_before * 1000),
                                     rec.file_id).decode()
        if rec.index.startswith(self.keys.ready_all(rec.task_id).decode()):
            return rec.index
        # Priority with aging: an entry of priority p counts as enqueued
        # p * aging seconds earlier, so a waiting low-priority entry
        # overtakes newer high-priority ones after a while; ties by age.
        rec.enqueued_at = t
        order = int((t - rec.priority * rec.aging) * 1000)
        return self.keys.ready(rec.task_id, order, rec.file_id).decode()

    def put_entry(self, rec: EntryRecord, ops: list[TxnOp]) -> None:
        """Write ``rec`` with everything that follows from its state, in ``ops``:
        its index keys (ready / delayed / waiting, open, dead) and one journal
        record per event remembered since it was loaded."""
        was, now_done = rec.from_state, rec.done
        want = self._index_for(rec, self.clock())
        if want != rec.index:
            if rec.index:
                ops.append(Delete(rec.index.encode()))
            if want:
                ops.append(Put(want.encode(), b""))
            rec.index = want
        was_done = was is not None and (was in (CONSUMED, DEAD) or (
            was == VERIFIED and not rec.consumers))
        if was is None or was_done != now_done:
            open_key = self.keys.open(rec.task_id, rec.file_id)
            if not now_done:
                ops.append(Put(open_key, b""))
            elif was is not None:
                ops.append(Delete(open_key))
        if (was == DEAD) != (rec.state == DEAD):
            dead_key = self.keys.dead(rec.task_id, rec.file_id)
            ops.append(Put(dead_key, b"") if rec.state == DEAD else Delete(dead_key))
        for event in rec.take_events():
            rec.seq += 1
            record = {"from": was or "", "to": rec.state, **event}
            ops.append(Put(self.keys.journal(rec.task_id, rec.file_id, rec.seq),
                           json.dumps(record, default=str).encode()))
        ops.append(Put(self.keys.entry(rec.task_id, rec.file_id), rec.dump()))

    def journal_only(self, rec: EntryRecord, event: str, ops: list[TxnOp],
                     **details: Any) -> None:
        """A journal record for an event that leaves the entry itself untouched
        (taking a consume lease): keyed after the entry's last record, made unique."""
        record = {"at": now(), "event": event, "from": rec.state, "to": rec.state, **details}
        unique = f"~{uuid.uuid4().hex[:12]}".encode()
        key = self.keys.journal(rec.task_id, rec.file_id, rec.seq) + unique
        ops.append(Put(key, json.dumps(record, default=str).encode()))


def claim_value(agent: str, session: int, slot: int = -1) -> bytes:
    return json.dumps({"agent": agent, "session": session, "slot": slot}).encode()


def claim_holder(kv: KV | None) -> str:
    if kv is None:
        return ""
    try:
        return str(json.loads(kv.value).get("agent", ""))
    except ValueError:
        return ""


def need_entry(kvs: list[KV], task_id: str, file_id: str) -> tuple[KV, EntryRecord]:
    """The entry a read returned; ``NotFound`` if it returned none."""
    if not kvs:
        raise NotFound(f"no entry {file_id!r} in task {task_id!r}", task_id=task_id,
                       file_id=file_id)
    return kvs[0], EntryRecord.load(kvs[0].value)


def need_task(kvs: list[KV], task_id: str, active: bool = False) -> TaskRecord:
    """The task a read returned; ``NotFound``, or ``TaskNotActive`` if ``active``."""
    if not kvs:
        raise NotFound(f"no task {task_id!r}", task_id=task_id)
    task = TaskRecord.load(kvs[0].value)
    # A completed task has nothing left to hand out: callers then find nothing.
    if active and task.status not in ("active", "completed"):
        raise TaskNotActive(f"task {task_id!r} is {task.status}", task_id=task_id,
                            status=task.status)
    return task


def need_session(kvs: list[KV], session_id: int) -> str:
    """The agent name of a session a read returned; ``SessionExpired`` if none."""
    if not kvs:
        raise SessionExpired(f"session {session_id:x} has expired or never existed",
                             session_id=session_id)
    return claim_holder(kvs[0]) or "?"


def take_slot(core: Core, session_kv: KV, used: list[KV], compares: list[Compare],
              ops: list[TxnOp]) -> int:
    """Reserve a free claim slot of the session (-1 when it has no limit).

    Slots are leased keys ``slots/{session}/{n}``, ``n < slots``: taking one is a
    create-only put in the claim's own transaction, so two concurrent claims
    can never both take the last slot.
    """
    limit = int(json.loads(session_kv.value).get("slots", 0) or 0)
    if limit <= 0:
        return -1
    session_id = session_kv.lease
    taken = {int(kv.key.rsplit(b"/", 1)[-1]) for kv in used}
    free = [n for n in range(limit) if n not in taken]
    if not free:
        agent = claim_holder(session_kv)
        raise SlotsExhausted(
            f"agent {agent} holds {limit} claims already (its slot limit); finish one first",
            session_id=session_id, slots=limit)
    n = core.rng.choice(free)
    key = core.keys.slot(session_id, n)
    compares.append(absent(key))
    ops.append(Put(key, b"", lease=session_id))
    # Later claims of the same transaction (a batch) must take other slots.
    used.append(KV(key, b"", 0, 0, 0, session_id))
    return n


def free_slots(session_kv: KV, used: list[KV]) -> int | None:
    """How many more claims the session may hold (None: no limit)."""
    limit = int(json.loads(session_kv.value).get("slots", 0) or 0)
    return None if limit <= 0 else max(0, limit - len(used))


def release_slot(core: Core, claim: KV, ops: list[TxnOp]) -> None:
    """Free the slot a claim holds (its value names it), in the caller's transaction."""
    try:
        info = json.loads(claim.value)
    except ValueError:
        return
    if int(info.get("slot", -1)) >= 0 and claim.lease:
        ops.append(Delete(core.keys.slot(claim.lease, int(info["slot"]))))


def check_session_id(session_id: int) -> None:
    if session_id <= 0:
        raise InvalidArgument("this call needs a session_id (open a session first)")


def entry_replay(raw: bytes, revision: int) -> pb.Entry:
    """The recorded reply of an entry-returning call, as first sent."""
    entry = pb.Entry.FromString(raw)
    entry.revision = revision
    return entry
