"""``openat2(2)`` with ``RESOLVE_NO_SYMLINKS``: a path opened in one call, refused if
any of its components is a symlink (Linux 5.6 and later; Python has no wrapper).

``Hasher`` opens an entry's file one component at a time from the staging root with
``O_NOFOLLOW``, so that no symlink is followed on the way: for ``TASK/DIR/FILE`` four
opens and four closes, and a small file is looked at two or three times on its way to
verified (its landing, the news of its commit, of its verification). The kernel gives
the same guarantee in one call. It says less about a failure (``ELOOP`` for a symlink
anywhere), so on any error the caller walks the path as before, and the walk says
which component is in the way. (One difference: a directory on the way is searched
here, not opened, so one the watcher may search but not list is no obstacle.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Callable
from typing import Any

#: openat2's number: the same on every Linux architecture (the calls added since 5.1
#: share one table)
SYS_OPENAT2 = 437
RESOLVE_NO_SYMLINKS = 0x04
AT_FDCWD = -100


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_syscall: Callable[..., int] | None = None
#: False once the kernel said it has no openat2, or refuses it (a seccomp filter that
#: predates it), or there is no libc to ask: the walk alone from then on
_usable = sys.platform.startswith("linux")
#: one ``open_how`` per set of flags, made once: ``flags`` -> (a pointer to it, its size)
_hows: dict[int, tuple[Any, int]] = {}


def _load() -> Callable[..., int] | None:
    global _syscall, _usable
    name = ctypes.util.find_library("c")
    if name is None:
        _usable = False
        return None
    call = ctypes.CDLL(name, use_errno=True).syscall
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                     ctypes.c_size_t]
    _syscall = call
    return call


def open_no_symlinks(path: str, flags: int) -> int | None:
    """A descriptor of the absolute ``path`` opened with ``flags``, no component of it
    (the last one included) a symlink; None if it could not be opened so, whatever the
    reason (it is missing, a symlink or a file is in the way, no permission, a kernel
    without openat2): the caller then walks the path itself, which says why."""
    global _usable
    if not _usable:
        return None
    call = _syscall or _load()
    if call is None:
        return None
    how = _hows.get(flags)
    if how is None:
        made = _OpenHow(flags, 0, RESOLVE_NO_SYMLINKS)
        how = _hows[flags] = (ctypes.pointer(made), ctypes.sizeof(made))
    fd = call(SYS_OPENAT2, AT_FDCWD, os.fsencode(path), how[0], how[1])
    if fd >= 0:
        return int(fd)
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        _usable = False
    return None
