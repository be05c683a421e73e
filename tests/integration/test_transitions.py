"""Every legal transition of the entry state machine, and a sample of illegal ones."""

from __future__ import annotations

import time
from pathlib import Path

import blake3
import pytest

from baton_relay.client import Claim, Client, produce
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

#: retries become claimable again at once (the default backoff starts at 1 s)
FAST_RETRY = {"base_seconds": 0.001}


def manifest(task: str = "t1", n: int = 2, **task_fields: object) -> dict[str, object]:
    entries = [{"file_id": f"f{i}", "path": f"out/f{i}.bin"} for i in range(n)]
    return {"task_id": task, "entries": entries, "backoff": FAST_RETRY, **task_fields}


def claim_soon(client: Client, session: object, task: str, timeout: float = 5.0) -> Claim:
    """Claim the next entry, waiting (with a deadline) for one to become claimable."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.claim(task, session=session)  # type: ignore[arg-type]
        except errors.NothingToClaim:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def write(path: str, data: bytes) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)


def test_create_is_create_only(client: Client) -> None:
    """The same manifest twice is a no-op; a different one under the id is ALREADY_EXISTS."""
    task, created = client.operator.create_task(manifest())
    assert created and task.status == pb.TASK_STATUS_ACTIVE and task.entry_count == 2
    again, created_again = client.operator.create_task(manifest())
    assert not created_again and again.manifest_digest == task.manifest_digest
    with pytest.raises(errors.TaskExists):
        client.operator.create_task(manifest(n=3))
    assert client.operator.get_task("t1").entry_count == 2


def test_claim_returns_token_and_absolute_path(client: Client, registry: object) -> None:
    """Claim moves pending → writing with a fencing token and the staging path."""
    client.operator.create_task(manifest())
    with client.open_session("p1", ttl=10) as s:
        claim = client.claim("t1", "f0", session=s)
        assert claim.token > 0
        # the attempt's own file: the token before the extension
        staging = registry.staging  # type: ignore[attr-defined]
        assert claim.path == f"{staging}/t1/out/f0~t{claim.token}.bin"
        entry = client.operator.get_entry("t1", "f0")
        assert (entry.state == pb.ENTRY_STATE_WRITING and entry.owner == "p1" and entry.token
                == claim.token)


def test_full_lifecycle_commit_then_report(client: Client) -> None:
    """pending → writing → written → verified → consumed, with the report after the commit."""
    client.operator.create_task(manifest(n=1))
    data = b"payload"
    with client.open_session("agent", ttl=10) as s:
        c = client.claim("t1", session=s)
        write(c.path, data)
        assert client.commit("t1", c.file_id, c.token, len(data),
                             digest(data)).state == pb.ENTRY_STATE_WRITTEN
        assert client.watcher.report("t1", c.file_id, len(data),
                                     digest(data)).state == pb.ENTRY_STATE_VERIFIED
        lease = client.consume("t1", "default", session=s)
        assert (lease.file_id, lease.size, lease.digest) == ("f0", len(data), digest(data))
        assert client.operator.get_entry("t1", "f0").consuming == {"default": "agent"}
        assert client.ack("t1", "f0", "default", lease.token).state == pb.ENTRY_STATE_CONSUMED


def test_report_before_commit_verifies_at_commit(client: Client) -> None:
    """A watcher report that arrives first is kept; the commit then verifies at once."""
    client.operator.create_task(manifest(n=1))
    data = b"early"
    with client.open_session("agent", ttl=10) as s:
        c = client.claim("t1", session=s)
        assert client.watcher.report("t1", "f0", len(data),
                                     digest(data)).state == pb.ENTRY_STATE_WRITING
        entry = client.commit("t1", "f0", c.token, len(data), digest(data))
        assert entry.state == pb.ENTRY_STATE_VERIFIED and entry.digest == digest(data)


def test_a_report_of_the_live_attempt_before_its_commit_writes_nothing(
        client: Client) -> None:
    """A report naming the live attempt's token, before its commit, is kept in the
    replica's memory, not on the entry: the entry does not move, and the commit of that
    attempt still verifies at once (one transaction for both)."""
    client.operator.create_task(manifest(n=1))
    data = b"seen early"
    with client.open_session("agent", ttl=10) as s:
        c = client.claim("t1", session=s)
        claimed = client.operator.get_entry("t1", "f0").revision
        answer = client.watcher.report("t1", "f0", len(data), digest(data), token=c.token)
        assert (answer.state, answer.revision) == (pb.ENTRY_STATE_WRITING, claimed)
        assert client.operator.get_entry("t1", "f0").revision == claimed
        entry = client.commit("t1", "f0", c.token, len(data), digest(data))
        assert entry.state == pb.ENTRY_STATE_VERIFIED and entry.digest == digest(data)
        assert [r.event for r in client.operator.journal("t1", "f0")] == [
            "claimed", "committed", "verified"]
        assert client.operator.journal("t1", "f0")[-1].revision == entry.revision


def test_a_report_newer_than_the_replicas_view_goes_the_transactional_way(
        client: Client) -> None:
    """A watcher that saw the entry at a revision the replica's view has not reached
    (another replica moved it) is not answered from that view: the report is decided
    on etcd, and kept on the entry as before."""
    client.operator.create_task(manifest(n=1))
    data = b"seen later"
    with client.open_session("agent", ttl=10) as s:
        c = client.claim("t1", session=s)
        claimed = client.operator.get_entry("t1", "f0").revision
        req = pb.ReportVerificationRequest(
            task_id="t1", file_id="f0", size=len(data), digest=digest(data), token=c.token,
            seen_revision=claimed + 1_000)
        (answer,) = client.watcher.report_batch([req])
        assert isinstance(answer, pb.Entry) and answer.state == pb.ENTRY_STATE_WRITING
        assert answer.revision > claimed
        assert client.operator.get_entry("t1", "f0").revision == answer.revision


def test_kept_reports_are_bounded_the_oldest_going_first(
        client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica keeps at most ``EARLY_KEPT`` reports before their commits: past it the
    oldest goes, and its commit waits for the report after it (nothing is lost)."""
    from baton_relay.registry.verbs import verify

    monkeypatch.setattr(verify, "EARLY_KEPT", 1)
    client.operator.create_task(manifest(n=2))
    data = b"kept"
    with client.open_session("agent", ttl=10) as s:
        first, second = client.claim("t1", session=s), client.claim("t1", session=s)
        for c in (first, second):
            assert client.watcher.report("t1", c.file_id, len(data), digest(data),
                                         token=c.token).state == pb.ENTRY_STATE_WRITING
        assert client.commit("t1", first.file_id, first.token, len(data),
                             digest(data)).state == pb.ENTRY_STATE_WRITTEN
        assert client.commit("t1", second.file_id, second.token, len(data),
                             digest(data)).state == pb.ENTRY_STATE_VERIFIED
        assert client.watcher.report("t1", first.file_id, len(data), digest(data),
                                     token=first.token).state == pb.ENTRY_STATE_VERIFIED


