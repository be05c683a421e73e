"""Checkpoints: an attempt records its progress on a key beside its entry, the next
attempt's claim (a consumer group's next lease) carries it, a stale token changes
nothing, and the journal records them sparingly (real etcd, real registry)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import blake3
import pytest
from click.testing import CliRunner
from registry_fixtures import RegistryHandle, on_etcd

from baton_relay.client import Client
from baton_relay.client.cli import cli
from baton_relay.client.consumer import consume
from baton_relay.client.producer import produce
from baton_relay.kernel.contract import MAX_CHECKPOINT_BYTES
from baton_relay.kernel.errors import InvalidArgument, StaleToken
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import ClaimRef, Keys

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

Wait = Callable[..., None]
EMPTY = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def kept(registry: RegistryHandle, ref: ClaimRef) -> dict[str, object] | None:
    """The checkpoint key of ``ref`` as stored, or None."""
    async def read(etcd: Etcd) -> dict[str, object] | None:
        kv = await etcd.get(Keys(registry.prefix).checkpoint(ref))
        return None if kv is None else json.loads(kv.value)

    return on_etcd(registry.etcd, read)


def one_entry(client: Client, **task: object) -> None:
    client.operator.create_task({"task_id": "t1", "digest_optional": True, **task,
                                 "entries": [{"file_id": "a", "path": "a"}]})


def claimable(client: Client, wait_for: Wait, task_id: str, file_id: str) -> None:
    """Wait for the entry's retry backoff to end."""
    wait_for(lambda: "claimable" in client.operator.explain(task_id, file_id).text, timeout=10,
             what="backoff over")


def test_a_checkpoint_is_handed_to_the_attempt_after_a_fail(client: Client,
                                                           wait_for: Wait) -> None:
    """The claim after a fail carries the last checkpoint (data, progress, message,
    digest, the attempt that made it) and its own attempt number."""
    one_entry(client, backoff={"base_seconds": 0.01, "cap_seconds": 0.01})
    with client.open_session("p", ttl=30) as session:
        first = client.claim("t1", "a", session=session)
        assert first.checkpoint is None and first.attempt == 1
        session.checkpoint("t1", "a", first.token, data=b"page 3", progress=0.25)
        out = session.checkpoint("t1", "a", first.token, data=b"page 7", progress=0.5,
                                 message="halfway")
        assert out.attempt == 1 and out.digest == blake3.blake3(b"page 7").hexdigest()
        client.fail("t1", "a", first.token, "crashed", session=session)
        claimable(client, wait_for, "t1", "a")
        second = client.claim("t1", "a", session=session)
    assert second.attempt == 2
    assert second.checkpoint is not None
    c = second.checkpoint
    assert (c.data, c.progress, c.message, c.token, c.attempt) == (
        b"page 7", 0.5, "halfway", first.token, 1)
    assert c.digest == blake3.blake3(b"page 7").hexdigest() and c.at


def test_a_checkpoint_survives_a_deadline_and_a_commit_drops_it(
    client: Client, registry: RegistryHandle, wait_for: Wait,
) -> None:
    """An attempt taken back at its deadline leaves its checkpoint to the next; the
    commit that finishes an attempt deletes it."""
    one_entry(client, claim_deadline_seconds=1,
              backoff={"base_seconds": 0.01, "cap_seconds": 0.01})
    ref = ClaimRef("p", "t1", "a")
    with client.open_session("p", ttl=30) as session:
        first = client.claim("t1", "a", session=session)
        session.checkpoint("t1", "a", first.token, data=b"x" * 10, progress=0.9)
        wait_for(lambda: client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_PENDING,
                 timeout=10, what="the claim taken away at its deadline")
        claimable(client, wait_for, "t1", "a")
        second = client.claim("t1", "a", session=session)
        assert second.checkpoint is not None and second.checkpoint.data == b"x" * 10
        assert kept(registry, ref) is not None
        client.commit("t1", "a", second.token, 0, session=session)
    assert kept(registry, ref) is None


