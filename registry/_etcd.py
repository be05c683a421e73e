"""The only module that talks to etcd (through aetcd's channel and v3 stubs).

It exposes a small typed surface (``KV``, compares, ops, ``Etcd``) and turns
every client error into a Baton error here, keeping the cause, so nothing else
in the registry needs to know which etcd client library is underneath.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar

import aetcd
import grpc
from aetcd import rpc

from client.errors import Internal, SessionExpired, Unavailable

from .keys import prefix_end

P = ParamSpec("P")
R = TypeVar("R")

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}


class Compacted(Unavailable):
    """A watch asked for a revision etcd has already compacted away."""


def _translate(exc: BaseException) -> Exception:
    if isinstance(exc, grpc.aio.AioRpcError):
        details = exc.details() or ""
        if "lease not found" in details:
            return SessionExpired(f"etcd lease not found ({details})")
        if exc.code() in _RETRYABLE:
            return Unavailable(f"etcd unavailable: {details or exc.code().name}")
        return Internal(f"etcd error {exc.code().name}: {details}")
    if isinstance(exc, aetcd.ClientError):
        return Unavailable(f"etcd client error: {exc}")
    return Internal(f"etcd error: {exc!r}")


def _etcd_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except (grpc.aio.AioRpcError, aetcd.ClientError) as e:
            raise _translate(e) from e

    return wrapper


@dataclass(frozen=True, slots=True)
class KV:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def _from_pb(cls, kv: Any) -> KV:
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


Target = Literal["version", "create", "mod", "value"]
Op = Literal["==", "!=", ">", "<"]


@dataclass(frozen=True, slots=True)
class Compare:
    key: bytes
    target: Target
    op: Op
    operand: int | bytes

    def _pb(self) -> Any:
        result = {
            "==": rpc.Compare.EQUAL,
            "!=": rpc.Compare.NOT_EQUAL,
            ">": rpc.Compare.GREATER,
            "<": rpc.Compare.LESS,
        }[self.op]
        msg = rpc.Compare(key=self.key, result=result)
        if self.target == "version":
            msg.target, msg.version = rpc.Compare.VERSION, self.operand
        elif self.target == "create":
            msg.target, msg.create_revision = rpc.Compare.CREATE, self.operand
        elif self.target == "mod":
            msg.target, msg.mod_revision = rpc.Compare.MOD, self.operand
        else:
            msg.target, msg.value = rpc.Compare.VALUE, self.operand
        return msg


def absent(key: bytes) -> Compare:
    return Compare(key, "version", "==", 0)


def present(key: bytes) -> Compare:
    return Compare(key, "version", ">", 0)


def unchanged(kv: KV) -> Compare:
    """The key still holds exactly the revision ``kv`` was read at."""
    return Compare(kv.key, "mod", "==", kv.mod_revision)


def created_at(key: bytes, revision: int) -> Compare:
    return Compare(key, "create", "==", revision)


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes


@dataclass(frozen=True, slots=True)
class Get:
    """Read one key, or with ``prefix`` every key under it (``limit`` 0 = all)."""

    key: bytes
    prefix: bool = False
    limit: int = 0
    keys_only: bool = False


TxnOp = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class Guarded:
    """One caller's guarded transaction inside a group (etcd's nested ``request_txn``).

    Its compares decide between its own branches only: in a group, one
    caller's failed compare does not fail the others. etcd evaluates every
    compare of a request against the state before the request, so callers of
    one group must not read what another writes (``Committer`` sees to it).
    """

    compares: Sequence[Compare]
    success: Sequence[TxnOp]
    failure: Sequence[TxnOp] = ()

    def _pb(self) -> Any:
        return rpc.TxnRequest(
            compare=[c._pb() for c in self.compares],
            success=[_op_pb(op) for op in self.success],
            failure=[_op_pb(op) for op in self.failure],
        )


def _op_pb(op: TxnOp) -> Any:
    if isinstance(op, Put):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=op.key, value=op.value, lease=op.lease))
    if isinstance(op, Delete):
        return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=op.key))
    return rpc.RequestOp(request_range=rpc.RangeRequest(
        key=op.key,
        range_end=prefix_end(op.key) if op.prefix else b"",
        limit=op.limit,
        keys_only=op.keys_only,
    ))


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    #: one list per ``Get`` op of the branch that ran, in order
    gets: list[list[KV]]


def _gets(resp: Any) -> list[list[KV]]:
    return [
        [KV._from_pb(kv) for kv in r.response_range.kvs]
        for r in resp.responses
        if r.WhichOneof("response") == "response_range"
    ]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KV


class Etcd:
    """An asyncio connection to one etcd endpoint (``host:port``)."""

    def __init__(self, endpoint: str, timeout: float = 5.0) -> None:
        """``endpoint`` is ``host:port``, or several separated by commas (members of
        one cluster): calls are then spread over them, and a member that is down
        only fails the calls it was given (retried by callers)."""
        members = [e.strip() for e in endpoint.split(",") if e.strip()]
        if not members or any(":" not in m for m in members):
            raise ValueError(f"etcd endpoint must be host:port[,host:port...]: {endpoint!r}")
        if len(members) == 1:
            target, options = members[0], {}
        else:
            # A gRPC multi-address target, balanced per call.
            target = "ipv4:" + ",".join(members)
            options = {"grpc.lb_policy_name": "round_robin"}
        host, _, port = target.rpartition(":")
        self.endpoint = endpoint
        self._timeout = timeout
        self._client = aetcd.Client(host=host or "127.0.0.1", port=int(port), timeout=timeout,
                                    options=options)

    @_etcd_errors
    async def connect(self) -> None:
        await self._client.connect()
        self._kv = self._client.kvstub
        self._lease = self._client.leasestub
        self._watch = rpc.WatchStub(self._client.channel)
        self._maint = self._client.maintenancestub

    async def close(self) -> None:
        await self._client.close()

    @_etcd_errors
    async def status(self) -> str:
        """The etcd server version (also a cheap liveness probe)."""
        resp = await self._maint.Status(rpc.StatusRequest(), timeout=self._timeout)
        return str(resp.version)

    @_etcd_errors
    async def get(self, key: bytes) -> KV | None:
        resp = await self._kv.Range(rpc.RangeRequest(key=key), timeout=self._timeout)
        return KV._from_pb(resp.kvs[0]) if resp.kvs else None

    @_etcd_errors
    async def range(
        self,
        prefix: bytes,
        *,
        start: bytes | None = None,
        limit: int = 0,
        keys_only: bool = False,
        revision: int = 0,
    ) -> tuple[list[KV], int, bool]:
        """Keys under ``prefix`` from ``start`` (inclusive), sorted by key.

        ``revision`` reads an older snapshot (0 = now). Returns (kvs, revision
        of the read, whether more keys follow).
        """
        req = rpc.RangeRequest(
            key=start or prefix,
            range_end=prefix_end(prefix),
            limit=limit,
            keys_only=keys_only,
            revision=revision,
        )
        resp = await self._kv.Range(req, timeout=self._timeout)
        return [KV._from_pb(kv) for kv in resp.kvs], resp.header.revision, bool(resp.more)

    @_etcd_errors
    async def count(self, prefix: bytes) -> int:
        req = rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix), count_only=True)
        resp = await self._kv.Range(req, timeout=self._timeout)
        return int(resp.count)

    @_etcd_errors
    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
    ) -> TxnResult:
        req = rpc.TxnRequest(
            compare=[c._pb() for c in compares],
            success=[_op_pb(op) for op in success],
            failure=[_op_pb(op) for op in failure],
        )
        resp = await self._kv.Txn(req, timeout=self._timeout)
        return TxnResult(bool(resp.succeeded), int(resp.header.revision), _gets(resp))

    @_etcd_errors
    async def txn_group(self, group: Sequence[Guarded]) -> tuple[int, list[TxnResult]]:
        """Several callers' transactions in one request (one raft entry, one revision).

        Returns the revision and, per caller, whether its compares held and
        the reads of the branch that ran.
        """
        req = rpc.TxnRequest(success=[rpc.RequestOp(request_txn=g._pb()) for g in group])
        resp = await self._kv.Txn(req, timeout=self._timeout)
        rev = int(resp.header.revision)
        return rev, [TxnResult(bool(r.response_txn.succeeded), rev, _gets(r.response_txn))
                     for r in resp.responses]

    async def scan(
        self,
        prefix: bytes,
        *,
        page: int = 1000,
        keys_only: bool = False,
        revision: int = 0,
        start: bytes | None = None,
    ) -> AsyncGenerator[KV, None]:
        """Every key under ``prefix``, read ``page`` keys per request, all at one revision
        (the first page's, unless ``revision`` is given): no read exceeds gRPC's
        message limit however many keys there are."""
        while True:
            kvs, rev, more = await self.range(prefix, start=start, limit=page,
                                              keys_only=keys_only, revision=revision)
            revision = revision or rev
            for kv in kvs:
                yield kv
            if not more or not kvs:
                return
            start = kvs[-1].key + b"\0"

    async def read(self, gets: Sequence[Get]) -> list[list[KV]]:
        """Several reads in one round trip, all at the same revision."""
        return (await self.txn([], gets)).gets

    # leases -------------------------------------------------------------

    @_etcd_errors
    async def grant(self, ttl: int) -> tuple[int, int]:
        resp = await self._lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl), timeout=self._timeout)
        if resp.error:
            raise Internal(f"lease grant failed: {resp.error}")
        return int(resp.ID), int(resp.TTL)

    @_etcd_errors
    async def keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; the TTL it now has, or 0 if it is gone."""

        async def one() -> Any:
            yield rpc.LeaseKeepAliveRequest(ID=lease_id)

        call = self._lease.LeaseKeepAlive(one(), timeout=self._timeout)
        async for reply in call:
            return int(reply.TTL)
        return 0

    @_etcd_errors
    async def time_to_live(self, lease_id: int) -> int:
        """Seconds left on a lease; -1 if it does not exist."""
        resp = await self._lease.LeaseTimeToLive(
            rpc.LeaseTimeToLiveRequest(ID=lease_id), timeout=self._timeout
        )
        return int(resp.TTL)

    @_etcd_errors
    async def revoke(self, lease_id: int) -> None:
        try:
            await self._lease.LeaseRevoke(
                rpc.LeaseRevokeRequest(ID=lease_id), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as e:
            if "lease not found" not in (e.details() or ""):
                raise

    # watches ------------------------------------------------------------

    async def watch(self, prefix: bytes, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Batches of events under ``prefix`` from ``start_revision`` (inclusive).

        Raises ``Compacted`` if that revision is gone, ``Unavailable`` if the
        stream breaks; the caller re-lists and watches again.
        """
        stop = asyncio.Event()

        async def requests() -> Any:
            yield rpc.WatchRequest(
                create_request=rpc.WatchCreateRequest(
                    key=prefix, range_end=prefix_end(prefix), start_revision=start_revision
                )
            )
            await stop.wait()

        call = self._watch.Watch(requests())
        try:
            async for resp in call:
                if resp.compact_revision:
                    raise Compacted(
                        f"revision {start_revision} compacted (now {resp.compact_revision})"
                    )
                if resp.canceled:
                    raise Unavailable(f"etcd cancelled the watch: {resp.cancel_reason}")
                if resp.events:
                    yield [
                        WatchEvent("delete" if ev.type == 1 else "put", KV._from_pb(ev.kv))
                        for ev in resp.events
                    ]
        except grpc.aio.AioRpcError as e:
            raise _translate(e) from e
        finally:
            stop.set()
            call.cancel()
