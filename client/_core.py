"""The agent's calls, each written once: the request it sends, the reply it unwraps,
the errors it raises. How a call travels is a subclass's: a message on a session's
stream (:class:`~baton_relay.client.aio.AsyncSession`) or a unary RPC
(:class:`UnarySession`). The blocking :class:`~baton_relay.client.Client` runs these
on its event loop; it implements none of them itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ..kernel import errors, tracing
from ..kernel.backoff import Backoff
from ..kernel.v1 import baton_pb2 as pb
from ._wire import Attributes, Claim, Lease, encode_attributes
from .retry import BACKPRESSURE_BACKOFF, BACKPRESSURE_WAIT, waiting_line

__all__ = ["AgentCore", "UnarySession"]

log = logging.getLogger("baton.client")

#: each call's unary method (its request and reply are those of its stream message)
UNARY = {"claim": "Claim", "claim_batch": "ClaimBatch", "commit": "Commit",
         "commit_batch": "CommitBatch", "fail": "Fail", "checkpoint": "Checkpoint",
         "consume": "Consume", "consume_batch": "ConsumeBatch", "ack": "Ack",
         "ack_batch": "AckBatch", "nack": "Nack", "keepalive": "KeepAlive"}


class AgentCore:
    """The agent's calls over ``_ask``, which sends one and returns its reply (the
    message a unary call of the same name returns), or raises the domain error.

    ``draining`` turns True once a call that takes new work is refused with
    ``Draining``: the session's host is drained."""

    session_id: int = 0
    draining: bool = False

    async def _ask(self, kind: str, request: Any, wait: float | None = None) -> Any:
        raise NotImplementedError

    async def _work(self, kind: str, request: Any) -> Any:
        """A call that takes new work: a ``Draining`` refusal marks the session."""
        try:
            return await self._ask(kind, request)
        except errors.Draining:
            self.draining = True
            raise

    async def claim(self, task_id: str, file_id: str = "", *,
                    traceparent: str | None = None) -> Claim:
        """Claim an entry (or the next claimable one) for writing. ``traceparent``: the
        span of the attempt, kept on the entry (traces on; None: the current span)."""
        r = await self._work("claim", pb.ClaimRequest(
            task_id=task_id, file_id=file_id, session_id=self.session_id,
            traceparent=tracing.current() if traceparent is None else traceparent))
        return Claim.of(task_id, r, self.session_id)

    async def claim_waiting(self, task_id: str, file_id: str = "", *,
                            wait: float = BACKPRESSURE_WAIT,
                            backoff: Backoff = BACKPRESSURE_BACKOFF,
                            traceparent: str | None = None) -> Claim:
        """``claim``, waiting out ``Backpressure`` (a consumer group of the task at its
        backlog limit) with jittered backoff for up to ``wait`` seconds, then raising
        the last refusal; logged at INFO once per wait."""
        deadline = time.monotonic() + wait
        failures = 0
        while True:
            try:
                return await self.claim(task_id, file_id, traceparent=traceparent)
            except errors.Backpressure as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                failures += 1
                if failures == 1:
                    log.info(waiting_line(e, wait))
                await asyncio.sleep(min(backoff.delay(failures), left))

    async def claim_batch(self, task_id: str, max_count: int) -> list[Claim]:
        """Claim up to ``max_count`` entries in one transaction (all or nothing)."""
        r = await self._work("claim_batch", pb.ClaimBatchRequest(
            task_id=task_id, session_id=self.session_id, max=max_count))
        return [Claim.of(task_id, c, self.session_id) for c in r.claims]

    async def commit(self, task_id: str, file_id: str, token: int, size: int,
                     digest: str = "", *, attributes: Attributes = None) -> pb.Entry:
        """Publish a claim's file: its size and BLAKE3 ``digest`` (required unless the
        task sets ``digest_optional``). ``attributes``: what the task's routing rules
        look at (see ``encode_attributes``)."""
        r = await self._ask("commit", pb.CommitRequest(
            task_id=task_id, file_id=file_id, token=token, size=size, digest=digest,
            session_id=self.session_id, attributes=encode_attributes(attributes)))
        return r.entry  # type: ignore[no-any-return]

    async def commit_batch(self, commits: Sequence[tuple[str, str, int, int, str]
                                                   | tuple[str, str, int, int, str,
                                                           Attributes]]) -> list[pb.Entry]:
        """Commit (task, file_id, token, size, digest[, attributes]) tuples in one
        transaction."""
        r = await self._ask("commit_batch", pb.CommitBatchRequest(commits=[
            pb.CommitRequest(task_id=c[0], file_id=c[1], token=c[2], size=c[3], digest=c[4],
                             attributes=encode_attributes(c[5] if len(c) > 5 else None))
            for c in commits]))
        return list(r.entries)

    async def fail(self, task_id: str, file_id: str, token: int, reason: str = "", *,
                   permanent: bool = False, delay: float = 0.0,
                   release: bool = False) -> pb.Entry:
        """Give a claim up: the entry is retried after its backoff (after ``delay``
        seconds instead, when given), or goes dead at once, no retry spent, when
        ``permanent``. ``release``: the attempt never began (claimed ahead, not worked
        on): pending again at once, no retry spent."""
        r = await self._ask("fail", pb.FailRequest(
            task_id=task_id, file_id=file_id, token=token, reason=reason,
            session_id=self.session_id, permanent=permanent, delay_seconds=delay,
            release=release))
        return r.entry  # type: ignore[no-any-return]

    async def checkpoint(self, task_id: str, file_id: str, token: int, *, data: bytes = b"",
                         progress: float = 0.0, message: str = "", group: str = ""
                         ) -> pb.Checkpoint:
        """Record how far the attempt holding ``token`` got (a producer's claim; with
        ``group``, a consume lease): the next attempt's claim (consume) carries it if
        this one does not finish. ``data``: at most 64 KiB; ``progress``: 0..1;
        ``message``: at most 200 characters. The checkpoint as kept, without its data."""
        r = await self._ask("checkpoint", pb.CheckpointRequest(
            task_id=task_id, file_id=file_id, token=token, group=group, data=data,
            progress=progress, message=message, session_id=self.session_id))
        return r.checkpoint  # type: ignore[no-any-return]

    async def consume(self, task_id: str, group: str = "default", file_id: str = "") -> Lease:
        """Take a verified entry (or the next one) for ``group``."""
        r = await self._work("consume", pb.ConsumeRequest(
            task_id=task_id, group=group, file_id=file_id, session_id=self.session_id))
        return Lease.of(task_id, r, self.session_id)

    async def consume_batch(self, task_id: str, group: str = "default",
                            max_count: int = 21) -> list[Lease]:
        """Take up to ``max_count`` verified entries for ``group`` in one transaction
        (all or nothing, at most 21); ack them together with ``ack_batch``."""
        r = await self._work("consume_batch", pb.ConsumeBatchRequest(
            task_id=task_id, group=group, session_id=self.session_id, max=max_count))
        return [Lease.of(task_id, lease, self.session_id) for lease in r.leases]

    async def ack(self, task_id: str, file_id: str, group: str, token: int) -> pb.Entry:
        """Mark a lease's entry done for ``group``."""
        r = await self._ask("ack", pb.AckRequest(
            task_id=task_id, file_id=file_id, group=group, token=token,
            session_id=self.session_id))
        return r.entry  # type: ignore[no-any-return]

    async def ack_batch(self, acks: list[tuple[str, str, str, int]]) -> list[pb.Entry]:
        """Ack (task, file_id, group, token) tuples in one transaction, all or nothing
        (at most 21); the entries as acked, in the same order."""
        r = await self._ask("ack_batch", pb.AckBatchRequest(acks=[
            pb.AckRequest(task_id=t, file_id=f, group=g, token=tok) for t, f, g, tok in acks]))
        return list(r.entries)

    async def nack(self, task_id: str, file_id: str, group: str, token: int,
                   reason: str = "", *, delay: float = 0.0,
                   permanent: bool = False) -> pb.Entry:
        """Hand a lease back to the group (after ``delay`` seconds, when given), or,
        ``permanent``, give the entry up: it goes dead for every group."""
        r = await self._ask("nack", pb.NackRequest(
            task_id=task_id, file_id=file_id, group=group, token=token, reason=reason,
            session_id=self.session_id, delay_seconds=delay, permanent=permanent))
        return r.entry  # type: ignore[no-any-return]


