"""The file work of producing a file, both surfaces': the staging tree reached safely,
the temp file, resume points, fsync and the rename into the claim's path. Nothing here
calls the registry; ``producer`` (blocking) and ``aproducer`` (asyncio) wrap it with
their claims, checkpoints, commits and fails.

The staging tree is shared, so nothing under a task's directory is trusted: the
entry's directory is reached one component at a time from the staging root with
``O_NOFOLLOW`` (the task's directory as the last component of the root's path; a
symlink on the way is refused, never followed, and a missing directory is created
where it was looked for), and every later step names files relative to that
directory's descriptor. The temp file gets a name nobody can guess and is created
with ``O_EXCL``, so a file or symlink planted in advance, or one left by a crashed
attempt, is never written through or reused.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Self, TypeVar

import blake3

from ..kernel import tracing
from ..kernel.contract import TEMP_MARKER, parse_attempt, parse_temp
from ..kernel.errors import BatonError, InvalidArgument
from ..kernel.v1 import baton_pb2 as pb
from ._wire import Attributes, Claim

#: random bytes in a temp file's name (hex-encoded): 64 bits nobody can guess
NONCE_BYTES = 8

#: longest file name most file systems take, in bytes (NAME_MAX)
NAME_MAX = 255

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: the staging root is the operator's: it may be a symlink, followed
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# The umask decides the published file's mode, as it does for `cp` and for what this
# helper wrote before: the watcher and the consumers may run as other users, and
# which of them may read is the operator's choice (umask, the staging dir's ACLs).
# The temp file needs no tighter mode than the file it becomes: what protects it is
# O_EXCL on a name nobody can guess, so nothing planted in advance is written through.
_FILE_MODE = 0o666
_DIR_MODE = 0o777

#: builds the error for a path that cannot be used safely, from the reason
Refusal = Callable[[str], BatonError]


def new_nonce() -> str:
    """The random part of a temp file's name (``secrets.token_hex``, without its two
    calls on the way to ``os.urandom``: every file takes one)."""
    return os.urandom(NONCE_BYTES).hex()


def temp_name(name: str, token: int, nonce: str | None = None) -> str:
    """The name the bytes of ``name`` are written under before the rename publishes them.

    ``.NAME.baton-tmp-TOKEN-NONCE``: hidden, marked for the watcher, naming the
    attempt, and unpredictable. A name too long for the file system loses the end
    of its ``NAME`` part, never the marker or the nonce.
    """
    tail = f"{TEMP_MARKER}{token}-{nonce if nonce is not None else new_nonce()}"
    room = max(NAME_MAX - 1 - len(tail.encode()), 0)
    encoded = name.encode()
    head = name if len(encoded) <= room else encoded[:room].decode(errors="ignore")
    return f".{head}{tail}"


def temp_path(final: Path, token: int, nonce: str | None = None) -> Path:
    """Where the bytes of ``final`` are written before the rename publishes them."""
    return final.with_name(temp_name(final.name, token, nonce))


def entry_parts(task_id: str, path: str, rel: str, refused: Refusal) -> tuple[str, list[str]]:
    """The staging root of an entry's absolute ``path`` and the components below it,
    the task's directory first (``path`` is ``ROOT/TASK/REL``, as the registry joins it)."""
    parts = [task_id, *rel.split("/")]
    suffix = "/" + "/".join(parts)
    if (not rel or "" in parts or "." in parts or ".." in parts
            or not path.endswith(suffix)):
        raise refused(f"not an entry path of task {task_id!r} below a staging root "
                      f"(entry path {rel!r})")
    return path[: -len(suffix)] or "/", parts


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_dir(parts: list[str], depth: int, dir_fd: int, refused: Refusal) -> int:
    """The directory ``parts[depth - 1]`` in ``dir_fd``, not followed if a symlink."""
    name = parts[depth - 1]
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            # where it is, for the error only: not joined on the path every file takes
            where = "/".join(parts[:depth])
            if _is_link(name, dir_fd):
                raise refused(f"{where} is a symlink (refused, not followed)") from e
            raise refused(f"{where} is not a directory") from e
        raise


def _open_root(root: str, create: bool) -> int:
    """A descriptor of the staging root; with ``create``, made if it cannot be opened."""
    try:
        return os.open(root, _ROOT_FLAGS)
    except OSError:
        if not create:
            raise
    # Made (as ``mkdir -p`` would) only when it cannot be opened: for every file after
    # the first it exists, and making it first would cost a failed mkdir and two stats
    # per file. One that cannot be made raises as it did.
    os.makedirs(root, exist_ok=True)
    return os.open(root, _ROOT_FLAGS)


