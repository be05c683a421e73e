"""The inotify emitter: one thread reads the kernel's events and translates them.

Like watchdog's emitter it only enqueues; nothing here hashes or talks to the
registry. Directory trees are watched recursively: a directory that appears is
watched first and announced second (``DIR_CREATED``), so whoever reacts to the
announcement by looking inside cannot miss a file created in between.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable

from ..kernel.contract import TEMP_MARKER
from ._inotify import (
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_DONT_FOLLOW,
    IN_EXCL_UNLINK,
    IN_IGNORED,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    NOT_A_FILE,
    Inotify,
    RawEvent,
)
from .errors import WatchFailed, WatchLimitReached
from .events import FsEvent, Kind

log = logging.getLogger("baton.watcher.inotify")

_SELF = IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW
#: a directory whose files matter (a task's tree)
TREE_MASK = (IN_CLOSE_WRITE | IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE | IN_ATTRIB | IN_MODIFY
             | IN_CREATE | IN_EXCL_UNLINK | _SELF)
#: a directory whose subdirectories matter, not its files (the staging root)
DIRS_MASK = IN_CREATE | IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE | _SELF


#: events about a name that is not an entry's file, or about no name
_NOT_A_FILE = NOT_A_FILE


class InotifyEmitter:
    """Watches directories with inotify and hands :class:`FsEvent` to ``sink``, the
    events of one read of the kernel's queue together."""

    def __init__(self, sink: Callable[[list[FsEvent]], None],
                 inotify: Inotify | None = None) -> None:
        self._sink = sink
        # the producer helper's temp files: dropped when read (and in ``handle``)
        self._ino = inotify or Inotify(os.fsencode(TEMP_MARKER))
        self._lock = threading.RLock()
        self._by_wd: dict[int, tuple[str, bool]] = {}
        self._by_path: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watcher-inotify", daemon=True)

    @property
    def watch_count(self) -> int:
        with self._lock:
            return len(self._by_wd)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._ino.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._ino.close()

    # watches ---------------------------------------------------------------------

    def watch(self, path: str, recursive: bool) -> None:
        self._add(path, recursive)
        if recursive:
            self._add_below(path)

    def _add(self, path: str, recursive: bool) -> None:
        wd = self._ino.add_watch(path, TREE_MASK if recursive else DIRS_MASK)
        with self._lock:
            self._by_wd[wd] = (path, recursive)
            self._by_path[path] = wd

    def _add_below(self, top: str) -> None:
        """Watch every directory below ``top``; each before it is listed."""
        stack = [top]
        while stack:
            current = stack.pop()
            try:
                with os.scandir(current) as it:
                    subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
            except (FileNotFoundError, NotADirectoryError):
                continue
            for sub in subdirs:
                try:
                    self._add(sub, True)
                except WatchLimitReached:
                    raise
                except WatchFailed:
                    continue  # removed meanwhile
                stack.append(sub)

    def unwatch(self, path: str) -> None:
        with self._lock:
            doomed = [(p, wd) for p, wd in self._by_path.items()
                      if p == path or p.startswith(path + "/")]
            for p, wd in doomed:
                del self._by_path[p]
                self._by_wd.pop(wd, None)
        for _, wd in doomed:
            try:
                self._ino.rm_watch(wd)
            except WatchFailed as e:
                log.debug("rm_watch: %s", e)

    # events ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._ino.read()
            except OSError as e:  # the descriptor is gone: nothing more will come
                if not self._stop.is_set():
                    log.error("reading inotify events failed: %s", e)
                    self._sink([FsEvent(Kind.OVERFLOW)])
                return
            self.handle(events)

    def handle(self, events: Iterable[RawEvent]) -> None:
        """Translate raw events (public so tests can inject e.g. an IN_Q_OVERFLOW);
        what they mean goes to the sink in one batch."""
        out: list[FsEvent] = []
        for ev in events:
            mask = ev.mask
            if not mask & _NOT_A_FILE and TEMP_MARKER in ev.name:
                continue  # the producer helper's temp file; its rename is what counts
            if mask & IN_Q_OVERFLOW:
                log.warning("inotify queue overflowed: events were lost")
                out.append(FsEvent(Kind.OVERFLOW))
                continue
            with self._lock:
                where = self._by_wd.get(ev.wd)
                if mask & IN_IGNORED:
                    if where is not None:
                        del self._by_wd[ev.wd]
                        if self._by_path.get(where[0]) == ev.wd:
                            del self._by_path[where[0]]
                    continue
            if where is None:
                continue
            directory, recursive = where
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                if mask & IN_MOVE_SELF:
                    self.unwatch(directory)  # it still exists, elsewhere, under another name
                out.append(FsEvent(Kind.DIR_GONE, directory))
                continue
            path = f"{directory}/{ev.name}"
            if mask & IN_ISDIR:
                self._directory_event(mask, path, recursive, out)
            elif mask & (IN_CLOSE_WRITE | IN_MOVED_TO):
                out.append(FsEvent(Kind.LANDED, path))
            elif mask & (IN_DELETE | IN_MOVED_FROM):
                out.append(FsEvent(Kind.GONE, path))
            elif mask & (IN_MODIFY | IN_ATTRIB):
                out.append(FsEvent(Kind.TOUCHED, path))
        if out:
            self._sink(out)

    def _directory_event(self, mask: int, path: str, recursive: bool,
                         out: list[FsEvent]) -> None:
        if mask & (IN_CREATE | IN_MOVED_TO):
            if recursive:
                try:
                    self.watch(path, True)
                except WatchLimitReached:
                    out.append(FsEvent(Kind.WATCH_LIMIT, path))
                    return
                except WatchFailed:
                    return  # gone again already
            out.append(FsEvent(Kind.DIR_CREATED, path))
        elif mask & (IN_DELETE | IN_MOVED_FROM):
            if mask & IN_MOVED_FROM:
                self.unwatch(path)
            out.append(FsEvent(Kind.DIR_GONE, path))
