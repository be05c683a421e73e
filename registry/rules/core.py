"""What every handler of one registry replica shares, and the rules for writing an entry.

Every transition is planned through a ``txn.Txn`` and committed by
``Core.txns`` (see ``txn.py``): reads become compares, so the decision is
never applied to state it was not made on. ``put_entry`` writes an entry
with everything that follows from its state (index keys, journal records)
into the same transaction; ``retry_or_dead`` is the one retry path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import random
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from ...kernel import logs, tracing
from ...kernel.backoff import Backoff
from ...kernel.errors import BatonError, NotFound
from ...kernel.v1 import baton_pb2 as pb
from ..records.archive_store import Archived, Archives
from ..records.clock import wall
from ..records.model import CONSUMED, DEAD, PENDING, VERIFIED, EntryRecord, TaskRecord, now
from ..store.backlog import Backlogs
from ..store.etcd import KV, Etcd
from ..store.fanout import Fanout
from ..store.keys import ClaimRef, Keys
from ..store.txn import Transactions, Txn
from ..store.view import View
from .machine import Event, apply

log = logging.getLogger("baton.registry")


class Gate:
    """Runs coroutines at most ``limit`` at a time, in the background; ``drain`` waits
    for those still running. For sweeps that move many entries, one guarded
    transaction each: run together, their transactions share requests."""

    def __init__(self, limit: int) -> None:
        self._slots = asyncio.Semaphore(limit)
        self._running: set[asyncio.Task[None]] = set()

    async def submit(self, work: Awaitable[None]) -> None:
        """Start ``work`` once fewer than ``limit`` are running."""
        await self._slots.acquire()

        async def run() -> None:
            try:
                await work
            finally:
                self._slots.release()

        task = asyncio.create_task(run())
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def drain(self) -> None:
        if self._running:
            await asyncio.gather(*self._running)


async def every(interval: float, stop: asyncio.Event, sweep: Callable[[], Awaitable[object]],
                what: str) -> None:
    """Run ``sweep`` every ``interval`` seconds until ``stop``: a sweep that fails is
    logged (with its traceback if unexpected) and the next one runs as planned."""
    while not stop.is_set():
        await sweep_once(sweep, what)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


async def on_change(changed: asyncio.Event, sweep: Callable[[], Awaitable[float | None]],
                    clock: Callable[[], float], interval: float, stop: asyncio.Event,
                    what: str) -> None:
    """Run ``sweep`` once, then again whenever ``changed`` is set or the time it returned
    (epoch seconds; None or inf: none) comes, at most once per ``interval`` seconds,
    until ``stop``. A sweep that fails (logged) runs again after ``interval``."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        changed.clear()
        started = loop.time()
        due = math.inf
        try:
            due = await sweep() or math.inf
        except BatonError as e:
            log.warning("%s sweep failed: %s", what, e)
            changed.set()
        except Exception:
            log.exception("%s sweep crashed", what)
            changed.set()
        while not stop.is_set() and not changed.is_set():
            left = min(due - clock(), 30.0)  # the wall clock read again now and then
            if left <= 0:
                break
            waits = [asyncio.ensure_future(w) for w in (changed.wait(), stop.wait())]
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        pause = started + interval - loop.time()
        if pause > 0 and not stop.is_set():  # coalesced: what changes meanwhile waits
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)


async def sweep_once(sweep: Callable[[], Awaitable[object]], what: str) -> None:
    """Run one sweep of a background loop; a failure is logged, never raised."""
    try:
        await sweep()
    except BatonError as e:
        log.warning("%s sweep failed: %s", what, e)
    except Exception:
        log.exception("%s sweep crashed", what)


