"""An agent's session on one bidirectional stream (``Session``).

A unary call costs the registry about 2.6 times the CPU of a message on a stream that
is already open (docs/performance.md), and an agent's loop is a chain of short calls:
so an agent opens its session on a stream and sends its calls on it as messages.

The first message opens a session or resumes one whose stream broke; each later one
is a call with its own ``call_id``, run as soon as it arrives, answered when done (in
any order) with its reply or its error. Keepalive is a call too: the stream being open
keeps nothing alive by itself, so an agent that stops (SIGSTOP, a hung loop) loses its
session at its TTL exactly as over unary calls. A broken stream ends nothing: the
session lives on its lease, and the agent resumes it on a new stream and sends again
what was not answered; each request's ``request_id`` makes a call that did apply the
first time answer from its request record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ...kernel import tracing
from ...kernel.errors import (
    NOTHING_TAKEN,
    BatonError,
    Internal,
    InvalidArgument,
    Unavailable,
    to_status,
)
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import Caller, scoped_request_id
from ..verbs.checkpoints import Checkpoints
from ..verbs.consumers import Consumers
from ..verbs.fused import Fused
from ..verbs.producers import Producers
from ..verbs.sessions import Sessions

log = logging.getLogger("baton.registry")

#: what the registry does with each kind of call: (the unary method it stands for,
#: how it is handled)
Handler = Callable[[Any, Caller], Awaitable[Any]]
#: ``(method, error or None, seconds, reply or None)`` of each call, for the metrics
Recorder = Callable[[str, BaseException | None, float, Any], None]

#: the unary method each kind of call stands for (its name in metrics and logs)
METHODS = {
    "claim": "Claim", "commit": "Commit", "fail": "Fail", "consume": "Consume",
    "ack": "Ack", "nack": "Nack", "claim_batch": "ClaimBatch",
    "commit_batch": "CommitBatch", "consume_batch": "ConsumeBatch", "ack_batch": "AckBatch",
    "keepalive": "KeepAlive", "commit_and_claim": "CommitAndClaim",
    "ack_and_consume": "AckAndConsume", "checkpoint": "Checkpoint",
    "commit_and_claim_batch": "CommitAndClaimBatch",
}


def call_error(error: BaseException) -> pb.CallError:
    """``error`` as a unary call would have ended with it (an unexpected one logged and
    sent as ``INTERNAL``)."""
    if not isinstance(error, BatonError):
        log.error("unexpected error in a call of a stream or a batch", exc_info=error)
        error = Internal(f"internal error: {type(error).__name__}: {error}")
    code, details, metadata = to_status(error)
    return pb.CallError(code=code.name, details=details, metadata=dict(metadata))


#: put among the replies to break the stream there (see ``AgentStreams.cut``)
_CUT = pb.SessionResponse()


@dataclass
class _Stream:
    """One open stream: its caller, its session, the calls still running."""

    caller: Caller
    session_id: int = 0
    running: int = 0


class AgentStreams:
    """Serves ``Session`` streams over the handlers the unary methods use."""

    def __init__(self, sessions: Sessions, producers: Producers, consumers: Consumers,
                 checkpoints: Checkpoints, record: Recorder | None = None) -> None:
        fused = Fused(producers, consumers)
        self.sessions = sessions
        self.record = record
        #: streams open on this replica, and the calls served on them by kind
        self.open = 0
        self.served: Counter[str] = Counter()
        #: every call still running, held here so that one whose stream ended finishes
        self.inflight: set[asyncio.Task[None]] = set()
        #: a fault to inject (the fault suite's nemesis, tests): called with each call's
        #: kind once it has applied; True breaks the stream before the reply is sent
        self.cut: Callable[[str], bool] | None = None
        self.handlers: dict[str, Handler] = {
            "claim": producers.claim,
            "commit": _entry(pb.CommitResponse, producers.commit),
            "fail": _entry(pb.FailResponse, producers.fail),
            "claim_batch": producers.claim_batch,
            "commit_batch": producers.commit_batch,
            "consume": consumers.consume,
            "ack": _entry(pb.AckResponse, consumers.ack),
            "nack": _entry(pb.NackResponse, consumers.nack),
            "consume_batch": consumers.consume_batch,
            "ack_batch": consumers.ack_batch,
            "keepalive": sessions.keepalive,
            "commit_and_claim": fused.commit_and_claim,
            "ack_and_consume": fused.ack_and_consume,
            "commit_and_claim_batch": fused.commit_and_claim_batch,
            "checkpoint": checkpoints.checkpoint,
        }

    async def serve(self, requests: AsyncIterator[Any], caller: Caller
                    ) -> AsyncIterator[pb.SessionResponse]:
        """The replies to ``requests``: the session first, then each call's reply as it
        is done. A domain error of the first message ends the stream with it; a call's
        error is that call's reply."""
        stream = _Stream(caller)
        replies: asyncio.Queue[pb.SessionResponse | None] = asyncio.Queue()
        first = await anext(aiter(requests), None)
        if first is None:
            return
        reader: asyncio.Task[None] | None = None
        self.open += 1
        try:
            yield pb.SessionResponse(session=await self._begin(stream, _decoded(first)))
            reader = asyncio.create_task(self._read(stream, requests, replies))
            while (reply := await replies.get()) is not None:
                if reply is _CUT:
                    raise Unavailable("the session stream was cut (an injected fault)")
                yield reply
            await reader  # its error (an undecodable message) ends the stream
        finally:
            self.open -= 1
            if reader is not None and not reader.done():
                # The agent went away; the calls already running finish on their own
                # (each is one etcd transaction): their replies wait in the request
                # records for the same calls sent again on the next stream.
                reader.cancel()

    async def _begin(self, stream: _Stream, first: pb.SessionRequest) -> pb.Session:
        kind = first.WhichOneof("kind")
        if kind == "open":
            session = await self.sessions.open(first.open, stream.caller)
        elif kind == "resume":
            session = await self.sessions.resume(first.resume.session_id, stream.caller)
        else:
            raise InvalidArgument("a session stream starts with open or resume, not a call",
                                  got=kind or "nothing")
        stream.session_id = session.session_id
        return session

    async def _read(self, stream: _Stream, requests: AsyncIterator[Any],
                    replies: asyncio.Queue[pb.SessionResponse | None]) -> None:
        """Start each call as it arrives; put None once the agent is done sending and
        every call has been answered."""
        done = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            self.inflight.discard(task)
            stream.running -= 1
            if not tasks and reading_over:
                done.set()

        reading_over = False
        try:
            async for message in requests:
                request = _decoded(message)
                if request.WhichOneof("kind") != "call":
                    raise InvalidArgument("a session stream opens once: after its first "
                                          "message, only calls",
                                          got=request.WhichOneof("kind") or "nothing")
                task = asyncio.create_task(self._call(stream, request.call, replies))
                stream.running += 1
                tasks.add(task)
                self.inflight.add(task)
                task.add_done_callback(finished)
        except BaseException:
            replies.put_nowait(None)  # the stream ends with this error
            raise
        finally:
            reading_over = True
            if not tasks:
                done.set()
        await done.wait()
        replies.put_nowait(None)

    async def _call(self, stream: _Stream, call: pb.AgentCall,
                    replies: asyncio.Queue[pb.SessionResponse | None]) -> None:
        kind = call.WhichOneof("request")
        start = time.monotonic()
        reply = pb.AgentReply(call_id=call.call_id)
        error: BaseException | None = None
        result: Any = None
        try:
            if kind is None:
                raise InvalidArgument("a call names no request", call_id=call.call_id)
            request = getattr(call, kind)
            self._fill(stream, kind, request)
            if tracing.ENABLED and call.traceparent:  # the caller's span is the parent
                with tracing.using(tracing.start(
                        f"baton.registry/{METHODS.get(kind, kind)}", parent=call.traceparent,
                        attributes=tracing.call_attributes(request)), unsent=NOTHING_TAKEN):
                    result = await self.handlers[kind](request, stream.caller)
            else:
                result = await self.handlers[kind](request, stream.caller)
            getattr(reply, kind).CopyFrom(result)
            self.served[kind] += 1
            if self.cut is not None and self.cut(kind):
                replies.put_nowait(_CUT)
                return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every error is this call's reply, not the stream's end
            error = e
            reply.error.CopyFrom(call_error(e))
        if self.record is not None:
            self.record(METHODS.get(kind or "", "Session"), error, time.monotonic() - start,
                        result)
        replies.put_nowait(pb.SessionResponse(reply=reply))

    @staticmethod
    def _fill(stream: _Stream, kind: str, request: Any) -> None:
        """The stream's session where a call leaves it out, and its request id scoped
        to the caller as a unary call's is (each part's, for a fused step)."""
        for part in (request, *_parts(request)):
            if hasattr(part, "session_id") and not part.session_id:
                part.session_id = stream.session_id
            if getattr(part, "request_id", ""):
                part.request_id = scoped_request_id(
                    stream.caller, f"Session.{kind}", part)


def _entry(response: Any, handler: Callable[[Any, Caller], Awaitable[pb.Entry]]) -> Handler:
    """A handler that returns an entry, as its reply message (``{entry: ...}``)."""

    async def wrapped(request: Any, caller: Caller) -> Any:
        return response(entry=await handler(request, caller))

    return wrapped


def _parts(request: Any) -> tuple[Any, ...]:
    """The requests a fused step is made of (none for other calls)."""
    if isinstance(request, pb.CommitAndClaimRequest):
        return request.commit, request.claim
    if isinstance(request, pb.CommitAndClaimBatchRequest):
        return tuple(request.commits)
    if isinstance(request, pb.AckAndConsumeRequest):
        return request.ack, request.consume
    return ()


def _decoded(message: Any) -> pb.SessionRequest:
    """The message, or the precise error of one that was not a SessionRequest."""
    if not isinstance(message, pb.SessionRequest):
        raise message.error()  # an Undecodable: the stream ends with INVALID_ARGUMENT
    return message
