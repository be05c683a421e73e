"""The staging retention, the watcher's side: consumed entries' files of its shards
leave staging once their retention has passed.

Candidates come from the task views (an entry seen consumed on a task's Watch stream,
in a reconciliation or in a reply: ``Table.on_consumed``) and from one listing of each
finished task of its shards (a completed task is no longer followed, yet its files are
the ones due). They wait in a heap by due time; one thread hands them out in turn to
a few workers (each removal is a round trip to the registry), starting at most
``rate`` a second:

1. hash the file through the safe path (``Hasher``: dir descriptors, ``O_NOFOLLOW``);
   a symlink or a non-regular file is left alone and counted;
2. ask the registry to record the removal (``RemoveStaged``), with the digest just
   read and the shard's epoch: it believes only the shard's owner, only past the
   retention, only for the verified bytes (a changed file is journalled and kept);
3. unlink the file, hashing it once more and checking that the name still names the
   inode hashed (``Hasher.remove``).

A crash between 2 and 3 leaves a marked entry whose file is still there: the next
time the entry is offered (a reconciliation, the listing after a restart or a shard
move) it is unlinked without asking again, its digest checked as before.

Directories: a task archived or deleted has its directory removed once nothing but
empty directories is left in it (a planted symlink, or a kept file, keeps it).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from ..client import Client
from ..kernel.contract import parse_attempt
from ..kernel.errors import (
    BatonError,
    DeadlineExceeded,
    NotFound,
    NotShardOwner,
    StorageFull,
    Unavailable,
)
from ..kernel.logs import log
from ..kernel.v1 import baton_pb2 as pb
from .errors import FileChanged, FileMissing, HashFailed, Refused
from .hashing import Hasher
from .metrics import Metrics
from .shards import Membership
from .taskdirs import only_dirs, remove_empty

logger = logging.getLogger("baton.watcher")

Outcome = pb.RemoveStagedResponse.Outcome
Key = tuple[str, str]
#: seconds before a removal that failed for a passing reason is tried again
RETRY_AFTER = 5.0
#: seconds before one the registry refused for another reason is tried again
REFUSED_AFTER = 60.0


@dataclass
class Candidate:
    """A consumed entry's file the watcher will remove (or finish removing)."""

    #: the committed attempt's file (relative to the task's directory)
    path: str
    size: int
    digest: str
    #: when it is due (UTC epoch seconds)
    due: float
    #: the registry recorded its removal already: only the unlink is left
    removed: bool = False
    #: the entry's path and its committed token: the files of older attempts
    #: beside it go with it
    entry_path: str = ""
    token: int = 0


