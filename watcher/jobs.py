"""The queue between event intake and the hash workers, coalescing by entry.

A key (task, file_id) is at most once in the queue: a burst of events on one
file becomes one check. A key submitted while a worker holds it is marked and
handed out again once that worker is done, so the last event is never lost and
one file is never checked by two workers at once. Delayed submissions (retries
after a failed hash) are due later; an earlier submission of the same key wins.

A thread that learns of files to check may check them itself instead of queueing
them (:meth:`JobQueue.hold`, then :meth:`JobQueue.release`): it holds their keys as a
worker would, so the same rules keep one check per file at a time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

Key = tuple[str, str]


class JobQueue:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: workers wait on it for a key to be due
        self._cond = threading.Condition(self._lock)
        #: ``settle`` waits on it for held keys to be released; separate, so that a
        #: release wakes no idle worker
        self._released = threading.Condition(self._lock)
        self._settling = 0
        self._heap: list[tuple[float, int, Key]] = []
        self._due: dict[Key, tuple[float, int]] = {}
        self._held: set[Key] = set()
        self._again: dict[Key, float] = {}
        #: of those, the ones only an inline check asked for again (``hold``), not a
        #: ``submit``, which wants a worker (a large file, a retry after a delay)
        self._asked: set[Key] = set()
        self._seq = itertools.count()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._due)

    def submit(self, key: Key, delay: float = 0.0) -> None:
        """Check ``key`` after ``delay`` seconds (or sooner if already due sooner)."""
        with self._cond:
            if self._closed:
                return
            due = self._clock() + delay
            if key in self._held:
                self._again[key] = min(due, self._again.get(key, due))
                self._asked.discard(key)
                return
            self._push(key, due)

    def _push(self, key: Key, due: float) -> None:
        current = self._due.get(key)
        if current is not None and current[0] <= due:
            return
        seq = next(self._seq)
        self._due[key] = (due, seq)
        heapq.heappush(self._heap, (due, seq, key))
        self._cond.notify()

    def get(self) -> Key | None:
        """The next due key, now held by the caller until :meth:`done`; None once closed."""
        with self._cond:
            while not self._closed:
                while self._heap and self._due.get(self._heap[0][2]) != self._heap[0][:2]:
                    heapq.heappop(self._heap)  # superseded by an earlier submission
                if self._heap:
                    due, _, key = self._heap[0]
                    wait = due - self._clock()
                    if wait <= 0:
                        heapq.heappop(self._heap)
                        del self._due[key]
                        self._held.add(key)
                        return key
                    self._cond.wait(wait)
                else:
                    self._cond.wait()
            return None

    def done(self, key: Key) -> None:
        self.release([key])

    def hold(self, keys: list[Key]) -> list[Key]:
        """Of ``keys``, the ones the caller may check on its own thread now, as if a
        worker had got each of them (queued ones are taken out of the queue), held
        until :meth:`release`. A key a worker holds is not among them: it is handed
        out again once that worker is done, as for :meth:`submit`."""
        with self._cond:
            if self._closed:
                return []
            now = self._clock()
            held = []
            for key in keys:
                if key in self._held:
                    if key not in self._again:
                        self._asked.add(key)
                    self._again[key] = min(now, self._again.get(key, now))
                else:
                    self._due.pop(key, None)  # its heap item is skipped as superseded
                    self._held.add(key)
                    held.append(key)
            return held

    def release(self, keys: list[Key], *, keep_again: bool = False) -> list[Key]:
        """The checks of ``keys`` (from :meth:`hold`) are done. A key asked for again
        meanwhile is queued for the workers; with ``keep_again``, one that only another
        inline check asked for (``hold``) stays held instead and is returned, for the
        caller to check again itself: no hand-off for news that raced its check. One
        submitted meanwhile (a large file, a retry) is the workers' all the same."""
        if not keys:
            return []
        kept: list[Key] = []
        with self._cond:
            for key in keys:
                again = self._again.pop(key, None)
                asked = key in self._asked
                self._asked.discard(key)
                if again is not None and keep_again and asked and not self._closed:
                    kept.append(key)
                    continue
                self._held.discard(key)
                if again is not None and not self._closed:
                    self._push(key, again)
            if self._settling:
                self._released.notify_all()
        return kept

    def pending(self) -> list[Key]:
        """The keys due or delayed (a snapshot)."""
        with self._cond:
            return list(self._due)

    def settle(self, which: Callable[[Key], bool], timeout: float) -> bool:
        """Drop the queued keys ``which`` selects, then wait until none of them is held
        by a worker (its check finished); False if one still is after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            for key in [k for k in self._due if which(k)]:
                del self._due[key]  # its heap item is skipped as superseded
            for key in [k for k in self._again if which(k)]:
                del self._again[key]
                self._asked.discard(key)
            while any(which(k) for k in self._held):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settling += 1
                try:
                    self._released.wait(left)
                finally:
                    self._settling -= 1
        return True

    def idle(self) -> bool:
        """Nothing due, delayed or held (for tests and benchmarks)."""
        with self._cond:
            return not self._due and not self._held

    def close(self) -> None:
        """Wake every waiting worker; pending keys are dropped (a restart reconciles)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