class Unary(Protocol):
    """What a :class:`UnarySession` needs of its client: one unary call, retried as
    the client's policy says (``AsyncClient.unary_call``)."""

    async def unary_call(self, method: str, request: Any, *, wait: float | None = None,
                         retry: bool = True) -> Any: ...


class UnarySession(AgentCore):
    """A session named by its id, whose calls are unary RPCs (no stream): one its
    caller keeps alive with :meth:`refresh`, as a one-shot command does, or, with id
    0, the calls that name no session (a commit or an ack whose token is enough, the
    batches). Made by ``AsyncClient.open_unary_session`` and ``AsyncClient.unary``."""

    def __init__(self, client: Unary, session_id: int = 0, agent: str = "",
                 ttl: int = 0) -> None:
        self.client = client
        self.session_id = session_id
        self.agent = agent
        self.ttl = ttl
        self.draining = False

    async def _ask(self, kind: str, request: Any, wait: float | None = None) -> Any:
        return await self.client.unary_call(UNARY[kind], request, wait=wait)

    async def refresh_reply(self) -> pb.KeepAliveResponse:
        """Refresh the session's lease once; the registry's whole reply: the TTL, and
        whether the session's host is drained (which ``draining`` then says)."""
        reply: pb.KeepAliveResponse = await self._ask(
            "keepalive", pb.KeepAliveRequest(session_id=self.session_id))
        if reply.ttl > 0:
            self.ttl = int(reply.ttl)
        self.draining = bool(reply.draining)
        return reply

    async def refresh(self) -> int:
        """Refresh the session's lease once; the TTL it has now."""
        return int((await self.refresh_reply()).ttl)

    async def close(self, *, retry: bool = True) -> None:
        """End the session: its lease is revoked, its claims go back now."""
        await self.client.unary_call(
            "CloseSession", pb.CloseSessionRequest(session_id=self.session_id), retry=retry)
