"""Hand-off semantics: fan-out, dependencies, retries and dead letters, priorities,
batches, pause/cancel, slots, idempotency, journal and explain, assemblies, completion."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Any

import blake3
import pytest
from registry_fixtures import RegistryHandle

from baton_relay.client import Client, Session
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.sweeps.scheduler import assembly_digest

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

FAST = {"base_seconds": 0.001}


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


#: the digest of a one-byte file b"x": commits here publish no file and no watcher looks
X = digest(b"x")


def entries(*ids: str, **fields: Any) -> list[dict[str, Any]]:
    return [{"file_id": i, "path": i, **fields} for i in ids]


def produce_verified(client: Client, s: Session, task: str, file_id: str = "",
                     data: bytes = b"x") -> str:
    """Claim, commit and verify one entry (what producer + watcher do); its file id."""
    c = client.claim(task, file_id, session=s)
    client.commit(task, c.file_id, c.token, len(data), digest(data))
    client.watcher.report(task, c.file_id, len(data), digest(data))
    return c.file_id


def wait_for(condition: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def claim_soon(client: Client, s: Session, task: str, timeout: float = 5.0) -> Any:
    def attempt() -> Any:
        try:
            return client.claim(task, session=s)
        except errors.NothingToClaim:
            return None
    return wait_for(attempt, timeout)


# 1. fan-out and queues ---------------------------------------------------------

def test_every_group_gets_every_entry_one_agent_at_a_time(client: Client) -> None:
    """Across groups every entry is broadcast; within a group each goes to one agent."""
    client.operator.create_task({"task_id": "t", "consumers": ["index", "archive"],
                                 "entries": entries("a", "b", "c")})
    with client.open_session("p", ttl=10) as s:
        for _ in range(3):
            produce_verified(client, s, "t")
        taken: dict[str, list[str]] = {"index": [], "archive": []}
        for group in taken:
            for agent in ("x", "y", "z"):
                with client.open_session(agent, ttl=10) as a:
                    lease = client.consume("t", group, session=a)
                    taken[group].append(lease.file_id)
                    client.ack("t", lease.file_id, group, lease.token)
        assert sorted(taken["index"]) == sorted(taken["archive"]) == ["a", "b", "c"]
        task = client.operator.get_task("t")
        assert dict(task.consumed_by_group) == {"index": 3, "archive": 3}
        assert task.states["consumed"] == 3


def test_entry_consumers_override_the_task_default(client: Client) -> None:
    """An entry naming its own consumer groups is offered to those groups only."""
    client.operator.create_task({"task_id": "t", "consumers": ["g1"], "entries": [
        {"file_id": "a", "path": "a", "consumers": ["g2"]}]})
    with client.open_session("p", ttl=10) as s:
        produce_verified(client, s, "t")
        with pytest.raises(errors.NothingToClaim):
            client.consume("t", "g1", session=s)
        assert client.consume("t", "g2", session=s).file_id == "a"


# 2. dependencies --------------------------------------------------------------

def test_dead_dependency_blocks_dependents_visibly(client: Client) -> None:
    """A dependency that dies makes its dependents blocked, in status and explain."""
    client.operator.create_task({"task_id": "t", "max_retries": 0, "entries": [
        {"file_id": "base", "path": "base"},
        {"file_id": "top", "path": "top", "depends_on": ["base"]}]})
    with client.open_session("p", ttl=10) as s:
        c = client.claim("t", session=s)
        client.fail("t", c.file_id, c.token, "broken input")
    assert client.operator.get_task("t").blocked == 1
    text = client.operator.explain("t", "top").text
    assert "blocked" in text and "base" in text


# 3. retries, backoff, dead letters ----------------------------------------------------

def test_retry_waits_for_exponential_backoff(client: Client) -> None:
    """A failed entry is not claimable before its backoff ends; delays grow by the factor."""
    client.operator.create_task({"task_id": "t", "max_retries": 5,
                                 "backoff": {"base_seconds": 0.4, "factor": 2, "cap_seconds": 10},
                                 "entries": entries("a")})
    with client.open_session("p", ttl=30) as s:
        delays = []
        for _ in range(2):
            c = claim_soon(client, s, "t", timeout=10)
            failed_at = time.time()
            entry = client.fail("t", "a", c.token, "flaky")
            assert entry.state == pb.ENTRY_STATE_PENDING and entry.not_before
            with pytest.raises(errors.IllegalTransition, match="backoff"):
                client.claim("t", "a", session=s)
            due = datetime.fromisoformat(entry.not_before.replace("Z", "+00:00")).timestamp()
            delays.append(due - failed_at)
        # jitter keeps each delay within [delay/2, delay]: 0.4 s, then 0.8 s
        assert 0.15 <= delays[0] <= 0.45 and 0.35 <= delays[1] <= 0.85


def test_dead_keeps_history_and_requeue_restores_budget(client: Client) -> None:
    """After max_retries the entry is dead with its attempts in the journal; requeue revives it."""
    client.operator.create_task({"task_id": "t", "max_retries": 1, "backoff": FAST,
                                 "entries": entries("a")})
    with client.open_session("p", ttl=10) as s:
        for reason in ("first", "second"):
            c = claim_soon(client, s, "t")
            client.fail("t", "a", c.token, reason)
        assert client.operator.get_entry("t", "a").state == pb.ENTRY_STATE_DEAD
        failures = [r.reason for r in client.operator.journal("t", "a") if r.event == "failed"]
        assert len(failures) == 2 and "second" in failures[-1]
        entry = client.operator.requeue("t", "a")
        assert (entry.state, entry.retry_count) == (pb.ENTRY_STATE_PENDING, 0)
        assert claim_soon(client, s, "t").file_id == "a"
        with pytest.raises(errors.IllegalTransition):
            client.operator.requeue("t", "a")  # only dead entries


# 4. priorities with aging -------------------------------------------------------------

def test_highest_priority_first_then_oldest(client: Client) -> None:
    """A lone claimer gets entries by priority, then in the order they became ready."""
    ids = [f"p{p}-{n}" for p in (3, 9, 0, 5) for n in range(2)]
    client.operator.create_task({"task_id": "t", "entries": [
        {"file_id": i, "path": i, "priority": int(i[1])} for i in ids]})
    with client.open_session("p", ttl=10) as s:
        order = [client.claim("t", session=s).file_id for _ in ids]
    assert [int(i[1]) for i in order] == [9, 9, 5, 5, 3, 3, 0, 0]


def test_aging_lets_a_long_waiting_entry_overtake(
        registry: RegistryHandle, client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry that waited longer than (priority gap * aging) goes before a newer higher one."""
    # The registry's wall clock (Core.clock) 0.6 s behind while the entries are made, then
    # right again: by it, "low" has waited 0.6 s > 9 * 0.05 s when "high" is requeued.
    # (Set back, not forward: the sweeps' alarms keep the clock they started with.)
    core = registry._running.core
    wall = core.clock
    monkeypatch.setattr(core, "clock", lambda: wall() - 0.6)
    client.operator.create_task({"task_id": "t", "aging_seconds": 0.05, "entries": [
        {"file_id": "low", "path": "low", "priority": 0},
        {"file_id": "high", "path": "high", "priority": 9}]})
    monkeypatch.setattr(core, "clock", wall)
    with client.open_session("p", ttl=10) as s:
        high = client.claim("t", session=s)
        assert high.file_id == "high"
        # Given back unbegun: ready again at once, enqueued now. (A failed entry would
        # wait in the delayed index, which a claim reads after the ready one: "low"
        # would come first whatever the aging.)
        client.fail("t", "high", high.token, "requeued later", release=True)
        assert client.claim("t", session=s).file_id == "low"
        assert client.claim("t", session=s).file_id == "high"


