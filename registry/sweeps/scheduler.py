"""Background moves that no caller makes: entries whose backoff ended, whose
dependencies (or parts) are now verified, and tasks whose entries are all done.

Each move is one guarded transaction (``txn.write``), so several replicas may
run schedulers at once: the compares let exactly one of them apply each move.
None moves an entry of a cancelled task (``Scheduler.unless_cancelled``): its entries
stay as they were.
Its sweeps run on the elected replica only, and each reads the head of an index of
what is due, never every stored entry or task: ``delayed/`` and ``cdelayed/``
(backoffs and nacks), ``wakes/`` (an entry became verified and something waits for
it), ``finishing/`` (an entry finished: its task may be complete) and ``cancels/`` (a
cancel that may have stopped part-way), each key written by the same transaction as
its cause. A sweep runs only when its index is written or a key of it falls due, as
the leader's watch of the indexes tells it (``follow``, ``registry.sweeps``): keys
put under ``delayed/``, ``cdelayed/`` and ``cancels/`` name their due time, which is
kept per task (``Dues``), and only the tasks with a key due are read then. Another
task's verification writes no wake key for the entries waiting on it across tasks
(``TaskRecord.cross_deps``): the entries they wait for are followed instead
(``registry.waits``). A replica that becomes the leader first looks once at tasks
whose header an older registry wrote (``learn``): those have no such keys yet
(docs/architecture.md). Verifications made by any replica also wake that replica's
scheduler at once (``Core.verified``), leader or not: its own work, done as it
happens. Every listing is read a page at a time, and one entry or task that cannot be
handled (a corrupt record, a move that keeps conflicting) is logged and passed over
(and looked at again soon): it never stops the sweep for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

from ...kernel.contract import assembly_digest
from ..records.model import CONSUMED, PENDING, VERIFIED, EntryRecord, TaskRecord, now
from ..rules import lifecycle
from ..rules.checks import need_task, voided
from ..rules.core import Core, Gate
from ..rules.election import Election
from ..rules.lifecycle import TaskEvent
from ..rules.machine import Event, apply
from ..rules.sweeping import (
    Alarm,
    Complaints,
    Dues,
    SweepWatch,
    follow_due,
    rings,
    run_sweep,
    swept_due,
    told,
)
from ..store.etcd import KV, Delete, Guarded, Watched, empty, present, unchanged
from ..store.keys import prefix_end
from ..store.txn import Retry, Txn, write
from ..verbs.operators import Operators
from ..verbs.verify import Verifier
from .waits import WAITING_STATUSES, CrossWaits

log = logging.getLogger("baton.registry")

#: seconds between two looks at task completion at most (each walks the open index of
#: the tasks in which something finished)
SLOW_SWEEP = 2.0
#: keys read per request when listing an index (delayed, waiting, task headers)
SCAN_PAGE = 1000
#: handled index keys deleted per etcd request (each guarded on its own)
FORGET_CHUNK = 100
#: entries promoted at once when their backoffs end (each its own transaction)
PROMOTE_PARALLEL = 32
#: dependencies (parts) of one entry pinned by its release; beyond, read unpinned
PIN_MAX = 100



class Scheduler:
    def __init__(self, core: Core, interval: float = 0.5) -> None:
        self.core = core
        self.keys = core.keys
        self.interval = interval
        self.verifier = Verifier(core)
        self._complain = Complaints("scheduler")
        #: task headers as last parsed, by key: (mod revision, record)
        self._parsed: dict[bytes, tuple[int, TaskRecord]] = {}
        #: when the keys of ``delayed/``, ``cdelayed/`` (by task) and ``cancels/`` are
        #: next due, as far as the elected replica knows (``follow``)
        self.delayed, self.nacked, self.cancels = Dues(), Dues(), Dues()
        #: the entries waiting on other tasks' entries (``follow``)
        self.cross: CrossWaits | None = None
        self._sweeps: list[tuple[Alarm, Callable[[bool], Awaitable[int]], str, float]] = []

    def follow(self, watch: SweepWatch) -> None:
        """Follow the indexes its sweeps read on the leader's watch (``sweeps``): keys
        put under ``delayed/``, ``cdelayed/`` and ``cancels/`` tell when they fall due,
        a ``wakes/`` or ``finishing/`` key put rings its sweep, and a task header
        written has that task's cross-task waits read again (``waits``)."""
        k = self.keys
        by_task: Callable[[list[str]], str] = lambda parts: parts[0]  # noqa: E731

        def due_index(base: bytes, dues: Dues) -> Alarm:
            alarm = watch.alarm(dues)
            watch.follow(Watched(base, deletes=False), told(dues, alarm, base, by_task))
            return alarm

        def rung(base: bytes) -> Alarm:
            alarm = watch.alarm()
            watch.follow(Watched(base, deletes=False), rings(alarm))
            return alarm

        cross = watch.alarm()
        self.cross = CrossWaits(self.core, cross, self._check, self._complain)
        watch.follow(Watched(k.tasks()), self.cross.headers_written)
        watch.when_ended(self.cross.close)
        self._sweeps = [
            (due_index(k.delayed_all(), self.delayed), self._promote_woken,
             "scheduler: backoffs over", self.interval),
            (due_index(k.cdelayed_all(), self.nacked), self._return_woken,
             "scheduler: nacks over", self.interval),
            (rung(k.wakes()), self._wakes_woken, "scheduler: wake keys", self.interval),
            (rung(k.finishing_all()), self._complete_woken, "scheduler: task completion",
             SLOW_SWEEP),
            (follow_due(watch, k.cancels(), self.cancels), self._cancels_woken,
             "scheduler: cancels", self.interval),
            (cross, self._cross_woken, "scheduler: cross-task waits", self.interval),
        ]

    async def run(self, stop: asyncio.Event, election: Election,
                  full_every: float = 0.0) -> None:
        """Run each sweep (``follow`` first) while ``election`` leads, when its index
        is written or its due time comes, until ``stop``. This replica's own
        verifications are followed up at once, leader or not (``Core.verified``)."""
        events = asyncio.create_task(self._on_verified(stop))
        try:
            await asyncio.gather(*(run_sweep(election, alarm, sweep, what, interval, stop,
                                             full_every)
                                   for alarm, sweep, what, interval in self._sweeps))
        finally:
            events.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await events

    async def _promote_woken(self, whole: bool) -> int:
        return await self._promote_index(
            self.keys.delayed_all(), "delayed entry",
            lambda task_id, rest, key: self._promote_plan(task_id, rest[0], key),
            self.delayed, None if whole else self.delayed.due(self.core.clock()))

    async def _return_woken(self, whole: bool) -> int:
        return await self._promote_index(
            self.keys.cdelayed_all(), "nacked entry",
            lambda task_id, rest, key: self._return_plan(task_id, rest[0], rest[1], key),
            self.nacked, None if whole else self.nacked.due(self.core.clock()))

    async def _wakes_woken(self, whole: bool) -> int:
        return await self.sweep_wakes()

    async def _complete_woken(self, whole: bool) -> int:
        return await self.complete_tasks()

    async def _cancels_woken(self, whole: bool) -> int:
        return await swept_due(self.core, self.keys.cancels(), self.cancels,
                               self.finish_cancels)

    async def _cross_woken(self, whole: bool) -> int:
        if whole:  # what older registries left first (they wrote no index keys for it)
            await self.learn()
        assert self.cross is not None
        return await self.cross.sweep(whole)

    async def _on_verified(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            task_id, file_id = await self.core.verified.get()
            try:
                kv = await self.core.etcd.get(self.keys.entry(task_id, file_id))
                if kv is None:
                    continue
                rec = EntryRecord.load(kv.value)
            except Exception as e:
                self._complain(f"entry {task_id}/{file_id}", e)
                continue
            for name in [*rec.dependents, *([rec.assembly] if rec.assembly else [])]:
                await self._check(task_id, name)

    async def _check(self, task_id: str, file_id: str) -> bool | None:
        """``check_waiting`` for one entry of a sweep: failures are logged, not raised
        (None)."""
        item = f"waiting entry {task_id}/{file_id}"
        try:
            moved = await self.check_waiting(task_id, file_id)
        except Exception as e:
            self._complain(item, e)
            return None
        self._complain.cleared(item)
        return moved

    def unless_cancelled(self, task_id: str, index: bytes,
                         plan: Callable[[Txn], Awaitable[bool]]
                         ) -> Callable[[Txn], Awaitable[bool]]:
        """``plan`` (a move of an entry of ``task_id`` that ``index``, an index key,
        brought a sweep to), unless the task is cancelled (or being deleted): its
        entries stay as they were (docs/cli.md, ``cancel``). Every move of this module
        goes through here.

        The task header is read in the move's own transaction and pinned whenever the
        plan writes, so a cancel applied meanwhile fails the move's compare and the
        move, planned again, meets the cancelled task: whichever etcd applies first
        decides, never a read made earlier. Meeting one, the index key (if still there)
        is deleted in that transaction, as the cancel deletes a task's index keys, and
        nothing else is written: no sweep comes back to it, nothing is logged."""
        task_key = self.keys.task(task_id)

        async def guarded(txn: Txn) -> bool:
            task, listed = await txn.peek_many([task_key, index])
            if voided(task):
                if listed is not None:
                    txn.pin(task_key, task)
                    txn.delete(index)
                return False
            moved = await plan(txn)
            if txn.writes:
                pinned, read = txn.read_state(task_key)
                if pinned and _revision(read) != _revision(task):
                    raise Retry()  # the plan read it again, changed: plan again
                txn.pin(task_key, task)
            return moved

        return guarded

    # retry backoff ---------------------------------------------------------

    async def promote_due(self) -> int:
        """Entries whose retry backoff is over become claimable."""
        return await self._promote_index(
            self.keys.delayed_all(), "delayed entry",
            lambda task_id, rest, key: self._promote_plan(task_id, rest[0], key))

    async def promote_nacked(self) -> int:
        """Entries a consumer group nacked with a delay that is over go back to that
        group's claimable index."""
        return await self._promote_index(
            self.keys.cdelayed_all(), "nacked entry",
            lambda task_id, rest, key: self._return_plan(task_id, rest[0], rest[1], key))

    async def _promote_index(
        self, base: bytes, what: str,
        plan_of: Callable[[str, list[str], bytes], Callable[[Txn], Awaitable[bool]]],
        dues: Dues | None = None, tasks: Sequence[str] | None = None,
    ) -> int:
        """Run ``plan_of``'s plan for each key of an index ``{task}/{due}/…`` under
        ``base`` whose due time (epoch ms) has come, each its own transaction, many at
        once; a task's keys past now are skipped whole (they sort by due time). Only
        the keys of ``tasks``, if given (else of every task). ``dues`` learns when each
        task looked at has its next key due (a task whose promotion failed: soon)."""
        now_ms = int(self.core.clock() * 1000)
        moved = 0
        gate = Gate(PROMOTE_PARALLEL)
        marks = dues.marks() if dues is not None else {}
        #: each task looked at: when its first key not due is (None: it has none)
        found: dict[str, float | None] = {}
        failed: set[str] = set()

        async def promote(task_id: str, item: str,
                          plan: Callable[[Txn], Awaitable[bool]]) -> None:
            nonlocal moved
            try:
                # Fresh: the plan peeks at the entry and may do nothing (see run()).
                moved += await write(self.core.txns, plan, fresh=True)
            except Exception as e:
                self._complain(item, e)
                failed.add(task_id)
            else:
                self._complain.cleared(item)

        async def walk(prefix: bytes, start: bytes | None) -> bytes | None:
            """Promote the due keys under ``prefix`` from ``start``; where to go on
            from (the next task's keys), or None once at its end."""
            pages = self.core.etcd.scan(prefix, page=SCAN_PAGE, keys_only=True, start=start)
            async with contextlib.aclosing(pages):
                async for key in pages:
                    try:
                        task_id, due, *rest = self.keys.parse_tail(key.key, base)
                        found.setdefault(task_id, None)
                        if int(due) > now_ms:
                            # A task's keys sort by due time: the rest of this
                            # task's are not due either; go on with the next task.
                            found[task_id] = int(due) / 1000
                            return prefix_end(self.keys.below(base, task_id))
                        plan = self.unless_cancelled(task_id, key.key,
                                                     plan_of(task_id, rest, key.key))
                    except (ValueError, IndexError) as e:
                        self._complain(f"{what} key {key.key!r}", e)
                        continue
                    await gate.submit(promote(task_id, f"{what} {task_id}/{rest[-1]}", plan))
            return None

        if tasks is None:
            start: bytes | None = None
            while (start := await walk(base, start)) is not None:
                pass
        else:
            for task_id in tasks:
                found.setdefault(task_id, None)
                await walk(self.keys.below(base, task_id), None)
        await gate.drain()
        if dues is not None:
            retry = self.core.clock() + self.interval
            for task_id in {*found, *(dues.scopes() if tasks is None else ())}:
                due = found.get(task_id)
                if task_id in failed:  # looked at again soon, as the sweeps did each period
                    due = min(due if due is not None else retry, retry)
                dues.learnt(task_id, due, marks)
        return moved

    def _return_plan(self, task_id: str, group: str, file_id: str,
                     index: bytes) -> Callable[[Txn], Awaitable[bool]]:
        """Hand a nacked entry back to ``group`` once its delay is over: its delayed key
        goes, its claimable key comes, and the entry is written (so that consumers
        waiting on the task's watch wake). A key whose entry moved on is deleted alone."""
        async def plan(txn: Txn) -> bool:
            key = self.keys.entry(task_id, file_id)
            kv, listed = await txn.peek_many([key, index])
            if listed is None:
                return False  # gone meanwhile (handed back, or its task cancelled)
            txn.require(present(index))  # a cancel deletes it: nothing comes back then
            txn.delete(index)
            if kv is None:
                return True
            rec = EntryRecord.load(kv.value)
            until = rec.nacked_until.get(group)
            if (rec.state != VERIFIED or until is None
                    or self.keys.cdelayed(task_id, int(until * 1000), group, file_id) != index):
                return True  # left over: the entry moved on (its keys went with it)
            txn.pin(key, kv)
            del rec.nacked_until[group]
            txn.put(self.keys.cready(task_id, group, file_id), b"")
            rec.remember("returned", group=group, reason="the nack's delay is over")
            self.core.put_entry(rec, txn)
            return True

        return plan

    def _promote_plan(self, task_id: str, file_id: str,
                      index: bytes) -> Callable[[Txn], Awaitable[bool]]:
        async def plan(txn: Txn) -> bool:
            key = self.keys.entry(task_id, file_id)
            kv, listed = await txn.peek_many([key, index])
            if kv is None or listed is None:
                return False  # gone (a cancel deletes the index key alone): nothing to do
            rec = EntryRecord.load(kv.value)
            if rec.index != index.decode() or rec.not_before > self.core.clock():
                return False  # moved on already (nothing pinned: no commit at all)
            txn.pin(key, kv)
            # The index key is written with the entry, but a cancel deletes a
            # task's index keys alone: never bring one back for a cancelled task.
            txn.require(present(index))
            self.core.put_entry(rec, txn)
            return True

        return plan

    # dependencies and assemblies ---------------------------------------------

    async def sweep_waiting(self) -> int:
        """The entries waiting for an entry verified since the last look (its wake key),
        and every waiting entry of a task whose entries wait for other tasks', checked."""
        moved = await self.sweep_wakes()
        for header in await self._headers():
            if header.cross_deps is not False and header.status in WAITING_STATUSES:
                moved += await self._sweep_waiting_of(header.task_id)
        return moved

    async def sweep_wakes(self) -> int:
        """The entries waiting for an entry verified since the last look (its wake key),
        checked; the wake keys handled deleted."""
        moved = 0
        done: list[KV] = []
        async for kv in self._listing(self.keys.wakes()):
            item = f"wake key {kv.key.decode(errors='replace')}"
            try:
                task_id, file_id = self.keys.parse_tail(kv.key, self.keys.wakes())
                entry = await self.core.etcd.get(self.keys.entry(task_id, file_id))
                rec = EntryRecord.load(entry.value) if entry is not None else None
            except Exception as e:  # kept: looked at again next time
                self._complain(item, e)
                continue
            self._complain.cleared(item)
            failed = False
            for name in [*rec.dependents, *([rec.assembly] if rec.assembly else [])] if (
                    rec is not None) else []:
                checked = await self._check(task_id, name)
                failed = failed or checked is None
                moved += bool(checked)
            if not failed:  # else kept: looked at again next time
                done.append(kv)
        await self._forget(done)
        return moved

    async def _sweep_waiting_of(self, task_id: str) -> int:
        """Every waiting entry of one task, checked."""
        base = self.keys.waiting(task_id, "")
        moved = 0
        pages = self.core.etcd.scan(base, page=SCAN_PAGE, keys_only=True)
        async with contextlib.aclosing(pages):
            async for key in pages:
                moved += bool(await self._check(task_id, self.keys.last_segment(key.key)))
        return moved

    async def _headers(self) -> list[TaskRecord]:
        """Every task header: from the view (no etcd request) once it is loaded, each
        parsed once per revision."""
        view = self.core.view
        if view is not None and view.ready:
            kvs = await view.scan(self.keys.tasks(), 0, False)
        else:
            kvs = [kv async for kv in self.core.etcd.scan(self.keys.tasks(), page=SCAN_PAGE)]
        parsed: dict[bytes, tuple[int, TaskRecord]] = {}
        for kv in kvs:
            known = self._parsed.get(kv.key)
            if known is None or known[0] != kv.mod_revision:
                try:
                    known = (kv.mod_revision, TaskRecord.load(kv.value))
                except Exception as e:
                    self._complain(f"task header {kv.key.decode(errors='replace')}", e)
                    continue
            parsed[kv.key] = known
        self._parsed = parsed
        return [task for _, task in parsed.values()]

    async def _listing(self, base: bytes, end: bytes = b"") -> AsyncGenerator[KV, None]:
        """The keys of an index of due work (each names something to do; the sweep
        deletes those it did), a page per request: at rest, one request of no key.
        Bounded by how much work is due, never by what is stored."""
        pages = self.core.etcd.scan(base, page=SCAN_PAGE, keys_only=True, end=end)
        async with contextlib.aclosing(pages):
            async for kv in pages:
                yield kv

    async def _forget(self, listed: Sequence[KV]) -> None:
        """Delete index keys a sweep has handled, each only if not written again since
        it was listed (then it is handled again next time)."""
        for i in range(0, len(listed), FORGET_CHUNK):
            await self.core.etcd.txn_group([
                Guarded([unchanged(kv)], [Delete(kv.key)]) for kv in listed[i:i + FORGET_CHUNK]])

    async def check_waiting(self, task_id: str, file_id: str) -> bool:
        """Release an entry waiting for dependencies, or verify an assembly, if due."""

        async def plan(txn: Txn) -> bool:
            key = self.keys.entry(task_id, file_id)
            (kv,) = await txn.peek_many([key])
            if kv is None:
                return False
            rec = EntryRecord.load(kv.value)
            if rec.state != PENDING or rec.deps_ok:
                return False
            names = rec.parts or rec.depends_on
            ok = (VERIFIED,) if rec.parts else (VERIFIED, CONSUMED)
            if len(names) <= PIN_MAX:
                others = await self._read_pinned(txn, task_id, names, ok)
            else:
                others = await self._read_unpinned(task_id, names, ok)
            if others is None:
                return False  # not due (nothing pinned: no commit at all)
            txn.pin(key, kv)
            rec.deps_ok = True
            if rec.parts:
                apply(rec, Event.ASSEMBLE)
                rec.size = sum(o.size for o in others)
                rec.digest = assembly_digest([o.digest for o in others])
                routed = await self.verifier.route(txn, rec)
                rec.remember("verified", digest=rec.digest, reason="every part verified",
                             **routed)
                self.verifier.open_to_consumers(rec, txn)
                # Its own dependents (and task completion) hear of it like any verification.
                self.verifier.notify(rec, txn)
            else:
                rec.remember("released", reason="dependencies verified")
            self.core.put_entry(rec, txn)
            return True

        # Fresh: the plan peeks at the entry and its dependencies and may do nothing.
        return await write(self.core.txns, self.unless_cancelled(
            task_id, self.keys.waiting(task_id, file_id), plan), fresh=True)

    async def _read_pinned(self, txn: Txn, task_id: str, names: Sequence[str],
                           ok: tuple[str, ...]) -> list[EntryRecord] | None:
        """A few dependencies (parts), each pinned if the release goes ahead: the
        release then applies only if every one is still as read."""
        keys = [self.keys.dependency(task_id, n) for n in names]
        found = await txn.peek_many(keys)
        others = _all_in(await self._records(names, found), ok)
        if others is not None:
            for k, kv in zip(keys, found, strict=True):
                txn.pin(k, kv)
        return others

    async def _records(self, names: Sequence[str], found: Sequence[KV | None]
                       ) -> list[EntryRecord | None]:
        """The entries read; one of another task that is archived (its key gone, never
        to come back) from that task's archive."""
        return [EntryRecord.load(kv.value) if kv is not None
                else await self.core.archived_entry(name)
                for name, kv in zip(names, found, strict=True)]

    async def _read_unpinned(self, task_id: str, names: Sequence[str],
                             ok: tuple[str, ...]) -> list[EntryRecord] | None:
        """Many dependencies (parts): more than one transaction may compare (etcd
        allows 128 compares along a transaction's path), so they are read, not pinned.

        They are read straight from etcd, a chunk per request (``Etcd.get_chunks``), after the
        waiting entry itself was read (its pin is the release's guard), and must
        be as of one instant: a key changed after the first request's revision
        means the chunks may disagree, and the plan starts over (``Retry``).
        The view is not used: its keys may be behind by different amounts.

        Why the release stays right without pins:

        * An assembly: a part that leaves ``verified`` re-puts its assembly in the
          same transaction (``Verifier._unverify_assembly``), so the assembly's
          mod revision (pinned) moves, and a release planned on parts as they
          were fails its compare and is planned again. Every part was read after
          the assembly, so each was verified from its read until the commit.
        * Dependencies: a released dependent is never blocked again when a
          dependency later leaves ``verified`` (``deps_ok`` only goes from False
          to True for a dependent). The dependencies were all verified or
          consumed at one instant (the first read's revision), while the
          dependent waited (it waits from creation until its release, and its
          pin says it still does): a release then is what a release at that
          instant would have been, and a dependency leaving ``verified`` since
          is, to everyone, a departure after the release.
        """
        keys = [self.keys.dependency(task_id, n) for n in names]
        name_of = dict(zip(keys, names, strict=True))
        others: list[EntryRecord] = []
        first = latest = 0
        chunks = self.core.etcd.get_chunks(keys)
        async with contextlib.aclosing(chunks):
            async for revision, found in chunks:
                first = first or revision
                chunk = [kv for _, kv in found]
                recs = _all_in(await self._records([name_of[k] for k, _ in found], chunk), ok)
                if recs is None:
                    return None  # one not due is enough: read no further
                others += recs
                latest = max([latest, *(kv.mod_revision for kv in chunk if kv is not None)])
        if latest > first:
            raise Retry()  # changed while we read: not one instant; read again
        return others

    # task completion ---------------------------------------------------------

    async def complete_tasks(self) -> int:
        """Each task in which an entry finished since the last look (its finishing keys)
        is completed if none of its entries is open any more."""
        base = self.keys.finishing_all()
        by_task: dict[str, list[KV]] = {}
        async for kv in self._listing(base):
            by_task.setdefault(self.keys.parse_tail(kv.key, base)[0], []).append(kv)
        completed = 0
        for task_id, listed in by_task.items():
            item = f"task {task_id}"
            try:
                # Looked at after the keys were listed: each entry finished before.
                completed += await write(self.core.txns, self._complete_plan(task_id))
            except Exception as e:  # its keys stay: looked at again next time
                self._complain(item, e)
                continue
            self._complain.cleared(item)
            await self._forget(listed)
        return completed

    async def finish_cancels(self) -> int:
        """Cancels whose replica may have stopped part-way (their keys, from 30 s after
        the cancel; the cancel deletes its key once done) are finished: what is left of
        their claims, twins and claimable keys revoked; how many had some left."""
        base = self.keys.cancels()
        now_ms = int(self.core.clock() * 1000)
        finished = 0
        done: list[KV] = []
        async for kv in self._listing(base, end=self.keys.due_until(base, now_ms)):
            item = f"cancel key {kv.key.decode(errors='replace')}"
            try:
                task_id = self.keys.last_segment(kv.key)
                finished += await self._finish_cancel(task_id)
            except Exception as e:
                self._complain(item, e)
                continue
            self._complain.cleared(item)
            done.append(kv)
        await self._forget(done)
        return finished

    async def _finish_cancel(self, task_id: str) -> bool:
        """``Operators.finish_cancel`` for a task still cancelled."""
        kv = await self.core.etcd.get(self.keys.task(task_id))
        if kv is None or TaskRecord.load(kv.value).status != "cancelled":
            return False
        return await Operators(self.core).finish_cancel(task_id)

    async def learn(self) -> int:
        """Once, when this replica becomes the leader: the tasks whose header an older
        registry wrote (``cross_deps`` unknown) have no wake, finishing or cancel keys
        for what happened before. Each is looked at whole once: its waiting entries
        checked (and whether any waits for another task's entry written to its header),
        its completion, or, cancelled, the rest of its cancel. How many tasks."""
        learnt = 0
        for header in await self._headers():
            if header.cross_deps is not None:
                continue
            item = f"task {header.task_id} (written by an older registry)"
            try:
                await self._learn(header.task_id)
            except Exception as e:
                self._complain(item, e)
                continue
            self._complain.cleared(item)
            learnt += 1
        return learnt

    async def _learn(self, task_id: str) -> None:
        base = self.keys.waiting(task_id, "")
        cross = False
        pages = self.core.etcd.scan(base, page=SCAN_PAGE, keys_only=True)
        async with contextlib.aclosing(pages):
            async for key in pages:
                file_id = self.keys.last_segment(key.key)
                kv = await self.core.etcd.get(self.keys.entry(task_id, file_id))
                if kv is not None:
                    cross = cross or any(":" in d for d in EntryRecord.load(kv.value).depends_on)
                await self._check(task_id, file_id)
        await self._finish_cancel(task_id)
        await write(self.core.txns, self._complete_plan(task_id))

        async def plan(txn: Txn) -> None:
            kv = await txn.get(self.keys.task(task_id))
            if kv is None:
                return
            task = TaskRecord.load(kv.value)
            if task.cross_deps is None and task.status in WAITING_STATUSES:
                task.cross_deps = cross
                txn.put(kv.key, task.dump())

        await write(self.core.txns, plan)

    def _complete_plan(self, task_id: str) -> Callable[[Txn], Awaitable[bool]]:
        async def plan(txn: Txn) -> bool:
            key = self.keys.task(task_id)
            (kv,) = await txn.peek_many([key])
            if kv is None:
                return False
            task = need_task(kv, task_id)
            if not lifecycle.allowed(task.status, TaskEvent.COMPLETE):
                return False
            if await txn.scan(self.keys.open_all(task_id), limit=1, keys_only=True):
                return False  # work left (nothing pinned: no commit at all)
            txn.pin(key, kv)
            # And still none when it commits: an entry opened again in between (a
            # requeue, a verified file that changed) fails this completion.
            txn.require(empty(self.keys.open_all(task_id)))
            dead = await self.core.etcd.count(self.keys.dead_all(task_id))
            lifecycle.apply(task, TaskEvent.COMPLETE)
            task.finished_at = now()
            task.status_reason = (f"{task.entry_count - dead} consumed, {dead} dead"
                                  if dead else "every entry consumed")
            txn.put(key, task.dump())
            txn.after(lambda: log.info("task %s completed (%s)", task_id, task.status_reason))
            return True

        return plan


def _all_in(found: Sequence[EntryRecord | None], ok: tuple[str, ...]
            ) -> list[EntryRecord] | None:
    """The entries read, if every one exists and is in an ``ok`` state; else None."""
    out = []
    for rec in found:
        if rec is None or rec.state not in ok:
            return None
        out.append(rec)
    return out


def _revision(kv: KV | None) -> int:
    return kv.mod_revision if kv is not None else 0
