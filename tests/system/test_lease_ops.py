"""SREs operate leases: rotate sessions onto fresh leases under load, revoke them, drain
a host; against a real etcd and a real registry, each test on its own prefix."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import blake3
import pytest
from registry_fixtures import TEST_RETRY, RegistryHandle, on_etcd
from test_cli import invoke, ok_json, one_error_line
from test_leases import wait_for

from baton_relay.client import Client, Session, consume_each, produce_each
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.rules.checks import SessionRecord
from baton_relay.registry.store.etcd import Put
from baton_relay.registry.verbs.leases import MOVE_CHUNK, Leases

#: a well-formed digest for commits that publish no file (the test reports it as watcher)
DIGEST = "0" * 64
T = TypeVar("T")


def manifest(task: str, n: int, **extra: Any) -> dict[str, Any]:
    return {"task_id": task, "entries": [{"file_id": f"e{i:04d}", "path": f"e{i:04d}"}
                                         for i in range(n)], **extra}


def in_registry(registry: RegistryHandle, body: Callable[[Leases], Awaitable[T]]) -> T:
    """Run ``body`` on the registry's own loop, with lease operations over its core."""
    leases = Leases(registry._running.core)
    return asyncio.run_coroutine_threadsafe(body(leases), registry._loop).result(60)


def claim_all(client: Client, session: Session, task: str, n: int) -> list[Any]:
    """``n`` claims of one session, a batch (one transaction) at a time."""
    claims: list[Any] = []
    while len(claims) < n:
        claims += client.claim_batch(task, n - len(claims), session=session)
    return claims


def journal_events(client: Client, task: str) -> dict[str, list[pb.JournalRecord]]:
    by_event: dict[str, list[pb.JournalRecord]] = defaultdict(list)
    for r in client.operator.journal(task):
        by_event[r.event].append(r)
    return by_event


def assert_nothing_reaped(registry: RegistryHandle, client: Client, *tasks: str) -> None:
    """No claim was ever free: the reaper moved nothing, no journal says a lease was lost."""
    assert registry.reaper.reaped == 0
    for task in tasks:
        lost = [r for r in client.operator.journal(task) if "lost" in r.reason or "lost" in r.event]
        assert lost == [], lost



# --- rotate -----------------------------------------------------------------------------


