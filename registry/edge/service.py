"""The gRPC face of the registry: three services by audience, thin handlers over the
registry's parts.

``AgentService`` serves agents (sessions, claims, commits, consumes, acks, a task's
events), ``WatcherService`` the watchers (membership, shards, what they found on disk),
``OperatorService`` operators (tasks, the journal, leases, shards). Who may call what
follows the service (``identity.POLICY``); authentication, the access check, error
translation, metrics and request-id scoping are the server's interceptors
(``interceptors``), so a handler here only calls the part that does the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message_factory import GetMessageClass

from ...kernel.contract import DEFAULT_SHARDS, MAX_REPORT_BATCH, MAX_WATCH_BYTES, MAX_WATCH_EVENTS
from ...kernel.errors import InvalidArgument
from ...kernel.v1 import baton_pb2 as pb
from ...kernel.v1 import baton_pb2_grpc as pb_grpc
from ..records.access import check_reader
from ..records.identity import WATCHER, current, redact, scoped_request_id
from ..records.manifest import check_id
from ..rules.core import Core
from ..rules.pools import PoolAdmin
from ..verbs.checkpoints import Checkpoints
from ..verbs.consumers import Consumers
from ..verbs.leases import Leases
from ..verbs.operators import Operators
from ..verbs.producers import Producers
from ..verbs.removal import Removal
from ..verbs.retention import StagingRetention
from ..verbs.sessions import Sessions
from ..verbs.shards import Shards
from ..verbs.tasks import Tasks
from .agent_stream import AgentStreams, call_error
from .interceptors import Context, decoder


class Parts:
    """The registry's parts, made once and shared by its three services."""

    def __init__(self, core: Core, shards: Shards | None = None) -> None:
        self.core = core
        self.shards = shards or Shards(core, DEFAULT_SHARDS)
        self.tasks = Tasks(core)
        self.producers = Producers(core)
        self.consumers = Consumers(core)
        self.checkpoints = Checkpoints(core)
        self.leases = Leases(core)
        self.sessions = Sessions(core, renew=self.leases.renew)
        self.operators = Operators(core)
        self.removal = Removal(core)
        self.retention = StagingRetention(core)
        self.streams = AgentStreams(self.sessions, self.producers, self.consumers,
                                    self.checkpoints)
        self.pools = PoolAdmin(core)

    async def readable(self, task_id: str) -> None:
        """Refuse a read of ``task_id``'s contents its access rules do not allow the
        caller (access.check_reader); operators and watchers read every task."""
        caller = current()
        if caller.operator or WATCHER in caller.roles:
            return
        check_id("task_id", task_id)
        _, task = await self.core.task(task_id)
        check_reader(caller, task_id, task.readers)


def together(events: Sequence[pb.TaskEvent]) -> Iterator[list[pb.TaskEvent]]:
    """``events`` in runs, one ``Watch`` message each: at most ``MAX_WATCH_EVENTS``, and
    a run past ``MAX_WATCH_BYTES`` takes no more."""
    run: list[pb.TaskEvent] = []
    size = 0
    for event in events:
        run.append(event)
        size += event.ByteSize()
        if len(run) >= MAX_WATCH_EVENTS or size >= MAX_WATCH_BYTES:
            yield run
            run, size = [], 0
    if run:
        yield run


def add_to_server(servicer: Any, server: grpc.aio.Server) -> None:
    """Register ``servicer``'s methods under its service (the class's name in the
    contract), as the generated ``add_..._to_server`` does, but with a decoder that
    turns bytes that are not the request message into ``interceptors.Undecodable``
    (refused as ``INVALID_ARGUMENT``, not gRPC's ``UNKNOWN``)."""
    service = pb.DESCRIPTOR.services_by_name[type(servicer).__name__]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request = GetMessageClass(method.input_type)
        reply = GetMessageClass(method.output_type)
        make = (grpc.stream_stream_rpc_method_handler if method.client_streaming
                else grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=decoder(request),
                                     response_serializer=reply.SerializeToString)
    generic = grpc.method_handlers_generic_handler(service.full_name, handlers)
    server.add_generic_rpc_handlers((generic,))
    # as the generated code does: a registered method skips the generic lookup
    server.add_registered_method_handlers(  # type: ignore[attr-defined]  # not in grpc-stubs
        service.full_name, handlers)


