"""The one backoff of Baton: exponential, jittered.

After failure ``n`` (1, 2, ...) the bound is ``initial · factor^(n-1)``, at most ``cap``,
and a caller waits a time drawn between ``floor · bound`` and the bound: spread out, so
that many callers that failed together do not come back together. The client's retries,
the registry's transaction loop, ``baton up``'s supervisor and the watcher's task streams
wait with full jitter (``floor`` 0); an entry's retry after a failure keeps at least half
of its task's backoff (``floor`` 0.5). The jitter is injected so tests can pin it
(``jitter=upper`` waits the bound itself).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff", "upper"]


def upper(low: float, high: float) -> float:
    """A jitter that always takes the bound: the backoff without its spread (tests)."""
    return high


@dataclass(frozen=True)
class Backoff:
    """How long to wait after the ``n``-th failure in a row."""

    #: the bound after the first failure, in seconds
    initial: float
    #: the largest bound
    cap: float
    #: how the bound grows per failure
    factor: float = 2.0
    #: the least share of the bound that is waited (0: full jitter)
    floor: float = 0.0
    #: a number between its two arguments
    jitter: Callable[[float, float], float] = random.uniform

    def __post_init__(self) -> None:
        if min(self.initial, self.cap, self.factor) < 0 or not 0 <= self.floor <= 1:
            raise ValueError(f"a backoff needs initial, cap and factor >= 0 and a floor in "
                             f"0..1, not initial={self.initial} cap={self.cap} "
                             f"factor={self.factor} floor={self.floor}")

    def bound(self, failures: int) -> float:
        """The most it waits after ``failures`` failures in a row (0 before the first)."""
        if failures < 1:
            return 0.0
        try:
            grown = self.initial * self.factor ** (failures - 1)
        except OverflowError:  # far past the cap
            return self.cap
        return min(self.cap, grown)

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row: drawn up to the bound."""
        bound = self.bound(failures)
        return self.jitter(self.floor * bound, bound) if bound > 0 else 0.0
