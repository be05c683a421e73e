"""Which filesystem a path is on, from ``statfs(2)`` (``os.statvfs`` has no f_type).

inotify only sees changes made through the local kernel: on NFS, CIFS/SMB or
FUSE mounts, writes by other hosts (or by the FUSE daemon) raise no events.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: f_type magic numbers (linux/magic.h) of filesystems inotify cannot fully see
REMOTE_MAGIC = {
    0x6969: "NFS",
    0x517B: "SMB",
    0xFF534D42: "CIFS",
    0xFE534D42: "SMB2",
    0x65735546: "FUSE",
}

_libc: ctypes.CDLL | None = None


def fs_type(path: str) -> int | None:
    """The f_type of the filesystem holding ``path``; None if statfs is unavailable."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        _libc = ctypes.CDLL(name, use_errno=True)
    # struct statfs starts with f_type (a native long on Linux); 256 bytes is larger
    # than the whole struct on every architecture.
    buf = ctypes.create_string_buffer(256)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def blind_spot(path: str) -> str | None:
    """Why inotify cannot be trusted for ``path`` (e.g. "on an NFS mount"), else None."""
    try:
        magic = fs_type(path)
    except OSError:
        return None
    if magic is None:
        return None
    name = REMOTE_MAGIC.get(magic)
    return f"on a {name} mount (f_type {magic:#x})" if name else None
