"""The registry's wall clock: UTC epoch seconds, for every time a record holds and every
due time a sweep compares with one.

It is ``time.time`` unless the thread the registry's event loop runs on was given
another with :func:`use` (``baton_relay.testing`` gives its test clock, so that a
record's stamps and the sweeps' due times move together when a test moves time). Times
between two moments of the registry's own (a lease's renewal, a pause) are read from the
event loop, ``loop.time()``, which the same test clock drives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_here = threading.local()


def wall() -> float:
    """Now, in UTC epoch seconds, by this thread's clock."""
    clock: Callable[[], float] | None = getattr(_here, "clock", None)
    return time.time() if clock is None else clock()


@contextmanager
def use(clock: Callable[[], float]) -> Iterator[None]:
    """Read :func:`wall` from ``clock`` on this thread while inside."""
    before = getattr(_here, "clock", None)
    _here.clock = clock
    try:
        yield
    finally:
        _here.clock = before
