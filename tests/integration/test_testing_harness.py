"""baton_relay.testing: the registry in-process on the in-memory store, by a clock the
test owns. What falls due in an advance fires (claim deadlines, stalls, retry
backoffs, lease expiry), live sessions are held through it unless the test says not,
and the registry's stamps move with the clock. No etcd: the fixture is the one agents'
tests get (``baton_registry``, found by pytest through the package's entry point)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import blake3
import pytest

from baton_relay.client import produce, read_verified
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.model import epoch_of
from baton_relay.testing import InProcessRegistry, serve

EMPTY = blake3.blake3(b"").hexdigest()


def one_entry(registry: InProcessRegistry, **task: object) -> None:
    registry.client.operator.create_task({"task_id": "t", "digest_optional": True,
                                          "entries": [{"file_id": "a", "path": "a"}], **task})


def state(registry: InProcessRegistry) -> int:
    return registry.client.operator.get_entry("t", "a").state


def test_a_ten_minute_claim_deadline_passes_in_one_advance(
        baton_registry: InProcessRegistry) -> None:
    """Nothing happens before the deadline; at it the claim is taken back (the retry
    path, its token dead), while the agent's session, alive, is held through the jump."""
    one_entry(baton_registry, claim_deadline_seconds=600)
    client = baton_registry.client
    with client.open_session("slow", ttl=10) as session:
        claim = client.claim("t", "a", session=session)
        baton_registry.advance(599)
        assert state(baton_registry) == pb.ENTRY_STATE_WRITING
        baton_registry.advance(2)
        entry = client.operator.get_entry("t", "a")
        assert (entry.state, entry.retry_count) == (pb.ENTRY_STATE_PENDING, 1)
        assert client.operator.journal("t", "a")[-1].event == "deadline"
        with pytest.raises(errors.StaleToken):
            client.commit("t", "a", claim.token, 0, session=session)
        assert not session.lost.is_set()  # held through 601 s on a 10 s lease


def test_sessions_not_held_run_out_and_their_claims_go_back(
        baton_registry: InProcessRegistry) -> None:
    one_entry(baton_registry)
    client = baton_registry.client
    session = client.open_session("frozen", ttl=10)
    client.claim("t", "a", session=session)
    baton_registry.advance(9, hold_sessions=False)
    assert state(baton_registry) == pb.ENTRY_STATE_WRITING  # not yet: 1 s left
    baton_registry.advance(2, hold_sessions=False)
    entry = client.operator.get_entry("t", "a")
    assert (entry.state, entry.retry_count) == (pb.ENTRY_STATE_PENDING, 1)
    with pytest.raises(errors.SessionExpired):
        client.claim("t", session=session)


def test_a_stall_is_found_on_the_test_clock(baton_registry: InProcessRegistry) -> None:
    one_entry(baton_registry, stall_after_seconds=300)
    client = baton_registry.client
    with client.open_session("silent", ttl=10) as session:
        claim = client.claim("t", "a", session=session)
        session.checkpoint("t", "a", claim.token, progress=0.1)
        baton_registry.advance(299)
        assert state(baton_registry) == pb.ENTRY_STATE_WRITING
        baton_registry.advance(2)
        entry = client.operator.get_entry("t", "a")
        assert entry.state == pb.ENTRY_STATE_PENDING and entry.error.startswith("stalled")


def test_a_retry_backoff_ends_when_the_clock_says(baton_registry: InProcessRegistry) -> None:
    """fail --delay 3600: refused for the hour, claimable after it, with the checkpoint
    of the failed attempt handed to the next one."""
    one_entry(baton_registry, max_retries=3)
    client = baton_registry.client
    with client.open_session("p", ttl=10) as session:
        first = client.claim("t", "a", session=session)
        session.checkpoint("t", "a", first.token, data=b"page 7", progress=0.5)
        client.fail("t", "a", first.token, "rate limited", delay=3600, session=session)
        baton_registry.advance(3590)
        with pytest.raises(errors.IllegalTransition, match="retry backoff"):
            client.claim("t", "a", session=session)
        baton_registry.advance(11)
        second = client.claim("t", "a", session=session)
    assert second.attempt == 2
    assert second.checkpoint is not None and second.checkpoint.data == b"page 7"


def test_the_registrys_stamps_follow_the_clock(baton_registry: InProcessRegistry) -> None:
    one_entry(baton_registry)
    before = epoch_of(baton_registry.client.operator.get_entry("t", "a").updated_at)
    baton_registry.advance(86400)
    with baton_registry.client.open_session("p", ttl=10) as session:
        baton_registry.client.claim("t", "a", session=session)
    after = epoch_of(baton_registry.client.operator.get_entry("t", "a").updated_at)
    assert 86400 <= after - before < 86400 + 60


def test_a_watcher_verifies_what_an_agent_produces(baton_registry: InProcessRegistry) -> None:
    """The whole hand-off: produced, verified by a real watcher, consumed and read
    against its digest, acknowledged."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "consumers": ["g"],
                                 "entries": [{"file_id": "a", "path": "a"}]})
    baton_registry.watcher()
    with client.open_session("p", ttl=10) as session:
        with produce(client, session, "t", "a") as out:
            out.write(b"hello")
        baton_registry.wait_for(lambda: state(baton_registry) == pb.ENTRY_STATE_VERIFIED,
                                what="the watcher's verification")
        lease = client.consume("t", "g", "a", session=session)
        assert read_verified(lease) == b"hello"
        client.ack("t", "a", "g", lease.token, session=session)
    assert state(baton_registry) == pb.ENTRY_STATE_CONSUMED


def test_the_async_client_is_served_too(baton_registry: InProcessRegistry) -> None:
    one_entry(baton_registry)

    async def hand_off() -> int:
        async with baton_registry.async_client() as client, \
                await client.open_session("p", ttl=10) as session:
            claim = await session.claim("t", "a")
            entry = await session.commit("t", "a", claim.token, 0, EMPTY)
            return int(entry.state)

    assert asyncio.run(hand_off()) == pb.ENTRY_STATE_WRITTEN


def test_two_registries_do_not_share_anything(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    with serve(tmp_path / "1") as one, serve(tmp_path / "2") as two:
        one_entry(one)
        with pytest.raises(errors.NotFound):
            two.client.operator.get_entry("t", "a")
        one.advance(60)
        assert two.clock.ahead == 0


def test_time_only_moves_on(baton_registry: InProcessRegistry) -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="seconds ahead"):
            baton_registry.advance(bad)
    assert baton_registry.clock.ahead == 0
