"""Following the registry: one ``Watch`` stream per served task, resumed as it ends.

A stream starts with a snapshot of the task's entries (applied as a whole,
then handed on as a "synced" batch: the daemon checks every entry's file, a
per-task reconciliation), then streams every change. Streams end after
``timeout`` seconds and are resumed from the next revision, without a new
snapshot and without a reconciliation. While nothing of the task changes, the
registry sends progress events (the revision the stream has come to, at etcd's
watch progress interval): the resume revision keeps up with etcd's, so an idle
task's resume is not refused as compacted. A resume from a compacted revision (a
partition longer than etcd's history) is caught up by the registry: it sends every
entry written since, as changes; from an older registry, refused as compacted, it
takes a snapshot of that task alone. A broken stream
(registry gone) starts over with a snapshot, and the daemon is told, so it
reconciles once the registry is back. A task whose stream has had its snapshot and
lost nothing since is ``current``: a routine reconciliation does not list it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..client import Client
from ..kernel.backoff import Backoff
from ..kernel.errors import BatonError, Compacted, NotFound
from ..kernel.logs import log
from ..kernel.v1 import baton_pb2 as pb
from .state import Change, Table, TaskView

logger = logging.getLogger("baton.watcher")

#: (task_id, changes, synced): synced is True for a batch that is a full snapshot
OnChanges = Callable[[str, list[Change], bool], None]


class TaskStreams:
    def __init__(self, client: Client, table: Table, *, on_changes: OnChanges,
                 on_lost: Callable[[], None], on_gone: Callable[[TaskView], None],
                 stop: threading.Event, timeout: float, backoff: float = 0.5,
                 count: Callable[[str], None] = lambda name: None) -> None:
        self.client = client
        self.table = table
        self.on_changes = on_changes
        self.on_lost = on_lost
        self.on_gone = on_gone
        self.stop = stop
        self.timeout = timeout
        #: told "stream_snapshots" for each snapshot a stream takes, "stream_resumes"
        #: for each stream resumed from a revision (the daemon's metrics)
        self.count = count
        #: between tries of a broken task stream: up to ``backoff`` doubling, at most 5 s
        self.backoff = Backoff(backoff, max(backoff, 5.0))
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def follow(self, task_id: str) -> bool:
        """Serve ``task_id`` from now on; False if it is served already."""
        with self._lock:
            if self.stop.is_set():
                return False
            view, created = self.table.add_task(task_id)
            if not created:
                return False
            thread = threading.Thread(target=self._run, args=(view,), daemon=True,
                                      name=f"watcher-stream-{task_id}")
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        log(logger, logging.INFO, "serving task", task=task_id, directory=view.directory)
        thread.start()
        return True

    def join(self, timeout: float) -> None:
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)

    def _current(self, view: TaskView) -> bool:
        return (not self.stop.is_set() and not view.forgotten.is_set()
                and self.table.task(view.task_id) is view)

    def _run(self, view: TaskView) -> None:
        task_id = view.task_id
        revision, failures = 0, 0
        while self._current(view):
            snapshot: list[pb.Entry] = []
            self.count("stream_resumes" if revision else "stream_snapshots")
            try:
                for ev in self.client.watch(task_id, start_revision=revision,
                                            timeout=self.timeout, progress=True,
                                            catch_up=True):
                    if not self._current(view):
                        return
                    if ev.kind == pb.TaskEvent.KIND_SNAPSHOT:
                        snapshot.append(ev.entry)
                    elif ev.kind == pb.TaskEvent.KIND_SYNCED:
                        changes = self.table.replace(task_id, snapshot)
                        revision = ev.revision + 1
                        view.current = True  # every change from here on comes
                        self.on_changes(task_id, changes, True)
                    elif ev.kind == pb.TaskEvent.KIND_CHANGED:
                        revision = max(revision, ev.revision + 1)
                        change = self.table.apply(task_id, ev.entry)
                        if change is not None:
                            self.on_changes(task_id, [change], False)
                    elif ev.kind == pb.TaskEvent.KIND_PROGRESS and revision:
                        # nothing of the task changed up to there: resume after it
                        revision = max(revision, ev.revision + 1)
                failures = 0
            except NotFound:
                log(logger, logging.INFO, "task not in the registry", task=task_id)
                self.on_gone(view)  # this view only: the id may be served anew already
                return
            except Compacted as e:
                # The registry answered: only this task's place in etcd's history is
                # gone. Its snapshot (next round) checks its files; nothing else is.
                log(logger, logging.WARNING, "task stream resumed too late; taking a "
                    "snapshot of the task", task=task_id, error=str(e))
                revision, view.current = 0, False
            except BatonError as e:
                if not self._current(view):
                    return
                failures += 1
                log(logger, logging.WARNING, "task stream broken; starting over",
                    task=task_id, error=f"{type(e).__name__}: {e}", attempt=failures)
                revision, view.current = 0, False
                self.on_lost()
                self.stop.wait(self.backoff.delay(failures))
