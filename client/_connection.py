"""A connection to a registry: one gRPC channel, typed errors, safe retries, and the
event loop that carries the agents' calls. The calls themselves are grouped as the
registry's services are (``_agent``, ``_watcher_calls``, ``_operator``); the agents'
are the asyncio client's (``_core``, ``aio``), run on that loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ..kernel import errors, tracing
from ..kernel.contract import DEFAULT_REGISTRY
from ._wire import (
    Credentials,
    channel_options,
    checked,
    explained,
    method_of,
    raise_from_rpc,
)
from .retry import RetryPolicy

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from .aio import AsyncClient

T = TypeVar("T")
C = TypeVar("C", bound="Connection")

log = logging.getLogger("baton.client")


class _Stub:
    """The registry's methods on a channel, each made when first called
    (``method_of``)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel

    def __getattr__(self, name: str) -> Any:
        call = method_of(self._channel, name)
        setattr(self, name, call)
        return call


class _Loop:
    """The event loop, in a daemon thread, where every blocking client of the process
    runs its agent calls (on a session's stream or unary) and its long-lived streams
    (``Connection.spawn``): the asyncio client is the one implementation of the agent's
    calls, the blocking one hands it each call. One per process, because gRPC's asyncio
    layer serves one running event loop at a time (a second one, running in another
    thread, gets its futures refused)."""

    _shared: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="baton-streams",
                                       daemon=True)
        self.thread.start()

    @classmethod
    def shared(cls) -> _Loop:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a blocking client's call made on its own event loop's thread "
                               "would wait for itself: await the asyncio client's call there")
        # the caller's span goes with the call (traces on): the registry's is its child
        result: T = asyncio.run_coroutine_threadsafe(tracing.carried(coro), self.loop).result()
        return result

    def start(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


class Connection:
    """One registry connection (see ``Client``, which adds the calls)."""

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
        """The asyncio client that carries this client's agent calls: its stream
        sessions and its unary calls."""
        with self._lock:
            if self.closed:
                raise errors.ClientClosed(f"this client of {self.target} is closed")
            if self._aio is None:
                from .aio import AsyncClient  # only agents that keep a session need it

                async def make() -> AsyncClient:
                    c = self.credentials
                    return AsyncClient(self.target, timeout=self.timeout, retry=self.retry,
                                       ca=c.ca, cert=c.cert, key=c.key)

                self._loop = _Loop.shared()
                self._aio = self._loop.run(make())
            return self._aio

    def spawn(self, make: Callable[[AsyncClient], Coroutine[Any, Any, T]]
              ) -> concurrent.futures.Future[T]:
        """Run ``make(client)`` on the loop that carries this client's streams, without
        waiting for it; its future (cancelling it cancels the coroutine). ``client`` is
        this client's asyncio twin: the same registry, channel options and identity
        (mutual TLS as here). However many streams a process follows so, they share
        one thread, and an idle one costs nothing until a message arrives."""
        aio = self._streams()
        loop = self._loop
        if loop is None:  # closed since
            raise errors.ClientClosed(f"this client of {self.target} is closed")
        return loop.start(make(aio))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run an agent call of the asyncio client on the loop that carries it; its
        result."""
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

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any) -> Any:
        """A unary call of the operators' or the watchers' services (the agents' calls
        are the asyncio client's, run on its loop: ``_run``)."""
        checked(method, request)
        rpc = self._method(method)

        metadata = None
        if tracing.ENABLED and (parent := tracing.current()):
            metadata = (("traceparent", parent),)  # the registry's span is its child

        def attempt() -> Any:
            try:
                return rpc(request, timeout=self.timeout, metadata=metadata)
            except grpc.RpcError as e:
                raise explained(raise_from_rpc(e, method, self.timeout), self.credentials,
                                self.target) from None

        return self.retry.call(attempt)


class Calls:
    """The calls of one of the registry's services, made over a connection they share
    with the others (``Client.operator``, ``Client.watcher``)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    def _call(self, method: str, request: Any) -> Any:
        return self._connection._call(method, request)

    def _method(self, name: str) -> Any:
        return self._connection._method(name)
