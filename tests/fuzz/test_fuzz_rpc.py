"""Fuzzing every RPC of the contract against a real registry on a real etcd.

Each input is one call of one method (any service, any method the descriptors list but
the agent session stream, which test_session_stream covers) with a hostile request. A
finding is:

- a crash: ``INTERNAL`` or ``UNKNOWN`` (an exception the registry did not mean), or the
  registry no longer answering;
- a hang: a unary call without an answer in ``HANG`` seconds;
- an unclear error: a refusal without a message, or one that shows a traceback;
- a change from a refused call: etcd's keys under the registry's prefix differ after a
  call the registry refused. Things move by themselves too (a session a fuzzed call
  opened expires, its claims are reaped), so a refusal that coincides with a change is
  sent again once etcd has been still for a moment: a refusal that writes does so again.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import given
from hypothesis import strategies as st
from registry_fixtures import TEST_RETRY, RegistryHandle, start_registry

from baton_relay.client import Client
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import EtcdProcess

from .strategies import fuzz_settings, messages, named

#: seconds a unary call may take before it counts as a hang
HANG = 15.0
#: codes a refusal may carry: each says what was wrong (kernel/errors.py's table)
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE}
#: calls made again, each once etcd is still, before a refused call that changed etcd
#: counts as a finding (the registry's background work may move a key meanwhile)
QUIET_ATTEMPTS = 3
#: the largest request the registry takes (gRPC's default); a larger one never leaves
#: the client
MAX_MESSAGE = 4 * 1024 * 1024

METHODS: list[MethodDescriptor] = [
    m for service in pb.DESCRIPTOR.services_by_name.values() for m in service.methods
    if not m.client_streaming]


def message_class(descriptor: Any) -> type[Any]:
    return message_factory.GetMessageClass(descriptor)


#: methods that end what they name: they get the spare task, session and host, so that
#: the fixture's task and session stay usable for the other methods' inputs
DESTRUCTIVE = {"CancelTask", "DeleteTask", "ArchiveTask", "PauseTask", "RevokeSession",
               "RotateLease", "DrainHost", "DrainWatcher", "MoveShard", "Rebalance",
               "CloseSession", "Requeue"}


@dataclass
class World:
    registry: RegistryHandle
    channel: grpc.Channel
    etcd: EtcdProcess
    prefix: str
    #: values by field name that reach existing things: for most methods, and for the
    #: destructive ones
    known: dict[str, tuple[Any, ...]]
    spare: dict[str, tuple[Any, ...]]


@pytest.fixture(scope="module")
def world(etcd: EtcdProcess) -> Iterator[World]:
    """A registry with a task, a session holding a claim, a committed entry and a
    registered watcher: ids and tokens the fuzzed requests name."""
    prefix = f"/baton-fuzz/{time.monotonic_ns()}/"
    with tempfile.TemporaryDirectory(prefix="baton-fuzz-") as tmp:
        registry = start_registry(etcd.endpoint, prefix, Path(tmp))
        try:
            with Client(registry.address, timeout=10, retry=TEST_RETRY) as c:
                for task in ("t", "spare"):
                    c.operator.create_task({"task_id": task, "consumers": ["default", "sink"],
                                            "digest_optional": True, "entries": [
                                       {"file_id": f"f{i}", "path": f"d/f{i}.bin"}
                                       for i in range(5)]})
                session = c.open_session("fuzz", ttl=3600, keepalive=False)
                spare = c.open_session("spare", ttl=3600, keepalive=False, host="spare-host")
                spare_claim = c.claim("spare", "f0", session=spare)
                held = c.claim("t", "f0", session=session)
                done = c.claim("t", "f1", session=session)
                c.commit("t", "f1", done.token, 0, session=session)
                watcher = c.watcher.register_watcher(tmp, ttl=600)
            known: dict[str, tuple[Any, ...]] = {
                "task_id": ("t",), "file_id": ("f0", "f1", "f2"),
                "group": ("default", "sink"), "session_id": (session.session_id,),
                "token": (held.token, done.token), "watcher_id": (watcher.watcher_id,),
                "agent": ("fuzz",), "reason": ("fuzzed",)}
            spare_known = {**known, "task_id": ("spare",), "session_id": (spare.session_id,),
                           "token": (spare_claim.token,), "host": ("spare-host",),
                           "watcher_id": ("0" * 16,)}
            with grpc.insecure_channel(registry.address) as channel:
                yield World(registry, channel, etcd, prefix, known, spare_known)
        finally:
            registry.stop()


def keys_digest(w: World) -> str:
    """What etcd holds under the registry's prefix: every key and its mod revision."""
    h = hashlib.blake2b()
    for kv in _range(w):
        h.update(kv)
    return h.hexdigest()


