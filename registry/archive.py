"""Finished tasks out of etcd: the archive store, and archiving a task into it.

etcd holds what is live. A task that completed or was cancelled is, after its
``archive_after`` (a manifest field; the registry's ``--archive-after`` by default),
written to an archive store with its entries and journal, verified there, and only
then removed from etcd; etcd keeps its header, status ``archived``, naming the
archive. Reads of the task (get, entries, journal, explain) are then answered from
the archive. Archives older than ``--archive-retention`` are deleted, headers too.

Archiving is three steps, each safe to interrupt, and a rerun finishes the job:

1. One guarded transaction marks the header ``archiving`` (from ``completed`` or
   ``cancelled``): nothing resumes, cancels, requeues or claims from it any more.
2. Unless the store already holds a verified archive of the task (a rerun after
   step 3 began), everything of the task is read at one etcd revision, a page at a
   time, and written as one archive; the store checks it back before anything is
   deleted. Writing the same task again replaces the file whole: one copy.
3. The task's keys are deleted in guarded chunks (``removal.Removal.sweep``; each
   key listed and pinned, so a key written after the archive's revision stops the
   sweep instead of being lost), then the header becomes ``archived`` in a
   transaction that requires every prefix of the task empty.

The store is one small interface (:class:`ArchiveStore`); :class:`DirectoryStore`
keeps one gzip-compressed JSON Lines file per task with a BLAKE3 checksum beside
it. An object store fits the same five methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import blake3

from baton_relay.client.errors import BatonError, IllegalTransition, NotFound
from baton_relay.client.v1 import baton_pb2 as pb

from ._etcd import Get, empty
from .claims import need_task
from .core import Core
from .manifest import check_id
from .model import FINISHED, STATES, EntryRecord, TaskRecord, epoch_of, now
from .removal import Removal
from .txn import Txn, write

log = logging.getLogger("baton.registry")

#: keys read per request while an archive is written
READ_PAGE = 1000
#: records written to the store per batch (each batch one trip to a thread)
WRITE_BATCH = 2000
_SUFFIX = ".jsonl.gz"
_META = ".meta.json"


class ArchiveCorrupt(BatonError):
    """An archive does not match its checksum (or cannot be read back)."""


@dataclass(frozen=True)
class ArchiveInfo:
    """What the store knows of one archive."""

    task_id: str
    location: str
    digest: str
    size: int
    records: int
    revision: int
    created_at: str


class ArchiveStore(Protocol):
    """Where archives live. Every method may block; the registry calls them in a thread."""

    def write(self, task_id: str, revision: int, records: Iterator[dict[str, Any]]
              ) -> ArchiveInfo:
        """Store the records as the task's archive, replacing any, and check it back."""
        ...

    def info(self, task_id: str) -> ArchiveInfo | None:
        """The task's archive, checked against its checksum; None if there is none."""
        ...

    def read(self, task_id: str) -> Iterator[dict[str, Any]]:
        """The records of the task's archive, in the order written."""
        ...

    def list(self) -> list[ArchiveInfo]:
        """Every archive (as recorded, not re-checked)."""
        ...

    def delete(self, task_id: str) -> None:
        ...


