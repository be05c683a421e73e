"""Leases give liveness, tokens give safety: lost agents, paused agents, dead consumers."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import pytest

from baton_relay.client import Client, Lease
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

#: a lost claim's entry is claimable again at once (the default backoff starts at 1 s)
FAST: dict[str, object] = {"backoff": {"base_seconds": 0.001}}
#: a well-formed digest for commits that publish no file (no watcher compares it)
DIGEST = "0" * 64


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` until true; the seconds it took. Fails after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")



@pytest.mark.real_time("test_on_the_clock.py::test_an_agent_gone_silent_loses_its_claim_when_its_lease_runs_out")
def test_sigkilled_agent_entry_returns_to_pending(client: Client, agent: Callable) -> None:  # type: ignore[type-arg]
    """An agent killed with SIGKILL: its entry is pending again within TTL + a margin."""
    ttl = 2
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}],
                                 **FAST})
    proc = agent("t1", ttl)
    claim = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITING
    killed = time.monotonic()
    proc.kill()
    wait_for(lambda: client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_PENDING, ttl + 3,
             "pending")
    # A lease is kept for its TTL after the last keepalive, at most ttl + margin after the kill.
    assert time.monotonic() - killed <= ttl + 3
    entry = client.operator.get_entry("t1", "a")
    assert entry.retry_count == 1 and "lost" in entry.error and entry.token == 0
    with pytest.raises(errors.StaleToken):
        client.commit("t1", "a", claim["token"], 1, DIGEST)


def test_paused_agent_cannot_commit_with_stale_token(client: Client, agent: Callable) -> None:  # type: ignore[type-arg]
    """An agent paused past its TTL wakes up to find its token refused."""
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}],
                                 **FAST})
    proc = agent("t1", 2)
    claim = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for(lambda: client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_PENDING, 6,
             "reap")
    # Someone else claims the entry meanwhile.
    with client.open_session("other", ttl=10) as s:
        fresh = client.claim("t1", "a", session=s)
        assert fresh.token > claim["token"]
        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.write("commit\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        outcome = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert outcome == {"ok": False, "error": outcome["error"]}
        assert outcome["error"] in ("StaleToken", "SessionExpired")
        entry = client.operator.get_entry("t1", "a")
        assert (entry.state == pb.ENTRY_STATE_WRITING and entry.owner == "other" and entry.token
                == fresh.token)
        assert client.commit("t1", "a", fresh.token, 1, DIGEST).state == pb.ENTRY_STATE_WRITTEN


def test_registry_refuses_token_of_expired_session_before_reap(
    registry_factory: Callable,  # type: ignore[type-arg]
) -> None:
    """Even before any reaper runs, a commit after the lease expired is refused."""
    slow = registry_factory(reap_interval=3600.0)
    with Client(slow.address) as c:
        c.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}],
                                **FAST})
        s = c.open_session("p", ttl=2, keepalive=False)
        claim = c.claim("t1", session=s)
        wait_for(lambda: c.operator.get_entry("t1", "a").token == 0, 6, "claim key to expire")
        with pytest.raises(errors.StaleToken):
            c.commit("t1", "a", claim.token, 1, DIGEST)
        assert c.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITING  # nobody reaped yet


def test_client_stops_trusting_lost_session(client: Client) -> None:
    """Once the lease is gone the client refuses to use the session at all."""
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}],
                                 **FAST})
    s = client.open_session("p", ttl=2)
    client.close_session(s.session_id)  # the lease dies behind the keepalive's back
    wait_for(s.lost.is_set, 5, "keepalive to notice")
    with pytest.raises(errors.SessionExpired):
        client.claim("t1", session=s)


@pytest.mark.real_time("test_on_the_clock.py::test_a_kept_alive_session_holds_its_claim_for_a_day")
def test_keepalive_holds_claim_beyond_ttl(client: Client) -> None:
    """A kept-alive session keeps its claim well past one TTL."""
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}],
                                 **FAST})
    with client.open_session("p", ttl=2) as s:
        claim = client.claim("t1", session=s)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # 2.5 TTLs, checking all along
            assert client.operator.get_entry("t1", "a").token == claim.token
            time.sleep(0.25)
        assert client.commit("t1", "a", claim.token, 1, DIGEST).state == pb.ENTRY_STATE_WRITTEN


@pytest.mark.real_time("test_on_the_clock.py::test_a_consumer_whose_agent_froze_hands_the_entry_back")
def test_dead_consumer_returns_entry_to_group(client: Client) -> None:
    """A consumer whose lease dies hands the entry back to its group."""
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}],
                                 **FAST})
    with client.open_session("p", ttl=10) as s:
        c = client.claim("t1", session=s)
        client.commit("t1", "a", c.token, 1, DIGEST)
        client.watcher.report("t1", "a", 1, DIGEST)
    dying = client.open_session("c1", ttl=2, keepalive=False)
    lease = client.consume("t1", "default", session=dying)
    with client.open_session("c2", ttl=10) as s2:
        got: list[Lease] = []

        def handed_back() -> bool:
            try:
                got.append(client.consume("t1", "default", session=s2))
                return True
            except errors.NothingToClaim:
                return False

        wait_for(handed_back, 6, "the entry to come back to the group")
        again = got[0]
        assert again.file_id == "a" and again.token > lease.token
        with pytest.raises(errors.StaleToken):
            client.ack("t1", "a", "default", lease.token)
        assert client.ack("t1", "a", "default", again.token).state == pb.ENTRY_STATE_CONSUMED


def test_lease_losses_exhaust_retries_to_dead(client: Client) -> None:
    """Each lost lease costs a retry; after max_retries the entry is dead, with history."""
    client.operator.create_task({"task_id": "t1", "max_retries": 1,
                                 "entries": [{"file_id": "a", "path": "a"}], **FAST})
    for expected in (pb.ENTRY_STATE_PENDING, pb.ENTRY_STATE_DEAD):
        s = client.open_session("p", ttl=10, keepalive=False)
        client.claim("t1", session=s)
        client.close_session(s.session_id)
        wait_for(lambda e=expected: client.operator.get_entry("t1", "a").state == e, 5, "reap")
    assert client.operator.get_entry("t1", "a").retry_count == 1