def test_checkpoint_limits_are_refused_naming_the_field(
    client: Client, registry: RegistryHandle,
) -> None:
    """Data over 64 KiB, a progress outside 0..1 and a long message are refused with
    InvalidArgument naming the field, and nothing is kept."""
    one_entry(client)
    with client.open_session("p", ttl=30) as session:
        claim = client.claim("t1", "a", session=session)
        bad: list[tuple[str, dict[str, object]]] = [
            ("data", {"data": b"x" * (MAX_CHECKPOINT_BYTES + 1)}),
            ("progress", {"progress": 1.5}),
            ("progress", {"progress": -0.1}),
            ("progress", {"progress": float("nan")}),
            ("message", {"message": "m" * 201}),
        ]
        for field, kwargs in bad:
            with pytest.raises(InvalidArgument) as e:
                session.checkpoint("t1", "a", claim.token, **kwargs)  # type: ignore[arg-type]
            assert e.value.fields.get("field") == field
        # exactly at the limit is fine
        session.checkpoint("t1", "a", claim.token, data=b"x" * MAX_CHECKPOINT_BYTES,
                           progress=1.0, message="m" * 200)
    assert kept(registry, ClaimRef("p", "t1", "a")) is not None


def test_a_stale_token_is_refused_and_changes_nothing(
    client: Client, registry: RegistryHandle,
) -> None:
    """A token that is not the live claim, and a checkpoint after the claim was taken
    back, are refused with StaleToken; the kept checkpoint stays as it was. (The
    failed entry's backoff is long: its promotion would be a write of the entry.)"""
    one_entry(client, backoff={"base_seconds": 3600, "cap_seconds": 3600})
    ref = ClaimRef("p", "t1", "a")
    with client.open_session("p", ttl=30) as session:
        claim = client.claim("t1", "a", session=session)
        session.checkpoint("t1", "a", claim.token, data=b"good", progress=0.3)
        before = kept(registry, ref)
        with pytest.raises(StaleToken):
            session.checkpoint("t1", "a", claim.token + 1000, data=b"bad", progress=0.9)
        assert kept(registry, ref) == before
        client.fail("t1", "a", claim.token, "gave up", session=session)  # taken back
        entry_before = client.operator.get_entry("t1", "a")
        with pytest.raises(StaleToken):
            session.checkpoint("t1", "a", claim.token, data=b"late", progress=0.95)
    assert kept(registry, ref) == before
    after = client.operator.get_entry("t1", "a")
    assert after.revision == entry_before.revision


def test_consumer_checkpoints_are_kept_per_group(
    client: Client, registry: RegistryHandle,
) -> None:
    """A consume lease's checkpoint goes to the next lease of its group only; an
    ack drops that group's."""
    client.operator.create_task({"task_id": "t1", "digest_optional": True, "consumers": ["g", "h"],
                                 "entries": [{"file_id": "a", "path": "a"}]})
    with client.open_session("p", ttl=30) as producer:
        claim = client.claim("t1", "a", session=producer)
        client.commit("t1", "a", claim.token, 0, session=producer)
    client.watcher.report("t1", "a", 0, EMPTY, reporter="test")
    with client.open_session("c", ttl=30) as session:
        g1 = client.consume("t1", "g", "a", session=session)
        assert g1.checkpoint is None and g1.attempt == 1
        session.checkpoint("t1", "a", g1.token, group="g", data=b"row 40", progress=0.4)
        client.nack("t1", "a", "g", g1.token, "later", session=session)
        h1 = client.consume("t1", "h", "a", session=session)
        assert h1.checkpoint is None  # the other group's is not handed over
        g2 = client.consume("t1", "g", "a", session=session)
        assert g2.checkpoint is not None and g2.checkpoint.data == b"row 40"
        assert g2.attempt == 2
        client.ack("t1", "a", "g", g2.token, session=session)
        assert kept(registry, ClaimRef("c", "t1", "a", "g")) is None
        client.ack("t1", "a", "h", h1.token, session=session)
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_CONSUMED


def test_the_journal_records_checkpoints_sparingly(
    client: Client, registry: RegistryHandle,
) -> None:
    """Many checkpoints in a row make one journal record; the key holds the latest."""
    one_entry(client)
    with client.open_session("p", ttl=30) as session:
        claim = client.claim("t1", "a", session=session)
        for i in range(5):
            session.checkpoint("t1", "a", claim.token, data=str(i).encode(),
                               progress=i / 10, message=f"step {i}")
    events = [r.event for r in client.operator.journal("t1", "a")]
    assert events.count("checkpoint") == 1
    stored = kept(registry, ClaimRef("p", "t1", "a"))
    assert stored is not None and stored["message"] == "step 4"


