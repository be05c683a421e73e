"""Entries waiting for another task's entries: released when one of those is written.

A verification writes a wake key only for what its own task knows waits for the
entry (``dependents``, an assembly): an entry of task B that depends on ``A:f`` is not
among ``A:f``'s dependents (B may be created long after A). So the elected replica
follows the dependencies themselves. For each task whose entries wait on other
tasks' (``TaskRecord.cross_deps``, or not known: a header an older registry wrote),
it reads the waiting entries once and keeps, for each entry they depend on, which of
them wait for it; it watches the entries of every task depended on (one etcd watch
per such task, passing on only the keys waited for) while something waits on it.
When such a key is written or deleted (verified, consumed, archived...), the entries
waiting for it are checked (``Scheduler.check_waiting``): each released in one
guarded transaction if every dependency is verified by then.

Nothing is missed between a read and a watch: a dependency is followed (its key kept,
its task watched from a revision no later than the read of the waiting entry) before
the entry is checked, so a dependency verified before the check is seen by the check,
and one verified after it by the watch. A task's waiting entries are read again when
its header is written (created, activated, paused, cancelled, removed); all of them on
every full look of the sweeps (``sweeps``), and after a watch of a dependency breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from ...kernel.errors import BatonError
from ..records.model import PENDING, EntryRecord, TaskRecord
from ..rules.core import Core
from ..rules.sweeping import Alarm
from ..store.etcd import Watched, WatchEvent

log = logging.getLogger("baton.registry")

#: task statuses whose waiting entries may be released
WAITING_STATUSES = frozenset({"creating", "active", "paused"})
#: waiting keys read per request
PAGE = 1000

Waiter = tuple[str, str]


class CrossWaits:
    """The entries of tasks with cross-task dependencies still waiting, and the
    watches of the tasks they depend on."""

    def __init__(self, core: Core, alarm: Alarm,
                 check: Callable[[str, str], Awaitable[bool | None]],
                 complain: Callable[[str, BaseException], None]) -> None:
        self.core = core
        self.keys = core.keys
        self.alarm = alarm
        self._check = check
        #: the scheduler's: a record that cannot be read is reported once, not at
        #: every look (the item named as the scheduler's own sweeps name it)
        self._complain = complain
        #: dependency entry key -> the waiting entries (task, file) that wait for it
        self._waiters: dict[bytes, set[Waiter]] = {}
        #: waiting entry -> the keys it waits for
        self._deps: dict[Waiter, list[bytes]] = {}
        #: dependency task -> its watch
        self._watches: dict[str, asyncio.Task[None]] = {}
        #: dependency keys written since the last sweep; tasks whose header was
        self._written: set[bytes] = set()
        self._headers_written: set[str] = set()

    @property
    def followed(self) -> list[str]:
        """The tasks whose entries are watched now (for tests and the curious)."""
        return sorted(t for t, w in self._watches.items() if not w.done())

    def headers_written(self, batch: list[WatchEvent]) -> None:
        """Task headers written or deleted: each such task's waiting entries are read
        again at the next sweep (when it waits on other tasks)."""
        base = self.keys.tasks()
        for ev in batch:
            self._headers_written.add(ev.kv.key[len(base):].decode(errors="replace"))
        self.alarm.ring()

    async def sweep(self, whole: bool) -> int:
        """Read again the waiting entries of the tasks whose header was written (every
        task with cross-task dependencies: ``whole``), then check the entries waiting
        for a dependency written since the last sweep; how many were released."""
        written, self._headers_written = self._headers_written, set()
        moved = 0
        # The headers from etcd, not the view: the view may not have come as far as the
        # revision the watch told of (or started from).
        if whole:
            self.close()
            tasks = await self._read_headers(None)
            written = {t for t, h in tasks.items() if _waits_across(h)}
        else:
            tasks = await self._read_headers(written)
        for task_id in sorted(written):
            self._forget_task(task_id)
            header = tasks.get(task_id)
            if header is not None and _waits_across(header):
                moved += await self._read_task(header)
        changed, self._written = self._written, set()
        for key in changed:
            for waiter in sorted(self._waiters.get(key, ())):
                moved += await self._check_one(waiter)
        self._unwatch_idle()
        return moved

    async def _read_headers(self, task_ids: set[str] | None) -> dict[str, TaskRecord]:
        """The headers of ``task_ids`` (None: every task) that exist and can be read."""
        if task_ids is None:
            kvs = [kv async for kv in self.core.etcd.scan(self.keys.tasks(), page=PAGE)]
        else:
            kvs = []
            async for _, found in self.core.etcd.get_chunks(
                    [self.keys.task(t) for t in sorted(task_ids)]):
                kvs += [kv for _, kv in found if kv is not None]
        headers = {}
        for kv in kvs:
            try:
                header = TaskRecord.load(kv.value)
            except (ValueError, TypeError) as e:
                self._complain(f"task header {kv.key.decode(errors='replace')}", e)
                continue
            headers[header.task_id] = header
        return headers

    def close(self) -> None:
        """Forget everything and stop every watch (the lead lost, or a full look)."""
        for watch in self._watches.values():
            watch.cancel()
        self._watches.clear()
        self._waiters.clear()
        self._deps.clear()
        self._written.clear()

    async def _read_task(self, header: TaskRecord) -> int:
        """Follow the dependencies of every waiting entry of one task, then check each."""
        task_id = header.task_id
        followed: list[Waiter] = []
        file_ids: list[str] = []
        pages = self.core.etcd.scan(self.keys.waiting(task_id, ""), page=PAGE, keys_only=True)
        async with contextlib.aclosing(pages):
            async for listed in pages:
                file_ids.append(self.keys.last_segment(listed.key))
        entries = [self.keys.entry(task_id, f) for f in file_ids]
        async for revision, found in self.core.etcd.get_chunks(entries):
            for key, kv in found:
                if kv is None:
                    continue
                try:
                    rec = EntryRecord.load(kv.value)
                except (ValueError, TypeError) as e:
                    self._complain(f"entry key {key.decode(errors='replace')}", e)
                    continue
                if rec.state != PENDING or rec.deps_ok:
                    continue
                names = [n for n in (rec.parts or rec.depends_on)
                         if ":" in n or header.cross_deps is None]
                if names:
                    self._follow((task_id, rec.file_id), names, revision)
                    followed.append((task_id, rec.file_id))
        moved = 0
        for waiter in followed:
            moved += await self._check_one(waiter)
        return moved

    def _follow(self, waiter: Waiter, names: list[str], revision: int) -> None:
        """Keep the keys ``waiter`` waits for, each task's watched from ``revision`` + 1
        on at the latest (the revision its waiting entry was read at)."""
        task_id, _ = waiter
        keys = [self.keys.dependency(task_id, n) for n in names]
        self._deps[waiter] = keys
        for key, name in zip(keys, names, strict=True):
            self._waiters.setdefault(key, set()).add(waiter)
            other = name.partition(":")[0] if ":" in name else task_id
            watch = self._watches.get(other)
            if watch is None or watch.done():
                self._watches[other] = asyncio.create_task(
                    self._watch(other, revision + 1), name=f"cross-task waits on {other}")

    async def _check_one(self, waiter: Waiter) -> int:
        moved = await self._check(*waiter)
        if moved is None:  # failed (logged): checked again after the sweep's interval
            self._written.update(self._deps.get(waiter, ()))
            self.alarm.ring()
        elif moved:
            self._forget(waiter)
        return int(bool(moved))

    def _forget(self, waiter: Waiter) -> None:
        for key in self._deps.pop(waiter, ()):
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._waiters[key]

    def _forget_task(self, task_id: str) -> None:
        for waiter in [w for w in self._deps if w[0] == task_id]:
            self._forget(waiter)

    def _unwatch_idle(self) -> None:
        """Stop watching tasks nothing waits on any more."""
        base = self.keys.entries_all()
        wanted = {key[len(base):].split(b"/", 1)[0].decode() for key in self._waiters}
        for task_id in [t for t in self._watches if t not in wanted]:
            self._watches.pop(task_id).cancel()

    async def _watch(self, task_id: str, start: int) -> None:
        """Note each key waited for among the task's entries written from ``start`` on."""
        try:
            watch = self.core.etcd.watch_many([Watched(self.keys.entries(task_id))], start,
                                              keep=self._waiters.__contains__)
            async with contextlib.aclosing(watch):
                async for item in watch:
                    if isinstance(item, list):
                        self._written.update(ev.kv.key for ev in item)
                        self.alarm.ring()
        except BatonError as e:
            log.warning("cross-task waits: watch of task %s broken (%s); looking again",
                        task_id, e)
            self.alarm.look()
        except Exception:
            log.exception("cross-task waits: watch of task %s crashed; looking again",
                          task_id)
            self.alarm.look()


def _waits_across(header: TaskRecord) -> bool:
    """Whether a task's waiting entries are followed here: some wait on another task's
    entries (or it is not known), and they may still be released."""
    return header.cross_deps is not False and header.status in WAITING_STATUSES
