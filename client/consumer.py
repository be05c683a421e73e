"""Consuming a file safely: wait for a verified entry, check its digest, ack."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import blake3

from ._client import Client, Lease, Session
from .errors import BatonError, ChecksumMismatch, NothingToClaim, Unavailable
from .v1 import baton_pb2 as pb


def next_lease(
    client: Client,
    session: Session | int,
    task_id: str,
    group: str = "default",
    timeout: float | None = None,
) -> Lease:
    """Consume the next verified entry for ``group``, waiting for one if needed.

    Waiting is event-driven: a ``Watch`` opened at the current revision is
    started before each attempt, so an entry verified between the attempt and
    the wait still wakes us. Raises ``NothingToClaim`` when ``timeout`` passes.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise NothingToClaim(f"nothing verified for group {group!r} within {timeout}s",
                                 task_id=task_id, group=group)
        events = client.watch(task_id, start_revision=-1, timeout=left)
        try:
            synced = next(events, None)  # SYNCED: the watch is in place
            if synced is None:
                continue
            try:
                return client.consume(task_id, group, session=session)
            except NothingToClaim:
                pass
            for event in events:
                if event.entry.state == pb.VERIFIED and group in event.entry.consumers:
                    break
        except Unavailable:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
        finally:
            events.close()


def read_verified(lease: Lease) -> bytes:
    """The bytes of a leased entry, after checking them against the verified digest."""
    data = Path(lease.path).read_bytes()
    digest = blake3.blake3(data).hexdigest()
    if len(data) != lease.size or digest != lease.digest:
        raise ChecksumMismatch(
            f"{lease.path}: read {len(data)} bytes with digest {digest}, expected "
            f"{lease.size} bytes with digest {lease.digest}",
            task_id=lease.task_id, file_id=lease.file_id,
        )
    return data


@dataclass
class Delivery:
    lease: Lease
    data: bytes


@contextmanager
def consume(
    client: Client,
    session: Session | int,
    task_id: str,
    group: str = "default",
    timeout: float | None = None,
) -> Iterator[Delivery]:
    """Yield the next verified entry's checked bytes; ack when the block ends.

    If the bytes do not match the verified digest, or the block raises, the
    entry is nacked (handed back to the group) and the error propagates.
    """
    lease = next_lease(client, session, task_id, group, timeout)
    try:
        delivery = Delivery(lease, read_verified(lease))
        yield delivery
    except BaseException as e:
        # The lease may be gone already; the reaper hands the entry back then.
        with suppress(BatonError):
            client.nack(task_id, lease.file_id, group, lease.token,
                        reason=f"{type(e).__name__}: {e}")
        raise
    client.ack(task_id, lease.file_id, group, lease.token)
