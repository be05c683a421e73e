"""What the watcher knows of the registry: its tasks and their entries, by path too.

Updated from the registry's Watch streams, the reconciliation listings and the
replies to reports; an update older than what is known (by etcd revision) is
ignored, so the three sources can race freely. Whichever of them brings the news
that an entry is consumed, ``Table.on_consumed`` hears it once: a reply that brings
it first makes the stream's later word of it old news, which nobody is told.
"""

from __future__ import annotations

import os
import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from ..kernel.contract import parse_attempt
from ..kernel.names import state_name
from ..kernel.v1 import baton_pb2 as pb

#: states whose files the watcher keeps an eye on
LIVE = frozenset({pb.ENTRY_STATE_PENDING, pb.ENTRY_STATE_WRITING, pb.ENTRY_STATE_WRITTEN,
                  pb.ENTRY_STATE_VERIFIED})
STATE_NAMES: dict[int, str] = {int(v): state_name(v) for v in pb.EntryState.values()}
CONSUMED = pb.ENTRY_STATE_CONSUMED
#: states without a committed attempt: the newest attempt's file is the one to look at
UNCOMMITTED = frozenset({pb.ENTRY_STATE_PENDING, pb.ENTRY_STATE_WRITING})
#: states whose file a check looks at (a pending entry's file is a dead attempt's)
CHECKED = frozenset({pb.ENTRY_STATE_WRITING, pb.ENTRY_STATE_WRITTEN,
                     pb.ENTRY_STATE_VERIFIED})
#: of those, the ones this watcher has not seen verified
UNVERIFIED = frozenset({pb.ENTRY_STATE_WRITING, pb.ENTRY_STATE_WRITTEN})


@dataclass
class EntryView:
    file_id: str
    path: str  # relative to the task's directory
    state: int
    size: int = 0
    digest: str = ""
    revision: int = 0
    #: the file of the attempt looked at (relative to the task's directory; "" =
    #: none known) and its token: once committed, the committed attempt's; before,
    #: the newest attempt whose file appeared (a dead attempt's is older than the
    #: live one's, and the registry believes only the live one)
    attempt_path: str = ""
    token: int = 0
    #: failed hashes in a row
    failures: int = 0
    #: when the registry last changed the entry (RFC 3339 UTC; parsed only when asked)
    updated_at: str = ""
    #: the staging retention, as the registry says (``retention.candidate``)
    staging_retention_seconds: float = -1.0
    consumed_at: str = ""
    staging_removed_at: str = ""
    #: the trace context of its hand-off, as the registry keeps it ("" = untraced)
    traceparent: str = ""

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, str(self.state))

    @property
    def updated_ns(self) -> int:
        """When the registry last changed the entry (UTC epoch nanoseconds; 0: unknown)."""
        return _epoch_ns(self.updated_at)

    def copy(self) -> EntryView:
        """A copy to hand out (as ``dataclasses.replace`` makes, at a fraction of its
        cost: one is made for each piece of news of each file)."""
        view = object.__new__(EntryView)
        view.__dict__.update(self.__dict__)
        return view


@dataclass
class TaskView:
    task_id: str
    directory: str
    entries: dict[str, EntryView] = field(default_factory=dict)
    by_path: dict[str, str] = field(default_factory=dict)
    #: its directory tree is being watched
    watched: bool = False
    #: set when the task is dropped; its stream ends
    forgotten: threading.Event = field(default_factory=threading.Event)
    #: when its files or its entries last changed (monotonic seconds)
    active_at: float = field(default_factory=time.monotonic)
    #: unwatched for having had no change for a while: reconciliation checks it
    cold: bool = False
    #: its Watch stream has applied a snapshot and has lost nothing since (a resume
    #: from a revision keeps it current; a broken stream or a refused resume does not)
    current: bool = False
    #: file ids by state, for the live states (kept by ``Table``): what a routine
    #: reconciliation looks at, without going through every entry
    by_state: dict[int, set[str]] = field(
        default_factory=lambda: {state: set() for state in LIVE})
    #: file ids by the directory of their path ("" = the task's directory)
    by_dir: dict[str, set[str]] = field(default_factory=dict)
    #: how many entries are in each state, every state (kept by ``Table``): the
    #: metrics' census reads these, not the entries
    counts: dict[int, int] = field(default_factory=dict)

    def needs_watch(self) -> bool:
        return not self.cold and any(self.by_state.values())


