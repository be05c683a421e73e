"""The agent's client for asyncio: a session and its calls on one stream.

    async with AsyncClient("127.0.0.1:7390") as c:
        async with c.session("ocr-1", ttl=10) as s:
            claim = await s.claim("scan-42")
            ...
            await s.commit(claim, size, digest)

An :class:`AsyncSession` opens its session on the registry's ``Session`` stream and
sends every call on it as a message (a message on an open stream costs both sides
about half of a unary call); replies come back in any order, each to its call. The
session is kept alive by keepalive messages on the stream, every TTL/3. When the
stream breaks (a replica restarts, the network blinks), the session does not end: it
is resumed on a new stream, to whichever replica answers, until its TTL runs out, and
the calls not yet answered are sent again; their request ids make a call that did
apply answer from its record, so nothing applies twice.

This is the one implementation of an agent's session, and its calls (``_core``'s
``AgentCore``) the one implementation of the agent's calls, on a stream or, for a
session kept alive by its caller (``open_unary_session``) or for calls that name no
session (``unary``), as unary RPCs: the blocking :class:`Client` runs them on an event
loop of its own thread, one per process.
gRPC's asyncio layer serves one running event loop per process: a program that runs
its own loop uses this client there, and not blocking stream sessions beside it.

The client also follows the registry's server streams (``watch``, ``watch_tasks``) as
async iterators. A blocking client's stream holds a thread, and gRPC's blocking
iterator wakes it ten times a second while nothing arrives; here an idle stream costs
nothing until a message comes, however many are open (the watcher follows every
served task's entries so: ``Client.spawn``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio

from ..kernel import errors, tracing
from ..kernel.backoff import Backoff
from ..kernel.contract import DEFAULT_REGISTRY, version
from ..kernel.v1 import baton_pb2 as pb
from ._core import AgentCore, UnarySession
from ._wire import (
    Attributes,
    Claim,
    Credentials,
    Lease,
    channel_options,
    checked,
    encode_attributes,
    error_of,
    events_of,
    explained,
    method_of,
    raise_from_rpc,
)
from .retry import RetryPolicy

__all__ = ["AsyncClient", "AsyncSession", "ServerStream", "UnarySession"]

M = TypeVar("M")

log = logging.getLogger("baton.client")

_SERVICE = pb.DESCRIPTOR.services_by_name["AgentService"].full_name
_OPERATOR = pb.DESCRIPTOR.services_by_name["OperatorService"].full_name
#: what ``read`` returns once the registry ended a stream
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc-stubs
#: what a broken stream is given between attempts to resume it
RESUME_BACKOFF = Backoff(0.05, 1.0)


class AsyncClient:
    """A channel to a registry for asyncio agents. With ``ca``, ``cert`` and ``key``
    (or ``BATON_CA``, ``BATON_CERT``, ``BATON_KEY``) it speaks mutual TLS, as
    :class:`~baton_relay.client.Client` does. Its unary calls (``unary``,
    ``open_unary_session``) are tried again on ``Unavailable`` as ``retry`` says."""

    def __init__(self, target: str = DEFAULT_REGISTRY, *, timeout: float = 10.0,
                 retry: RetryPolicy | None = None, ca: str | None = None,
                 cert: str | None = None, key: str | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._methods: dict[str, Any] = {}
        self.credentials = Credentials.resolve(ca, cert, key)
        options = channel_options(target, self.credentials)
        if self.credentials.tls:
            self._channel = grpc.aio.secure_channel(
                target, self.credentials.channel_credentials(), options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stream = self._channel.stream_stream(
            f"/{_SERVICE}/Session", request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString)
        self._watch = self._channel.unary_stream(
            f"/{_SERVICE}/Watch", request_serializer=pb.WatchRequest.SerializeToString,
            response_deserializer=pb.WatchResponse.FromString)
        self._watch_tasks = self._channel.unary_stream(
            f"/{_OPERATOR}/WatchTasks",
            request_serializer=pb.WatchTasksRequest.SerializeToString,
            response_deserializer=pb.WatchTasksResponse.FromString)
        self.closed = False

    async def open_session(self, agent: str, ttl: int = 10, *, slots: int = 0,
                           host: str = "") -> AsyncSession:
        """Open an agent session on a stream (see the module's docstring). ``slots``
        and ``host`` as for ``Client.open_session``."""
        session = AsyncSession(self, pb.OpenSessionRequest(
            agent=agent, ttl=ttl, host=host or socket.gethostname(), pid=os.getpid(),
            version=version(), slots=slots))
        await session.open()
        return session

    async def open_unary_session(self, agent: str, ttl: int = 10, *, slots: int = 0,
                                 host: str = "") -> UnarySession:
        """Open an agent session without a stream: its caller keeps it alive
        (``refresh``) and its calls are unary RPCs, as a one-shot command's are.
        ``slots`` and ``host`` as for ``open_session``."""
        r = await self.unary_call("OpenSession", pb.OpenSessionRequest(
            agent=agent, ttl=ttl, host=host or socket.gethostname(), pid=os.getpid(),
            version=version(), slots=slots))
        return UnarySession(self, r.session.session_id, r.session.agent, r.session.ttl)

    def unary(self, session_id: int = 0) -> UnarySession:
        """The agent's calls as unary RPCs naming ``session_id`` (0: none, as a commit,
        a fail, an ack or a nack may, whose token is enough; and the batches)."""
        return UnarySession(self, session_id)

    async def unary_call(self, method: str, request: Any, *, wait: float | None = None,
                         retry: bool = True) -> Any:
        """One unary call of the registry's ``method``; its reply, or its domain error.
        Tried again on ``Unavailable`` as the client's ``retry`` says (``retry``
        False: once); each attempt waits ``wait`` seconds (default: ``timeout``)."""
        if self.closed:
            raise errors.ClientClosed(f"{method}: this client of {self.target} is closed")
        checked(method, request)
        rpc = self._methods.get(method)
        if rpc is None:
            rpc = self._methods[method] = method_of(self._channel, method)
        metadata = None
        if tracing.ENABLED and (parent := tracing.current()):
            metadata = (("traceparent", parent),)  # the registry's span is its child
        limit = self.timeout if wait is None else wait

        async def attempt() -> Any:
            try:
                return await rpc(request, timeout=limit, metadata=metadata)
            except grpc.RpcError as e:
                raise explained(raise_from_rpc(e, method, limit), self.credentials,
                                self.target) from None

        if not retry:
            return await attempt()
        return await self.retry.acall(attempt)

    async def get_entry(self, task_id: str, file_id: str) -> pb.Entry:
        """An entry as the registry has it now (the operators' ``GetEntry``; the consume
        helpers read an assembly's parts with it)."""
        r = await self.unary_call("GetEntry", pb.GetEntryRequest(task_id=task_id,
                                                                 file_id=file_id))
        return r.entry  # type: ignore[no-any-return]

    @contextlib.asynccontextmanager
    async def session(self, agent: str, ttl: int = 10, *, slots: int = 0,
                      host: str = "") -> AsyncIterator[AsyncSession]:
        """``open_session`` as a context: the session is closed (revoked) on leaving."""
        session = await self.open_session(agent, ttl, slots=slots, host=host)
        try:
            yield session
        finally:
            await session.close()

    def watch(self, task_id: str, start_revision: int = 0, timeout: float | None = None, *,
              states: Sequence[pb.EntryState.ValueType] = (), progress: bool = False,
              catch_up: bool = False) -> ServerStream[pb.TaskEvent]:
        """The task's events, as ``Client.watch`` yields them (the same arguments); the
        iteration ends quietly when ``timeout`` passes or the stream is cancelled."""
        request = pb.WatchRequest(task_id=task_id, start_revision=start_revision,
                                  states=list(states), progress=progress,
                                  catch_up=catch_up, together=True)
        return EventStream(self._open(self._watch, request, timeout))

    def watch_tasks(self, timeout: float | None = None) -> ServerStream[pb.Task]:
        """Every task header, then each again as it changes, as ``client.operator.watch_tasks``."""
        return ServerStream(self._open(self._watch_tasks, pb.WatchTasksRequest(), timeout),
                            "WatchTasks", _task)

    def watch_task_headers(self, start_revision: int = 0, timeout: float | None = None
                           ) -> ServerStream[pb.WatchTasksResponse]:
        """The task headers' stream with progress messages (``WatchTasksRequest``):
        each reply a header with the revision it was written at, or (task unset) a
        revision every header change up to which was sent; resume from the highest
        revision + 1 with ``start_revision``, which sends only what changed since."""
        request = pb.WatchTasksRequest(start_revision=start_revision, progress=True)
        return ServerStream(self._open(self._watch_tasks, request, timeout), "WatchTasks",
                            _same)

    def _open(self, method: Any, request: Any, timeout: float | None) -> Any:
        if self.closed:
            raise errors.ClientClosed(f"this client of {self.target} is closed")
        return method(request, timeout=timeout)

    async def close(self) -> None:
        self.closed = True
        await self._channel.close(None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ServerStream(Generic[M]):
    """The messages of one server stream, as an async iterator.

    It ends quietly (as the blocking client's generators do) when the registry ends
    it, when its deadline passes, or when it is cancelled: by :meth:`cancel` from the
    loop (a caller that stops listening: silence, a task no longer followed) or by
    its channel closing. A failure raises the domain error (``Unavailable``,
    ``NotFound``, ``Compacted``...). Cancelling the task that reads it cancels the
    call and raises ``CancelledError``, as any await does.
    """

    def __init__(self, call: Any, method: str, unwrap: Callable[[Any], M]) -> None:
        self._call = call
        self._method = method
        self._unwrap = unwrap

    def cancel(self) -> None:
        """End the stream; the reader's iteration stops quietly."""
        self._call.cancel()

    def __aiter__(self) -> ServerStream[M]:
        return self

    async def __anext__(self) -> M:
        return self._unwrap(await self._reply())

    async def _reply(self) -> Any:
        """The next message; ``StopAsyncIteration`` once the stream has ended."""
        try:
            reply = await self._call.read()
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise StopAsyncIteration from None
            raise raise_from_rpc(e, self._method) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the reader is cancelled, not only the call
            raise StopAsyncIteration from None  # the call was: cancel(), or channel closed
        if reply is _EOF:
            raise StopAsyncIteration
        return reply


def _task_event(reply: pb.WatchResponse) -> pb.TaskEvent:
    return reply.event


class EventStream(ServerStream[pb.TaskEvent]):
    """A task's ``Watch`` events, one at a time, however many a message carries (they
    are asked for together: ``WatchRequest.together``; a registry that predates it
    sends one a message)."""

    def __init__(self, call: Any) -> None:
        super().__init__(call, "Watch", _task_event)
        self._queued: collections.deque[pb.TaskEvent] = collections.deque()

    def cancel(self) -> None:
        self._queued.clear()
        super().cancel()

    async def __anext__(self) -> pb.TaskEvent:
        while not self._queued:
            self._queued.extend(events_of(await self._reply()))
        return self._queued.popleft()


def _task(reply: pb.WatchTasksResponse) -> pb.Task:
    return reply.task


def _same(reply: pb.WatchTasksResponse) -> pb.WatchTasksResponse:
    return reply


class _Pending:
    """A call sent and not yet answered: sent again on a new stream if its stream broke."""

    __slots__ = ("call", "reply", "sent_on")

    def __init__(self, call: pb.AgentCall, reply: asyncio.Future[pb.AgentReply]) -> None:
        self.call = call
        self.reply = reply
        self.sent_on: object = None


class AsyncSession(AgentCore):
    """An agent session on a stream: its calls (``AgentCore``'s, each a message on the
    stream, and the fused steps only a stream carries), its keepalive, its resumption.

    ``lost`` turns True once the registry says the session is gone or no keepalive
    succeeded for a whole TTL; calls are then refused with ``SessionExpired`` (its
    claims' tokens may be dead). ``draining`` turns True when its host is drained.
    """

    def __init__(self, client: AsyncClient, opening: pb.OpenSessionRequest) -> None:
        self.client = client
        self._opening = opening
        self.session_id = 0
        self.agent = opening.agent
        self.ttl = int(opening.ttl or 10)
        self.slots = int(opening.slots)
        self.lost = False
        self.draining = False
        #: when the last keepalive that succeeded was sent: the lease lives a TTL from it
        self.last_ok = time.monotonic()
        #: streams this session was resumed on after one broke
        self.resumed = 0
        #: called once the session is lost (the blocking client sets its event so)
        self.on_lost: list[Callable[[], None]] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._call: Any = None
        self._connected = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        #: the task reading the current stream's replies
        self._reader: asyncio.Task[None] | None = None

    # the stream ---------------------------------------------------------------------

    async def open(self) -> None:
        """Open the session (the first message of its first stream)."""
        sent = time.monotonic()
        session = await self._connect(pb.SessionRequest(open=self._opening))
        self.session_id = session.session_id
        self.agent = session.agent
        self.ttl = int(session.ttl) or self.ttl
        self.slots = int(session.slots)
        self.last_ok = sent
        self._spawn(self._keep())

    async def _connect(self, first: pb.SessionRequest) -> pb.Session:
        """A new stream, its first message sent and the session it answers read; the
        stream then serves the calls."""
        call = self.client._stream(None, timeout=None)
        try:
            await call.write(first)
            reply: Any = await asyncio.wait_for(call.read(), self.client.timeout)
        except grpc.RpcError as e:
            call.cancel()
            raise raise_from_rpc(e, "Session", self.client.timeout) from None
        except TimeoutError:
            call.cancel()
            raise errors.Unavailable(f"Session: no reply from the registry within "
                                     f"{self.client.timeout:g} s") from None
        if reply is _EOF or reply.WhichOneof("kind") != "session":
            call.cancel()
            raise errors.Unavailable("Session: the stream ended before the session was open")
        self._call = call
        self._connected.set()
        self._reader = self._spawn(self._read(call))
        return reply.session  # type: ignore[no-any-return]

    async def _read(self, call: Any) -> None:
        """Hand each reply to its call until the stream ends; then resume the session
        on a new one (unless it is being closed)."""
        cause = "the registry ended the stream"
        try:
            while True:
                message = await call.read()
                if message is _EOF:
                    break
                pending = self._pending.get(message.reply.call_id)
                if pending is not None and not pending.reply.done():
                    pending.reply.set_result(message.reply)
        except grpc.RpcError as e:
            cause = str(raise_from_rpc(e, "Session"))
        except asyncio.CancelledError:
            return
        if self._closing or call is not self._call:
            return
        self._connected.clear()
        log.info("session %x: stream broke (%s); resuming it", self.session_id, cause)
        await self._resume()

    async def _resume(self) -> None:
        """Take the session up on a new stream and send again what was not answered;
        lose it when the registry says it is gone or its TTL passed without a stream."""
        for attempt in itertools.count(1):
            if self._closing:
                return
            if time.monotonic() - self.last_ok > self.ttl:
                self._lose(errors.SessionExpired(
                    f"session {self.session_id:x} of {self.agent} was lost: no stream to "
                    f"the registry for its whole TTL ({self.ttl} s)",
                    session_id=self.session_id))
                return
            sent = time.monotonic()
            try:
                await self._connect(pb.SessionRequest(
                    resume=pb.ResumeSessionRequest(session_id=self.session_id)))
            except (errors.SessionExpired, errors.NotFound, errors.PermissionDenied) as e:
                self._lose(e)
                return
            except errors.BatonError as e:
                log.info("session %x: resume attempt %d: %s", self.session_id, attempt, e)
                await asyncio.sleep(RESUME_BACKOFF.delay(attempt))
                continue
            self.last_ok = sent  # resuming refreshed the lease
            self.resumed += 1
            for pending in list(self._pending.values()):
                await self._send(pending)
            return

    async def _send(self, pending: _Pending) -> None:
        """Write a call on the current stream, unless it went there already; a write
        that fails leaves it to the resumption to send again."""
        async with self._write_lock:
            call = self._call
            if not self._connected.is_set() or pending.sent_on is call:
                return
            pending.sent_on = call
            try:
                await call.write(pb.SessionRequest(call=pending.call))
            except (grpc.RpcError, asyncio.InvalidStateError) as e:
                log.debug("session %x: write failed (%s); sent again once resumed",
                          self.session_id, e)

    async def _ask(self, kind: str, request: Any, wait: float | None = None) -> Any:
        """Send one call and wait for its reply; its error raised as the domain error
        a unary call would raise."""
        self.check()
        if hasattr(request, "request_id") and not request.request_id:
            request.request_id = _request_id()  # the same when sent again
        call = pb.AgentCall(call_id=next(self._ids))
        getattr(call, kind).CopyFrom(request)
        if tracing.ENABLED:
            call.traceparent = tracing.current()  # the registry's span is its child
        loop = asyncio.get_running_loop()
        pending = _Pending(call, loop.create_future())
        self._pending[call.call_id] = pending
        limit = self.client.timeout if wait is None else wait
        # The deadline is a timer on the reply itself, not a wait_for: one callback
        # instead of a task and a shield per call, on the path every step takes.
        timer = loop.call_later(limit, _expire, pending.reply, kind, limit)
        try:
            await self._send(pending)
            reply = await pending.reply
        finally:
            timer.cancel()
            del self._pending[call.call_id]
        if reply.WhichOneof("reply") == "error":
            raise error_of(reply.error)
        return getattr(reply, kind)

    def _lose(self, error: errors.BatonError) -> None:
        log.warning("session %x lost: %s", self.session_id, error)
        self.lost = True
        for hook in self.on_lost:
            hook()
        self._closing = True
        for pending in self._pending.values():
            if pending.reply.done():
                continue
            if pending.sent_on is None:  # never sent: it certainly did not apply
                pending.reply.set_exception(error)
                continue
            kind = pending.call.WhichOneof("request")
            pending.reply.set_exception(errors.OutcomeUnknown(
                f"{error}; its {kind} call was in flight and may have applied",
                session_id=self.session_id, call=kind))
        if self._call is not None:
            self._call.cancel()

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _keep(self) -> None:
        """Keepalive messages on the stream, every TTL/3 (TTL/10 after a failure)."""
        interval = max(self.ttl / 3, 0.2)
        while not self._closing:
            await asyncio.sleep(interval)
            if self._closing:
                return
            try:
                await self.refresh()
            except errors.SessionExpired as e:
                self._lose(e)
                return
            except errors.BatonError as e:
                if time.monotonic() - self.last_ok > self.ttl:
                    self._lose(errors.SessionExpired(
                        f"session {self.session_id:x} lost: no keepalive for {self.ttl} s "
                        f"({e})", session_id=self.session_id))
                    return
                interval = max(self.ttl / 10, 0.1)
                continue
            interval = max(self.ttl / 3, 0.2)

    def check(self) -> None:
        """Raise ``SessionExpired`` if this session can no longer be trusted."""
        if self.lost or time.monotonic() - self.last_ok > self.ttl:
            self.lost = True
            raise errors.SessionExpired(f"session {self.session_id:x} of {self.agent} "
                                        f"was lost", session_id=self.session_id)

    async def refresh(self) -> int:
        """Refresh the session's lease once (a keepalive message); the TTL it has now."""
        sent = time.monotonic()
        reply = await self._ask("keepalive", pb.KeepAliveRequest(session_id=self.session_id),
                                wait=max(self.ttl / 3, 1.0))
        self.last_ok = sent
        if reply.ttl > 0:
            self.ttl = int(reply.ttl)
        self.draining = bool(reply.draining)
        return int(reply.ttl)

    async def close(self, revoke: bool = True) -> None:
        """End the stream; with ``revoke`` end the session too (its claims go back now)."""
        if self._closing and self.lost:
            return
        self._closing = True
        if self._call is not None and self._connected.is_set():
            # Said done: the registry answers what is in flight and ends the stream.
            with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError, TimeoutError):
                async with asyncio.timeout(1.0):
                    async with self._write_lock:
                        await self._call.done_writing()
                    if self._reader is not None:
                        await asyncio.shield(self._reader)  # until the stream's end
        if self._call is not None:
            self._call.cancel()
        for task in list(self._tasks):
            task.cancel()
        if revoke and not self.lost:
            try:
                await self.client.unary(self.session_id).close(retry=False)
            except errors.BatonError as e:
                log.warning("closing session %x: %s", self.session_id, e)
        self.lost = True

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # the fused steps: only a stream carries them ----------------------------------

    async def commit_and_claim(self, task_id: str, file_id: str, token: int, size: int,
                               digest: str = "", *, attributes: Attributes = None,
                               traceparent: str = "") -> tuple[pb.Entry, Claim | None]:
        """Commit a claim and claim the task's next entry, in one message and one etcd
        transaction: the committed entry, and the next claim (None when there is
        none to take now: nothing claimable, the host drained, no free slot; a plain
        ``claim`` then says which, or waits). ``traceparent``: the next attempt's span
        (traces on), kept on the entry claimed."""
        r = await self._ask("commit_and_claim", pb.CommitAndClaimRequest(
            commit=pb.CommitRequest(task_id=task_id, file_id=file_id, token=token, size=size,
                                    digest=digest, session_id=self.session_id,
                                    attributes=encode_attributes(attributes),
                                    request_id=_request_id()),
            claim=pb.ClaimRequest(task_id=task_id, session_id=self.session_id,
                                  traceparent=traceparent)))
        if r.HasField("next"):
            return r.entry, Claim.of(task_id, r.next, self.session_id)
        self._noted(r.next_error)
        return r.entry, None

    async def commit_and_claim_batch(
            self, commits: Sequence[tuple[str, str, int, int, str]
                                    | tuple[str, str, int, int, str, Attributes]],
            task_id: str, max_count: int, *, traceparents: Sequence[str] = ()
    ) -> tuple[list[pb.Entry], list[Claim]]:
        """Commit (task, file_id, token, size, digest[, attributes]) tuples and claim up
        to ``max_count`` next entries of ``task_id``, in one message and one etcd
        transaction: the committed entries, in order, and the claims taken (none when
        none can be taken now, as ``commit_and_claim``'s None). ``traceparents``: the
        i-th claim's attempt span (traces on)."""
        r = await self._ask("commit_and_claim_batch", pb.CommitAndClaimBatchRequest(
            commits=[pb.CommitRequest(task_id=c[0], file_id=c[1], token=c[2], size=c[3],
                                      digest=c[4], session_id=self.session_id,
                                      attributes=encode_attributes(c[5] if len(c) > 5
                                                                   else None))
                     for c in commits],
            task_id=task_id, session_id=self.session_id, max=max_count,
            traceparents=list(traceparents), request_id=_request_id()))
        if not r.next:
            self._noted(r.next_error)
        return list(r.entries), [Claim.of(task_id, c, self.session_id) for c in r.next]

    async def ack_and_consume(self, task_id: str, file_id: str, group: str, token: int
                              ) -> tuple[pb.Entry, Lease | None]:
        """Ack a lease and take the group's next entry, in one message and one etcd
        transaction: the acked entry, and the next lease (None when there is none
        to take now)."""
        r = await self._ask("ack_and_consume", pb.AckAndConsumeRequest(
            ack=pb.AckRequest(task_id=task_id, file_id=file_id, group=group, token=token,
                              session_id=self.session_id, request_id=_request_id()),
            consume=pb.ConsumeRequest(task_id=task_id, group=group,
                                      session_id=self.session_id)))
        if r.HasField("next"):
            return r.entry, _lease(task_id, r.next, self.session_id)
        self._noted(r.next_error)
        return r.entry, None

    def _noted(self, why: pb.CallError) -> None:
        """What a fused step's missing next says of the session (drained, lost)."""
        if not why.code:
            return
        error = error_of(why)
        if isinstance(error, errors.Draining):
            self.draining = True
        elif isinstance(error, errors.SessionExpired):
            self._lose(error)


def _expire(reply: asyncio.Future[pb.AgentReply], kind: str, limit: float) -> None:
    """End a call's wait for its reply: its deadline passed."""
    if not reply.done():
        reply.set_exception(errors.DeadlineExceeded(
            f"{kind}: no reply from the registry within {limit:g} s (deadline exceeded)",
            method=kind, timeout=limit))


def _request_id() -> str:
    """A new request id: a call sent again with it applies once (a fused step's is its
    finishing part's)."""
    return os.urandom(16).hex()


def _lease(task_id: str, r: pb.ConsumeResponse, session_id: int) -> Lease:
    return Lease.of(task_id, r, session_id)
