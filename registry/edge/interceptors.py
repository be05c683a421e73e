"""What every call passes through before its handler: gRPC server interceptors, one
concern each.

In the order a call meets them (the server lists them so, the first outermost):

1. :class:`Metrics` counts every call by its status code, refused ones too;
2. :class:`Errors` turns what the rest raised into a status: a domain error into its
   code and trailing metadata (the table in ``kernel.errors``), a request that is not
   its method's message into ``INVALID_ARGUMENT``, anything else into ``INTERNAL``,
   logged with its traceback;
3. :class:`Authentication` finds the caller in the connection's certificate and makes
   it what ``identity.current()`` returns for the rest of the call;
4. :class:`Access` lets the caller in by the access table (``identity.POLICY``) or
   refuses the call before its handler runs;
5. :class:`RequestIds` scopes a unary request's ``request_id`` to its caller, its
   method and its arguments (a replay returns only the reply of the very same call).

Each wraps a method's behaviour once, the first time the method is called, so a call
costs a dictionary lookup per interceptor, not a new wrapper.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError, Message

from ...kernel import tracing
from ...kernel.contract import SERVICES
from ...kernel.errors import (
    NOTHING_TAKEN,
    BatonError,
    Internal,
    InvalidArgument,
    PermissionDenied,
    to_status,
)
from ..records.identity import authorize, caller_of, current, enter, scoped_request_id

if TYPE_CHECKING:
    from .metrics import RegistryMetrics

log = logging.getLogger("baton.registry")

#: the method paths of the registry's own services (not health checking, reflection)
BATON_PATHS = tuple(f"/{name}/" for name in SERVICES)

Context = grpc.aio.ServicerContext[Any, Any]
Behaviour = Callable[[Any, Context], Any]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable["grpc.RpcMethodHandler[Any, Any]"]]


@dataclass(frozen=True)
class Undecodable:
    """What a request that is not the method's protobuf message decodes to: refused as
    ``INVALID_ARGUMENT`` by :class:`Errors` (gRPC itself would answer ``UNKNOWN`` and
    log a traceback for an exception raised while decoding)."""

    request_type: str
    reason: str

    def error(self) -> InvalidArgument:
        return InvalidArgument(f"the request is not a valid {self.request_type}: {self.reason}",
                               request_type=self.request_type)


def decoder(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """The request deserializer of a method whose request message is ``cls``."""
    def decode(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Undecodable(cls.DESCRIPTOR.full_name, str(e) or "cannot decode")

    return decode


if TYPE_CHECKING:  # generic in the type stubs only
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


class _Wrapping(_Interceptor):
    """An interceptor that wraps each method's behaviour, once per method."""

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> Any:
        path: str = details.method
        handler = self._wrapped.get(path)
        if handler is None:
            inner = await continuation(details)
            if inner is None:  # no such method: gRPC answers UNIMPLEMENTED
                return None
            # Health checking and reflection answer everyone, as their protocols expect.
            ours = path.startswith(BATON_PATHS)
            handler = self._wrapped[path] = (self._wrap(path.rpartition("/")[2], inner)
                                             if ours else inner)
        return handler

    def _wrap(self, method: str, handler: Any) -> Any:
        if handler.request_streaming and handler.response_streaming:
            return handler._replace(stream_stream=self.stream(method, handler.stream_stream))
        if handler.response_streaming:
            return handler._replace(unary_stream=self.stream(method, handler.unary_stream))
        if handler.request_streaming:
            raise TypeError(f"{method}: client-streaming methods are not served")
        return handler._replace(unary_unary=self.unary(method, handler.unary_unary))

    def unary(self, method: str, behaviour: Behaviour) -> Behaviour:
        raise NotImplementedError

    def stream(self, method: str, behaviour: Behaviour) -> Behaviour:
        raise NotImplementedError


class Metrics(_Wrapping):
    """Counts every call (``RegistryMetrics.instrument``), refused ones too."""

    def __init__(self, metrics: RegistryMetrics) -> None:
        super().__init__()
        self.metrics = metrics

    def unary(self, method: str, behaviour: Behaviour) -> Behaviour:
        return self.metrics.instrument(method, behaviour, streaming=False)  # type: ignore[no-any-return]

    def stream(self, method: str, behaviour: Behaviour) -> Behaviour:
        return self.metrics.instrument(method, behaviour, streaming=True)  # type: ignore[no-any-return]