# 5. batches ------------------------------------------------------------------

def test_batch_claim_and_commit(client: Client) -> None:
    """A batch claim takes up to the per-transaction limit, all distinct; commit_batch commits."""
    client.operator.create_task({"task_id": "t",
                                 "entries": entries(*(f"e{i:02d}" for i in range(30)))})
    with client.open_session("p", ttl=10) as s:
        claims = client.claim_batch("t", 25, session=s)
        assert len(claims) == 21 and len({c.file_id for c in claims}) == 21
        assert len({c.token for c in claims}) == 1  # one transaction
        done = client.commit_batch([("t", c.file_id, c.token, 1, X) for c in claims])
        assert {e.state for e in done} == {pb.ENTRY_STATE_WRITTEN}
        rest = client.claim_batch("t", 25, session=s)
        assert len(rest) == 9


def test_commit_batch_is_all_or_nothing(client: Client) -> None:
    """One stale token in a batch refuses the whole batch and changes nothing."""
    client.operator.create_task({"task_id": "t", "entries": entries("a", "b", "c")})
    with client.open_session("p", ttl=10) as s:
        claims = client.claim_batch("t", 3, session=s)
        batch = [("t", c.file_id, c.token, 1, X) for c in claims]
        batch[1] = (batch[1][0], batch[1][1], batch[1][2] - 1, 1, X)
        with pytest.raises(errors.StaleToken):
            client.commit_batch(batch)
        assert {e.state for e in client.operator.list_entries("t")} == {pb.ENTRY_STATE_WRITING}