def test_rotation_under_load_frees_no_claim(registry: RegistryHandle, client: Client,
                                            agent: Callable[..., Any]) -> None:
    """Agents produce and consume while every lease is rotated over and over (one agent
    SIGSTOPped across rotations, within its TTL): every entry is committed once, by the
    token it was claimed with, and consumed; no agent errs; the reaper moves nothing."""
    n, stop = 240, threading.Event()
    client.operator.create_task(manifest("t", n, consumers=["c"]))
    client.operator.create_task(manifest("p", 1))
    committed: dict[str, list[int]] = defaultdict(list)
    claimed: dict[str, int] = {}
    acked: list[str] = []
    failures: list[str] = []
    lock = threading.Lock()

    def producer(name: str) -> None:
        try:
            with Client(registry.address, retry=TEST_RETRY) as c, \
                    c.open_session(name, ttl=3) as s:
                while not stop.is_set():
                    try:
                        claim = c.claim("t", session=s)
                    except errors.NothingToClaim:
                        return
                    with lock:
                        claimed[claim.file_id] = claim.token
                    c.commit("t", claim.file_id, claim.token, 1, DIGEST, session=s)
                    with lock:
                        committed[claim.file_id].append(claim.token)
                    c.watcher.report("t", claim.file_id, 1, DIGEST)  # as the watcher would
        except errors.BatonError as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")

    def consumer(name: str) -> None:
        try:
            with Client(registry.address, retry=TEST_RETRY) as c, \
                    c.open_session(name, ttl=3) as s:
                while not stop.is_set() and len(acked) < n:
                    try:
                        lease = c.consume("t", "c", session=s)
                    except errors.NothingToClaim:
                        time.sleep(0.01)
                        continue
                    c.ack("t", lease.file_id, "c", lease.token, session=s)
                    with lock:
                        acked.append(lease.file_id)
        except errors.BatonError as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")

    paused = agent("p", 10)
    paused_claim = json.loads(paused.stdout.readline())
    threads = [threading.Thread(target=producer, args=(f"prod-{i}",)) for i in range(3)]
    threads += [threading.Thread(target=consumer, args=(f"cons-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    rounds, stopped_at = 0, 0.0
    moved_sessions: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while (rounds < 20 or any(t.is_alive() for t in threads)) and (
                time.monotonic() < deadline):
            if rounds == 2:
                os.kill(paused.pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
            if stopped_at and (rounds == 14 or time.monotonic() - stopped_at > 5):
                os.kill(paused.pid, signal.SIGCONT)
                stopped_at = 0.0
            for r in client.operator.rotate_leases(every=True):
                assert r.old_lease != r.new_lease and r.transactions == 1
                moved_sessions.add(r.session_id)
            rounds += 1
    finally:
        stop.set()
        if stopped_at:
            os.kill(paused.pid, signal.SIGCONT)
        for t in threads:
            t.join(30)
    assert failures == []
    assert rounds >= 20 and len(moved_sessions) >= 6
    # The paused agent's token outlived every rotation it slept through.
    paused.stdin.write("commit\n")
    paused.stdin.flush()
    assert json.loads(paused.stdout.readline()) == {"ok": True, "state": pb.ENTRY_STATE_WRITTEN}
    (commit,) = journal_events(client, "p")["committed"]
    assert commit.token == paused_claim["token"]
    entries = client.operator.list_entries("t")
    assert sorted(e.file_id for e in entries if e.state
                  == pb.ENTRY_STATE_CONSUMED) == sorted(claimed)
    assert len(claimed) == n and sorted(acked) == sorted(claimed)
    assert all(tokens == [claimed[f]] for f, tokens in committed.items())
    commits = journal_events(client, "t")["committed"]
    assert sorted((r.file_id, r.token) for r in commits) == sorted(claimed.items())
    with pytest.raises(errors.StaleToken):  # a token used once is dead
        client.commit("t", "e0000", claimed["e0000"], 1, DIGEST)
    assert_nothing_reaped(registry, client, "t", "p")


def rotate_every(client: Client, period: float, until: Callable[[], bool],
                 deadline: float, what: str) -> int:
    """Rotate every session's lease each ``period`` seconds (an SRE's timer) until
    ``until()``; how many rotations the registry made. Fails past ``deadline``
    (``time.monotonic()``)."""
    rotated = 0
    tick = time.monotonic()
    while not until():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not so by the deadline, after {rotated} rotations")
        rotated += len(client.operator.rotate_leases(every=True))
        tick += period
        # The timer's cadence, not a wait for a condition: that is ``until``.
        time.sleep(max(0.0, tick - time.monotonic()))
    return rotated


def test_rotations_never_keep_a_killed_agent_alive(registry: RegistryHandle, client: Client,
                                                   agent: Callable[..., Any]) -> None:
    """An agent SIGKILLed while holding a claim, its lease rotated every second: its
    session and claim die within its TTL (and a margin) of the kill, as without the
    rotations, and another agent claims the entry."""
    ttl = 4
    client.operator.create_task({"task_id": "t", "entries": [{"file_id": "a", "path": "a"}],
                                 "backoff": {"base_seconds": 0.001}})
    proc = agent("t", ttl)
    claim = json.loads(proc.stdout.readline())
    (session,) = [a.session_id for a in client.operator.list_agents()]
    proc.kill()
    killed = time.monotonic()
    proc.wait()

    def gone() -> bool:
        return all(a.session_id != session for a in client.operator.list_agents())

    # Its last keepalive came before the kill: the lease ends at most a TTL after it.
    rotated = rotate_every(client, 1.0, gone, killed + ttl + 1.5, "the killed agent's "
                           "session gone within its TTL")
    assert rotated >= 1  # a rotation did happen while it was dying
    assert client.operator.get_entry("t", "a").token == 0  # the claim went with the lease
    wait_for(lambda: client.operator.get_entry("t", "a").state == pb.ENTRY_STATE_PENDING, 5,
             "the reaper")
    with client.open_session("other", ttl=10) as s:
        fresh = client.claim("t", "a", session=s)
        assert fresh.token > claim["token"]
        assert client.commit("t", "a", fresh.token, 1, DIGEST,
                             session=s).state == pb.ENTRY_STATE_WRITTEN
    with pytest.raises(errors.StaleToken):
        client.commit("t", "a", claim["token"], 1, DIGEST)


def test_a_live_agent_keeps_its_claim_and_ttl_through_rotations(registry: RegistryHandle,
                                                                 client: Client) -> None:
    """A kept-alive session rotated twice a second for several TTLs keeps its claim and
    token; each keepalive after a rotation gives it its full TTL again (so it is rotated
    again and again, not just once), and it is left on a lease of its own TTL."""
    ttl = 3
    client.operator.create_task(manifest("t", 1))
    with client.open_session("live", ttl=ttl) as s:
        claim = client.claim("t", session=s)
        until = time.monotonic() + 3 * ttl
        rotated = rotate_every(client, 0.5, lambda: time.monotonic() > until, until + 30,
                               "three TTLs of rotations")
        assert rotated >= 4, rotated
        assert client.operator.get_entry("t", "e0000").token == claim.token

        def full() -> bool:
            (info,) = client.operator.list_agents()
            left, granted = on_etcd(registry.etcd, lambda e: e.lease_times(info.lease_id))
            return granted == ttl and left > 0 and info.granted_ttl == ttl

        wait_for(full, 2 * ttl, "a keepalive to renew the session onto its full TTL")
        assert s.ttl == ttl and not s.lost.is_set()
        assert client.commit("t", "e0000", claim.token, 1, DIGEST, session=s).state == \
            pb.ENTRY_STATE_WRITTEN
    assert_nothing_reaped(registry, client, "t")


def test_rotation_of_more_keys_than_one_transaction_moves_them_in_chunks(
        registry: RegistryHandle, client: Client) -> None:
    """300 claims do not fit one transaction: they move in chunks while both leases
    live, the old lease is revoked, and every token still commits."""
    client.operator.create_task(manifest("t", 300))
    with client.open_session("bulk", ttl=20) as s:
        claims = claim_all(client, s, "t", 300)
        (before,) = [a.lease_id for a in client.operator.list_agents()
                     if a.session_id == s.session_id]
        (r,) = client.operator.rotate_leases(s.session_id, ttl=15)
        assert (r.old_lease, r.keys_moved, r.ttl) == (before, 300, 15)
        assert r.transactions == -(-300 // MOVE_CHUNK) > 1
        (info,) = [a for a in client.operator.list_agents() if a.session_id == s.session_id]
        assert info.lease_id == r.new_lease and info.granted_ttl == 15 and len(info.claims) == 300
        ttl, keys = on_etcd(registry.etcd, lambda e: e.lease_keys(r.old_lease))
        assert (ttl, keys) == (-1, [])
        wait_for(lambda: s.ttl == 15, 10, "the keepalive to adopt the new TTL")
        for c in claims:
            client.commit("t", c.file_id, c.token, 1, DIGEST, session=s)
    assert {e.state for e in client.operator.list_entries("t")} == {pb.ENTRY_STATE_WRITTEN}
    assert_nothing_reaped(registry, client, "t")


def test_an_interrupted_rotation_is_finished_by_a_rerun(registry: RegistryHandle,
                                                        client: Client) -> None:
    """A rotation stopped after its first chunk leaves both leases alive (keepalive
    refreshes both); `rotate` again finishes the move and revokes the old lease."""
    client.operator.create_task(manifest("t", 300))
    with client.open_session("bulk", ttl=20) as s:
        claims = claim_all(client, s, "t", 300)

        async def half(leases: Leases) -> tuple[int, int]:
            kv = await leases.core.etcd.get(leases.keys.agent(s.session_id))
            assert kv is not None
            record = await leases.begin_rotation(SessionRecord.of(kv, s.session_id), 20)
            assert record is not None
            moved, _ = await leases.move_keys(record, limit=1)
            return record.rotating_from, moved

        old, moved = in_registry(registry, half)
        assert moved == MOVE_CHUNK
        # The new lease has what the old one had left (whole seconds), not a fresh TTL.
        assert 0 < client.keepalive(s.session_id) < 20
        ttl, keys = on_etcd(registry.etcd, lambda e: e.lease_keys(old))
        assert ttl > 0 and len(keys) == 300 - MOVE_CHUNK
        (r,) = client.operator.rotate_leases(s.session_id)
        assert r.old_lease == old and r.keys_moved == 300 - MOVE_CHUNK
        assert on_etcd(registry.etcd, lambda e: e.lease_keys(old)) == (-1, [])
        for c in claims:
            client.commit("t", c.file_id, c.token, 1, DIGEST, session=s)
    assert_nothing_reaped(registry, client, "t")


# --- revoke -----------------------------------------------------------------------------


def test_revoke_returns_claims_at_once_without_spending_a_retry(
        registry: RegistryHandle, client: Client) -> None:
    """Revoked: claims pending again at once, retry_count unchanged, journal `revoked`
    with who and why; the token is refused; the session is lost to its agent."""
    client.operator.create_task(manifest("t", 4, consumers=["c"]))
    holder = client.open_session("rev-a", ttl=30, keepalive=False)
    claims = client.claim_batch("t", 3, session=holder)
    (r,) = client.operator.revoke_sessions(holder.session_id, reason="node maintenance")
    assert (r.session_id, r.agent, r.claims_returned) == (holder.session_id, "rev-a", 3)
    for c in claims:
        entry = client.operator.get_entry("t", c.file_id)
        assert (entry.state, entry.retry_count, entry.not_before) == (pb.ENTRY_STATE_PENDING, 0, "")
        with pytest.raises(errors.StaleToken):
            client.commit("t", c.file_id, c.token, 1, DIGEST)
    revoked = journal_events(client, "t")["revoked"]
    assert sorted(x.file_id for x in revoked) == sorted(c.file_id for c in claims)
    assert {(x.who, x.reason, x.from_state, x.to_state) for x in revoked} == {
        ("operator", "node maintenance", "writing", "pending")}
    with pytest.raises(errors.SessionExpired):
        client.keepalive(holder.session_id)
    assert not [a for a in client.operator.list_agents() if a.session_id == holder.session_id]
    # The entries are claimable again, at once.
    with client.open_session("rev-b", ttl=30) as s:
        assert len(client.claim_batch("t", 4, session=s)) == 4
    assert_nothing_reaped(registry, client, "t")


def test_revoke_by_agent_and_by_host(registry: RegistryHandle, client: Client) -> None:
    """`lease revoke --agent NAME` and `--host HOST` revoke every matching session; a
    consume-claim goes back to its group."""
    client.operator.create_task(manifest("t", 3, consumers=["c"]))
    with client.open_session("maker", ttl=30) as s:
        c0 = client.claim("t", "e0000", session=s)
        client.commit("t", "e0000", c0.token, 1, DIGEST, session=s)
    client.watcher.report("t", "e0000", 1, DIGEST)
    eater = client.open_session("eater", ttl=30, keepalive=False)
    lease = client.consume("t", "c", session=eater)
    on_host = [client.open_session(f"w{i}", ttl=30, keepalive=False, host="rack-7")
               for i in range(2)]
    client.claim("t", "e0001", session=on_host[0])
    client.claim("t", "e0002", session=on_host[1])

    by_agent = invoke(registry, "lease", "revoke", "--agent", "eater", "--reason", "oom")
    assert by_agent.exit_code == 0 and "(claims returned: 1)" in by_agent.stdout, by_agent.output
    with pytest.raises(errors.StaleToken):
        client.ack("t", lease.file_id, "c", lease.token)
    with client.open_session("eater-2", ttl=30) as s:
        again = client.consume("t", "c", session=s)
        assert again.file_id == "e0000"  # back to its group
        # acked before the session closes: a claim left on it would be the reaper's
        client.ack("t", again.file_id, "c", again.token)
    revoked = [r for r in client.operator.journal("t", "e0000") if r.event == "revoked"]
    assert [(r.group, r.reason, r.to_state) for r in revoked] == [("c", "oom", "verified")]

    by_host = ok_json(invoke(registry, "lease", "revoke", "--host", "rack-7", "-o", "json"))
    assert sorted((x["session"], x["claims_returned"]) for x in by_host) == sorted(
        (str(s.session_id), 1) for s in on_host)
    assert {e.state for e in client.operator.list_entries("t") if e.file_id
            != "e0000"} == {pb.ENTRY_STATE_PENDING}
    assert_nothing_reaped(registry, client, "t")


def test_a_revoke_interrupted_after_marking_is_finished_by_a_rerun(
        registry: RegistryHandle, client: Client) -> None:
    """A session marked revoked takes no new claim and no keepalive; revoking it again
    returns its claims and revokes its lease."""
    client.operator.create_task(manifest("t", 3))
    s = client.open_session("half", ttl=30, keepalive=False)
    claims = client.claim_batch("t", 2, session=s)

    async def mark(leases: Leases) -> None:
        key = leases.keys.agent(s.session_id)
        kv = await leases.core.etcd.get(key)
        assert kv is not None
        value = SessionRecord.of(kv, s.session_id).with_info(revoked={"by": "x", "reason": "y"})
        await leases.core.etcd.txn([], [Put(key, value, lease=kv.lease)])

    in_registry(registry, mark)
    with pytest.raises(errors.SessionExpired):
        client.claim("t", session=s)
    with pytest.raises(errors.SessionExpired):
        client.keepalive(s.session_id)
    (r,) = client.operator.revoke_sessions(s.session_id, reason="again")
    assert r.claims_returned == 2
    assert {client.operator.get_entry("t",
                                      c.file_id).state for c in claims} == {pb.ENTRY_STATE_PENDING}


# --- drain ------------------------------------------------------------------------------


def test_drain_refuses_new_work_then_revokes_what_is_left_at_the_deadline(
        registry: RegistryHandle, client: Client) -> None:
    """A host holding 200 claims is drained: new claims are refused with Draining (a
    session opened there later too), commits before the deadline succeed, the
    registry revokes the rest at the deadline; nothing is lost; undrain lets work in."""
    client.operator.create_task(manifest("t", 220))
    worker = client.open_session("dx-1", ttl=10, host="drain-x")
    idle = client.open_session("dx-2", ttl=3, host="drain-x")
    claims = claim_all(client, worker, "t", 200)
    reply = client.operator.drain_host("drain-x", deadline=4, reason="kernel upgrade")
    assert (reply.sessions, reply.claims) == (2, 200)
    with pytest.raises(errors.Draining) as refused:
        client.claim("t", session=worker)
    assert refused.value.exit_code == 8 and worker.draining
    wait_for(lambda: idle.draining, 5, "a keepalive to say the session is draining")
    late = client.open_session("dx-3", ttl=10, host="drain-x", keepalive=False)
    with pytest.raises(errors.Draining):
        client.consume("t", "default", session=late)
    assert client.refresh_session(late.session_id).draining
    rows = {r["session"]: r for r in ok_json(invoke(registry, "lease", "ls", "-o", "json"))}
    assert rows[str(worker.session_id)]["draining"] is True
    for c in claims[:50]:  # in flight: may finish before the deadline
        client.commit("t", c.file_id, c.token, 1, DIGEST, session=worker)
    wait_for(lambda: not [a for a in client.operator.list_agents() if a.host == "drain-x"], 15,
             "the registry's sweep to revoke the drained host's sessions")
    states = [e.state for e in client.operator.list_entries("t")]
    assert (states.count(pb.ENTRY_STATE_WRITTEN), states.count(pb.ENTRY_STATE_PENDING)) == (50, 170)
    assert {e.retry_count for e in client.operator.list_entries("t")} == {0}
    revoked = journal_events(client, "t")["revoked"]
    assert len(revoked) == 150 and {r.reason for r in revoked} == {"drain deadline"}
    with pytest.raises(errors.StaleToken):
        client.commit("t", claims[60].file_id, claims[60].token, 1, DIGEST)
    assert invoke(registry, "lease", "undrain", "--host", "drain-x").exit_code == 0
    with client.open_session("dx-4", ttl=10, host="drain-x") as s:
        assert client.claim("t", session=s).entry.state == pb.ENTRY_STATE_WRITING
        assert not s.draining
    assert_nothing_reaped(registry, client, "t")


def test_the_producer_helper_stops_cleanly_when_its_host_drains(
        registry: RegistryHandle, client: Client) -> None:
    """`produce_each` one at a time finishes the entry in hand, then ends without an
    error."""
    client.operator.create_task(manifest("t", 10, digest_optional=True))
    done = []
    with client.open_session("helper", ttl=10, host="drain-y") as s:
        for out in produce_each(client, s, "t", ahead=1):
            out.write(b"page")
            done.append(out.claim.file_id)
            if len(done) == 3:
                client.operator.drain_host("drain-y", deadline=60)
        assert s.draining
    states = {e.file_id: e.state for e in client.operator.list_entries("t")}
    assert sorted(f for f, st in states.items() if st == pb.ENTRY_STATE_WRITTEN) == sorted(done)
    assert len(done) == 3 and list(states.values()).count(pb.ENTRY_STATE_PENDING) == 7


def test_a_producer_loop_working_ahead_stops_at_its_next_step_once_drained(
        registry: RegistryHandle, client: Client) -> None:
    """Working ahead, `produce_each` learns of the drain at its next step: it finishes
    at most the entries it had claimed ahead, commits what it wrote, gives the rest
    back (no retry spent) and ends without an error; no claim is left."""
    client.operator.create_task(manifest("t", 40, digest_optional=True))
    done = []
    with client.open_session("helper", ttl=10, host="drain-z") as s:
        for out in produce_each(client, s, "t", ahead=8, linger=5.0):
            out.write(b"page")
            done.append(out.claim.file_id)
            if len(done) == 3:
                client.operator.drain_host("drain-z", deadline=60)
        assert s.draining
    entries = client.operator.list_entries("t")
    written = sorted(e.file_id for e in entries if e.state == pb.ENTRY_STATE_WRITTEN)
    assert written == sorted(done) and 3 <= len(done) <= 3 + 8
    rest = [e for e in entries if e.state != pb.ENTRY_STATE_WRITTEN]
    assert len(rest) == 40 - len(done)
    assert all(e.state == pb.ENTRY_STATE_PENDING and e.retry_count == 0 for e in rest)


def test_the_consumer_helper_stops_cleanly_when_its_host_drains(
        registry: RegistryHandle, client: Client) -> None:
    """`consume_each` acks the entry in hand, then ends without an error."""
    client.operator.create_task(manifest("t", 4, consumers=["g"], digest_optional=True))
    with client.open_session("maker", ttl=10) as s:
        for c in client.claim_batch("t", 4, session=s):
            write_file(c.path, b"page")
            client.commit("t", c.file_id, c.token, 4, session=s)
            client.watcher.report("t", c.file_id, 4, blake3.blake3(b"page").hexdigest())
    done = []
    with client.open_session("reader", ttl=10, host="drain-z") as s:
        for delivery in consume_each(client, s, "t", "g", timeout=5):
            assert delivery.data == b"page"
            done.append(delivery.lease.file_id)
            if len(done) == 2:
                client.operator.drain_host("drain-z", deadline=60)
        assert s.draining
    consumed = [e.file_id for e in client.operator.list_entries("t")
                if e.state == pb.ENTRY_STATE_CONSUMED]
    assert len(done) == 2 and sorted(consumed) == sorted(done)


def write_file(path: str, data: bytes) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)


def test_drain_cli_waits_for_the_claims_to_go_and_refused_claims_exit_8(
        registry: RegistryHandle, client: Client) -> None:
    """`baton claim` on a drained host exits 8; `lease drain` waits until the host holds
    nothing (here: the deadline's sweep), then says so."""
    client.operator.create_task(manifest("t", 3))
    here = socket.gethostname()
    held = client.open_session("cli-1", ttl=20, keepalive=False)
    client.claim("t", session=held)
    start = time.monotonic()
    drained = invoke(registry, "lease", "drain", "--host", here, "--deadline", "2")
    assert drained.exit_code == 0, drained.output
    assert time.monotonic() - start >= 1.5
    assert drained.stdout.splitlines()[-1] == f"host {here} drained: no claims left"
    assert f"{here}: claims left 1 (sessions 1)" in drained.stderr
    refused = invoke(registry, "claim", "t")
    assert refused.exit_code == 8 and "drained" in one_error_line(refused.stderr)
    assert invoke(registry, "lease", "undrain", "--host", here).exit_code == 0
    assert invoke(registry, "claim", "t").exit_code == 0


# --- the CLI ----------------------------------------------------------------------------


def test_lease_ls_and_show(registry: RegistryHandle, client: Client) -> None:
    """`lease ls` has one row per session with exactly its documented fields; `lease
    show` adds each claim; `agents` is `lease ls`; bad input has its exit status."""
    client.operator.create_task(manifest("t", 3, consumers=["g"]))
    s = client.open_session("lister", ttl=30, keepalive=False, host="h-1")
    claim = client.claim("t", "e0001", session=s)
    rows = ok_json(invoke(registry, "lease", "ls", "-o", "json"))
    (row,) = rows
    assert list(row) == ["session", "agent", "host", "pid", "ttl", "ttl_left", "claims",
                         "draining"]
    assert (row["session"], row["agent"], row["host"], row["pid"], row["ttl"], row["claims"],
            row["draining"]) == (str(s.session_id), "lister", "h-1", os.getpid(), 30, 1, False)
    assert 0 < row["ttl_left"] <= 30
    assert ok_json(invoke(registry, "agents", "-o", "json")) == rows
    table = invoke(registry, "lease", "ls")
    assert table.exit_code == 0
    header = next(line for line in table.stdout.splitlines() if "session" in line)
    assert header.split()[1::2] == ["session", "agent", "host", "pid", "ttl", "ttl_left",
                                    "claims", "draining"]
    shown = ok_json(invoke(registry, "lease", "show", str(s.session_id), "-o", "json"))
    (c,) = shown["claims"]
    assert (c["task"], c["file_id"], c["kind"], c["token"]) == ("t", "e0001", "produce",
                                                                 claim.token)
    assert 0 <= c["held"] < 30 and c["claimed_at"].endswith("Z")
    assert shown["lease"] == str(s.session_id)  # not rotated yet: its first lease
    text = invoke(registry, "lease", "show", str(s.session_id))
    assert text.exit_code == 0 and "e0001" in text.stdout and "produce" in text.stdout
    assert invoke(registry, "lease", "show", "12345").exit_code == 5
    assert invoke(registry, "lease", "revoke").exit_code == 2
    assert invoke(registry, "lease", "rotate", "1", "--all").exit_code == 2
    rotated = ok_json(invoke(registry, "lease", "rotate", "--all", "--ttl", "20", "-o", "json"))
    assert [(r["session"], r["ttl"], r["keys_moved"]) for r in rotated] == [
        (str(s.session_id), 20, 1)]
    after = ok_json(invoke(registry, "lease", "show", str(s.session_id), "-o", "json"))
    assert after["lease"] == rotated[0]["new_lease"] and after["ttl"] == 20
    assert after["claims"][0]["token"] == claim.token