def serve_all(parts: Parts, server: grpc.aio.Server) -> None:
    """Register the three services on ``server``."""
    for servicer in (AgentService(parts), WatcherService(parts), OperatorService(parts)):
        add_to_server(servicer, server)


class AgentService(pb_grpc.AgentServiceServicer):
    """What agents call: sessions, producers' and consumers' steps, a task's events."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.sessions, self.streams = parts.sessions, parts.streams
        self.producers, self.consumers = parts.producers, parts.consumers

    async def OpenSession(self, request: pb.OpenSessionRequest, context: Context
                          ) -> pb.OpenSessionResponse:
        return pb.OpenSessionResponse(session=await self.sessions.open(request, current()))

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Context
                        ) -> pb.KeepAliveResponse:
        return await self.sessions.keepalive(request, current())

    async def CloseSession(self, request: pb.CloseSessionRequest, context: Context
                           ) -> pb.CloseSessionResponse:
        return await self.sessions.close(request, current())

    async def Session(self, requests: AsyncIterator[Any], context: Context
                      ) -> AsyncIterator[pb.SessionResponse]:
        async for reply in self.streams.serve(requests, current()):
            yield reply

    async def Claim(self, request: pb.ClaimRequest, context: Context) -> pb.ClaimResponse:
        return await self.producers.claim(request, current())

    async def ClaimBatch(self, request: pb.ClaimBatchRequest, context: Context
                         ) -> pb.ClaimBatchResponse:
        return await self.producers.claim_batch(request, current())

    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        return pb.CommitResponse(entry=await self.producers.commit(request, current()))

    async def CommitBatch(self, request: pb.CommitBatchRequest, context: Context
                          ) -> pb.CommitBatchResponse:
        return await self.producers.commit_batch(request, current())

    async def Fail(self, request: pb.FailRequest, context: Context) -> pb.FailResponse:
        return pb.FailResponse(entry=await self.producers.fail(request, current()))

    async def Checkpoint(self, request: pb.CheckpointRequest, context: Context
                         ) -> pb.CheckpointResponse:
        return await self.parts.checkpoints.checkpoint(request, current())

    async def Consume(self, request: pb.ConsumeRequest, context: Context) -> pb.ConsumeResponse:
        return await self.consumers.consume(request, current())

    async def ConsumeBatch(self, request: pb.ConsumeBatchRequest, context: Context
                           ) -> pb.ConsumeBatchResponse:
        return await self.consumers.consume_batch(request, current())

    async def Ack(self, request: pb.AckRequest, context: Context) -> pb.AckResponse:
        return pb.AckResponse(entry=await self.consumers.ack(request, current()))

    async def Nack(self, request: pb.NackRequest, context: Context) -> pb.NackResponse:
        return pb.NackResponse(entry=await self.consumers.nack(request, current()))

    async def AckBatch(self, request: pb.AckBatchRequest, context: Context
                       ) -> pb.AckBatchResponse:
        return await self.consumers.ack_batch(request, current())

    async def Watch(self, request: pb.WatchRequest, context: Context
                    ) -> AsyncIterator[pb.WatchResponse]:
        caller = current()
        await self.parts.readable(request.task_id)
        async for events in self.parts.tasks.watch(request):
            for event in events:
                redact(event.entry, caller)
            if not request.together:
                for event in events:
                    yield pb.WatchResponse(event=event)
                continue
            for run in together(events):
                yield pb.WatchResponse(events=run)


class WatcherService(pb_grpc.WatcherServiceServicer):
    """What watchers call: membership, shards, and what they found on disk."""

    def __init__(self, parts: Parts) -> None:
        self.shards = parts.shards
        self.verifier = parts.producers.verifier
        self.retention = parts.retention

    async def RegisterWatcher(self, request: pb.RegisterWatcherRequest, context: Context
                              ) -> pb.RegisterWatcherResponse:
        return await self.shards.register(request, current())

    async def WatcherHeartbeat(self, request: pb.WatcherHeartbeatRequest, context: Context
                               ) -> pb.WatcherHeartbeatResponse:
        return await self.shards.heartbeat(request, current())

    async def ReleaseShard(self, request: pb.ReleaseShardRequest, context: Context
                           ) -> pb.ReleaseShardResponse:
        return await self.shards.release(request, current())

    async def ReportVerification(self, request: pb.ReportVerificationRequest, context: Context
                                 ) -> pb.ReportVerificationResponse:
        return pb.ReportVerificationResponse(entry=await self.verifier.report(request,
                                                                              current()))

    async def ReportVerificationBatch(self, request: pb.ReportVerificationBatchRequest,
                                      context: Context) -> pb.ReportVerificationBatchResponse:
        """Each report applied on its own (their transactions share etcd round trips
        through the group commit; one entry's in the order sent), each answered with
        its entry or its error."""
        if len(request.reports) > MAX_REPORT_BATCH:
            raise InvalidArgument(
                f"a batch carries at most {MAX_REPORT_BATCH} reports, not "
                f"{len(request.reports)}", limit=MAX_REPORT_BATCH)
        caller = current()
        Result = pb.ReportVerificationBatchResponse.Result

        async def one(report: pb.ReportVerificationRequest) -> Any:
            if report.request_id:  # scoped as a unary report's is
                report.request_id = scoped_request_id(caller, "ReportVerification", report)
            try:
                return Result(entry=await self.verifier.report(report, caller))
            except Exception as e:  # the report's own answer, not the batch's end
                return Result(error=call_error(e))

        # Reports of one entry apply in the order sent, as calls one after the other
        # would (a watcher may report a file twice while it is being written: the
        # later bytes must not be overtaken by the earlier); other entries' at once.
        results: list[Any] = [None] * len(request.reports)
        by_entry: dict[tuple[str, str], list[int]] = {}
        for i, report in enumerate(request.reports):
            by_entry.setdefault((report.task_id, report.file_id), []).append(i)

        async def in_order(positions: list[int]) -> None:
            for i in positions:
                results[i] = await one(request.reports[i])

        await asyncio.gather(*(in_order(positions) for positions in by_entry.values()))
        return pb.ReportVerificationBatchResponse(results=results)

    async def ReportProblem(self, request: pb.ReportProblemRequest, context: Context
                            ) -> pb.ReportProblemResponse:
        return pb.ReportProblemResponse(entry=await self.verifier.problem(request, current()))

    async def RemoveStaged(self, request: pb.RemoveStagedRequest, context: Context
                           ) -> pb.RemoveStagedResponse:
        return await self.retention.mark(request, current())


class OperatorService(pb_grpc.OperatorServiceServicer):
    """What operators call: tasks, the journal, sessions and leases, watchers and shards,
    concurrency pools."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.core, self.tasks, self.operators = parts.core, parts.tasks, parts.operators
        self.leases, self.shards, self.removal = parts.leases, parts.shards, parts.removal
        self.pools = parts.pools

    async def CreateTask(self, request: pb.CreateTaskRequest, context: Context
                         ) -> pb.CreateTaskResponse:
        return await self.tasks.create(request)

    async def GetTask(self, request: pb.GetTaskRequest, context: Context) -> pb.GetTaskResponse:
        await self.parts.readable(request.task_id)
        return pb.GetTaskResponse(task=await self.tasks.get(request.task_id))

    async def ListTasks(self, request: pb.ListTasksRequest, context: Context
                        ) -> pb.ListTasksResponse:
        return await self.tasks.list(request, current())

    async def WatchTasks(self, request: pb.WatchTasksRequest, context: Context
                         ) -> AsyncIterator[pb.WatchTasksResponse]:
        async for task, revision in self.tasks.watch_tasks(
                current(), request.start_revision, request.progress):
            yield pb.WatchTasksResponse(task=task, revision=revision)

    async def GetEntry(self, request: pb.GetEntryRequest, context: Context
                       ) -> pb.GetEntryResponse:
        await self.parts.readable(request.task_id)
        return pb.GetEntryResponse(entry=redact(await self.tasks.get_entry(request), current()))

    async def ListEntries(self, request: pb.ListEntriesRequest, context: Context
                          ) -> pb.ListEntriesResponse:
        await self.parts.readable(request.task_id)
        resp = await self.tasks.list_entries(request)
        for entry in resp.entries:
            redact(entry, current())
        return resp

    async def PauseTask(self, request: pb.PauseTaskRequest, context: Context
                        ) -> pb.PauseTaskResponse:
        return pb.PauseTaskResponse(task=await self.operators.control("pause", request,
                                                                      current()))

    async def ResumeTask(self, request: pb.ResumeTaskRequest, context: Context
                         ) -> pb.ResumeTaskResponse:
        return pb.ResumeTaskResponse(task=await self.operators.control("resume", request,
                                                                       current()))

    async def CancelTask(self, request: pb.CancelTaskRequest, context: Context
                         ) -> pb.CancelTaskResponse:
        return pb.CancelTaskResponse(task=await self.operators.control("cancel", request,
                                                                       current()))

    async def DeleteTask(self, request: pb.DeleteTaskRequest, context: Context
                         ) -> pb.DeleteTaskResponse:
        return await self.removal.delete(request, current())

    async def ArchiveTask(self, request: pb.ArchiveTaskRequest, context: Context
                          ) -> pb.ArchiveTaskResponse:
        if self.core.archive is None:
            raise InvalidArgument("this registry archives nothing: it has no --archive-dir")
        check_id("task_id", request.task_id)
        task = await self.core.archive.archive(request.task_id, request.reason,
                                               who=current().name or "operator")
        return pb.ArchiveTaskResponse(task=task)

    async def Requeue(self, request: pb.RequeueRequest, context: Context) -> pb.RequeueResponse:
        if request.group and not request.file_id:
            replayed = await self.operators.replay_task(request, current())
            return pb.RequeueResponse(replayed=replayed)
        return pb.RequeueResponse(entry=await self.operators.requeue(request, current()))

    async def Journal(self, request: pb.JournalRequest, context: Context) -> pb.JournalResponse:
        await self.parts.readable(request.task_id)
        resp = await self.operators.journal(request)
        for record in resp.records:
            redact(record, current())
        return resp

    async def Explain(self, request: pb.ExplainRequest, context: Context) -> pb.ExplainResponse:
        await self.parts.readable(request.task_id)
        resp = await self.operators.explain(request, current())
        redact(resp.entry, current())
        return resp

    async def ListAgents(self, request: pb.ListAgentsRequest, context: Context
                         ) -> pb.ListAgentsResponse:
        return await self.operators.agents()

    async def RevokeSession(self, request: pb.RevokeSessionRequest, context: Context
                            ) -> pb.RevokeSessionResponse:
        return await self.leases.revoke(request, current())

    async def RotateLease(self, request: pb.RotateLeaseRequest, context: Context
                          ) -> pb.RotateLeaseResponse:
        return await self.leases.rotate(request, current())

    async def DrainHost(self, request: pb.DrainHostRequest, context: Context
                        ) -> pb.DrainHostResponse:
        return await self.leases.drain(request, current())

    async def UndrainHost(self, request: pb.UndrainHostRequest, context: Context
                          ) -> pb.UndrainHostResponse:
        return await self.leases.undrain(request, current())

    async def ListWatchers(self, request: pb.ListWatchersRequest, context: Context
                           ) -> pb.ListWatchersResponse:
        return await self.shards.list_watchers()

    async def ListShards(self, request: pb.ListShardsRequest, context: Context
                         ) -> pb.ListShardsResponse:
        return await self.shards.list_shards()

    async def MoveShard(self, request: pb.MoveShardRequest, context: Context
                        ) -> pb.MoveShardResponse:
        return pb.MoveShardResponse(shard=await self.shards.move(request, current()))

    async def Rebalance(self, request: pb.RebalanceRequest, context: Context
                        ) -> pb.RebalanceResponse:
        return await self.shards.rebalance(request, current())

    async def DrainWatcher(self, request: pb.DrainWatcherRequest, context: Context
                           ) -> pb.DrainWatcherResponse:
        return await self.shards.drain(request, current())

    async def SetPool(self, request: pb.SetPoolRequest, context: Context
                      ) -> pb.SetPoolResponse:
        return pb.SetPoolResponse(pool=await self.pools.define(request, current()))

    async def ListPools(self, request: pb.ListPoolsRequest, context: Context
                        ) -> pb.ListPoolsResponse:
        return pb.ListPoolsResponse(pools=await self.pools.listed())

    async def DeletePool(self, request: pb.DeletePoolRequest, context: Context
                         ) -> pb.DeletePoolResponse:
        return pb.DeletePoolResponse(deleted=await self.pools.delete(request, current()))