class Change(NamedTuple):
    """An entry whose state (or revision) moved forward (a tuple: one is made for each
    piece of news of each file)."""

    task_id: str
    entry: EntryView
    old_state: int | None


class Table:
    """Thread-safe; views handed out are copies."""

    def __init__(self, root: str, *,
                 on_consumed: Callable[[str, list[EntryView]], None] | None = None) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._tasks: dict[str, TaskView] = {}
        #: told (outside the lock) of every entry news of which made it consumed, or
        #: changed it while consumed, whichever source brought the news
        self.on_consumed = on_consumed

    def task_ids(self) -> list[str]:
        with self._lock:
            return list(self._tasks)

    def views(self) -> dict[str, TaskView]:
        """Every served task's view, as of now."""
        with self._lock:
            return dict(self._tasks)

    def task(self, task_id: str) -> TaskView | None:
        with self._lock:
            return self._tasks.get(task_id)

    def add_task(self, task_id: str) -> tuple[TaskView, bool]:
        with self._lock:
            if task_id in self._tasks:
                return self._tasks[task_id], False
            view = TaskView(task_id, os.path.join(self.root, task_id))
            self._tasks[task_id] = view
            return view, True

    def remove_task(self, task_id: str, view: TaskView | None = None) -> TaskView | None:
        """Stop serving ``task_id``; its view, or None if it was not served. With
        ``view``, only that one: a task deleted and created again under the same id has
        a new view, which news about the old one must not remove."""
        with self._lock:
            if view is not None and self._tasks.get(task_id) is not view:
                return None
            view = self._tasks.pop(task_id, None)
        if view is not None:
            view.forgotten.set()
        return view

    def set_watched(self, task_id: str, watched: bool) -> None:
        with self._lock:
            if (view := self._tasks.get(task_id)) is not None:
                view.watched = watched

    def needs_watch(self, task_id: str) -> tuple[bool, bool]:
        """(should its tree be watched, is it watched)."""
        with self._lock:
            view = self._tasks.get(task_id)
            return (view.needs_watch(), view.watched) if view else (False, False)

    def touch(self, task_id: str) -> bool:
        """The task changed now; True if that warms it up (it was cold)."""
        with self._lock:
            view = self._tasks.get(task_id)
            if view is None:
                return False
            view.active_at = time.monotonic()
            was, view.cold = view.cold, False
            return was

    def cool(self, idle: float, most: int | None = None) -> list[str]:
        """Mark cold the watched tasks with no change for ``idle`` seconds, or (with
        ``most``) the ``most`` watched tasks idle longest; their ids."""
        now = time.monotonic()
        with self._lock:
            warm = sorted((v for v in self._tasks.values() if v.watched and not v.cold),
                          key=lambda v: v.active_at)
            chosen = warm[:most] if most is not None else [
                v for v in warm if now - v.active_at >= idle]
            for view in chosen:
                view.cold = True
            return [v.task_id for v in chosen]

    def cold_count(self) -> int:
        with self._lock:
            return sum(1 for v in self._tasks.values() if v.cold)

    def apply(self, task_id: str, entry: pb.Entry, *,
              failures: int | None = None, quiet: bool = False) -> Change | None:
        """Record ``entry`` unless something newer is known; the change, if any.
        ``failures``: set the entry's count of failed hashes too (whether or not
        ``entry`` was news). ``quiet``: ``on_consumed`` is not told (the caller hands the
        entry to the staging retention itself, or it is the retention's own answer)."""
        with self._lock:
            view = self._tasks.get(task_id)
            if view is None:
                return None
            change = self._apply(view, entry)
            if failures is not None and (known := view.entries.get(entry.file_id)):
                known.failures = failures
        if (change is not None and change.entry.state == CONSUMED and self.on_consumed
                and not quiet):
            self.on_consumed(task_id, [change.entry])
        return change

    def _apply(self, view: TaskView, entry: pb.Entry) -> Change | None:
        # Each field of ``entry`` is read once: a read of a message's field makes a new
        # Python object, and this runs for every piece of news of every file.
        if entry.parts:
            return None  # an assembly has no file of its own; its parts do
        file_id, state, revision = entry.file_id, entry.state, entry.revision
        known = view.entries.get(file_id)
        old: int | None
        if known is None:
            old, path = None, entry.path
            known = EntryView(file_id, path, state)
            view.entries[file_id] = known
            view.by_path[path] = file_id
            view.by_dir.setdefault(posixpath.dirname(path), set()).add(file_id)
            view.counts[state] = view.counts.get(state, 0) + 1
        elif revision <= known.revision:
            return None
        else:
            old = known.state
            if state != old:
                if (was := view.by_state.get(old)) is not None:
                    was.discard(file_id)
                view.counts[old] -= 1
                view.counts[state] = view.counts.get(state, 0) + 1
                known.failures = 0
        if (now := view.by_state.get(state)) is not None:
            now.add(file_id)
        known.state, known.size, known.digest = state, entry.size, entry.digest
        attempt_path = entry.attempt_path
        if attempt_path and attempt_path != known.attempt_path:
            # committed: its attempt is decided (the same file: the same token)
            known.attempt_path = attempt_path
            attempt = parse_attempt(attempt_path)
            known.token = attempt[1] if attempt else 0
        known.revision = revision
        known.updated_at = entry.updated_at
        known.staging_retention_seconds = entry.staging_retention_seconds
        known.consumed_at = entry.consumed_at
        known.staging_removed_at = entry.staging_removed_at
        known.traceparent = entry.traceparent
        return Change(view.task_id, known.copy(), old)

    def replace(self, task_id: str, entries: list[pb.Entry]) -> list[Change]:
        """A full snapshot of the task: apply each entry, drop the ones not in it."""
        with self._lock:
            view = self._tasks.get(task_id)
            if view is None:
                return []
            keep = {e.file_id for e in entries}
            for gone in set(view.entries) - keep:
                old = view.entries.pop(gone)
                view.by_path.pop(old.path, None)
                view.by_state.get(old.state, set()).discard(gone)
                view.counts[old.state] -= 1
                if (same := view.by_dir.get(d := posixpath.dirname(old.path))) is not None:
                    same.discard(gone)
                    if not same:
                        del view.by_dir[d]
            changes = [c for e in entries if (c := self._apply(view, e)) is not None]
        if self.on_consumed and (consumed := [c.entry for c in changes
                                              if c.entry.state == CONSUMED]):
            self.on_consumed(task_id, consumed)
        return changes

    def entry(self, task_id: str, file_id: str) -> EntryView | None:
        with self._lock:
            view = self._tasks.get(task_id)
            known = view.entries.get(file_id) if view else None
            return known.copy() if known else None

    def revision(self, task_id: str, file_id: str) -> int:
        """The revision the entry is known at (0: not known)."""
        with self._lock:
            view = self._tasks.get(task_id)
            known = view.entries.get(file_id) if view else None
            return known.revision if known else 0

    def entries(self, task_id: str) -> list[EntryView]:
        with self._lock:
            view = self._tasks.get(task_id)
            return [e.copy() for e in view.entries.values()] if view else []

    def to_check(self, task_id: str, *, unverified: bool = True, verified: bool = False,
                 dirs: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """File ids of the task's entries a check looks at (``CHECKED`` states): those
        not seen verified, with ``verified`` the verified ones too, and the ones whose
        path is directly in one of ``dirs``. From the indexes: no pass over the entries."""
        with self._lock:
            view = self._tasks.get(task_id)
            if view is None:
                return []
            chosen: set[str] = set()
            for state in (UNVERIFIED if unverified else ()):
                chosen |= view.by_state[state]
            if verified:
                chosen |= view.by_state[pb.ENTRY_STATE_VERIFIED]
            for d in dirs:
                for file_id in view.by_dir.get(d, ()):
                    if view.entries[file_id].state in CHECKED:
                        chosen.add(file_id)
            return sorted(chosen)

    def survey(self, task_id: str, rel_dir: str) -> tuple[list[str], list[str]]:
        """What a check of everything below ``rel_dir`` ("": the whole task) looks at:
        the directories holding an uncommitted entry (whose attempts' files to list),
        and the file ids in ``CHECKED`` states. From the indexes, copying no entry: a
        new task's tree costs what it holds that is live, not what the task stores."""
        with self._lock:
            view = self._tasks.get(task_id)
            if view is None:
                return [], []
            top = rel_dir.rstrip("/")

            def below(d: str) -> bool:
                return not top or d == top or d.startswith(top + "/")

            entries = view.entries
            dirs = [d for d, ids in view.by_dir.items() if below(d) and any(
                entries[f].state in UNCOMMITTED for f in ids)]
            checked = [f for state in CHECKED for f in view.by_state[state]
                       if below(posixpath.dirname(entries[f].path))]
            return dirs, checked

    def saw_attempts(self, task_id: str, newest: dict[str, tuple[str, int]]) -> None:
        """The newest attempt's file on disk of each path in ``newest`` (by the
        entry's path: the file and its token), as ``Hasher.attempts`` lists them."""
        with self._lock:
            view = self._tasks.get(task_id)
            if view is None:
                return
            for path, (rel, token) in newest.items():
                if (file_id := view.by_path.get(path)) is not None:
                    self._saw(view, file_id, rel, token)

    def dirs_of(self, task_id: str) -> list[str]:
        """The directories of the task's entries' paths ("" = the task's directory)."""
        with self._lock:
            view = self._tasks.get(task_id)
            return sorted(view.by_dir) if view is not None else []

    def update(self, task_id: str, file_id: str, **changes: object) -> None:
        """Set local notes (``failures``) on an entry."""
        with self._lock:
            view = self._tasks.get(task_id)
            known = view.entries.get(file_id) if view else None
            if known is not None:
                for name, value in changes.items():
                    setattr(known, name, value)

    def census(self) -> tuple[dict[str, int], int]:
        """Entries of the served tasks by state name, and when the entry longest in
        ``written`` was committed (epoch ns; 0: none is written). For metrics, scraped
        at rest too: it reads each task's counts and its written entries only, never
        every stored entry."""
        counts = {name: 0 for state, name in STATE_NAMES.items() if state}
        oldest = 0
        with self._lock:
            for view in self._tasks.values():
                for state, n in view.counts.items():
                    name = STATE_NAMES.get(state, str(state))
                    counts[name] = counts.get(name, 0) + n
                for file_id in view.by_state[pb.ENTRY_STATE_WRITTEN]:
                    at = view.entries[file_id].updated_ns
                    if at and (not oldest or at < oldest):
                        oldest = at
        return counts, oldest

    def locate(self, path: str) -> tuple[str, str] | None:
        """(task_id, relative path) of an absolute path below the root, if it is one."""
        if not path.startswith(self.root + os.sep):
            return None
        task_id, _, rel = path[len(self.root) + 1 :].partition(os.sep)
        return task_id, rel

    def file_at(self, path: str) -> tuple[str, str] | None:
        """(task_id, file_id) of the entry an attempt's file at ``path`` belongs to,
        if any. An attempt newer than the one known of an uncommitted entry becomes
        the one its checks look at."""
        where = self.locate(path)
        if where is None:
            return None
        attempt = parse_attempt(where[1])
        logical, token = attempt if attempt else (where[1], 0)
        with self._lock:
            view = self._tasks.get(where[0])
            file_id = view.by_path.get(logical) if view else None
            if view is not None and file_id:
                self._saw(view, file_id, where[1], token)
        return (where[0], file_id) if file_id else None

    def saw_attempt(self, task_id: str, file_id: str, rel: str, token: int) -> None:
        """The file ``rel`` of the attempt with ``token`` is on disk."""
        with self._lock:
            view = self._tasks.get(task_id)
            if view is not None:
                self._saw(view, file_id, rel, token)

    @staticmethod
    def _saw(view: TaskView, file_id: str, rel: str, token: int) -> None:
        # Only an uncommitted entry follows the newest attempt; a committed one's is
        # decided, and any other attempt's file beside it is not its bytes.
        known = view.entries.get(file_id)
        if known is not None and token > known.token and known.state in UNCOMMITTED:
            known.attempt_path, known.token = rel, token


def _epoch_ns(stamp: str) -> int:
    """An RFC 3339 UTC timestamp as epoch nanoseconds (0 if absent or malformed)."""
    try:
        moment = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return 0
    return int(moment.timestamp() * 1_000_000_000)
