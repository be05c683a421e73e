"""The registry's time-based promises on the test's clock (baton_relay.testing): each
test here is the twin of one that waits for real time on etcd (named in its
docstring), with the times a user would set (minutes, hours) passed by ``advance``.
The originals stay in the whole suite (``make test``); the fast tier runs these in
their place (``-m "not real_time"``)."""

from __future__ import annotations

import blake3
import pytest

from baton_relay.client import Client, Session
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.testing import InProcessRegistry

EMPTY = blake3.blake3(b"").hexdigest()
MINUTE, HOUR = 60, 3600


def entry(reg: InProcessRegistry, task: str = "t", file_id: str = "a") -> pb.Entry:
    return reg.client.operator.get_entry(task, file_id)


def written_and_verified(client: Client, session: Session, task: str = "t",
                         file_id: str = "a") -> None:
    claim = client.claim(task, file_id, session=session)
    client.commit(task, file_id, claim.token, 0, EMPTY, session=session)
    client.watcher.report(task, file_id, 0, EMPTY, reporter="test")


def test_a_hung_producer_loses_its_claim_at_a_ten_minute_deadline(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_deadlines.py::test_a_hung_producer_loses_its_claim_at_the_deadline."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True,
                                 "claim_deadline_seconds": 10 * MINUTE,
                                 "backoff": {"base_seconds": 30, "cap_seconds": 30},
                                 "entries": [{"file_id": "a", "path": "a"}]})
    with client.open_session("hung", ttl=30, slots=1) as session:
        claim = client.claim("t", "a", session=session)
        baton_registry.advance(10 * MINUTE - 1)
        assert entry(baton_registry).state == pb.ENTRY_STATE_WRITING
        baton_registry.advance(2)
        got = entry(baton_registry)
        assert got.state == pb.ENTRY_STATE_PENDING and got.retry_count == 1
        assert "claim deadline" in got.error
        assert client.operator.journal("t", "a")[-1].event == "deadline"
        with pytest.raises(errors.StaleToken):
            client.commit("t", "a", claim.token, 0, session=session)
        assert not session.lost.is_set()
        with pytest.raises(errors.IllegalTransition, match="retry backoff"):
            client.claim("t", "a", session=session)
        baton_registry.advance(30)  # the backoff; the freed slot takes the entry again
        again = client.claim("t", "a", session=session)
        client.commit("t", "a", again.token, 0, session=session)
    assert entry(baton_registry).state == pb.ENTRY_STATE_WRITTEN


def test_a_hung_consumer_gives_the_entry_back_at_a_fifteen_minute_deadline(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_deadlines.py::test_a_hung_consumer_gives_the_entry_back_to_its_group."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True, "consumers": ["g"],
                                 "entries": [{"file_id": "a", "path": "a",
                                              "consume_deadline_seconds": 15 * MINUTE}]})
    with client.open_session("p", ttl=30) as producer:
        written_and_verified(client, producer)
    with client.open_session("hung", ttl=30) as hung, \
            client.open_session("next", ttl=30) as other:
        lease = client.consume("t", "g", "a", session=hung)
        baton_registry.advance(15 * MINUTE - 1)
        with pytest.raises(errors.NothingToClaim):
            client.consume("t", "g", session=other)
        baton_registry.advance(2)
        assert client.operator.journal("t", "a")[-1].event == "deadline"
        with pytest.raises(errors.StaleToken):
            client.ack("t", "a", "g", lease.token, session=hung)
        taken = client.consume("t", "g", session=other)
        client.ack("t", "a", "g", taken.token, session=other)
    assert entry(baton_registry).state == pb.ENTRY_STATE_CONSUMED


def test_a_producer_silent_for_five_minutes_is_taken_back_as_stalled(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_stall.py::test_a_producer_that_stops_checkpointing_is_taken_back_as_stalled."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True,
                                 "stall_after_seconds": 5 * MINUTE,
                                 "entries": [{"file_id": "a", "path": "a"}]})
    with client.open_session("silent", ttl=30) as session:
        claim = client.claim("t", "a", session=session)
        session.checkpoint("t", "a", claim.token, progress=0.1)
        baton_registry.advance(5 * MINUTE - 1)
        assert entry(baton_registry).state == pb.ENTRY_STATE_WRITING
        baton_registry.advance(2)
        got = entry(baton_registry)
        assert got.retry_count == 1 and got.error.startswith("stalled")
        assert client.operator.journal("t", "a")[-1].event == "stalled"
        with pytest.raises(errors.StaleToken):
            client.commit("t", "a", claim.token, 0, session=session)
        assert not session.lost.is_set()
    assert baton_registry.running.stalls.stalled == 1


