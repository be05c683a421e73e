"""The registry's side of the staging retention: manifest fields and their default,
and the guarded mark a watcher asks for before it removes a consumed entry's file
(real etcd, real registry; no watcher: the reports come from the test)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import RegistryHandle, produce_verified

from baton_relay.client import Client, Session
from baton_relay.kernel.errors import InvalidArgument, InvalidManifest, NotShardOwner
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

Outcome = pb.RemoveStagedResponse.Outcome


def _task(client: Client, task_id: str, n: int = 1, **spec: Any) -> None:
    client.operator.create_task({"task_id": task_id, **spec,
                                 "entries": [{"file_id": f"f{i}", "path": f"d/f{i}.bin"}
                                    for i in range(n)]})


def _consumed(client: Client, session: Session, task_id: str, file_id: str,
              groups: tuple[str, ...] = ("default",)) -> pb.Entry:
    """Produce, verify, then consume and ack ``file_id`` for each of ``groups``."""
    produce_verified(client, session, task_id, file_id)
    entry = client.operator.get_entry(task_id, file_id)
    for group in groups:
        lease = client.consume(task_id, group, file_id, session=session)
        entry = client.ack(task_id, file_id, group, lease.token, session=session)
    return entry


def _digest_of(path: str) -> str:
    return blake3.blake3(Path(path).read_bytes()).hexdigest()


def test_the_retention_comes_from_the_entry_the_task_or_the_registry(
    registry_factory: Callable[..., RegistryHandle],
) -> None:
    """An entry's retention is its own, else its task's, else --staging-retention."""
    registry = registry_factory(staging_retention=7.0)
    with Client(registry.address, timeout=10) as client:
        client.operator.create_task({"task_id": "t", "staging_retention_seconds": 0,
                                     "entries": [{"file_id": "a", "path": "a"},
                                        {"file_id": "b", "path": "b",
                                         "staging_retention_seconds": -1}]})
        client.operator.create_task({"task_id": "u", "entries": [{"file_id": "a", "path": "a"}]})
        assert client.operator.get_entry("t", "a").staging_retention_seconds == 0
        assert client.operator.get_entry("t", "b").staging_retention_seconds == -1
        assert client.operator.get_entry("u", "a").staging_retention_seconds == 7
        assert client.operator.get_task("t").spec.staging_retention_seconds == 0
        assert not client.operator.get_task("u").spec.HasField("staging_retention_seconds")


@pytest.mark.parametrize("value", [math.nan, math.inf, 400 * 86400.0])
def test_a_retention_that_is_not_a_number_of_seconds_is_refused(
    client: Client, value: float,
) -> None:
    """A retention not finite, or over a year, is refused and nothing is created."""
    with pytest.raises(InvalidManifest, match="staging_retention_seconds"):
        client.operator.create_task({"task_id": "t", "entries": [
            {"file_id": "a", "path": "a", "staging_retention_seconds": value}]})
    assert client.operator.list_tasks() == []


def test_a_consumed_entry_past_its_retention_is_marked_once_and_journalled(
    client: Client, session: Session,
) -> None:
    """Consumed and due: MARKED, journalled once, the task's staging bytes drop."""
    _task(client, "t", 2, staging_retention_seconds=0)
    entry = _consumed(client, session, "t", "f0")
    assert entry.state == pb.ENTRY_STATE_CONSUMED and entry.consumed_at
    produce_verified(client, session, "t", "f1")
    held = client.operator.get_task("t").staging_bytes
    assert held == entry.size + client.operator.get_entry("t", "f1").size
    digest = _digest_of(entry.abs_attempt_path)
    reply = client.watcher.remove_staged("t", "f0", entry.size, digest, reporter="w")
    assert reply.outcome == Outcome.OUTCOME_MARKED and reply.entry.staging_removed_at
    marked = client.operator.get_entry("t", "f0").revision
    again = client.watcher.remove_staged("t", "f0", entry.size, digest, reporter="w")
    assert again.outcome == Outcome.OUTCOME_MARKED
    assert client.operator.get_entry("t", "f0").revision == marked  # nothing written twice
    events = [r.event for r in client.operator.journal("t", "f0")]
    assert events.count("staging_removed") == 1
    assert client.operator.get_task("t").staging_bytes == held - entry.size


def test_an_entry_one_group_has_not_acked_is_not_marked(
    client: Client, session: Session,
) -> None:
    """Acked by one of two groups: NOT_CONSUMED, the entry unchanged."""
    _task(client, "t", consumers=["g1", "g2"], staging_retention_seconds=0)
    entry = _consumed(client, session, "t", "f0", groups=("g1",))
    assert entry.state == pb.ENTRY_STATE_VERIFIED
    reply = client.watcher.remove_staged("t", "f0", entry.size, _digest_of(entry.abs_attempt_path))
    assert reply.outcome == Outcome.OUTCOME_NOT_CONSUMED
    after = client.operator.get_entry("t", "f0")
    assert after.revision == entry.revision and not after.staging_removed_at


def test_before_its_retention_has_passed_an_entry_is_not_due(
    client: Client, session: Session,
) -> None:
    """Consumed but inside its retention: NOT_DUE with the seconds left."""
    _task(client, "t", staging_retention_seconds=3600)
    entry = _consumed(client, session, "t", "f0")
    reply = client.watcher.remove_staged("t", "f0", entry.size, _digest_of(entry.abs_attempt_path))
    assert reply.outcome == Outcome.OUTCOME_NOT_DUE
    assert 3500 < reply.due_in_seconds <= 3600
    assert client.operator.get_entry("t", "f0").revision == entry.revision


