"""One etcd watch per followed prefix per replica, shared by every client stream on it.

A client's ``Watch`` (a task's entries) or ``WatchTasks`` stream used to open an etcd
watch of its own: a hundred consumers and watchers following one task meant a hundred
watch streams to etcd, each event sent, decoded and turned into records a hundred times.
Here the first stream on a prefix opens one watch (a :class:`_Feed`); later streams
join it and are handed the same batches. A stream joins only where the shared watch has
not yet delivered its start revision, so it misses nothing and sees nothing twice:

- a stream that starts now or after a snapshot read now (the usual case) asks for a
  revision past anything the feed can have delivered, and joins;
- a stream resuming from an older revision than the feed has passed (a client back
  after a disconnect) is served by a watch of its own, as before;
- a stream that falls more than ``limit`` batches behind (a slow reader) leaves the feed
  and goes on, from the revision after the last batch it took, on a watch of its own —
  it never holds the others back and never loses an event.

Every watch asks etcd for progress notifications: while nothing under its prefix
changes, etcd says now and then (``--experimental-watch-progress-notify-interval``)
which revision the watch has come to, in order with its events. Each stream is handed
them as :class:`Progress` (a revision it has been given every event up to), which the
``Watch`` RPC passes on to clients that ask, so that an idle client stream resumes from
a revision etcd's compaction has not removed.

An error of the shared watch (its revision compacted, etcd unreachable) ends every
stream on it with that error, as it would have ended each one's own watch; the next
stream opens a new feed. The feed ends when its last stream leaves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .etcd import Etcd, WatchEvent

log = logging.getLogger(__name__)

#: batches a stream may have waiting before it leaves the feed for a watch of its own
DEFAULT_LIMIT = 1024

Batch = list[WatchEvent]


@dataclass(frozen=True, slots=True)
class Progress:
    """Every event under the prefix up to ``revision`` has been handed out."""

    revision: int


class _End:
    """The feed's watch ended without an error (the stream ends too)."""


class _Behind:
    """The stream fell ``limit`` batches behind and left the feed."""


_END, _BEHIND = _End(), _Behind()


@dataclass(eq=False)
class _Stream:
    """One client stream on a feed: the first revision it wants and what waits for it."""

    start: int
    waiting: asyncio.Queue[Batch | Progress | BaseException | _End | _Behind] = field(
        default_factory=asyncio.Queue)
    behind: bool = False


@dataclass(eq=False)
class _Feed:
    prefix: bytes
    #: the last revision handed to the streams (events up to it are past)
    delivered: int
    streams: set[_Stream] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


class Fanout:
    """Shared etcd watches of one replica, by prefix."""

    def __init__(self, etcd: Etcd, limit: int = DEFAULT_LIMIT) -> None:
        self.etcd = etcd
        self.limit = limit
        self._feeds: dict[bytes, _Feed] = {}
        #: streams served by a watch of their own since start (resumed from the past,
        #: or fallen behind), for tests and the curious
        self.private = 0

    @property
    def feeds(self) -> int:
        """Shared etcd watches open now."""
        return len(self._feeds)

    def streams(self, prefix: bytes) -> int:
        """Client streams on the shared watch of ``prefix`` now."""
        feed = self._feeds.get(prefix)
        return len(feed.streams) if feed else 0

    async def follow(self, prefix: bytes, start: int) -> AsyncIterator[Batch | Progress]:
        """Batches of events under ``prefix`` from revision ``start`` (inclusive), as
        :meth:`Etcd.watch` gives them, from the shared watch where it can; and, while
        nothing changes, :class:`Progress` now and then."""
        feed = self._feeds.get(prefix)
        if feed is None:
            feed = self._open(prefix, start)
        elif start <= feed.delivered:
            # The feed is past this start: only a watch of its own has those events.
            self.private += 1
            async for own in self._own(prefix, start):
                yield own
            return
        stream = _Stream(start)
        feed.streams.add(stream)
        after = start - 1
        try:
            while True:
                item = await stream.waiting.get()
                if isinstance(item, BaseException):
                    raise item
                if item is _END:
                    return
                if isinstance(item, _Behind):
                    break
                if isinstance(item, Progress):
                    after = max(after, item.revision)
                    yield item
                    continue
                assert isinstance(item, list)
                after = item[-1].kv.mod_revision
                yield item
        finally:
            self._leave(feed, stream)
        # Fallen behind: on from the revision after the last batch taken.
        self.private += 1
        log.info("watch of %r: a stream fell %d batches behind; it goes on alone",
                 prefix, self.limit)
        async for own in self._own(prefix, after + 1):
            yield own

    async def _own(self, prefix: bytes, start: int) -> AsyncIterator[Batch | Progress]:
        """A watch of a stream's own, its progress notifications as :class:`Progress`."""
        async for got in self.etcd.watch_progress(prefix, start):
            yield Progress(got) if isinstance(got, int) else got

    def _open(self, prefix: bytes, start: int) -> _Feed:
        feed = _Feed(prefix, delivered=start - 1)
        self._feeds[prefix] = feed
        feed.task = asyncio.get_running_loop().create_task(
            self._run(feed, start), name=f"fanout {prefix!r}")
        return feed

    def _leave(self, feed: _Feed, stream: _Stream) -> None:
        feed.streams.discard(stream)
        if not feed.streams and self._feeds.get(feed.prefix) is feed:
            del self._feeds[feed.prefix]
            if feed.task is not None:
                feed.task.cancel()

    async def _run(self, feed: _Feed, start: int) -> None:
        ending: BaseException | _End = _END
        try:
            async for item in self.etcd.watch_progress(feed.prefix, start):
                if isinstance(item, int):
                    self._hand_progress(feed, item)
                else:
                    self._hand_out(feed, item)
        except asyncio.CancelledError:
            return  # its last stream left
        except Exception as e:  # every stream on it ends with the watch's error
            ending = e
        # No stream may join a feed that has ended; those on it are told.
        if self._feeds.get(feed.prefix) is feed:
            del self._feeds[feed.prefix]
        for stream in feed.streams:
            stream.waiting.put_nowait(ending)

    def _hand_out(self, feed: _Feed, batch: Batch) -> None:
        """Give ``batch`` to every stream (the events from its start on) and note it
        delivered — in one step of the loop, so that no stream joins in between."""
        feed.delivered = batch[-1].kv.mod_revision
        for stream in feed.streams:
            if stream.behind:
                continue
            mine = batch if batch[0].kv.mod_revision >= stream.start else [
                ev for ev in batch if ev.kv.mod_revision >= stream.start]
            if not mine:
                continue
            if stream.waiting.qsize() >= self.limit:
                stream.behind = True
                stream.waiting.put_nowait(_BEHIND)
                continue
            stream.waiting.put_nowait(mine)

    def _hand_progress(self, feed: _Feed, revision: int) -> None:
        """Tell every stream the feed has handed out everything up to ``revision``
        (those it takes it to: a stream that started later already knows more)."""
        for stream in feed.streams:
            if (stream.behind or revision < stream.start
                    or stream.waiting.qsize() >= self.limit):
                continue
            stream.waiting.put_nowait(Progress(revision))