def test_a_producer_checkpointing_for_an_hour_is_left_alone(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_stall.py::test_a_slow_producer_that_keeps_checkpointing_is_left_alone:
    a checkpoint every four minutes of an hour, stall_after five minutes."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True,
                                 "entries": [{"file_id": "a", "path": "a",
                                              "stall_after_seconds": 5 * MINUTE}]})
    with client.open_session("slow", ttl=30) as session:
        claim = client.claim("t", "a", session=session)
        for step in range(15):
            session.checkpoint("t", "a", claim.token, progress=step / 15)
            baton_registry.advance(4 * MINUTE)
            assert entry(baton_registry).token == claim.token
        client.commit("t", "a", claim.token, 0, session=session)
    assert baton_registry.running.stalls.stalled == 0


def test_a_consumer_silent_past_its_stall_time_gives_the_entry_back(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_stall.py::test_a_stalled_consumer_gives_the_entry_back_to_its_group."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True, "consumers": ["g"],
                                 "stall_after_seconds": HOUR,
                                 "entries": [{"file_id": "a", "path": "a",
                                              "stall_after_seconds": 10 * MINUTE}]})
    with client.open_session("p", ttl=30) as producer:
        written_and_verified(client, producer)
    with client.open_session("silent", ttl=30) as silent, \
            client.open_session("next", ttl=30) as other:
        lease = client.consume("t", "g", "a", session=silent)
        baton_registry.advance(10 * MINUTE + 1)
        assert client.operator.journal("t", "a")[-1].event == "stalled"
        with pytest.raises(errors.StaleToken):
            client.ack("t", "a", "g", lease.token, session=silent)
        taken = client.consume("t", "g", session=other)
        client.ack("t", "a", "g", taken.token, session=other)
    assert entry(baton_registry).state == pb.ENTRY_STATE_CONSUMED


def test_a_delayed_fail_is_claimable_after_its_hour(baton_registry: InProcessRegistry) -> None:
    """Twin of test_error_kinds.py::test_delayed_fail_is_claimable_no_sooner_than_asked."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True, "max_retries": 3,
                                 "entries": [{"file_id": "a", "path": "a"}]})
    with client.open_session("p", ttl=30) as s:
        c = client.claim("t", session=s)
        failed = client.fail("t", "a", c.token, "rate limited", delay=HOUR, session=s)
        assert (failed.state, failed.retry_count) == (pb.ENTRY_STATE_PENDING, 1)
        baton_registry.advance(HOUR - 2)
        with pytest.raises(errors.NothingToClaim):
            client.claim("t", session=s)
        baton_registry.advance(3)
        assert client.claim("t", session=s).file_id == "a"


def test_a_delayed_nack_is_consumable_after_its_hour(baton_registry: InProcessRegistry) -> None:
    """Twin of test_error_kinds.py::test_delayed_nack_is_consumable_no_sooner_than_asked."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True, "consumers": ["g"],
                                 "entries": [{"file_id": "a", "path": "a"}]})
    with client.open_session("c", ttl=30) as s:
        written_and_verified(client, s)
        lease = client.consume("t", "g", session=s)
        client.nack("t", "a", "g", lease.token, "downstream full", delay=HOUR, session=s)
        baton_registry.advance(HOUR - 2)
        with pytest.raises(errors.NothingToClaim):
            client.consume("t", "g", session=s)
        assert "handed back to g at" in client.operator.explain("t", "a").text
        baton_registry.advance(3)
        again = client.consume("t", "g", session=s)
        assert again.file_id == "a"
        client.ack("t", "a", "g", again.token, session=s)
    events = [r.event for r in client.operator.journal("t", "a") if r.event != "consuming"]
    assert events[-3:] == ["nacked", "returned", "acked"]


def test_a_kept_alive_session_holds_its_claim_for_a_day(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_leases.py::test_keepalive_holds_claim_beyond_ttl: a 10 s lease, held
    through a day because its agent lives."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True,
                                 "entries": [{"file_id": "a", "path": "a"}]})
    with client.open_session("p", ttl=10) as s:
        claim = client.claim("t", session=s)
        for _ in range(4):
            baton_registry.advance(6 * HOUR)
            assert entry(baton_registry).token == claim.token
        assert client.commit("t", "a", claim.token, 0, EMPTY).state == pb.ENTRY_STATE_WRITTEN


