"""Tasks: create-only manifests, reads, listings and the per-task event stream."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Mapping, Sequence

from ...kernel.errors import (
    Compacted,
    Conflict,
    IllegalTransition,
    InvalidArgument,
    InvalidManifest,
    NotFound,
    PermissionDenied,
    TaskExists,
    shown,
)
from ...kernel.v1 import baton_pb2 as pb
from ..records import access
from ..records.identity import ANONYMOUS, Caller
from ..records.manifest import ValidTask, check_id, summary, validate
from ..records.model import (
    DEAD,
    PENDING,
    STATE_FROM_PB,
    STATES,
    WRITTEN,
    EntryRecord,
    TaskRecord,
    epoch_of,
    now,
)
from ..rules import lifecycle
from ..rules.checks import claim_holder, need_task
from ..rules.core import Core
from ..rules.lifecycle import TaskEvent
from ..store.etcd import KV, empty
from ..store.fanout import Progress
from ..store.keys import ClaimRef
from ..store.txn import Txn, write
from .removal import Removal

log = logging.getLogger("baton.registry")

#: entries written per transaction: three puts each, under etcd's default 128 ops
CHUNK = 40
#: bytes of entries per transaction (etcd refuses requests over 1.5 MiB by default)
CHUNK_BYTES = 512 * 1024
#: the largest entry record stored (long dependency, dependent or part lists)
MAX_ENTRY_BYTES = 256 * 1024
#: transactions in flight while a large task is written
PARALLEL = 8
#: entries read per page when listing
LIST_PAGE = 1000
#: the longest a manifest may keep a finished task in etcd before it is archived
MAX_ARCHIVE_AFTER = 366 * 86400.0


def _stored_size(e: EntryRecord) -> int:
    """About the bytes an entry, its index key and its open key take in a request (a
    little more, never less: every field but the lists and labels is bounded)."""
    lists = sum(len(x) + 3 for x in (*e.depends_on, *e.dependents, *e.parts, *e.consumers))
    labels = sum(len(k) + len(v) + 6 for k, v in e.labels.items())
    return 1000 + 2 * len(e.path) + 4 * len(e.file_id) + len(e.task_id) * 3 + lists + labels


class _HeaderNotBack(Exception):
    """CreateTask of a task archived while etcd refused writes, its header not back."""


def readable(caller: Caller, task: TaskRecord) -> bool:
    """Whether ``caller`` may see ``task`` in a listing (access.check_reader)."""
    try:
        access.check_reader(caller, task.task_id, task.readers)
    except PermissionDenied:
        return False
    return True


class Tasks:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys
        self.removal = Removal(core)
        self.fanout = core.fanout

    async def create(self, req: pb.CreateTaskRequest) -> pb.CreateTaskResponse:
        """Create a task, or finish creating it, or confirm it exists unchanged.

        The header goes first in state ``creating``; entries follow in chunks
        (each chunk one create-only transaction); the header turns ``active``
        last. A create interrupted anywhere is completed by sending the same
        manifest again; no claim is handed out until the task is active.
        """
        # Validating 100,000 entries takes seconds of CPU: not on the event loop,
        # where it would stall every other call (and agents' keepalives).
        valid, chunks = await asyncio.to_thread(self._prepare, req.spec,
                                                self.core.staging_retention)
        await self._check_external(valid)
        archive_after = req.spec.archive_after_seconds
        if not math.isfinite(archive_after) or archive_after > MAX_ARCHIVE_AFTER:
            raise InvalidManifest(f"archive_after_seconds {archive_after} is not a number of "
                                  f"seconds up to {MAX_ARCHIVE_AFTER:.0f} (a year), 0 (the "
                                  "registry's default) or negative (never)")
        key = self.keys.task(valid.task_id)
        record = TaskRecord(
            task_id=valid.task_id,
            status=lifecycle.INITIAL,
            staging_dir=self.core.staging_dir(valid.task_id),
            entry_count=len(valid.entries),
            manifest_digest=valid.digest,
            consumers=valid.consumers,
            max_retries=valid.max_retries,
            labels=valid.labels,
            priority=valid.priority,
            backoff=list(valid.backoff),
            aging=valid.aging,
            created_at=now(),
            access=dict(valid.access or {}),
            digest_optional=valid.digest_optional,
            archive_after=archive_after,
            staging_retention=(req.spec.staging_retention_seconds
                               if req.spec.HasField("staging_retention_seconds") else None),
            routing_rules=[{"condition": r.condition, "groups": r.groups,
                            **({"pools": r.pools} if r.pools else {})}
                           for r in valid.routing_rules],
            readers=access.readers_of(dict(valid.access or {}), valid.entries,
                                      valid.consumers),
            pools=dict(valid.pools or {}),
            pools_used=list(valid.pools_used),
            backlog_limits=dict(valid.backlog_limits),
            fairness_weights=valid.fairness or {},
            fairness_default=valid.fairness_default,
            cross_deps=any(":" in d for e in valid.entries for d in e.depends_on),
        )
        if valid.fairness:
            # One enqueue time for the task's entries, whichever chunk writes them, so
            # that their fairness keys interleave by weight (registry.fairness).
            enqueued = self.core.clock()
            for e in valid.entries:
                if e.deps_ok:  # claimable once the task is active; the others when released
                    e.enqueued_at = enqueued

        async def header(txn: Txn) -> TaskRecord | None:
            """Create the header; or the existing one, if there is one."""
            found = await txn.get(key)
            if found is not None:
                return TaskRecord.load(found.value)
            await self._not_archived(valid.task_id)
            for prefix in self.removal.prefixes_of(valid.task_id):
                txn.require(empty(prefix))  # no key of an earlier task of this id left
            txn.put(key, record.dump())
            return None

        try:
            existing = await write(self.core.txns, header)
        except _HeaderNotBack:
            existing = await self._header_back(valid.task_id)
        created = existing is None
        if existing is not None:
            if existing.manifest_digest != valid.digest:
                raise TaskExists(
                    f"task {valid.task_id!r} already exists with a different manifest",
                    task_id=valid.task_id,
                )
            if existing.status == "deleting":
                raise IllegalTransition(
                    f"task {valid.task_id!r} is being deleted; finish that with `baton task "
                    f"delete {valid.task_id}`, then create it again", task_id=valid.task_id,
                    status="deleting")
            if existing.status != "creating":
                return pb.CreateTaskResponse(task=existing.to_pb(), created=False)
        await self._write_entries(valid.task_id, chunks)

        async def activate(txn: Txn) -> TaskRecord:
            task = need_task(await txn.get(key), valid.task_id)
            if lifecycle.allowed(task.status, TaskEvent.ACTIVATE):
                lifecycle.apply(task, TaskEvent.ACTIVATE)
                txn.put(key, task.dump())
            return task

        record = await write(self.core.txns, activate)
        log.info("task created: %s (%d entries)", record.task_id, record.entry_count)
        return pb.CreateTaskResponse(task=record.to_pb(), created=created)

    async def _not_archived(self, task_id: str) -> None:
        """A task of this id archived while etcd refused writes (its header not back in
        etcd yet) raises ``_HeaderNotBack``."""
        if self.core.archive is not None and await asyncio.to_thread(
                self.core.archive.store.info, task_id) is not None:
            raise _HeaderNotBack()

    async def _header_back(self, task_id: str) -> TaskRecord:
        """The header of a task archived while etcd refused writes, put back (as the
        archiver's sweep would) to answer a CreateTask of the same id as for any
        archived task; ``IllegalTransition`` if etcd does not take it yet."""
        assert self.core.archive is not None
        await self.core.archive.archive(task_id)
        kv = await self.core.etcd.get(self.keys.task(task_id))
        if kv is None:
            raise IllegalTransition(
                f"task {task_id!r} was archived while etcd refused writes, and its header "
                "is not back in etcd yet: it cannot be created again (once etcd takes "
                f"writes, the archiver's sweep or `baton task archive {task_id}` brings "
                "it back)", task_id=task_id, status="archived")
        return TaskRecord.load(kv.value)

    async def _check_external(self, valid: ValidTask) -> None:
        """Every entry of another task named in ``depends_on`` must exist (in etcd, or
        in the archive of that task): refused at creation, like an unknown entry."""
        names = sorted({d for e in valid.entries for d in e.depends_on if ":" in d})
        if not names:
            return
        keys = {self.keys.dependency(valid.task_id, n): n for n in names}
        missing = []
        async for _, found in self.core.etcd.get_chunks(list(keys)):
            for key, kv in found:
                if kv is None and await self.core.archived_entry(keys[key]) is None:
                    missing.append(keys[key])
        if missing:
            problems = [f"depends on {shown(n)}, which does not exist (create task "
                        f"{shown(n.partition(':')[0])} first)" for n in missing]
            raise InvalidManifest(summary(problems), problems=problems)

    @staticmethod
    def _prepare(spec: pb.TaskSpec, retention: float = 86400.0,
                 ) -> tuple[ValidTask, list[list[EntryRecord]]]:
        """Validate a manifest and cut its entries into transactions etcd accepts, by
        count and by bytes; an entry too large to store at all is refused here, before
        anything is written (it would leave the task ``creating`` half-way). Entries
        whose manifest names no staging retention get ``retention`` (the registry's)."""
        valid = validate(spec)
        for e in valid.entries:
            if e.staging_retention is None:
                e.staging_retention = retention
        chunks: list[list[EntryRecord]] = []
        size = 0
        too_large = []
        for e in valid.entries:
            n = _stored_size(e)
            if n > MAX_ENTRY_BYTES:
                too_large.append(f"entry {e.file_id!r} would be stored as {n} bytes "
                                 f"(at most {MAX_ENTRY_BYTES}): shorten its depends_on, "
                                 "parts or labels, or the number of entries depending on it")
                continue
            if not chunks or len(chunks[-1]) >= CHUNK or size + n > CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(e)
            size += n
        if too_large:
            shown = too_large[:20]
            more = f" (and {len(too_large) - 20} more)" if len(too_large) > 20 else ""
            raise InvalidManifest("invalid manifest: " + "; ".join(shown) + more,
                                  problems=too_large)
        return valid, chunks

    async def _write_entries(self, task_id: str, chunks: list[list[EntryRecord]]) -> None:
        gate = asyncio.Semaphore(PARALLEL)
        header = self.keys.task(task_id)

        async def still_creating(txn: Txn) -> None:
            """Chunks are written only while the header says ``creating`` (pinned): a
            task deleted meanwhile gets no entries written after its header is gone."""
            task = need_task(await txn.get(header), task_id)
            if task.status != "creating":
                raise IllegalTransition(
                    f"task {task_id!r} is {task.status}: its creation was stopped",
                    task_id=task_id, status=task.status)

        async def chunk(batch: list[EntryRecord]) -> None:
            async def plan(txn: Txn) -> None:
                txn.cache_writes = False  # a bulk write: not what claims read next
                await still_creating(txn)
                for e in batch:
                    txn.pin(self.keys.entry(e.task_id, e.file_id), None)  # create-only
                    self.core.put_entry(e, txn)  # the entry, its index key and open key

            async with gate:
                # Built under the gate: building every chunk up front would keep the
                # loop busy while the first transactions wait out their deadline.
                try:
                    await write(self.core.txns, plan, attempts=1)
                except Conflict:
                    # An entry exists already (an earlier, interrupted create of the
                    # same manifest wrote this chunk: chunks are atomic), or the header
                    # changed: then say why, from etcd itself.
                    await write(self.core.txns, still_creating)

        await asyncio.gather(*(chunk(batch) for batch in chunks))

    async def get(self, task_id: str) -> pb.Task:
        """The task with counts by state and by consumer group (reads every entry), and
        its limited groups' backlogs."""
        check_id("task_id", task_id)
        _, record = await self.core.task(task_id)
        if record.status == "archived":  # its counts were kept when it was archived
            task = record.to_pb()
            task.dead = record.archived_states.get(DEAD, 0)
            return task
        counts = dict.fromkeys(STATES, 0)
        by_group = dict.fromkeys(record.consumers, 0)
        states: dict[str, str] = {}
        pending_deps: list[EntryRecord] = []
        stuck_before = self.core.clock() - self.core.stuck_written_after
        stuck = staged = 0
        async for kv in self._entries(task_id):
            rec = EntryRecord.load(kv.value)
            counts[rec.state] += 1
            staged += rec.staged_bytes
            stuck += rec.state == WRITTEN and 0 < epoch_of(rec.updated_at) < stuck_before
            states[rec.file_id] = rec.state
            for group in rec.consumed_by:
                by_group[group] = by_group.get(group, 0) + 1
            if rec.state == PENDING and not rec.deps_ok:
                pending_deps.append(rec)
        # Dependencies on other tasks' entries are read (this task's are known).
        blocked = len(await self.core.blocked(task_id, pending_deps, known=states))
        task = record.to_pb(states=counts)
        task.consumed_by_group.update(by_group)
        task.blocked = blocked
        task.stuck_written = stuck
        task.staging_bytes = staged
        task.open, task.dead = await self._progress(task_id)
        if record.backlog_limits and record.status not in ("completed", "cancelled"):
            task.backlog.extend(b.to_pb() for b in await self.core.backlogs.count(
                task_id, record.backlog_limits))
        return task

    async def _progress(self, task_id: str) -> tuple[int, int]:
        """(entries not done, dead entries), from the indexes: no scan of the task."""
        return (await self.core.etcd.count(self.keys.open_all(task_id)),
                await self.core.etcd.count(self.keys.dead_all(task_id)))

    async def list(self, req: pb.ListTasksRequest,
                   caller: Caller = ANONYMOUS) -> pb.ListTasksResponse:
        """The tasks in etcd; with ``archived``, the archived ones instead; only those
        ``caller`` may read (access.check_reader)."""
        records = [TaskRecord.load(kv.value) async for kv in self.core.etcd.scan(
            self.keys.tasks(), page=LIST_PAGE)]
        if req.archived and self.core.archive is not None:
            # and those archived while etcd refused writes, their headers not back yet
            records += await self.core.archive.headerless_all({r.task_id for r in records})
            records.sort(key=lambda r: r.task_id)
        tasks = []
        for record in records:
            if (record.status == "archived") != req.archived or not readable(caller, record):
                continue
            task = record.to_pb()
            if req.archived:
                task.dead = record.archived_states.get(DEAD, 0)
            else:
                task.open, task.dead = await self._progress(task.spec.task_id)
            tasks.append(task)
        return pb.ListTasksResponse(tasks=tasks)

    async def _entries(self, task_id: str, revision: int = 0,
                       start_after: str = "") -> AsyncIterator[KV]:
        prefix = self.keys.entries(task_id)
        start = self.keys.entry(task_id, start_after) + b"\0" if start_after else None
        while True:
            kvs, rev, more = await self.core.etcd.range(
                prefix, start=start, limit=LIST_PAGE, revision=revision
            )
            revision = revision or rev
            for kv in kvs:
                yield kv
            if not more:
                return
            start = kvs[-1].key + b"\0"

    async def get_entry(self, req: pb.GetEntryRequest) -> pb.Entry:
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        try:
            kv, rec = await self.core.entry(req.task_id, req.file_id)
        except NotFound:
            _, task = await self.core.task(req.task_id)
            if task.status != "archived":
                raise
            entries = (await self.core.archived(req.task_id)).entries
            for rev, archived in entries:
                if archived.file_id == req.file_id:
                    entry = archived.to_pb(self.core.staging_dir(req.task_id), revision=rev)
                    await self.core.mark_blocked(req.task_id, [(archived, entry)],
                                                 known={r.file_id: r.state for _, r in entries})
                    return entry
            raise
        return await self._entry_pb(kv, rec)

    async def _entry_pb(self, kv: KV, rec: EntryRecord) -> pb.Entry:
        claim = await self.core.etcd.get(self.keys.claim(ClaimRef("p", rec.task_id, rec.file_id)))
        consuming = {}
        for group in rec.consumers:
            c = await self.core.etcd.get(
                self.keys.claim(ClaimRef("c", rec.task_id, rec.file_id, group)))
            if c is not None:
                consuming[group] = claim_holder(c)
        entry = rec.to_pb(
            self.core.staging_dir(rec.task_id),
            revision=kv.mod_revision,
            token=claim.create_revision if claim else 0,
            consuming=consuming,
        )
        await self.core.mark_blocked(rec.task_id, [(rec, entry)])
        return entry

    async def list_entries(self, req: pb.ListEntriesRequest) -> pb.ListEntriesResponse:
        check_id("task_id", req.task_id)
        _, task = await self.core.task(req.task_id)
        if req.start_after:
            check_id("file_id", req.start_after)
        if req.limit < 0:
            raise InvalidArgument("limit must be ≥ 0")
        want = STATE_FROM_PB.get(req.state) if req.state else None
        staging = self.core.staging_dir(req.task_id)
        out: list[tuple[EntryRecord, pb.Entry]] = []
        # the states of the entries passed over too: their dependents' need no read
        states: dict[str, str] = {}
        async for rev, rec in self._records(req.task_id, req.start_after,
                                            task.status == "archived"):
            states[rec.file_id] = rec.state
            if want is None or rec.state == want:
                out.append((rec, rec.to_pb(staging, revision=rev)))
                if req.limit and len(out) >= req.limit:
                    break
        await self.core.mark_blocked(req.task_id, out, known=states)
        return pb.ListEntriesResponse(entries=[entry for _, entry in out])

    async def _records(self, task_id: str, start_after: str,
                       archived: bool) -> AsyncIterator[tuple[int, EntryRecord]]:
        """The task's entries in file id order (from its archive once archived), each
        with the revision it was last written at."""
        if archived:
            for rev, rec in (await self.core.archived(task_id)).entries:
                if rec.file_id > start_after:
                    yield rev, rec
            return
        async for kv in self._entries(task_id, start_after=start_after):
            yield kv.mod_revision, EntryRecord.load(kv.value)

    async def watch(self, req: pb.WatchRequest) -> AsyncIterator[Sequence[pb.TaskEvent]]:
        """A snapshot of the task's entries (unless resuming), then every change: in
        runs of events, those one etcd watch response brought (or one page of a
        listing)."""
        check_id("task_id", req.task_id)
        wanted = frozenset(STATE_FROM_PB.get(s, "") for s in req.states)
        if "" in wanted:
            bad = next(s for s in req.states if s not in STATE_FROM_PB)
            raise InvalidArgument(f"states: {bad} is not an entry state")
        await self.core.task(req.task_id)
        staging = self.core.staging_dir(req.task_id)
        start = req.start_revision
        if start < 0:
            _, at, _ = await self.core.etcd.range(self.keys.task(req.task_id), limit=1)
            yield [pb.TaskEvent(kind=pb.TaskEvent.KIND_SYNCED, revision=at)]
            start = at + 1
        elif start == 0:
            # One consistent snapshot at revision ``at``, then changes after it.
            _, at, _ = await self.core.etcd.range(self.keys.task(req.task_id), limit=1)
            states: dict[str, str] = {}
            page: list[tuple[EntryRecord, pb.Entry]] = []
            async for kv in self._entries(req.task_id, revision=at):
                rec = EntryRecord.load(kv.value)
                states[rec.file_id] = rec.state
                if wanted and rec.state not in wanted:
                    continue
                page.append((rec, rec.to_pb(staging, revision=kv.mod_revision)))
                if len(page) >= LIST_PAGE:
                    if events := await self._events(pb.TaskEvent.KIND_SNAPSHOT, page, states):
                        yield events
                    page = []
            if events := await self._events(pb.TaskEvent.KIND_SNAPSHOT, page, states):
                yield events
            yield [pb.TaskEvent(kind=pb.TaskEvent.KIND_SYNCED, revision=at)]
            start = at + 1
        while True:
            sent = False
            try:
                async for batch in self.fanout.follow(self.keys.entries(req.task_id), start):
                    if isinstance(batch, Progress):
                        if req.progress:
                            sent = True
                            yield [pb.TaskEvent(kind=pb.TaskEvent.KIND_PROGRESS,
                                                revision=batch.revision)]
                        continue
                    changed = []
                    for ev in batch:
                        if ev.kind == "put":
                            rec = EntryRecord.load(ev.kv.value)
                            if wanted and rec.state not in wanted:
                                continue
                            changed.append(
                                (rec, rec.to_pb(staging, revision=ev.kv.mod_revision)))
                    if events := await self._events(pb.TaskEvent.KIND_CHANGED, changed):
                        sent = True
                        yield events
                return
            except Compacted:
                if not req.catch_up or sent:
                    raise
            # The resume's revision is gone: what changed since is what was written
            # since (etcd's entries carry their last revision); then on from there.
            _, at, _ = await self.core.etcd.range(self.keys.task(req.task_id), limit=1)
            caught: list[tuple[EntryRecord, pb.Entry]] = []
            async for kv in self._entries(req.task_id, revision=at):
                if kv.mod_revision < start:
                    continue
                rec = EntryRecord.load(kv.value)
                if wanted and rec.state not in wanted:
                    continue
                caught.append((rec, rec.to_pb(staging, revision=kv.mod_revision)))
                if len(caught) >= LIST_PAGE:
                    if events := await self._events(pb.TaskEvent.KIND_CHANGED, caught):
                        yield events
                    caught = []
            if events := await self._events(pb.TaskEvent.KIND_CHANGED, caught):
                yield events
            log.info("watch of %s resumed from compacted revision %d: caught up to %d",
                     req.task_id, start, at)
            start = at + 1

    async def _events(self, kind: pb.TaskEvent.Kind.ValueType,
                      read: Sequence[tuple[EntryRecord, pb.Entry]],
                      known: Mapping[str, str] | None = None) -> Sequence[pb.TaskEvent]:
        """Watch events of entries as read, each saying whether it is blocked (one
        dependency read for the lot; ``known``: states of the task's entries read)."""
        if not read:
            return []
        await self.core.mark_blocked(read[0][0].task_id, read, known)
        return [pb.TaskEvent(kind=kind, entry=entry, revision=entry.revision)
                for _, entry in read]

    async def watch_tasks(self, caller: Caller = ANONYMOUS, start_revision: int = 0,
                          progress: bool = False) -> AsyncIterator[tuple[pb.Task | None, int]]:
        """Every task header now (those ``caller`` may read), then each one again whenever
        it changes; each with the revision it was written at. From ``start_revision``
        (> 0): only the headers written since, then changes. With ``progress``, ``(None,
        revision)`` after the snapshot and, while no header changes, now and then: every
        change up to ``revision`` has been sent.

        A resume from a revision etcd has compacted is caught up from the headers as they
        are now (each carries the revision it was last written at): those written since
        are sent, the rest were sent before. Headers are few (one per task), so the look
        is one paged read; a resume that was not compacted reads none."""
        if start_revision < 0:
            raise InvalidArgument("start_revision must be ≥ 0")
        base = self.keys.tasks()
        start = start_revision
        if start == 0:
            _, at, _ = await self.core.etcd.range(base, limit=1, keys_only=True)
            async for kv in self.core.etcd.scan(base, page=LIST_PAGE, revision=at):
                if readable(caller, record := TaskRecord.load(kv.value)):
                    yield record.to_pb(), kv.mod_revision
            if progress:
                yield None, at
            start = at + 1
        while True:
            try:
                async for batch in self.fanout.follow(base, start):
                    if isinstance(batch, Progress):
                        if progress:
                            yield None, batch.revision
                        start = batch.revision + 1
                        continue
                    for ev in batch:
                        start = max(start, ev.kv.mod_revision + 1)
                        if ev.kind == "put" and readable(
                                caller, record := TaskRecord.load(ev.kv.value)):
                            yield record.to_pb(), ev.kv.mod_revision
                return
            except Compacted:
                pass  # caught up below from the headers as they are now
            _, at, _ = await self.core.etcd.range(base, limit=1, keys_only=True)
            async for kv in self.core.etcd.scan(base, page=LIST_PAGE, revision=at):
                if kv.mod_revision >= start and readable(
                        caller, record := TaskRecord.load(kv.value)):
                    yield record.to_pb(), kv.mod_revision
            log.info("task headers' watch resumed from compacted revision %d: caught up "
                     "to %d", start, at)
            if progress:
                yield None, at
            start = at + 1
