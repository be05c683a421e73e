"""The watcher's membership: its registration and the shards it owns.

The watcher registers on its own lease and heartbeats every TTL/3; each reply
lists the shards it owns, at which epoch, and those it is asked to hand over.
It serves (watches, hashes, reports on) only the tasks of shards it owns, and
every report names the shard's epoch: the registry believes the owner at the
current epoch only (``baton_relay.registry.verbs.shards``).

A handover runs on its own thread so the heartbeats go on meanwhile: the
daemon stops serving the shard's tasks, the checks already in hand finish (and
report, under the old epoch, which is still current), then the shard is
released. A shard gained is served after a reconciliation with the registry,
so nothing is reported for it from before. If the registration is lost (the
registry says so, or no heartbeat succeeded for a whole TTL), every shard is
dropped and the watcher registers again under a new id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..client import Client
from ..kernel.backoff import Backoff
from ..kernel.contract import shard_of
from ..kernel.errors import BatonError, ClientClosed, NotFound
from ..kernel.logs import log
from ..kernel.v1 import baton_pb2 as pb

logger = logging.getLogger("baton.watcher")

#: seconds before registering again while the registry cannot be reached (the bound
#: after one failure; it grows to the cap while they go on failing)
REGISTER_RETRY, REGISTER_RETRY_CAP = 1.0, 8.0
REGISTER_BACKOFF = Backoff(REGISTER_RETRY, REGISTER_RETRY_CAP, floor=0.5)
#: seconds between heartbeats while the watcher owns no shard yet
FIRST_SHARDS = 0.5
#: task ids whose shard is kept (beyond, the record starts over)
SHARDS_KEPT = 4096


class Membership:
    """Thread-safe. :meth:`start` registers (retrying in the background), then
    heartbeats until :meth:`stop`."""

    def __init__(self, client: Client, root: str, reporter: str, ttl: int, *,
                 capacity: Callable[[], pb.WatcherCapacity],
                 gained: Callable[[set[int]], None],
                 lost: Callable[[set[int]], None],
                 handover: Callable[[int], None],
                 remember: Callable[[str], None] = lambda watcher_id: None,
                 previous: str = "") -> None:
        self.client = client
        #: the registration before a restart (ended when this one registers), and where
        #: each new registration is written down for the next restart
        self._previous = previous
        self._remember = remember
        self.root = root
        self.reporter = reporter
        self.ttl = ttl
        self._capacity = capacity
        #: called with shards newly owned (the daemon reconciles them first)
        self._gained = gained
        #: called with shards no longer owned (the daemon stops serving their tasks)
        self._lost = lost
        #: called on a handover thread; returns once the shard's checks in hand are done
        self._handover = handover
        self._lock = threading.Lock()
        self.watcher_id = ""
        self.count = 0
        #: task id -> its shard among ``count`` (emptied when the count changes)
        self._shards: dict[str, int] = {}
        #: shard -> epoch: owned and served
        self._owned: dict[int, int] = {}
        #: shard -> epoch: being handed over (reports of checks in hand still count)
        self._leaving: dict[int, int] = {}
        self.draining = False
        self._stop = threading.Event()
        self._last_ok = 0.0
        self._thread = threading.Thread(target=self._run, name="watcher-membership",
                                        daemon=True)

    # what the daemon asks ---------------------------------------------------------

    def _shard(self, task_id: str) -> int:
        """The task's shard among ``count`` (under the lock): asked for each file's
        news and report, so kept per task id rather than hashed each time."""
        n = self._shards.get(task_id)
        if n is None:
            if len(self._shards) >= SHARDS_KEPT:
                self._shards.clear()
            n = self._shards[task_id] = shard_of(task_id, self.count)
        return n

    def shard(self, task_id: str) -> int | None:
        with self._lock:
            return self._shard(task_id) if self.count else None

    def serves(self, task_id: str) -> bool:
        """Whether this watcher serves the task: it owns its shard (and keeps it)."""
        with self._lock:
            return bool(self.count) and self._shard(task_id) in self._owned

    def epoch_of(self, task_id: str) -> int | None:
        """The epoch to report ``task_id`` under (None: not this watcher's to report)."""
        with self._lock:
            if not self.count:
                return None
            n = self._shard(task_id)
            return self._owned.get(n, self._leaving.get(n))

    def owned(self) -> dict[int, int]:
        with self._lock:
            return dict(self._owned)

    # lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._register()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _register(self) -> bool:
        try:
            reply = self.client.watcher.register_watcher(self.root, self.reporter, self.ttl,
                                                         self._capacity(), previous=self._previous)
        except BatonError as e:
            log(logger, logging.WARNING, "cannot register with the registry; retrying",
                error=f"{type(e).__name__}: {e}")
            return False
        with self._lock:
            self.watcher_id, self.count, self.ttl = reply.watcher_id, reply.shard_count, reply.ttl
            self._shards.clear()
        self._previous = reply.watcher_id
        self._remember(reply.watcher_id)
        self._last_ok = time.monotonic()
        log(logger, logging.INFO, "registered", watcher=reply.watcher_id, ttl=reply.ttl,
            shards=reply.shard_count, owned=len(reply.shards))
        self._apply(pb.WatcherHeartbeatResponse(ttl=reply.ttl, shard_count=reply.shard_count,
                                                shards=reply.shards))
        return True

    def _run(self) -> None:
        failed = 0  # registrations in a row that could not reach the registry
        interval = 0.0 if self.watcher_id else REGISTER_BACKOFF.delay(1)
        while not self._stop.wait(interval):
            if not self.watcher_id:
                failed = 0 if self._register() else failed + 1
                interval = REGISTER_BACKOFF.delay(failed) if failed else self.ttl / 3
                if self.watcher_id:
                    self._beat()
                continue
            self._beat()
            # Owning nothing yet (just started): ask again soon, not a third of a TTL later.
            interval = max(self.ttl / 3, 0.2) if self._owned or self.draining else min(
                self.ttl / 3, FIRST_SHARDS)

    def _beat(self) -> None:
        sent = time.monotonic()
        try:
            reply = self.client.watcher.watcher_heartbeat(self.watcher_id, self._capacity())
        except NotFound as e:
            self._expired(str(e))
            return
        except ClientClosed:
            self._stop.set()
            return
        except BatonError as e:
            if time.monotonic() - self._last_ok > self.ttl:
                self._expired(f"no heartbeat for {self.ttl}s ({e})")
            return
        self._last_ok = sent
        self._apply(reply)

    def _expired(self, why: str) -> None:
        """The registration is gone: so are the shards; register again."""
        with self._lock:
            dropped = set(self._owned) | set(self._leaving)
            self._owned.clear()
            self._leaving.clear()
            old, self.watcher_id = self.watcher_id, ""
        log(logger, logging.WARNING, "registration lost; every shard dropped", watcher=old,
            reason=why, shards=len(dropped))
        if dropped:
            self._lost(dropped)
        self._register()

    def _apply(self, reply: pb.WatcherHeartbeatResponse) -> None:
        now = {g.shard: g for g in reply.shards}
        with self._lock:
            if self.count != reply.shard_count:
                self._shards.clear()
            self.count = reply.shard_count
            self.draining = reply.draining
            gained = {n for n, g in now.items() if not g.release and (
                self._owned.get(n) != g.epoch) and n not in self._leaving}
            lost = {n for n in self._owned if n not in now or now[n].epoch != self._owned[n]}
            leaving = {n for n, g in now.items() if g.release and n in self._owned}
            for n in lost:
                del self._owned[n]
            for n in leaving:
                self._leaving[n] = self._owned.pop(n)
            for n in gained:
                self._owned[n] = now[n].epoch
            for n in [n for n in self._leaving if n not in now]:
                del self._leaving[n]  # handed over, or the registry forced the move
        if lost:
            log(logger, logging.INFO, "shards lost", shards=_names(lost))
            self._lost(lost)
        for n in sorted(leaving):
            threading.Thread(target=self._hand_over, args=(n,), daemon=True,
                             name=f"watcher-handover-{n}").start()
        if gained:
            log(logger, logging.INFO, "shards gained", shards=_names(gained),
                epochs=_names({now[n].epoch for n in gained}))
            self._gained(gained)

    def _hand_over(self, n: int) -> None:
        with self._lock:
            epoch, watcher_id = self._leaving.get(n), self.watcher_id
        if epoch is None:
            return
        self._lost({n})
        self._handover(n)
        try:
            self.client.watcher.release_shard(watcher_id, n, epoch)
        except BatonError as e:
            log(logger, logging.WARNING, "releasing a shard failed; the registry takes it at "
                "the move's deadline", shard=n, error=f"{type(e).__name__}: {e}")
        else:
            log(logger, logging.INFO, "shard handed over", shard=n, epoch=epoch)
        with self._lock:
            if self._leaving.get(n) == epoch:
                del self._leaving[n]


def _names(shards: set[int]) -> str:
    return ",".join(str(n) for n in sorted(shards))
