"""The only module that talks to etcd (through the generated v3 stubs of ``aetcd.rpc``).

It exposes a small typed surface (``KV``, compares, ops, ``Etcd``) and turns
every client error into a Baton error here, keeping the cause, so nothing else
in the registry needs to know how etcd is reached. The gRPC channels are built
here too, plaintext or TLS, and the etcd auth token rides on every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import math
import socket
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import grpc
from aetcd import rpc

from ...kernel.errors import (
    BatonError,
    Compacted,
    Internal,
    InvalidArgument,
    SessionExpired,
    StorageFull,
    Unavailable,
)
from .keys import prefix_end

log = logging.getLogger("baton.registry")

P = ParamSpec("P")
R = TypeVar("R")

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}

#: what etcd answers when the token sent is no longer good (a simple token expires
#: after ``--auth-token-ttl`` s unused, 300 by default; any token once users or roles
#: change): authenticate again and retry, as etcd's own client does
_STALE_TOKEN = (
    "etcdserver: invalid auth token",
    "etcdserver: user name is empty",
    "etcdserver: revision of auth store is old",
)

#: words of an etcd or gRPC error (any of them), whether they mean this over TLS (True),
#: in plaintext (False) or either way (None), and what to tell the operator; the first
#: match wins (gRPC's words differ with the TLS version and the etcd release)
_HINTS: tuple[tuple[tuple[str, ...], bool | None, str], ...] = (
    (("Connection refused",), None, "is etcd running there?"),
    (("Hostname Verification",), True,
     "etcd's certificate does not name the host as written in --etcd: its subject "
     "alternative names must include every endpoint's DNS name or IP address"),
    (("CERTIFICATE_VERIFY_FAILED",), True, "etcd's certificate does not chain to --etcd-ca"),
    (("TSI_DATA_CORRUPTED", "ALERT_BAD_CERTIFICATE", "CERTIFICATE_REQUIRED"), True,
     "etcd refused the client certificate: give --etcd-cert/--etcd-key, signed by a CA "
     "etcd trusts (its --trusted-ca-file)"),
    (("Handshake read failed", "WRONG_VERSION_NUMBER"), True,
     "etcd does not serve TLS there: drop --etcd-ca, or use its TLS port"),
    (("Socket closed",), False,
     "etcd closed the connection: if it serves TLS only, give --etcd-ca (and --etcd-cert/"
     "--etcd-key when it checks client certificates)"),
    (("user name is empty",), None,
     "etcd has authentication enabled: give --etcd-user and --etcd-password-file, or a "
     "client certificate whose common name is an etcd user"),
    (("authentication failed",), None, "check --etcd-user and --etcd-password-file"),
    (("permission denied",), None,
     "the etcd user needs a role with readwrite on the registry's prefix; see "
     "docs/operations.md, etcd over TLS"),
)


def _hinted(details: str, tls: bool | None = None) -> str:
    """``details`` with the hint of :data:`_HINTS` that fits, if any."""
    hint = next((h for words, when, h in _HINTS
                 if when in (None, tls) and any(w in details for w in words)), "")
    return f"{details} ({hint})" if hint else details


def _translate(exc: BaseException) -> BatonError:
    if isinstance(exc, grpc.aio.AioRpcError):
        details = exc.details() or ""
        if "lease not found" in details:
            return SessionExpired(f"etcd lease not found ({details})")
        if "database space exceeded" in details:
            return StorageFull(f"etcd refuses writes: its database is full ({details}); "
                               "free space (archive or remove finished tasks, compact, "
                               "defragment), then `etcdctl alarm disarm`")
        if exc.code() in _RETRYABLE:
            return Unavailable(f"etcd unavailable: {_hinted(details) or exc.code().name}")
        return Internal(f"etcd error {exc.code().name}: {_hinted(details)}")
    return Internal(f"etcd error: {exc!r}")


#: the kinds of request the registry makes, as ``Etcd.observe`` names them
Kind = Literal["range", "txn", "lease", "watch", "status"]


def _ignore(kind: Kind, seconds: float, ok: bool) -> None:
    pass


def _request(kind: Kind) -> Callable[[Callable[Concatenate[Etcd, P], Awaitable[R]]],
                                     Callable[Concatenate[Etcd, P], Awaitable[R]]]:
    """A request of ``kind``: its errors translated, its time told to ``Etcd.observe``."""

    def decorate(fn: Callable[Concatenate[Etcd, P], Awaitable[R]],
                 ) -> Callable[Concatenate[Etcd, P], Awaitable[R]]:
        @functools.wraps(fn)
        async def wrapper(self: Etcd, /, *args: P.args, **kwargs: P.kwargs) -> R:
            start, ok = time.perf_counter(), False
            try:
                result = await fn(self, *args, **kwargs)
                ok = True
                return result
            except grpc.aio.AioRpcError as e:
                error = _translate(e)
                if isinstance(error, StorageFull):
                    self.full_at = time.monotonic()
                raise error from e
            finally:
                self.observe(kind, time.perf_counter() - start, ok)

        return wrapper

    return decorate


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

    def _fill(self, into: Any) -> None:
        """Build the transaction in place, in ``into`` (a TxnRequest)."""
        _add_compares(into.compare, self.compares)
        _add_ops(into.success, self.success)
        _add_ops(into.failure, self.failure)


def _txn_pb(compares: Sequence[Compare], success: Sequence[TxnOp],
            failure: Sequence[TxnOp]) -> Any:
    req = rpc.TxnRequest()
    _add_compares(req.compare, compares)
    _add_ops(req.success, success)
    _add_ops(req.failure, failure)
    return req


# The hot path builds each request's messages in place (``add()`` and field
# assignment): four times cheaper than constructing each message and copying it
# into its parent, with the same bytes on the wire (tests/unit/test_etcd_wire.py).

def _add_compares(field: Any, compares: Sequence[Compare]) -> None:
    for c in compares:
        m = field.add()
        target, name = _TARGETS[c.target]
        m.key, m.result, m.target = c.key, _RESULTS[c.op], target
        if c.range_end:
            m.range_end = c.range_end
        setattr(m, name, c.operand)


def _add_ops(field: Any, ops: Sequence[TxnOp]) -> None:
    for op in ops:
        kind = type(op)
        if kind is Put:
            p = field.add().request_put
            p.key, p.value = op.key, op.value  # type: ignore[union-attr]
            if op.lease:  # type: ignore[union-attr]
                p.lease = op.lease  # type: ignore[union-attr]
        elif kind is Delete:
            field.add().request_delete_range.key = op.key
        else:
            r = field.add().request_range
            r.key = op.key
            if op.prefix:  # type: ignore[union-attr]
                r.range_end = prefix_end(op.key)
            if op.limit:  # type: ignore[union-attr]
                r.limit = op.limit  # type: ignore[union-attr]
            if op.keys_only:  # type: ignore[union-attr]
                r.keys_only = True


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


@dataclass(frozen=True, slots=True)
class Watched:
    """A prefix a watch follows, and which of its events etcd sends (``puts``, ``deletes``):
    etcd filters the others out before they are sent. ``progress``: whether it asks for
    progress notifications (when the stream does; one prefix of a stream asking is
    enough to hear that the stream lives, each costs a message per interval)."""

    prefix: bytes
    puts: bool = True
    deletes: bool = True
    progress: bool = True

    def create_request(self, start_revision: int, notify: bool) -> Any:
        notify = notify and self.progress
        filters = ([rpc.WatchCreateRequest.NOPUT] if not self.puts else []) + (
            [rpc.WatchCreateRequest.NODELETE] if not self.deletes else [])
        return rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=self.prefix, range_end=prefix_end(self.prefix), start_revision=start_revision,
            progress_notify=notify, filters=filters))


def parse_endpoints(endpoint: str, *, tls: bool = False) -> list[tuple[str, int]]:
    """The members of ``host:port[,host:port...]`` as (host, port); an IPv6 host is
    written in brackets and returned without them. A member may start with
    ``http://``, or with ``https://`` when ``tls``. ``ValueError`` says what is wrong."""
    usage = "etcd endpoint must be host:port[,host:port...] (IPv6 as [addr]:port)"
    scheme, other = ("https://", "http://") if tls else ("http://", "https://")
    members = []
    for raw in endpoint.split(","):
        member = raw.strip()
        if not member:
            continue
        if member.startswith(scheme):
            member = member[len(scheme):].rstrip("/")
        elif member.startswith(other) and tls:
            raise ValueError(f"{usage}: {member!r} says http:// but --etcd-ca turns TLS on")
        elif member.startswith(other):
            raise ValueError(f"{usage}: {member!r} (https:// needs --etcd-ca; only plain "
                             "http is supported without it)")
        elif "://" in member:
            raise ValueError(f"{usage}: {member!r} (only http://, or https:// with --etcd-ca)")
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


