"""What the registry's reads and records promise (issue 37): every read of an entry
says the same `blocked`, a commit's reply says the digest it stored, a cancelled task's
entries stay as they were, and a committed attempt ends with its commit (real etcd,
real registry)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import RegistryHandle, on_etcd

from baton_relay.client import Client, Session
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.identity import ANONYMOUS
from baton_relay.registry.records.model import PENDING, WRITING, EntryRecord
from baton_relay.registry.rules.core import Core
from baton_relay.registry.store.etcd import KV, Etcd
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.sweeps.scheduler import Scheduler
from baton_relay.registry.verbs.consumers import Consumers
from baton_relay.registry.verbs.leases import Leases
from baton_relay.registry.verbs.operators import Operators
from baton_relay.registry.verbs.producers import Producers
from baton_relay.registry.verbs.sessions import Sessions
from baton_relay.registry.verbs.tasks import Tasks
from baton_relay.registry.verbs.verify import Verifier

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

Wait = Callable[..., None]


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def write(path: str, data: bytes) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)


def manifest(task: str, n: int, **task_fields: object) -> dict[str, object]:
    return {"task_id": task, "backoff": {"base_seconds": 0.001},
            "entries": [{"file_id": f"f{i}", "path": f"out/f{i}.bin"} for i in range(n)],
            **task_fields}


def written(client: Client, session: Session, task: str, file_id: str) -> bytes:
    """Claim ``file_id``, write its file and commit it: written; its bytes."""
    claim = client.claim(task, file_id, session=session)
    data = f"{task}/{file_id}".encode()
    write(claim.path, data)
    entry = client.commit(task, file_id, claim.token, len(data), digest(data), session=session)
    assert entry.state == pb.ENTRY_STATE_WRITTEN
    return data


# --- 2: one `blocked` for every read ---------------------------------------------------


def test_every_read_of_an_entry_says_a_dead_dependency_blocks_it(
        client: Client, session: Session) -> None:
    """GetEntry, ListEntries, Explain and Watch all say blocked for an entry whose
    dependency is dead, and not for its siblings."""
    client.operator.create_task({"task_id": "t", "max_retries": 0, "entries": [
        {"file_id": "a", "path": "a"}, {"file_id": "b", "path": "b", "depends_on": ["a"]},
        {"file_id": "c", "path": "c"}]})
    claim = client.claim("t", "a", session=session)
    assert client.fail("t", "a", claim.token, "jammed",
                       session=session).state == pb.ENTRY_STATE_DEAD
    assert client.operator.get_task("t").blocked == 1
    assert client.operator.get_entry("t", "b").blocked
    listed = {e.file_id: e.blocked for e in client.operator.list_entries("t")}
    assert listed == {"a": False, "b": True, "c": False}
    assert [e.blocked for e in client.operator.list_entries("t", pb.ENTRY_STATE_PENDING)] == [True,
                                                                                              False]
    assert client.operator.explain("t", "b").entry.blocked
    assert not client.operator.explain("t", "c").entry.blocked
    snapshot = {}
    for event in client.watch("t", timeout=10):
        if event.kind == pb.TaskEvent.KIND_SYNCED:
            break
        snapshot[event.entry.file_id] = event.entry.blocked
    assert snapshot == {"a": False, "b": True, "c": False}


# --- 10: a commit's reply says what was stored ------------------------------------------


def test_every_commit_reply_carries_the_committed_digest(
        client: Client, session: Session) -> None:
    """Commit, CommitBatch, CommitAndClaim and CommitAndClaimBatch each reply with the
    entry written and the digest the commit stored, as GetEntry then reads it."""
    client.operator.create_task(manifest("t", 6))
    data = b"payload"
    d = digest(data)
    with client.open_session("fused", ttl=30) as streamed:
        one = client.claim("t", "f0", session=session)
        entry = client.commit("t", "f0", one.token, len(data), d, session=session)
        assert (entry.state, entry.digest) == (pb.ENTRY_STATE_WRITTEN, d)
        assert client.operator.get_entry("t", "f0").digest == d

        two = [client.claim("t", f, session=session) for f in ("f1", "f2")]
        entries = client.commit_batch([("t", c.file_id, c.token, len(data), d) for c in two])
        assert [(e.state, e.digest) for e in entries] == [(pb.ENTRY_STATE_WRITTEN, d)] * 2

        three = client.claim("t", "f3", session=streamed)
        entry, nxt = client.commit_and_claim("t", "f3", three.token, len(data), d,
                                             session=streamed)
        assert (entry.state, entry.digest) == (pb.ENTRY_STATE_WRITTEN, d)
        assert nxt is not None
        entries, _ = client.commit_and_claim_batch(
            [("t", nxt.file_id, nxt.token, len(data), d)], "t", 1, session=streamed)
        assert [(e.state, e.digest) for e in entries] == [(pb.ENTRY_STATE_WRITTEN, d)]


# --- 11: a cancelled task's entries stay as they were ---------------------------------


def test_a_file_committed_before_a_cancel_is_not_verified_after_it(
        client: Client, session: Session) -> None:
    """Commit, cancel, then the watcher's report (alone or in a batch): refused with
    TaskNotActive, and the entry stays written."""
    client.operator.create_task(manifest("t", 2))
    data = {f: written(client, session, "t", f) for f in ("f0", "f1")}
    client.operator.cancel_task("t", reason="wrong batch")
    with pytest.raises(errors.TaskNotActive, match="cancelled"):
        client.watcher.report("t", "f0", len(data["f0"]), digest(data["f0"]))
    (answer,) = client.watcher.report_batch([pb.ReportVerificationRequest(
        task_id="t", file_id="f1", size=len(data["f1"]), digest=digest(data["f1"]))])
    assert isinstance(answer, errors.TaskNotActive)
    for f in ("f0", "f1"):
        entry = client.operator.get_entry("t", f)
        assert entry.state == pb.ENTRY_STATE_WRITTEN and entry.digest == digest(data[f])
        assert [r.event for r in client.operator.journal("t", f)] == ["claimed", "committed"]


def test_a_verification_racing_a_cancel_lands_before_it_by_revision(
        client: Client, session: Session, registry: RegistryHandle) -> None:
    """Reports racing a cancel: every verification the journal holds has a revision
    below the cancel's; every entry not verified by then stays written."""
    n = 40
    client.operator.create_task(manifest("t", n))
    data = {f"f{i}": written(client, session, "t", f"f{i}") for i in range(n)}
    start = threading.Barrier(2)
    answers: list[object] = []

    def report_each() -> None:
        start.wait()
        for f, b in data.items():
            try:
                answers.append(client.watcher.report("t", f, len(b), digest(b)))
            except errors.TaskNotActive as e:
                answers.append(e)

    reporter = threading.Thread(target=report_each)
    reporter.start()
    start.wait()
    client.operator.cancel_task("t")
    reporter.join(timeout=60)
    assert not reporter.is_alive() and len(answers) == n

    async def header_revision(etcd: Etcd) -> int:
        kv = await etcd.get(Keys(registry.prefix).task("t"))
        assert kv is not None
        return kv.mod_revision

    cancelled_at = on_etcd(registry.etcd, header_revision)
    for f in data:
        records = client.operator.journal("t", f)
        verified = [r.revision for r in records if r.event == "verified"]
        assert all(rev < cancelled_at for rev in verified), (f, verified, cancelled_at)
        state = client.operator.get_entry("t", f).state
        assert state == (pb.ENTRY_STATE_VERIFIED if verified else pb.ENTRY_STATE_WRITTEN)