class Staged(Protocol):
    """An entry as the registry sent it (``pb.Entry``) or as a task view keeps it."""

    @property
    def file_id(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def attempt_path(self) -> str: ...
    @property
    def state(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def digest(self) -> str: ...
    @property
    def staging_retention_seconds(self) -> float: ...
    @property
    def consumed_at(self) -> str: ...
    @property
    def staging_removed_at(self) -> str: ...


def candidate(entry: Staged) -> Candidate | None:
    """What ``entry`` leaves to remove: None unless consumed, with a file of its own
    (an assembly's ``pb.Entry`` has parts and no digest of a file) and a retention
    that is not negative."""
    if entry.state != pb.ENTRY_STATE_CONSUMED or getattr(entry, "parts", None) or not entry.digest:
        return None
    path = entry.attempt_path or entry.path
    attempt = parse_attempt(path)
    token = attempt[1] if attempt else 0
    if entry.staging_removed_at:
        return Candidate(path, entry.size, entry.digest, 0.0, removed=True,
                         entry_path=entry.path, token=token)
    if entry.staging_retention_seconds < 0 or not entry.consumed_at:
        return None
    due = _epoch(entry.consumed_at) + entry.staging_retention_seconds
    return Candidate(path, entry.size, entry.digest, due, entry_path=entry.path, token=token)


class Retention:
    """The removal loop: :meth:`start`, feed it (:meth:`offer`, :meth:`finished`,
    :meth:`task_gone`), :meth:`stop`."""

    def __init__(self, client: Client, hasher: Hasher, membership: Membership,
                 metrics: Metrics, reporter: str, root: str, rate: float,
                 workers: int = 4, *,
                 on_reply: Callable[[str, pb.Entry], None] = lambda t, e: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.hasher = hasher
        self.membership = membership
        self.metrics = metrics
        self.reporter = reporter
        self.root = root
        self.gap = 1.0 / rate
        self.on_reply = on_reply
        self.clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._known: dict[Key, Candidate] = {}
        self._heap: list[tuple[float, str, str]] = []
        #: finished tasks to list, tasks listed since their shard became ours, and
        #: directories of tasks gone to remove once empty
        self._to_list: list[str] = []
        self._listed: set[str] = set()
        self._dirs: list[str] = []
        #: entries whose file is gone (removed, or missing when its turn came): a
        #: marked entry offered again is not looked at again
        self._gone: dict[str, set[str]] = {}
        self._held = 0
        self._stopping = False
        #: files in hand at once (each one RPC and a hash: a round trip apiece)
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="watcher-removal")
        self._busy: set[Key] = set()
        #: when the next removal may start (monotonic seconds)
        self._slot = 0.0
        self._thread = threading.Thread(target=self._run, name="watcher-retention",
                                        daemon=True)

    # feeding ---------------------------------------------------------------------------

    def offer(self, task_id: str, entries: Iterable[Staged]) -> None:
        """Entries of a task of this watcher's shards."""
        with self._lock:
            for entry in entries:
                key = (task_id, entry.file_id)
                if (c := candidate(entry)) is not None and (
                        entry.file_id not in self._gone.get(task_id, ())):
                    self._put(key, c)

    def finished(self, task_id: str) -> None:
        """A finished task of its shards: list its consumed entries once."""
        with self._lock:
            if task_id not in self._listed:
                self._listed.add(task_id)
                self._to_list.append(task_id)
                self._wake.notify()

    def task_gone(self, task_id: str) -> None:
        """A task archived or deleted: its directory goes once it is empty."""
        with self._lock:
            self._dirs.append(task_id)
            self._listed.discard(task_id)
            self._gone.pop(task_id, None)
            self._wake.notify()

    def shards_lost(self) -> None:
        """Forget what is no longer this watcher's: the new owner lists it again."""
        with self._lock:
            for key in [k for k in self._known if not self.membership.serves(k[0])]:
                self._drop(key)
            self._listed = {t for t in self._listed if self.membership.serves(t)}
            self._gone = {t: f for t, f in self._gone.items() if self.membership.serves(t)}

    def held(self) -> int:
        """Bytes of the known candidates not removed yet (a metrics level)."""
        with self._lock:
            return self._held

    def _put(self, key: Key, c: Candidate) -> None:
        old = self._known.get(key)
        if old is not None and old.due == c.due and old.removed == c.removed:
            return
        if old is not None:
            self._drop(key)
        self._known[key] = c
        if not c.removed:
            self._held += c.size
        heapq.heappush(self._heap, (c.due, *key))
        self._wake.notify()

    def _drop(self, key: Key) -> None:
        c = self._known.pop(key, None)
        if c is not None and not c.removed:
            self._held -= c.size

    # the loop ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        """Hand out the work in order: listings and directories on this thread, each
        file to the pool, starts paced to ``rate`` a second."""
        while True:
            with self._lock:
                work = self._next()
                if work is None:
                    return
            try:
                work()
            except Exception:
                logger.exception("staging retention: a step failed")

    def _next(self) -> Callable[[], None] | None:
        """The next thing to do (waiting until there is one); None when stopping."""
        while not self._stopping:
            if self._to_list:
                task_id = self._to_list.pop(0)
                return lambda: self._list(task_id)
            if self._dirs:
                task_id = self._dirs.pop(0)
                return lambda: self._remove_dir(task_id)
            now, wait = self.clock(), 60.0
            while self._heap and len(self._busy) < self.workers:
                due, task_id, file_id = self._heap[0]
                key = (task_id, file_id)
                c = self._known.get(key)
                if c is None or c.due != due or key in self._busy:
                    # superseded or dropped; one in hand is looked at again when done
                    heapq.heappop(self._heap)
                    continue
                if due > now:
                    wait = min(due - now, wait)
                    break
                start = max(self._slot, time.monotonic())
                if start > time.monotonic():
                    wait = start - time.monotonic()
                    break
                heapq.heappop(self._heap)
                self._slot = start + self.gap
                self._busy.add(key)
                return lambda: self._submit(key, c)
            self._wake.wait(wait)
        return None

    def _submit(self, key: Key, c: Candidate) -> None:
        try:
            self._pool.submit(self._one, key, c)
        except RuntimeError:  # the pool is shut down: stopping
            with self._lock:
                self._busy.discard(key)

    def _one(self, key: Key, c: Candidate) -> None:
        """Remove one file (on a pool thread), then decide what becomes of it."""
        again: float | None = None
        try:
            again = self._remove(key, c)
        except Exception:
            logger.exception("staging retention: a removal failed")
            again = self.clock() + REFUSED_AFTER
        finally:
            with self._lock:
                self._busy.discard(key)
                now = self._known.get(key)
                if now is c:
                    if again is None:
                        self._drop(key)
                        if self.membership.serves(key[0]):  # else the next owner's
                            self._gone.setdefault(key[0], set()).add(key[1])
                    else:
                        c.due = again
                        heapq.heappush(self._heap, (again, *key))
                elif now is not None:  # offered anew while in hand: its turn again
                    heapq.heappush(self._heap, (now.due, *key))
                self._wake.notify()

    def _list(self, task_id: str) -> None:
        if not self.membership.serves(task_id):
            return
        try:
            entries = self.client.operator.list_entries(task_id, state=pb.ENTRY_STATE_CONSUMED)
        except NotFound:
            return
        except BatonError as e:
            log(logger, logging.WARNING, "staging retention: cannot list a finished task; "
                "trying again later", task=task_id, error=str(e))
            with self._lock:
                self._listed.discard(task_id)
            return
        self.offer(task_id, entries)

    # one file ------------------------------------------------------------------------------

    def _remove(self, key: Key, c: Candidate) -> float | None:
        """Remove one file if it may go: when to try again (None: done with it)."""
        task_id, file_id = key
        epoch = self.membership.epoch_of(task_id)
        if epoch is None:
            return None  # its shard left: the new owner removes it
        if c.removed:
            self._unlink(key, c)
            return None
        try:
            hashed = self.hasher.hash(task_id, c.path)
        except FileMissing:
            return None  # nothing left to remove
        except Refused as e:
            self._refused(key, e)
            return None
        except HashFailed as e:  # changed while read, unreadable: look again later
            log(logger, logging.INFO, "staging retention: cannot hash yet", task=task_id,
                file_id=file_id, reason=e.reason)
            return self.clock() + RETRY_AFTER
        try:
            allowed = self.hasher.removable(task_id, c.path)
        except HashFailed as e:
            allowed, why = False, e.reason
        else:
            why = "its directory is not writable by the watcher"
        if not allowed:
            self._refused(key, Refused(f"{task_id}/{c.path}", why))
            return None
        try:
            reply = self.client.watcher.remove_staged(
                task_id, file_id, hashed.identity.size, hashed.digest, self.reporter,
                watcher_id=self.membership.watcher_id, shard_epoch=epoch)
        except (NotFound, NotShardOwner) as e:
            log(logger, logging.INFO, "staging retention: not this watcher's to remove",
                task=task_id, file_id=file_id, error=str(e))
            return None
        except (Unavailable, StorageFull, DeadlineExceeded):
            # Passing: etcd at its quota (its alarm is disarmed once space is made) or a
            # registry away. Waiting as long as for a refusal let a long fault run's
            # staging fill up behind an etcd quota incident: removals resume soon.
            return self.clock() + RETRY_AFTER
        except BatonError as e:
            log(logger, logging.WARNING, "staging retention: registry refused",
                task=task_id, file_id=file_id, error=f"{type(e).__name__}: {e}")
            return self.clock() + REFUSED_AFTER
        self.on_reply(task_id, reply.entry)
        if reply.outcome == Outcome.OUTCOME_MARKED:
            self._unlink(key, c)
        elif reply.outcome == Outcome.OUTCOME_CHANGED:
            self._changed(key, hashed.digest)
        elif reply.outcome == Outcome.OUTCOME_NOT_DUE:
            return self.clock() + reply.due_in_seconds
        return None

    def _unlink(self, key: Key, c: Candidate) -> None:
        """Unlink a marked entry's file (unless it is gone, or changed), and the files
        its dead attempts left beside it."""
        if c.token:
            try:
                dead = self.hasher.remove_dead_attempts(key[0], c.entry_path, c.token)
            except HashFailed:
                dead = 0
            if dead:
                self.metrics.add("staging_files_removed", dead)
                log(logger, logging.INFO, "removed dead attempts' files from staging",
                    task=key[0], file_id=key[1], files=dead)
        try:
            size = self.hasher.remove(key[0], c.path, c.digest)
        except FileMissing:
            return
        except FileChanged as e:
            self._changed(key, e.digest)
            return
        except Refused as e:
            self._refused(key, e)
            return
        except HashFailed as e:
            log(logger, logging.WARNING, "staging retention: cannot remove", task=key[0],
                file_id=key[1], reason=e.reason)
            return
        self.metrics.add("staging_files_removed")
        self.metrics.add("staging_bytes_removed", size)
        log(logger, logging.INFO, "removed from staging", task=key[0], file_id=key[1],
            size=size)

    def _changed(self, key: Key, digest: str) -> None:
        self.metrics.add("staging_files_changed")
        log(logger, logging.WARNING, "staging retention: file changed after verification; "
            "kept", task=key[0], file_id=key[1], digest=digest or "-")

    def _refused(self, key: Key, e: HashFailed) -> None:
        self.metrics.add("staging_files_refused")
        log(logger, logging.WARNING, "staging retention: left alone", task=key[0],
            file_id=key[1], reason=e.reason)

    # directories ---------------------------------------------------------------------------

    def _task_gone(self, task_id: str) -> bool:
        """The registry's word that the task is archived or deleted (or deleting)."""
        try:
            task = self.client.operator.get_task(task_id)
        except NotFound:
            return True
        except BatonError:
            return False
        return task.status in (pb.TASK_STATUS_ARCHIVED, pb.TASK_STATUS_DELETING)

    def _remove_dir(self, task_id: str) -> None:
        """Remove the task's directory if nothing but empty directories is in it and
        the registry says the task is archived or gone."""
        if not self.membership.serves(task_id) or not only_dirs(self.root, task_id):
            return
        if self._task_gone(task_id) and remove_empty(self.root, task_id):
            self.metrics.add("staging_dirs_removed")
            log(logger, logging.INFO, "task directory removed (empty; the task is "
                "archived or deleted)", task=task_id)

def _epoch(stamp: str) -> float:
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
