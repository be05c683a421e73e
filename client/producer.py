"""Producing a file safely: claim, write a temp file, fsync, rename, fsync the dir, commit."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import blake3

from ._client import Claim, Client, Session
from .v1 import baton_pb2 as pb

#: temp files carry this marker; the watcher ignores them
TEMP_MARKER = ".baton-tmp-"


def temp_path(final: Path, token: int) -> Path:
    """Where the bytes of ``final`` are written before the rename publishes them."""
    return final.with_name(f".{final.name}{TEMP_MARKER}{token}")


@dataclass
class Output:
    """The open temp file of a claim: write to it; size and digest follow along."""

    claim: Claim
    file: BinaryIO
    size: int = 0
    #: the committed entry, once the ``produce`` block has ended
    entry: pb.Entry | None = None
    _hash: blake3.blake3 = field(default_factory=blake3.blake3)

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        self.size += len(data)
        return self.file.write(data)

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def produce(
    client: Client, session: Session | int, task_id: str, file_id: str = ""
) -> Iterator[Output]:
    """Claim an entry and yield its output; publish and commit when the block ends.

    If the block raises, the temp file is removed and the entry failed (it goes
    back to ``pending`` or to ``dead``), and the exception propagates. The file
    becomes visible under its final name only complete and on disk.
    """
    claim = client.claim(task_id, file_id, session=session)
    final = Path(claim.path)
    tmp = temp_path(final, claim.token)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            out = Output(claim, f)
            yield out
            f.flush()
            os.fsync(f.fileno())
        if isinstance(session, Session):
            # A claim lost while we wrote (paused past the TTL) must not publish over
            # the attempt that replaced it; the registry would refuse the commit anyway.
            session.check()
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        client.fail(task_id, claim.file_id, claim.token, reason=f"{type(e).__name__}: {e}")
        raise
    out.entry = client.commit(task_id, claim.file_id, claim.token, out.size, out.digest)


def put(client: Client, session: Session | int, task_id: str, file_id: str,
        src: Path | BinaryIO, chunk: int = 1 << 20) -> pb.Entry:
    """Claim ``file_id``, copy ``src`` into it durably, and commit."""
    with produce(client, session, task_id, file_id) as out:
        if isinstance(src, Path):
            with open(src, "rb") as f:
                shutil.copyfileobj(f, out, chunk)
        else:
            shutil.copyfileobj(src, out, chunk)
    assert out.entry is not None
    return out.entry
