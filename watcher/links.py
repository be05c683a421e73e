"""Verified files with more than one name, which inotify cannot see change.

inotify reports a write in the directory the file was opened through. A file
with a second hard link outside the staging tree can be rewritten through that
name without an event in any watched directory, and would stay ``verified``
until the next reconciliation. While such a file is verified the watcher keeps
it here, and the daemon stats it every ``poll_interval``: a changed identity
(size, mtime, ctime or inode) queues a check, which hashes the file again and
reports what it finds.
"""

from __future__ import annotations

import threading

from .hashing import Identity
from .jobs import Key


class LinkedFiles:
    """Verified files with ``st_nlink > 1``, with the identity last vouched for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[Key, Identity] = {}

    def keep(self, key: Key, identity: Identity) -> bool:
        """Poll ``key`` from now on (its latest identity); True if it was not polled yet."""
        with self._lock:
            new = key not in self._files
            self._files[key] = identity
            return new

    def drop(self, key: Key) -> None:
        with self._lock:
            self._files.pop(key, None)

    def items(self) -> list[tuple[Key, Identity]]:
        with self._lock:
            return list(self._files.items())

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._files

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)
