"""The watcher's digest reports, sent many to a message.

A hash worker hands its report over and goes on with the next file; one thread sends
what queued while the batch before it was on its way, up to ``MAX_REPORT_BATCH``, in
one ``ReportVerificationBatch`` call, and hands each report's answer (the entry after
it, or the error it alone ended with) to the callback given with it. Nothing waits
for a batch to fill: on a quiet watcher a report leaves at once, alone; under load
the batches grow by themselves, and the registry applies their reports together
(their transactions share etcd round trips).
"""

from __future__ import annotations

import logging
import threading
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

    def __init__(self, client: Client, max_batch: int = MAX_REPORT_BATCH) -> None:
        self.client = client
        self.max_batch = max_batch
        self._queue: deque[_Queued] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._sending = False
        #: the reporter thread waits for reports (a submit wakes it)
        self._idle = False
        self._local = threading.local()
        self._gathering = _Gathering(self)
        self._thread = threading.Thread(target=self._run, name="watcher-reporter",
                                        daemon=True)
        #: batches sent and reports carried, for the watcher's metrics and tests
        self.batches = 0
        self.reports = 0

    def start(self) -> Reporter:
        self._thread.start()
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
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def __len__(self) -> int:
        return len(self._queue)

    def settle(self, timeout: float) -> bool:
        """Wait until every report handed over so far is answered; False if
        ``timeout`` seconds passed first (a shard handover waits so)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._sending,
                                       timeout)

    def _take(self) -> list[_Queued]:
        with self._cond:
            while not self._queue and not self._closing:
                self._idle = True
                try:
                    self._cond.wait()
                finally:
                    self._idle = False
            batch: list[_Queued] = []
            while self._queue and len(batch) < self.max_batch:
                batch.append(self._queue.popleft())
            self._sending = bool(batch)
            self._cond.notify_all()
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
                self._sending = False
                self._cond.notify_all()
