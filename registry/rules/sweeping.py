"""The elected replica's sweeps, woken by what is written instead of by a timer.

Each sweep of the leader (the reaper, deadlines, stalls, the scheduler's) reads an
index of what is due, and every index key is written by the transaction that makes
its work due (docs/architecture.md, "Sweeps"). So there is nothing to look at unless a
key was written under an index, or a due time a key names has come. The leader follows
the indexes with one etcd watch (:class:`SweepWatch`, asking for progress
notifications), and each sweep sleeps on an :class:`Alarm` until the nearest of:

- a write its index's handler rings for (a claim key deleted, a wake key put, ...);
- the earliest due time known of its index (:class:`Dues`, fed by the keys the watch
  shows and by the sweep's own read of its index's head);
- a full look, owed when this replica becomes the leader, whenever its watch breaks
  (etcd unreachable, the watch's revision compacted) and after a sweep fails: the
  watch starts from a revision read *before* the looks are asked for, so whatever a
  look does not see, the watch brings; and every ``full_every`` seconds, so that an
  event lost without the watch breaking (a fault nobody foresaw) delays due work by
  that long at worst, never for ever.

A burst of writes is coalesced: a sweep runs at most once per ``interval``
(``--reap-interval``), so a busy stack sweeps no more often than periodic sweeps did,
and an idle one sends etcd nothing. Every move a sweep makes is still one guarded
transaction: a sweep that overlaps a new leader's changes nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable

from ...kernel.backoff import Backoff
from ...kernel.errors import BatonError
from ..store.etcd import Watched, WatchEvent
from ..store.keys import Keys
from .core import Core
from .election import Election

log = logging.getLogger("baton.registry")

class Complaints:
    """Logs a failure once per item and error (a poisoned record is not news every
    half second); repeats go to debug. Shared by the sweeps and the reaper."""

    def __init__(self, who: str) -> None:
        self.who = who
        self._seen: dict[str, str] = {}

    def __call__(self, item: str, exc: BaseException) -> None:
        what = f"{type(exc).__name__}: {exc}"
        if self._seen.get(item) == what:
            log.debug("%s: %s still fails: %s", self.who, item, what)
            return
        if len(self._seen) > 10_000:
            self._seen.clear()
        self._seen[item] = what
        if isinstance(exc, BatonError):
            log.warning("%s: %s failed: %s", self.who, item, what)
        else:
            log.error("%s: %s failed", self.who, item, exc_info=exc)

    def cleared(self, item: str) -> None:
        self._seen.pop(item, None)


#: seconds an idle alarm sleeps at most before it reads the wall clock again (due
#: times are wall-clock times, which may jump; no etcd request)
NAP = 30.0
#: seconds before a broken watch is set up again (the bound after one break), and the
#: most it grows to while the watch keeps breaking
REWATCH_DELAY, REWATCH_CAP = 0.5, 5.0
REWATCH = Backoff(REWATCH_DELAY, REWATCH_CAP, floor=0.5)
#: a sweep's head read first looks this many seconds ahead (etcd walks only the keys
#: of the range it reads: the keys due soon, not every key of the index)
NEAR = 60.0


class Dues:
    """The earliest due time (epoch seconds) known of each scope of an index (a task's
    keys in ``delayed/``, or all of ``deadlines/``): never later than its earliest key,
    as long as every key written is told (``saw``) and every look at a scope says what
    it found (``learnt``)."""

    def __init__(self) -> None:
        self._due: dict[str, float] = {}
        #: per scope, the number of the last key told: a look that began before it
        #: must not forget it
        self._told: dict[str, int] = {}
        self._numbers = itertools.count(1)

    def saw(self, scope: str, due: float) -> None:
        """A key due at ``due`` was written under ``scope``."""
        if due < self._due.get(scope, math.inf):
            self._due[scope] = due
        self._told[scope] = next(self._numbers)

    def marks(self) -> dict[str, int]:
        """Taken before a look: what it may overwrite (``learnt``)."""
        return dict(self._told)

    def learnt(self, scope: str, due: float | None, marks: dict[str, int]) -> None:
        """A look begun at ``marks`` found ``scope``'s earliest key due at ``due`` (None:
        no key). Keys told of since the look began are kept."""
        if self._told.get(scope, 0) != marks.get(scope, 0):
            if due is not None:
                self.saw(scope, due)
            return
        if due is None:
            self._due.pop(scope, None)
            self._told.pop(scope, None)
        else:
            self._due[scope] = due

    def due(self, now: float) -> list[str]:
        """The scopes with a key due by ``now``."""
        return [scope for scope, due in self._due.items() if due <= now]

    def scopes(self) -> list[str]:
        return list(self._due)

    def next(self) -> float:
        return min(self._due.values(), default=math.inf)


class Alarm:
    """When one sweep runs next: rung by a write to its index (``ring``), due at the
    earliest time its :class:`Dues` knows of or it asked for (``wake_at``), or owed a
    full look (``look``)."""

    def __init__(self, clock: Callable[[], float], dues: Dues | None = None) -> None:
        self.clock = clock
        self.dues = dues
        self._rung = False
        self._whole = False
        self._at = math.inf
        self._poke = asyncio.Event()
        #: sweeps run on it (for tests and the curious)
        self.swept = 0

    def ring(self) -> None:
        self._rung = True
        self._poke.set()

    def look(self) -> None:
        self._whole = True
        self._poke.set()

    def wake_at(self, t: float) -> None:
        if t < self._at:
            self._at = t
            self._poke.set()

    def poke(self) -> None:
        """Something the due time depends on changed (its ``Dues`` were told)."""
        self._poke.set()

    @property
    def due(self) -> float:
        return min(self._at, self.dues.next() if self.dues is not None else math.inf)

    def ready(self) -> bool:
        return self._rung or self._whole or self.clock() >= self.due

    def take(self) -> bool:
        """Before a sweep runs: whether it is to look whole; rings and a time asked for
        are then spent (one that comes during the sweep runs it again)."""
        whole = self._whole
        self._rung = self._whole = False
        self._at = math.inf
        return whole

    async def wait(self, longest: float) -> None:
        """Return once the sweep is to run, or after ``longest`` seconds."""
        loop = asyncio.get_running_loop()
        until = loop.time() + longest
        while not self.ready():
            left = min(self.due - self.clock(), until - loop.time(), NAP)
            if left <= 0:
                return
            self._poke.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), left)


Handler = Callable[[list[WatchEvent]], None]


class SweepWatch:
    """The leader's one etcd watch over the indexes its sweeps read: each batch of
    events is handed to the handler of the prefix it is under; at the start of each
    watch every alarm is owed a full look."""

    def __init__(self, core: Core, election: Election) -> None:
        self.core = core
        self.election = election
        self._routes: list[tuple[Watched, Handler]] = []
        self._alarms: list[Alarm] = []
        self._ended: list[Callable[[], None]] = []
        #: watches started (the first of each term included) and broken, for tests and
        #: metrics; the revision the watch has come to
        self.starts = 0
        self.breaks = 0
        self.revision = 0

    @property
    def alarms(self) -> list[Alarm]:
        return list(self._alarms)

    def follow(self, watched: Watched, handler: Handler) -> None:
        """Hand every event under ``watched.prefix`` (those it asks for) to ``handler``."""
        self._routes.append((watched, handler))

    def alarm(self, dues: Dues | None = None) -> Alarm:
        """A sweep's alarm, owed a full look whenever the watch starts."""
        alarm = Alarm(self.core.clock, dues)
        self._alarms.append(alarm)
        return alarm

    def when_ended(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` whenever a watch ends (the lead lost, the watch broken)."""
        self._ended.append(hook)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the indexes while this replica leads, until ``stop``."""
        broken = 0  # breaks in a row: a watch that ran REWATCH_CAP s starts them over
        while await self.election.until_leading(stop):
            began = time.monotonic()
            try:
                await _until(stop, self.election, self._follow())
            except BatonError as e:
                self.breaks += 1
                log.warning("sweeps: watch broken (%s); every sweep looks whole again", e)
            except Exception:
                self.breaks += 1
                log.exception("sweeps: watch crashed; every sweep looks whole again")
            finally:
                for hook in self._ended:
                    hook()
            broken = 1 if time.monotonic() - began >= REWATCH_CAP else broken + 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), REWATCH.delay(broken))

    async def _follow(self) -> None:
        # The revision now, read before any look is asked for: the watch brings
        # everything after it, so nothing falls between a look and the watch.
        _, at, _ = await self.core.etcd.range(self.core.keys.tasks(), limit=1, keys_only=True)
        self.revision = at
        self.starts += 1
        for alarm in self._alarms:
            alarm.look()
        # Progress notifications on the first prefix only: one is enough to hear that
        # the stream lives, and each costs a message per interval.
        watched = [dataclasses.replace(w, progress=n == 0)
                   for n, (w, _) in enumerate(self._routes)]
        watch = self.core.etcd.watch_many(watched, at + 1)
        async with contextlib.aclosing(watch):
            async for item in watch:
                if isinstance(item, int):
                    self.revision = max(self.revision, item)  # alive, idle
                    continue
                self._dispatch(item)

    def _dispatch(self, batch: list[WatchEvent]) -> None:
        self.revision = max(self.revision, batch[-1].kv.mod_revision)
        for watched, handler in self._routes:
            mine = [ev for ev in batch if ev.kv.key.startswith(watched.prefix)]
            if mine:
                try:
                    handler(mine)
                except Exception:  # one handler's fault never stops the others
                    log.exception("sweeps: handling events under %r failed", watched.prefix)


async def _until(stop: asyncio.Event, election: Election, work: Awaitable[None]) -> None:
    """Run ``work`` until it ends, ``stop`` is set or ``election`` no longer leads."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    lost = asyncio.ensure_future(election.until_not_leading())
    try:
        await asyncio.wait({task, stopped, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (stopped, lost):
            t.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.done() and not task.cancelled():
        task.result()  # its error, if it failed


async def run_sweep(election: Election, alarm: Alarm, sweep: Callable[[bool], Awaitable[object]],
                    what: str, interval: float, stop: asyncio.Event,
                    full_every: float = 0.0) -> None:
    """Run ``sweep(whole)`` while ``election`` leads, each time ``alarm`` says, at most
    once per ``interval`` seconds, whole at least every ``full_every`` seconds (0: only
    when owed). A sweep that fails is logged and owes a full look."""
    loop = asyncio.get_running_loop()
    last = -math.inf
    last_whole = loop.time()
    while await election.until_leading(stop):
        longest = (last_whole + full_every - loop.time()) if full_every > 0 else math.inf
        await _until(stop, election, alarm.wait(max(0.0, longest)))
        if stop.is_set() or not election.is_leader:
            continue
        pause = last + interval - loop.time()
        if pause > 0:  # coalesced: what else comes meanwhile is swept with it
            await _until(stop, election, asyncio.sleep(pause))
            if stop.is_set() or not election.is_leader:
                continue
        overdue = full_every > 0 and loop.time() >= last_whole + full_every
        if not (alarm.ready() or overdue):
            continue
        whole = alarm.take() or overdue
        last = loop.time()
        if whole:
            last_whole = last
        try:
            await sweep(whole)
        except BatonError as e:
            log.warning("%s sweep failed: %s", what, e)
            alarm.look()
        except Exception:
            log.exception("%s sweep crashed", what)
            alarm.look()
        finally:
            alarm.swept += 1


def due_of(key: bytes, base: bytes) -> float:
    """The due time (epoch seconds) of an index key ``base{due ms}/...``."""
    return int(key[len(base):].split(b"/", 1)[0]) / 1000


async def head_due(core: Core, base: bytes) -> float | None:
    """The due time of the first key of an index ``base{due}/...`` (None: it holds no
    key), read with the range first ending ``NEAR`` seconds from now, so that etcd walks
    only the keys due by then; only if none is, the whole index is read (a key, its
    count)."""
    near = core.keys.due_until(base, int((core.clock() + NEAR) * 1000))
    for end in (near, b""):
        kvs, _, _ = await core.etcd.range(base, limit=1, keys_only=True, end=end)
        if kvs:
            return due_of(kvs[0].key, base)
    return None


def told(dues: Dues, alarm: Alarm, base: bytes, scope_of: Callable[[list[str]], str]
         ) -> Handler:
    """A handler for an index ``base{...}`` whose keys name their due time: each key
    put is told to ``dues`` under the scope ``scope_of`` its parts says, and the alarm
    poked."""

    def handle(batch: list[WatchEvent]) -> None:
        for ev in batch:
            parts = ev.kv.key[len(base):].decode(errors="replace").split("/")
            try:
                scope = scope_of(parts)
                due = due_of(ev.kv.key, Keys.below(base, scope) if scope else base)
            except (ValueError, IndexError):
                alarm.ring()  # a key that names no due time: let the sweep complain of it
                continue
            dues.saw(scope, due)
        alarm.poke()

    return handle


def rings(alarm: Alarm) -> Handler:
    """A handler that rings ``alarm`` for any event."""

    def handle(batch: Iterable[WatchEvent]) -> None:
        alarm.ring()

    return handle


def follow_due(watch: SweepWatch, base: bytes, dues: Dues) -> Alarm:
    """Follow the keys put under an index ``base{due}/...`` (deadlines, stalls, cancels)
    into ``dues``; the alarm of its sweep."""
    alarm = watch.alarm(dues)
    watch.follow(Watched(base, deletes=False), told(dues, alarm, base, lambda parts: ""))
    return alarm


async def swept_due(core: Core, base: bytes, dues: Dues,
                    sweep: Callable[[], Awaitable[int]]) -> int:
    """Run ``sweep`` (of the keys of ``base{due}/...`` due by now), then learn when the
    next key is due from the index's head."""
    marks = dues.marks()
    done = await sweep()
    dues.learnt("", await head_due(core, base), marks)
    return done
