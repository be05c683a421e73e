"""What the emitters tell the daemon, and the bounded queue between them.

Emitters (inotify or polling) only translate what the kernel or a scan saw into
:class:`FsEvent` and put it on the :class:`Intake`; the daemon's dispatcher
decides what each means. When the intake is full an event is dropped and the
intake remembers that it overflowed: the daemon then reconciles everything,
exactly as after the kernel's own IN_Q_OVERFLOW.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
from dataclasses import dataclass
from typing import Protocol


class Kind(enum.Enum):
    LANDED = "landed"  # closed after writing, or renamed into place
    TOUCHED = "touched"  # modified or attributes changed (matters for verified files)
    GONE = "gone"  # deleted or renamed away
    DIR_CREATED = "dir_created"  # the emitter already watches it (when it watches its parent)
    DIR_GONE = "dir_gone"
    OVERFLOW = "overflow"  # events were lost; reconcile everything
    WATCH_LIMIT = "watch_limit"  # inotify ran out of watches below ``path``


@dataclass(frozen=True, slots=True)
class FsEvent:
    kind: Kind
    path: str = ""


class Emitter(Protocol):
    """A source of :class:`FsEvent` for the directory trees it is asked to watch."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def watch(self, path: str, recursive: bool) -> None:
        """Watch ``path`` (and, if ``recursive``, every directory below, as they appear)."""

    def unwatch(self, path: str) -> None:
        """Stop watching ``path`` and everything below it."""


class Intake:
    """A bounded FIFO of events that records, instead of blocking, when it overflows."""

    def __init__(self, maxsize: int) -> None:
        self._queue: queue.Queue[FsEvent | None] = queue.Queue(maxsize)
        self._lock = threading.Lock()
        self._overflowed = False

    def put(self, event: FsEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            with self._lock:
                self._overflowed = True

    def __len__(self) -> int:
        """Events waiting (approximately: for metrics)."""
        return self._queue.qsize()

    def get(self, timeout: float | None = None) -> FsEvent | None:
        """The next event; an OVERFLOW first if events were dropped; None on timeout/close."""
        with self._lock:
            if self._overflowed:
                self._overflowed = False
                return FsEvent(Kind.OVERFLOW)
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Wake a blocked :meth:`get` (it returns None)."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