# --- 12: a committed attempt ends with its commit -------------------------------------


def committed_at(client: Client, task: str, file_id: str) -> str:
    (record,) = [r for r in client.operator.journal(task, file_id) if r.event == "committed"]
    return record.at


def test_a_committed_attempt_ends_with_its_commit(
        client: Client, session: Session) -> None:
    """Each attempt whose commit is in the journal ends with it (when, "committed"),
    through Commit, CommitBatch, CommitAndClaim and CommitAndClaimBatch, and still
    once its entry is consumed."""
    client.operator.create_task(manifest("t", 5))
    data = b"payload"
    d = digest(data)
    with client.open_session("fused", ttl=30) as streamed:
        one = client.claim("t", "f0", session=session)
        client.commit("t", "f0", one.token, len(data), d, session=session)
        client.watcher.report("t", "f0", len(data), d)
        lease = client.consume("t", "default", "f0", session=session)
        assert client.ack("t", "f0", "default", lease.token).state == pb.ENTRY_STATE_CONSUMED
        two = client.claim("t", "f1", session=session)
        client.commit_batch([("t", "f1", two.token, len(data), d)])
        three = client.claim("t", "f2", session=streamed)
        _, nxt = client.commit_and_claim("t", "f2", three.token, len(data), d,
                                         session=streamed)
        assert nxt is not None
        client.commit_and_claim_batch([("t", nxt.file_id, nxt.token, len(data), d)], "t", 0,
                                      session=streamed)
        for f in ("f0", "f1", "f2", nxt.file_id):
            (attempt,) = client.operator.explain("t", f).attempts
            assert (attempt.outcome, attempt.ended_at, attempt.digest, attempt.size) == (
                "committed", committed_at(client, "t", f), d, len(data)), f


