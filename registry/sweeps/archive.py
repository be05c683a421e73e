"""Finished tasks out of etcd: archiving a task into the archive store, and reading it back.

etcd holds what is live. A task that completed or was cancelled is, after its
``archive_after`` (a manifest field; the registry's ``--archive-after`` by default),
written to an archive store with its entries and journal, verified there, and only
then removed from etcd; etcd keeps its header, status ``archived``, naming the
archive. Reads of the task (get, entries, journal, explain) are then answered from
the archive. Archives older than ``--archive-retention`` are deleted, headers too.

Archiving is three steps, each safe to interrupt, and a rerun finishes the job:

1. One guarded transaction marks the header ``archiving`` (from ``completed`` or
   ``cancelled``): nothing resumes, cancels, requeues or claims from it any more.
2. Unless the store already holds a verified archive made of this header (a rerun
   after step 3 began), everything of the task is read at one etcd revision, a page
   at a time, and written as one archive; the store checks it back before anything
   is deleted. Writing the same task again replaces the file whole: one copy.
3. The task's keys are deleted in guarded chunks (``removal.Removal.sweep``; each
   key listed and pinned, so a key written after the archive's revision stops the
   sweep instead of being lost), then the header becomes ``archived`` in a
   transaction that requires every prefix of the task empty.

etcd at its quota (``NOSPACE``) refuses every put, so neither step 1 nor the end of
step 3 can be written; it still applies transactions that only delete (etcd 3.4
always, 3.5 once its database file is back under the quota). Archiving is then how
space is freed, with deletes only:

a. The archive is written as in step 2 (or the store's is kept, if it was made of
   this header and nothing of the task was written since it was read).
b. The header itself goes first, in a transaction requiring it as archived and no key
   of the task written after the archive's revision. From then on nothing can change
   the task: every writer needs its header, and a CreateTask of the same id brings the
   archived header back first (refused while etcd takes no puts). Reads of the task
   answer from the archive, as ``archived``.
c. The task's other keys are deleted as in step 3, each chunk requiring the header
   still absent.
d. The header comes back, ``archived``, in a transaction requiring it absent and every
   prefix of the task empty, as soon as etcd takes puts: at once if it does, else at
   the archiver's next sweep (or ``baton task archive`` again). Until then the archive
   store is the only record of the task.

Not relying on the alarm for exclusion is deliberate: an operator may disarm it at any
moment, and etcd 3.4 does not charge puts nested in a grouped transaction against the
quota. The store itself is ``archive_store.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

from ...kernel.errors import BatonError, IllegalTransition, NotFound, StorageFull
from ...kernel.v1 import baton_pb2 as pb
from ..records.archive_store import (
    ArchiveCorrupt,
    Archived,
    ArchiveInfo,
    ArchiveStore,
    DirectoryStore,
)
from ..records.manifest import check_id
from ..records.model import FINISHED, STATES, EntryRecord, TaskRecord, epoch_of, now
from ..rules import lifecycle
from ..rules.core import Core
from ..rules.election import Election
from ..rules.lifecycle import TaskEvent
from ..store.etcd import KV, Compare, Get, empty
from ..store.keys import prefix_end
from ..store.txn import Txn, write
from ..verbs.removal import Removal
from ..verbs.retention import holds_staging

__all__ = ["ArchiveCorrupt", "ArchiveInfo", "ArchiveStore", "Archived", "Archiver",
           "DirectoryStore"]

log = logging.getLogger("baton.registry")

#: keys read per request while an archive is written
READ_PAGE = 1000
#: pages of records read from etcd ahead of the store: what an archive holds in memory
#: is about this many pages (and the one in hand), whatever the task's size
PAGES_AHEAD = 2


class ArchiveAborted(BatonError):
    """Reading the task from etcd failed while its archive was being written: the
    store drops what it wrote (the archive is written again next time)."""


class _Handoff:
    """Records from the event loop, where they are read from etcd, to the store's
    thread, where they are written: a page at a time, and at most ``PAGES_AHEAD``
    pages ahead of the store, so that archiving a task of 100,000 entries never holds
    them all at once."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._pages: queue.SimpleQueue[list[dict[str, Any]] | BaseException | None] = (
            queue.SimpleQueue())
        self._room = asyncio.Semaphore(PAGES_AHEAD)

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record handed over, in order (on the store's thread); raises
        :class:`ArchiveAborted` if the reading side gave up."""
        while (page := self._pages.get()) is not None:
            if isinstance(page, BaseException):
                raise page
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                self._loop.call_soon_threadsafe(self._room.release)
            yield from page

    async def put(self, page: list[dict[str, Any]], store: asyncio.Future[Any]) -> None:
        """Hand ``page`` over once the store has room; raises what the store raised if
        it stopped reading first."""
        room = asyncio.ensure_future(self._room.acquire())
        try:
            await asyncio.wait({room, store}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not room.done():
                room.cancel()
        if store.done():  # it stopped reading: with its error, or too early
            if room.done() and not room.cancelled():
                self._room.release()
            await store
            raise ArchiveCorrupt("the archive store stopped reading before the end")
        self._pages.put(page)

    def end(self) -> None:
        self._pages.put(None)

    def abort(self, reason: str) -> None:
        self._pages.put(ArchiveAborted(reason))


def _mark(task: TaskRecord, reason: str) -> None:
    """``task`` as step 1 writes it (and as a task archived without puts is stored)."""
    lifecycle.apply(task, TaskEvent.ARCHIVE, lambda: IllegalTransition(
        f"cannot archive task {task.task_id!r}: it is {task.status}; only a completed "
        "or cancelled task is archived", task_id=task.task_id, status=task.status))
    task.status_reason = f"archive ({task.status_reason or 'finished'})" + (
        f": {reason}" if reason else "")


def _made_of(info: ArchiveInfo, header: KV) -> bool:
    """Whether the archive was read with the header as it is now (an archive made before
    headers' revisions were recorded: of a header marked ``archiving``, never changed)."""
    return info.header_revision in (header.mod_revision, 0)


def _count_states(states: Iterable[str]) -> dict[str, int]:
    counts = dict.fromkeys(STATES, 0)
    for state in states:
        counts[state] = counts.get(state, 0) + 1
    return {s: n for s, n in counts.items() if n}


class Archiver:
    """Archives finished tasks and answers reads of archived ones (see the module)."""

    def __init__(self, core: Core, store: ArchiveStore, after: float = 86400.0,
                 retention: float = 90 * 86400.0) -> None:
        self.core = core
        self.keys = core.keys
        self.store = store
        #: seconds after a task finished that it is archived, unless it says otherwise
        self.after = after
        #: seconds an archive is kept
        self.retention = retention
        self.removal = Removal(core)
        #: tasks this replica archived, and archives it expired (for metrics)
        self.archived = 0
        #: the election this replica archives under (None: it always archives)
        self.election: Election | None = None
        self.expired = 0
        #: per task this replica is archiving or expiring: its lock, and how many use it
        self._busy: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, task_id: str) -> AsyncIterator[None]:
        """One archive (or expiry) of a task at a time in this replica: the sweep finds
        a task ``archiving`` while ``baton task archive`` is still writing it, and two
        writes of one archive would only do the work twice. (Replicas racing are kept
        apart by the guarded transactions, and the store's temporary names.)"""
        lock, users = self._busy.get(task_id, (asyncio.Lock(), 0))
        self._busy[task_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._busy[task_id]
            if users == 1:
                del self._busy[task_id]
            else:
                self._busy[task_id] = (lock, users - 1)

    def busy(self, task_id: str) -> bool:
        """Whether this replica is archiving (or expiring) the task right now."""
        return task_id in self._busy

    # archiving ---------------------------------------------------------------------

    async def archive(self, task_id: str, reason: str = "", who: str = "") -> pb.Task:
        """Archive a finished task now (idempotent: an archived task is returned as is);
        with deletes only while etcd refuses puts. ``who``: the operator who asked
        (none: the registry's own archiving)."""
        check_id("task_id", task_id)
        if who:
            log.info("task %s: archive asked by %s (%s)", task_id, who,
                     reason or "no reason given")
        async with self._one_at_a_time(task_id):
            return await self._archive(task_id, reason)

    async def _archive(self, task_id: str, reason: str) -> pb.Task:
        try:
            task = await write(self.core.txns, self._mark_plan(task_id, reason))
        except StorageFull as full:
            return await self._without_puts(task_id, reason, full)
        if task is None:  # archived while etcd refused puts: finish it
            return await self._finish_headerless(task_id)
        if task.status == "archived":
            return task.to_pb()
        info = await self._archive_of(task_id, reason)
        await self.removal.sweep(task_id, before=info.revision + 1)
        states = await asyncio.to_thread(self._entry_states, task_id)
        try:
            done = await write(self.core.txns, self._final_plan(task_id, info, states))
        except StorageFull as full:
            return await self._without_puts(task_id, reason, full)
        self._count(task_id, info, reason)
        return done.to_pb()

    def _mark_plan(self, task_id: str, reason: str
                   ) -> Callable[[Txn], Awaitable[TaskRecord | None]]:
        key = self.keys.task(task_id)

        async def plan(txn: Txn) -> TaskRecord | None:
            kv = await txn.get(key)
            if kv is None:
                return None
            task = TaskRecord.load(kv.value)
            if task.status in ("archiving", "archived"):
                return task  # an interrupted archive carries on; a done one is done
            _mark(task, reason)
            txn.put(key, task.dump())
            return task

        return plan

    async def _archive_of(self, task_id: str, reason: str) -> ArchiveInfo:
        """The checked archive of the task as it is now: the store's if it was made of
        this header, else a new one. A task marked ``archiving`` may have lost keys to
        step 3 already, so its archive is kept whatever; one not marked has lost none
        (step b goes before any delete), so it is read again if anything of it was
        written after its archive."""
        kv = await self.core.etcd.get(self.keys.task(task_id))
        info = await asyncio.to_thread(self.store.info, task_id)
        if kv is not None and info is not None and _made_of(info, kv) and (
                TaskRecord.load(kv.value).status == "archiving"
                or await self._untouched(task_id, info.revision)):
            return info
        return await self._write(task_id, reason)

    async def _write(self, task_id: str, reason: str) -> ArchiveInfo:
        """Read the task at one revision, a page at a time, and store it, its header as
        step 1 marks it."""
        found, revision, _ = await self.core.etcd.range(self.keys.task(task_id), limit=1)
        if not found:
            raise NotFound(f"no task {task_id!r}", task_id=task_id)
        header_kv = found[0]
        header = json.loads(header_kv.value)
        task = TaskRecord.load(header_kv.value)
        if task.status != "archiving":
            _mark(task, reason)
            header = json.loads(task.dump())
        handoff = _Handoff()
        store = asyncio.ensure_future(asyncio.to_thread(
            self.store.write, task_id, revision, handoff.records(), header_kv.mod_revision))
        try:
            page: list[dict[str, Any]] = [{"kind": "task", "revision": revision,
                                           "header": header}]
            async for record in self._records(task_id, revision):
                page.append(record)
                if len(page) >= READ_PAGE:
                    await handoff.put(page, store)
                    page = []
            await handoff.put(page, store)
        except BaseException as e:
            handoff.abort(f"reading task {task_id!r} from etcd failed: {e!r}")
            store.add_done_callback(_retrieved)  # its ArchiveAborted is ours, raised here
            # The store drops what it wrote before this archive is over (and another may
            # begin): nothing half-written outlives a failed archive.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(store)
            raise
        handoff.end()
        return await store

    async def _records(self, task_id: str, revision: int) -> AsyncIterator[dict[str, Any]]:
        """The task's entries, then its journal, as archive records: as etcd had them at
        ``revision``, read a page at a time."""
        entries_base = self.keys.entries(task_id)
        async for kv in self.core.etcd.scan(entries_base, page=READ_PAGE, revision=revision):
            yield {"kind": "entry", "revision": kv.mod_revision,
                   "record": json.loads(kv.value)}
        journal_base = self.keys.journal_all(task_id)
        async for kv in self.core.etcd.scan(journal_base, page=READ_PAGE, revision=revision):
            file_id = self.keys.parse_tail(kv.key, journal_base)[0]
            yield {"kind": "journal", "file_id": file_id,
                   "revision": kv.create_revision, "record": json.loads(kv.value)}

    def _final_plan(self, task_id: str, info: ArchiveInfo, states: dict[str, int]
                    ) -> Callable[[Txn], Awaitable[TaskRecord]]:
        key = self.keys.task(task_id)

        async def plan(txn: Txn) -> TaskRecord:
            kv = await txn.get(key)
            if kv is None:
                raise NotFound(f"no task {task_id!r}", task_id=task_id)
            task = TaskRecord.load(kv.value)
            if task.status == "archived":
                return task
            if not lifecycle.allowed(task.status, TaskEvent.STORE):
                raise IllegalTransition(f"task {task_id!r} is {task.status}; not archived",
                                        task_id=task_id)
            await self._require_empty(txn, task_id, "were written after its archive: "
                                      "archive it again")
            lifecycle.apply(task, TaskEvent.STORE)
            task.archived_at, task.archive = now(), info.location
            task.archived_states = states
            txn.put(key, task.dump())
            return task

        return plan

    async def _require_empty(self, txn: Txn, task_id: str, why: str) -> None:
        """Nothing of the task but its header in etcd, now (else ``IllegalTransition``
        saying ``why``) and when ``txn`` commits."""
        prefixes = self.removal.prefixes_of(task_id)
        # Straight from etcd (the view may be behind); the compares below keep it so.
        left = await self.core.etcd.read([Get(p, prefix=True, limit=1, keys_only=True)
                                          for p in prefixes])
        if any(left):
            raise IllegalTransition(f"keys of task {task_id!r} {why}", task_id=task_id)
        for p in prefixes:
            txn.require(empty(p))

    def _count(self, task_id: str, info: ArchiveInfo, reason: str) -> None:
        self.archived += 1
        log.info("task %s archived: %d records in %s (%s)", task_id, info.records,
                 info.location, reason or "retention")

    def _entry_states(self, task_id: str) -> dict[str, int]:
        """The archived entries by state (what GetTask answers for the task)."""
        return _count_states(str(r["record"].get("state", ""))
                             for r in self.store.read(task_id) if r.get("kind") == "entry")

    # archiving while etcd refuses puts -------------------------------------------------

    async def _without_puts(self, task_id: str, reason: str, full: StorageFull) -> pb.Task:
        """Steps a to d of the module: the archive, the header deleted first, then the
        other keys; the header back at once if etcd takes puts again."""
        if await self.core.etcd.get(self.keys.task(task_id)) is None:
            return await self._finish_headerless(task_id)
        log.warning("archiving task %s with deletes only: %s", task_id, full)
        try:
            info = await self._archive_of(task_id, reason)
            dropped = await write(self.core.txns, self._drop_plan(task_id, info), fresh=True)
        except StorageFull as e:
            raise _deletes_refused(task_id, e) from e
        if dropped:
            self._count(task_id, info, reason or "etcd full")
        return await self._finish_headerless(task_id, info)

    def _untouched_since(self, task_id: str, revision: int) -> list[Compare]:
        """No key of the task (but its header) written after ``revision``: deleted keys
        are in the archive read then, and absent ones compare as revision 0."""
        return [Compare(p, "mod", "<", revision + 1, range_end=prefix_end(p))
                for p in self.removal.prefixes_of(task_id)]

    async def _untouched(self, task_id: str, revision: int) -> bool:
        """Whether nothing of the task was written after ``revision`` (a compare-only
        transaction: etcd answers it at its quota too)."""
        return (await self.core.etcd.txn(self._untouched_since(task_id, revision), [])
                ).succeeded

    def _drop_plan(self, task_id: str, info: ArchiveInfo
                   ) -> Callable[[Txn], Awaitable[bool]]:
        """Step b: delete the header as the archive read it, if nothing of the task was
        written after the archive; whether this deleted it."""
        key = self.keys.task(task_id)

        async def plan(txn: Txn) -> bool:
            kv = await txn.get(key)
            if kv is None:
                return False  # gone already: a rerun, or another replica
            if not _made_of(info, kv):
                raise IllegalTransition(f"task {task_id!r} changed after its archive was "
                                        "read: nothing deleted; archive it again",
                                        task_id=task_id)
            untouched = self._untouched_since(task_id, info.revision)
            if not (await self.core.etcd.txn(untouched, [])).succeeded:
                raise IllegalTransition(
                    f"keys of task {task_id!r} were written after its archive was read "
                    f"(revision {info.revision}): nothing deleted; archive it again",
                    task_id=task_id)
            for compare in untouched:
                txn.require(compare)
            txn.delete(key)
            return True

        return plan

    async def _finish_headerless(self, task_id: str, info: ArchiveInfo | None = None
                                 ) -> pb.Task:
        """Steps c and d for a task whose header is gone (``NotFound`` if the store has
        no archive of it either): the task as archived."""
        if info is None:
            info = await asyncio.to_thread(self.store.info, task_id)
            if info is None:
                raise NotFound(f"no task {task_id!r}", task_id=task_id)
        try:
            await self.removal.sweep(task_id, before=info.revision + 1,
                                     guard=self._header_gone(task_id))
        except StorageFull as e:
            raise _deletes_refused(task_id, e) from e
        record = await self._restored(task_id, info)
        try:
            back = await write(self.core.txns, self._restore_plan(record), fresh=True)
        except StorageFull:
            log.info("task %s archived while etcd refuses writes: its header comes back, "
                     "archived, once etcd takes writes again", task_id)
            return record.to_pb()
        return back.to_pb()

    def _header_gone(self, task_id: str) -> Callable[[Txn], Awaitable[None]]:
        """Step c's guard of each chunk: the header still absent."""
        key = self.keys.task(task_id)

        async def guard(txn: Txn) -> None:
            if await txn.get(key) is not None:
                raise IllegalTransition(f"task {task_id!r} has a header again: its keys "
                                        "are left as they are", task_id=task_id)

        return guard

    def _restore_plan(self, record: TaskRecord) -> Callable[[Txn], Awaitable[TaskRecord]]:
        """Step d: the header back, ``archived``, where there is none and nothing of the
        task is left."""
        task_id = record.task_id
        key = self.keys.task(task_id)

        async def plan(txn: Txn) -> TaskRecord:
            kv = await txn.get(key)
            if kv is not None:
                found = TaskRecord.load(kv.value)
                if found.status != "archived":
                    raise IllegalTransition(
                        f"task {task_id!r} is {found.status} in etcd, yet archived in "
                        f"{record.archive}: its header is not restored", task_id=task_id)
                return found
            await self._require_empty(txn, task_id, "are still in etcd: archive it again")
            txn.put(key, record.dump())
            txn.after(lambda: log.info("task %s: header back in etcd, archived", task_id))
            return record

        return plan

    async def _restored(self, task_id: str, info: ArchiveInfo) -> TaskRecord:
        """The header of a task archived while etcd refused puts, as step d writes it."""
        archived = await self.load(task_id)
        task = archived.header
        lifecycle.apply(task, TaskEvent.STORE)  # stored as step 1 marks it: archiving
        task.archived_at, task.archive = info.created_at, info.location
        task.archived_states = _count_states(rec.state for _, rec in archived.entries)
        return task

    async def headerless(self, task_id: str) -> TaskRecord | None:
        """For a task etcd has no header of: its header as archived, if the store has an
        archive of it (archived while etcd refused puts, the header not back yet)."""
        info = await asyncio.to_thread(self.store.info, task_id)
        return None if info is None else await self._restored(task_id, info)

    async def headerless_all(self, present: set[str]) -> list[TaskRecord]:
        """The archived tasks whose headers are not back in etcd (``present``: the task
        ids etcd has headers of)."""
        infos = await asyncio.to_thread(self.store.list)
        return [await self._restored(i.task_id, i) for i in infos if i.task_id not in present]

    # the background sweep ------------------------------------------------------------

    async def sweep(self) -> int:
        """Archive the tasks finished longer ago than their ``archive_after``, finish
        interrupted archives (headers restored too), and expire archives past the
        retention."""
        moved = 0
        clock = self.core.clock()
        present = set()
        for task in await self.headers():
            present.add(task.task_id)
            if self.busy(task.task_id):
                continue  # being archived here right now (`baton task archive`)
            try:
                if self._due(task, clock) and not (
                        task.status != "archiving"
                        and await holds_staging(self.core, task.task_id, clock)):
                    await self.archive(task.task_id)
                    moved += 1
                elif task.status == "archived" and clock - epoch_of(task.archived_at) > (
                        self.retention):
                    await self.expire(task.task_id)
            except Exception as e:  # one task (or its store's failure) never stops the others
                log.warning("archiving task %s: %s", task.task_id, _described(e))
        for info in await asyncio.to_thread(self.store.list):
            if info.task_id not in present and not self.busy(info.task_id):
                try:  # archived while etcd refused puts
                    await self.archive(info.task_id)
                except Exception as e:
                    log.warning("archiving task %s: %s", info.task_id, _described(e))
        return moved

    def _due(self, task: TaskRecord, clock: float) -> bool:
        if task.status == "archiving":
            return True
        if task.status not in FINISHED or not task.finished_at:
            return False
        after = task.archive_after or self.after
        return after >= 0 and clock - epoch_of(task.finished_at) >= after

    async def expire(self, task_id: str) -> None:
        """Delete an archive past the retention, then its header (guarded)."""
        async with self._one_at_a_time(task_id):
            await self._expire(task_id)

    async def _expire(self, task_id: str) -> None:
        key = self.keys.task(task_id)
        await asyncio.to_thread(self.store.delete, task_id)

        async def plan(txn: Txn) -> None:
            kv = await txn.get(key)
            if kv is not None and TaskRecord.load(kv.value).status == "archived":
                txn.delete(key)

        await write(self.core.txns, plan)
        self.expired += 1
        log.info("archive of task %s expired (older than %.0f days): deleted", task_id,
                 self.retention / 86400)

    # reading archived tasks ---------------------------------------------------------------

    async def load(self, task_id: str) -> Archived:
        return await asyncio.to_thread(self._load, task_id)

    def _load(self, task_id: str) -> Archived:
        header: TaskRecord | None = None
        entries: list[tuple[int, EntryRecord]] = []
        journal: list[tuple[str, int, dict[str, Any]]] = []
        for r in self.store.read(task_id):
            kind = r.get("kind")
            if kind == "task":
                header = TaskRecord.load(json.dumps(r["header"]).encode())
            elif kind == "entry":
                entries.append((int(r["revision"]),
                                EntryRecord.load(json.dumps(r["record"]).encode())))
            elif kind == "journal":
                journal.append((str(r["file_id"]), int(r["revision"]), dict(r["record"])))
        if header is None:
            raise ArchiveCorrupt(f"archive of task {task_id!r} has no header", task_id=task_id)
        return Archived(header, entries, journal)

    async def headers(self) -> list[TaskRecord]:
        """Every task header etcd keeps, read a page at a time."""
        return [TaskRecord.load(kv.value) async for kv in self.core.etcd.scan(
            self.keys.tasks(), page=READ_PAGE)]


def _described(e: Exception) -> str:
    """A failure as a log line says it: Baton's own errors by their message, others
    (the store's OSError) with their type too."""
    return str(e) if isinstance(e, BatonError) else f"{type(e).__name__}: {e}"


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Done callback: the future's exception is known already (no "never retrieved")."""
    if not future.cancelled():
        future.exception()


def _deletes_refused(task_id: str, e: StorageFull) -> StorageFull:
    """etcd refused a transaction that only deletes or compares: etcd 3.5 does while its
    database file is over the quota, the alarm or not."""
    return StorageFull(
        f"cannot archive task {task_id!r} while etcd refuses even transactions that only "
        f"delete ({e}; etcd 3.5 does while its database file is over the quota): compact "
        "and defragment etcd (`etcdctl compact`, `etcdctl defrag`), archive again, then "
        "`etcdctl alarm disarm`; if that frees too little, raise --quota-backend-bytes "
        "for a while (docs/operations.md, \"etcd upkeep\")", task_id=task_id)
