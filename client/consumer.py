"""Consuming a file safely: wait for a verified entry, check its digest, ack.

The staging tree is shared, so the leased path is not trusted: it is opened one
component at a time from the staging root with ``O_NOFOLLOW`` (as the producer
helper and the watcher do), only a regular file is read, and never more than
the entry's verified size plus one byte, which is what tells a longer file.

An assembly (an entry with ``parts``) has no file of its own: its bytes are its
parts', in order, each read and checked as a file of its own. Each part is held
in memory whole until its digest is checked, never more than one at a time with
``iter_parts``: parts of 8 to 64 MiB keep that small (and a producer's claim on
one part short).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Protocol

import blake3

from ..kernel import tracing
from ..kernel.backoff import Backoff
from ..kernel.contract import assembly_digest
from ..kernel.errors import (
    BatonError,
    ChecksumMismatch,
    Draining,
    NothingToClaim,
    Unavailable,
)
from ..kernel.names import state_name
from ..kernel.v1 import baton_pb2 as pb
from ._client import Client, Session
from ._wire import Lease
from .failures import handing_back
from .staging import Refusal, open_entry_dir

# O_NONBLOCK: opening a FIFO for reading must not wait for a writer (it is refused
# after fstat); it changes nothing for a regular file. O_NOCTTY: a terminal device
# planted there never becomes our controlling terminal.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def next_lease(
    client: Client,
    session: Session | int,
    task_id: str,
    group: str = "default",
    timeout: float | None = None,
) -> Lease:
    """Consume the next verified entry for ``group``, waiting for one if needed.

    Waiting is event-driven: a ``Watch`` opened at the current revision is
    started before the first attempt, so an entry verified between the attempt and
    the wait still wakes us. Raises ``NothingToClaim`` when ``timeout`` passes,
    and ``Draining`` once the session's host is drained (a keepalive says so
    while we wait: each wait then lasts at most a third of the session's TTL).
    A wait that ends with nothing verified is resumed from the revision its watch
    had come to (the registry's progress events keep it current while the task is
    idle), without another attempt: an idle consumer costs the registry one resumed
    stream per wait, and no read of the task. A broken watch is opened again; a
    consume whose outcome is unknown (the registry became unreachable before it
    replied) raises ``Unavailable`` at once, never ``NothingToClaim``: it may have
    leased an entry to the session, which only the session's end (``close`` with
    revoke) hands back.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    #: the revision the watch has come to (0: none yet); an attempt is due when a
    #: verification for the group was seen, or no watch stood yet
    revision, attempt = 0, True
    #: the watch's breaks in a row, which pace the next try (``WATCH_BACKOFF``)
    broken = 0
    while True:
        kept = session if isinstance(session, Session) else None
        wait = wait_span(deadline, timeout, task_id, group, kept)
        # only moves into verified are sent: a waiting consumer is not woken by the
        # task's other moves
        events = client.watch(task_id, timeout=wait, **watch_from(revision))
        try:
            if not revision:
                try:
                    synced = next(events, None)  # SYNCED: the watch is in place
                except Unavailable as e:
                    broken += 1
                    time.sleep(pause_or_raise(deadline, e, broken))
                    continue
                if synced is None:
                    continue
                revision, attempt, broken = synced.revision, True, 0
            if attempt:
                # Unavailable here is not retried: the consume may have been applied
                # with its reply lost, so a lease may be held; the caller must know it.
                try:
                    return client.consume(task_id, group, session=session)
                except NothingToClaim:
                    attempt = False
            try:
                for event in events:
                    revision = max(revision, event.revision)
                    if wakes(event, group):
                        attempt = True
                        break
            except Unavailable as e:
                revision, attempt = 0, True  # start afresh: the watch, then an attempt
                broken += 1
                time.sleep(pause_or_raise(deadline, e, broken))
        finally:
            events.close()