def test_a_commit_twice_in_one_batch_is_invalid(client: Client) -> None:
    """The same entry twice in one batch is refused before anything is read."""
    client.operator.create_task({"task_id": "t", "entries": entries("a", "b")})
    with client.open_session("p", ttl=10) as s:
        (c,) = client.claim_batch("t", 1, session=s)
        with pytest.raises(errors.InvalidArgument,
                           match=rf"commits \[0\] and \[1\] both commit t/{c.file_id}"):
            client.commit_batch([("t", c.file_id, c.token, 1, X)] * 2)
        assert client.operator.get_entry("t", c.file_id).state == pb.ENTRY_STATE_WRITING


def test_lease_lost_in_the_middle_of_batches(client: Client) -> None:
    """When an agent holding batch claims loses its lease, every entry goes back."""
    client.operator.create_task({"task_id": "t", "backoff": FAST,
                                 "entries": entries(*(f"e{i:02d}" for i in range(10)))})
    s = client.open_session("p", ttl=10, keepalive=False)
    first = client.claim_batch("t", 4, session=s)
    client.commit_batch([("t", c.file_id, c.token, 1, X) for c in first[:2]])
    client.claim_batch("t", 4, session=s)
    client.close_session(s.session_id)
    def settled() -> Counter[int] | None:
        states = Counter(e.state for e in client.operator.list_entries("t"))
        return states if states[pb.ENTRY_STATE_WRITING] == 0 else None

    states = wait_for(settled)
    assert states == {pb.ENTRY_STATE_WRITTEN: 2, pb.ENTRY_STATE_PENDING: 8}


# 6. pause, resume, cancel ------------------------------------------------------------

def test_pause_stops_new_claims_but_lets_running_ones_finish(client: Client) -> None:
    """A paused task hands out nothing; a claim made before commits; resume restores claims."""
    client.operator.create_task({"task_id": "t", "entries": entries("a", "b")})
    with client.open_session("p", ttl=10) as s:
        running = client.claim("t", session=s)
        paused = client.operator.pause_task("t", "maintenance")
        assert paused.status == pb.TASK_STATUS_PAUSED and "maintenance" in paused.status_reason
        with pytest.raises(errors.TaskNotActive):
            client.claim("t", session=s)
        assert client.commit("t", running.file_id, running.token, 1,
                             X).state == pb.ENTRY_STATE_WRITTEN
        assert client.operator.resume_task("t").status == pb.TASK_STATUS_ACTIVE
        assert client.claim("t", session=s).file_id != running.file_id


def test_cancel_revokes_claims(client: Client) -> None:
    """Cancelling a task kills its claims' tokens and hands out nothing more."""
    client.operator.create_task({"task_id": "t", "entries": entries("a", "b")})
    with client.open_session("p", ttl=10) as s:
        c = client.claim("t", session=s)
        task = client.operator.cancel_task("t", "wrong input")
        assert task.status == pb.TASK_STATUS_CANCELLED and "wrong input" in task.status_reason
        with pytest.raises(errors.StaleToken):
            client.commit("t", c.file_id, c.token, 1, X)
        with pytest.raises(errors.TaskNotActive):
            client.claim("t", session=s)
        with pytest.raises(errors.IllegalTransition):
            client.operator.resume_task("t")


# 7. slots ---------------------------------------------------------------------

def test_slot_limit_refuses_claims_beyond_it(client: Client) -> None:
    """A session with 2 slots gets RESOURCE_EXHAUSTED on a third claim, until one finishes."""
    client.operator.create_task({"task_id": "t", "entries": entries("a", "b", "c")})
    with client.open_session("p", ttl=10, slots=2) as s:
        a = client.claim("t", session=s)
        client.claim("t", session=s)
        with pytest.raises(errors.SlotsExhausted):
            client.claim("t", session=s)
        (agent,) = [x for x in client.operator.list_agents() if x.session_id == s.session_id]
        assert agent.slots == 2 and len(agent.claims) == 2 and 0 < agent.ttl_left <= 10
        client.commit("t", a.file_id, a.token, 1, X)
        assert client.claim("t", session=s).file_id not in (a.file_id,)


