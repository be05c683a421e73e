"""Hashing a staged file safely: no symlinks, regular files only, stable while read.

Every path is opened one component at a time from the staging root with
``O_NOFOLLOW``, so neither the file nor any directory between the root and it
may be a symlink, and the bytes hashed are the ones behind the descriptor that
was checked. Where the kernel has ``openat2``, a path is first opened in one call
that refuses a symlink anywhere on it (``_openat2.py``); on any error the walk is
made as before, and says why. Sizes, times and the inode are compared before and
after: a file that changed while it was read raises :class:`FileChanged` and is
hashed again later.

Small files are read and hashed on the calling thread. Large files are memory
mapped and hashed on blake3's AUTO threads: about twice the speed of chunked
reads, which gain nothing from threads because copying the bytes is what costs
(bench/hash_threshold.py, docs/watcher.md). A mapping turns a concurrent
truncation into SIGBUS, which would kill the daemon, so the mapping is made in
a helper process that is sent the descriptor opened and checked here
(``update_mmap`` would also reopen the file by path, following symlinks).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import blake3

from ..kernel.contract import attempt_path, parse_attempt, parse_temp
from ._openat2 import open_no_symlinks
from .config import LARGE_FILE
from .errors import FileChanged, FileMissing, HashFailed, Refused

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
#: a descriptor that only says which file it is (``fstat``), the file not opened for
#: reading (None where there is no ``O_PATH``)
_PATH_FLAGS = (os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC) if hasattr(os, "O_PATH") else None

SMALL_CHUNK = 1 << 20
#: files below this many bytes are hashed wherever they are looked at, and their
#: digests are not remembered: reading and hashing 64 KiB costs about two lookups in
#: the state file, and a new file (every file of a hand-off) is never in it anyway
#: (docs/watcher.md, "Small files")
SMALL_FILE = 64 << 10


@dataclass(frozen=True, slots=True)
class Identity:
    """Which file, and which version of it: equal identities mean unchanged bytes."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    #: names the file has (``st_nlink``); more than one: see ``links.py``. Not part
    #: of the identity: adding or removing a name changes ctime anyway.
    links: int = field(default=1, compare=False)

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                   st.st_nlink)


@dataclass(frozen=True, slots=True)
class Hashed:
    """The BLAKE3 digest of a file whose identity did not change while it was read."""

    identity: Identity
    digest: str
    #: when reading it began (epoch nanoseconds; 0: not kept), for its trace's span
    started_ns: int = 0


def split_path(task_id: str, rel: str) -> list[str]:
    """The components from the staging root to an entry's file; refuses escapes."""
    parts = [task_id, *rel.split("/")]
    if rel.startswith("/") or "" in parts or "." in parts or ".." in parts:
        raise Refused(f"{task_id}/{rel}", "path escapes the task directory")
    return parts


def _translate(path: str, e: OSError) -> HashFailed:
    if e.errno == errno.ENOENT:
        return FileMissing(path, "no such file")
    if e.errno == errno.ELOOP:
        return Refused(path, "a symlink is on the path (refused)")
    if e.errno == errno.ENOTDIR:
        return Refused(path, "a non-directory is on the path")
    return HashFailed(path, e.strerror or str(e))


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


class HelperDied(Exception):
    """The mapping helper died mid-hash: SIGBUS from a file truncated while mapped."""


