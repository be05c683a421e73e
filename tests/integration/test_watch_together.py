"""``WatchRequest.together``: the changes one write of the store makes to a task reach
a follower in one message (issue 38: a message per write, not one per entry), and a
client that does not ask is sent one event a message, as before. The clients ask, and
hand their callers the same events, one at a time."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from registry_fixtures import RegistryHandle

from baton_relay.client import Client
from baton_relay.client.aio import AsyncClient
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.kernel.v1 import baton_pb2_grpc as pb_grpc

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

N = 5
CHANGED = pb.TaskEvent.KIND_CHANGED
SYNCED = pb.TaskEvent.KIND_SYNCED


def seen(events: list[pb.TaskEvent]) -> list[tuple[int, str, int]]:
    return [(e.kind, e.entry.file_id, e.entry.state) for e in events]


def test_one_write_of_several_entries_is_one_message_when_asked_together(
        registry: RegistryHandle, client: Client) -> None:
    client.operator.create_task({"task_id": "t", "entries": [
        {"file_id": f"f{i}", "path": f"f{i}"} for i in range(N)]})
    with grpc.insecure_channel(registry.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        together = stub.Watch(pb.WatchRequest(task_id="t", start_revision=-1, together=True),
                              timeout=20)
        alone = stub.Watch(pb.WatchRequest(task_id="t", start_revision=-1), timeout=20)
        flat = client.watch("t", start_revision=-1, timeout=20)
        first = next(together)
        assert [e.kind for e in first.events] == [SYNCED] and not first.HasField("event")
        assert next(alone).event.kind == SYNCED
        assert next(flat).kind == SYNCED
        with client.open_session("p", ttl=10) as session:
            claims = client.claim_batch("t", N, session=session)  # one transaction
            assert len(claims) == N
            message = next(together)
            singles = [next(alone) for _ in range(N)]
            flattened = [next(flat) for _ in range(N)]
        together.cancel()
        alone.cancel()
    assert len(message.events) == N and not message.HasField("event")
    assert {e.entry.file_id for e in message.events} == {f"f{i}" for i in range(N)}
    assert {(e.kind, e.entry.state) for e in message.events} == {
        (CHANGED, pb.ENTRY_STATE_WRITING)}
    assert all(not m.events and m.HasField("event") for m in singles)
    assert seen([m.event for m in singles]) == seen(list(message.events))
    assert seen(flattened) == seen(list(message.events))


def test_the_async_client_hands_out_a_message_s_events_one_at_a_time(
        registry: RegistryHandle, client: Client) -> None:
    client.operator.create_task({"task_id": "t", "entries": [
        {"file_id": f"f{i}", "path": f"f{i}"} for i in range(N)]})

    async def follow() -> list[pb.TaskEvent]:
        async with AsyncClient(registry.address) as aio:
            stream = aio.watch("t", start_revision=0, timeout=20)
            got = []
            async for event in stream:
                got.append(event)
                if event.kind == SYNCED:
                    await asyncio.to_thread(claim)
                elif len(got) == 2 * N + 1:
                    stream.cancel()
            return got

    def claim() -> None:
        with client.open_session("p", ttl=10) as session:
            client.claim_batch("t", N, session=session)

    got = asyncio.run(follow())
    assert [e.kind for e in got] == [pb.TaskEvent.KIND_SNAPSHOT] * N + [SYNCED] + [CHANGED] * N
    assert [e.entry.file_id for e in got[:N]] == [f"f{i}" for i in range(N)]
    assert {e.entry.file_id for e in got[N + 1:]} == {f"f{i}" for i in range(N)}