def test_concurrent_claims_never_exceed_slots(client: Client) -> None:
    """Eight threads claiming on one 3-slot session: exactly three succeed."""
    client.operator.create_task({"task_id": "t", "entries": entries(*(f"e{i}" for i in range(8)))})
    with client.open_session("p", ttl=10, slots=3) as s:
        outcomes: list[str] = []
        barrier = threading.Barrier(8)

        def claim() -> None:
            barrier.wait()
            try:
                client.claim("t", session=s)
                outcomes.append("ok")
            except errors.SlotsExhausted:
                outcomes.append("full")

        threads = [threading.Thread(target=claim) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert Counter(outcomes) == {"ok": 3, "full": 5}


# 8. idempotency ---------------------------------------------------------------

def test_retry_through_another_replica_returns_the_original_outcome(
    registry_factory: Callable[..., Any],
) -> None:
    """A call retried on another replica (as after a replica died mid-reply) applies once."""
    a, b = registry_factory(), registry_factory()
    ca, cb = Client(a.address), Client(b.address)
    ca.operator.create_task({"task_id": "t", "entries": entries("x", "y")})
    with ca.open_session("p", ttl=10) as s:
        req = pb.ClaimRequest(task_id="t", session_id=s.session_id, request_id="req-1")
        first = ca._call("Claim", req)
        again = cb._call("Claim", pb.ClaimRequest(task_id="t", session_id=s.session_id,
                                                  request_id="req-1"))
        assert (again.token, again.entry.file_id) == (first.token, first.entry.file_id)
        commit = pb.CommitRequest(task_id="t", file_id=first.entry.file_id, token=first.token,
                                  size=1, digest=X, request_id="req-2")
        done = ca._call("Commit", commit).entry
        assert cb._call("Commit", commit).entry.state == done.state == pb.ENTRY_STATE_WRITTEN
        assert Counter(e.state for e in ca.operator.list_entries("t")) == {
            pb.ENTRY_STATE_WRITTEN: 1, pb.ENTRY_STATE_PENDING: 1}


# 9. journal and explain -----------------------------------------------------------

def test_journal_records_every_transition(client: Client) -> None:
    """Each transition leaves a journal record with who, token, from → to, in order."""
    client.operator.create_task({"task_id": "t", "entries": entries("a")})
    with client.open_session("prod", ttl=10) as s:
        c = client.claim("t", session=s)
        client.commit("t", "a", c.token, 1, digest(b"x"))
        client.watcher.report("t", "a", 1, digest(b"x"))
        lease = client.consume("t", "default", session=s)
        client.ack("t", "a", "default", lease.token)
    records = client.operator.journal("t", "a")
    assert [(r.event, r.from_state, r.to_state) for r in records] == [
        ("claimed", "pending", "writing"), ("committed", "writing", "written"),
        ("verified", "written", "verified"), ("consuming", "verified", "verified"),
        ("acked", "verified", "consumed")]
    assert records[0].label == "prod" and records[1].token == c.token
    assert records[0].revision == c.token  # written by the claim's own transaction
    revisions = [r.revision for r in records]
    assert revisions == sorted(revisions)


def test_explain_says_what_an_entry_waits_for(client: Client) -> None:
    """explain names the lease holder, the backoff, the dependency and the consumer group."""
    client.operator.create_task({"task_id": "t", "consumers": ["ocr"], "max_retries": 3,
                                 "backoff": {"base_seconds": 60}, "entries": [
                            {"file_id": "a", "path": "a"}, {"file_id": "b", "path": "b"},
                            {"file_id": "c", "path": "c", "depends_on": ["a"]}]})
    with client.open_session("agent-7", ttl=10) as s:
        client.claim("t", "a", session=s)
        assert "agent-7" in client.operator.explain("t", "a").text
        assert "waits for dependencies: a (writing)" in client.operator.explain("t", "c").text
        b = client.claim("t", "b", session=s)
        client.fail("t", "b", b.token, "timeout")
        assert "backoff until" in client.operator.explain("t", "b").text
    client.operator.create_task({"task_id": "u", "consumers": ["ocr"], "entries": entries("a")})
    with client.open_session("p", ttl=10) as s:
        produce_verified(client, s, "u")
    assert "Consumer groups still to ack: ocr" in client.operator.explain("u", "a").text


# 10. assemblies -----------------------------------------------------------------

def test_assembly_is_verified_when_all_parts_are(client: Client) -> None:
    """An assembly becomes verified once every part is; its consumers then get it."""
    client.operator.create_task({"task_id": "t", "entries": [
        {"file_id": "p1", "path": "big.part1"}, {"file_id": "p2", "path": "big.part2"},
        {"file_id": "big", "path": "big", "parts": ["p1", "p2"]}]})
    with client.open_session("p", ttl=10) as s:
        with pytest.raises(errors.IllegalTransition, match="parts"):
            client.claim("t", "big", session=s)
        produce_verified(client, s, "t", "p1", b"one")
        assert client.operator.get_entry("t", "big").state == pb.ENTRY_STATE_PENDING
        produce_verified(client, s, "t", "p2", b"two!")
        big = wait_for(lambda: (e := client.operator.get_entry("t", "big")).state
                       == pb.ENTRY_STATE_VERIFIED
                                                               and e)
        assert big.size == 7 and big.digest == assembly_digest([digest(b"one"), digest(b"two!")])
        lease = client.consume("t", "default", session=s)
        assert lease.file_id == "big"  # parts have no consumers of their own
        client.ack("t", "big", "default", lease.token)


# 11. task completion --------------------------------------------------------------

def test_task_completes_when_every_entry_is_consumed_or_dead(client: Client) -> None:
    """A task whose entries are all consumed or dead becomes completed, counting the dead."""
    client.operator.create_task({"task_id": "t", "max_retries": 0, "entries": entries("a", "b")})
    with client.open_session("p", ttl=10) as s:
        produce_verified(client, s, "t", "a")
        c = client.claim("t", "b", session=s)
        client.fail("t", "b", c.token, "no good")
        lease = client.consume("t", "default", session=s)
        assert [(t.open, t.dead) for t in client.operator.list_tasks()] == [(1, 1)]
        client.ack("t", "a", "default", lease.token)
    task = wait_for(lambda: (t := client.operator.get_task("t")).status
                    == pb.TASK_STATUS_COMPLETED and t)
    assert "1 dead" in task.status_reason and (task.open, task.dead) == (0, 1)


def test_batch_claim_stops_at_free_slots(client: Client) -> None:
    """A batch claim on a session with 2 free slots claims 2, then is refused."""
    client.operator.create_task({"task_id": "t", "entries": entries(*(f"e{i}" for i in range(6)))})
    with client.open_session("p", ttl=10, slots=2) as s:
        assert len(client.claim_batch("t", 5, session=s)) == 2
        with pytest.raises(errors.SlotsExhausted):
            client.claim_batch("t", 5, session=s)


def test_unverified_entry_frees_its_consumers_slots(client: Client) -> None:
    """When verified bytes vanish, the consumer holding them gets its slot back."""
    client.operator.create_task({"task_id": "t", "backoff": FAST, "entries": entries("a", "b")})
    with client.open_session("p", ttl=10) as s:
        produce_verified(client, s, "t", "a")
        produce_verified(client, s, "t", "b")
    with client.open_session("c", ttl=10, slots=1) as s:
        lease = client.consume("t", "default", session=s)
        client.watcher.report_problem("t", lease.file_id, pb.ReportProblemRequest.KIND_MISSING,
                                      "deleted")
        assert client.consume("t", "default", session=s).file_id != lease.file_id


def test_a_paused_task_takes_no_new_work_and_lets_work_in_hand_finish(
        client: Client) -> None:
    """Pausing keeps the run and takes no new work: claims and consumes, single and
    batched, are refused with a TaskNotActive naming the pause and its reason, while a
    claim and a consume lease taken before commit, ack and nack; resume hands out the
    rest from where it was."""
    client.operator.create_task({"task_id": "t", "entries": entries("a", "b", "c", "d", "e"),
                                 "consumers": ["g"]})
    with client.open_session("p", ttl=10) as s:
        for f in ("a", "b", "c"):
            produce_verified(client, s, "t", f)
        writing = client.claim("t", "d", session=s)
        acked = client.consume("t", "g", "a", session=s)
        nacked = client.consume("t", "g", "b", session=s)
        client.operator.pause_task("t", "disk swap")
        for take in (lambda: client.claim("t", session=s),
                     lambda: client.claim_batch("t", 2, session=s),
                     lambda: client.consume("t", "g", session=s),
                     lambda: client.consume_batch("t", "g", 2, session=s)):
            with pytest.raises(errors.TaskNotActive,
                               match=r"paused \(pause: disk swap\): it hands out no new "
                                     r"claims or consumes until `baton task resume`"):
                take()
        assert client.commit("t", "d", writing.token, 1, X,
                             session=s).state == pb.ENTRY_STATE_WRITTEN
        assert client.ack("t", "a", "g", acked.token, session=s).state == pb.ENTRY_STATE_CONSUMED
        client.nack("t", "b", "g", nacked.token, session=s)
        task = client.operator.get_task("t")
        assert task.status == pb.TASK_STATUS_PAUSED and task.status_reason == "pause: disk swap"
        assert dict(task.states) == {**dict.fromkeys(task.states, 0), "consumed": 1,
                                     "verified": 2, "written": 1, "pending": 1}
        assert client.operator.resume_task("t").status == pb.TASK_STATUS_ACTIVE
        assert client.claim("t", session=s).file_id == "e"
        assert sorted(lease.file_id for lease in client.consume_batch("t", "g", 5, session=s)
                      ) == ["b", "c"]


def test_pause_stops_new_consume_leases(client: Client) -> None:
    """A paused task hands out no consume leases either."""
    client.operator.create_task({"task_id": "t", "entries": entries("a")})
    with client.open_session("p", ttl=10) as s:
        produce_verified(client, s, "t")
        client.operator.pause_task("t")
        with pytest.raises(errors.TaskNotActive):
            client.consume("t", "default", session=s)
        client.operator.resume_task("t")
        assert client.consume("t", "default", session=s).file_id == "a"


def test_entry_shows_blocked_and_journal_names_the_consumer(client: Client) -> None:
    """GetEntry flags an entry blocked by a dead dependency; the journal records consuming."""
    client.operator.create_task({"task_id": "t", "max_retries": 0, "entries": [
        {"file_id": "a", "path": "a"}, {"file_id": "b", "path": "b", "depends_on": ["a"]},
        {"file_id": "c", "path": "c"}]})
    with client.open_session("p", ttl=10) as s:
        c = client.claim("t", "a", session=s)
        client.fail("t", "a", c.token, "bad")
        assert client.operator.get_entry("t", "b").blocked
        produce_verified(client, s, "t", "c")
        lease = client.consume("t", "default", session=s)
        client.ack("t", "c", "default", lease.token)
    events = [(r.event, r.label) for r in client.operator.journal("t", "c")]
    assert ("consuming", "p") in events and ("acked", "p") in events
    failed = [r for r in client.operator.journal("t", "a") if r.event == "failed"]
    assert failed[0].token == c.token
    with pytest.raises(errors.NotFound):
        client.operator.journal("nope")


def test_assembly_leaves_verified_when_a_part_changes(client: Client) -> None:
    """A part whose file changes takes its verified assembly out of verified too."""
    client.operator.create_task({"task_id": "t", "backoff": FAST, "entries": [
        {"file_id": "p1", "path": "p1"}, {"file_id": "p2", "path": "p2"},
        {"file_id": "big", "path": "big", "parts": ["p1", "p2"]}]})
    with client.open_session("p", ttl=10) as s:
        produce_verified(client, s, "t", "p1", b"one")
        produce_verified(client, s, "t", "p2", b"two")
        wait_for(lambda: client.operator.get_entry("t", "big").state == pb.ENTRY_STATE_VERIFIED)
        lease = client.consume("t", "default", session=s)
        client.watcher.report("t", "p1", 3, digest(b"ONE"))  # the part's file changed
        big = client.operator.get_entry("t", "big")
        assert big.state == pb.ENTRY_STATE_PENDING and "p1" in big.error
        with pytest.raises(errors.StaleToken):
            client.ack("t", "big", "default", lease.token)
        produce_verified(client, s, "t", "p1", b"one")  # produced again
        wait_for(lambda: client.operator.get_entry("t", "big").state == pb.ENTRY_STATE_VERIFIED)