def test_a_committed_attempt_taken_back_ends_with_how(
        client: Client, session: Session) -> None:
    """A commit the watcher then finds wrong: its attempt ends with the failure, not
    the commit; the next attempt, unfinished, is in progress."""
    client.operator.create_task(manifest("t", 1))
    written(client, session, "t", "f0")
    entry = client.watcher.report("t", "f0", 3, digest(b"bad"))
    assert entry.state == pb.ENTRY_STATE_PENDING
    client.claim("t", "f0", session=session)
    first, second = client.operator.explain("t", "f0").attempts
    failed = [r for r in client.operator.journal("t", "f0") if r.to_state == "pending"][-1]
    assert (first.outcome, first.ended_at) == (failed.event, failed.at)
    assert "checksum mismatch" in first.error
    assert (second.outcome, second.ended_at) == ("", "")


# --- 11: nothing moves a cancelled task's entries on its own ---------------------------
#
# On a Core of this test's own (real etcd, no scheduler running), so that each sweep runs
# exactly when the test says: after the cancel.


class Clock:
    """The registry's wall clock, moved on by the test (backoffs and nack delays)."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


async def _on_core(etcd: Any, prefix: str, clock: Clock,
                   body: Callable[[Core], Awaitable[None]]) -> None:
    conn = Etcd(etcd.endpoint)
    await conn.connect()
    core = Core(conn, Keys(prefix), "/staging", clock=clock)
    await core.start()
    try:
        await body(core)
    finally:
        await core.stop()
        await conn.close()


def _run(etcd: Any, prefix: str, body: Callable[[Core], Awaitable[None]],
         clock: Clock | None = None) -> None:
    asyncio.run(_on_core(etcd, prefix, clock or Clock(), body))


async def _session(core: Core) -> int:
    return (await Sessions(core).open(pb.OpenSessionRequest(agent="p", ttl=60, slots=8),
                                      ANONYMOUS)).session_id


async def _committed(core: Core, session: int, file_id: str) -> None:
    producers = Producers(core)
    claim = await producers.claim(pb.ClaimRequest(task_id="t", file_id=file_id,
                                                  session_id=session), ANONYMOUS)
    await producers.commit(pb.CommitRequest(task_id="t", file_id=file_id, token=claim.token,
                                            size=1, digest=digest(b"x")), ANONYMOUS)


async def _verified(core: Core, session: int, file_id: str) -> None:
    await _committed(core, session, file_id)
    await Verifier(core).report(pb.ReportVerificationRequest(
        task_id="t", file_id=file_id, size=1, digest=digest(b"x")))


async def _cancel(core: Core, monkeypatch: pytest.MonkeyPatch | None = None) -> int:
    """Cancel task t; the header's revision. With ``monkeypatch``, the cancel stops
    right after its first transaction (the registry died there): the task is cancelled,
    its claims and index keys not revoked yet."""
    if monkeypatch is not None:
        async def stopped(self: Operators, task_id: str) -> None:
            return None

        monkeypatch.setattr(Operators, "_revoke_claims", stopped)
    task = await Operators(core).control("cancel", pb.CancelTaskRequest(task_id="t"),
                                         ANONYMOUS)
    assert task.status == pb.TASK_STATUS_CANCELLED
    kv = await core.etcd.get(core.keys.task("t"))
    assert kv is not None
    return kv.mod_revision


async def _under(core: Core, base: bytes) -> list[KV]:
    kvs, _, _ = await core.etcd.range(base)
    return kvs


async def _as_it_was(core: Core, file_id: str, cancelled_at: int) -> EntryRecord:
    """The entry, written last before the cancel, and no journal record of it after."""
    kv = await core.etcd.get(core.keys.entry("t", file_id))
    assert kv is not None and kv.mod_revision < cancelled_at, (file_id, kv, cancelled_at)
    journal = await _under(core, core.keys.journal_all("t", file_id))
    after = [r.mod_revision for r in journal if r.mod_revision > cancelled_at]
    assert after == [], file_id
    return EntryRecord.load(kv.value)


def test_a_dependent_is_not_released_after_its_task_is_cancelled(
        etcd: Any, prefix: str) -> None:
    """b's dependency verified just before the cancel: neither the event of that
    verification nor the sweep of waiting entries releases b after it, and its waiting
    key goes (nothing looks at it again)."""
    async def body(core: Core) -> None:
        await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(task_id="t", entries=[
            pb.EntrySpec(file_id="a", path="a"),
            pb.EntrySpec(file_id="b", path="b", depends_on=["a"])])))
        await _verified(core, await _session(core), "a")
        cancelled_at = await _cancel(core)
        scheduler = Scheduler(core)
        assert not await scheduler.check_waiting("t", "b")  # the verification's event
        assert await scheduler.sweep_waiting() == 0
        rec = await _as_it_was(core, "b", cancelled_at)
        assert (rec.state, rec.deps_ok) == (PENDING, False)
        assert await _under(core, core.keys.waiting_all()) == []

    _run(etcd, prefix, body)


def test_an_assembly_is_not_verified_after_its_task_is_cancelled(
        etcd: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every part verified just before a cancel that stopped part-way: the assembly
    stays pending, not verified, whichever way the scheduler comes to it."""
    async def body(core: Core) -> None:
        await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(task_id="t", entries=[
            pb.EntrySpec(file_id="p", path="p"), pb.EntrySpec(file_id="q", path="q"),
            pb.EntrySpec(file_id="x", path="x", parts=["p", "q"])])))
        session = await _session(core)
        for part in ("p", "q"):
            await _verified(core, session, part)
        cancelled_at = await _cancel(core, monkeypatch)
        scheduler = Scheduler(core)
        assert not await scheduler.check_waiting("t", "x")
        assert await scheduler.sweep_waiting() == 0
        rec = await _as_it_was(core, "x", cancelled_at)
        assert (rec.state, rec.digest) == (PENDING, "")
        assert await _under(core, core.keys.waiting_all()) == []

    _run(etcd, prefix, body)