def test_the_helpers_record_and_resume(client: Client, registry: RegistryHandle,
                                       wait_for: Wait) -> None:
    """``produce``'s output and ``consume``'s delivery record checkpoints; after a
    failed block the next claim carries what the output recorded."""
    one_entry(client, backoff={"base_seconds": 0.01, "cap_seconds": 0.01})
    with client.open_session("p", ttl=30) as session:
        with pytest.raises(RuntimeError), produce(client, session, "t1", "a") as out:
            out.write(b"abc")
            out.checkpoint(data=b"offset 3", progress=0.3, message="wrote 3")
            raise RuntimeError("killed")
        claimable(client, wait_for, "t1", "a")
        claim = client.claim("t1", "a", session=session)
        assert claim.checkpoint is not None and claim.checkpoint.data == b"offset 3"
        client.fail("t1", "a", claim.token, "again", session=session)
    client.operator.create_task({"task_id": "t2", "consumers": ["g"], "digest_optional": True,
                                 "entries": [{"file_id": "b", "path": "b"}]})
    with client.open_session("c", ttl=30) as session:
        with produce(client, session, "t2", "b") as out:
            out.write(b"")
        client.watcher.report("t2", "b", 0, EMPTY, reporter="test")
        with consume(client, session, "t2", "g", timeout=10) as delivery:
            kept_now = delivery.checkpoint(data=b"done 1", progress=1.0)
            assert kept_now.token == delivery.lease.token
    assert client.operator.get_entry("t2", "b").state == pb.ENTRY_STATE_CONSUMED
    assert kept(registry, ClaimRef("c", "t2", "b", "g")) is None


def test_baton_checkpoint_command(client: Client, registry: RegistryHandle,
                                  tmp_path: Path) -> None:
    """`baton checkpoint` records a claim's checkpoint with --data-file, --progress and
    --message; a bad --progress exits with InvalidArgument's status."""
    one_entry(client)
    with client.open_session("p", ttl=30) as session:
        claim = client.claim("t1", "a", session=session)
        data = tmp_path / "state.bin"
        data.write_bytes(b"\x00\x01resume here")
        base = ["checkpoint", "t1", "a", "--token", str(claim.token)]
        env = {"BATON_REGISTRY": registry.address}
        run = CliRunner().invoke(cli, [*base, "--progress", "0.6", "--message", "cli",
                                       "--data-file", str(data), "-o", "json"], env=env)
        assert run.exit_code == 0, run.output
        shown = json.loads(run.stdout)
        assert shown["progress"] == 0.6 and shown["attempt"] == 1
        assert shown["digest"] == blake3.blake3(data.read_bytes()).hexdigest()
        bad = CliRunner().invoke(cli, [*base, "--progress", "2"], env=env)
        assert bad.exit_code == InvalidArgument.exit_code and "progress" in bad.output
    stored = kept(registry, ClaimRef("p", "t1", "a"))
    assert stored is not None and stored["message"] == "cli" and stored["progress"] == 0.6


def test_explain_and_the_agents_list_show_progress(client: Client, registry: RegistryHandle
                                                   ) -> None:
    """Explain says what the last checkpoint of the claim in hand says; the agents
    list (`lease show`, `top`) carries each claim's progress and checkpoint time."""
    one_entry(client, stall_after_seconds=600)
    with client.open_session("p", ttl=30) as session:
        claim = client.claim("t1", "a", session=session)
        assert "has not checkpointed yet" in client.operator.explain("t1", "a").text
        session.checkpoint("t1", "a", claim.token, progress=0.42, message="page 42")
        text = client.operator.explain("t1", "a").text
        assert "says 42% (page 42)" in text and "stalled after 600 s" in text
        (info,) = [c for a in client.operator.list_agents() if a.session_id == session.session_id
                   for c in a.claims]
        assert info.progress == pytest.approx(0.42) and info.checkpoint_at
        run = CliRunner().invoke(cli, ["lease", "show", str(session.session_id), "-o", "json"],
                                 env={"BATON_REGISTRY": registry.address})
        assert run.exit_code == 0, run.output
        (shown,) = json.loads(run.stdout)["claims"]
        assert shown["progress"] == pytest.approx(0.42) and shown["checkpoint_age"] >= 0
