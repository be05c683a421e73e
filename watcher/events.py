"""What the emitters tell the daemon, and the bounded queue between them.

Emitters (inotify or polling) only translate what the kernel or a scan saw into
:class:`FsEvent` and put it on the :class:`Intake`; the daemon's dispatcher
decides what each means. When the intake is full an event is dropped and the
intake remembers that it overflowed: the daemon then reconciles everything,
exactly as after the kernel's own IN_Q_OVERFLOW.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
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
    """A bounded FIFO of events that records, instead of blocking, when it overflows.

    The dispatcher takes every waiting event at once (:meth:`take`), and an emitter
    wakes it only if it waits: a burst of events is one hand-off, not one per event.
    """

    def __init__(self, maxsize: int) -> None:
        self._maxsize = maxsize
        self._events: deque[FsEvent] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._overflowed = False
        self._closed = False
        self._waiting = False

    def put(self, event: FsEvent) -> None:
        self.put_all([event])

    def put_all(self, events: list[FsEvent]) -> None:
        """Queue ``events`` (those beyond the bound are dropped: an overflow)."""
        with self._cond:
            room = self._maxsize - len(self._events)
            if len(events) > room:
                self._overflowed = True
                events = events[:max(0, room)]
            self._events.extend(events)
            if self._waiting:
                self._cond.notify()

    def __len__(self) -> int:
        """Events waiting (for metrics)."""
        return len(self._events)

    def take(self, timeout: float | None = None) -> list[FsEvent]:
        """Every event waiting, an OVERFLOW first if events were dropped; waits for one
        up to ``timeout`` seconds (None: until one comes or :meth:`close`); [] if none
        came, or once closed."""
        with self._cond:
            if not self._events and not self._overflowed and not self._closed:
                self._waiting = True
                try:
                    self._cond.wait(timeout)
                finally:
                    self._waiting = False
            if self._closed:
                return []
            events = list(self._events)
            self._events.clear()
            if self._overflowed:
                self._overflowed = False
                events.insert(0, FsEvent(Kind.OVERFLOW))
            return events

    def get(self, timeout: float | None = None) -> FsEvent | None:
        """The next event; an OVERFLOW first if events were dropped; None on timeout/close."""
        with self._cond:
            if self._overflowed:
                self._overflowed = False
                return FsEvent(Kind.OVERFLOW)
            if not self._events and not self._closed:
                self._waiting = True
                try:
                    self._cond.wait(timeout)
                finally:
                    self._waiting = False
            if self._closed or not self._events:
                return None
            return self._events.popleft()

    def close(self) -> None:
        """Wake a blocked :meth:`take` or :meth:`get` (they return nothing from now on)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
