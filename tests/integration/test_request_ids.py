"""A request id identifies one call: its retry is answered from the record, and the
same id sent with another call or other arguments is another request."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from registry_fixtures import RegistryHandle

from baton_relay.client import Client
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores


def rpc(registry: RegistryHandle, name: str, request: Any) -> Any:
    """Call method ``name`` (whichever service has it) with ``request`` as it is."""
    (method,) = [m for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods
                 if m.name == name]
    out = message_factory.GetMessageClass(method.output_type)
    with grpc.insecure_channel(registry.address) as channel:
        return channel.unary_unary(
            f"/{method.containing_service.full_name}/{name}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=out.FromString)(request, timeout=10)


@pytest.fixture
def session(client: Client) -> int:
    client.operator.create_task({"task_id": "t", "digest_optional": True, "entries": [
        {"file_id": f"f{i}", "path": f"f{i}"} for i in range(4)]})
    return client.open_session("p", ttl=60, keepalive=False).session_id


def test_a_retried_call_is_answered_from_its_record(
        registry: RegistryHandle, client: Client, session: int) -> None:
    """The same claim sent twice with one request id applies once: the same reply."""
    req = pb.ClaimRequest(task_id="t", file_id="f0", session_id=session, request_id="r1")
    first, again = rpc(registry, "Claim", req), rpc(registry, "Claim", req)
    assert again == first
    assert client.operator.get_entry("t", "f0").token == first.token


def test_one_request_id_on_another_method_is_another_request(
        registry: RegistryHandle, client: Client, session: int) -> None:
    """A request id first used by a batch claim, then by a consume: the consume is
    answered as a consume (it used to be handed the batch's record and fail to decode
    it: INTERNAL, found by fuzzing)."""
    rpc(registry, "ClaimBatch", pb.ClaimBatchRequest(task_id="t", max=2, session_id=session,
                                                     request_id="same"))
    with pytest.raises(grpc.RpcError) as refused:
        rpc(registry, "Consume", pb.ConsumeRequest(task_id="t", group="default",
                                                   session_id=session, request_id="same"))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND  # nothing verified yet
    assert "nothing to consume" in (refused.value.details() or "")


def test_one_request_id_with_other_arguments_is_another_request(
        registry: RegistryHandle, client: Client, session: int) -> None:
    """Two claims of different entries under one request id: both apply, each with its
    own reply (not the first one's, which would leave the second entry unclaimed)."""
    a = rpc(registry, "Claim", pb.ClaimRequest(task_id="t", file_id="f0", session_id=session,
                                               request_id="dup"))
    b = rpc(registry, "Claim", pb.ClaimRequest(task_id="t", file_id="f1", session_id=session,
                                               request_id="dup"))
    assert (a.entry.file_id, b.entry.file_id) == ("f0", "f1")
    assert client.operator.get_entry("t", "f1").token == b.token
