"""What the blocking and the asyncio clients share: the records they hand out (a
claim, a lease), the identity files, the channel's options, how a commit's attributes
travel."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ..kernel import errors
from ..kernel.contract import (
    KEEPALIVE_MS,
    KEEPALIVE_TIMEOUT_MS,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    mib,
)
from ..kernel.v1 import baton_pb2 as pb


@dataclass(frozen=True)
class Claim:
    """A producer's claim: write ``path``, then commit or fail with ``token``."""

    task_id: str
    file_id: str
    token: int
    path: str
    entry: pb.Entry
    session_id: int = 0
    #: the checkpoint an earlier attempt left (None: start from the beginning), and
    #: this attempt's number (0: the registry did not say)
    checkpoint: pb.Checkpoint | None = None
    attempt: int = 0

    @classmethod
    def of(cls, task_id: str, r: pb.ClaimResponse, session_id: int) -> Claim:
        return cls(task_id, r.entry.file_id, r.token, r.path, r.entry, session_id,
                   r.checkpoint if r.HasField("checkpoint") else None, r.attempt)

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task_id, "file_id": self.file_id, "token": self.token,
                "path": self.path, "session": self.session_id, "attempt": self.attempt,
                **_checkpoint_dict(self.checkpoint)}


@dataclass(frozen=True)
class Lease:
    """A consumer's hold on a verified entry: read ``path``, then ack or nack."""

    task_id: str
    file_id: str
    group: str
    token: int
    path: str
    size: int
    digest: str
    entry: pb.Entry
    session_id: int = 0
    #: the checkpoint an earlier lease of the group left, and this lease's number
    checkpoint: pb.Checkpoint | None = None
    attempt: int = 0

    @classmethod
    def of(cls, task_id: str, r: pb.ConsumeResponse, session_id: int) -> Lease:
        return cls(task_id, r.entry.file_id, r.group, r.token, r.path, r.size, r.digest,
                   r.entry, session_id, r.checkpoint if r.HasField("checkpoint") else None,
                   r.attempt)

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task_id, "file_id": self.file_id, "group": self.group,
                "token": self.token, "path": self.path, "size": self.size,
                "digest": self.digest, "session": self.session_id, "attempt": self.attempt,
                **_checkpoint_dict(self.checkpoint)}


def _checkpoint_dict(checkpoint: pb.Checkpoint | None) -> dict[str, Any]:
    """A checkpoint as a claim's or lease's JSON shows it (its data as base64)."""
    if checkpoint is None:
        return {}
    import base64

    return {"checkpoint": {
        "data": base64.b64encode(checkpoint.data).decode(), "progress": checkpoint.progress,
        "message": checkpoint.message, "attempt": checkpoint.attempt, "at": checkpoint.at,
        "digest": checkpoint.digest}}


@dataclass(frozen=True)
class Credentials:
    """The files of a client identity: the CA that signed the registry's certificate,
    and this client's certificate and key (see docs/security.md)."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @classmethod
    def resolve(cls, ca: str | None, cert: str | None, key: str | None) -> Credentials:
        """The three given; when none is, ``BATON_CA``, ``BATON_CERT``, ``BATON_KEY``."""
        if ca is None and cert is None and key is None:
            env = os.environ
            return cls(env.get("BATON_CA", ""), env.get("BATON_CERT", ""),
                       env.get("BATON_KEY", ""))
        return cls(ca or "", cert or "", key or "")

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert or self.key)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if not self.ca:
            raise errors.InvalidArgument(
                "TLS needs the CA that signed the registry's certificate "
                "(--ca or BATON_CA) along with the client certificate")
        if bool(self.cert) != bool(self.key):
            raise errors.InvalidArgument(
                "a client certificate needs its key and the reverse "
                "(--cert/BATON_CERT with --key/BATON_KEY)")

        def read(what: str, path: str) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise errors.InvalidArgument(f"cannot read the {what} {path}: {e.strerror}",
                                             path=path) from None

        return grpc.ssl_channel_credentials(
            root_certificates=read("CA (BATON_CA)", self.ca),
            private_key=read("key (BATON_KEY)", self.key),
            certificate_chain=read("certificate (BATON_CERT)", self.cert))


#: a commit's attributes: a JSON object as a mapping, or as its text
Attributes = Mapping[str, Any] | str | None


def encode_attributes(attributes: Attributes) -> str:
    """The JSON text a commit carries: a mapping encoded, text sent as it is (so a
    number keeps every digit it was written with), nothing for None or ``{}``. The
    registry checks it is an object of at most ``MAX_ATTRIBUTES_BYTES``."""
    if attributes is None or isinstance(attributes, str):
        return attributes or ""
    return json.dumps(dict(attributes), separators=(",", ":")) if attributes else ""


def channel_options(target: str, credentials: Credentials) -> list[tuple[str, Any]]:
    """The options of a channel to ``target``: message bounds, the keepalive pings that
    notice a silent replica, and the name TLS checks."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
        ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0)]
    name = _tls_name(target) if credentials.tls else ""
    if name:
        # A list of replicas is one gRPC target: the certificate is checked
        # against its first host, which every replica's certificate must name.
        options.append(("grpc.ssl_target_name_override", name))
    return options