@dataclass(frozen=True)
class EtcdAuth:
    """How the registry proves itself to etcd (its ``--etcd-*`` settings).

    ``ca`` turns TLS on: etcd's certificate must chain to it and name the host of
    every member as written in ``--etcd`` (a DNS name or an IP address among its
    subject alternative names). ``cert``/``key`` are sent when etcd checks client
    certificates (``--client-cert-auth``). ``user``/``password`` log in to etcd's
    own authentication; the caller reads the password from its file. A setting
    given without the one it needs raises ``InvalidArgument`` naming both.
    """

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        pairs = (
            (self.cert, self.key, "--etcd-cert", "--etcd-key",
             "the private key of that certificate"),
            (self.key, self.cert, "--etcd-key", "--etcd-cert", "the certificate it belongs to"),
            (self.cert, self.ca, "--etcd-cert", "--etcd-ca",
             "a client certificate is only sent over TLS, and TLS needs the CA that signed "
             "etcd's certificate"),
            (self.user, self.password, "--etcd-user", "--etcd-password-file",
             "a file holding the user's password"),
            (self.password, self.user, "--etcd-password-file", "--etcd-user",
             "the etcd user it is the password of"),
        )
        for given, needed, setting, other, why in pairs:
            if given and not needed:
                raise InvalidArgument(f"{setting} is given without {other} ({why})",
                                      setting=setting)

    def _credentials(self) -> grpc.ChannelCredentials | None:
        """The TLS credentials read from the files (None: plaintext); files that cannot
        be read or do not fit together raise ``InvalidArgument`` naming the setting."""
        if not self.ca:
            return None
        ca = _read_pem(self.ca, "--etcd-ca")
        checker = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            checker.load_verify_locations(cadata=ca.decode("ascii", errors="replace"))
        except ssl.SSLError as e:
            raise InvalidArgument(f"--etcd-ca {self.ca}: not a CA certificate bundle ({e})",
                                  setting="--etcd-ca", path=self.ca) from e
        if not self.cert:
            return grpc.ssl_channel_credentials(root_certificates=ca)
        cert, key = _read_pem(self.cert, "--etcd-cert"), _read_pem(self.key, "--etcd-key")
        try:
            # A password argument keeps OpenSSL from prompting for an encrypted key.
            checker.load_cert_chain(self.cert, self.key, password=lambda: b"")
        except ssl.SSLError as e:
            raise InvalidArgument(
                f"--etcd-cert {self.cert} and --etcd-key {self.key} do not make a usable "
                f"pair ({e}; the key must match the certificate and not be encrypted)",
                setting="--etcd-key", path=self.key) from e
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)