class Kept(Protocol):
    """What the wait for a lease reads of a session kept alive (blocking or asyncio)."""

    session_id: int

    @property
    def ttl(self) -> int: ...

    @property
    def draining(self) -> bool: ...


def wait_span(deadline: float | None, timeout: float | None, task_id: str, group: str,
              session: Kept | None) -> float | None:
    """How long the next watch of a wait for a lease may last (None: no end): to the
    caller's deadline, and, for a session kept alive, at most a third of its TTL, so
    that a drained host is seen. Raises ``NothingToClaim`` once the deadline passed,
    ``Draining`` once the session's host is drained."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        raise NothingToClaim(f"nothing verified for group {group!r} within {timeout}s",
                             task_id=task_id, group=group)
    if session is None:
        return left
    if session.draining:
        raise Draining(f"session {session.session_id:x} is draining: no new work",
                       session_id=session.session_id)
    return min(left if left is not None else session.ttl, max(session.ttl / 3, 0.5))


def watch_from(revision: int) -> dict[str, Any]:
    """The watch a wait for a lease opens: from the revision it had come to (0: now,
    its first message saying so), only moves into verified, with progress."""
    return {"start_revision": revision + 1 if revision else -1,
            "states": [pb.ENTRY_STATE_VERIFIED], "progress": True, "catch_up": True}


def wakes(event: pb.TaskEvent, group: str) -> bool:
    """Whether ``event`` is an entry verified for ``group``: a consume is worth trying."""
    return (event.kind == pb.TaskEvent.KIND_CHANGED
            and event.entry.state == pb.ENTRY_STATE_VERIFIED
            and group in event.entry.consumers)


#: between a consumer's watch that broke and the next one: Baton's one jittered backoff
WATCH_BACKOFF = Backoff(0.1, 2.0)


def pause_or_raise(deadline: float | None, error: Unavailable, broken: int,
                   backoff: Backoff = WATCH_BACKOFF) -> float:
    """The watch broke (nothing was taken) for the ``broken``-th time in a row: the
    seconds to wait before looking again (the backoff's, never past the caller's
    deadline), or ``error`` raised once the caller's time is up."""
    delay = backoff.delay(broken)
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise error
        delay = min(delay, left)
    return delay


def _refusal(lease: Lease) -> Refusal:
    def refused(reason: str) -> BatonError:
        return ChecksumMismatch(f"{lease.path}: {reason}; not the verified file",
                                task_id=lease.task_id, file_id=lease.file_id, path=lease.path)
    return refused


