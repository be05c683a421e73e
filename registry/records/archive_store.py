"""Where archives live: the store interface, and the directory store.

An archive is one task as read from etcd at one revision (its header, entries and
journal), written whole and checked back against its checksum. Its meta records
that revision and the header's own mod revision, so the archiver can tell whether
an archive it finds was made of the header it sees now (``archive``).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import blake3

from ...kernel.errors import BatonError, NotFound
from ...kernel.v1 import baton_pb2 as pb
from .manifest import check_id
from .model import EntryRecord, TaskRecord, now

_SUFFIX = ".jsonl.gz"
_META = ".meta.json"


class ArchiveCorrupt(BatonError):
    """An archive does not match its checksum (or cannot be read back)."""


@dataclass(frozen=True)
class ArchiveInfo:
    """What the store knows of one archive."""

    task_id: str
    location: str
    digest: str
    size: int
    records: int
    #: the etcd revision everything was read at
    revision: int
    created_at: str
    #: the mod revision of the task's header as read (0: an archive made before this
    #: was recorded, always of a header marked ``archiving``)
    header_revision: int = 0


class ArchiveStore(Protocol):
    """Where archives live. Every method may block; the registry calls them in a thread."""

    def write(self, task_id: str, revision: int, records: Iterator[dict[str, Any]],
              header_revision: int = 0) -> ArchiveInfo:
        """Store the records as the task's archive, replacing any, and check it back.

        ``records`` are read from etcd while they are written (a few pages ahead): it
        must be consumed to its end, and if it raises (the reading failed), nothing of
        this write may be kept."""
        ...

    def info(self, task_id: str) -> ArchiveInfo | None:
        """The task's archive, checked against its checksum; None if there is none."""
        ...

    def read(self, task_id: str) -> Iterator[dict[str, Any]]:
        """The records of the task's archive, in the order written."""
        ...

    def list(self) -> list[ArchiveInfo]:
        """Every archive (as recorded, not re-checked)."""
        ...

    def delete(self, task_id: str) -> None:
        ...


@dataclass(frozen=True)
class Archived:
    """An archived task as read back: its header, entries (with their revisions) and
    journal records (file id, revision, record)."""

    header: TaskRecord
    entries: list[tuple[int, EntryRecord]]
    journal: list[tuple[str, int, dict[str, Any]]]


class Archives(Protocol):
    """The archiver as the rest of the registry uses it (``archive.Archiver`` is the one):
    declared here, beside the store, so that ``core.Core`` can hold it while the archiver
    itself is built on ``Core``."""

    store: ArchiveStore

    async def archive(self, task_id: str, reason: str = "", who: str = "") -> pb.Task:
        """Archive a finished task now (idempotent)."""
        ...

    async def headerless(self, task_id: str) -> TaskRecord | None:
        """The archived header of a task etcd has no header of (None: no archive)."""
        ...

    async def headerless_all(self, present: set[str]) -> list[TaskRecord]:
        """The archived tasks whose headers are not in etcd (``present``)."""
        ...

    async def load(self, task_id: str) -> Archived:
        """An archived task, read back from the store."""
        ...


class DirectoryStore:
    """``ROOT/{task}.jsonl.gz`` and ``ROOT/{task}.meta.json`` (its BLAKE3 digest, size,
    record count, etcd revision and header revision). Each file is written to a
    temporary name, synced and renamed; the meta file goes last, so an archive without
    one is incomplete and is written again."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _paths(self, task_id: str) -> tuple[Path, Path]:
        check_id("task_id", task_id)
        return self.root / f"{task_id}{_SUFFIX}", self.root / f"{task_id}{_META}"

    def write(self, task_id: str, revision: int, records: Iterator[dict[str, Any]],
              header_revision: int = 0) -> ArchiveInfo:
        self.root.mkdir(parents=True, exist_ok=True)
        data, meta = self._paths(task_id)
        with contextlib.suppress(FileNotFoundError):
            meta.unlink()  # from here on the old archive (if any) is incomplete
        tmp = _temporary(data)
        count = 0
        try:
            with open(tmp, "wb") as raw:
                # No name or time in the gzip header: the same records make the same
                # bytes, whichever temporary name they were written under.
                with gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as out:
                    for record in records:
                        out.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
                        count += 1
                raw.flush()
                os.fsync(raw.fileno())
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # half an archive: nothing of it is kept
            raise
        os.replace(tmp, data)
        digest, size = _digest(data)
        info = ArchiveInfo(task_id, str(data), digest, size, count, revision, now(),
                           header_revision)
        _write_synced(meta, json.dumps(asdict(info)).encode())
        _sync_dir(self.root)
        checked = self.info(task_id)
        if checked is None or checked.records != count:
            raise ArchiveCorrupt(f"archive of task {task_id!r} did not read back whole")
        return checked

    def info(self, task_id: str) -> ArchiveInfo | None:
        data, meta = self._paths(task_id)
        try:
            info = ArchiveInfo(**json.loads(meta.read_bytes()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as e:
            raise ArchiveCorrupt(f"archive of task {task_id!r}: unreadable {meta}: {e}") from e
        try:
            digest, size = _digest(data)
        except FileNotFoundError:
            raise ArchiveCorrupt(f"archive of task {task_id!r}: {data} is missing") from None
        if (digest, size) != (info.digest, info.size):
            raise ArchiveCorrupt(f"archive of task {task_id!r}: {data} does not match its "
                                 f"checksum (BLAKE3 {digest[:16]}…, recorded "
                                 f"{info.digest[:16]}…)", task_id=task_id)
        return info

    def read(self, task_id: str) -> Iterator[dict[str, Any]]:
        data, _ = self._paths(task_id)
        try:
            with gzip.open(data, "rb") as f:
                for line in f:
                    yield json.loads(line)
        except FileNotFoundError:
            raise NotFound(f"task {task_id!r} has no archive", task_id=task_id) from None
        except (OSError, ValueError, EOFError) as e:
            raise ArchiveCorrupt(f"archive of task {task_id!r} cannot be read: {e}",
                                 task_id=task_id) from e

    def list(self) -> list[ArchiveInfo]:
        out = []
        for meta in sorted(self.root.glob(f"*{_META}")):
            with contextlib.suppress(OSError, ValueError, TypeError):
                out.append(ArchiveInfo(**json.loads(meta.read_bytes())))
        return out

    def delete(self, task_id: str) -> None:
        data, meta = self._paths(task_id)
        for path in (meta, data):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _digest(path: Path) -> tuple[str, int]:
    h = blake3.blake3()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _temporary(path: Path) -> Path:
    """A name to write ``path`` under before it is renamed into place: one no other
    writer uses, in this process (two archives of a task at once) or on another host
    sharing the directory (the same process id)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")


def _write_synced(path: Path, data: bytes) -> None:
    tmp = _temporary(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