def _read_pem(path: str, setting: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(f"{setting} {path}: cannot read it ({e.strerror or e})",
                              setting=setting, path=path) from e
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"{setting} {path}: not a PEM file (no '-----BEGIN' line)",
                              setting=setting, path=path)
    return data


Metadata = tuple[tuple[str, str], ...]

#: while calls are open (the registry always has a watch), ping each member every 10 s
#: (etcd refuses pings more often than its ``--grpc-keepalive-min-time``, 5 s) and drop
#: the connection when a ping goes unanswered for 5 s: a member that went silent (a
#: partition drops packets, nothing resets the connection) ends its watches and
#: leaves the calls' rotation within about 15 s, not when TCP gives up
KEEPALIVE: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
]

#: sent with every call: a member that knows no leader (cut off from the others, or
#: mid-election) refuses the call at once ("etcdserver: no leader", retried elsewhere)
#: instead of holding it until the deadline, and ends a watch it can no longer keep
#: current, so that the stream is opened again on a member that can
REQUIRE_LEADER: Metadata = (("hasleader", "true"),)


@dataclass(frozen=True, slots=True)
class _Channel:
    """One gRPC channel to etcd and the v3 services on it."""

    target: str
    channel: grpc.aio.Channel
    kv: Any
    lease: Any
    watch: Any
    maint: Any
    auth: Any
    cluster: Any

    @classmethod
    def open(cls, target: str, credentials: grpc.ChannelCredentials | None) -> _Channel:
        options: list[tuple[str, Any]] = [
            ("grpc.lb_policy_name", "round_robin")] if target.startswith(
            ("ipv4:", "ipv6:")) else []
        options += KEEPALIVE
        channel = (grpc.aio.insecure_channel(target, options=options) if credentials is None
                   else grpc.aio.secure_channel(target, credentials, options=options))
        return cls(target, channel, rpc.KVStub(channel), rpc.LeaseStub(channel),
                   rpc.WatchStub(channel), rpc.MaintenanceStub(channel), rpc.AuthStub(channel),
                   rpc.ClusterStub(channel))