def _tls_name(target: str) -> str:
    """The host a list target (``ipv4:A:P,B:P``, ``ipv6:[A]:P,...``) names first, whose
    name the replicas' certificates carry; "" for a plain ``host:port``."""
    scheme, sep, rest = target.partition(":")
    if not sep or scheme not in ("ipv4", "ipv6", "dns"):
        return ""
    first = rest.lstrip("/").split(",")[0]
    host = first.rpartition(":")[0] if not first.startswith("[") else first[1:].split("]")[0]
    return host.strip("[]")


def error_of(error: pb.CallError) -> errors.BatonError:
    """The domain error one call of a stream or a batch ended with."""
    return errors.from_status(grpc.StatusCode[error.code], error.details,
                              tuple(error.metadata.items()))


def raise_from_rpc(e: grpc.RpcError, method: str = "", timeout: float = 0.0
                    ) -> errors.BatonError:
    """The domain error a failed call carries (the inverse of the registry's
    ``to_status``); a bare deadline says which call and how long it waited."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else ()
    error = errors.from_status(code, details, trailing)
    if type(error) is errors.DeadlineExceeded and method:
        # The transport only says "Deadline Exceeded"; say which call and how long.
        return errors.DeadlineExceeded(
            f"{method}: no reply from the registry within {timeout:g} s (deadline exceeded)",
            method=method, timeout=timeout)
    return error


def events_of(reply: pb.WatchResponse) -> Sequence[pb.TaskEvent]:
    """The events of one ``Watch`` message: several (``events``) or one (``event``)."""
    return reply.events if reply.events else (reply.event,)


#: the registry's methods by name, from the services' descriptors
METHODS = {method.name: method for service in pb.DESCRIPTOR.services_by_name.values()
           for method in service.methods}


def method_of(channel: Any, name: str) -> Any:
    """The callable of the registry's method ``name`` on ``channel`` (blocking or
    asyncio), made from its descriptor: the generated stubs make every method at once,
    a cost every short-lived ``baton`` process would pay for its one or two calls."""
    method = METHODS.get(name)
    if method is None:
        raise AttributeError(name)
    request = getattr(pb, method.input_type.name)
    reply = getattr(pb, method.output_type.name)
    make = channel.unary_stream if method.server_streaming else channel.unary_unary
    return make(f"/{method.containing_service.full_name}/{name}",
                request_serializer=request.SerializeToString,
                response_deserializer=reply.FromString,
                _registered_method=True)  # as generated stubs do


def checked(method: str, request: Any) -> None:
    """Give a request its id (the same across its retries) and refuse one larger than a
    registry accepts, before it is sent."""
    if hasattr(request, "request_id") and not request.request_id:
        request.request_id = os.urandom(16).hex()
    size = request.ByteSize()
    if size > MAX_REQUEST_BYTES:
        raise errors.MessageTooLarge(
            f"{method}: the request is {mib(size)}; a registry accepts at most "
            f"{mib(MAX_REQUEST_BYTES)}", size=size, limit=MAX_REQUEST_BYTES)


def explained(error: errors.BatonError, credentials: Credentials, target: str
              ) -> errors.BatonError:
    """A connection refused by the transport, with what usually causes it."""
    if type(error) is not errors.Unavailable:
        return error
    text = error.message.lower()
    if credentials.tls and ("ssl" in text or "handshake" in text or "tls" in text):
        return errors.Unavailable(
            f"{error.message} (the TLS handshake with {target} failed: is "
            "BATON_CA the CA of the registry's certificate, and BATON_CERT/BATON_KEY "
            "an identity that CA signed?)")
    if not credentials.tls and "refused" not in text:
        return errors.Unavailable(
            f"{error.message} (this client speaks plaintext: a registry serving TLS "
            "needs BATON_CA, BATON_CERT and BATON_KEY)")
    return error
