"""Consuming a file safely, for asyncio: ``consumer``'s helpers on an
:class:`~baton_relay.client.aio.AsyncSession`.

    async with AsyncClient(registry) as c, c.session("ocr-1") as s:
        async with aconsume(s, "t1", group="default", timeout=30) as got:
            print(got.data)
        async for got in aconsume_each(s, "t1"):
            work(got.data)

They wait, check and hand back as the blocking ones do, with the same code for the
file work (``consumer.read_verified``: the leased path reached without a symlink, only
the verified size read, the digest checked; it runs in a worker thread, so the loop
goes on meanwhile) and for what a wait decides (``consumer.wait_span``,
``consumer.wakes``); only the calls to the registry are awaited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

from ..kernel import tracing
from ..kernel.errors import BatonError, Draining, NothingToClaim, Unavailable
from ..kernel.v1 import baton_pb2 as pb
from ._wire import Lease
from .aio import AsyncSession
from .consumer import (
    Delivered,
    consumption,
    nacked,
    part_leases,
    pause_or_raise,
    read_verified,
    wait_span,
    wakes,
    watch_from,
)

__all__ = ["AsyncDelivery", "aconsume", "aconsume_each", "anext_lease", "aparts_of",
           "aread_verified"]


async def anext_lease(session: AsyncSession, task_id: str, group: str = "default",
                      timeout: float | None = None) -> Lease:  # noqa: ASYNC109
    """``next_lease``: consume the next verified entry for ``group``, waiting for one
    (event-driven, on a ``Watch`` opened before the first attempt) if needed. Raises
    ``NothingToClaim`` when ``timeout`` passes, ``Draining`` once the session's host is
    drained, and ``Unavailable`` at once when a consume's outcome is unknown."""
    deadline = None if timeout is None else time.monotonic() + timeout
    revision, attempt, broken = 0, True, 0
    while True:
        wait = wait_span(deadline, timeout, task_id, group, session)
        events = session.client.watch(task_id, timeout=wait, **watch_from(revision))
        try:
            if not revision:
                try:
                    synced = await anext(events, None)  # SYNCED: the watch is in place
                except Unavailable as e:
                    broken += 1
                    await asyncio.sleep(pause_or_raise(deadline, e, broken))
                    continue
                if synced is None:
                    continue
                revision, attempt, broken = synced.revision, True, 0
            if attempt:
                # Unavailable here is not retried: the consume may have been applied
                # with its reply lost, so a lease may be held; the caller must know it.
                try:
                    return await session.consume(task_id, group)
                except NothingToClaim:
                    attempt = False
            try:
                async for event in events:
                    revision = max(revision, event.revision)
                    if wakes(event, group):
                        attempt = True
                        break
            except Unavailable as e:
                revision, attempt = 0, True  # start afresh: the watch, then an attempt
                broken += 1
                await asyncio.sleep(pause_or_raise(deadline, e, broken))
        finally:
            events.cancel()


async def aread_verified(lease: Lease) -> bytes:
    """``read_verified`` in a worker thread: the leased entry's bytes, checked against
    the verified digest (``ChecksumMismatch`` otherwise)."""
    return await asyncio.to_thread(read_verified, lease)


async def aparts_of(session: AsyncSession, lease: Lease) -> list[Lease]:
    """``parts_of``: the parts of a leased assembly, in order, each a lease of its own,
    checked against what the assembly was verified with."""
    parts = [await session.client.get_entry(lease.task_id, name)
             for name in lease.entry.parts]
    return part_leases(lease, parts)


@dataclass
class AsyncDelivery(Delivered):
    """A leased entry's checked bytes (``Delivery``, for asyncio)."""

    _session: AsyncSession | None = None
    #: the span of this consumption (traces on; "" = untraced)
    traceparent: str = ""

    async def checkpoint(self, *, data: bytes = b"", progress: float = 0.0,
                         message: str = "") -> pb.Checkpoint:
        """Record how far the work on this entry got: if it is not acked, the group's
        next lease of it carries ``data`` (``lease.checkpoint``) to resume from."""
        assert self._session is not None, "an AsyncDelivery made by aconsume() checkpoints"
        lease = self.lease
        with tracing.child(self.traceparent, "baton.checkpoint", progress=progress):
            return await self._session.checkpoint(
                lease.task_id, lease.file_id, lease.token, data=data, progress=progress,
                message=message, group=lease.group)


@asynccontextmanager
async def _delivered(session: AsyncSession, lease: Lease,
                     trace: str = "") -> AsyncIterator[AsyncDelivery]:
    """Yield the lease's checked bytes; a block that raises nacks the entry."""
    try:
        with tracing.child(trace, "baton.read", size=lease.size):
            if lease.entry.parts:
                data = b"".join([await aread_verified(part)
                                 for part in await aparts_of(session, lease)])
            else:
                data = await aread_verified(lease)
        yield AsyncDelivery(lease, data, session, trace)
    except BaseException as e:
        # The lease may be gone already; the reaper hands the entry back then.
        with suppress(BatonError):
            await session.nack(lease.task_id, lease.file_id, lease.group, lease.token,
                               **nacked(e))
        raise


@asynccontextmanager
async def aconsume(session: AsyncSession, task_id: str, group: str = "default",
                   timeout: float | None = None) -> AsyncIterator[AsyncDelivery]:  # noqa: ASYNC109
    """``consume``: yield the next verified entry's checked bytes; ack when the block
    ends. Bytes that do not match the verified digest, or a block that raises, nack
    the entry (a ``PermanentError`` gives it up, a ``RetryAfter`` hands it back after
    its delay) and the error propagates."""
    lease = await anext_lease(session, task_id, group, timeout)
    with consumption(lease) as trace:
        async with _delivered(session, lease, trace) as delivery:
            yield delivery
        with tracing.child(trace, "baton.ack"):
            await session.ack(task_id, lease.file_id, group, lease.token)


async def aconsume_each(session: AsyncSession, task_id: str, group: str = "default",
                        timeout: float | None = None  # noqa: ASYNC109
                        ) -> AsyncIterator[AsyncDelivery]:
    """``consume_each``: the group's verified entries one after another, each acked
    when the loop asks for the next, in the same message as the next one's consume.
    Ends without an error when none is verified within ``timeout`` or once the
    session's host is drained. Leaving the loop early nacks the entry in hand; as for
    any async generator, that happens when the generator is closed, so a loop that
    may ``break`` wraps it in ``contextlib.aclosing``."""
    lease: Lease | None = None
    while True:
        if lease is None:
            if session.draining:
                return
            try:
                lease = await anext_lease(session, task_id, group, timeout)
            except (NothingToClaim, Draining):
                return
        with consumption(lease) as trace:
            async with _delivered(session, lease, trace) as delivery:
                yield delivery
            with tracing.child(trace, "baton.ack"):
                if not session.draining:
                    _, lease = await session.ack_and_consume(task_id, lease.file_id, group,
                                                             lease.token)
                else:
                    await session.ack(task_id, lease.file_id, group, lease.token)
                    lease = None