async def abort(context: Context, exc: Exception) -> None:
    """End the call with ``exc``'s status (``INTERNAL``, logged, for what is not a
    domain error)."""
    if not isinstance(exc, BatonError):
        log.exception("unexpected error", exc_info=exc)
        exc = Internal(f"internal error: {type(exc).__name__}: {exc}")
    code, details, metadata = to_status(exc)
    context.set_trailing_metadata(metadata)
    await context.abort(code, details)


class Errors(_Wrapping):
    """A raised error becomes the call's status; an undecodable request is refused."""

    def unary(self, method: str, behaviour: Behaviour) -> Behaviour:
        @functools.wraps(behaviour)
        async def call(request: Any, context: Context) -> Any:
            try:
                if isinstance(request, Undecodable):
                    raise request.error()
                return await behaviour(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await abort(context, e)
                raise  # unreachable: abort raises

        return call

    def stream(self, method: str, behaviour: Behaviour) -> Behaviour:
        @functools.wraps(behaviour)
        async def call(request: Any, context: Context) -> AsyncIterator[Any]:
            try:
                if isinstance(request, Undecodable):
                    raise request.error()
                async for item in behaviour(request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await abort(context, e)

        return call


class Authentication(_Wrapping):
    """The caller is who its certificate says (everyone is anonymous, holding every
    role, on a registry serving plaintext)."""

    def __init__(self, secure: bool) -> None:
        super().__init__()
        self.secure = secure

    def unary(self, method: str, behaviour: Behaviour) -> Behaviour:
        @functools.wraps(behaviour)
        async def call(request: Any, context: Context) -> Any:
            enter(caller_of(context.auth_context(), self.secure))
            return await behaviour(request, context)

        return call

    def stream(self, method: str, behaviour: Behaviour) -> Behaviour:
        @functools.wraps(behaviour)
        async def call(request: Any, context: Context) -> AsyncIterator[Any]:
            enter(caller_of(context.auth_context(), self.secure))
            async for item in behaviour(request, context):
                yield item

        return call


class Access(_Wrapping):
    """The access table lets the caller in, or the call is refused before its handler."""

    @staticmethod
    def _admit(method: str, context: Context) -> None:
        try:
            authorize(method, current())
        except PermissionDenied:
            log.warning("refused %s to %s from %s", method, current().describe(),
                        context.peer())
            raise

    def unary(self, method: str, behaviour: Behaviour) -> Behaviour:
        @functools.wraps(behaviour)
        async def call(request: Any, context: Context) -> Any:
            self._admit(method, context)
            return await behaviour(request, context)

        return call

    def stream(self, method: str, behaviour: Behaviour) -> Behaviour:
        @functools.wraps(behaviour)
        async def call(request: Any, context: Context) -> AsyncIterator[Any]:
            self._admit(method, context)
            async for item in behaviour(request, context):
                yield item

        return call


class RequestIds(_Wrapping):
    """A unary request's ``request_id``, scoped to the caller, the method and the
    request's other fields (the session stream scopes each call's the same way)."""

    def unary(self, method: str, behaviour: Behaviour) -> Behaviour:
        @functools.wraps(behaviour)
        async def call(request: Any, context: Context) -> Any:
            if getattr(request, "request_id", ""):
                request.request_id = scoped_request_id(current(), method, request)
            return await behaviour(request, context)

        return call

    def stream(self, method: str, behaviour: Behaviour) -> Behaviour:
        return behaviour  # streams carry no request id of their own


class Traces(_Wrapping):
    """A unary call that carries its caller's span (``traceparent`` metadata) gets a
    span of its own, the child of that one (installed only when traces are on)."""

    def unary(self, method: str, behaviour: Behaviour) -> Behaviour:
        name = f"baton.registry/{method}"

        @functools.wraps(behaviour)
        async def call(request: Any, context: Context) -> Any:
            parent = next((v for k, v in context.invocation_metadata() or ()
                           if k == "traceparent"), "")
            if not parent:
                return await behaviour(request, context)
            with tracing.using(tracing.start(name, parent=str(parent),
                                             attributes=tracing.call_attributes(request)),
                               unsent=NOTHING_TAKEN):
                return await behaviour(request, context)

        return call

    def stream(self, method: str, behaviour: Behaviour) -> Behaviour:
        return behaviour  # the session stream's calls carry their own (AgentCall)


def chain(*, secure: bool, metrics: RegistryMetrics | None) -> list[_Wrapping]:
    """The registry's interceptors, outermost first."""
    outer: list[_Wrapping] = [Metrics(metrics)] if metrics is not None else []
    inner: list[_Wrapping] = [Traces()] if tracing.ENABLED else []
    return [*outer, Errors(), Authentication(secure), Access(), RequestIds(), *inner]
