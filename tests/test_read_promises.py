"""What the registry's reads and records promise (issue 37): every read of an entry
says the same `blocked`, a commit's reply says the digest it stored, a cancelled task's
entries stay as they were, and a committed attempt ends with its commit (real etcd,
real registry)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import blake3
import pytest
from registry_fixtures import RegistryHandle, on_etcd

from baton_relay.client import Client, Session
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry._etcd import Etcd
from baton_relay.registry.keys import Keys

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
    client.create_task({"task_id": "t", "max_retries": 0, "entries": [
        {"file_id": "a", "path": "a"}, {"file_id": "b", "path": "b", "depends_on": ["a"]},
        {"file_id": "c", "path": "c"}]})
    claim = client.claim("t", "a", session=session)
    assert client.fail("t", "a", claim.token, "jammed",
                       session=session).state == pb.ENTRY_STATE_DEAD
    assert client.get_task("t").blocked == 1
    assert client.get_entry("t", "b").blocked
    listed = {e.file_id: e.blocked for e in client.list_entries("t")}
    assert listed == {"a": False, "b": True, "c": False}
    assert [e.blocked for e in client.list_entries("t", pb.ENTRY_STATE_PENDING)] == [True, False]
    assert client.explain("t", "b").entry.blocked
    assert not client.explain("t", "c").entry.blocked
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
    client.create_task(manifest("t", 6))
    data = b"payload"
    d = digest(data)
    with client.open_session("fused", ttl=30) as streamed:
        one = client.claim("t", "f0", session=session)
        entry = client.commit("t", "f0", one.token, len(data), d, session=session)
        assert (entry.state, entry.digest) == (pb.ENTRY_STATE_WRITTEN, d)
        assert client.get_entry("t", "f0").digest == d

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
    client.create_task(manifest("t", 2))
    data = {f: written(client, session, "t", f) for f in ("f0", "f1")}
    client.cancel_task("t", reason="wrong batch")
    with pytest.raises(errors.TaskNotActive, match="cancelled"):
        client.report("t", "f0", len(data["f0"]), digest(data["f0"]))
    (answer,) = client.report_batch([pb.ReportVerificationRequest(
        task_id="t", file_id="f1", size=len(data["f1"]), digest=digest(data["f1"]))])
    assert isinstance(answer, errors.TaskNotActive)
    for f in ("f0", "f1"):
        entry = client.get_entry("t", f)
        assert entry.state == pb.ENTRY_STATE_WRITTEN and entry.digest == digest(data[f])
        assert [r.event for r in client.journal("t", f)] == ["claimed", "committed"]


def test_a_verification_racing_a_cancel_lands_before_it_by_revision(
        client: Client, session: Session, registry: RegistryHandle) -> None:
    """Reports racing a cancel: every verification the journal holds has a revision
    below the cancel's; every entry not verified by then stays written."""
    n = 40
    client.create_task(manifest("t", n))
    data = {f"f{i}": written(client, session, "t", f"f{i}") for i in range(n)}
    start = threading.Barrier(2)
    answers: list[object] = []

    def report_each() -> None:
        start.wait()
        for f, b in data.items():
            try:
                answers.append(client.report("t", f, len(b), digest(b)))
            except errors.TaskNotActive as e:
                answers.append(e)

    reporter = threading.Thread(target=report_each)
    reporter.start()
    start.wait()
    client.cancel_task("t")
    reporter.join(timeout=60)
    assert not reporter.is_alive() and len(answers) == n

    async def header_revision(etcd: Etcd) -> int:
        kv = await etcd.get(Keys(registry.prefix).task("t"))
        assert kv is not None
        return kv.mod_revision

    cancelled_at = on_etcd(registry.etcd, header_revision)
    for f in data:
        records = client.journal("t", f)
        verified = [r.revision for r in records if r.event == "verified"]
        assert all(rev < cancelled_at for rev in verified), (f, verified, cancelled_at)
        state = client.get_entry("t", f).state
        assert state == (pb.ENTRY_STATE_VERIFIED if verified else pb.ENTRY_STATE_WRITTEN)


# --- 12: a committed attempt ends with its commit -------------------------------------


def committed_at(client: Client, task: str, file_id: str) -> str:
    (record,) = [r for r in client.journal(task, file_id) if r.event == "committed"]
    return record.at


def test_a_committed_attempt_ends_with_its_commit(
        client: Client, session: Session) -> None:
    """Each attempt whose commit is in the journal ends with it (when, "committed"),
    through Commit, CommitBatch, CommitAndClaim and CommitAndClaimBatch, and still
    once its entry is consumed."""
    client.create_task(manifest("t", 5))
    data = b"payload"
    d = digest(data)
    with client.open_session("fused", ttl=30) as streamed:
        one = client.claim("t", "f0", session=session)
        client.commit("t", "f0", one.token, len(data), d, session=session)
        client.report("t", "f0", len(data), d)
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
            (attempt,) = client.explain("t", f).attempts
            assert (attempt.outcome, attempt.ended_at, attempt.digest, attempt.size) == (
                "committed", committed_at(client, "t", f), d, len(data)), f


def test_a_committed_attempt_taken_back_ends_with_how(
        client: Client, session: Session) -> None:
    """A commit the watcher then finds wrong: its attempt ends with the failure, not
    the commit; the next attempt, unfinished, is in progress."""
    client.create_task(manifest("t", 1))
    written(client, session, "t", "f0")
    entry = client.report("t", "f0", 3, digest(b"bad"))
    assert entry.state == pb.ENTRY_STATE_PENDING
    client.claim("t", "f0", session=session)
    first, second = client.explain("t", "f0").attempts
    failed = [r for r in client.journal("t", "f0") if r.to_state == "pending"][-1]
    assert (first.outcome, first.ended_at) == (failed.event, failed.at)
    assert "checksum mismatch" in first.error
    assert (second.outcome, second.ended_at) == ("", "")
