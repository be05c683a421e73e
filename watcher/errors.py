"""The watcher's errors: one root, one class per outcome, data as attributes."""

from __future__ import annotations


class WatcherError(Exception):
    """Root of every error the watcher raises on purpose."""


class HashFailed(WatcherError):
    """Hashing ``path`` failed for ``reason``; it counts towards the file's failures.

    ``permanent`` failures (a symlink, not a regular file) will not go away by
    trying again, so they are reported at once instead of after three attempts.
    """

    permanent = False

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class FileMissing(HashFailed):
    """The file (or a directory on its way) does not exist."""


class Refused(HashFailed):
    """The path is a symlink, crosses a symlink, or is not a regular file."""

    permanent = True


class FileChanged(HashFailed):
    """The file changed while it was hashed; ``digest`` is what the read bytes hash to."""

    def __init__(self, path: str, reason: str, digest: str) -> None:
        super().__init__(path, reason)
        self.digest = digest


class WatchFailed(WatcherError):
    """A directory could not be watched (``errno`` from inotify_add_watch)."""

    def __init__(self, path: str, errno: int, reason: str) -> None:
        super().__init__(f"cannot watch {path}: {reason}")
        self.path = path
        self.errno = errno


class WatchLimitReached(WatchFailed):
    """inotify refused a watch with ENOSPC: the user's max_user_watches is used up."""
