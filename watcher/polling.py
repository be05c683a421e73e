"""The polling emitter: the one module that imports watchdog.

Used where inotify cannot see (network and FUSE mounts), when inotify runs out
of watches, and with ``--observer poll``. Polling cannot tell a finished write
from one in progress, so a created or modified file is reported as landed and
the hasher's before/after comparison catches files still being written.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers.api import ObservedWatch
from watchdog.observers.polling import PollingObserver

from ..kernel.contract import TEMP_MARKER
from .events import FsEvent, Kind


def _path(raw: bytes | str) -> str:
    return os.fsdecode(raw)


class _Handler(FileSystemEventHandler):
    def __init__(self, sink: Callable[[FsEvent], None], files: bool) -> None:
        self._sink = sink
        self._files = files

    def dispatch(self, event: FileSystemEvent) -> None:
        kind, src = event.event_type, _path(event.src_path)
        dest = _path(event.dest_path) if event.dest_path else ""
        if event.is_directory:
            if kind == "created":
                self._sink(FsEvent(Kind.DIR_CREATED, src))
            elif kind == "deleted":
                self._sink(FsEvent(Kind.DIR_GONE, src))
            elif kind == "moved":
                self._sink(FsEvent(Kind.DIR_GONE, src))
                self._sink(FsEvent(Kind.DIR_CREATED, dest))
            return
        if not self._files:
            return
        if kind in ("created", "modified", "closed"):
            self._landed(src)
        elif kind == "deleted":
            self._gone(src)
        elif kind == "moved":
            self._gone(src)
            self._landed(dest)

    def _landed(self, path: str) -> None:
        if TEMP_MARKER not in os.path.basename(path):
            self._sink(FsEvent(Kind.LANDED, path))

    def _gone(self, path: str) -> None:
        if TEMP_MARKER not in os.path.basename(path):
            self._sink(FsEvent(Kind.GONE, path))


class PollingEmitter:
    """Scans watched trees every ``interval`` seconds (watchdog's PollingObserver)."""

    def __init__(self, sink: Callable[[FsEvent], None], interval: float) -> None:
        self._sink = sink
        self._observer = PollingObserver(timeout=interval)
        self._lock = threading.Lock()
        self._watches: dict[str, ObservedWatch] = {}

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        if self._observer.is_alive():
            self._observer.join(timeout=10)

    def watch(self, path: str, recursive: bool) -> None:
        with self._lock:
            if path in self._watches:
                return
            self._watches[path] = self._observer.schedule(
                _Handler(self._sink, files=recursive), path, recursive=recursive
            )

    def unwatch(self, path: str) -> None:
        with self._lock:
            doomed = [p for p in self._watches if p == path or p.startswith(path + "/")]
            watches = [self._watches.pop(p) for p in doomed]
        for w in watches:
            with contextlib.suppress(KeyError):
                self._observer.unschedule(w)
