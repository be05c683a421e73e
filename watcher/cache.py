"""What this watcher hashed: file identity → digest, per entry.

It lets the watcher skip a file it already vouched for (same inode, size,
mtime and ctime means the same bytes) and re-send an earlier result without
reading the file again. The SQLite form survives restarts, so a restarted
watcher does not rehash every verified file; without it, a restart rehashes
verified files once and reports only those whose bytes changed. It also keeps the
watcher id the watcher last registered as, so that a restart ends that registration
and takes its shards back at once.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from typing import Protocol

from .hashing import Identity


@dataclass(frozen=True)
class Known:
    identity: Identity
    digest: str


class IdentityCache(Protocol):
    def get(self, task_id: str, file_id: str) -> Known | None: ...

    def put(self, task_id: str, file_id: str, known: Known) -> None: ...

    def drop(self, task_id: str, file_id: str) -> None: ...

    def drop_task(self, task_id: str) -> None: ...

    def registration(self) -> str:
        """The watcher id this watcher last registered as ("" if none is known)."""
        ...

    def set_registration(self, watcher_id: str) -> None: ...

    def close(self) -> None: ...


class MemoryCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[tuple[str, str], Known] = {}
        self._registration = ""

    def registration(self) -> str:
        return self._registration

    def set_registration(self, watcher_id: str) -> None:
        self._registration = watcher_id

    def get(self, task_id: str, file_id: str) -> Known | None:
        with self._lock:
            return self._data.get((task_id, file_id))

    def put(self, task_id: str, file_id: str, known: Known) -> None:
        with self._lock:
            self._data[(task_id, file_id)] = known

    def drop(self, task_id: str, file_id: str) -> None:
        with self._lock:
            self._data.pop((task_id, file_id), None)

    def drop_task(self, task_id: str) -> None:
        with self._lock:
            for key in [k for k in self._data if k[0] == task_id]:
                del self._data[key]

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS known (
    task_id TEXT NOT NULL, file_id TEXT NOT NULL,
    device INTEGER, inode INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER,
    digest TEXT NOT NULL,
    PRIMARY KEY (task_id, file_id)
);
CREATE TABLE IF NOT EXISTS registration (
    one INTEGER PRIMARY KEY CHECK (one = 1), watcher_id TEXT NOT NULL
);
"""


class SqliteCache:
    """The same, in a SQLite file (WAL; a lost last write only costs a rehash)."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def registration(self) -> str:
        with self._lock:
            row = self._db.execute("SELECT watcher_id FROM registration").fetchone()
        return str(row[0]) if row else ""

    def set_registration(self, watcher_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO registration VALUES (1, ?)",
                             (watcher_id,))

    def get(self, task_id: str, file_id: str) -> Known | None:
        with self._lock:
            row = self._db.execute(
                "SELECT device, inode, size, mtime_ns, ctime_ns, digest FROM known "
                "WHERE task_id = ? AND file_id = ?", (task_id, file_id)).fetchone()
        if row is None:
            return None
        return Known(Identity(*row[:5]), row[5])

    def put(self, task_id: str, file_id: str, known: Known) -> None:
        i = known.identity
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO known VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (task_id, file_id, i.device, i.inode, i.size, i.mtime_ns, i.ctime_ns,
                 known.digest))

    def drop(self, task_id: str, file_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM known WHERE task_id = ? AND file_id = ?",
                             (task_id, file_id))

    def drop_task(self, task_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM known WHERE task_id = ?", (task_id,))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def open_cache(path: str) -> IdentityCache:
    return SqliteCache(path) if path else MemoryCache()
