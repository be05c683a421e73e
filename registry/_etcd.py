"""The only module that talks to etcd (through aetcd's channel and v3 stubs).

It exposes a small typed surface (``KV``, compares, ops, ``Etcd``) and turns
every client error into a Baton error here, keeping the cause, so nothing else
in the registry needs to know which etcd client library is underneath.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar

import aetcd
import grpc
from aetcd import rpc

from client.errors import Internal, SessionExpired, Unavailable

from .keys import prefix_end

log = logging.getLogger("baton.registry")

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
    #: compare every key in [key, range_end) (etcd ≥ 3.3); b"": the key alone
    range_end: bytes = b""

    def _pb(self) -> Any:
        target, field = _TARGETS[self.target]
        return rpc.Compare(key=self.key, result=_RESULTS[self.op], range_end=self.range_end,
                           target=target, **{field: self.operand})


_RESULTS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, ">": rpc.Compare.GREATER,
            "<": rpc.Compare.LESS}
_TARGETS = {"version": (rpc.Compare.VERSION, "version"),
            "create": (rpc.Compare.CREATE, "create_revision"),
            "mod": (rpc.Compare.MOD, "mod_revision"),
            "value": (rpc.Compare.VALUE, "value")}


def absent(key: bytes) -> Compare:
    return Compare(key, "version", "==", 0)


def empty(prefix: bytes) -> Compare:
    """No key exists under ``prefix`` (every key in the range has version 0)."""
    return Compare(prefix, "version", "==", 0, range_end=prefix_end(prefix))


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

#: point reads per request (etcd's default limit is 128 operations per transaction)
READ_CHUNK = 100


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


def parse_endpoints(endpoint: str) -> list[tuple[str, int]]:
    """The members of ``host:port[,host:port...]`` as (host, port); an IPv6 host is
    written in brackets and returned without them. ``ValueError`` says what is wrong."""
    usage = "etcd endpoint must be host:port[,host:port...] (IPv6 as [addr]:port)"
    members = []
    for raw in endpoint.split(","):
        member = raw.strip()
        if not member:
            continue
        if member.startswith("http://"):
            member = member[len("http://"):].rstrip("/")
        elif "://" in member:
            raise ValueError(f"{usage}: {member!r} (only plain http is supported)")
        if member.startswith("["):
            host, close, rest = member[1:].partition("]")
            if not close or not rest.startswith(":"):
                raise ValueError(f"{usage}: {member!r}")
            port = rest[1:]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"{usage}: {host!r} is not an IPv6 address") from None
        else:
            host, _, port = member.rpartition(":")
            if ":" in host:
                raise ValueError(f"{usage}: write an IPv6 address in brackets, "
                                 f"[{host}]:{port}")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{usage}: {member!r}")
        members.append((host, int(port)))
    if not members:
        raise ValueError(f"{usage}: {endpoint!r}")
    return members


def _target(addresses: list[tuple[str, int]]) -> str:
    """A gRPC target: one ``host:port`` as is (a name goes to gRPC's resolver), or
    several IP addresses as one ``ipv4:`` list, else one ``ipv6:`` list (IPv4
    addresses mapped into IPv6 when the families are mixed)."""

    def family(host: str) -> int:
        try:
            return ipaddress.ip_address(host).version
        except ValueError:
            return 0  # a name

    def v6(host: str) -> str:
        return f"::ffff:{host}" if family(host) == 4 else host

    if len(addresses) == 1:
        host, port = addresses[0]
        return f"[{host}]:{port}" if family(host) == 6 else f"{host}:{port}"
    if all(family(h) == 4 for h, _ in addresses):
        return "ipv4:" + ",".join(f"{h}:{p}" for h, p in addresses)
    return "ipv6:" + ",".join(f"[{v6(h)}]:{p}" for h, p in addresses)


class Etcd:
    """An asyncio connection to one etcd endpoint (``host:port``)."""

    def __init__(self, endpoint: str, timeout: float = 5.0) -> None:
        """``endpoint`` is ``host:port``, or several separated by commas (members of
        one cluster): calls are then spread over them, and a member that is down
        only fails the calls it was given (retried by callers).

        A host is a DNS name, an IPv4 address or an IPv6 address in brackets
        (``[::1]:2379``); ``http://`` in front of a member is accepted and dropped.
        One member is handed to gRPC as it is (its resolver looks the name up, and
        again on reconnecting); several are looked up when connecting, every
        address of every name, and balanced over as one list of addresses.
        """
        self.members = parse_endpoints(endpoint)
        self.endpoint = endpoint
        self._timeout = timeout
        self._client = self._new_client(
            _target(self.members) if len(self.members) == 1 else "")

    def _new_client(self, target: str) -> aetcd.Client:
        if not target:  # several members: the real client is made by ``connect``
            return aetcd.Client(timeout=self._timeout)
        options = {"grpc.lb_policy_name": "round_robin"} if target.startswith(
            ("ipv4:", "ipv6:")) else {}
        # aetcd dials f"{host}:{port}": every target here ends in ":port".
        host, _, port = target.rpartition(":")
        return aetcd.Client(host=host, port=int(port), timeout=self._timeout, options=options)

    async def _resolve(self) -> str:
        """A gRPC target listing every address of every member (``ipv4:`` or ``ipv6:``)."""
        loop = asyncio.get_running_loop()
        addresses: list[tuple[str, int]] = []
        failures = []
        for host, port in self.members:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                failures.append(f"{host}: {e}")
                continue
            for family, _, _, _, sockaddr in infos:
                if family in (socket.AF_INET, socket.AF_INET6):
                    addresses.append((str(sockaddr[0]), port))
        if not addresses:
            raise Unavailable(f"cannot resolve any etcd endpoint of {self.endpoint!r}: "
                              + "; ".join(failures))
        if failures:
            log.warning("etcd endpoints not resolved (left out): %s", "; ".join(failures))
        return _target(list(dict.fromkeys(addresses)))

    @_etcd_errors
    async def connect(self) -> None:
        if len(self.members) > 1:
            self._client = self._new_client(await self._resolve())
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

    async def get_chunks(
        self, keys: Sequence[bytes]
    ) -> AsyncGenerator[tuple[int, list[tuple[bytes, KV | None]]], None]:
        """Many keys' values, ``READ_CHUNK`` per request (etcd refuses a transaction of
        more than 128 operations): per request, its revision and each (key, value or
        None)."""
        for i in range(0, len(keys), READ_CHUNK):
            chunk = keys[i:i + READ_CHUNK]
            result = await self.txn([], [Get(k) for k in chunk])
            yield result.revision, [(k, kvs[0] if kvs else None)
                                    for k, kvs in zip(chunk, result.gets, strict=True)]

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

    async def watch(
        self,
        prefix: bytes | Sequence[bytes],
        start_revision: int,
        keep: Callable[[bytes], bool] | None = None,
    ) -> AsyncIterator[list[WatchEvent]]:
        """Batches of events under ``prefix`` (or under each of several prefixes, on
        one stream) from ``start_revision`` (inclusive); with ``keep``, only events
        whose key it accepts (tested before anything else is built).

        Events of one prefix come in revision order; events of different prefixes
        are not ordered with each other. Raises ``Compacted`` if that revision is
        gone, ``Unavailable`` if the stream breaks; the caller re-lists and watches
        again.
        """
        prefixes = [prefix] if isinstance(prefix, bytes) else list(prefix)
        stop = asyncio.Event()

        async def requests() -> Any:
            for p in prefixes:
                yield rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                    key=p, range_end=prefix_end(p), start_revision=start_revision))
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
                    batch = [
                        WatchEvent("delete" if ev.type == 1 else "put", KV._from_pb(ev.kv))
                        for ev in resp.events if keep is None or keep(ev.kv.key)
                    ]
                    if batch:
                        yield batch
        except grpc.aio.AioRpcError as e:
            raise _translate(e) from e
        finally:
            stop.set()
            call.cancel()
