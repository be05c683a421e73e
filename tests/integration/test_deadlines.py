"""Processing deadlines: a live but hung agent loses its claim at the claim's deadline
(producer: the retry path; consumer: back to its group), its token dies, and a claim
that ended in time leaves nothing behind; entries written and never verified are
counted and named as stuck (real etcd, real registry)."""

from __future__ import annotations

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


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryHandle]) -> RegistryHandle:
    return registry_factory(stuck_written_after=0.5)


def deadline_keys(registry: RegistryHandle) -> int:
    async def count(etcd: Etcd) -> int:
        return await etcd.count(Keys(registry.prefix).deadlines())

    return on_etcd(registry.etcd, count)


@pytest.mark.real_time("test_on_the_clock.py::test_a_hung_producer_loses_its_claim_at_a_ten_minute_deadline")
def test_a_hung_producer_loses_its_claim_at_the_deadline(
    client: Client, wait_for: Wait,
) -> None:
    client.operator.create_task({"task_id": "t1", "digest_optional": True,
                                 "claim_deadline_seconds": 1,
                                 "entries": [{"file_id": "a", "path": "a"}]})
    with client.open_session("hung", ttl=30, slots=1) as session:  # keepalive runs
        claim = client.claim("t1", "a", session=session)
        wait_for(lambda: client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_PENDING,
                 timeout=10,
                 what="the claim taken away")
        entry = client.operator.get_entry("t1", "a")
        assert entry.retry_count == 1 and "claim deadline" in entry.error
        events = [r.event for r in client.operator.journal("t1", "a")]
        assert events[-1] == "deadline"
        with pytest.raises(StaleToken):  # it wakes up: too late
            client.commit("t1", "a", claim.token, 0, session=session)
        assert not session.lost.is_set()  # the session itself is fine
        # its slot was freed with the claim: it may claim again (after the backoff)
        wait_for(lambda: "claimable" in client.operator.explain("t1", "a").text,
                 what="backoff over")
        again = client.claim("t1", "a", session=session)
        client.commit("t1", "a", again.token, 0, session=session)
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITTEN


@pytest.mark.real_time("test_on_the_clock.py::test_a_hung_consumer_gives_the_entry_back_at_a_fifteen_minute_deadline")
def test_a_hung_consumer_gives_the_entry_back_to_its_group(
    client: Client, wait_for: Wait,
) -> None:
    client.operator.create_task({"task_id": "t1", "digest_optional": True, "consumers": ["g"],
                                 "entries": [{"file_id": "a", "path": "a",
                                     "consume_deadline_seconds": 1}]})
    with client.open_session("p", ttl=30) as producer:
        claim = client.claim("t1", "a", session=producer)
        client.commit("t1", "a", claim.token, 0, session=producer)
    client.watcher.report("t1", "a", 0, EMPTY, reporter="test")
    with client.open_session("hung", ttl=30) as hung, \
            client.open_session("next", ttl=30) as other:
        lease = client.consume("t1", "g", "a", session=hung)
        wait_for(lambda: client.operator.journal("t1", "a")[-1].event == "deadline", timeout=10,
                 what="the consume-claim taken away")
        with pytest.raises(StaleToken):
            client.ack("t1", "a", "g", lease.token, session=hung)
        taken = client.consume("t1", "g", session=other)
        assert taken.file_id == "a"
        client.ack("t1", "a", "g", taken.token, session=other)
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_CONSUMED


def test_a_claim_that_ends_in_time_leaves_nothing_and_keeps_its_entry(
    client: Client, wait_for: Wait, registry: RegistryHandle,
) -> None:
    client.operator.create_task({"task_id": "t1", "digest_optional": True,
                                 "claim_deadline_seconds": 1,
                                 "entries": [{"file_id": "a", "path": "a"},
                                    {"file_id": "b", "path": "b", "claim_deadline_seconds": 60}]})
    with client.open_session("quick", ttl=30) as session:
        a = client.claim("t1", "a", session=session)
        b = client.claim("t1", "b", session=session)
        assert deadline_keys(registry) == 2
        client.commit("t1", "a", a.token, 0, session=session)
        # a's key falls due and is dropped without touching a; b's own deadline is later
        wait_for(lambda: deadline_keys(registry) == 1, timeout=10, what="a's key dropped")
        assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITTEN
        assert client.operator.get_entry("t1", "b").state == pb.ENTRY_STATE_WRITING
        assert client.operator.get_entry("t1", "b").claim_deadline_seconds == 60
        client.commit("t1", "b", b.token, 0, session=session)


def test_deadlines_in_a_manifest_are_checked(client: Client) -> None:
    for bad in ({"claim_deadline_seconds": -1}, {"consume_deadline_seconds": 8 * 86400}):
        with pytest.raises(InvalidManifest, match="deadline_seconds"):
            client.operator.create_task({"task_id": "t1", **bad,
                                         "entries": [{"file_id": "a", "path": "a"}]})


def test_an_entry_written_and_never_verified_is_counted_and_named_as_stuck(
    registry: RegistryHandle, client: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    client.operator.create_task({"task_id": "t1", "digest_optional": True,
                                 "entries": [{"file_id": "a", "path": "a"},
                                             {"file_id": "b", "path": "b"}]})
    with client.open_session("p", ttl=30) as session:
        claim = client.claim("t1", "a", session=session)
        client.commit("t1", "a", claim.token, 0, session=session)
    assert client.operator.get_task("t1").stuck_written == 0  # just written
    # 0.6 s later by the registry's clock (Core.clock), past --stuck-written-after
    # (0.5 s): the age itself is under test
    core = registry._running.core
    wall = core.clock
    monkeypatch.setattr(core, "clock", lambda: wall() + 0.6)
    assert client.operator.get_task("t1").stuck_written == 1
    assert "it is stuck" in client.operator.explain("t1", "a").text
    assert "stuck" not in client.operator.explain("t1", "b").text