def open_entry_dir(task_id: str, path: str, rel: str, refused: Refusal, *,
                   create: bool = False) -> tuple[int, str]:
    """A descriptor of the directory that holds an entry's file, and the file's name
    in it, reached from the staging root without following a symlink.

    The staging root itself is the operator's and may be a symlink. With ``create``,
    missing directories are made (the root too, as ``mkdir -p`` would). The caller
    closes the descriptor.
    """
    root, parts = entry_parts(task_id, path, rel, refused)
    try:
        # The root and the task's directory in one call: the root's path is followed
        # as it is below, and O_NOFOLLOW holds for its last component, the task's
        # directory. Whatever fails takes the way below, one component at a time,
        # which makes what is missing or says what is wrong.
        fd, below = os.open(f"{root}/{parts[0]}", _DIR_FLAGS), 2
    except OSError:
        fd, below = _open_root(root, create), 1
    try:
        for depth in range(below, len(parts)):
            try:
                child = _open_dir(parts, depth, fd, refused)
            except FileNotFoundError:
                if not create:
                    raise
                with suppress(FileExistsError):  # made by another producer meanwhile
                    os.mkdir(parts[depth - 1], _DIR_MODE, dir_fd=fd)
                    os.fsync(fd)  # the new directory's name is durable before files in it
                child = _open_dir(parts, depth, fd, refused)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def refuse_link(name: str, dir_fd: int, where: str, refused: Refusal) -> None:
    """Refuse a symlink at ``name``: the path is not ours to publish to."""
    if _is_link(name, dir_fd):
        raise refused(f"{where} is a symlink (refused, not replaced)")


@dataclass
class OutputFile:
    """The open temp file of a claim, what both surfaces' outputs share: size and
    digest follow along as bytes go in, and where the next resume point falls
    (``produce(..., resumable=True)``). ``Output`` (blocking) and
    ``aproducer.AsyncOutput`` (asyncio) add the writes and the checkpoints."""

    claim: Claim
    file: BinaryIO
    size: int = 0
    #: the committed entry, once the ``produce`` block has ended
    entry: pb.Entry | None = None
    #: committed with the file, for the task's routing rules; the block may set them
    #: once it knows (a report's verdict, say)
    attributes: Attributes = None
    _hash: blake3.blake3 = field(default_factory=blake3.blake3)
    #: a resumable write (``produce(..., resumable=True)``): the temp file's name, the
    #: bytes between two resume points (0: not resumable), the size expected (for the
    #: progress shown), and how far the last resume point got
    _temp: str = ""
    _resume_every: int = 0
    _expected: int = 0
    _saved: int = -1
    #: the attempt's span (traces on; "" = untraced): checkpoints are its children
    _trace: str = ""
    #: ``close()`` was called: the bytes are complete
    _closed: bool = False
    #: an earlier attempt's partial file was adopted: a resume point is due at once,
    #: naming the file's new name for an attempt after this one
    _adopted: bool = False

    def _fill(self, data: bytes | bytearray | memoryview) -> Iterator[None]:
        """Append ``data``, yielding each time a resume point is due: each time
        ``resume_every`` bytes have gone in since the last one, in the middle of the
        data if need be (so a large write does not stretch the work a kill loses)."""
        if self.closed:
            raise ValueError(f"write to a closed output ({self.claim.task_id}/"
                             f"{self.claim.file_id})")
        view = memoryview(data).cast("B")
        every = self._resume_every
        while every and len(view) >= (room := every - (self.size - max(self._saved, 0))):
            self._append(view[:room])
            yield
            view = view[room:]
        if view:
            self._append(view)

    def _append(self, data: memoryview) -> None:
        self._hash.update(data)
        self.size += len(data)
        self.file.write(data)

    def _point(self) -> tuple[bytes, float, str]:
        """Make what was written so far durable; the resume point's checkpoint (its
        data, the progress over the expected size, its message)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        point = ResumePoint(self._temp, self.size, self._hash.hexdigest())
        progress = min(self.size / self._expected, 1.0) if self._expected else 0.0
        return point.dump(), progress, f"{self.size} bytes written and on disk"

    def close(self) -> None:
        """The bytes are complete: later writes raise ``ValueError``, and leaving a
        ``produce_each`` loop (``break``, ``return``, an exception) commits this
        output rather than failing it. The file is made durable, renamed and committed
        as usual, when the block or the loop's step ends."""
        if not self.file.closed:
            self.file.flush()
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether the bytes are complete (``close()``, or ``file`` closed)."""
        return self._closed or self.file.closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:  # an error in the block leaves it open: it may be partial
            self.close()

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()


def _unusable(claim: Claim) -> Refusal:
    def refused(reason: str) -> BatonError:
        return InvalidArgument(f"cannot publish {claim.path}: {reason}", task_id=claim.task_id,
                               file_id=claim.file_id, path=claim.path)
    return refused


#: the most bytes a resumable write puts on disk between two resume points
RESUME_EVERY = 8 << 20
#: ... and the most, as a fraction of the expected size when it is known (the smaller
#: of the two holds), but never fewer bytes apart than ``RESUME_MIN``: a small file
#: is quick to write again, and each point costs an fsync and a call to the registry
RESUME_FRACTION = 0.05
RESUME_MIN = 1 << 20


def resume_interval(every: int, fraction: float, expected: int) -> int:
    """Bytes between two resume points of a resumable write: ``every``, or ``fraction``
    of the ``expected`` size (0: unknown) when that is smaller, not under
    ``RESUME_MIN`` unless ``every`` is. The work a killed attempt loses is at most
    this many bytes."""
    if expected > 0 and fraction > 0:
        return min(every, max(int(expected * fraction), RESUME_MIN))
    return every
#: what a resume point's checkpoint data says it is
_RESUME_FORMAT = "baton-resume/1"


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumable write got: its temp file (a name in the entry's directory),
    the length on disk, and the BLAKE3 of those bytes. Kept as a checkpoint's data."""

    temp: str
    length: int
    digest: str

    def dump(self) -> bytes:
        return json.dumps({"format": _RESUME_FORMAT, "temp": self.temp,
                           "length": self.length, "blake3": self.digest}).encode()

    def before(self, name: str, token: int) -> bool:
        """Whether the temp file is an earlier attempt's at the entry whose file (this
        attempt's, ``name``) the claim with ``token`` writes: a resume point naming a
        file of another entry, or of this or a later attempt, is not followed."""
        temp, mine = parse_temp(self.temp), parse_attempt(name)
        entry = mine[0] if mine is not None else name
        return temp is not None and temp[0] == entry and temp[1] < token

    @classmethod
    def of(cls, checkpoint: pb.Checkpoint | None) -> ResumePoint | None:
        """The resume point an earlier attempt's checkpoint holds, if it holds one that
        names a temp file of Baton's in the entry's own directory."""
        if checkpoint is None or not checkpoint.data:
            return None
        try:
            d = json.loads(checkpoint.data)
            point = cls(str(d["temp"]), int(d["length"]), str(d["blake3"]))
        except (ValueError, KeyError, TypeError):
            return None
        if (d.get("format") != _RESUME_FORMAT or point.length < 0
                or "/" in point.temp or not point.temp.startswith(".")
                or TEMP_MARKER not in point.temp):
            return None
        return point


