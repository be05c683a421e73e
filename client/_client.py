"""The agent-side client: one gRPC channel, typed errors, safe retries, sessions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ..kernel import errors
from ..kernel.contract import (
    DEFAULT_REGISTRY,
    MAX_MANIFEST_BYTES,
    MAX_REQUEST_BYTES,
    mib,
    version,
)
from ..kernel.errors import SessionExpired
from ..kernel.v1 import baton_pb2 as pb
from ._wire import (
    Attributes,
    Claim,
    Credentials,
    Lease,
    channel_options,
    encode_attributes,
    raise_from_rpc,
)
from .retry import RetryPolicy

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from .aio import AsyncClient, AsyncSession

T = TypeVar("T")

__all__ = ["DEFAULT_REGISTRY", "Claim", "Client", "Lease", "RetryPolicy", "Session",
           "parse_manifest"]

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

    client: Client
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
    carrier: Client | None = None

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

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Stub:
    """The registry's methods on a channel, each made when first called, from the
    service descriptor. The generated ``RegistryStub`` makes all thirty at once, a
    cost every short-lived ``baton`` process would pay for its one or two calls."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._service = pb.DESCRIPTOR.services_by_name["Registry"]

    def __getattr__(self, name: str) -> Any:
        method = self._service.methods_by_name.get(name)
        if method is None:
            raise AttributeError(name)
        request = getattr(pb, method.input_type.name)
        reply = getattr(pb, method.output_type.name)
        make = self._channel.unary_stream if method.server_streaming else self._channel.unary_unary
        call = make(f"/{self._service.full_name}/{name}",
                    request_serializer=request.SerializeToString,
                    response_deserializer=reply.FromString,
                    _registered_method=True)  # type: ignore[call-arg]  # as generated stubs do
        setattr(self, name, call)
        return call


class _Loop:
    """The event loop, in a daemon thread, where every blocking client of the process
    runs its stream sessions: the asyncio client is the one implementation of a
    session, the blocking one hands it each call. One per process, because gRPC's
    asyncio layer serves one running event loop at a time (a second one, running in
    another thread, gets its futures refused)."""

    _shared: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="baton-sessions",
                                       daemon=True)
        self.thread.start()

    @classmethod
    def shared(cls) -> _Loop:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        result: T = asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        return result