def test_a_negative_retention_keeps_the_file(client: Client, session: Session) -> None:
    """Retention below zero: KEPT, never marked."""
    _task(client, "t", staging_retention_seconds=-1)
    entry = _consumed(client, session, "t", "f0")
    reply = client.watcher.remove_staged("t", "f0", entry.size, _digest_of(entry.abs_attempt_path))
    assert reply.outcome == Outcome.OUTCOME_KEPT and not reply.entry.staging_removed_at


def test_a_file_changed_after_verification_is_journalled_and_not_marked(
    client: Client, session: Session,
) -> None:
    """Another digest than the verified one: CHANGED, journalled once per digest."""
    _task(client, "t", staging_retention_seconds=0)
    entry = _consumed(client, session, "t", "f0")
    other = blake3.blake3(b"other bytes").hexdigest()
    for _ in range(2):
        reply = client.watcher.remove_staged("t", "f0", entry.size, other, reporter="w")
        assert reply.outcome == Outcome.OUTCOME_CHANGED and not reply.entry.staging_removed_at
    records = [r for r in client.operator.journal("t", "f0") if r.event == "staging_changed"]
    assert len(records) == 1
    assert client.operator.get_task("t").staging_bytes == entry.size


def test_bad_input_is_refused_precisely(client: Client, session: Session) -> None:
    """A malformed digest or id is INVALID_ARGUMENT; nothing changes."""
    _task(client, "t", staging_retention_seconds=0)
    entry = _consumed(client, session, "t", "f0")
    with pytest.raises(InvalidArgument, match="digest"):
        client.watcher.remove_staged("t", "f0", entry.size, "abc")
    with pytest.raises(InvalidArgument, match="file_id"):
        client.watcher.remove_staged("t", "../x", entry.size, entry.digest)
    assert client.operator.get_entry("t", "f0").revision == entry.revision


def test_only_the_shard_owner_at_its_epoch_may_mark(
    client: Client, session: Session, staging: Path,
) -> None:
    """Once watchers hold shards, a removal from another watcher or epoch is refused."""
    _task(client, "t", staging_retention_seconds=0)
    entry = _consumed(client, session, "t", "f0")
    reg = client.watcher.register_watcher(str(staging), reporter="w", ttl=30)
    grant = reg.shards[0]
    assert len(reg.shards) == reg.shard_count  # the only watcher owns every shard
    digest = _digest_of(entry.abs_attempt_path)
    for watcher_id, epoch in [("", 0), (reg.watcher_id, grant.epoch + 1), ("nobody", 1)]:
        with pytest.raises(NotShardOwner):
            client.watcher.remove_staged("t", "f0", entry.size, digest, watcher_id=watcher_id,
                                         shard_epoch=epoch)
    assert not client.operator.get_entry("t", "f0").staging_removed_at
    epochs = {g.epoch for g in reg.shards}
    assert len(epochs) == 1  # all granted together, at one epoch
    reply = client.watcher.remove_staged("t", "f0", entry.size, digest, watcher_id=reg.watcher_id,
                                         shard_epoch=grant.epoch)
    assert reply.outcome == Outcome.OUTCOME_MARKED


def test_the_archive_waits_for_files_about_to_leave_staging(
    registry_factory: Callable[..., RegistryHandle], tmp_path: Path, wait_for: Any,
) -> None:
    """A finished task whose consumed files are due for removal is archived only once
    they are removed; one whose removal is a day away is archived at once."""
    registry = registry_factory(archive_dir=str(tmp_path / "archive"), archive_after=0.0,
                                archive_interval=0.2)
    with Client(registry.address, timeout=10) as client, \
            client.open_session("agent", ttl=10) as session:
        _task(client, "soon", staging_retention_seconds=0)
        _task(client, "later", staging_retention_seconds=86400)
        entry = _consumed(client, session, "soon", "f0")
        wait_for(lambda: client.operator.get_task("soon").status == pb.TASK_STATUS_COMPLETED,
                 what="soon completed")
        _consumed(client, session, "later", "f0")
        wait_for(lambda: client.operator.get_task("later").status == pb.TASK_STATUS_ARCHIVED,
                 what="the task whose files stay a day archived")
        # Swept since it completed (later finished after it): still waiting.
        assert client.operator.get_task("soon").status == pb.TASK_STATUS_COMPLETED
        reply = client.watcher.remove_staged("soon", "f0", entry.size,
                                             _digest_of(entry.abs_attempt_path))
        assert reply.outcome == Outcome.OUTCOME_MARKED
        wait_for(lambda: client.operator.get_task("soon").status == pb.TASK_STATUS_ARCHIVED,
                 what="archived once its file is removed")


def test_the_registry_default_comes_from_its_configuration() -> None:
    """--staging-retention sets the default (86400 unless given); a non-number is refused."""
    from baton_relay.kernel.errors import BatonError
    from baton_relay.registry.edge.config import load_config

    assert load_config([], {}).staging_retention == 86400
    assert load_config(["--staging-retention", "0"], {}).staging_retention == 0
    assert load_config([], {"BATON_STAGING_RETENTION": "-1"}).staging_retention == -1
    with pytest.raises(BatonError, match="staging-retention"):
        load_config(["--staging-retention", "inf"], {})