def _range(w: World) -> Iterator[bytes]:
    import asyncio

    from baton_relay.registry.store.etcd import Etcd

    async def read() -> list[bytes]:
        etcd = Etcd(w.etcd.endpoint)
        await etcd.connect()
        try:
            return [kv.key + b"@" + str(kv.mod_revision).encode()
                    async for kv in etcd.scan(w.prefix.encode(), keys_only=True)]
        finally:
            await etcd.close()
    return iter(asyncio.run(read()))


def call(w: World, method: MethodDescriptor, request: Any) -> grpc.RpcError | None:
    """Call ``method``; its error, or None when it answered."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    out = message_class(method.output_type)
    try:
        if method.server_streaming:
            stream = w.channel.unary_stream(path, request_serializer=type(request)
                                            .SerializeToString,
                                            response_deserializer=out.FromString)(
                request, timeout=2)
            try:
                next(iter(stream), None)
            finally:
                stream.cancel()
        else:
            w.channel.unary_unary(path, request_serializer=type(request).SerializeToString,
                                  response_deserializer=out.FromString)(request, timeout=HANG)
    except grpc.RpcError as e:
        return e
    return None


def still(w: World, seconds: float = 0.5, within: float = 20.0) -> str:
    """The prefix's digest once it has not changed for ``seconds``."""
    deadline = time.monotonic() + within
    last = keys_digest(w)
    while time.monotonic() < deadline:
        time.sleep(seconds)
        now = keys_digest(w)
        if now == last:
            return now
        last = now
    return last


@fuzz_settings(250)
@given(data=st.data())
def test_every_rpc_refuses_hostile_requests_clearly_and_changes_nothing(
        world: World, data: st.DataObject) -> None:
    """Any request to any method: an answer, or a refusal with a status that names the
    kind of problem and a message — never a crash, a hang or a write."""
    method = data.draw(st.sampled_from(METHODS), label="method")
    named(world.spare if method.name in DESTRUCTIVE else world.known)
    request = data.draw(messages(message_class(method.input_type)), label="request")
    if request.ByteSize() > MAX_MESSAGE:
        return  # gRPC's client refuses it; the registry never sees it
    before = keys_digest(world)
    error = call(world, method, request)
    if error is None:
        return
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and method.server_streaming:
        return  # a stream with nothing to say yet
    assert code in REFUSALS, f"{method.name}: {code.name}: {details[:500]}"
    assert details.strip(), f"{method.name}: {code.name} without a message"
    assert "Traceback" not in details, f"{method.name}: a traceback in the error"
    if keys_digest(world) != before:
        # Something moved meanwhile (the registry's own background work: a shard move
        # coming due, a lease): try again once etcd is still. A refused call that
        # writes writes every time; the background only now and then — so the call is
        # cleared by any one attempt that left etcd as it found it.
        for _ in range(QUIET_ATTEMPTS):
            quiet = still(world)
            again = call(world, method, request)
            assert again is not None and again.code() == code, (
                f"{method.name}: refused with {code.name}, then answered otherwise")
            if keys_digest(world) == quiet:
                break
        else:
            raise AssertionError(f"{method.name}: refused ({code.name}: {details[:200]}) "
                                 f"but changed etcd, {QUIET_ATTEMPTS} times out of "
                                 f"{QUIET_ATTEMPTS}")