class Client:
    """A connection to a registry. Thread-safe; one per process is enough.

    With ``ca``, ``cert`` and ``key`` (paths of PEM files) it speaks mutual TLS,
    the certificate being the caller's identity; given none of them, it reads
    ``BATON_CA``, ``BATON_CERT`` and ``BATON_KEY``; with none set anywhere it
    speaks plaintext, which only a registry started with ``--insecure`` accepts.
    """

    def __init__(
        self,
        target: str = DEFAULT_REGISTRY,
        *,
        timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.credentials = Credentials.resolve(ca, cert, key)
        options = channel_options(target, self.credentials)
        if self.credentials.tls:
            self._channel = grpc.secure_channel(
                target, self.credentials.channel_credentials(), options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = _Stub(self._channel)
        #: guards the channel against use once closed (see :meth:`_method`)
        self._lock = threading.Lock()
        self.closed = False
        #: the asyncio client the stream sessions use, on its loop; made when first needed
        self._aio: AsyncClient | None = None
        self._loop: _Loop | None = None

    def close(self) -> None:
        """Close the channel; calls made afterwards raise ``ClientClosed``."""
        with self._lock:
            self.closed = True
            self._channel.close()
            loop, aio, self._loop, self._aio = self._loop, self._aio, None, None
        if loop is not None and aio is not None:
            loop.run(aio.close())

    def _streams(self) -> AsyncClient:
        """The asyncio client that carries this client's stream sessions."""
        with self._lock:
            if self.closed:
                raise errors.ClientClosed(f"this client of {self.target} is closed")
            if self._aio is None:
                from .aio import AsyncClient  # only agents that keep a session need it

                async def make() -> AsyncClient:
                    c = self.credentials
                    return AsyncClient(self.target, timeout=self.timeout, ca=c.ca,
                                       cert=c.cert, key=c.key)

                self._loop = _Loop.shared()
                self._aio = self._loop.run(make())
            return self._aio

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a stream session's call on the loop that carries it; its result."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise errors.ClientClosed(f"this client of {self.target} is closed")
        return loop.run(coro)

    def _method(self, name: str) -> Any:
        """The callable of a registry method. Making one on a closed channel crashes the
        process inside gRPC, so it is made under the lock ``close`` takes, and refused
        once closed (a session's keepalive thread may outlive its client)."""
        with self._lock:
            if self.closed:
                raise errors.ClientClosed(f"{name}: this client of {self.target} is closed")
            return getattr(self._stub, name)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any) -> Any:
        if hasattr(request, "request_id") and not request.request_id:
            request.request_id = os.urandom(16).hex()  # the same across retries
        size = request.ByteSize()
        if size > MAX_REQUEST_BYTES:
            raise errors.MessageTooLarge(
                f"{method}: the request is {mib(size)}; a registry accepts at most "
                f"{mib(MAX_REQUEST_BYTES)}", size=size, limit=MAX_REQUEST_BYTES)
        rpc = self._method(method)

        def attempt() -> Any:
            try:
                return rpc(request, timeout=self.timeout)
            except grpc.RpcError as e:
                raise self._explain(raise_from_rpc(e, method, self.timeout)) from None

        return self.retry.call(attempt)

    def _explain(self, error: errors.BatonError) -> errors.BatonError:
        """A connection refused by the transport, with what usually causes it."""
        if type(error) is not errors.Unavailable:
            return error
        text = error.message.lower()
        if self.credentials.tls and ("ssl" in text or "handshake" in text or "tls" in text):
            return errors.Unavailable(
                f"{error.message} (the TLS handshake with {self.target} failed: is "
                "BATON_CA the CA of the registry's certificate, and BATON_CERT/BATON_KEY "
                "an identity that CA signed?)")
        if not self.credentials.tls and "refused" not in text:
            return errors.Unavailable(
                f"{error.message} (this client speaks plaintext: a registry serving TLS "
                "needs BATON_CA, BATON_CERT and BATON_KEY)")
        return error

    # tasks -----------------------------------------------------------------

    def create_task(self, spec: pb.TaskSpec | dict[str, Any]) -> tuple[pb.Task, bool]:
        """Create a task from a manifest; (task, created). Same manifest again: no-op."""
        if isinstance(spec, dict):
            spec = parse_manifest(spec)
        check_manifest_size(spec)
        resp = self._call("CreateTask", pb.CreateTaskRequest(spec=spec))
        return resp.task, resp.created

    def get_task(self, task_id: str) -> pb.Task:
        return self._call("GetTask", pb.GetTaskRequest(task_id=task_id))  # type: ignore[no-any-return]

    def list_tasks(self, archived: bool = False) -> list[pb.Task]:
        """The tasks in etcd; with ``archived``, the tasks archived out of it."""
        return list(self._call("ListTasks", pb.ListTasksRequest(archived=archived)).tasks)

    def get_entry(self, task_id: str, file_id: str) -> pb.Entry:
        req = pb.GetEntryRequest(task_id=task_id, file_id=file_id)
        return self._call("GetEntry", req)  # type: ignore[no-any-return]

    def list_entries(self, task_id: str, state: int = 0, limit: int = 0) -> list[pb.Entry]:
        req = pb.ListEntriesRequest(task_id=task_id, state=state, limit=limit)  # type: ignore[arg-type]
        return list(self._call("ListEntries", req).entries)

    def pause_task(self, task_id: str, reason: str = "") -> pb.Task:
        """No new work: claims and consumes are refused (``TaskNotActive``) until
        ``resume_task``; claims and consumes in hand may still be finished."""
        return self._call("PauseTask", pb.TaskControlRequest(task_id=task_id, reason=reason))  # type: ignore[no-any-return]

    def resume_task(self, task_id: str, reason: str = "") -> pb.Task:
        return self._call("ResumeTask", pb.TaskControlRequest(task_id=task_id, reason=reason))  # type: ignore[no-any-return]

    def cancel_task(self, task_id: str, reason: str = "") -> pb.Task:
        """Stop the task for good: its claims are revoked (their tokens die)."""
        return self._call("CancelTask", pb.TaskControlRequest(task_id=task_id, reason=reason))  # type: ignore[no-any-return]

    def archive_task(self, task_id: str, reason: str = "") -> pb.Task:
        """Archive a completed or cancelled task now: out of etcd, into the archive."""
        req = pb.TaskControlRequest(task_id=task_id, reason=reason)
        return self._call("ArchiveTask", req)  # type: ignore[no-any-return]

    def delete_task(self, task_id: str, reason: str = "", *,
                    discard_history: bool = False) -> pb.DeleteTaskResponse:
        """Remove a task that never ran (no entry was ever claimed) or is stuck being
        created, and every key of it; an interrupted delete, sent again, finishes. A
        task that ran is refused with ``IllegalTransition`` (it is kept for audit),
        unless it is cancelled and ``discard_history`` says to delete its journal too."""
        req = pb.DeleteTaskRequest(task_id=task_id, reason=reason,
                                   discard_history=discard_history)
        return self._call("DeleteTask", req)  # type: ignore[no-any-return]

    def requeue(self, task_id: str, file_id: str) -> pb.Entry:
        """Bring a dead entry back to pending with a fresh retry budget."""
        return self._call("Requeue", pb.RequeueRequest(task_id=task_id, file_id=file_id))  # type: ignore[no-any-return]

    def journal(self, task_id: str, file_id: str = "", limit: int = 0) -> list[pb.JournalRecord]:
        """The journal's records, oldest first: the newest ``limit`` (0: all, up to the
        registry's bound on a reply; ``journal_reply`` says how many there are)."""
        return list(self.journal_reply(task_id, file_id, limit).records)

    def journal_reply(self, task_id: str, file_id: str = "", limit: int = 0
                      ) -> pb.JournalResponse:
        """``journal``'s reply: its records and ``total``, how many the journal holds."""
        req = pb.JournalRequest(task_id=task_id, file_id=file_id, limit=limit)
        return self._call("Journal", req)  # type: ignore[no-any-return]

    def explain(self, task_id: str, file_id: str) -> pb.Explanation:
        return self._call("Explain", pb.GetEntryRequest(task_id=task_id, file_id=file_id))  # type: ignore[no-any-return]

    def list_agents(self) -> list[pb.AgentInfo]:
        return list(self._call("ListAgents", pb.ListAgentsRequest()).agents)

    # sessions --------------------------------------------------------------

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
        if keepalive:
            aio = self._streams()
            stream = self._run(aio.open_session(agent, ttl, slots=slots, host=host))
            session = Session(self, stream.session_id, stream.agent, stream.ttl, stream=stream,
                              carrier=self)
            stream.on_lost.append(session.lost.set)
            return session
        req = pb.OpenSessionRequest(agent=agent, ttl=ttl, host=host or socket.gethostname(),
                                    pid=os.getpid(), version=version(), slots=slots)
        resp = self._call("OpenSession", req)
        return Session(self, resp.session_id, resp.agent, resp.ttl)

    def keepalive(self, session_id: int) -> int:
        """Refresh a session's lease once; the TTL it now has."""
        return int(self.refresh_session(session_id).ttl)

    def refresh_session(self, session_id: int) -> pb.KeepAliveResponse:
        """Refresh a session's lease once; the registry's whole reply: the TTL, and
        whether the session's host is drained."""
        return self._call("KeepAlive", pb.KeepAliveRequest(session_id=session_id))  # type: ignore[no-any-return]

    # leases (operators) ------------------------------------------------------

    def revoke_sessions(self, session_id: int = 0, *, agent: str = "", host: str = "",
                        reason: str = "") -> list[pb.RevokedSession]:
        """Revoke the session named, or every session of ``agent`` or of ``host``: their
        claims go back at once without spending a retry, their tokens die."""
        req = pb.RevokeSessionRequest(session_id=session_id, agent=agent, host=host,
                                      reason=reason)
        return list(self._call("RevokeSession", req).sessions)

    def rotate_leases(self, session_id: int = 0, *, every: bool = False, host: str = "",
                      ttl: int = 0) -> list[pb.RotatedSession]:
        """Move the session named (every session, those of ``host``) onto a fresh etcd
        lease, with ``ttl`` (0: its own) from its next keepalive; claims, tokens and
        session ids stay. The new lease has no more time than the old one had left."""
        req = pb.RotateLeaseRequest(session_id=session_id, all=every, host=host, ttl=ttl)
        return list(self._call("RotateLease", req).sessions)

    def drain_host(self, host: str, deadline: int = 0, reason: str = "") -> pb.DrainHostResponse:
        """Drain ``host``: its sessions take no new work; what they still hold after
        ``deadline`` seconds (0: the registry's default) is revoked."""
        req = pb.DrainHostRequest(host=host, deadline_seconds=deadline, reason=reason)
        return self._call("DrainHost", req)  # type: ignore[no-any-return]

    def undrain_host(self, host: str) -> pb.UndrainHostResponse:
        return self._call("UndrainHost", pb.UndrainHostRequest(host=host))  # type: ignore[no-any-return]

    def close_session(self, session_id: int) -> None:
        self._call("CloseSession", pb.CloseSessionRequest(session_id=session_id))

    # producers -------------------------------------------------------------

    def claim(self, task_id: str, file_id: str = "", *, session: Session | int) -> Claim:
        """Claim an entry (or the next claimable one) for writing."""
        if (stream := _stream_of(session)) is not None:
            return self._run(stream.claim(task_id, file_id))
        sid = _session_id(session)
        with _draining(session):
            resp = self._call("Claim", pb.ClaimRequest(task_id=task_id, file_id=file_id,
                                                       session_id=sid))
        return Claim(task_id, resp.entry.file_id, resp.token, resp.path, resp.entry, sid)

    def claim_batch(self, task_id: str, max_count: int, *, session: Session | int) -> list[Claim]:
        """Claim up to ``max_count`` entries in one transaction (all or nothing)."""
        if (stream := _stream_of(session)) is not None:
            return self._run(stream.claim_batch(task_id, max_count))
        sid = _session_id(session)
        with _draining(session):
            resp = self._call("ClaimBatch", pb.ClaimBatchRequest(
                task_id=task_id, session_id=sid, max=max_count))
        return [Claim(task_id, c.entry.file_id, c.token, c.path, c.entry, sid)
                for c in resp.claims]

    def commit_batch(self, commits: Sequence[tuple[str, str, int, int, str]
                                             | tuple[str, str, int, int, str, Attributes]]
                     ) -> list[pb.Entry]:
        """Commit (task, file_id, token, size, digest[, attributes]) tuples in one
        transaction."""
        req = pb.CommitBatchRequest(commits=[
            pb.CommitRequest(task_id=c[0], file_id=c[1], token=c[2], size=c[3], digest=c[4],
                             attributes=encode_attributes(c[5] if len(c) > 5 else None))
            for c in commits])
        return list(self._call("CommitBatch", req).entries)

    def commit(self, task_id: str, file_id: str, token: int, size: int,
               digest: str = "", *, session: Session | int = 0,
               attributes: Attributes = None) -> pb.Entry:
        """Publish a claim's file: its size and BLAKE3 ``digest`` (required unless the
        task sets ``digest_optional``). ``session``: the one holding the claim (the
        registry then checks it holds it). ``attributes``: what the task's routing
        rules look at (see ``encode_attributes``)."""
        if (stream := _stream_of(session)) is not None:
            return self._run(stream.commit(task_id, file_id, token, size, digest,
                                           attributes=attributes))
        req = pb.CommitRequest(task_id=task_id, file_id=file_id, token=token, size=size,
                               digest=digest, session_id=_named_session(session),
                               attributes=encode_attributes(attributes))
        return self._call("Commit", req).entry  # type: ignore[no-any-return]

    def commit_and_claim(self, task_id: str, file_id: str, token: int, size: int,
                         digest: str = "", *, session: Session,
                         attributes: Attributes = None) -> tuple[pb.Entry, Claim | None]:
        """Commit a claim and claim the task's next entry in one step (one message on
        the session's stream, one etcd transaction): the committed entry and the next
        claim, None when none can be taken now. Needs a session kept on its stream."""
        return self._run(_needs_stream(session, "commit_and_claim").commit_and_claim(
            task_id, file_id, token, size, digest, attributes=attributes))

    def fail(self, task_id: str, file_id: str, token: int, reason: str = "", *,
             session: Session | int = 0) -> pb.Entry:
        if (stream := _stream_of(session)) is not None:
            return self._run(stream.fail(task_id, file_id, token, reason))
        req = pb.FailRequest(task_id=task_id, file_id=file_id, token=token, reason=reason,
                             session_id=_named_session(session))
        return self._call("Fail", req).entry  # type: ignore[no-any-return]

    def report(self, task_id: str, file_id: str, size: int, digest: str,
               identity: pb.FileIdentity | None = None, reporter: str = "", *,
               watcher_id: str = "", shard_epoch: int = 0) -> pb.Entry:
        """Report what a watcher hashed on disk (the registry verifies against it).
        ``watcher_id``, ``shard_epoch``: the reporting watcher and the epoch at which
        it owns the task's shard (once watchers hold shards, only the owner counts)."""
        req = pb.VerificationReport(task_id=task_id, file_id=file_id, size=size, digest=digest,
                                    identity=identity, reporter=reporter,
                                    watcher_id=watcher_id, shard_epoch=shard_epoch)
        return self._call("ReportVerification", req).entry  # type: ignore[no-any-return]

    def report_problem(self, task_id: str, file_id: str, kind: int, reason: str,
                       reporter: str = "", *, watcher_id: str = "",
                       shard_epoch: int = 0) -> pb.Entry:
        """Report that a file cannot be vouched for (``pb.ProblemReport.CORRUPTED``/``MISSING``)."""
        req = pb.ProblemReport(task_id=task_id, file_id=file_id, kind=kind,  # type: ignore[arg-type]
                               reason=reason, reporter=reporter, watcher_id=watcher_id,
                               shard_epoch=shard_epoch)
        return self._call("ReportProblem", req).entry  # type: ignore[no-any-return]

    def remove_staged(self, task_id: str, file_id: str, size: int, digest: str,
                      reporter: str = "", *, watcher_id: str = "",
                      shard_epoch: int = 0) -> pb.RemoveStagedResponse:
        """Ask to remove a consumed entry's file from staging, giving the size and
        digest read from it just now; the outcome says whether to unlink it (only the
        owner of the task's shard at ``shard_epoch`` is believed)."""
        req = pb.RemoveStagedRequest(task_id=task_id, file_id=file_id, size=size,
                                     digest=digest, reporter=reporter,
                                     watcher_id=watcher_id, shard_epoch=shard_epoch)
        return self._call("RemoveStaged", req)  # type: ignore[no-any-return]

    # watcher membership and shards --------------------------------------------

    def register_watcher(self, root: str, reporter: str = "", ttl: int = 10,
                         capacity: pb.WatcherCapacity | None = None, *,
                         previous: str = "") -> pb.RegisterWatcherResponse:
        """Register a watcher on its own lease; keep it with :meth:`watcher_heartbeat`.
        ``previous``: the registration this watcher had before it restarted, which ends
        now (its shards are the new one's at once)."""
        req = pb.RegisterWatcherRequest(host=socket.gethostname(), pid=os.getpid(), root=root,
                                        reporter=reporter, ttl=ttl, version=version(),
                                        capacity=capacity, previous_watcher_id=previous)
        return self._call("RegisterWatcher", req)  # type: ignore[no-any-return]

    def watcher_heartbeat(self, watcher_id: str, capacity: pb.WatcherCapacity | None = None
                          ) -> pb.WatcherHeartbeatResponse:
        """Refresh a watcher's lease; the shards it owns now (and those to hand over)."""
        req = pb.WatcherHeartbeatRequest(watcher_id=watcher_id, capacity=capacity)
        return self._call("WatcherHeartbeat", req)  # type: ignore[no-any-return]

    def release_shard(self, watcher_id: str, shard: int, epoch: int) -> pb.ShardInfo:
        req = pb.ReleaseShardRequest(watcher_id=watcher_id, shard=shard, epoch=epoch)
        return self._call("ReleaseShard", req).shard  # type: ignore[no-any-return]

    def list_watchers(self) -> list[pb.WatcherInfo]:
        return list(self._call("ListWatchers", pb.ListWatchersRequest()).watchers)

    def list_shards(self) -> pb.ListShardsResponse:
        return self._call("ListShards", pb.ListShardsRequest())  # type: ignore[no-any-return]

    def move_shard(self, shard: int, to_watcher: str, deadline: int = 0) -> pb.ShardInfo:
        """Start moving a shard (its owner hands it over within ``deadline`` seconds)."""
        req = pb.MoveShardRequest(shard=shard, to_watcher=to_watcher, deadline=deadline)
        return self._call("MoveShard", req)  # type: ignore[no-any-return]

    def rebalance(self, dry_run: bool = False) -> list[pb.ShardMove]:
        return list(self._call("Rebalance", pb.RebalanceRequest(dry_run=dry_run)).moves)

    def drain_watcher(self, watcher_id: str, undo: bool = False) -> pb.DrainWatcherResponse:
        req = pb.DrainWatcherRequest(watcher_id=watcher_id, undo=undo)
        return self._call("DrainWatcher", req)  # type: ignore[no-any-return]

    # consumers -------------------------------------------------------------

    def consume(self, task_id: str, group: str = "default", file_id: str = "", *,
                session: Session | int) -> Lease:
        """Take a verified entry (or the next one) for ``group``."""
        if (stream := _stream_of(session)) is not None:
            return self._run(stream.consume(task_id, group, file_id))
        sid = _session_id(session)
        req = pb.ConsumeRequest(task_id=task_id, group=group, file_id=file_id, session_id=sid)
        with _draining(session):
            r = self._call("Consume", req)
        return Lease(task_id, r.entry.file_id, r.group, r.token, r.path, r.size, r.digest,
                     r.entry, sid)

    def consume_batch(self, task_id: str, group: str = "default", max_count: int = 21, *,
                      session: Session | int) -> list[Lease]:
        """Take up to ``max_count`` verified entries for ``group`` in one transaction
        (all or nothing, at most 21); ack them together with :meth:`ack_batch`."""
        if (stream := _stream_of(session)) is not None:
            return self._run(stream.consume_batch(task_id, group, max_count))
        sid = _session_id(session)
        req = pb.ConsumeBatchRequest(task_id=task_id, group=group, session_id=sid,
                                     max=max_count)
        with _draining(session):
            resp = self._call("ConsumeBatch", req)
        return [Lease(task_id, r.entry.file_id, r.group, r.token, r.path, r.size, r.digest,
                      r.entry, sid) for r in resp.leases]

    def ack(self, task_id: str, file_id: str, group: str, token: int, *,
            session: Session | int = 0) -> pb.Entry:
        if (stream := _stream_of(session)) is not None:
            return self._run(stream.ack(task_id, file_id, group, token))
        req = pb.AckRequest(task_id=task_id, file_id=file_id, group=group, token=token,
                            session_id=_named_session(session))
        return self._call("Ack", req).entry  # type: ignore[no-any-return]

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
        req = pb.AckBatchRequest(acks=[
            pb.AckRequest(task_id=t, file_id=f, group=g, token=tok) for t, f, g, tok in acks])
        return list(self._call("AckBatch", req).entries)

    def nack(self, task_id: str, file_id: str, group: str, token: int,
             reason: str = "", *, session: Session | int = 0) -> pb.Entry:
        if (stream := _stream_of(session)) is not None:
            return self._run(stream.nack(task_id, file_id, group, token, reason))
        req = pb.NackRequest(task_id=task_id, file_id=file_id, group=group, token=token,
                             reason=reason, session_id=_named_session(session))
        return self._call("Nack", req).entry  # type: ignore[no-any-return]

    # events ----------------------------------------------------------------

    def watch_tasks(self, timeout: float | None = None) -> Generator[pb.Task, None, None]:
        """Every task header, then each again as it changes (created, paused, completed)."""
        call = self._method("WatchTasks")(pb.WatchTasksRequest(), timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return
            raise raise_from_rpc(e) from None
        finally:
            call.cancel()

    def watch(self, task_id: str, start_revision: int = 0,
              timeout: float | None = None) -> Generator[pb.TaskEvent, None, None]:
        """The task's events (see ``WatchRequest``); ends quietly when ``timeout`` passes."""
        request = pb.WatchRequest(task_id=task_id, start_revision=start_revision)
        call = self._method("Watch")(request, timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            raise raise_from_rpc(e) from None
        finally:
            call.cancel()


@contextmanager
def _draining(session: Session | int) -> Iterator[None]:
    """A ``Draining`` refusal marks the session draining."""
    try:
        yield
    except errors.Draining:
        if isinstance(session, Session):
            session.drained()
        raise


def _stream_of(session: Session | int) -> AsyncSession | None:
    """The stream a session's calls travel on (None: unary calls)."""
    return session.stream if isinstance(session, Session) else None


def _needs_stream(session: Session, what: str) -> AsyncSession:
    if session.stream is None:
        raise errors.InvalidArgument(f"{what} needs a session kept on its stream "
                                     "(open_session with keepalive)")
    return session.stream


def _named_session(session: Session | int) -> int:
    """The id of the session a token call names (no check: the registry decides)."""
    return session.session_id if isinstance(session, Session) else int(session)


def _session_id(session: Session | int) -> int:
    if isinstance(session, Session):
        session.check()
        return session.session_id
    return int(session)


def check_manifest_size(spec: pb.TaskSpec) -> None:
    """Refuse a manifest larger than a registry accepts, before sending it."""
    size = spec.ByteSize()
    if size > MAX_MANIFEST_BYTES:
        why = (f"the manifest is {mib(size)} encoded; a registry accepts at most "
               f"{mib(MAX_MANIFEST_BYTES)} (split the task, or shorten paths, ids and labels)")
        raise errors.InvalidManifest(f"invalid manifest: {why}", problems=[why],
                                     size=size, limit=MAX_MANIFEST_BYTES)


def parse_manifest(data: dict[str, Any]) -> pb.TaskSpec:
    """A manifest (JSON object) as a ``TaskSpec``; unknown fields are an error."""
    from google.protobuf import json_format  # only manifests need it, not every command

    try:
        return json_format.ParseDict(data, pb.TaskSpec())
    except json_format.ParseError as e:
        raise errors.InvalidManifest(f"invalid manifest: {e}", problems=[str(e)]) from None