class DirectoryStore:
    """``ROOT/{task}.jsonl.gz`` and ``ROOT/{task}.meta.json`` (its BLAKE3 digest, size,
    record count and etcd revision). Each file is written to a temporary name, synced
    and renamed; the meta file goes last, so an archive without one is incomplete and
    is written again."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _paths(self, task_id: str) -> tuple[Path, Path]:
        check_id("task_id", task_id)
        return self.root / f"{task_id}{_SUFFIX}", self.root / f"{task_id}{_META}"

    def write(self, task_id: str, revision: int, records: Iterator[dict[str, Any]]
              ) -> ArchiveInfo:
        self.root.mkdir(parents=True, exist_ok=True)
        data, meta = self._paths(task_id)
        with contextlib.suppress(FileNotFoundError):
            meta.unlink()  # from here on the old archive (if any) is incomplete
        tmp = data.with_name(f".{data.name}.{os.getpid()}.tmp")
        count = 0
        with open(tmp, "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
                for record in records:
                    out.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
                    count += 1
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, data)
        digest, size = _digest(data)
        info = ArchiveInfo(task_id, str(data), digest, size, count, revision, now())
        _write_synced(meta, json.dumps(asdict(info)).encode())
        _sync_dir(self.root)
        checked = self.info(task_id)
        if checked is None or checked.records != count:
            raise ArchiveCorrupt(f"archive of task {task_id!r} did not read back whole")
        return checked

    def info(self, task_id: str) -> ArchiveInfo | None:
        data, meta = self._paths(task_id)
        try:
            info = ArchiveInfo(**json.loads(meta.read_bytes()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as e:
            raise ArchiveCorrupt(f"archive of task {task_id!r}: unreadable {meta}: {e}") from e
        try:
            digest, size = _digest(data)
        except FileNotFoundError:
            raise ArchiveCorrupt(f"archive of task {task_id!r}: {data} is missing") from None
        if (digest, size) != (info.digest, info.size):
            raise ArchiveCorrupt(f"archive of task {task_id!r}: {data} does not match its "
                                 f"checksum (BLAKE3 {digest[:16]}…, recorded "
                                 f"{info.digest[:16]}…)", task_id=task_id)
        return info

    def read(self, task_id: str) -> Iterator[dict[str, Any]]:
        data, _ = self._paths(task_id)
        try:
            with gzip.open(data, "rb") as f:
                for line in f:
                    yield json.loads(line)
        except FileNotFoundError:
            raise NotFound(f"task {task_id!r} has no archive", task_id=task_id) from None
        except (OSError, ValueError, EOFError) as e:
            raise ArchiveCorrupt(f"archive of task {task_id!r} cannot be read: {e}",
                                 task_id=task_id) from e

    def list(self) -> list[ArchiveInfo]:
        out = []
        for meta in sorted(self.root.glob(f"*{_META}")):
            with contextlib.suppress(OSError, ValueError, TypeError):
                out.append(ArchiveInfo(**json.loads(meta.read_bytes())))
        return out

    def delete(self, task_id: str) -> None:
        data, meta = self._paths(task_id)
        for path in (meta, data):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _digest(path: Path) -> tuple[str, int]:
    h = blake3.blake3()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _write_synced(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Archived:
    """An archived task as read back: its header, entries (with their revisions) and
    journal records (file id, revision, record)."""

    header: TaskRecord
    entries: list[tuple[int, EntryRecord]]
    journal: list[tuple[str, int, dict[str, Any]]]


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
        self.expired = 0

    # archiving ---------------------------------------------------------------------

    async def archive(self, task_id: str, reason: str = "") -> pb.Task:
        """Archive a finished task now (idempotent: an archived task is returned as is)."""
        check_id("task_id", task_id)
        task = await write(self.core.txns, self._mark_plan(task_id, reason))
        if task.status == "archived":
            return task.to_pb()
        info = await asyncio.to_thread(self.store.info, task_id)
        if info is None:
            info = await self._write(task_id)
        await self.removal.sweep(task_id, before=info.revision + 1)
        states = await asyncio.to_thread(self._entry_states, task_id)
        done = await write(self.core.txns, self._final_plan(task_id, info, states))
        self.archived += 1
        log.info("task %s archived: %d records in %s (%s)", task_id, info.records,
                 info.location, reason or "retention")
        return done.to_pb()

    def _mark_plan(self, task_id: str, reason: str) -> Callable[[Txn], Awaitable[TaskRecord]]:
        key = self.keys.task(task_id)

        async def plan(txn: Txn) -> TaskRecord:
            task = need_task(await txn.get(key), task_id)
            if task.status in ("archiving", "archived"):
                return task  # an interrupted archive carries on; a done one is done
            if task.status not in FINISHED:
                raise IllegalTransition(
                    f"cannot archive task {task_id!r}: it is {task.status}; only a "
                    "completed or cancelled task is archived", task_id=task_id,
                    status=task.status)
            task.status = "archiving"
            task.status_reason = f"archive ({task.status_reason or 'finished'})" + (
                f": {reason}" if reason else "")
            txn.put(key, task.dump())
            return task

        return plan

    async def _write(self, task_id: str) -> ArchiveInfo:
        """Read the task at one revision, a page at a time, and store it."""
        found, revision, _ = await self.core.etcd.range(self.keys.task(task_id), limit=1)
        if not found:
            raise NotFound(f"no task {task_id!r}", task_id=task_id)
        header_kv = found[0]
        records: list[dict[str, Any]] = [{"kind": "task", "revision": revision,
                                          "header": json.loads(header_kv.value)}]
        entries_base = self.keys.entries(task_id)
        async for kv in self.core.etcd.scan(entries_base, page=READ_PAGE, revision=revision):
            records.append({"kind": "entry", "revision": kv.mod_revision,
                            "record": json.loads(kv.value)})
        journal_base = self.keys.journal_all(task_id)
        async for kv in self.core.etcd.scan(journal_base, page=READ_PAGE, revision=revision):
            file_id = self.keys.parse_tail(kv.key, journal_base)[0]
            records.append({"kind": "journal", "file_id": file_id,
                            "revision": kv.create_revision, "record": json.loads(kv.value)})
        return await asyncio.to_thread(self.store.write, task_id, revision, iter(records))

    def _final_plan(self, task_id: str, info: ArchiveInfo, states: dict[str, int]
                    ) -> Callable[[Txn], Awaitable[TaskRecord]]:
        key = self.keys.task(task_id)
        prefixes = self.removal.prefixes_of(task_id)

        async def plan(txn: Txn) -> TaskRecord:
            task = need_task(await txn.get(key), task_id)
            if task.status == "archived":
                return task
            if task.status != "archiving":
                raise IllegalTransition(f"task {task_id!r} is {task.status}; not archived",
                                        task_id=task_id)
            left = await self.core.etcd.read([Get(p, prefix=True, limit=1, keys_only=True)
                                              for p in prefixes])
            if any(left):
                raise IllegalTransition(f"keys of task {task_id!r} were written after its "
                                        "archive: archive it again", task_id=task_id)
            for p in prefixes:
                txn.require(empty(p))
            task.status, task.archived_at, task.archive = "archived", now(), info.location
            task.archived_states = states
            txn.put(key, task.dump())
            return task

        return plan

    def _entry_states(self, task_id: str) -> dict[str, int]:
        """The archived entries by state (what GetTask answers for the task)."""
        states = dict.fromkeys(STATES, 0)
        for r in self.store.read(task_id):
            if r.get("kind") == "entry":
                state = str(r["record"].get("state", ""))
                states[state] = states.get(state, 0) + 1
        return {s: n for s, n in states.items() if n}

    # the background sweep ------------------------------------------------------------

    async def sweep(self) -> int:
        """Archive the tasks finished longer ago than their ``archive_after``, finish
        interrupted archives, and expire archives past the retention."""
        moved = 0
        clock = self.core.clock()
        kvs, _, _ = await self.core.etcd.range(self.keys.tasks())
        for kv in kvs:
            task = TaskRecord.load(kv.value)
            due = self._due(task, clock)
            try:
                if due:
                    await self.archive(task.task_id)
                    moved += 1
                elif task.status == "archived" and clock - epoch_of(task.archived_at) > (
                        self.retention):
                    await self.expire(task.task_id)
            except BatonError as e:  # one task never stops the others
                log.warning("archiving task %s: %s", task.task_id, e)
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
        """The headers etcd keeps of archived tasks."""
        kvs, _, _ = await self.core.etcd.range(self.keys.tasks())
        return [t for t in (TaskRecord.load(kv.value) for kv in kvs) if t.status == "archived"]