def test_a_consumer_whose_agent_froze_hands_the_entry_back(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_leases.py::test_dead_consumer_returns_entry_to_group: its session's
    lease runs out while it is frozen (the clock not holding sessions)."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True,
                                 "entries": [{"file_id": "a", "path": "a"}]})
    with client.open_session("p", ttl=10) as s:
        written_and_verified(client, s)
    frozen = client.open_session("c1", ttl=30)
    lease = client.consume("t", "default", session=frozen)
    baton_registry.advance(31, hold_sessions=False)
    with client.open_session("c2", ttl=10) as s2:
        again = client.consume("t", "default", session=s2)
        assert again.file_id == "a" and again.token > lease.token
        with pytest.raises(errors.StaleToken):
            client.ack("t", "a", "default", lease.token)
        client.ack("t", "a", "default", again.token, session=s2)


def test_an_entry_waiting_long_enough_overtakes_a_higher_priority(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_handoff.py::test_aging_lets_a_long_waiting_entry_overtake, with aging of
    a minute a priority: "low" has waited ten minutes, more than the gap of nine."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "aging_seconds": MINUTE, "entries": [
        {"file_id": "low", "path": "low", "priority": 0},
        {"file_id": "high", "path": "high", "priority": 9}]})
    with client.open_session("p", ttl=10) as s:
        assert client.claim("t", session=s).file_id == "high"
        baton_registry.advance(10 * MINUTE)
        high = client.operator.get_entry("t", "high")
        client.fail("t", "high", high.token, "requeued later", release=True)
        # "high" is ready again, enqueued now; "low" has waited 10 minutes > 9 * 1 minute
        assert client.claim("t", session=s).file_id == "low"
        assert client.claim("t", session=s).file_id == "high"


def test_a_wait_shorter_than_the_gap_changes_nothing(
        baton_registry: InProcessRegistry) -> None:
    """The aging twin's counterpart: the same ten minutes, with aging of a day a
    priority, leave the higher priority first."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "aging_seconds": 86400, "entries": [
        {"file_id": "low", "path": "low", "priority": 0},
        {"file_id": "high", "path": "high", "priority": 9}]})
    with client.open_session("p", ttl=10) as s:
        assert client.claim("t", session=s).file_id == "high"
        baton_registry.advance(10 * MINUTE)
        high = client.operator.get_entry("t", "high")
        client.fail("t", "high", high.token, "requeued later", release=True)
        assert client.claim("t", session=s).file_id == "high"


def test_an_entry_written_and_never_verified_is_stuck_after_ten_minutes(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_deadlines.py::test_an_entry_written_and_never_verified_is_counted_and_
    named_as_stuck, at the default --stuck-written-after (600 s)."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "entries": [
        {"file_id": "a", "path": "a"}, {"file_id": "b", "path": "b"}]})
    with client.open_session("p", ttl=30) as s:
        for f in ("a", "b"):
            claim = client.claim("t", f, session=s)
            client.commit("t", f, claim.token, 0, EMPTY, session=s)
    client.watcher.report("t", "b", 0, EMPTY, reporter="test")
    baton_registry.advance(10 * MINUTE - 5)
    assert client.operator.get_task("t").stuck_written == 0
    baton_registry.advance(10)
    assert client.operator.get_task("t").stuck_written == 1
    assert "it is stuck" in client.operator.explain("t", "a").text
    assert "stuck" not in client.operator.explain("t", "b").text


def test_an_agent_gone_silent_loses_its_claim_when_its_lease_runs_out(
        baton_registry: InProcessRegistry) -> None:
    """Twin of test_leases.py::test_sigkilled_agent_entry_returns_to_pending: the agent
    keeps its session alive no more (killed); at its lease's end, not before, the entry
    is pending again, a retry spent, its token dead."""
    client = baton_registry.client
    client.operator.create_task({"task_id": "t", "digest_optional": True,
                                 "backoff": {"base_seconds": 0.001},
                                 "entries": [{"file_id": "a", "path": "a"}]})
    gone = client.open_session("killed", ttl=30, keepalive=False)
    claim = client.claim("t", "a", session=gone)
    baton_registry.advance(28, hold_sessions=False)
    assert entry(baton_registry).state == pb.ENTRY_STATE_WRITING
    baton_registry.advance(3, hold_sessions=False)
    got = entry(baton_registry)
    assert (got.state, got.retry_count, got.token) == (pb.ENTRY_STATE_PENDING, 1, 0)
    assert "lost" in got.error
    with pytest.raises(errors.StaleToken):
        client.commit("t", "a", claim.token, 0, EMPTY)