def test_a_kept_report_of_another_attempt_does_not_verify_the_commit(client: Client) -> None:
    """What was seen of a dead attempt's file (its token, reported late) never vouches
    for the live attempt's commit, even with the same bytes: the report after the
    commit decides."""
    client.operator.create_task(manifest(n=1, max_retries=3))
    data = b"same bytes"
    with client.open_session("agent", ttl=10) as s:
        first = client.claim("t1", session=s)
        client.fail("t1", "f0", first.token, reason="try again", session=s)
        second = claim_soon(client, s, "t1")
        assert second.token > first.token
        client.watcher.report("t1", "f0", len(data), digest(data), token=first.token)
        entry = client.commit("t1", "f0", second.token, len(data), digest(data))
        assert entry.state == pb.ENTRY_STATE_WRITTEN
        assert client.watcher.report("t1", "f0", len(data), digest(data),
                                     token=second.token).state == pb.ENTRY_STATE_VERIFIED


def test_a_report_of_other_bytes_before_the_commit_does_not_fail_it(client: Client) -> None:
    """Seen before the commit, bytes other than the committed ones (an earlier attempt's
    file, renamed over a moment later) neither verify nor fail the commit: the report
    after it decides. (A long fault run found such commits sent back as mismatches.)"""
    client.operator.create_task(manifest(n=1))
    old, new = b"old attempt", b"new attempt"  # the same size
    with client.open_session("agent", ttl=10) as s:
        c = client.claim("t1", session=s)
        assert client.watcher.report("t1", "f0", len(old),
                                     digest(old)).state == pb.ENTRY_STATE_WRITING
        entry = client.commit("t1", "f0", c.token, len(new), digest(new))
        assert (entry.state, entry.retry_count) == (pb.ENTRY_STATE_WRITTEN, 0)
        assert client.watcher.report("t1", "f0", len(new),
                                     digest(new)).state == pb.ENTRY_STATE_VERIFIED