@dataclass(frozen=True, slots=True)
class Member:
    """One member of the etcd cluster as :meth:`Etcd.member_statuses` found it."""

    id: int
    #: its ``--name`` ("" for a member added but not started yet)
    name: str
    client_urls: tuple[str, ...]
    #: the etcd release it runs ("" when it could not be asked: see ``problem``)
    version: str
    #: why its version is unknown ("" when known)
    problem: str = ""
    is_learner: bool = False

    @property
    def label(self) -> str:
        """How logs, errors and metrics name it: its name, else its id in hex."""
        return self.name or f"{self.id:x}"


class Etcd:
    """An asyncio connection to one etcd cluster (``host:port``, or several members)."""

    def __init__(self, endpoint: str, timeout: float = 5.0, *,
                 auth: EtcdAuth = EtcdAuth()) -> None:
        """``endpoint`` is ``host:port``, or several separated by commas (members of
        one cluster): calls are then spread over them, and a member that is down
        only fails the calls it was given (retried by callers).

        A host is a DNS name, an IPv4 address or an IPv6 address in brackets
        (``[::1]:2379``); ``http://`` in front of a member is accepted and dropped
        (``https://`` with TLS). One member is handed to gRPC as it is (its
        resolver looks the name up, and again on reconnecting). Several are, in
        plaintext, looked up when connecting, every address of every name, and
        balanced over as one list of addresses; over TLS each member gets a
        channel of its own, so that its certificate is checked against its own
        name, and calls go in turn to the members whose channel is ready.

        ``auth`` turns on TLS and etcd authentication (see :class:`EtcdAuth`).
        """
        self.members = parse_endpoints(endpoint, tls=bool(auth.ca))
        self.endpoint = endpoint
        self.auth = auth
        self._timeout = timeout
        self._channels: list[_Channel] = []
        self._turn = 0
        #: the metadata of every call: the leader requirement and, once logged in as
        #: ``auth.user``, the ``token``
        self._metadata: Metadata = REQUIRE_LEADER
        self._renewing = asyncio.Lock()
        #: when etcd last refused a request for want of space (``time.monotonic()``;
        #: -inf: never), so that writes go alone for a while (``txn.Committer``)
        self.full_at = -math.inf
        #: told the kind, duration and success of every request (the registry's metrics)
        self.observe: Callable[[Kind, float, bool], None] = _ignore
        #: the highest revision a write of this client produced that changed a key
        #: ``tracks`` accepts (0: none yet): a watch that has reached it has seen every
        #: such write of this replica (``View.current``)
        self.wrote = 0
        #: which written keys count for ``wrote`` (None: none). Only keys a watch
        #: follows may count: a revision no watched key changed at would never be
        #: reached by that watch's events.
        self.tracks: Callable[[bytes], bool] | None = None

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

    async def connect(self) -> None:
        """Open the channel(s), check that etcd answers (over TLS: that each side
        accepts the other's certificate) within the timeout, and log in as
        ``auth.user`` if one is given. Raises ``Unavailable`` saying why etcd could
        not be reached, ``InvalidArgument`` for files that cannot be used and for
        credentials etcd refused."""
        credentials = self.auth._credentials()
        if credentials is not None and len(self.members) > 1:
            targets = [_target([member]) for member in self.members]
        elif len(self.members) > 1:
            targets = [await self._resolve()]
        else:
            targets = [_target(self.members)]
        await self.close()
        self._channels = [_Channel.open(t, credentials) for t in targets]
        try:
            await self._probe()
            if self.auth.user:
                await self._login()
        except BaseException:
            await self.close()
            raise

    async def _probe(self) -> None:
        """One Status call per channel, all at once; the members that do not answer
        are logged and left to gRPC's reconnection, unless none answers. Any answer
        counts, a refusal too: this checks the way to etcd, not the rights."""
        calls = [c.maint.Status(rpc.StatusRequest(), timeout=self._timeout)
                 for c in self._channels]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = []
        for channel, result in zip(self._channels, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                if result.code() in _RETRYABLE:
                    failed.append((channel, result))
            elif isinstance(result, BaseException):
                raise result
        if len(failed) == len(self._channels):
            raise self._unreachable(failed[0][1]) from failed[0][1]
        for channel, e in failed:
            log.warning("etcd member %s does not answer (calls go to the others until it "
                        "does): %s", channel.target,
                        _hinted(e.details() or e.code().name, bool(self.auth.ca)))

    def _unreachable(self, e: grpc.aio.AioRpcError) -> BatonError:
        details = e.details() or e.code().name
        if not self.auth.ca:
            return Unavailable(f"cannot reach etcd at {self.endpoint}: "
                               f"{_hinted(details, tls=False)}", endpoint=self.endpoint)
        hinted = _hinted(details, tls=True)
        if hinted == details:
            hinted += " (check --etcd-ca/--etcd-cert/--etcd-key)"
        return Unavailable(f"cannot reach etcd at {self.endpoint} over TLS: {hinted}",
                           endpoint=self.endpoint)

    async def _login(self) -> None:
        try:
            self._metadata = await self._authenticate()
        except grpc.aio.AioRpcError as e:
            details = e.details() or e.code().name
            if "authentication failed" in details:
                raise InvalidArgument(
                    f"etcd at {self.endpoint} refused user {self.auth.user!r}: {details} "
                    "(check --etcd-user and --etcd-password-file)",
                    setting="--etcd-user") from e
            if "authentication is not enabled" in details:
                raise InvalidArgument(
                    f"--etcd-user is given but etcd at {self.endpoint} has authentication "
                    "disabled: enable it (etcdctl auth enable) or drop --etcd-user and "
                    "--etcd-password-file", setting="--etcd-user") from e
            raise _translate(e) from e

    async def _authenticate(self) -> Metadata:
        request = rpc.AuthenticateRequest(name=self.auth.user, password=self.auth.password)
        resp = await self._pick().auth.Authenticate(request, timeout=self._timeout)
        return (*REQUIRE_LEADER, ("token", str(resp.token)))

    async def _renew(self, stale: Metadata) -> None:
        """Log in again, unless another call already did since ``stale`` was sent."""
        async with self._renewing:
            if self._metadata is stale:
                log.info("etcd refused the auth token of %r; logging in again", self.auth.user)
                self._metadata = await self._authenticate()

    async def _with_token(self, call: Callable[[Metadata], Awaitable[R]]) -> R:
        """``call`` with the current token; when etcd refuses the token, log in again
        and make the call once more (every call but the watch, which retries on its
        own, goes through here)."""
        sent = self._metadata
        try:
            return await call(sent)
        except grpc.aio.AioRpcError as e:
            if not self.auth.user or not any(m in (e.details() or "")
                                             for m in _STALE_TOKEN):
                raise
        await self._renew(sent)
        return await call(self._metadata)

    def _unary(self, method: Callable[..., Any], request: Any) -> Awaitable[Any]:
        """A unary call to ``method`` of a stub from :meth:`_pick`, with the timeout and token."""
        return self._with_token(
            lambda metadata: method(request, timeout=self._timeout, metadata=metadata))

    def _pick(self) -> _Channel:
        """The channel of the next call: the only one, or the next ready member in turn
        (none ready: the next one anyway, which fails fast and is retried by callers)."""
        channels = self._channels
        if len(channels) == 1:
            return channels[0]
        if not channels:
            raise Unavailable(f"not connected to etcd at {self.endpoint} (call connect())")
        for _ in channels:
            self._turn = (self._turn + 1) % len(channels)
            channel = channels[self._turn]
            if channel.channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
                return channel
        self._turn = (self._turn + 1) % len(channels)
        return channels[self._turn]

    async def close(self) -> None:
        channels, self._channels = self._channels, []
        for channel in channels:
            await channel.channel.close(None)

    @_request("status")
    async def status(self) -> str:
        """The etcd server version (also a cheap liveness probe)."""
        resp = await self._unary(self._pick().maint.Status, rpc.StatusRequest())
        return str(resp.version)

    @_request("status")
    async def member_statuses(self) -> list[Member]:
        """Every member of the cluster (etcd's member list) with the release it runs,
        read from its own Status: first through the channels the registry already has,
        then, for members those did not reach, on a short-lived channel to the member's
        first client URL (with the registry's credentials). A member that cannot be
        asked is returned with ``version`` "" and the reason in ``problem``."""
        listed = await self._unary(self._pick().cluster.MemberList, rpc.MemberListRequest())
        versions: dict[int, str] = {}
        answers = await asyncio.gather(*(self._status_of(c) for c in self._channels),
                                       return_exceptions=True)
        for answer in answers:
            if not isinstance(answer, BaseException):
                versions[int(answer.header.member_id)] = str(answer.version)
        missing = [m for m in listed.members if int(m.ID) not in versions]
        asked = await asyncio.gather(*(self._member_version(tuple(m.clientURLs))
                                       for m in missing))
        problems: dict[int, str] = {}
        for m, (version, problem) in zip(missing, asked, strict=True):
            versions[int(m.ID)] = version
            problems[int(m.ID)] = problem
        return [Member(int(m.ID), str(m.name), tuple(m.clientURLs), versions[int(m.ID)],
                       problems.get(int(m.ID), ""), bool(m.isLearner))
                for m in listed.members]

    def _status_of(self, channel: _Channel) -> Awaitable[Any]:
        """Status of the member(s) behind ``channel``, with the timeout and token."""
        return self._with_token(lambda metadata: channel.maint.Status(
            rpc.StatusRequest(), timeout=self._timeout, metadata=metadata))

    async def _member_version(self, urls: tuple[str, ...]) -> tuple[str, str]:
        """(version, "") of the member serving at its first client URL, or ("", why not)."""
        if not urls:
            return "", "it advertises no client URL (added but not started yet?)"
        try:
            (member,) = parse_endpoints(urls[0], tls=bool(self.auth.ca))
        except ValueError as e:
            return "", f"its client URL {urls[0]} cannot be dialled here ({e})"
        channel = _Channel.open(_target([member]), self.auth._credentials())
        try:
            answer = await self._status_of(channel)
        except grpc.aio.AioRpcError as e:
            return "", (f"{urls[0]} does not answer: "
                        f"{_hinted(e.details() or e.code().name, bool(self.auth.ca))}")
        finally:
            await channel.channel.close(None)
        return str(answer.version), ""

    @_request("range")
    async def get(self, key: bytes) -> KV | None:
        resp = await self._unary(self._pick().kv.Range, rpc.RangeRequest(key=key))
        return KV._from_pb(resp.kvs[0]) if resp.kvs else None

    @_request("range")
    async def range(
        self,
        prefix: bytes,
        *,
        start: bytes | None = None,
        limit: int = 0,
        keys_only: bool = False,
        revision: int = 0,
        end: bytes = b"",
        min_mod_revision: int = 0,
    ) -> tuple[list[KV], int, bool]:
        """Keys under ``prefix`` from ``start`` (inclusive), sorted by key; with ``end``,
        only those before it (etcd then walks no further: it visits every key of a range
        to count it, whatever the ``limit``).

        ``revision`` reads an older snapshot (0 = now); ``min_mod_revision`` keeps
        only keys last written at or after it (etcd still walks the whole range).
        Returns (kvs, revision of the read, whether more keys follow).
        """
        req = rpc.RangeRequest(
            key=start or prefix,
            range_end=end or prefix_end(prefix),
            limit=limit,
            keys_only=keys_only,
            revision=revision,
            min_mod_revision=min_mod_revision,
        )
        resp = await self._unary(self._pick().kv.Range, req)
        return [KV._from_pb(kv) for kv in resp.kvs], resp.header.revision, bool(resp.more)

    @_request("range")
    async def count(self, prefix: bytes) -> int:
        req = rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix), count_only=True)
        resp = await self._unary(self._pick().kv.Range, req)
        return int(resp.count)

    @_request("txn")
    async def counts(self, prefixes: Sequence[bytes]) -> list[int]:
        """How many keys are under each prefix: count-only ranges in one request, at
        one revision (no key or value is sent back; etcd still walks each range)."""
        req = rpc.TxnRequest(success=[
            rpc.RequestOp(request_range=rpc.RangeRequest(
                key=p, range_end=prefix_end(p), count_only=True))
            for p in prefixes])
        resp = await self._unary(self._pick().kv.Txn, req)
        return [int(r.response_range.count) for r in resp.responses]

    @_request("txn")
    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
    ) -> TxnResult:
        req = _txn_pb(compares, success, failure)
        resp = await self._unary(self._pick().kv.Txn, req)
        self._note(success if resp.succeeded else failure, int(resp.header.revision))
        return TxnResult(bool(resp.succeeded), int(resp.header.revision), _gets(resp))

    @_request("txn")
    async def txn_group(self, group: Sequence[Guarded]) -> tuple[int, list[TxnResult]]:
        """Several callers' transactions in one request (one raft entry, one revision).

        Returns the revision and, per caller, whether its compares held and
        the reads of the branch that ran.
        """
        req = rpc.TxnRequest()
        for g in group:
            g._fill(req.success.add().request_txn)
        resp = await self._unary(self._pick().kv.Txn, req)
        rev = int(resp.header.revision)
        for g, r in zip(group, resp.responses, strict=False):
            self._note(g.success if r.response_txn.succeeded else g.failure, rev)
        return rev, [TxnResult(bool(r.response_txn.succeeded), rev, _gets(r.response_txn))
                     for r in resp.responses]

    def _note(self, ops: Sequence[TxnOp], revision: int) -> None:
        """Record ``revision`` in ``wrote`` if the branch that ran changed a tracked key."""
        tracks = self.tracks
        if tracks is not None and revision > self.wrote and any(
                not isinstance(op, Get) and tracks(op.key) for op in ops):
            self.wrote = revision

    async def scan(
        self,
        prefix: bytes,
        *,
        page: int = 1000,
        keys_only: bool = False,
        revision: int = 0,
        start: bytes | None = None,
        end: bytes = b"",
    ) -> AsyncGenerator[KV, None]:
        """Every key under ``prefix`` (before ``end``, if given), read ``page`` keys per
        request, all at one revision (the first page's, unless ``revision`` is given): no
        read exceeds gRPC's message limit however many keys there are."""
        while True:
            kvs, rev, more = await self.range(prefix, start=start, limit=page,
                                              keys_only=keys_only, revision=revision, end=end)
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

    @_request("lease")
    async def grant(self, ttl: int) -> tuple[int, int]:
        resp = await self._unary(self._pick().lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))
        if resp.error:
            raise Internal(f"lease grant failed: {resp.error}")
        return int(resp.ID), int(resp.TTL)

    @_request("lease")
    async def keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; the TTL it now has, or 0 if it is gone."""

        async def once(metadata: Metadata) -> int:
            async def one() -> Any:
                yield rpc.LeaseKeepAliveRequest(ID=lease_id)

            call = self._pick().lease.LeaseKeepAlive(one(), timeout=self._timeout,
                                                     metadata=metadata)
            async for reply in call:
                return int(reply.TTL)
            return 0

        return await self._with_token(once)

    @_request("lease")
    async def time_to_live(self, lease_id: int) -> int:
        """Seconds left on a lease; -1 if it does not exist."""
        resp = await self._unary(self._pick().lease.LeaseTimeToLive,
                                 rpc.LeaseTimeToLiveRequest(ID=lease_id))
        return int(resp.TTL)

    @_request("lease")
    async def lease_times(self, lease_id: int) -> tuple[int, int]:
        """Seconds left on a lease, as etcd counts them (whole seconds, rounded down:
        the lease has at least that long), and the TTL it was granted, which each
        refresh gives it again; (-1, 0) if it does not exist."""
        resp = await self._unary(self._pick().lease.LeaseTimeToLive,
                                 rpc.LeaseTimeToLiveRequest(ID=lease_id))
        return (int(resp.TTL), int(resp.grantedTTL)) if resp.TTL >= 0 else (-1, 0)

    @_request("lease")
    async def lease_keys(self, lease_id: int) -> tuple[int, list[bytes]]:
        """Seconds left on a lease (-1 if it does not exist) and every key attached to
        it, as etcd's lessor knows them (one reply: a lease holds what one session
        holds)."""
        resp = await self._unary(self._pick().lease.LeaseTimeToLive,
                                 rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True))
        return int(resp.TTL), [bytes(k) for k in resp.keys]

    @_request("lease")
    async def revoke(self, lease_id: int) -> None:
        try:
            await self._unary(self._pick().lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id))
        except grpc.aio.AioRpcError as e:
            if "lease not found" not in (e.details() or ""):
                raise

    # watches ------------------------------------------------------------

    async def watch(
        self,
        prefix: bytes | Sequence[bytes],
        start_revision: int,
        keep: Callable[[bytes], bool] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> AsyncIterator[list[WatchEvent]]:
        """Batches of events under ``prefix`` (or under each of several prefixes, on
        one stream) from ``start_revision`` (inclusive); with ``keep``, only events
        whose key it accepts (tested before anything else is built).

        Events of one prefix come in revision order; events of different prefixes
        are not ordered with each other. Raises ``Compacted`` if that revision is
        gone, ``Unavailable`` if the stream breaks; the caller re-lists and watches
        again. ``progress`` is told the revision of every response carrying events,
        after its kept events are yielded (those ``keep`` drops included: the watch
        has still come that far).
        """
        async with contextlib.aclosing(
                self._watch(prefix, start_revision, keep, progress, notify=False)) as items:
            async for item in items:
                if isinstance(item, list):
                    yield item

    async def watch_progress(
        self, prefix: bytes, start_revision: int,
    ) -> AsyncIterator[list[WatchEvent] | int]:
        """As :meth:`watch` of one prefix, with etcd's progress notifications in
        between: an ``int`` is a revision up to which every event under ``prefix`` has
        been yielded (sent while the watch is idle, at etcd's
        ``--experimental-watch-progress-notify-interval``, 10 minutes by default).

        They come from the watch's own stream in order with its events (etcd sends
        them only to a watch that has caught up, through the queue its events take),
        unlike the answers to a ``WatchProgressRequest``, which etcd before 3.4.24 and
        3.5.8 may send ahead of events still queued."""
        async with contextlib.aclosing(
                self._watch(prefix, start_revision, None, None, notify=True)) as items:
            async for item in items:
                yield item

    async def watch_many(
        self, watched: Sequence[Watched], start_revision: int,
        keep: Callable[[bytes], bool] | None = None,
    ) -> AsyncGenerator[list[WatchEvent] | int, None]:
        """As :meth:`watch_progress`, of several prefixes on one stream, each with the
        events it asks for (:class:`Watched`); with ``keep``, only events whose key it
        accepts. An ``int`` is a revision one of the prefixes has been followed up to
        (etcd's progress notification, sent while the watch is idle): the stream lives."""
        async with contextlib.aclosing(
                self._watch(watched, start_revision, keep, None, notify=True)) as items:
            async for item in items:
                yield item

    async def _watch(
        self,
        prefix: bytes | Sequence[bytes] | Sequence[Watched],
        start_revision: int,
        keep: Callable[[bytes], bool] | None,
        progress: Callable[[int], None] | None,
        notify: bool,
    ) -> AsyncGenerator[list[WatchEvent] | int, None]:
        watched = [p if isinstance(p, Watched) else Watched(p)
                   for p in ([prefix] if isinstance(prefix, bytes) else prefix)]

        async def requests(stop: asyncio.Event) -> Any:
            for w in watched:
                yield w.create_request(start_revision, notify)
            await stop.wait()

        sent = self._metadata
        for attempt in (1, 2):
            stop = asyncio.Event()
            start = time.perf_counter()
            call = self._pick().watch.Watch(requests(stop), metadata=sent)
            delivered = confirmed = False
            try:
                async for resp in call:
                    if not confirmed:  # a watch's time: until etcd answers its creation
                        confirmed = True
                        self.observe("watch", time.perf_counter() - start, not resp.canceled)
                    if resp.compact_revision:
                        raise Compacted(
                            f"revision {start_revision} compacted (now {resp.compact_revision})"
                        )
                    if resp.canceled:
                        # etcd checks the token when a watch is created and cancels it
                        # if the token is stale (3.5 calls that "permission denied"):
                        # once, before any event, log in again and watch anew.
                        stale = any(m in resp.cancel_reason
                                    for m in (*_STALE_TOKEN, "permission denied"))
                        if attempt == 1 and self.auth.user and stale and not delivered:
                            break
                        raise Unavailable(
                            f"etcd cancelled the watch: {_hinted(resp.cancel_reason)}")
                    if resp.events:
                        batch = [
                            WatchEvent("delete" if ev.type == 1 else "put", KV._from_pb(ev.kv))
                            for ev in resp.events if keep is None or keep(ev.kv.key)
                        ]
                        if batch:
                            delivered = True
                            yield batch
                        if progress is not None:
                            progress(int(resp.header.revision))
                    elif notify and not resp.created:
                        # a progress notification: the watch has come this far
                        yield int(resp.header.revision)
                else:
                    return
            except grpc.aio.AioRpcError as e:
                if not confirmed:
                    self.observe("watch", time.perf_counter() - start, False)
                raise _translate(e) from e
            finally:
                stop.set()
                call.cancel()
            try:
                await self._renew(sent)
            except grpc.aio.AioRpcError as e:
                raise _translate(e) from e
            sent = self._metadata