class Core:
    """State shared by every handler of one registry replica."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        staging_root: str,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = wall,
        view: bool = True,
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.staging_root = staging_root.rstrip("/") or "/"
        self.sleep = sleep
        self.rng = rng or random.Random()
        #: wall clock (UTC epoch seconds) for backoff and ordering; leases use etcd's
        self.clock = clock
        #: what the hot path reads, fed by a watch (None: every read goes to etcd)
        self.view = View(etcd, keys) if view else None
        #: clients' watch streams share one etcd watch per prefix (registry.fanout)
        self.fanout = Fanout(etcd)
        #: the one way to write: guarded transactions, group-committed
        self.txns = Transactions(etcd, keys.request, self.view, sleep=sleep, rng=self.rng)
        #: entries that just became verified, for the scheduler (dependents, assemblies)
        self.verified: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        #: where finished tasks go, and archived ones are read from (None: nowhere)
        self.archive: Archives | None = None
        #: seconds after which a written entry no watcher verified counts as stuck
        self.stuck_written_after = 600.0
        #: seconds a consumed entry's file stays in staging unless its manifest says
        self.staging_retention = 86400.0
        #: claims this replica refused because a concurrency pool had no free unit,
        #: per pool (the metrics' baton_pool_refusals)
        self.pool_refusals: collections.Counter[str] = collections.Counter()
        #: limited tasks' backlogs: counted for producers' claims (back-pressure)
        self.backlogs = Backlogs(etcd, keys)
        #: what watchers saw of live attempts' files before their commits, by entry
        #: (registry.verbs.verify: a hint this replica's commits take, never in etcd)
        self.early: collections.OrderedDict[tuple[str, str], dict[str, Any]] = (
            collections.OrderedDict())

    async def start(self) -> None:
        if self.view is not None:
            await self.view.start()

    async def stop(self) -> None:
        if self.view is not None:
            await self.view.stop()
        await self.txns.committer.close()
        c = self.txns.committer
        log.info("transactions: %d committed in %d etcd requests; plans made again: %s",
                 c.carried, c.requests,
                 ", ".join(f"{n} ({why})" for why, n in self.txns.replans.items()))

    def staging_dir(self, task_id: str) -> str:
        return f"{self.staging_root}/{task_id}"

    # reading (operators' paths, straight from etcd) ---------------------------

    async def task(self, task_id: str) -> tuple[KV | None, TaskRecord]:
        """The task's header (and its key), or, if etcd has none, the header of its
        archive, as ``archived`` (archived while etcd refused writes; no key)."""
        kv = await self.etcd.get(self.keys.task(task_id))
        if kv is not None:
            return kv, TaskRecord.load(kv.value)
        archived = await self.archive.headerless(task_id) if self.archive else None
        if archived is None:
            raise NotFound(f"no task {task_id!r}", task_id=task_id)
        return None, archived

    async def entry(self, task_id: str, file_id: str) -> tuple[KV, EntryRecord]:
        kv = await self.etcd.get(self.keys.entry(task_id, file_id))
        if kv is None:
            raise NotFound(f"no entry {file_id!r} in task {task_id!r}", task_id=task_id,
                           file_id=file_id)
        return kv, EntryRecord.load(kv.value)

    async def archived(self, task_id: str) -> Archived:
        """An archived task, read back from the archive."""
        if self.archive is None:
            raise NotFound(f"task {task_id!r} is archived, and this registry reads no "
                           "archive (--archive-dir)", task_id=task_id)
        return await self.archive.load(task_id)

    async def dependency_states(self, task_id: str, names: Iterable[str],
                                known: Mapping[str, str] | None = None) -> dict[str, str]:
        """The state of the entry each ``depends_on`` (or ``parts``) name of an entry of
        ``task_id`` means, by name: a file id of that task, or ``task:file_id`` of
        another, read from etcd, or from the other task's archive once it is archived;
        "missing" if there is none. ``known``: states of ``task_id``'s own entries by
        file id, already read (not read again)."""
        known = known or {}
        states = {n: known[n] for n in names if ":" not in n and n in known}
        keys = {self.keys.dependency(task_id, n): n for n in names if n not in states}
        async for _, found in self.etcd.get_chunks(list(keys)):
            for key, kv in found:
                name = keys[key]
                if kv is not None:
                    try:
                        states[name] = EntryRecord.load(kv.value).state
                    except (ValueError, TypeError):
                        states[name] = "unreadable"
                    continue
                archived = await self.archived_entry(name)
                states[name] = archived.state if archived else "missing"
        return states

    async def blocked(self, task_id: str, recs: Iterable[EntryRecord],
                      known: Mapping[str, str] | None = None) -> set[str]:
        """The file ids of ``recs`` (entries of ``task_id``) that a dead dependency or
        part blocks (``EntryRecord.blocked_by``): the one decision behind a task's count
        of blocked entries and every read's ``Entry.blocked`` (GetEntry, ListEntries,
        Explain, Watch). Only entries pending and not released look their dependencies
        up, all in one read; ``known``: states of the task's entries already read."""
        waiting = [r for r in recs if r.state == PENDING and not r.deps_ok]
        if not waiting:
            return set()
        states = await self.dependency_states(
            task_id, {n for r in waiting for n in r.parts or r.depends_on}, known)
        return {r.file_id for r in waiting if r.blocked_by(states)}

    async def mark_blocked(self, task_id: str,
                           read: Iterable[tuple[EntryRecord, pb.Entry]],
                           known: Mapping[str, str] | None = None) -> None:
        """Set ``blocked`` on each entry as a read shows it, from its record (see
        ``blocked``): every read that hands out entries goes through here."""
        pairs = list(read)
        blocked = await self.blocked(task_id, (rec for rec, _ in pairs), known)
        for rec, entry in pairs:
            entry.blocked = rec.file_id in blocked

    async def archived_entry(self, name: str) -> EntryRecord | None:
        """An entry of another task (``task:file_id``), from its archive if that task is
        archived; None if it is not (or the archive has no such entry)."""
        other, sep, file_id = name.partition(":")
        if not sep or self.archive is None:
            return None
        try:
            _, header = await self.task(other)
        except NotFound:
            return None
        if header.status != "archived":
            return None
        for _, rec in (await self.archived(other)).entries:
            if rec.file_id == file_id:
                return rec
        return None

    # the retry path --------------------------------------------------------

    def retry_or_dead(self, rec: EntryRecord, reason: str, token: int = 0,
                      event: str = "failed", who: str = "", *, delay: float = 0.0,
                      permanent: bool = False) -> None:
        """Send an entry back to ``pending`` (retry_count + 1, after a backoff) or ``dead``.

        ``delay``: the backoff is that many seconds instead (the producer knows when a
        retry may succeed); ``permanent``: dead at once, no retry spent (it knows none
        can). The caller's ``put_entry`` writes it, with its index and journal (one
        record of ``event``: ``failed``, or ``deadline`` when a claim ran out of time),
        which keeps what the attempt's explanation shows: its digest and size.
        """
        # ``who``: the identity that failed it, if one did (else the registry itself, at
        # a deadline, a lost lease, a mismatch); ``label``: the agent that held it
        digest = rec.committed_digest or rec.digest or (rec.observed or {}).get("digest", "")
        extra: dict[str, Any] = {"digest": digest} if digest else {}
        if rec.size:
            extra["size"] = rec.size
        if permanent:
            extra["permanent"] = True
        if delay:
            extra["delay"] = delay
        rec.remember(event, reason=reason, who=who, label=rec.owner, token=token,
                     attempt=rec.retry_count, **extra)
        rec.error = reason
        if permanent:
            apply(rec, Event.GIVE_UP)  # resets the attempt's fields; no retry spent
        elif rec.retry_count < rec.max_retries:
            apply(rec, Event.RETRY)  # resets the attempt's fields (machine.ATTEMPT)
            rec.retry_count += 1
            base, factor, cap = rec.backoff
            # Jitter spreads retries of entries that failed together; at least half the
            # task's backoff is kept.
            backoff = Backoff(base, cap, factor, floor=0.5, jitter=self.rng.uniform)
            wait = delay if delay else backoff.delay(rec.retry_count)
            rec.not_before = self.clock() + wait
        else:
            apply(rec, Event.DIE)

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
        if rec.fairness_key and rec.from_state is None and rec.enqueued_at:
            t = rec.enqueued_at  # created with its task's other entries: one time for all
        # Priority with aging: an entry of priority p counts as enqueued
        # p * aging seconds earlier, so a waiting low-priority entry
        # overtakes newer high-priority ones after a while; ties by age.
        rec.enqueued_at = t
        order = int((t - rec.priority * rec.aging) * 1000)
        if rec.fairness_key:
            # then by virtual time: the keys interleave by weight (registry.fairness)
            return self.keys.ready_fair(rec.task_id, order, rec.fair_time,
                                        rec.file_id).decode()
        return self.keys.ready(rec.task_id, order, rec.file_id).decode()

    def put_entry(self, rec: EntryRecord, txn: Txn) -> None:
        """Write ``rec`` with everything that follows from its state, in ``txn``:
        its index keys (ready / delayed / waiting, open, finishing, dead) and one journal
        record per event remembered since it was loaded."""
        was, now_done = rec.from_state, rec.done
        want = self._index_for(rec, self.clock())
        if want != rec.index:
            if rec.index:
                txn.delete(rec.index.encode())
            if want:
                txn.put(want.encode(), b"")
            rec.index = want
        was_done = was is not None and (was in (CONSUMED, DEAD) or (
            was == VERIFIED and not rec.consumers))
        if was is None or was_done != now_done:
            open_key = self.keys.open(rec.task_id, rec.file_id)
            if not now_done:
                txn.put(open_key, b"")
            elif was is not None:
                txn.delete(open_key)
                # The due-work signal of task completion, with its cause: whichever
                # replica finishes an entry, the leader's scheduler hears of it from etcd.
                txn.put(self.keys.finishing(rec.task_id, rec.file_id), b"")
        if (was == DEAD) != (rec.state == DEAD):
            dead_key = self.keys.dead(rec.task_id, rec.file_id)
            if rec.state == DEAD:
                txn.put(dead_key, b"")
            else:
                txn.delete(dead_key)
        self._log_move(rec, was, txn)
        for event in rec.take_events():
            rec.seq += 1
            record = {"from": was or "", "to": rec.state, **event}
            txn.put(self.keys.journal(rec.task_id, rec.file_id, rec.seq),
                    json.dumps(record, default=str).encode())
        txn.put(self.keys.entry(rec.task_id, rec.file_id), rec.dump())

    def _log_move(self, rec: EntryRecord, was: str | None, txn: Txn) -> None:
        """Once ``txn`` applies: a line for an entry that went dead (WARNING) or moved
        (DEBUG), with its task, file id and the revision it moved at."""
        dead = rec.state == DEAD and was != DEAD
        level = logging.WARNING if dead else logging.DEBUG
        if was == rec.state or not log.isEnabledFor(level):
            return
        task_id, file_id, state, error = rec.task_id, rec.file_id, rec.state, rec.error
        retries = rec.retry_count
        # the entry's trace (traces on), which the line names
        traced = {"trace_id": tid} if (tid := tracing.trace_id(rec.traceparent)) else {}

        def emit() -> None:
            if dead:
                logs.log(log, level, "entry dead", task=task_id, file_id=file_id,
                         revision=txn.revision, retries=retries, reason=error, **traced)
            else:
                logs.log(log, level, "entry moved", task=task_id, file_id=file_id,
                         revision=txn.revision, was=was or "new", now=state, **traced)

        txn.after(emit)

    def arm_deadline(self, txn: Txn, ref: ClaimRef, seconds: float) -> None:
        """In the transaction making a claim: its processing deadline, ``seconds`` from
        now (none for 0), which ``deadlines.Deadlines`` enforces."""
        if seconds > 0:
            due = int((self.clock() + seconds) * 1000)
            txn.put(self.keys.deadline(due, ref), b"")

    def arm_stall(self, txn: Txn, ref: ClaimRef, seconds: float, token: int = 0,
                  since: float = 0.0) -> None:
        """When a claim counts as stalled: ``seconds`` after ``since`` (now) unless it
        checkpoints, which ``stalls.Stalls`` enforces (none for 0). Written by the
        claim's transaction, the key's create revision is the token; a key put again
        later names it (``token``)."""
        if seconds > 0:
            due = int(((since or self.clock()) + seconds) * 1000)
            value = {"after": seconds, **({"token": token} if token else {})}
            txn.put(self.keys.stall(due, ref), json.dumps(value).encode())

    def journal_only(self, rec: EntryRecord, event: str, txn: Txn, **details: Any) -> None:
        """A journal record for an event that leaves the entry itself untouched
        (taking a consume lease): keyed after the entry's last record, made unique."""
        record = {"at": now(), "event": event, "from": rec.state, "to": rec.state, **details}
        unique = f"~{uuid.uuid4().hex[:12]}".encode()
        key = self.keys.journal(rec.task_id, rec.file_id, rec.seq) + unique
        txn.put(key, json.dumps(record, default=str).encode())