def test_a_report_before_a_commit_without_digest_waits_for_the_next(client: Client) -> None:
    """A commit without a digest (digest_optional) cannot tell whose bytes an earlier
    report saw: it stays written until the watcher reports again."""
    client.operator.create_task(manifest(n=1, digest_optional=True))
    with client.open_session("agent", ttl=10) as s:
        c = client.claim("t1", session=s)
        client.watcher.report("t1", "f0", 3, digest(b"old"))
        assert client.commit("t1", "f0", c.token, 3).state == pb.ENTRY_STATE_WRITTEN
        entry = client.watcher.report("t1", "f0", 3, digest(b"new"))
        assert (entry.state, entry.digest) == (pb.ENTRY_STATE_VERIFIED, digest(b"new"))


def test_digest_optional_commit_without_digest_takes_the_watchers(client: Client) -> None:
    """On a digest_optional task a producer may commit only the size; the watcher's digest
    becomes the entry's."""
    client.operator.create_task(manifest(n=1, digest_optional=True))
    with client.open_session("agent", ttl=10) as s:
        c = client.claim("t1", session=s)
        client.commit("t1", "f0", c.token, 3)
        entry = client.watcher.report("t1", "f0", 3, digest(b"abc"))
        assert entry.state == pb.ENTRY_STATE_VERIFIED and entry.digest == digest(b"abc")


def test_mismatched_report_takes_the_retry_path(client: Client) -> None:
    """A report whose digest differs from the commit sends the entry back to pending."""
    client.operator.create_task(manifest(n=1))
    with client.open_session("agent", ttl=10) as s:
        c = client.claim("t1", session=s)
        client.commit("t1", "f0", c.token, 3, digest(b"abc"))
        entry = client.watcher.report("t1", "f0", 3, digest(b"xyz"))
        assert entry.state == pb.ENTRY_STATE_PENDING and entry.retry_count == 1
        assert "mismatch" in entry.error


def test_fail_retries_then_dead(client: Client) -> None:
    """Fail sends the entry back to pending until max_retries, then to dead."""
    client.operator.create_task(manifest(n=1, max_retries=1))
    with client.open_session("agent", ttl=10) as s:
        c = client.claim("t1", session=s)
        entry = client.fail("t1", "f0", c.token, "disk full")
        assert (entry.state == pb.ENTRY_STATE_PENDING and entry.retry_count == 1
                and "disk full" in entry.error)
        c = client.claim("t1", session=s)
        assert client.fail("t1", "f0", c.token, "again").state == pb.ENTRY_STATE_DEAD
        with pytest.raises(errors.NothingToClaim):
            client.claim("t1", session=s)


def test_nack_returns_entry_to_group(client: Client) -> None:
    """Nack hands a consumed entry back so another agent of the group can take it."""
    client.operator.create_task(manifest(n=1))
    with client.open_session("a", ttl=10) as s:
        c = client.claim("t1", session=s)
        client.commit("t1", "f0", c.token, 1, digest(b"x"))
        client.watcher.report("t1", "f0", 1, digest(b"x"))
        first = client.consume("t1", "default", session=s)
        with pytest.raises(errors.NothingToClaim):
            client.consume("t1", "default", session=s)
        client.nack("t1", "f0", "default", first.token, "try later")
        second = client.consume("t1", "default", session=s)
        assert second.file_id == "f0" and second.token > first.token
        with pytest.raises(errors.StaleToken):
            client.ack("t1", "f0", "default", first.token)
        assert client.ack("t1", "f0", "default", second.token).state == pb.ENTRY_STATE_CONSUMED


def test_every_group_must_ack(client: Client) -> None:
    """With two consumer groups the entry is consumed only after both acked."""
    client.operator.create_task(manifest(n=1, consumers=["index", "archive"]))
    with client.open_session("a", ttl=10) as s:
        c = client.claim("t1", session=s)
        client.commit("t1", "f0", c.token, 1, digest(b"x"))
        client.watcher.report("t1", "f0", 1, digest(b"x"))
        a = client.consume("t1", "index", session=s)
        b = client.consume("t1", "archive", session=s)
        assert client.ack("t1", "f0", "index", a.token).state == pb.ENTRY_STATE_VERIFIED
        entry = client.ack("t1", "f0", "archive", b.token)
        assert entry.state == pb.ENTRY_STATE_CONSUMED and sorted(entry.consumed_by) == ["archive",
                                                                                        "index"]


