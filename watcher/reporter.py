"""The watcher's digest reports, sent many to a message.

A hash worker hands its report over and goes on with the next file; a sender thread
sends what queued while the batch before it was on its way, up to
``MAX_REPORT_BATCH``, in one ``ReportVerificationBatch`` call, and hands each report's
answer (the entry after it, or the error it alone ended with) to the callback given
with it. Nothing waits for a batch to fill: on a quiet watcher a report leaves at
once, alone; under load the batches grow by themselves, and the registry applies
their reports together (their transactions share etcd round trips).

``lanes`` senders have a batch on its way at once (two by default): a report does not
wait behind a whole batch of others' transactions, so more of them reach the registry
before their file's commit, which then verifies it in its own transaction (one
transaction a file instead of two). One entry's reports stay in the order submitted: a
report whose entry has one on its way waits in the queue until that one is answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..client import Client
from ..kernel.contract import MAX_REPORT_BATCH
from ..kernel.errors import BatonError, Internal
from ..kernel.logs import log
from ..kernel.v1 import baton_pb2 as pb

logger = logging.getLogger("baton.watcher")

#: what a report's callback receives: the entry after it, or the error it ended with
Outcome = pb.Entry | BatonError
Done = Callable[[Outcome], None]
#: batches on their way at once (senders)
LANES = 2


@dataclass
class _Queued:
    request: pb.ReportVerificationRequest
    done: Done


class _Gathering:
    """``Reporter.gathering``'s context (a class, not a generator: it is entered for
    each batch of checks, several times per file)."""

    __slots__ = ("_reporter",)

    def __init__(self, reporter: Reporter) -> None:
        self._reporter = reporter

    def __enter__(self) -> None:
        self._reporter._local.gathering = True

    def __exit__(self, *exc: object) -> None:
        reporter = self._reporter
        reporter._local.gathering = False
        with reporter._cond:
            if reporter._idle and reporter._queue:
                reporter._cond.notify_all()


class Reporter:
    """Batches ``ReportVerification`` calls on one thread (see the module)."""

    def __init__(self, client: Client, max_batch: int = MAX_REPORT_BATCH,
                 lanes: int = LANES) -> None:
        if lanes < 1:
            raise ValueError(f"a reporter needs at least one lane, not {lanes}")
        self.client = client
        self.max_batch = max_batch
        self._queue: deque[_Queued] = deque()
        self._cond = threading.Condition()
        self._closing = False
        #: batches on their way, and the entries they carry reports of
        self._sending = 0
        self._on_way: set[tuple[str, str]] = set()
        #: senders waiting for reports (a submit wakes them)
        self._idle = 0
        self._local = threading.local()
        self._gathering = _Gathering(self)
        self._threads = [threading.Thread(target=self._run, name=f"watcher-reporter-{i}",
                                          daemon=True) for i in range(lanes)]
        #: batches sent and reports carried, for the watcher's metrics and tests
        self.batches = 0
        self.reports = 0

    def start(self) -> Reporter:
        for thread in self._threads:
            thread.start()
        return self

    def submit(self, request: pb.ReportVerificationRequest, done: Done) -> None:
        """Queue ``request``; ``done`` gets its outcome on the reporter's thread."""
        with self._cond:
            if self._closing:
                raise BatonError("the watcher is stopping: no new reports")
            self._queue.append(_Queued(request, done))
            if self._idle and not getattr(self._local, "gathering", False):
                self._cond.notify_all()  # notify() might wake one in ``settle`` instead

    def gathering(self) -> _Gathering:
        """The reports the calling thread submits within go together: the reporter
        is woken once, at the end, not for the first of them."""
        return self._gathering

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, then stop (waits at most ``timeout`` seconds)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    def __len__(self) -> int:
        return len(self._queue)

    def settle(self, timeout: float) -> bool:
        """Wait until every report handed over so far is answered; False if
        ``timeout`` seconds passed first (a shard handover waits so)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._sending,
                                       timeout)

    def _take(self) -> list[_Queued]:
        """The next batch: queued reports in order, but none of an entry that has one
        on its way (those stay queued, in order); empty once closing with nothing left."""
        with self._cond:
            while True:
                batch = self._takeable()
                if batch or (self._closing and not self._queue):
                    break
                # Nothing queued, or only reports of entries on their way (their batch's
                # sender takes them once answered): wait for a submit or an answer.
                self._idle += 1
                try:
                    self._cond.wait()
                finally:
                    self._idle -= 1
            if batch:
                self._sending += 1
                self._cond.notify_all()
            return batch

    def _takeable(self) -> list[_Queued]:
        queue, on_way = self._queue, self._on_way
        if not on_way:  # the common case: the front of the queue, as it is
            batch = [queue.popleft() for _ in range(min(len(queue), self.max_batch))]
        else:
            batch, kept = [], deque()
            while queue and len(batch) < self.max_batch:
                q = queue.popleft()
                key = (q.request.task_id, q.request.file_id)
                (kept if key in on_way else batch).append(q)
            kept.extend(queue)
            self._queue = kept
        for q in batch:
            on_way.add((q.request.task_id, q.request.file_id))
        return batch

    def _run(self) -> None:
        while batch := self._take():
            outcomes: list[Outcome]
            try:
                outcomes = self.client.watcher.report_batch([q.request for q in batch])
            except BatonError as e:  # the call as a whole: each report ends with it
                outcomes = [e] * len(batch)
            except Exception as e:  # never lose the thread: each report hears of it
                log(logger, logging.ERROR, "report batch failed", error=repr(e))
                outcomes = [Internal(f"report batch failed: {e!r}")] * len(batch)
            if len(outcomes) != len(batch):
                outcomes = [Internal(f"the registry answered {len(outcomes)} of "
                                     f"{len(batch)} reports")] * len(batch)
            self.batches += 1
            self.reports += len(batch)
            for queued, outcome in zip(batch, outcomes, strict=True):
                try:
                    queued.done(outcome)
                except Exception as e:  # one report's handling never stops the others
                    log(logger, logging.ERROR, "handling a report's answer failed",
                        task=queued.request.task_id, file_id=queued.request.file_id,
                        error=repr(e))
            with self._cond:
                self._sending -= 1
                for queued in batch:
                    self._on_way.discard((queued.request.task_id, queued.request.file_id))
                self._cond.notify_all()
