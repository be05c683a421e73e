"""Following the registry: each served task's ``Watch`` stream and the stream of task
headers (``WatchTasks``), every one of them on one thread.

A task's stream starts with a snapshot of its entries (applied as a whole, then
handed on as a "synced" batch: the daemon checks every entry's file, a per-task
reconciliation), then streams every change. While nothing of the task changes, the
registry sends progress events (the revision the stream has come to, at etcd's watch
progress interval): the revision a stream would resume from keeps up with etcd's, so
an idle task's resume is not refused as compacted. A resume from a compacted revision
(a partition longer than etcd's history) is caught up by the registry: it sends every
entry written since, as changes; from an older registry, refused as compacted, it
takes a snapshot of that task alone. A broken stream (registry gone) starts over with
a snapshot, and the daemon is told, so it reconciles once the registry is back. A
task whose stream has had its snapshot and lost nothing since is ``current``: a
routine reconciliation does not list it.

**One thread, nothing polled.** The streams are coroutines on the client's event loop
(``Client.spawn``: the thread that carries the process's asyncio calls, its channel
set up as the blocking client's, mutual TLS included). A blocking gRPC stream holds a
thread, and gRPC's blocking iterator wakes it every 0.1 s while nothing arrives: a
hundred idle tasks were a thousand wake-ups a second. On the loop an idle stream
costs nothing until a message comes.

**A stream lasts while it is healthy.** It used to end on a timer, so that a stuck
stream could not go unnoticed; progress events do that now. A stream from which
nothing (a change, a progress event) has come for ``silence`` seconds is cancelled
and resumed from its revision, without a snapshot: under ``baton up`` etcd sends
progress every 10 s, so a healthy idle stream is never resumed. The channel's
keepalive pings (client/_wire.py) find a dead connection sooner, which breaks its
streams. A registry that sends no progress (an older one, or etcd left at its default
interval of 10 minutes) has each idle stream resumed every ``silence`` seconds, as the
timer did. ``timeout``, when set, still ends every stream after that long.

**The news goes to a few threads.** Applying news to the table is quick and happens
on the loop, in order. What the daemon does with it takes longer: on a change, a small
file is hashed inline and its report sent, a round trip to the registry; on a snapshot,
the tree is watched and every entry handed to the workers; on a task gone, the registry
is asked again. Measured on a test stack (64 KiB files put one after another, news
timed as the daemon handled it): half the batches of changes took under 0.2 ms (news
that needs no check), one in ten over 2 ms, the slowest 9 ms; a snapshot of 20,000
entries 22 ms. Done on the loop, each would hold every other task's stream that long,
and a slow disk or registry longer. So the callbacks run on ``workers`` threads
(``News``): a task's news in order and one batch at a time, different tasks side by
side; changes that came while the task's previous batch was handled go as one batch
(their reports leave together). A task with ``NEWS_BACKLOG`` items waiting stops
reading its stream until they are taken, so a slow disk holds memory down as a
stream's own thread used to. The headers' stream hands its news to the same threads,
in order. It carries no progress, so no silence limit applies to it: it lasts until it
breaks (keepalive pings find a dead registry).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..client import Client
from ..client.aio import AsyncClient, ServerStream
from ..kernel.backoff import Backoff
from ..kernel.errors import BatonError, Compacted, NotFound
from ..kernel.logs import log
from ..kernel.v1 import baton_pb2 as pb
from .state import Change, Table, TaskView

logger = logging.getLogger("baton.watcher")

#: (task_id, changes, synced): synced is True for a batch that is a full snapshot
OnChanges = Callable[[str, list[Change], bool], None]

#: seconds without a message after which a stream is resumed: three of the progress
#: intervals ``baton up`` gives etcd (10 s)
SILENCE = 30.0
#: threads the streams' news is handled on
NEWS_WORKERS = 4
#: news items waiting for one task at which its stream stops reading
NEWS_BACKLOG = 1024
#: the key of the task headers' news
HEADERS = "task headers"
CHANGED, SNAPSHOT = pb.TaskEvent.KIND_CHANGED, pb.TaskEvent.KIND_SNAPSHOT
SYNCED, PROGRESS = pb.TaskEvent.KIND_SYNCED, pb.TaskEvent.KIND_PROGRESS


class News:
    """Work handed from the event loop to a few threads: one key's items in order and
    one batch at a time (a handler gets every item that waited), keys side by side."""

    def __init__(self, handle: Callable[[list[Any]], None], workers: int,
                 backlog: int = NEWS_BACKLOG) -> None:
        self._handle = handle
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="watcher-news")
        self.backlog = backlog
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        #: a key is here while a worker has (or is about to have) its items
        self._queued: dict[Hashable, list[Any]] = {}
        #: a stream waiting for room in its key's queue: its loop and future
        self._waiting: dict[Hashable, tuple[asyncio.AbstractEventLoop,
                                            asyncio.Future[None]]] = {}

    def put(self, key: Hashable, item: Any) -> bool:
        """Queue ``item``; False once ``backlog`` items wait (see :meth:`room`)."""
        with self._lock:
            queued = self._queued.get(key)
            if queued is not None:
                queued.append(item)
                return len(queued) < self.backlog
            self._queued[key] = [item]
        self._pool.submit(self._drain, key)
        return True

    async def room(self, key: Hashable) -> None:
        """Returns once fewer than ``backlog`` items wait for ``key``."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if len(self._queued.get(key, ())) < self.backlog:
                return
            future: asyncio.Future[None] = loop.create_future()
            self._waiting[key] = (loop, future)
        await future

    def _drain(self, key: Hashable) -> None:
        while True:
            with self._lock:
                items = self._queued[key]
                if not items:
                    del self._queued[key]
                    self._settled.notify_all()
                    return
                self._queued[key] = []
                waiting = self._waiting.pop(key, None)
            if waiting is not None:
                waiting[0].call_soon_threadsafe(_resolve, waiting[1])
            try:
                self._handle(items)
            except Exception:
                logger.exception("handling news of %s failed", key)

    def settle(self, timeout: float) -> bool:
        """Wait until no news is waiting or being handled; False after ``timeout``."""
        with self._settled:
            return self._settled.wait_for(lambda: not self._queued, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Silence:
    """Cancels a stream from which nothing has come for ``limit`` seconds (0: never).
    One timer, moved only when it fires: hearing a message costs a clock reading."""

    def __init__(self, cancel: Callable[[], None], limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._cancel = cancel
        self.limit = limit
        self.fired = False
        self.last = self._loop.time()
        self._timer = self._loop.call_at(self.last + limit, self._check) if limit > 0 else None

    def heard(self) -> None:
        self.last = self._loop.time()

    def _check(self) -> None:
        due = self.last + self.limit
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self._timer = None
        self.fired = True
        self._cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class TaskStreams:
    def __init__(self, client: Client, table: Table, *, on_changes: OnChanges,
                 on_lost: Callable[[], None], on_gone: Callable[[TaskView], None],
                 stop: threading.Event, timeout: float = 0.0, silence: float = SILENCE,
                 backoff: float = 0.5, count: Callable[[str], None] = lambda name: None,
                 workers: int = NEWS_WORKERS) -> None:
        self.client = client
        self.table = table
        self.on_changes = on_changes
        self.on_lost = on_lost
        self.on_gone = on_gone
        self.stop = stop
        #: seconds a stream lasts before it is resumed (0: as long as it is healthy)
        self.timeout = timeout
        #: seconds without a message after which a stream is resumed (0: never)
        self.silence = silence
        #: told "stream_snapshots" for each snapshot a stream takes, "stream_resumes"
        #: for each stream resumed from a revision, "stream_silences" for each one
        #: resumed for having been silent (the daemon's metrics)
        self.count = count
        #: between tries of a broken task stream: up to ``backoff`` doubling, at most 5 s
        self.backoff = Backoff(backoff, max(backoff, 5.0))
        self.news = News(self._handle, workers)
        self._lock = threading.Lock()
        #: the streams running, by key (the id of a task's view, or ``HEADERS``)
        self._runs: dict[Hashable, concurrent.futures.Future[None]] = {}

    def follow(self, task_id: str) -> bool:
        """Serve ``task_id`` from now on; False if it is served already."""
        with self._lock:
            if self.stop.is_set():
                return False
            view, created = self.table.add_task(task_id)
            if not created:
                return False
            try:
                run = self.client.spawn(lambda aio: self._follow(view, aio))
            except BatonError:  # the client is closed: the watcher is stopping
                return False
            self._runs[id(view)] = run
        run.add_done_callback(lambda _: self._ended(id(view), run))
        log(logger, logging.INFO, "serving task", task=task_id, directory=view.directory)
        return True

    def follow_headers(self, on_task: Callable[[pb.Task], None],
                       retry: float = 1.0) -> None:
        """Hand ``on_task`` every task header, then each one again as it changes (on
        the news threads, in order); a broken stream is opened again after ``retry``
        seconds."""
        with self._lock:
            if self.stop.is_set() or HEADERS in self._runs:
                return
            try:
                run = self.client.spawn(lambda aio: self._headers(aio, on_task, retry))
            except BatonError:
                return
            self._runs[HEADERS] = run
        run.add_done_callback(lambda _: self._ended(HEADERS, run))

    def drop(self, view: TaskView) -> None:
        """``view`` is no longer served: end its stream now (it would otherwise last
        until its next message)."""
        with self._lock:
            run = self._runs.get(id(view))
        if run is not None:
            run.cancel()

    def join(self, timeout: float) -> None:
        """Wait for the streams to end (once stopping, they are cancelled) and for
        the news in hand to be handled."""
        with self._lock:
            runs = list(self._runs.values())
        if self.stop.is_set():
            for run in runs:
                run.cancel()
        concurrent.futures.wait(runs, timeout)
        self.news.settle(timeout)
        if self.stop.is_set():
            self.news.close()

    def _ended(self, key: Hashable, run: concurrent.futures.Future[None]) -> None:
        with self._lock:
            if self._runs.get(key) is run:
                del self._runs[key]
        if not run.cancelled() and (error := run.exception()) is not None:
            logger.error("stream %s failed", key, exc_info=error)

    def _current(self, view: TaskView) -> bool:
        return (not self.stop.is_set() and not view.forgotten.is_set()
                and self.table.task(view.task_id) is view)

    def _deadline(self) -> float | None:
        return self.timeout if self.timeout > 0 else None

    # on the loop ------------------------------------------------------------------------

    async def _follow(self, view: TaskView, aio: AsyncClient) -> None:
        """One task's stream, resumed from its revision as it ends, until the task is
        no longer served (or its view is gone from the registry)."""
        task_id = view.task_id
        revision, failures = 0, 0
        while self._current(view):
            snapshot: list[pb.Entry] = []
            self.count("stream_resumes" if revision else "stream_snapshots")
            heard = 0
            stream: ServerStream[pb.TaskEvent] | None = None
            silence: _Silence | None = None
            try:
                stream = aio.watch(task_id, start_revision=revision,
                                   timeout=self._deadline(), progress=True, catch_up=True)
                silence = _Silence(stream.cancel, self.silence)
                async for ev in stream:
                    silence.heard()
                    heard += 1
                    if not self._current(view):
                        return
                    kind = ev.kind  # (changes first: three of them come for each file)
                    if kind == CHANGED:
                        revision = max(revision, ev.revision + 1)
                        change = self.table.apply(task_id, ev.entry)
                        if change is not None:
                            await self._tell(view, ([change], False))
                    elif kind == SNAPSHOT:
                        snapshot.append(ev.entry)
                    elif kind == SYNCED:
                        changes = self.table.replace(task_id, snapshot)
                        revision = ev.revision + 1
                        view.current = True  # every change from here on comes
                        await self._tell(view, (changes, True))
                    elif kind == PROGRESS and revision:
                        # nothing of the task changed up to there: resume after it
                        revision = max(revision, ev.revision + 1)
                if silence.fired:
                    self.count("stream_silences")
                    log(logger, logging.INFO, "task stream silent; resuming it",
                        task=task_id, silence_s=self.silence, revision=revision)
                    failures = 0
                elif heard or self._deadline():
                    failures = 0
                else:
                    # ended by the registry with nothing said: not at once again
                    failures += 1
                    await asyncio.sleep(self.backoff.delay(failures))
            except NotFound:
                log(logger, logging.INFO, "task not in the registry", task=task_id)
                # this view only: the id may be served anew already
                await self._tell(view, lambda: self.on_gone(view))
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
                await self._tell(view, self.on_lost)
                await asyncio.sleep(self.backoff.delay(failures))
            finally:
                if silence is not None:
                    silence.stop()
                if stream is not None:
                    stream.cancel()

    async def _headers(self, aio: AsyncClient, on_task: Callable[[pb.Task], None],
                       retry: float) -> None:
        """The task headers' stream, resumed from where it stood (progress messages keep
        that current while no header changes): after a break only the headers that
        changed come again. Silent for the silence limit: resumed, as a task's is."""
        revision = 0
        while not self.stop.is_set():
            silence: _Silence | None = None
            stream: ServerStream[pb.WatchTasksResponse] | None = None
            try:
                stream = aio.watch_task_headers(revision, timeout=self._deadline())
                silence = _Silence(stream.cancel, self.silence)
                heard = False
                async for reply in stream:
                    silence.heard()
                    heard = True
                    if self.stop.is_set():
                        return
                    if reply.revision:
                        revision = max(revision, reply.revision + 1)
                    if reply.HasField("task"):
                        await self._put(HEADERS, functools.partial(on_task, reply.task))
                if silence.fired:  # (the stream metrics count the tasks' streams)
                    log(logger, logging.INFO, "task headers' stream silent; resuming it",
                        silence_s=self.silence, revision=revision)
                elif not heard and not self._deadline():
                    await asyncio.sleep(retry)  # ended with nothing said: not at once again
            except BatonError as e:
                if self.stop.is_set():
                    return
                log(logger, logging.WARNING, "task stream lost; retrying", error=str(e))
                await asyncio.sleep(retry)
            finally:
                if silence is not None:
                    silence.stop()
                if stream is not None:
                    stream.cancel()

    async def _tell(self, view: TaskView,
                    news: tuple[list[Change], bool] | Callable[[], None]) -> None:
        await self._put(id(view), (view, news))

    async def _put(self, key: Hashable, item: Any) -> None:
        if not self.news.put(key, item):
            await self.news.room(key)

    # on the news threads -----------------------------------------------------------------

    def _handle(self, items: list[Any]) -> None:
        """A key's news, in order: a task's changes that came one after another go as
        one batch (a snapshot's stays its own); those of a view no longer served are
        dropped (its task may be served anew under another view)."""
        batch: list[Change] = []
        view: TaskView | None = None
        for item in items:
            if self.stop.is_set():
                return
            if callable(item):  # a task header's
                item()
                continue
            view, news = item
            if callable(news):
                if batch:
                    self._changes(view, batch, False)
                    batch = []
                news()
            elif news[1]:
                if batch:
                    self._changes(view, batch, False)
                    batch = []
                self._changes(view, news[0], True)
            else:
                batch.extend(news[0])
        if batch and view is not None and not self.stop.is_set():
            self._changes(view, batch, False)

    def _changes(self, view: TaskView, changes: list[Change], synced: bool) -> None:
        if self._current(view):
            self.on_changes(view.task_id, changes, synced)