@pytest.mark.parametrize("state", ["writing", "verified"])
def test_claiming_a_non_pending_entry_is_refused(client: Client, state: str) -> None:
    """Claim of an entry that is not pending fails and changes nothing."""
    client.operator.create_task(manifest(n=1))
    with client.open_session("a", ttl=10) as s:
        c = client.claim("t1", "f0", session=s)
        if state == "verified":
            client.commit("t1", "f0", c.token, 1, digest(b"x"))
            client.watcher.report("t1", "f0", 1, digest(b"x"))
        before = client.operator.get_entry("t1", "f0")
        with pytest.raises(errors.IllegalTransition):
            client.claim("t1", "f0", session=s)
        assert client.operator.get_entry("t1", "f0") == before


def test_commit_twice_and_commit_after_fail_are_refused(client: Client) -> None:
    """A token is good for one commit or fail only."""
    client.operator.create_task(manifest(n=1))
    with client.open_session("a", ttl=10) as s:
        c = client.claim("t1", session=s)
        client.commit("t1", "f0", c.token, 1, digest(b"x"))
        with pytest.raises(errors.StaleToken):
            client.commit("t1", "f0", c.token, 1, digest(b"x"))
        with pytest.raises(errors.StaleToken):
            client.fail("t1", "f0", c.token, "late")
        assert client.operator.get_entry("t1", "f0").state == pb.ENTRY_STATE_WRITTEN


def test_wrong_token_changes_nothing(client: Client) -> None:
    """A commit with a token that is not the live claim's is refused as StaleToken."""
    client.operator.create_task(manifest(n=1))
    with client.open_session("a", ttl=10) as s:
        c = client.claim("t1", session=s)
        before = client.operator.get_entry("t1", "f0")
        for bad in (c.token - 1, c.token + 1, 0):
            with pytest.raises(errors.StaleToken):
                client.commit("t1", "f0", bad, 1, digest(b"x"))
        assert client.operator.get_entry("t1", "f0") == before


def test_commit_checks_input(client: Client) -> None:
    """Negative sizes, malformed or missing digests and sizes against expected_size are
    refused."""
    m = manifest(n=1)
    m["entries"][0]["expected_size"] = 5  # type: ignore[index]
    client.operator.create_task(m)
    with client.open_session("a", ttl=10) as s:
        c = client.claim("t1", session=s)
        with pytest.raises(errors.InvalidArgument):
            client.commit("t1", "f0", c.token, -1, digest(b"12345"))
        with pytest.raises(errors.InvalidArgument):
            client.commit("t1", "f0", c.token, 5, "not-hex")
        with pytest.raises(errors.InvalidArgument, match="BLAKE3 digest"):
            client.commit("t1", "f0", c.token, 5)
        with pytest.raises(errors.InvalidArgument, match="expected_size"):
            client.commit("t1", "f0", c.token, 4, digest(b"1234"))
        assert client.operator.get_entry("t1", "f0").state == pb.ENTRY_STATE_WRITING
        assert client.commit("t1", "f0", c.token, 5,
                             digest(b"12345")).state == pb.ENTRY_STATE_WRITTEN


def test_unknown_task_entry_and_session(client: Client) -> None:
    """Calls naming things that do not exist get NotFound / SessionExpired."""
    with pytest.raises(errors.NotFound):
        client.operator.get_task("nope")
    client.operator.create_task(manifest(n=1))
    with pytest.raises(errors.NotFound):
        client.operator.get_entry("t1", "nope")
    with pytest.raises(errors.SessionExpired):
        client.claim("t1", session=0x7FFF_0000_0000)


def test_producer_helper_publishes_atomically(client: Client) -> None:
    """produce() writes a temp file, renames it into place and commits size + digest."""
    client.operator.create_task(manifest(n=1))
    with client.open_session("a", ttl=10) as s:
        with produce(client, s, "t1") as out:
            out.write(b"hello ")
            out.write(b"world")
            assert not Path(out.claim.path).exists()  # not visible before the rename
        assert Path(out.claim.path).read_bytes() == b"hello world"
        assert list(Path(out.claim.path).parent.iterdir()) == [Path(out.claim.path)]
        assert out.entry is not None and out.entry.state == pb.ENTRY_STATE_WRITTEN
        assert out.entry.size == 11


def test_producer_helper_fails_entry_when_body_raises(client: Client) -> None:
    """If the body of produce() raises, the temp file is removed and the entry failed."""
    client.operator.create_task(manifest(n=1))
    with client.open_session("a", ttl=10) as s:
        with pytest.raises(RuntimeError), produce(client, s, "t1") as out:
            out.write(b"half")
            raise RuntimeError("model crashed")
        entry = client.operator.get_entry("t1", "f0")
        assert entry.state == pb.ENTRY_STATE_PENDING and "model crashed" in entry.error
        assert not any(Path(out.claim.path).parent.iterdir())