def test_an_entry_in_backoff_is_not_promoted_after_its_task_is_cancelled(
        etcd: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed entry's backoff ends after a cancel that stopped before deleting its
    delayed key: the promotion sweep leaves the entry as it was (no ready key comes)
    and drops the key."""
    clock = Clock()

    async def body(core: Core) -> None:
        await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(task_id="t", entries=[
            pb.EntrySpec(file_id="f", path="f")])))
        producers = Producers(core)
        claim = await producers.claim(pb.ClaimRequest(task_id="t", file_id="f",
                                                      session_id=await _session(core)),
                                      ANONYMOUS)
        await producers.fail(pb.FailRequest(task_id="t", file_id="f", token=claim.token,
                                            delay_seconds=60), ANONYMOUS)
        cancelled_at = await _cancel(core, monkeypatch)
        clock.t += 120  # the backoff is over
        assert await Scheduler(core).promote_due() == 0
        rec = await _as_it_was(core, "f", cancelled_at)
        assert rec.index.startswith(core.keys.delayed_of_task("t").decode())
        assert await _under(core, core.keys.ready_all("t")) == []
        assert await _under(core, core.keys.delayed_of_task("t")) == []

    _run(etcd, prefix, body, clock)


def test_a_nacked_entry_is_not_handed_back_after_its_task_is_cancelled(
        etcd: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A nack's delay ends after a cancel that stopped before deleting its key: the
    entry is not handed back to the group (no claimable key, no `returned` record)."""
    clock = Clock()

    async def body(core: Core) -> None:
        await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(task_id="t", entries=[
            pb.EntrySpec(file_id="f", path="f")])))
        session = await _session(core)
        await _verified(core, session, "f")
        consumers = Consumers(core)
        lease = await consumers.consume(pb.ConsumeRequest(task_id="t", group="default",
                                                          session_id=session), ANONYMOUS)
        await consumers.nack(pb.NackRequest(task_id="t", file_id="f", group="default",
                                            token=lease.token, delay_seconds=60), ANONYMOUS)
        cancelled_at = await _cancel(core, monkeypatch)
        clock.t += 120  # the nack's delay is over
        assert await Scheduler(core).promote_nacked() == 0
        rec = await _as_it_was(core, "f", cancelled_at)
        assert "default" in rec.nacked_until
        assert await _under(core, core.keys.cready_of_task("t")) == []
        assert await _under(core, core.keys.cdelayed_of_task("t")) == []

    _run(etcd, prefix, body, clock)