def _remove_partial(parent: int, temp: str) -> None:
    """Unlink an earlier attempt's partial file, if it is a regular file."""
    with suppress(OSError):
        if stat.S_ISREG(os.stat(temp, dir_fd=parent, follow_symlinks=False).st_mode):
            os.unlink(temp, dir_fd=parent)


def _adopt(parent: int, point: ResumePoint | None, attempt: str
           ) -> tuple[int, blake3.blake3, int] | None:
    """Take over an earlier attempt's partial file, if its first ``point.length`` bytes
    are still those the point recorded: renamed to this attempt's temp name, cut to
    that length, and open for writing after it (the descriptor, the hash of what is
    there, its length). None to start over; a partial that no longer matches is
    removed (nobody can resume from it).

    The earlier attempt's claim is over (this one holds the entry), so its token is
    dead: whatever that process still writes into the file changes the bytes this
    attempt commits, and the watcher's digest then refuses them."""
    if point is None or point.temp == attempt:
        return None
    try:
        fd = os.open(point.temp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return None  # gone, or not a regular file we may open
    try:
        st = os.fstat(fd)
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size >= point.length:
            done = 0
            while done < point.length:
                chunk = os.pread(fd, min(8 << 20, point.length - done), done)
                if not chunk:
                    break
                hasher.update(chunk)
                done += len(chunk)
            if done == point.length and hasher.hexdigest() == point.digest:
                os.ftruncate(fd, point.length)
                os.lseek(fd, point.length, os.SEEK_SET)
                os.rename(point.temp, attempt, src_dir_fd=parent, dst_dir_fd=parent)
                return fd, hasher, point.length
        if stat.S_ISREG(st.st_mode):
            _remove_partial(parent, point.temp)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


@dataclass(frozen=True)
class Resume:
    """A write's resume points: at most ``every`` bytes apart (0: not resumable), or
    ``fraction`` of the ``expected`` size (0: the entry's, if it has one)."""

    every: int = 0
    fraction: float = RESUME_FRACTION
    expected: int = 0

    @classmethod
    def of(cls, resumable: bool, every: int, fraction: float, expected: int) -> Resume:
        """``produce``'s arguments, checked."""
        if resumable and every < 1:
            raise InvalidArgument(f"resume_every must be at least 1 byte, not {every}")
        if not 0 <= fraction <= 1:
            raise InvalidArgument(f"resume_fraction must be within 0..1, not {fraction}")
        return cls(every if resumable else 0, fraction, expected)


OutT = TypeVar("OutT", bound=OutputFile)


@contextmanager
def staged(claim: Claim, nonce: Callable[[], str], attributes: Attributes,
           resume: Resume, trace: str, output: Callable[..., OutT],
           check: Callable[[], None]) -> Iterator[OutT]:
    """The file work of a claim's write, both surfaces': yield the output ``output``
    makes (of ``OutputFile``'s fields) on a new temp file, or on an earlier attempt's
    partial file it adopts (``resume``: where resume points go; the output's
    ``_adopted`` says a point is due); once the block ends, make it durable, ``check``
    the session still holds, and rename it into the claim's path, all reached from
    the staging root without following a symlink. A block that raises removes the
    temp file (unless a resume point keeps it for the next attempt) and the error
    propagates: failing the entry is the caller's. ``trace``: the attempt's span
    ("" = untraced), the parent of the write's."""
    if not trace:  # no span to wrap the write in: one context less on every file's way
        with _staged(claim, nonce, attributes, resume, trace, output, check) as out:
            yield out
        return
    with tracing.child(trace, "baton.write") as span:
        with _staged(claim, nonce, attributes, resume, trace, output, check) as out:
            yield out
        tracing.annotate(span, **{"baton.size": out.size, "baton.resumed_at": out._saved
                                  if out._saved > 0 and out._resume_every else None})


@contextmanager
def _staged(claim: Claim, nonce: Callable[[], str], attributes: Attributes,
            resume: Resume, trace: str, output: Callable[..., OutT],
            check: Callable[[], None]) -> Iterator[OutT]:
    refused = _unusable(claim)
    parent: int | None = None
    tmp = ""  # set once the temp file is ours to remove
    out: OutT | None = None
    expected = resume.expected or claim.entry.expected_size
    every = resume_interval(resume.every, resume.fraction, expected) if resume.every else 0
    try:
        parent, name = open_entry_dir(claim.task_id, claim.path, claim.entry.attempt_path,
                                      refused, create=True)
        refuse_link(name, parent, "the final name", refused)
        attempt = temp_name(name, claim.token, nonce())
        point = ResumePoint.of(claim.checkpoint)
        if point is not None and not point.before(name, claim.token):
            point = None
        adopted = None
        if every:
            adopted = _adopt(parent, point, attempt)
        elif point is not None:  # a partial no attempt will resume from: not kept
            _remove_partial(parent, point.temp)
        if adopted is None:
            fd, hasher, length = os.open(attempt, _TEMP_FLAGS, _FILE_MODE, dir_fd=parent), \
                blake3.blake3(), 0
        else:
            fd, hasher, length = adopted
        tmp = attempt
        with open(fd, "wb") as f:  # what os.fdopen opens, without its checks of its arguments
            out = output(claim=claim, file=f, size=length, attributes=attributes,
                         _hash=hasher, _temp=attempt, _resume_every=every,
                         _expected=expected, _saved=length if adopted else -1,
                         _trace=trace, _adopted=adopted is not None)
            yield out
            if f.closed:  # closed by the block: its bytes reached the file, not the disk
                _fsync_file(attempt, parent)
            else:
                f.flush()
                os.fsync(f.fileno())
        check()
        # rename() replaces a symlink, never writes through it; one planted while we
        # wrote is refused all the same, not silently replaced.
        refuse_link(name, parent, "the final name", refused)
        os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        tmp = ""
        os.fsync(parent)
    except BaseException:
        # A resumable write keeps what a resume point recorded, for the next attempt.
        kept = out is not None and out._resume_every and out._saved >= 0
        if tmp and parent is not None and not kept:
            with suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=parent)
        raise
    finally:
        if parent is not None:
            os.close(parent)


def _fsync_file(name: str, parent: int) -> None:
    """Make the file ``name`` (in the directory ``parent``) durable by a descriptor
    of its own: the block closed the one it was written through."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def failure(e: BaseException, out: OutputFile | None) -> str:
    """Why an attempt failed, as the journal says it."""
    if isinstance(e, GeneratorExit):  # the code that held the output let it go
        written = out.size if out is not None else 0
        return (f"left with its output not closed ({written} bytes written): a break, "
                "return or exception in the producing loop's body; close() an output "
                "whose bytes are complete to have it committed")
    return f"{type(e).__name__}: {e}"
