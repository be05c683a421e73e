"""How a client call is tried again while the registry cannot be reached.

Like kazoo's ``KazooRetry``, the policy is an object whose sleep, clock and jitter
can be swapped in tests. A call is retried only on ``Unavailable`` (which includes
``DeadlineExceeded``): every mutating request carries a request id that stays the
same across its attempts, so the registry applies it at most once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..kernel.backoff import Backoff
from ..kernel.errors import Unavailable

R = TypeVar("R")


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
