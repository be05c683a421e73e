"""Live task summaries for the console's browsers, fed by the registry's watch streams."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from typing import Any

from ...client._client import Client
from ...client.aio import AsyncClient, ServerStream
from ...kernel import errors
from ...kernel.names import state_name, status_name
from ...kernel.v1 import baton_pb2 as pb

#: task statuses after which nothing moves (no watch is kept on them)
FINISHED = {pb.TASK_STATUS_CANCELLED, pb.TASK_STATUS_ARCHIVED}
#: seconds before a broken stream is resumed
WATCH_RETRY = 1.0
#: how long the rate looks back (seconds)
RATE_WINDOW = 60.0
#: at most this often a changed task is read again and sent to the browsers (seconds)
COALESCE = 0.3


class Hub:
    """Live task summaries for every browser: one WatchTasks stream, one Watch stream
    per unfinished task, and one reader that asks GetTask again for the tasks whose
    streams moved (at most every ``COALESCE`` seconds), then sends the summary to each
    subscriber."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queues: set[asyncio.Queue[str]] = set()
        self.followed: set[str] = set()
        #: tasks the headers' stream said have finished: their entry streams end
        self.finished: set[str] = set()
        self.dirty: set[str] = set()
        self.samples: dict[str, deque[tuple[float, int]]] = {}
        self.changed = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        for target in (self._watch_tasks, self._flush):
            threading.Thread(target=target, daemon=True).start()

    def subscribe(self) -> asyncio.Queue[str]:
        q: asyncio.Queue[str] = asyncio.Queue(maxsize=1000)
        with self.lock:
            self.queues.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[str]) -> None:
        with self.lock:
            self.queues.discard(q)

    def _mark(self, task_id: str) -> None:
        with self.lock:
            self.dirty.add(task_id)
        self.changed.set()

    def _watch_tasks(self) -> None:
        # Resumed where it stood when it breaks: only headers that changed come again.
        try:
            for task in self.client.operator.follow_tasks(self.stop, retry=WATCH_RETRY):
                self._mark(task.spec.task_id)
                if task.status in FINISHED:
                    with self.lock:
                        self.finished.add(task.spec.task_id)
                else:
                    self._follow(task.spec.task_id)
        except ValueError:
            return  # the client is closed: the console is stopping

    def _follow(self, task_id: str) -> None:
        with self.lock:
            self.finished.discard(task_id)
            if task_id in self.followed:
                return
            self.followed.add(task_id)
        try:
            # on the client's one stream loop: an idle task's stream holds no thread
            self.client.spawn(lambda aio: self._watch_entries(aio, task_id))
        except errors.BatonError:  # the client is closed: the console is stopping
            with self.lock:
                self.followed.discard(task_id)

    async def _watch_entries(self, aio: AsyncClient, task_id: str) -> None:
        """Mark the task at each change of its entries, until it finishes or is gone.
        The stream asks for progress events, so it resumes from where it stood after a
        break (caught up by the registry if etcd compacted that revision meanwhile)."""
        revision = 0
        try:
            while not self._done(task_id):
                heard = False
                stream: ServerStream[pb.TaskEvent] | None = None
                try:
                    stream = aio.watch(task_id,
                                       start_revision=revision + 1 if revision else -1,
                                       progress=True, catch_up=True)
                    async for ev in stream:
                        heard = True
                        revision = max(revision, ev.revision)
                        if ev.kind == pb.TaskEvent.KIND_CHANGED:
                            self._mark(task_id)
                        if self._done(task_id):
                            return
                except errors.NotFound:
                    return  # the task is gone
                except errors.ClientClosed:
                    return  # the console is stopping
                except errors.BatonError:
                    heard = False  # the registry is away: resume after a pause
                finally:
                    if stream is not None:
                        stream.cancel()
                if not heard:
                    await asyncio.sleep(WATCH_RETRY)
        finally:
            with self.lock:
                self.followed.discard(task_id)

    def _done(self, task_id: str) -> bool:
        with self.lock:
            return self.stop.is_set() or task_id in self.finished

    def _flush(self) -> None:
        while not self.stop.is_set():
            self.changed.wait()
            self.changed.clear()
            with self.lock:
                due, self.dirty = self.dirty, set()
            for task_id in due:
                try:
                    row = self.summary(self.client.operator.get_task(task_id))
                except errors.BatonError:
                    continue
                self._send(json.dumps(row))
            self.stop.wait(COALESCE)

    def _send(self, data: str) -> None:
        loop = self.loop
        if loop is None:
            return
        with self.lock:  # browsers come and go on the event loop's thread
            queues = list(self.queues)
        for q in queues:
            loop.call_soon_threadsafe(_offer, q, data)

    def rate(self, task_id: str, consumed: int) -> float | None:
        """Entries consumed per second over the last minute, as seen here."""
        now = time.monotonic()
        with self.lock:
            seen = self.samples.setdefault(task_id, deque())
            if not seen or seen[-1][1] != consumed:
                seen.append((now, consumed))
            while len(seen) > 1 and now - seen[0][0] > RATE_WINDOW:
                seen.popleft()
            if len(seen) < 2:
                return None
            (t0, c0), (t1, c1) = seen[0], seen[-1]
        return (c1 - c0) / max(now - t0, t1 - t0, 1e-3)

    def summary(self, task: pb.Task) -> dict[str, Any]:
        states = dict(task.states)
        consumed = int(states.get("consumed", 0))
        rate = self.rate(task.spec.task_id, consumed)
        total = task.entry_count
        return {
            "task_id": task.spec.task_id, "status": status_name(task.status),
            "status_reason": task.status_reason, "entries": total, "consumed": consumed,
            "progress": f"{consumed}/{total}" + (f" ({100 * consumed // total}%)"
                                                  if total else ""),
            "rate": "-" if rate is None else f"{rate:.2f}/s",
            "dead": task.dead, "stuck": task.stuck_written + task.blocked,
            "states": {state_name(s): int(states.get(state_name(s), 0))
                       for s in pb.EntryState.values() if s},
        }


def _offer(q: asyncio.Queue[str], data: str) -> None:
    if not q.full():
        q.put_nowait(data)