def _open_leased(lease: Lease) -> tuple[int, int]:
    """A descriptor of the leased file, reached without symlinks, and its size now:
    a regular file no longer than the verified size."""
    refused = _refusal(lease)
    parent, name = open_entry_dir(lease.task_id, lease.path, lease.entry.attempt_path,
                                  refused)
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refused("it is a symlink (refused, not followed)") from e
        raise
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refused("not a regular file")
        if st.st_size > lease.size:
            raise refused(f"{st.st_size} bytes, longer than the verified {lease.size}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_at_most(fd: int, limit: int) -> bytes:
    # One read usually returns it all, in one buffer; a file that changes meanwhile,
    # or one past Linux's 2 GiB per read, takes more (and a join).
    data = os.read(fd, limit)
    if not data or len(data) == limit:
        return data
    chunks, total = [data], len(data)
    while total < limit and (more := os.read(fd, limit - total)):
        chunks.append(more)
        total += len(more)
    return b"".join(chunks)


def read_verified(lease: Lease) -> bytes:
    """The bytes of a leased entry, after checking them against the verified digest.

    They are all held in memory, so this is for files that fit: no more than the
    verified size plus one byte is ever read, whatever the path leads to. Raises
    ``ChecksumMismatch`` when the path is not the verified file: different bytes,
    longer or shorter, a symlink anywhere below the staging root, or not a regular
    file (a FIFO, a device).
    """
    fd, size = _open_leased(lease)
    try:
        # Reading to the size seen, not the lease's, sizes the buffer by what is
        # there; the one byte more tells a file that grew since.
        data = _read_at_most(fd, size + 1)
    finally:
        os.close(fd)
    if len(data) > size:
        raise _refusal(lease)(f"grew while read, past {size} bytes (changed since verified)")
    digest = blake3.blake3(data).hexdigest()
    if len(data) != lease.size or digest != lease.digest:
        raise ChecksumMismatch(
            f"{lease.path}: read {len(data)} bytes with digest {digest}, expected "
            f"{lease.size} bytes with digest {lease.digest}",
            task_id=lease.task_id, file_id=lease.file_id,
        )
    return data


def parts_of(client: Client, lease: Lease) -> list[Lease]:
    """The parts of a leased assembly, in order, each as a lease of its own (under the
    assembly's token) for ``read_verified``.

    Checked before any byte is read: every part is still verified, and their digests
    and sizes are those the assembly was verified with. Raises ``ChecksumMismatch``
    otherwise (a part changed since; the registry takes the assembly back).
    """
    return part_leases(lease, [client.operator.get_entry(lease.task_id, name)
                                for name in lease.entry.parts])


def part_leases(lease: Lease, parts: list[pb.Entry]) -> list[Lease]:
    """``parts_of``'s check of an assembly's ``parts`` as the registry has them now."""
    what = f"assembly {lease.task_id}/{lease.file_id}"
    for part in parts:
        if part.state != pb.ENTRY_STATE_VERIFIED:
            raise ChecksumMismatch(
                f"{what}: part {part.file_id} is {state_name(part.state)}, "
                "no longer verified", task_id=lease.task_id, file_id=lease.file_id)
    size = sum(p.size for p in parts)
    digest = assembly_digest([p.digest for p in parts])
    if size != lease.size or digest != lease.digest:
        raise ChecksumMismatch(
            f"{what}: its parts now have {size} bytes and assembly digest {digest}, "
            f"expected {lease.size} bytes with digest {lease.digest}",
            task_id=lease.task_id, file_id=lease.file_id)
    return [Lease(lease.task_id, p.file_id, lease.group, lease.token, p.abs_attempt_path, p.size,
                  p.digest, p, lease.session_id) for p in parts]


def iter_parts(client: Client, lease: Lease) -> Iterator[bytes]:
    """The bytes of a leased assembly, one part at a time, in order, each checked
    against its verified digest before it is yielded (``read_verified``)."""
    for part in parts_of(client, lease):
        yield read_verified(part)


@dataclass
class Delivered:
    """A leased entry's checked bytes, what both surfaces' deliveries share."""

    lease: Lease
    #: the entry's checked bytes (an assembly's: its parts', in order)
    data: bytes


@dataclass
class Delivery(Delivered):
    #: where ``checkpoint`` is recorded: the client and the session holding the lease
    _client: Client | None = None
    _session: Session | int = 0
    #: the span of this consumption (traces on; "" = untraced): a producer that makes
    #: a file of the next stage from it may link its own to it
    traceparent: str = ""

    def checkpoint(self, *, data: bytes = b"", progress: float = 0.0,
                   message: str = "") -> pb.Checkpoint:
        """Record how far the work on this entry got: if it is not acked, the group's
        next lease of it carries ``data`` (``lease.checkpoint``) to resume from."""
        assert self._client is not None, "a Delivery made by consume() records checkpoints"
        lease = self.lease
        with tracing.child(self.traceparent, "baton.checkpoint", progress=progress):
            return self._client.checkpoint(lease.task_id, lease.file_id, lease.token,
                                           data=data, progress=progress, message=message,
                                           group=lease.group, session=self._session)


@contextmanager
def consume(
    client: Client,
    session: Session | int,
    task_id: str,
    group: str = "default",
    timeout: float | None = None,
) -> Iterator[Delivery]:
    """Yield the next verified entry's checked bytes; ack when the block ends.

    An assembly's bytes are its parts', in order, each checked (``iter_parts``; use
    it with ``next_lease`` to hold one part at a time instead of all of them). If
    the bytes do not match the verified digest, or the block raises, the entry is
    nacked (handed back to the group) and the error propagates: a ``PermanentError``
    gives it up (dead for every group), a ``RetryAfter`` hands it back after its
    delay (``baton_relay.client.failures``).
    """
    lease = next_lease(client, session, task_id, group, timeout)
    with consumption(lease) as trace:
        with _delivered(client, session, lease, trace) as delivery:
            yield delivery
        with tracing.child(trace, "baton.ack"):
            client.ack(task_id, lease.file_id, group, lease.token, session=session)


@contextmanager
def consumption(lease: Lease) -> Iterator[str]:
    """Within: the span of one group's consumption of an entry, ended with the block's
    error if it raises; yields its traceparent ("" when traces are off). The span is the
    child of the one the entry carries (the watcher's verification, so the hand-off
    reads producer → watcher → consumers in one trace)."""
    span: Any = None
    if tracing.ENABLED:
        span = tracing.start("baton.consume", parent=lease.entry.traceparent, attributes={
            "baton.task": lease.task_id, "baton.file_id": lease.file_id,
            "baton.group": lease.group, "baton.token": lease.token,
            "baton.attempt": lease.attempt, "baton.size": lease.size})
    try:
        yield tracing.traceparent(span)
    except BaseException as e:
        tracing.end(span, e)
        raise
    tracing.end(span)


@contextmanager
def _delivered(client: Client, session: Session | int, lease: Lease,
               trace: str = "") -> Iterator[Delivery]:
    """Yield the lease's checked bytes; a block that raises nacks the entry. ``trace``:
    the consumption's span ("" = untraced), the parent of the read's."""
    try:
        with tracing.child(trace, "baton.read", size=lease.size):
            data = (b"".join(iter_parts(client, lease)) if lease.entry.parts
                    else read_verified(lease))
        yield Delivery(lease, data, client, session, trace)
    except BaseException as e:
        # The lease may be gone already; the reaper hands the entry back then.
        with suppress(BatonError):
            client.nack(lease.task_id, lease.file_id, lease.group, lease.token,
                        session=session, **nacked(e))
        raise


def nacked(e: BaseException) -> dict[str, Any]:
    """How a lease whose work raised ``e`` is handed back: the reason, and whether
    for good (``PermanentError``) or after a delay (``RetryAfter``)."""
    permanent, delay = handing_back(e)
    return {"reason": f"{type(e).__name__}: {e}", "permanent": permanent, "delay": delay}


def consume_each(client: Client, session: Session, task_id: str, group: str = "default",
                 timeout: float | None = None) -> Iterator[Delivery]:
    """Consume the group's verified entries one after another: each delivery is
    yielded, and acked when the loop asks for the next.

    On a session kept on its stream, each ack takes the next entry in the same step
    (one message, one etcd transaction); when none is there, the loop waits for
    one as ``next_lease`` does. The loop ends, without an error, when none is
    verified within ``timeout`` or once the session's host is drained
    (``Session.draining``): the entry in hand is acked first, and no new one is
    taken. Leaving the loop early (``break``, an exception) nacks the entry in hand,
    as ``consume`` does.
    """
    lease: Lease | None = None
    while True:
        if lease is None:
            if session.draining:
                return
            try:
                lease = next_lease(client, session, task_id, group, timeout)
            except (NothingToClaim, Draining):
                return
        with consumption(lease) as trace:
            with _delivered(client, session, lease, trace) as delivery:
                yield delivery
            with tracing.child(trace, "baton.ack"):
                if session.stream is not None and not session.draining:
                    _, lease = client.ack_and_consume(task_id, lease.file_id, group,
                                                      lease.token, session=session)
                else:
                    client.ack(task_id, lease.file_id, group, lease.token, session=session)
                    lease = None
