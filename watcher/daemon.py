"""The watcher daemon: wires emitters, the dispatcher, hash workers and the registry.

Threads, and what flows between them::

    emitters (inotify / polling) ──FsEvent──▶ Intake ──▶ dispatcher ──key──▶ JobQueue
    registry streams (every task's, one thread) ──news──▶ news threads ─────────▶ │
    reconciler: full (start, overflow, lost registry) ──every entry────────────────▶ │
                routine (every N s) ──what may have changed────────────────────▶ │
                                                                hash workers ◀──┘
                                                       (hash, then client.watcher.report)

Nothing but the workers reads file contents or reports, so intake never waits
for a hash, and the number of files hashed at once is bounded.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import socket
import threading
import time
from collections import Counter
from typing import Any

from ..client import Client, RetryPolicy
from ..kernel.backoff import Backoff
from ..kernel.contract import shard_of
from ..kernel.errors import BatonError, NotFound
from ..kernel.logs import log
from ..kernel.v1 import baton_pb2 as pb
from .cache import IdentityCache, open_cache
from .checker import Checker
from .config import WatcherConfig
from .errors import HashFailed, WatchFailed
from .events import FsEvent, Intake, Kind
from .hashing import Hasher
from .jobs import JobQueue
from .metrics import Levels, Metrics
from .observe import Watches
from .reporter import Reporter
from .retention import Retention
from .shards import Membership
from .state import CHECKED, Change, EntryView, Table, TaskView
from .sync import TaskStreams
from .taskdirs import TaskDirs

logger = logging.getLogger("baton.watcher")

_TASK_ID = re.compile(r"^[A-Za-z0-9._-]+$")
#: task statuses a watcher does not serve: finished, or on the way out of etcd
FINISHED = (pb.TASK_STATUS_CANCELLED, pb.TASK_STATUS_COMPLETED, pb.TASK_STATUS_ARCHIVING,
            pb.TASK_STATUS_ARCHIVED, pb.TASK_STATUS_DELETING)
#: finished tasks whose consumed files the staging retention still removes, and tasks
#: gone whose directory goes once empty
DONE = (pb.TASK_STATUS_CANCELLED, pb.TASK_STATUS_COMPLETED)
GONE = (pb.TASK_STATUS_ARCHIVED, pb.TASK_STATUS_DELETING)
#: a directory whose times are this close to when it was looked at is looked at
#: again at the next pass (a change within the same clock tick leaves them as they were)
RACY_SECONDS = 2.0
#: seconds before a reconciliation that could not reach the registry is tried again
#: (the bound after one failure; it grows to the cap while they go on failing)
RECONCILE_RETRY, RECONCILE_RETRY_CAP = 1.0, 8.0
RECONCILE_BACKOFF = Backoff(RECONCILE_RETRY, RECONCILE_RETRY_CAP, floor=0.5)
#: seconds a shard's handover waits for the checks in hand before releasing anyway
HANDOVER_WAIT = 20.0
#: share of the inotify watch limit above which cold tasks are shed, and down to which
WATCHES_HIGH, WATCHES_LOW = 0.9, 0.8
MAX_USER_WATCHES = "/proc/sys/fs/inotify/max_user_watches"


class Watcher:
    """One watcher over one staging root. :meth:`start`, then :meth:`stop`."""

    def __init__(self, config: WatcherConfig, *, hasher: Hasher | None = None,
                 cache: IdentityCache | None = None, retry: RetryPolicy | None = None) -> None:
        self.config = config
        os.makedirs(config.staging, exist_ok=True)
        self.root = os.path.realpath(config.staging)
        self.reporter = config.reporter or f"watcher@{socket.gethostname()}"
        self.metrics = Metrics()
        self.metrics.levels(self._levels)
        #: where ``/metrics`` is served once started (0: ``--metrics`` is off)
        self.metrics_port = 0
        self.intake = Intake(config.event_queue)
        self.jobs = JobQueue()
        self.table = Table(self.root, on_consumed=self._consumed)
        self.taskdirs = TaskDirs(self.root)
        # Explicit even when empty: the configuration has read BATON_CA/CERT/KEY
        # already, and "" for all three is plaintext, not "look in os.environ".
        self.client = Client(config.registry, retry=retry, ca=config.ca, cert=config.cert,
                             key=config.key)
        self.cache = cache if cache is not None else open_cache(config.state_file)
        self.hasher = hasher or Hasher(self.root, config.large_file)
        self.watches = Watches(self.root, config.observer, self.intake.put_all,
                               config.poll_interval)
        self._stop = threading.Event()
        #: wakes the reconciler: a pass is wanted now (or the watcher stops)
        self._reconcile_now = threading.Event()
        #: the next pass is a full one (something may have been missed)
        self._full_due = threading.Event()
        #: (task id, directory relative to it) of the file events since the last pass
        self._event_dirs: set[tuple[str, str]] = set()
        self._event_dirs_lock = threading.Lock()
        #: per unwatched task, its directories' times as the last routine pass saw them
        self._dir_marks: dict[str, dict[str, tuple[int, int, int] | None]] = {}
        self.membership = Membership(
            self.client, self.root, self.reporter, config.shard_ttl, capacity=self.capacity,
            gained=self._shards_gained, lost=self._shards_lost, handover=self._handover,
            remember=self.cache.set_registration, previous=self.cache.registration())
        self.reports = Reporter(self.client)
        self.checker = Checker(
            self.table, self.cache, self.hasher, self.client, self.jobs, self.metrics,
            self.reporter, config.max_failures, config.retry_delay, self._registry_lost,
            membership=self.membership, batches=self.reports,
            look_again=lambda key: self._check_now([key]),
        )
        self.retention = Retention(
            self.client, self.hasher, self.membership, self.metrics, self.reporter,
            self.root, config.removal_rate, on_reply=self._removal_reply)
        self._shedding = False
        self.streams = TaskStreams(
            self.client, self.table, on_changes=self._on_changes,
            on_lost=self._registry_lost, on_gone=self._gone, stop=self._stop,
            timeout=config.stream_timeout, silence=config.stream_silence,
            count=self.metrics.add,
        )
        self._threads = [
            threading.Thread(target=self._dispatch, name="watcher-dispatch", daemon=True),
            threading.Thread(target=self._reconcile_loop, name="watcher-reconcile",
                             daemon=True),
            threading.Thread(target=self._poll_links, name="watcher-links", daemon=True),
            *(threading.Thread(target=self._work, name=f"watcher-hash-{i}", daemon=True)
              for i in range(config.hash_workers)),
        ]
        self._stopped = False

    # lifecycle ---------------------------------------------------------------------

    def start(self) -> Watcher:
        """Watch the root, start the threads, reconcile once; returns self. A
        ``--metrics`` address that cannot be served raises ``InvalidArgument`` before
        anything else starts."""
        if self.config.metrics:
            self.metrics_port = self.metrics.serve(self.config.metrics, logger)
        self.watches.start()
        for t in self._threads:
            t.start()
        self.reports.start()
        self.membership.start()
        self.retention.start()
        if not self.reconcile("start"):
            self._request_full()
        # Serve new tasks the moment they are created, and drop finished ones, from the
        # registry's stream of task headers (no waiting for a reconciliation).
        self.streams.follow_headers(self._serve, RECONCILE_RETRY)
        log(logger, logging.INFO, "watching", root=self.root, registry=self.config.registry,
            observer=self.watches.root_backend, workers=self.config.hash_workers,
            reporter=self.reporter)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking events; let each worker finish (and report) the file in hand."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        self.membership.stop()
        self.watches.stop()
        self.intake.close()
        self.jobs.close()
        self._reconcile_now.set()
        # Threads not started: the start failed (a bad --metrics), nothing ran to stop.
        started = [t for t in self._threads if t.ident is not None]
        for t in started:
            t.join(timeout)
        # and the checks the streams' news threads make themselves (``_check_now``) done
        self.jobs.settle(lambda key: True, timeout)
        self.reports.close(timeout)  # what the workers reported, sent
        self.retention.stop(timeout)
        self.client.close()  # ends the registry's streams
        self.streams.join(timeout)
        self.hasher.close()
        self.cache.close()
        self.metrics.close()
        if started:
            log(logger, logging.INFO, "stopped", **self.metrics.snapshot())

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _levels(self) -> Levels:
        """What the metrics ask for when scraped."""
        entries, written_ns = self.table.census()
        oldest = max(0.0, (time.time_ns() - written_ns) / 1e9) if written_ns else 0.0
        return Levels(queued_checks=len(self.jobs), queued_events=len(self.intake),
                      inotify_watches=self.watches.watch_count(),
                      tasks=len(self.table.task_ids()), entries=entries,
                      oldest_written=oldest, staging_held=self.retention.held())

    def capacity(self) -> pb.WatcherCapacity:
        """What this watcher tells the registry at each heartbeat."""
        backlog: dict[int, int] = {}
        count = self.membership.count
        pending = self.jobs.pending()
        if count:
            for task_id, _ in pending:
                n = shard_of(task_id, count)
                backlog[n] = backlog.get(n, 0) + 1
        return pb.WatcherCapacity(
            watches_used=self.watches.watch_count(), watches_max=_max_user_watches(),
            hash_mbps=self.metrics.hash_rate(), backlog=len(pending),
            tasks=len(self.table.task_ids()), cold_tasks=self.table.cold_count(),
            shard_backlog=backlog)

    # shards ---------------------------------------------------------------------------

    def _shards_gained(self, shards: set[int]) -> None:
        # The reconciliation serves the shards' tasks, from what the registry says now.
        self._request_full()

    def _shards_lost(self, shards: set[int]) -> None:
        for task_id in self.table.task_ids():
            if self.membership.shard(task_id) in shards:
                self._forget(task_id)
        self.retention.shards_lost()

    def _handover(self, shard: int) -> None:
        """Returns once no check of the shard's tasks is in hand (or after a while)."""
        start = time.monotonic()
        if not self.jobs.settle(lambda key: self.membership.shard(key[0]) == shard,
                                HANDOVER_WAIT):
            log(logger, logging.WARNING, "handing a shard over with a check still running",
                shard=shard)
        # and the reports those checks handed over, answered
        if not self.reports.settle(max(0.0, HANDOVER_WAIT - (time.monotonic() - start))):
            log(logger, logging.WARNING, "handing a shard over with reports unanswered",
                shard=shard)

    def _serves(self, task_id: str) -> bool:
        return self.membership.serves(task_id)

    def _registry_lost(self) -> None:
        self._request_full()  # it retries until the registry answers again

    def _request_full(self) -> None:
        """A full reconciliation, as soon as may be: something may have been missed."""
        self._full_due.set()
        self._reconcile_now.set()

    # the registry's side -----------------------------------------------------------------

    def _on_changes(self, task_id: str, changes: list[Change], synced: bool) -> None:
        if not self._serves(task_id):
            return  # its shard left while the stream was open; the stream ends with it
        warmed = bool(changes) and self.table.touch(task_id)
        # read before the tree may become watched below: that rescans everything
        watched = self.table.needs_watch(task_id)[1]
        if synced:  # a snapshot: many files, some of them large; the workers'
            for c in changes:
                if c.entry.state in CHECKED:  # (a pending entry's check does nothing)
                    self.jobs.submit((task_id, c.entry.file_id))
        else:
            self._check_now([(task_id, c.entry.file_id) for c in changes
                             if self.checker.wants(c, watched=watched)])
        self._sync_watch(task_id, rescan=synced or warmed)

    def _consumed(self, task_id: str, entries: list[EntryView]) -> None:
        """Entries news made consumed, from a stream or a reply (``Table.on_consumed``):
        their files are the staging retention's. A reply to a report that finds the
        entry consumed can bring that news before the task's stream does, which then
        brings nothing new: hearing it only from the stream would lose the file."""
        if self._serves(task_id):
            self.retention.offer(task_id, entries)

    def _sync_watch(self, task_id: str, *, rescan: bool = False, rewalk: bool = False) -> None:
        """Watch a task's tree while it has live entries, and not after.

        Whenever a tree becomes watched (or ``rescan``), every live entry is
        checked: the watch is in place first, so nothing lands unseen in between.
        """
        view = self.table.task(task_id)
        if view is None:
            return
        need, watched = self.table.needs_watch(task_id)
        if need and (not watched or rewalk):
            try:
                backend = self.watches.watch_tree(view.directory)
            except WatchFailed as e:
                log(logger, logging.DEBUG, "task directory not watchable yet", task=task_id,
                    reason=str(e))
                self.table.set_watched(task_id, False)
                return
            if not watched:
                log(logger, logging.INFO, "watching task", task=task_id, backend=backend)
                self.table.set_watched(task_id, True)
                rescan = True
        elif not need and watched:
            self.watches.unwatch_tree(view.directory)
            self.table.set_watched(task_id, False)
            log(logger, logging.INFO, "task has no live entries; watches removed",
                task=task_id)
        if rescan:
            self._check_all(task_id)

    def _check_all(self, task_id: str, rel_dir: str = "") -> None:
        """Check every entry below ``rel_dir`` ("": the whole task), a tree now
        watched: what landed before the watch raised no event. An attempt's file found
        beside an entry not yet committed is remembered (one listing per directory),
        so news of its claim, which this watcher's events would otherwise answer, finds
        it known."""
        dirs, checked = self.table.survey(task_id, rel_dir)
        for rel in dirs:
            self.table.saw_attempts(task_id, self.hasher.attempts(task_id, rel))
        for file_id in checked:
            self.jobs.submit((task_id, file_id))

    def _forget(self, task_id: str, view: TaskView | None = None) -> None:
        """Stop serving ``task_id``; with ``view``, only if that is still how it is
        served (news about a task that was deleted and created again under the same id
        must not stop the new one being served)."""
        removed = self.table.remove_task(task_id, view)
        if view is not None and removed is None:
            return
        self.taskdirs.forget(task_id)
        if removed is not None:
            self.streams.drop(removed)
            self.watches.unwatch_tree(removed.directory)
            self.cache.drop_task(task_id)
            log(logger, logging.INFO, "no longer serving task", task=task_id)

    def _gone(self, view: TaskView) -> None:
        """The registry says ``view``'s task is not there: stop serving that view, then
        ask once more. A task created again under the id in the meantime is served: its
        header, if it came while the old view was still served, started nothing."""
        self._forget(view.task_id, view)
        try:
            task = self.client.operator.get_task(view.task_id)
        except NotFound:
            if self._serves(view.task_id):
                self.retention.task_gone(view.task_id)
            return
        except BatonError as e:
            log(logger, logging.WARNING, "task gone; cannot tell whether it is back",
                task=view.task_id, error=str(e))
            self._request_full()
            return
        self._serve(task)

    def _serve(self, task: pb.Task) -> None:
        """Follow ``task`` from its header: serve it if it is this watcher's to serve
        (its files are checked by its stream's snapshot), forget it once finished."""
        task_id = task.spec.task_id
        if task.status in FINISHED:
            self._forget(task_id)
            self._retain(task)
        elif task.status != pb.TASK_STATUS_CREATING and self._serves(task_id):
            self.taskdirs.prepare(task)
            self.streams.follow(task_id)

    def reconcile(self, reason: str, *, full: bool = True) -> bool:
        """Compare the registry with the disk; False if the registry could not be
        reached. A full pass lists every task and every served task's entries, checks
        each entry's file and walks each watched tree again; a routine one
        (``full=False``) looks only at what may have changed (:meth:`_routine`)."""
        counts: Counter[str] = Counter()
        try:
            done = self._full(reason, counts) if full else self._routine(reason, counts)
            if done:
                counts["reconciliations"] += 1
                counts["full_reconciliations"] += full
            return done
        finally:
            self.metrics.add_all(counts)

    def _full(self, reason: str, counts: Counter[str]) -> bool:
        # What was served before the listing was asked for: only those views may be
        # dropped on its word. A task created (or created again) meanwhile is newer
        # than the listing, which may still show it finished, or not at all.
        before = self.table.views()
        dirs = self._take_event_dirs()  # this pass looks at every file
        try:
            tasks = self.client.operator.list_tasks()
            counts["reconcile_listings"] += 1
        except BatonError as e:
            log(logger, logging.WARNING, "reconciliation: registry unreachable",
                reason=reason, error=str(e))
            self._put_back_event_dirs(dirs)
            return False
        served = set()
        for t in tasks:
            task_id = t.spec.task_id
            if t.status in FINISHED or not self._serves(task_id):
                if task_id in before:
                    self._forget(task_id, before[task_id])
                self._retain(t)
            else:
                served.add(task_id)
                self.taskdirs.prepare(t, again=True)
                self.streams.follow(task_id)
        for task_id in before.keys() - served:
            self._forget(task_id, before[task_id])
        self._sweep_dirs({t.spec.task_id for t in tasks})
        for task_id in served:
            if not self._list_task(task_id, counts, rewalk=True):
                self._put_back_event_dirs(dirs)
                return False
        log(logger, logging.INFO, "reconciled", reason=reason, full=True, tasks=len(served),
            entries_checked=counts["reconcile_entries_checked"])
        return True

    def _list_task(self, task_id: str, counts: Counter[str], *, rewalk: bool) -> bool:
        """List one served task's entries and check each file against them; False if
        the registry could not be reached."""
        try:
            entries = self.client.operator.list_entries(task_id)
        except BatonError as e:
            log(logger, logging.WARNING, "reconciliation: cannot list entries",
                task=task_id, error=str(e))
            return False
        counts["reconcile_listings"] += 1
        counts["reconcile_entries_listed"] += len(entries)
        for entry in entries:
            # quiet: every entry listed is offered to the retention below, news or not
            self.table.apply(task_id, entry, quiet=True)
            if entry.state in CHECKED and not entry.parts:
                self.jobs.submit((task_id, entry.file_id))
                counts["reconcile_entries_checked"] += 1
        self.retention.offer(task_id, entries)
        if rewalk and self.table.needs_watch(task_id) == (True, True):
            counts["reconcile_trees_walked"] += 1
        self._sync_watch(task_id, rewalk=rewalk)
        return True

    def _routine(self, reason: str, counts: Counter[str]) -> bool:
        """What may have changed since the last pass, from this watcher's own records;
        nothing is listed from the registry for a task whose stream is current (it has
        had every change since its snapshot) and no tree is walked. Per served task:

        - stream not current (no snapshot yet, broken, a resume refused): listed and
          checked as in a full pass;
        - tree not watched (cold, or not watchable): no emitter sees it, so its
          directories are looked at instead — one ``stat`` each — and the entries of
          those changed since the last pass (a file created, renamed into place or
          removed there changes the directory) are checked, with the entries not seen
          verified; a tree that could not be watched is tried again (``_moved_dirs``);
        - else the entries not seen verified (writing, written: a check that found
          nothing yet, or whose report did not get through) and the entries directly
          in a directory that had events about files no entry was known by (an
          event naming an entry's file was that file's check).

        Task directories get their group and mode put back. What this misses (events
        lost without an overflow being reported) only a full pass finds."""
        dirs = self._take_event_dirs()
        self.taskdirs.again()
        by_task: dict[str, set[str]] = {}
        for task_id, rel_dir in dirs:
            by_task.setdefault(task_id, set()).add(rel_dir)
        tasks = 0
        for task_id, view in self.table.views().items():
            if not self._serves(task_id):
                continue
            tasks += 1
            if not view.current:
                if not self._list_task(task_id, counts, rewalk=False):
                    self._put_back_event_dirs(dirs)
                    return False
                continue
            if not view.watched and not view.cold:
                self._sync_watch(task_id)  # not watchable before: it may be now
            looked = by_task.get(task_id, set())
            if not view.watched:
                looked = looked | self._moved_dirs(view)
            else:
                self._dir_marks.pop(task_id, None)
            for file_id in self.table.to_check(task_id, dirs=looked):
                self.jobs.submit((task_id, file_id))
                counts["reconcile_entries_checked"] += 1
        for gone in self._dir_marks.keys() - self.table.views().keys():
            del self._dir_marks[gone]
        log(logger, logging.DEBUG, "reconciled", reason=reason, full=False, tasks=tasks,
            entries_listed=counts["reconcile_entries_listed"],
            entries_checked=counts["reconcile_entries_checked"])
        return True

    def _moved_dirs(self, view: TaskView) -> set[str]:
        """The directories of an unwatched task's entries whose ``stat`` changed since
        the last pass looked (all of them at the first look). A directory changes when
        a file is created, renamed into it or removed from it, which is how files land
        (the producer helper writes a temporary file and renames it into place); a file
        rewritten in place changes no directory, and is found by the next full pass (or
        refused by the consumer's digest check before then). A directory changed less
        than ``RACY_SECONDS`` before it was looked at is looked at again next time: a
        change in the same clock tick would leave its times as they were."""
        marks = self._dir_marks.get(view.task_id, {})
        seen: dict[str, tuple[int, int, int] | None] = {}
        moved: set[str] = set()
        racy = time.time_ns() - int(RACY_SECONDS * 1e9)
        for d in self.table.dirs_of(view.task_id):
            try:
                st = os.stat(os.path.join(view.directory, d))
            except OSError:
                mark = None  # not there (yet): its entries' checks say what that means
            else:
                mark = (st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            if d not in marks or marks[d] != mark or (mark and max(mark[:2]) > racy):
                moved.add(d)
            seen[d] = mark
        self._dir_marks[view.task_id] = seen
        return moved

    def _take_event_dirs(self) -> set[tuple[str, str]]:
        with self._event_dirs_lock:
            dirs, self._event_dirs = self._event_dirs, set()
        return dirs

    def _put_back_event_dirs(self, dirs: set[tuple[str, str]]) -> None:
        """A pass that could not finish: its directories are the next one's."""
        with self._event_dirs_lock:
            self._event_dirs |= dirs

    def _retain(self, task: pb.Task) -> None:
        """A task no longer served: the staging retention still removes the files of a
        finished one of its shards, and the directory of one archived or deleted."""
        task_id = task.spec.task_id
        if not self._serves(task_id):
            return
        if task.status in DONE:
            self.retention.finished(task_id)
        elif task.status in GONE:
            self.retention.task_gone(task_id)

    def _sweep_dirs(self, listed: set[str]) -> None:
        """Directories of tasks of this watcher's shards that the registry no longer
        lists (archived or deleted while nobody looked) go once empty."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            if name not in listed and _TASK_ID.match(name) and self._serves(name):
                self.retention.task_gone(name)

    def _removal_reply(self, task_id: str, entry: pb.Entry) -> None:
        # quiet: the retention has the entry in hand (told of its own answer, it would
        # look at the file it has just removed once more)
        self.table.apply(task_id, entry, quiet=True)

    def _reconcile_loop(self) -> None:
        """A routine pass every ``reconcile_interval``; a full one when asked for (an
        overflow, a lost registry, a shard gained, a pass that failed) and every
        ``full_reconcile_interval`` if set."""
        interval, every = self.config.reconcile_interval, self.config.full_reconcile_interval
        last_full = time.monotonic()
        failed = 0  # reconciliations in a row that could not reach the registry
        while not self._stop.is_set():
            requested = self._reconcile_now.wait(interval)
            if self._stop.is_set():
                return
            self._reconcile_now.clear()
            timed = every > 0 and time.monotonic() - last_full >= every
            full = self._full_due.is_set() or timed
            self._full_due.clear()  # asked for again during the pass: one more after it
            reason = "requested" if requested and full else "timer" if timed else "interval"
            if self.reconcile(reason, full=full):
                failed = 0
                if full:
                    last_full = time.monotonic()
            else:
                failed += 1
                self._stop.wait(RECONCILE_BACKOFF.delay(failed))
                self._request_full()

    def _poll_links(self) -> None:
        """Every ``poll_interval``, check the verified files with several names whose
        identity changed: inotify does not see writes through their other names."""
        links = self.checker.links
        while not self._stop.wait(self.config.poll_interval):
            self._cool()
            for key, seen in links.items():
                entry = self.table.entry(*key)
                if entry is None or entry.state != pb.ENTRY_STATE_VERIFIED:
                    links.drop(key)
                    continue
                try:
                    now = self.hasher.stat(key[0], entry.attempt_path)
                except HashFailed:
                    now = None
                if now != seen:
                    self.jobs.submit(key)

    def _cool(self) -> None:
        """Unwatch task directories with no change for ``cold_after`` (the periodic
        reconciliation checks their files); near the inotify watch limit, say so and
        shed the tasks idle longest until well below it."""
        cooled = self.table.cool(self.config.cold_after)
        most, used = _max_user_watches(), self.watches.watch_count()
        if most and used >= most * WATCHES_HIGH:
            if not self._shedding:
                log(logger, logging.WARNING, "near the inotify watch limit; shedding cold "
                    "tasks", used=used, max=most)
            self._shedding = True
            shed = 0
            while self.watches.watch_count() > most * WATCHES_LOW and (
                    more := self.table.cool(0.0, most=1)):
                self._sync_watch(more[0])
                shed += 1
            if shed:
                log(logger, logging.WARNING, "shed tasks to stay below the inotify watch "
                    "limit", tasks=shed, used=self.watches.watch_count(), max=most)
        else:
            self._shedding = False
        for task_id in cooled:
            self._sync_watch(task_id)
            log(logger, logging.INFO, "task directory cold; unwatched until it changes",
                task=task_id, idle_s=self.config.cold_after)

    # the filesystem's side -----------------------------------------------------------------

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            keys: dict[tuple[str, str], None] = {}  # in order, once each
            events = self.intake.take()
            self.metrics.add("events", len(events))
            for event in events:
                try:
                    if (key := self._handle(event)) is not None:
                        keys[key] = None
                except Exception:
                    logger.exception("handling %s failed", event)
            self._check_now(list(keys))

    def _check_now(self, keys: list[tuple[str, str]]) -> None:
        """Check these entries' files on this thread, small ones hashed here: no hand-off
        to a worker per file (a large file, or a directory to list, is still theirs;
        so is an entry a worker holds, checked again once it is done). Their reports
        leave together."""
        held = self.jobs.hold(keys) if keys else []
        while held:
            self.metrics.add("inline_checks", len(held))
            try:
                with self.reports.gathering():
                    for key in held:
                        try:
                            self.checker.check(key, inline=True)
                        except Exception:
                            logger.exception("checking %s/%s failed", *key)
            except BaseException:
                self.jobs.release(held)
                raise
            # News of an entry that came while it was checked here (another thread's
            # event or stream) is checked again here, not handed to a worker.
            held = self.jobs.release(held, keep_again=True)

    def _handle(self, event: FsEvent) -> tuple[str, str] | None:
        """Act on one event; the entry whose file to check, if it names one."""
        if event.kind is Kind.OVERFLOW:
            self.metrics.add("overflows")
            log(logger, logging.WARNING, "events were lost; reconciling everything")
            self._request_full()
            return None
        where = self.table.locate(event.path)
        if where is None:
            return None
        task_id, rel = where
        self.table.touch(task_id)
        if event.kind is Kind.WATCH_LIMIT:
            self.watches.fall_back(event.path)
            self._check_all(task_id)
        elif event.kind is Kind.DIR_CREATED:
            if rel:
                self._check_all(task_id, rel)  # the emitter watches it already
            elif self.table.task(task_id) is not None:
                self._sync_watch(task_id, rescan=True)
            elif _TASK_ID.match(task_id) and self._serves(task_id):
                self.streams.follow(task_id)  # a new task: its snapshot checks its files
        elif event.kind is Kind.DIR_GONE:
            if not rel and (view := self.table.task(task_id)) is not None:
                self.watches.unwatch_tree(view.directory)
                self.table.set_watched(task_id, False)
            self._check_all(task_id, rel)
        elif (key := self.table.file_at(event.path)) is not None:
            if event.kind is Kind.TOUCHED:
                entry = self.table.entry(*key)
                if entry is None or entry.state != pb.ENTRY_STATE_VERIFIED:
                    return None  # only a verified file's changes matter before its close
            return key
        elif rel:
            # A file no entry is known by (yet): the next routine reconciliation looks
            # at that directory's files again. An event naming an entry's file is
            # that file's check, made now; its directory's other files are not news.
            with self._event_dirs_lock:
                self._event_dirs.add((task_id, posixpath.dirname(rel)))
        return None

    def _work(self) -> None:
        while (key := self.jobs.get()) is not None:
            self.metrics.add("worker_checks")
            try:
                self.checker.check(key)
            except Exception:
                logger.exception("checking %s/%s failed", *key)
            finally:
                self.jobs.done(key)


def _max_user_watches() -> int:
    """The host's inotify watch limit per user (0: unknown, e.g. not Linux)."""
    try:
        with open(MAX_USER_WATCHES) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def start_watcher(config: WatcherConfig, **kw: Any) -> Watcher:
    """A started :class:`Watcher` (keyword arguments as for its constructor)."""
    return Watcher(config, **kw).start()
