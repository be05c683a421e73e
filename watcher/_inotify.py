"""The one module that imports ``inotify_simple``; it translates its errors.

A thin typed layer: add/remove watches, and a blocking read that another
thread can interrupt (a pipe is polled next to the inotify descriptor).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import struct
from typing import NamedTuple

import inotify_simple

from .errors import WatchFailed, WatchLimitReached

_f = inotify_simple.flags
IN_MODIFY = int(_f.MODIFY)
IN_ATTRIB = int(_f.ATTRIB)
IN_CLOSE_WRITE = int(_f.CLOSE_WRITE)
IN_MOVED_FROM = int(_f.MOVED_FROM)
IN_MOVED_TO = int(_f.MOVED_TO)
IN_CREATE = int(_f.CREATE)
IN_DELETE = int(_f.DELETE)
IN_DELETE_SELF = int(_f.DELETE_SELF)
IN_MOVE_SELF = int(_f.MOVE_SELF)
IN_Q_OVERFLOW = int(_f.Q_OVERFLOW)
IN_IGNORED = int(_f.IGNORED)
IN_ISDIR = int(_f.ISDIR)
IN_ONLYDIR = int(_f.ONLYDIR)
IN_DONT_FOLLOW = int(_f.DONT_FOLLOW)
IN_EXCL_UNLINK = int(_f.EXCL_UNLINK)


class RawEvent(NamedTuple):
    """One event as the kernel wrote it (a tuple: several are made per file landed)."""

    wd: int
    mask: int
    cookie: int
    name: str


_HEAD = struct.Struct("iIII")  # struct inotify_event, before its name
#: bytes read at once: whole events only, as many as fit (a name is at most 256 bytes)
READ_SIZE = 64 << 10


#: events about a name that is not a file's, or about no name (never dropped)
NOT_A_FILE = IN_ISDIR | IN_Q_OVERFLOW | IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF


def parse(data: bytes, drop: bytes = b"") -> list[RawEvent]:
    """The events in what a read of an inotify descriptor returned; with ``drop``, not
    those about a file whose name contains it (left out before a name is decoded or an
    event made: most events of a landing file are about the producer's temp file)."""
    events = []
    pos, end, head = 0, len(data), _HEAD.size
    unpack = _HEAD.unpack_from
    while pos < end:
        wd, mask, cookie, size = unpack(data, pos)
        pos += head
        name = data[pos:pos + size].split(b"\0", 1)[0] if size else b""
        pos += size
        if drop and drop in name and not mask & NOT_A_FILE:
            continue
        events.append(RawEvent(wd, mask, cookie, os.fsdecode(name)))
    return events


class Inotify:
    """One inotify instance; events about files whose names contain ``drop`` (bytes,
    if any) are not read out (:func:`parse`)."""

    def __init__(self, drop: bytes = b"") -> None:
        self._drop = drop
        try:
            self._ino = inotify_simple.INotify()
        except OSError as e:
            raise WatchFailed("(inotify_init)", e.errno or 0, e.strerror or str(e)) from e
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._ino.fileno(), select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)

    def add_watch(self, path: str, mask: int) -> int:
        try:
            return int(self._ino.add_watch(path, mask))
        except OSError as e:
            code = e.errno or 0
            cls = WatchLimitReached if code == errno.ENOSPC else WatchFailed
            raise cls(path, code, e.strerror or str(e)) from e

    def rm_watch(self, wd: int) -> None:
        try:
            self._ino.rm_watch(wd)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the kernel already dropped it
                raise WatchFailed(f"(wd {wd})", e.errno or 0, e.strerror or str(e)) from e

    def read(self) -> list[RawEvent]:
        """Block until events arrive (all of them are returned) or :meth:`wake` is called."""
        ready = {fd for fd, _ in self._poll.poll()}
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        if self._ino.fileno() not in ready:
            return []
        try:
            return parse(os.read(self._ino.fileno(), READ_SIZE), self._drop)
        except BlockingIOError:
            return []

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def close(self) -> None:
        self._ino.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