def test_a_revoked_session_gives_nothing_of_a_cancelled_task_back(
        etcd: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session revoked while a cancel that stopped part-way left its claim: the claim
    dies (token, twin, slot) and its entry of the cancelled task stays writing."""
    async def body(core: Core) -> None:
        await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(task_id="t", entries=[
            pb.EntrySpec(file_id="f", path="f")])))
        session = await _session(core)
        await Producers(core).claim(pb.ClaimRequest(task_id="t", file_id="f",
                                                    session_id=session), ANONYMOUS)
        cancelled_at = await _cancel(core, monkeypatch)
        revoked = await Leases(core).revoke_session(session, "ops", "host retired")
        assert revoked is not None and revoked.claims_returned == 1
        rec = await _as_it_was(core, "f", cancelled_at)
        assert rec.state == WRITING
        for base in (core.keys.claims_of_task("p", "t"), core.keys.inflight_of_task("p", "t"),
                     core.keys.ready_all("t")):
            assert await _under(core, base) == [], base

    _run(etcd, prefix, body)


def test_a_cancel_leaves_the_scheduler_nothing_of_the_task_to_look_at(
        etcd: Any, prefix: str) -> None:
    """An entry finished and a verification that wakes a dependent, just before the
    cancel: the cancel deletes their finishing and wake keys with the waiting one, so
    no sweep looks at the task again and a delete finds only its history."""
    async def body(core: Core) -> None:
        await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(
            task_id="t", max_retries=0, entries=[
                pb.EntrySpec(file_id="a", path="a"),
                pb.EntrySpec(file_id="b", path="b", depends_on=["a"]),
                pb.EntrySpec(file_id="d", path="d")])))
        session = await _session(core)
        await _verified(core, session, "a")  # wakes b
        producers = Producers(core)
        claim = await producers.claim(pb.ClaimRequest(task_id="t", file_id="d",
                                                      session_id=session), ANONYMOUS)
        await producers.fail(pb.FailRequest(task_id="t", file_id="d", token=claim.token,
                                            reason="jammed"), ANONYMOUS)  # d finished: dead
        assert await _under(core, core.keys.wakes_of_task("t"))
        assert await _under(core, core.keys.finishing_of_task("t"))
        await _cancel(core)
        for left in (core.keys.wakes_of_task("t"), core.keys.finishing_of_task("t"),
                     core.keys.waiting_all()):
            assert await _under(core, left) == [], left

    _run(etcd, prefix, body)
