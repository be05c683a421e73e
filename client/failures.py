"""Exceptions a ``produce`` or ``consume`` block raises to say what kind of failure it
met: the helper hands the entry back accordingly, then lets the exception propagate.

    with produce(c, s, "t1", "a") as out:
        if not source_exists():
            raise PermanentError("the source is gone")   # dead at once, no retry
        if rate_limited():
            raise RetryAfter(30, "upstream says wait")   # claimable again in 30 s

Any other exception fails the entry (a producer's: retried after the task's
backoff) or nacks it (a consumer's: the group may take it again at once).
"""

from __future__ import annotations


class PermanentError(Exception):
    """No retry can succeed: a producer's entry goes dead at once, its retries not
    spent (``fail --permanent``); a consumer gives the entry up, and it goes dead for
    every group (``nack --permanent``)."""


class RetryAfter(Exception):
    """Try again no sooner than ``seconds`` from now: a producer's entry is claimable
    again then (instead of after the task's backoff; a retry is spent as for any
    failure); a consumer's entry is handed back to its group then."""

    def __init__(self, seconds: float, reason: str = "") -> None:
        super().__init__(reason or f"retry after {seconds:g} s")
        self.seconds = seconds


def handing_back(error: BaseException) -> tuple[bool, float]:
    """The ``permanent`` and ``delay`` a fail or nack takes for ``error``."""
    if isinstance(error, PermanentError):
        return True, 0.0
    if isinstance(error, RetryAfter):
        return False, error.seconds
    return False, 0.0
