"""Which emitter watches which tree: inotify where it can see, polling where not.

The staging root is watched for new task directories; each served task's
directory tree is watched on its own, so a task's watches can be dropped when
it is finished. Polling takes over, with a warning that says why, when asked
to (``--observer poll``), when a tree is on a network or FUSE mount (statfs),
or when inotify runs out of watches (ENOSPC).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable

from ..kernel.logs import log
from .errors import WatchFailed, WatchLimitReached
from .events import Emitter, FsEvent
from .fsinfo import blind_spot

logger = logging.getLogger("baton.watcher")

INOTIFY, POLL = "inotify", "poll"
LIMIT_REASON = "inotify ran out of watches (ENOSPC; raise fs.inotify.max_user_watches)"


class Watches:
    def __init__(self, root: str, mode: str, sink: Callable[[list[FsEvent]], None],
                 poll_interval: float,
                 spot: Callable[[str], str | None] = blind_spot) -> None:
        self.root = root
        self.mode = mode
        self._sink = sink
        self._poll_interval = poll_interval
        self._spot = spot
        self._lock = threading.RLock()
        self._inotify: Emitter | None = None
        self._polling: Emitter | None = None
        self._trees: dict[str, str] = {}
        self.root_backend = INOTIFY

    def _poller(self) -> Emitter:
        if self._polling is None:
            from .polling import PollingEmitter  # watchdog only where it is needed

            sink = self._sink
            self._polling = PollingEmitter(lambda event: sink([event]), self._poll_interval)
            self._polling.start()
        return self._polling

    def _warn(self, path: str, reason: str) -> None:
        log(logger, logging.WARNING, "falling back to polling", path=path, reason=reason,
            poll_interval=self._poll_interval)

    def start(self) -> None:
        reason = self._why_not_inotify(self.root)
        if reason is None:
            try:
                from .emitter import InotifyEmitter

                emitter = InotifyEmitter(self._sink)
            except (ImportError, WatchFailed) as e:
                reason = f"inotify is unavailable ({e})"
            else:
                emitter.start()
                self._inotify = emitter
                try:
                    emitter.watch(self.root, recursive=False)
                except WatchLimitReached:
                    reason = LIMIT_REASON
        if reason is not None:
            self._warn(self.root, reason)
            self.root_backend = POLL
            self._poller().watch(self.root, recursive=False)

    def _why_not_inotify(self, path: str) -> str | None:
        if self.mode == POLL:
            return "--observer poll"
        if self.mode == "auto" and (spot := self._spot(path)) is not None:
            return f"inotify cannot see writes {spot}"
        return None

    def watch_tree(self, path: str) -> str:
        """Watch a task's tree (again: after an overflow this adds missing watches).

        Returns the backend used. Raises :class:`WatchFailed` if ``path`` cannot be
        watched at all (e.g. it does not exist yet).
        """
        with self._lock:
            backend = self._trees.get(path)
            if backend == POLL:
                return POLL
            reason = None
            if self.root_backend == POLL or self._inotify is None:
                backend = POLL  # the reason was given for the root
            elif backend is None and (reason := self._why_not_inotify(path)) is not None:
                backend = POLL
            else:
                try:
                    self._inotify.watch(path, recursive=True)
                    self._trees[path] = INOTIFY
                    return INOTIFY
                except WatchLimitReached:
                    self._inotify.unwatch(path)
                    reason, backend = LIMIT_REASON, POLL
            if not os.path.isdir(path):
                raise WatchFailed(path, errno.ENOENT, "no such directory")
            if reason is not None:
                self._warn(path, reason)
            self._poller().watch(path, recursive=True)
            self._trees[path] = POLL
            return POLL

    def fall_back(self, below: str) -> None:
        """inotify ran out of watches somewhere below a watched tree: poll that tree."""
        with self._lock:
            tree = next((t for t in self._trees if below == t or below.startswith(t + "/")),
                        None)
            if tree is None or self._trees[tree] == POLL or self._inotify is None:
                return
            self._inotify.unwatch(tree)
            self._warn(tree, LIMIT_REASON)
            self._poller().watch(tree, recursive=True)
            self._trees[tree] = POLL

    def unwatch_tree(self, path: str) -> None:
        with self._lock:
            backend = self._trees.pop(path, None)
            emitter = self._polling if backend == POLL else self._inotify
            if backend is not None and emitter is not None:
                emitter.unwatch(path)

    def backend_of(self, path: str) -> str | None:
        with self._lock:
            return self._trees.get(path)

    def watch_count(self) -> int:
        """Directories watched by inotify (0 without it)."""
        count = getattr(self._inotify, "watch_count", 0)
        return int(count)

    def stop(self) -> None:
        for emitter in (self._inotify, self._polling):
            if emitter is not None:
                emitter.stop()
