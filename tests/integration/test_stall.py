"""Stalls: an attempt whose session lives but which stops checkpointing is taken back
after the entry's stall_after_seconds, as at a deadline (reason "stalled", its token
dead, a retry spent); one that keeps checkpointing is left alone (real etcd, real
registry)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from registry_fixtures import RegistryHandle, on_etcd

from baton_relay.client import Client
from baton_relay.kernel.errors import InvalidManifest, StaleToken
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import Keys

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

Wait = Callable[..., None]
EMPTY = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def stall_keys(registry: RegistryHandle) -> int:
    async def count(etcd: Etcd) -> int:
        return await etcd.count(Keys(registry.prefix).stalls())

    return on_etcd(registry.etcd, count)


@pytest.mark.real_time("test_on_the_clock.py::test_a_producer_silent_for_five_minutes_is_taken_back_as_stalled")
def test_a_producer_that_stops_checkpointing_is_taken_back_as_stalled(
    client: Client, registry: RegistryHandle, wait_for: Wait,
) -> None:
    """Alive (its keepalive runs) but silent past stall_after_seconds: the claim goes,
    the entry takes the retry path with reason "stalled", the token is dead."""
    client.operator.create_task({"task_id": "t1", "digest_optional": True, "stall_after_seconds": 1,
                                 "entries": [{"file_id": "a", "path": "a"}]})
    with client.open_session("silent", ttl=30) as session:
        claim = client.claim("t1", "a", session=session)
        session.checkpoint("t1", "a", claim.token, progress=0.1)  # then nothing more
        wait_for(lambda: client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_PENDING,
                 timeout=10, what="the stalled claim taken back")
        entry = client.operator.get_entry("t1", "a")
        assert entry.retry_count == 1 and entry.error.startswith("stalled")
        assert client.operator.journal("t1", "a")[-1].event == "stalled"
        with pytest.raises(StaleToken):
            client.commit("t1", "a", claim.token, 0, session=session)
        assert not session.lost.is_set()  # the session itself lives on
    assert registry.stalls.stalled == 1
    wait_for(lambda: stall_keys(registry) == 0, what="the stall key gone")


@pytest.mark.real_time("test_on_the_clock.py::test_a_producer_checkpointing_for_an_hour_is_left_alone")
def test_a_slow_producer_that_keeps_checkpointing_is_left_alone(
    client: Client, registry: RegistryHandle,
) -> None:
    """Checkpoints every 0.3 s for three times stall_after_seconds: never stalled."""
    client.operator.create_task({"task_id": "t1", "digest_optional": True,
                                 "entries": [{"file_id": "a", "path": "a",
                                              "stall_after_seconds": 1}]})
    with client.open_session("slow", ttl=30) as session:
        claim = client.claim("t1", "a", session=session)
        end = time.monotonic() + 3
        step = 0
        while time.monotonic() < end:
            step += 1
            session.checkpoint("t1", "a", claim.token, progress=min(step / 20, 1.0))
            time.sleep(0.3)  # the pace of the work itself is under test
        client.commit("t1", "a", claim.token, 0, session=session)
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITTEN
    assert "stalled" not in [r.event for r in client.operator.journal("t1", "a")]
    assert registry.stalls.stalled == 0


@pytest.mark.real_time("test_on_the_clock.py::test_a_consumer_silent_past_its_stall_time_gives_the_entry_back")
def test_a_stalled_consumer_gives_the_entry_back_to_its_group(
    client: Client, wait_for: Wait,
) -> None:
    """A consume lease that never checkpoints goes back to its group at the entry's
    stall_after_seconds (overriding the task's)."""
    client.operator.create_task({"task_id": "t1", "digest_optional": True, "consumers": ["g"],
                                 "stall_after_seconds": 600,
                                 "entries": [{"file_id": "a", "path": "a",
                                              "stall_after_seconds": 1}]})
    with client.open_session("p", ttl=30) as producer:
        claim = client.claim("t1", "a", session=producer)
        assert claim.attempt == 1
        client.commit("t1", "a", claim.token, 0, session=producer)
    client.watcher.report("t1", "a", 0, EMPTY, reporter="test")
    with client.open_session("silent", ttl=30) as silent, \
            client.open_session("next", ttl=30) as other:
        lease = client.consume("t1", "g", "a", session=silent)
        wait_for(lambda: client.operator.journal("t1", "a")[-1].event == "stalled", timeout=10,
                 what="the lease taken back")
        with pytest.raises(StaleToken):
            client.ack("t1", "a", "g", lease.token, session=silent)
        taken = client.consume("t1", "g", session=other)
        client.ack("t1", "a", "g", taken.token, session=other)
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_CONSUMED


def test_stall_after_in_a_manifest_is_checked(client: Client) -> None:
    """stall_after_seconds must be within 0..a week, task and entries alike."""
    for task, entry in (({"stall_after_seconds": -1}, {}),
                        ({}, {"stall_after_seconds": 8 * 86400})):
        with pytest.raises(InvalidManifest, match="stall_after_seconds"):
            client.operator.create_task({"task_id": "t1", **task,
                                         "entries": [{"file_id": "a", "path": "a", **entry}]})
