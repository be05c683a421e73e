"""What agents call (the registry's AgentService), blocking: sessions, producers'
claims and commits, consumers' consumes and acks, a task's events. Each call runs the
asyncio client's (``_core.AgentCore``, ``aio``) on the loop of this process's streams:
on the session's stream, or as a unary call for a session kept by its caller or named
by its id."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..kernel import errors
from ..kernel.errors import SessionExpired
from ..kernel.v1 import baton_pb2 as pb
from ._connection import Connection
from ._wire import Attributes, Claim, Lease

if TYPE_CHECKING:
    from ._core import AgentCore
    from .aio import AsyncSession, ServerStream

log = logging.getLogger("baton.client")


@dataclass
class Session:
    """An agent session: an etcd lease that lives while it is kept alive.

    A session opened with ``keepalive`` (the default) lives on a stream (``stream``):
    its calls travel there as messages, a keepalive message every TTL/3 refreshes it,
    and a broken stream is resumed (see :mod:`baton_relay.client.aio`). Without, the
    caller keeps it alive (``Client.keepalive``), as a one-shot command does.

    Once the lease is lost (the registry says so, or no refresh succeeded for
    a whole TTL), ``lost`` is set and the client refuses to use the session's
    claims: their fencing tokens may already be dead.

    The registry keeps the session on whichever etcd lease an operator rotated it
    to; each refresh brings back the TTL the session has now (a rotation may
    change it), which paces the next ones. ``draining`` turns True when the
    session's host is drained (a refresh says so, or a claim is refused with
    ``Draining``): take no new work, finish what is held.
    """

    client: AgentCalls
    session_id: int
    agent: str
    _ttl: int
    lost: threading.Event = field(default_factory=threading.Event)
    _draining: threading.Event = field(default_factory=threading.Event)
    #: the session on its stream, where calls naming this session go; None for a
    #: session the caller keeps alive with unary calls
    stream: AsyncSession | None = None
    #: the client whose event loop carries the stream (``client`` may be changed to
    #: another replica's, which then makes the unary calls, as ``close``'s revoke)
    carrier: Connection | None = None

    @property
    def ttl(self) -> int:
        """The session's TTL as its last refresh said (a rotation may change it)."""
        return self.stream.ttl if self.stream is not None else self._ttl

    @ttl.setter
    def ttl(self, value: int) -> None:
        self._ttl = value

    @property
    def keepalive(self) -> bool:
        """Whether the session keeps itself alive (on its stream)."""
        return self.stream is not None

    @property
    def draining(self) -> bool:
        """Whether the session's host is drained: no new claims or consumes."""
        if self.stream is not None:
            return self.stream.draining
        return self._draining.is_set()

    def refresh(self) -> int:
        """Refresh the session's lease once and take what the registry says of it
        (its TTL, whether it is draining); the TTL."""
        if self.stream is not None:
            return (self.carrier or self.client)._run(self.stream.refresh())
        reply = self.client.refresh_session(self.session_id)
        if reply.ttl > 0:
            self.ttl = int(reply.ttl)
        if reply.draining:
            self._draining.set()
        else:
            self._draining.clear()
        return int(reply.ttl)

    def drained(self) -> None:
        """The registry refused new work: the session's host is drained."""
        self._draining.set()
        if self.stream is not None:
            self.stream.draining = True

    def check(self) -> None:
        """Raise ``SessionExpired`` if this session can no longer be trusted."""
        if self.stream is not None:
            try:
                self.stream.check()
            except SessionExpired:
                self.lost.set()
                raise
        elif self.lost.is_set():
            raise SessionExpired(f"session {self.session_id:x} of {self.agent} was lost",
                                 session_id=self.session_id)

    def close(self, revoke: bool = True) -> None:
        """End the stream; with ``revoke`` end the lease too (claims go back now)."""
        if self.stream is not None:
            lost = self.lost.is_set() or self.stream.lost
            carrier = self.carrier or self.client
            if not carrier.closed:
                with contextlib.suppress(errors.ClientClosed):
                    carrier._run(self.stream.close(revoke=False))
            if revoke and not lost:
                try:
                    self.client.close_session(self.session_id)
                except errors.BatonError as e:
                    log.warning("closing session %x: %s", self.session_id, e)
        elif revoke and not self.lost.is_set():
            try:
                self.client.close_session(self.session_id)
            except errors.BatonError as e:
                log.warning("closing session %x: %s", self.session_id, e)
        self.lost.set()

    def checkpoint(self, task_id: str, file_id: str, token: int, *, data: bytes = b"",
                   progress: float = 0.0, message: str = "", group: str = ""
                   ) -> pb.Checkpoint:
        """Record how far this session's claim (with ``group``, its consume lease)
        holding ``token`` got; see ``AgentCalls.checkpoint``."""
        return self.client.checkpoint(task_id, file_id, token, data=data, progress=progress,
                                      message=message, group=group, session=self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AgentCalls(Connection):
    """The AgentService's calls, blocking: each runs the asyncio client's call of the
    same name (``_core.AgentCore``) on the event loop of this client's streams, on the
    session's stream when it has one, else as a unary RPC (``AsyncClient.unary``)."""

    def _core(self, session: Session | int, *, check: bool = False) -> AgentCore:
        """Where the calls naming ``session`` go: its stream, or unary calls naming its
        id; ``check``: refuse a session that can no longer be trusted first."""
        if isinstance(session, Session):
            if session.stream is not None:
                return session.stream
            if check:
                session.check()
            session = session.session_id
        return self._streams().unary(int(session))

    def open_session(self, agent: str, ttl: int = 10, *, keepalive: bool = True,
                     slots: int = 0, host: str = "") -> Session:
        """Open an agent session; with ``keepalive`` it lives on a stream (its calls
        and its keepalive, every TTL/3, travel there; a broken stream is resumed), else
        it is kept by the caller's own ``keepalive`` calls.

        ``slots`` caps the claims (producer and consumer) it may hold at once;
        one more is refused with ``SlotsExhausted`` (0 = no limit). ``host`` is the
        host the session says it runs on, which ``baton lease drain --host`` names
        (default: this machine's host name; a container may give its node's).
        """
        aio = self._streams()
        if keepalive:
            stream = self._run(aio.open_session(agent, ttl, slots=slots, host=host))
            session = Session(self, stream.session_id, stream.agent, stream.ttl, stream=stream,
                              carrier=self)
            stream.on_lost.append(session.lost.set)
            return session
        opened = self._run(aio.open_unary_session(agent, ttl, slots=slots, host=host))
        return Session(self, opened.session_id, opened.agent, opened.ttl)

    def keepalive(self, session_id: int) -> int:
        """Refresh a session's lease once; the TTL it now has."""
        return int(self.refresh_session(session_id).ttl)

    def refresh_session(self, session_id: int) -> pb.KeepAliveResponse:
        """Refresh a session's lease once; the registry's whole reply: the TTL, and
        whether the session's host is drained."""
        return self._run(self._streams().unary(session_id).refresh_reply())

    def close_session(self, session_id: int) -> None:
        self._run(self._streams().unary(session_id).close())

    def claim(self, task_id: str, file_id: str = "", *, session: Session | int,
              traceparent: str | None = None) -> Claim:
        """Claim an entry (or the next claimable one) for writing. ``traceparent``: the
        span of the attempt, kept on the entry when traces are on (None: the current
        span; ``produce`` opens one per attempt)."""
        core = self._core(session, check=True)
        with _draining(session):
            return self._run(core.claim(task_id, file_id, traceparent=traceparent))

    def claim_batch(self, task_id: str, max_count: int, *, session: Session | int) -> list[Claim]:
        """Claim up to ``max_count`` entries in one transaction (all or nothing)."""
        core = self._core(session, check=True)
        with _draining(session):
            return self._run(core.claim_batch(task_id, max_count))

    def commit_batch(self, commits: Sequence[tuple[str, str, int, int, str]
                                             | tuple[str, str, int, int, str, Attributes]]
                     ) -> list[pb.Entry]:
        """Commit (task, file_id, token, size, digest[, attributes]) tuples in one
        transaction."""
        return self._run(self._core(0).commit_batch(commits))

    def commit(self, task_id: str, file_id: str, token: int, size: int,
               digest: str = "", *, session: Session | int = 0,
               attributes: Attributes = None) -> pb.Entry:
        """Publish a claim's file: its size and BLAKE3 ``digest`` (required unless the
        task sets ``digest_optional``). ``session``: the one holding the claim (the
        registry then checks it holds it). ``attributes``: what the task's routing
        rules look at (see ``encode_attributes``)."""
        return self._run(self._core(session).commit(task_id, file_id, token, size, digest,
                                                    attributes=attributes))

    def commit_and_claim(self, task_id: str, file_id: str, token: int, size: int,
                         digest: str = "", *, session: Session,
                         attributes: Attributes = None,
                         traceparent: str = "") -> tuple[pb.Entry, Claim | None]:
        """Commit a claim and claim the task's next entry in one step (one message on
        the session's stream, one etcd transaction): the committed entry and the next
        claim, None when none can be taken now. Needs a session kept on its stream.
        ``traceparent``: the next attempt's span, as ``claim`` takes it."""
        return self._run(_needs_stream(session, "commit_and_claim").commit_and_claim(
            task_id, file_id, token, size, digest, attributes=attributes,
            traceparent=traceparent))

    def commit_and_claim_batch(
            self, commits: Sequence[tuple[str, str, int, int, str]
                                    | tuple[str, str, int, int, str, Attributes]],
            task_id: str, max_count: int, *, session: Session,
            traceparents: Sequence[str] = ()) -> tuple[list[pb.Entry], list[Claim]]:
        """Commit (task, file_id, token, size, digest[, attributes]) tuples and claim up
        to ``max_count`` next entries of ``task_id`` in one step (one message on the
        session's stream, one etcd transaction): the committed entries and the claims
        taken (none when none can be taken now). Needs a session kept on its stream."""
        return self._run(_needs_stream(session, "commit_and_claim_batch")
                         .commit_and_claim_batch(commits, task_id, max_count,
                                                 traceparents=traceparents))

    def fail(self, task_id: str, file_id: str, token: int, reason: str = "", *,
             session: Session | int = 0, permanent: bool = False,
             delay: float = 0.0, release: bool = False) -> pb.Entry:
        """Give a claim up: the entry is retried after its backoff (after ``delay``
        seconds instead, when given), or goes dead at once, no retry spent, when
        ``permanent``. ``release``: the attempt never began (claimed ahead, not worked
        on): the entry is pending again at once, no retry spent."""
        return self._run(self._core(session).fail(task_id, file_id, token, reason,
                                                  permanent=permanent, delay=delay,
                                                  release=release))

    def checkpoint(self, task_id: str, file_id: str, token: int, *, data: bytes = b"",
                   progress: float = 0.0, message: str = "", group: str = "",
                   session: Session | int = 0) -> pb.Checkpoint:
        """Record how far the attempt holding ``token`` got (a producer's claim; with
        ``group``, a consume lease): the next attempt's claim (consume) carries it if
        this one does not finish. ``data``: at most 64 KiB; ``progress``: 0..1;
        ``message``: at most 200 characters. The checkpoint as kept, without its data."""
        return self._run(self._core(session).checkpoint(
            task_id, file_id, token, data=data, progress=progress, message=message,
            group=group))

    def consume(self, task_id: str, group: str = "default", file_id: str = "", *,
                session: Session | int) -> Lease:
        """Take a verified entry (or the next one) for ``group``."""
        core = self._core(session, check=True)
        with _draining(session):
            return self._run(core.consume(task_id, group, file_id))

    def consume_batch(self, task_id: str, group: str = "default", max_count: int = 21, *,
                      session: Session | int) -> list[Lease]:
        """Take up to ``max_count`` verified entries for ``group`` in one transaction
        (all or nothing, at most 21); ack them together with :meth:`ack_batch`."""
        core = self._core(session, check=True)
        with _draining(session):
            return self._run(core.consume_batch(task_id, group, max_count))

    def ack(self, task_id: str, file_id: str, group: str, token: int, *,
            session: Session | int = 0) -> pb.Entry:
        return self._run(self._core(session).ack(task_id, file_id, group, token))

    def ack_and_consume(self, task_id: str, file_id: str, group: str, token: int, *,
                        session: Session) -> tuple[pb.Entry, Lease | None]:
        """Ack a lease and take the group's next entry in one step: the acked entry
        and the next lease, None when none can be taken now. Needs a session kept on
        its stream."""
        return self._run(_needs_stream(session, "ack_and_consume").ack_and_consume(
            task_id, file_id, group, token))

    def ack_batch(self, acks: list[tuple[str, str, str, int]]) -> list[pb.Entry]:
        """Ack (task, file_id, group, token) tuples in one transaction, all or nothing
        (at most 21); the entries as acked, in the same order."""
        return self._run(self._core(0).ack_batch(acks))

    def nack(self, task_id: str, file_id: str, group: str, token: int,
             reason: str = "", *, session: Session | int = 0, delay: float = 0.0,
             permanent: bool = False) -> pb.Entry:
        """Hand a lease back to the group (after ``delay`` seconds, when given), or,
        ``permanent``, give the entry up: it goes dead for every group."""
        return self._run(self._core(session).nack(task_id, file_id, group, token, reason,
                                                  delay=delay, permanent=permanent))

    def watch(self, task_id: str, start_revision: int = 0,
              timeout: float | None = None, *,
              states: Sequence[pb.EntryState.ValueType] = (), progress: bool = False,
              catch_up: bool = False) -> Generator[pb.TaskEvent, None, None]:
        """The task's events (see ``WatchRequest``); ends quietly when ``timeout`` passes.
        ``states``: only entries in these (``pb.ENTRY_STATE_*``); empty: every entry.
        ``progress``: also ``KIND_PROGRESS`` events (entry unset) while nothing changes,
        whose ``revision + 1`` is where to resume. A resume from a revision etcd has
        compacted raises ``Compacted`` (an ``Unavailable``), or, with ``catch_up``, is
        sent every entry written since that revision as ``KIND_CHANGED``, as it is now.
        The stream is the asyncio client's (``AsyncClient.watch``), read on its loop."""
        aio = self._streams()

        async def opened() -> ServerStream[pb.TaskEvent]:
            return aio.watch(task_id, start_revision, timeout, states=states,
                             progress=progress, catch_up=catch_up)

        stream = self._run(opened())
        try:
            while (event := self._run(_next(stream))) is not None:
                yield event
        finally:
            loop = self._loop
            if loop is not None:
                loop.loop.call_soon_threadsafe(stream.cancel)


async def _next(stream: ServerStream[pb.TaskEvent]) -> pb.TaskEvent | None:
    """The stream's next event; None once it has ended."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


@contextmanager
def _draining(session: Session | int) -> Iterator[None]:
    """A ``Draining`` refusal marks the session draining."""
    try:
        yield
    except errors.Draining:
        if isinstance(session, Session):
            session.drained()
        raise


def _needs_stream(session: Session, what: str) -> AsyncSession:
    if session.stream is None:
        raise errors.InvalidArgument(f"{what} needs a session kept on its stream "
                                     "(open_session with keepalive)")
    return session.stream