def test_retried_claim_applies_once(client: Client) -> None:
    """The same request id sent twice claims once and returns the same answer."""
    client.operator.create_task(manifest(n=3))
    with client.open_session("a", ttl=10) as s:
        req = pb.ClaimRequest(task_id="t1", session_id=s.session_id, request_id="r-123")
        first = client._call("Claim", req)
        second = client._call("Claim", pb.ClaimRequest(task_id="t1", session_id=s.session_id,
                                                       request_id="r-123"))
        assert (first.entry.file_id, first.token) == (second.entry.file_id, second.token)
        states = [e.state for e in client.operator.list_entries("t1")]
        assert states.count(pb.ENTRY_STATE_WRITING) == 1


def test_watch_streams_snapshot_then_changes(client: Client) -> None:
    """Watch sends every entry, SYNCED, then each change as it happens."""
    client.operator.create_task(manifest(n=2))
    events = client.watch("t1", timeout=10)
    kinds = [next(events).kind for _ in range(3)]
    assert kinds == [pb.TaskEvent.KIND_SNAPSHOT, pb.TaskEvent.KIND_SNAPSHOT,
                     pb.TaskEvent.KIND_SYNCED]
    with client.open_session("a", ttl=10) as s:
        c = client.claim("t1", "f1", session=s)
        ev = next(events)
        assert ev.kind == pb.TaskEvent.KIND_CHANGED
        assert (ev.entry.file_id, ev.entry.state, ev.revision) == ("f1", pb.ENTRY_STATE_WRITING,
                                                                   c.token)
    events.close()


def test_changed_verified_file_revokes_consumers(client: Client) -> None:
    """A report that a verified file changed takes it out of verified; its consumers' tokens die."""
    client.operator.create_task(manifest(n=1))
    with client.open_session("a", ttl=10) as s:
        c = client.claim("t1", session=s)
        client.commit("t1", "f0", c.token, 1, digest(b"x"))
        client.watcher.report("t1", "f0", 1, digest(b"x"))
        lease = client.consume("t1", "default", session=s)
        entry = client.watcher.report("t1", "f0", 1, digest(b"y"))
        assert entry.state == pb.ENTRY_STATE_PENDING and "changed on disk" in entry.error
        with pytest.raises(errors.StaleToken):
            client.ack("t1", "f0", "default", lease.token)
        with pytest.raises(errors.NothingToClaim):
            client.consume("t1", "default", session=s)


@pytest.mark.parametrize("kind", [pb.ReportProblemRequest.KIND_CORRUPTED,
                                  pb.ReportProblemRequest.KIND_MISSING])
def test_problem_reports_take_the_retry_path(client: Client, kind: int) -> None:
    """A corrupted or missing file sends a written or verified entry down the retry path."""
    client.operator.create_task(manifest(n=2))
    with client.open_session("a", ttl=10) as s:
        for file_id, verify in (("f0", False), ("f1", True)):
            c = client.claim("t1", file_id, session=s)
            client.commit("t1", file_id, c.token, 1, digest(b"x"))
            if verify:
                client.watcher.report("t1", file_id, 1, digest(b"x"))
            entry = client.watcher.report_problem("t1", file_id, kind, "unreadable three times")
            assert entry.state == pb.ENTRY_STATE_PENDING and entry.retry_count == 1
            assert "unreadable three times" in entry.error
        with pytest.raises(errors.InvalidArgument):
            client.watcher.report_problem("t1", "f0", 0, "no kind")


def test_claim_next_waits_for_dependencies(client: Client) -> None:
    """An entry is handed out only once its dependencies are verified."""
    client.operator.create_task({"task_id": "t1", "entries": [
        {"file_id": "a", "path": "a"}, {"file_id": "b", "path": "b", "depends_on": ["a"]}]})
    with client.open_session("p", ttl=10) as s:
        first = client.claim("t1", session=s)
        assert first.file_id == "a"
        with pytest.raises(errors.NothingToClaim):
            client.claim("t1", session=s)
        with pytest.raises(errors.IllegalTransition, match="dependencies"):
            client.claim("t1", "b", session=s)
        client.commit("t1", "a", first.token, 1, digest(b"x"))
        client.watcher.report("t1", "a", 1, digest(b"x"))
        # The registry releases dependents right after the verification, in the background.
        assert claim_soon(client, s, "t1").file_id == "b"
