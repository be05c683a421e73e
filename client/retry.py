"""How a client call is tried again while the registry cannot be reached.

Like kazoo's ``KazooRetry``, the policy is an object whose sleep, clock and jitter
can be swapped in tests. A call is retried only on ``Unavailable`` (which includes
``DeadlineExceeded``): every mutating request carries a request id that stays the
same across its attempts, so the registry applies it at most once.

A producer's claim refused with ``Backpressure`` is a different wait: nothing is
wrong, a consumer group is behind. The producing helpers (``produce``,
``produce_each``, ``put``, ``AsyncSession.claim_waiting``) claim again after
``BACKPRESSURE_BACKOFF`` for up to ``BACKPRESSURE_WAIT`` seconds.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from ..kernel.backoff import Backoff
from ..kernel.errors import Backpressure, Unavailable

R = TypeVar("R")

#: seconds the producing helpers wait out back-pressure by default
BACKPRESSURE_WAIT = 300.0
#: between claims refused with ``Backpressure``: Baton's one jittered backoff
BACKPRESSURE_BACKOFF = Backoff(0.05, 2.0)


def waiting_line(error: Backpressure, wait: float) -> str:
    """What is logged (INFO, once per wait) when a producer starts waiting out
    ``error``."""
    f = error.fields
    return (f"task {f.get('task_id', '?')!r} is back-pressured by consumer group "
            f"{f.get('group', '?')!r} (backlog {f.get('backlog', '?')}, limit "
            f"{f.get('limit', '?')}): waiting up to {wait:g} s to claim")


@dataclass(frozen=True)
class RetryPolicy:
    """How ``UNAVAILABLE`` calls are retried: exponential backoff with full jitter.

    Every mutating call carries a request id that stays the same across its
    retries, so the registry applies it at most once.
    """

    attempts: int = 6
    initial: float = 0.1
    cap: float = 2.0
    deadline: float = 30.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    #: a number between its two arguments
    jitter: Callable[[float, float], float] = random.uniform

    def wait(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1, 2, ...): anything up to
        ``initial`` doubled per attempt, at most ``cap`` (Baton's one :class:`Backoff`)."""
        return Backoff(self.initial, self.cap, jitter=self.jitter).delay(attempt)

    def call(self, fn: Callable[[], R]) -> R:
        """``fn()``, tried again on ``Unavailable`` until ``attempts`` calls were made
        or ``deadline`` seconds passed since the first; the last error is raised."""
        start = self.clock()
        attempt = 1
        while True:
            try:
                return fn()
            except Unavailable:
                if attempt >= self.attempts or self.clock() - start >= self.deadline:
                    raise
            self.sleep(self.wait(attempt))
            attempt += 1

    async def acall(self, fn: Callable[[], Awaitable[R]]) -> R:
        """``call`` for a coroutine: ``await fn()``, tried again as ``call`` tries. The
        waits are the event loop's, unless the policy was given a ``sleep`` of its own
        (a test's), which is called as ``call`` calls it."""
        start = self.clock()
        attempt = 1
        while True:
            try:
                return await fn()
            except Unavailable:
                if attempt >= self.attempts or self.clock() - start >= self.deadline:
                    raise
            delay = self.wait(attempt)
            if self.sleep is time.sleep:
                await asyncio.sleep(delay)
            else:
                self.sleep(delay)
            attempt += 1
