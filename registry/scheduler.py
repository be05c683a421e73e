"""Background moves that no caller makes: entries whose backoff ended, whose
dependencies (or parts) are now verified, and tasks whose entries are all done.

Each move is one guarded transaction, so several replicas may run schedulers
at once: the compares let exactly one of them apply each move. Verifications
made by this replica wake the scheduler at once (``Core.verified``); a
periodic sweep catches everything else (other replicas, restarts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import blake3

from client.errors import BatonError

from ._etcd import KV, Compare, Get, Put, TxnOp, present, unchanged
from .core import Core
from .model import CONSUMED, PENDING, VERIFIED, EntryRecord, TaskRecord
from .verify import Verifier

log = logging.getLogger("baton.registry")

#: seconds between full sweeps of waiting entries and of task completion
SLOW_SWEEP = 2.0


def assembly_digest(part_digests: list[str]) -> str:
    """An assembly's digest: BLAKE3 of its parts' hex digests, in order, joined by newlines."""
    return blake3.blake3("\n".join(part_digests).encode()).hexdigest()


class Scheduler:
    def __init__(self, core: Core, interval: float = 0.5) -> None:
        self.core = core
        self.keys = core.keys
        self.interval = interval
        self.verifier = Verifier(core)

    async def run(self, stop: asyncio.Event) -> None:
        events = asyncio.create_task(self._on_verified(stop))
        loops = 0
        try:
            while not stop.is_set():
                try:
                    await self.promote_due()
                    if loops % max(1, int(SLOW_SWEEP / self.interval)) == 0:
                        await self.sweep_waiting()
                        await self.complete_tasks()
                except BatonError as e:
                    log.warning("scheduler sweep failed: %s", e)
                except Exception:
                    log.exception("scheduler sweep crashed")
                loops += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
        finally:
            events.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await events

    async def _on_verified(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            task_id, file_id = await self.core.verified.get()
            try:
                kv = await self.core.etcd.get(self.keys.entry(task_id, file_id))
                if kv is None:
                    continue
                rec = EntryRecord.load(kv.value)
                for dependent in rec.dependents:
                    await self.check_waiting(task_id, dependent)
                if rec.assembly:
                    await self.check_waiting(task_id, rec.assembly)
            except BatonError as e:
                log.warning("promoting after %s/%s failed: %s", task_id, file_id, e)

    async def _move(self, kv: KV, rec: EntryRecord, compares: list[Compare],
                    ops: list[TxnOp]) -> bool:
        self.core.put_entry(rec, ops)
        result = await self.core.etcd.txn([unchanged(kv), *compares], ops)
        return result.succeeded

    async def promote_due(self) -> int:
        """Entries whose retry backoff is over become claimable."""
        kvs, _, _ = await self.core.etcd.range(self.keys.delayed_all(), keys_only=True)
        now_ms = int(self.core.clock() * 1000)
        moved = 0
        for key in kvs:
            task_id, due, file_id = self.keys.parse_tail(key.key, self.keys.delayed_all())
            if int(due) > now_ms:
                continue
            kv = await self.core.etcd.get(self.keys.entry(task_id, file_id))
            if kv is None:
                continue
            rec = EntryRecord.load(kv.value)
            if rec.index != key.key.decode():
                continue
            moved += await self._move(kv, rec, [present(key.key)], [])
        return moved

    async def sweep_waiting(self) -> None:
        kvs, _, _ = await self.core.etcd.range(self.keys.waiting_all(), keys_only=True)
        for key in kvs:
            task_id, file_id = self.keys.parse_tail(key.key, self.keys.waiting_all())
            await self.check_waiting(task_id, file_id)

    async def check_waiting(self, task_id: str, file_id: str) -> bool:
        """Release an entry waiting for dependencies, or verify an assembly, if due."""
        for _ in range(8):
            kv = await self.core.etcd.get(self.keys.entry(task_id, file_id))
            if kv is None:
                return False
            rec = EntryRecord.load(kv.value)
            if rec.state != PENDING or rec.deps_ok:
                return False
            names = rec.parts or rec.depends_on
            found = await self.core.etcd.read([Get(self.keys.entry(task_id, n)) for n in names])
            others = [(kvs[0], EntryRecord.load(kvs[0].value)) for kvs in found if kvs]
            if len(others) != len(names):
                return False
            ok = ((VERIFIED,) if rec.parts else (VERIFIED, CONSUMED))
            if not all(o.state in ok for _, o in others):
                return False
            ops: list[TxnOp] = []
            rec.deps_ok = True
            if rec.parts:
                rec.state, rec.size = VERIFIED, sum(o.size for _, o in others)
                rec.digest = assembly_digest([o.digest for _, o in others])
                rec.remember("verified", digest=rec.digest, reason="every part verified")
                self.verifier.open_to_consumers(rec, ops)
            else:
                rec.remember("released", reason="dependencies verified")
            if await self._move(kv, rec, [unchanged(o) for o, _ in others], ops):
                if rec.parts:
                    self.core.verified.put_nowait((task_id, file_id))
                return True
        return False

    async def complete_tasks(self) -> None:
        """An active task none of whose entries is open any more is completed."""
        kvs, _, _ = await self.core.etcd.range(self.keys.tasks())
        for kv in kvs:
            task = TaskRecord.load(kv.value)
            if task.status != "active":
                continue
            if await self.core.etcd.count(self.keys.open_all(task.task_id)) == 0:
                dead = await self.core.etcd.count(self.keys.dead_all(task.task_id))
                task.status = "completed"
                task.status_reason = (f"{task.entry_count - dead} consumed, {dead} dead"
                                      if dead else "every entry consumed")
                result = await self.core.etcd.txn([unchanged(kv)], [Put(kv.key, task.dump())])
                if result.succeeded:
                    log.info("task %s completed (%s)", task.task_id, task.status_reason)
