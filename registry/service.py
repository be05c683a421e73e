"""The gRPC face of the registry: thin handlers over the state machine.

Each handler turns a domain error into its status code and trailing metadata
through the shared table in ``kernel.errors``; anything unexpected is logged
with its traceback and sent as ``INTERNAL``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from ..kernel.contract import DEFAULT_SHARDS
from ..kernel.errors import (
    BatonError,
    Internal,
    InvalidArgument,
    PermissionDenied,
    to_status,
)
from ..kernel.v1 import baton_pb2 as pb
from ..kernel.v1 import baton_pb2_grpc as pb_grpc
from .access import check_reader
from .agent_stream import AgentStreams
from .consumers import Consumers
from .core import Core
from .identity import (
    WATCHER,
    Caller,
    authorize,
    caller_of,
    current,
    redact,
    scoped_request_id,
)
from .leases import Leases
from .manifest import check_id
from .operators import Operators
from .producers import Producers
from .removal import Removal
from .retention import StagingRetention
from .sessions import Sessions
from .shards import Shards
from .tasks import Tasks

if TYPE_CHECKING:
    from .metrics import RegistryMetrics

log = logging.getLogger("baton.registry")

Req = TypeVar("Req")
Resp = TypeVar("Resp")


@dataclass(frozen=True)
class Undecodable:
    """What a request that is not the method's protobuf message decodes to: the
    handler refuses it as ``INVALID_ARGUMENT`` (gRPC would answer ``UNKNOWN`` and
    log a traceback for an exception raised while decoding)."""

    request_type: str
    reason: str

    def error(self) -> InvalidArgument:
        return InvalidArgument(f"the request is not a valid {self.request_type}: {self.reason}",
                               request_type=self.request_type)


def _decoder(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def decode(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Undecodable(cls.DESCRIPTOR.full_name, str(e) or "cannot decode")

    return decode


Context = grpc.aio.ServicerContext[Any, Any]


async def _admit(method: str, context: Context, secure: bool) -> Caller:
    """The caller, let into ``method`` by the access table, or the call aborted."""
    caller = caller_of(context.auth_context(), secure)
    try:
        authorize(method, caller)
    except PermissionDenied as e:
        log.warning("refused %s to %s from %s", method, caller.describe(), context.peer())
        await _abort(context, e)
    return caller


def _guard(method: str, behaviour: Any, streaming: bool, secure: bool) -> Any:
    """``behaviour`` behind the access table: the one check every call passes."""
    if streaming:
        @functools.wraps(behaviour)
        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            await _admit(method, context, secure)
            async for item in behaviour(request, context):
                yield item

        return stream

    @functools.wraps(behaviour)
    async def unary(request: Any, context: Context) -> Any:
        await _admit(method, context, secure)
        return await behaviour(request, context)

    return unary


def add_to_server(servicer: pb_grpc.RegistryServicer, server: grpc.aio.Server,
                  *, secure: bool, metrics: RegistryMetrics | None = None) -> None:
    """Register ``servicer``'s methods as the generated ``add_RegistryServicer_to_server``
    does, built from the service descriptor, but each behind the access table
    (``identity.POLICY``; with ``secure`` False every caller is anonymous and
    holds every role) and with a decoder that turns bytes that are not the request
    message into :class:`Undecodable`. With ``metrics``, every call is counted
    there, refused ones too."""
    service = pb.DESCRIPTOR.services_by_name["Registry"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request = GetMessageClass(method.input_type)
        reply = GetMessageClass(method.output_type)
        make = (grpc.stream_stream_rpc_method_handler if method.client_streaming
                else grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        behaviour = _guard(method.name, getattr(servicer, method.name),
                           method.server_streaming, secure)
        if metrics is not None:
            behaviour = metrics.instrument(method.name, behaviour, method.server_streaming)
        handlers[method.name] = make(behaviour,
                                     request_deserializer=_decoder(request),
                                     response_serializer=reply.SerializeToString)
    generic = grpc.method_handlers_generic_handler(service.full_name, handlers)
    server.add_generic_rpc_handlers((generic,))
    # as the generated code does: a registered method skips the generic lookup
    server.add_registered_method_handlers(  # type: ignore[attr-defined]  # not in grpc-stubs
        service.full_name, handlers)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> None:
    if not isinstance(exc, BatonError):
        log.exception("unexpected error", exc_info=exc)
        exc = Internal(f"internal error: {type(exc).__name__}: {exc}")
    code, details, metadata = to_status(exc)
    context.set_trailing_metadata(metadata)
    await context.abort(code, details)


def unary(
    fn: Callable[[Any, Req], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]:
    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            if getattr(request, "request_id", ""):
                # Scoped to the caller and the call: a replay only ever returns the
                # reply of this very call.
                request.request_id = scoped_request_id(  # type: ignore[attr-defined]
                    current(), fn.__name__, request)
            return await fn(self, request)
        except Exception as e:
            await _abort(context, e)
            raise  # unreachable: abort raises

    return handler


class RegistryService(pb_grpc.RegistryServicer):
    def __init__(self, core: Core, shards: Shards | None = None) -> None:
        self.core = core
        self.shards = shards or Shards(core, DEFAULT_SHARDS)
        self.tasks = Tasks(core)
        self.producers = Producers(core)
        self.consumers = Consumers(core)
        self.leases = Leases(core)
        self.sessions = Sessions(core, renew=self.leases.renew)
        self.operators = Operators(core)
        self.removal = Removal(core)
        self.retention = StagingRetention(core)
        self.streams = AgentStreams(self.sessions, self.producers, self.consumers)

    @unary
    async def CreateTask(self, request: pb.CreateTaskRequest) -> pb.CreateTaskResponse:
        return await self.tasks.create(request)

    async def _readable(self, task_id: str) -> None:
        """Refuse a read of ``task_id``'s contents its access rules do not allow the
        caller (access.check_reader); operators and watchers read every task."""
        caller = current()
        if caller.operator or WATCHER in caller.roles:
            return
        check_id("task_id", task_id)
        _, task = await self.core.task(task_id)
        check_reader(caller, task_id, task.readers)

    @unary
    async def GetTask(self, request: pb.GetTaskRequest) -> pb.Task:
        await self._readable(request.task_id)
        return await self.tasks.get(request.task_id)

    @unary
    async def ListTasks(self, request: pb.ListTasksRequest) -> pb.ListTasksResponse:
        return await self.tasks.list(request, current())

    @unary
    async def GetEntry(self, request: pb.GetEntryRequest) -> pb.Entry:
        await self._readable(request.task_id)
        return redact(await self.tasks.get_entry(request), current())

    @unary
    async def ListEntries(self, request: pb.ListEntriesRequest) -> pb.ListEntriesResponse:
        await self._readable(request.task_id)
        resp = await self.tasks.list_entries(request)
        for entry in resp.entries:
            redact(entry, current())
        return resp

    @unary
    async def PauseTask(self, request: pb.TaskControlRequest) -> pb.Task:
        return await self.operators.control("pause", request, current())

    @unary
    async def ResumeTask(self, request: pb.TaskControlRequest) -> pb.Task:
        return await self.operators.control("resume", request, current())

    @unary
    async def CancelTask(self, request: pb.TaskControlRequest) -> pb.Task:
        return await self.operators.control("cancel", request, current())

    @unary
    async def DeleteTask(self, request: pb.DeleteTaskRequest) -> pb.DeleteTaskResponse:
        return await self.removal.delete(request, current())

    @unary
    async def ArchiveTask(self, request: pb.TaskControlRequest) -> pb.Task:
        if self.core.archive is None:
            raise InvalidArgument("this registry archives nothing: it has no --archive-dir")
        check_id("task_id", request.task_id)
        return await self.core.archive.archive(request.task_id, request.reason,
                                                who=current().name or "operator")

    @unary
    async def Requeue(self, request: pb.RequeueRequest) -> pb.Entry:
        return await self.operators.requeue(request, current())

    @unary
    async def Journal(self, request: pb.JournalRequest) -> pb.JournalResponse:
        await self._readable(request.task_id)
        resp = await self.operators.journal(request)
        for record in resp.records:
            redact(record, current())
        return resp

    @unary
    async def Explain(self, request: pb.GetEntryRequest) -> pb.Explanation:
        await self._readable(request.task_id)
        resp = await self.operators.explain(request, current())
        redact(resp.entry, current())
        return resp

    @unary
    async def ListAgents(self, request: pb.ListAgentsRequest) -> pb.ListAgentsResponse:
        return await self.operators.agents()

    @unary
    async def RevokeSession(self, request: pb.RevokeSessionRequest,
                            ) -> pb.RevokeSessionResponse:
        return await self.leases.revoke(request, current())

    @unary
    async def RotateLease(self, request: pb.RotateLeaseRequest) -> pb.RotateLeaseResponse:
        return await self.leases.rotate(request, current())

    @unary
    async def DrainHost(self, request: pb.DrainHostRequest) -> pb.DrainHostResponse:
        return await self.leases.drain(request, current())

    @unary
    async def UndrainHost(self, request: pb.UndrainHostRequest) -> pb.UndrainHostResponse:
        return await self.leases.undrain(request, current())

    @unary
    async def OpenSession(self, request: pb.OpenSessionRequest) -> pb.Session:
        return await self.sessions.open(request, current())

    @unary
    async def KeepAlive(self, request: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        return await self.sessions.keepalive(request, current())

    @unary
    async def CloseSession(self, request: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        return await self.sessions.close(request, current())

    @unary
    async def Claim(self, request: pb.ClaimRequest) -> pb.ClaimResponse:
        return await self.producers.claim(request, current())

    @unary
    async def ClaimBatch(self, request: pb.ClaimBatchRequest) -> pb.ClaimBatchResponse:
        return await self.producers.claim_batch(request, current())

    @unary
    async def CommitBatch(self, request: pb.CommitBatchRequest) -> pb.CommitBatchResponse:
        return await self.producers.commit_batch(request, current())

    @unary
    async def Commit(self, request: pb.CommitRequest) -> pb.CommitResponse:
        return pb.CommitResponse(entry=await self.producers.commit(request, current()))

    @unary
    async def Fail(self, request: pb.FailRequest) -> pb.FailResponse:
        return pb.FailResponse(entry=await self.producers.fail(request, current()))

    @unary
    async def ReportVerification(self, request: pb.VerificationReport) -> pb.ReportResponse:
        return pb.ReportResponse(entry=await self.producers.verifier.report(request,
                                                                             current()))

    @unary
    async def ReportProblem(self, request: pb.ProblemReport) -> pb.ReportResponse:
        return pb.ReportResponse(entry=await self.producers.verifier.problem(request,
                                                                              current()))

    @unary
    async def RemoveStaged(self, request: pb.RemoveStagedRequest) -> pb.RemoveStagedResponse:
        return await self.retention.mark(request, current())

    @unary
    async def Consume(self, request: pb.ConsumeRequest) -> pb.ConsumeResponse:
        return await self.consumers.consume(request, current())

    @unary
    async def ConsumeBatch(self, request: pb.ConsumeBatchRequest) -> pb.ConsumeBatchResponse:
        return await self.consumers.consume_batch(request, current())

    @unary
    async def Ack(self, request: pb.AckRequest) -> pb.AckResponse:
        return pb.AckResponse(entry=await self.consumers.ack(request, current()))

    @unary
    async def Nack(self, request: pb.NackRequest) -> pb.NackResponse:
        return pb.NackResponse(entry=await self.consumers.nack(request, current()))

    @unary
    async def AckBatch(self, request: pb.AckBatchRequest) -> pb.AckBatchResponse:
        return await self.consumers.ack_batch(request, current())

    @unary
    async def RegisterWatcher(self, request: pb.RegisterWatcherRequest
                              ) -> pb.RegisterWatcherResponse:
        return await self.shards.register(request, current())

    @unary
    async def WatcherHeartbeat(self, request: pb.WatcherHeartbeatRequest
                               ) -> pb.WatcherHeartbeatResponse:
        return await self.shards.heartbeat(request, current())

    @unary
    async def ReleaseShard(self, request: pb.ReleaseShardRequest) -> pb.ReleaseShardResponse:
        return await self.shards.release(request, current())

    @unary
    async def ListWatchers(self, request: pb.ListWatchersRequest) -> pb.ListWatchersResponse:
        return await self.shards.list_watchers()

    @unary
    async def ListShards(self, request: pb.ListShardsRequest) -> pb.ListShardsResponse:
        return await self.shards.list_shards()

    @unary
    async def MoveShard(self, request: pb.MoveShardRequest) -> pb.ShardInfo:
        return await self.shards.move(request, current())

    @unary
    async def Rebalance(self, request: pb.RebalanceRequest) -> pb.RebalanceResponse:
        return await self.shards.rebalance(request, current())

    @unary
    async def DrainWatcher(self, request: pb.DrainWatcherRequest) -> pb.DrainWatcherResponse:
        return await self.shards.drain(request, current())

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.TaskEvent]:
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            caller = current()
            await self._readable(request.task_id)
            async for event in self.tasks.watch(request):
                redact(event.entry, caller)
                yield event
        except Exception as e:
            await _abort(context, e)

    async def Session(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SessionResponse]:
        try:
            async for reply in self.streams.serve(requests, current()):
                yield reply
        except Exception as e:
            await _abort(context, e)

    async def WatchTasks(
        self, request: pb.WatchTasksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.Task]:
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            async for task in self.tasks.watch_tasks(current()):
                yield task
        except Exception as e:
            await _abort(context, e)