class _Helper:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        script = os.path.join(os.path.dirname(__file__), "_mapped_child.py")
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, script, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
            )
        self.sock = ours

    def close(self) -> None:
        self.sock.close()  # the helper exits when its socket closes
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class MappedHasher:
    """Hashes descriptors by mapping them in helper processes (one per calling thread)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._helpers: list[_Helper] = []

    def digest(self, fd: int) -> tuple[str, int]:
        """(BLAKE3 hex digest, bytes hashed) of the file behind ``fd``."""
        helper: _Helper | None = getattr(self._local, "helper", None)
        if helper is None:
            helper = _Helper()
            self._local.helper = helper
            with self._lock:
                self._helpers.append(helper)
        try:
            socket.send_fds(helper.sock, [b"h"], [fd])
            reply = helper.sock.recv(256).decode()
        except OSError:
            reply = ""
        if not reply:
            self._local.helper = None
            with self._lock:
                self._helpers.remove(helper)
            helper.close()
            raise HelperDied(f"hash helper died (status {helper.process.returncode})")
        status, _, rest = reply.partition(" ")
        if status != "ok":
            raise OSError(rest)
        digest, size = rest.split()
        return digest, int(size)

    def close(self) -> None:
        with self._lock:
            helpers, self._helpers = self._helpers, []
        for helper in helpers:
            helper.close()


class Hasher:
    """Hashes entries' files below one staging root (thread-safe)."""

    def __init__(self, root: str, large_file: int = LARGE_FILE, *,
                 small_chunk: int = SMALL_CHUNK, small_file: int = SMALL_FILE) -> None:
        self.root = os.path.realpath(root)
        self.large_file = large_file
        #: files below this many bytes are hashed by :meth:`look` (never remembered)
        self.small_file = small_file
        self.small_chunk = small_chunk
        self._buffers = threading.local()
        self._mapped = MappedHasher()

    def close(self) -> None:
        """End the mapping helpers (they are started again when needed)."""
        self._mapped.close()

    def _parent(self, parts: Sequence[str], shown: str) -> int:
        """A descriptor of the directory holding the file, reached without symlinks."""
        fd = open_no_symlinks(self._path(parts[:-1]), _DIR_FLAGS)
        if fd is not None:
            return fd
        # one component at a time, which says which one is in the way, if one is
        try:
            fd = os.open(self.root, _DIR_FLAGS)
        except OSError as e:
            raise _translate(self.root, e) from e
        try:
            for name in parts[:-1]:
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(name, fd):
                        raise Refused(shown, f"{name!r} on the path is a symlink (refused)") from e
                    raise _translate(shown, e) from e
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _path(self, parts: Sequence[str]) -> str:
        """The absolute path of ``parts`` (from :func:`split_path`: no escapes)."""
        return "/".join((self.root, *parts))

    def stat(self, task_id: str, rel: str) -> Identity | None:
        """The file's identity, or None if it does not exist (cheap: no bytes read)."""
        parts = split_path(task_id, rel)
        shown = "/".join(parts)
        try:
            parent = self._parent(parts, shown)
        except FileMissing:
            return None
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _translate(shown, e) from e
        finally:
            os.close(parent)
        if stat.S_ISLNK(st.st_mode):
            raise Refused(shown, "is a symlink (refused)")
        if not stat.S_ISREG(st.st_mode):
            raise Refused(shown, "not a regular file")
        return Identity.of(st)

    def look(self, task_id: str, rel: str, *,
             known: Identity | None = None) -> Identity | Hashed | None:
        """The file hashed if it is small (below ``small_file``: reading it costs about
        what remembering its digest would) and its identity is not ``known`` (the
        caller knows the digest of those bytes), else only its identity (no bytes
        read); None if it does not exist. One walk from the root, one descriptor:
        what is hashed is the file whose identity was taken."""
        parts = split_path(task_id, rel)
        if known is not None and _PATH_FLAGS is not None:
            # Most often the news that follows a report (its commit, its verification):
            # the file reported, unchanged. Its identity from a descriptor that reads
            # nothing, opened in one call; anything else is looked at as below.
            fd = open_no_symlinks(self._path(parts), _PATH_FLAGS)
            if fd is not None:
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                identity = Identity.of(st)
                if stat.S_ISREG(st.st_mode) and (
                        st.st_size >= self.small_file or identity == known):
                    return identity
        shown = "/".join(parts)
        try:
            parent = self._parent(parts, shown)
        except FileMissing:
            return None
        try:
            try:
                fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                return None
            except OSError as e:
                raise _translate(shown, e) from e
            try:
                before = os.fstat(fd)
                if stat.S_ISREG(before.st_mode) and (
                        before.st_size >= self.small_file
                        or (known is not None and Identity.of(before) == known)):
                    return Identity.of(before)
                return self._hash_fd(fd, parent, parts[-1], shown, before)
            finally:
                os.close(fd)
        finally:
            os.close(parent)

    def hash(self, task_id: str, rel: str) -> Hashed:
        """Hash the entry's file; raises a :class:`HashFailed` subclass when it cannot."""
        parts = split_path(task_id, rel)
        shown = "/".join(parts)
        parent = self._parent(parts, shown)
        try:
            return self._hash_in(parent, parts[-1], shown)
        finally:
            os.close(parent)

    def _hash_in(self, parent: int, name: str, shown: str) -> Hashed:
        """Hash ``name``, opened from the directory descriptor ``parent``."""
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
        except OSError as e:
            raise _translate(shown, e) from e
        try:
            return self._hash_fd(fd, parent, name, shown)
        finally:
            os.close(fd)

    def newest_attempt(self, task_id: str, rel: str) -> tuple[str, int] | None:
        """The file of the newest attempt of the entry at ``rel`` (the entry's path)
        that is on disk, relative to the task's directory, and its token; None if
        none is (a listing of its directory: for when its events were missed)."""
        parts = split_path(task_id, rel)
        try:
            parent = self._parent(parts, "/".join(parts))
        except HashFailed:
            return None
        try:
            names = os.listdir(parent)
        except OSError:
            return None
        finally:
            os.close(parent)
        tokens = [a[1] for n in names
                  if (a := parse_attempt(n)) is not None and a[0] == parts[-1]]
        if not tokens:
            return None
        return attempt_path(rel, max(tokens)), max(tokens)

    def attempts(self, task_id: str, rel_dir: str) -> dict[str, tuple[str, int]]:
        """The newest attempt's file of each entry directly in ``rel_dir`` ("": the
        task's directory) that has one on disk, by the entry's path: (the file,
        relative to the task's directory, and its token). One listing for them all."""
        # the directory's components, and a name in it (``_parent`` opens all but it)
        parts = split_path(task_id, f"{rel_dir}/-" if rel_dir else "-")
        try:
            parent = self._parent(parts, "/".join(parts[:-1]))
        except HashFailed:
            return {}
        try:
            names = os.listdir(parent)
        except OSError:
            return {}
        finally:
            os.close(parent)
        prefix = f"{rel_dir}/" if rel_dir else ""
        newest: dict[str, tuple[str, int]] = {}
        for name in names:
            if (a := parse_attempt(name)) is not None:
                path = prefix + a[0]
                if path not in newest or a[1] > newest[path][1]:
                    newest[path] = (prefix + name, a[1])
        return newest

    def remove_dead_attempts(self, task_id: str, rel: str, token: int) -> int:
        """Unlink the files of the attempts before ``token`` of the entry at ``rel``
        (the entry's path): regular files beside it, named for it with an older
        token (``kernel.contract.attempt_path``), and the partial files such attempts
        kept to be resumed (temp files, ``kernel.contract.parse_temp``); how many.
        Nothing is hashed: no such file is ever an entry's bytes."""
        parts = split_path(task_id, rel)
        try:
            parent = self._parent(parts, "/".join(parts))
        except FileMissing:
            return 0
        removed = 0
        try:
            for name in os.listdir(parent):
                attempt = parse_temp(name) or parse_attempt(name)
                if attempt is None or attempt[0] != parts[-1] or attempt[1] >= token:
                    continue
                with contextlib.suppress(OSError):
                    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        os.unlink(name, dir_fd=parent)
                        removed += 1
        finally:
            os.close(parent)
        return removed

    def removable(self, task_id: str, rel: str) -> bool:
        """Whether this process may unlink the entry's file: write and search on the
        directory holding it, as the kernel decides for its effective identity and
        capabilities (asked before a removal is recorded, so that none is recorded
        that cannot be made)."""
        parts = split_path(task_id, rel)
        parent = self._parent(parts, "/".join(parts))
        try:
            return os.access(".", os.W_OK | os.X_OK, dir_fd=parent, effective_ids=True)
        finally:
            os.close(parent)

    def remove(self, task_id: str, rel: str, digest: str) -> int:
        """Unlink the entry's file if it is a regular file, reached without a symlink,
        whose bytes hash to ``digest``; the bytes removed. Raises :class:`FileMissing`,
        :class:`Refused` (a link, not a regular file: left alone) or
        :class:`FileChanged` (other bytes: kept, ``digest`` says which).

        The file is hashed through a descriptor opened from its parent's, and unlinked
        from that same parent only if the name still names the inode hashed: a rename
        over it in between is seen, and the new file is kept.
        """
        parts = split_path(task_id, rel)
        shown = "/".join(parts)
        parent = self._parent(parts, shown)
        try:
            hashed = self._hash_in(parent, parts[-1], shown)
            if hashed.digest != digest:
                raise FileChanged(shown, "differs from the verified digest", hashed.digest)
            try:
                now = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISREG(now.st_mode) or Identity.of(now) != hashed.identity:
                    raise FileChanged(shown, "replaced before its removal", "")
                os.unlink(parts[-1], dir_fd=parent)
            except OSError as e:
                raise _translate(shown, e) from e
            return hashed.identity.size
        finally:
            os.close(parent)

    def _hash_fd(self, fd: int, parent: int, name: str, shown: str,
                 before: os.stat_result | None = None) -> Hashed:
        if before is None:
            before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise Refused(shown, "not a regular file")
        try:
            if before.st_size >= self.large_file:
                digest, total = self._mapped.digest(fd)
            else:
                digest, total = self._read(fd)
            after = os.fstat(fd)
            now = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except HelperDied as e:
            raise FileChanged(shown, f"truncated while hashed ({e})", "") from e
        except FileNotFoundError as e:
            raise FileChanged(shown, "removed while hashed", "") from e
        except OSError as e:
            raise HashFailed(shown, f"read failed: {e.strerror or e}") from e
        identity = Identity.of(before)
        if Identity.of(after) != identity or total != before.st_size:
            raise FileChanged(shown, "changed while hashed", digest)
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise FileChanged(shown, "replaced while hashed", digest)
        return Hashed(identity, digest)

    def _read(self, fd: int) -> tuple[str, int]:
        hasher = blake3.blake3()
        view = self._buffer(self.small_chunk)
        total = 0
        while n := os.readv(fd, [view]):
            hasher.update(view[:n])
            total += n
        return hasher.hexdigest(), total

    def _buffer(self, size: int) -> memoryview:
        """A per-thread reusable read buffer of ``size`` bytes."""
        views: dict[int, memoryview] = self._buffers.__dict__.setdefault("views", {})
        if size not in views:
            views[size] = memoryview(bytearray(size))
        return views[size]
