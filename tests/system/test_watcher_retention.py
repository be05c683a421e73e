"""Staging retention, end to end (real etcd, registry, watchers, inotify): the files of
fully consumed entries leave staging after their retention and nothing else does: not
an entry one group has not acked, not a file changed after verification, not a
symlink; through a watcher kill and shard moves; a task's directory goes once empty
and archived."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import TEST_RETRY, RegistryHandle, produce_verified
from watcher_fixtures import (
    FAST,
    Producing,
    WatcherProcess,
    histories,
    is_state,
    put_bytes,
)

from baton_relay.client import Client, Session
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher import Watcher, WatcherConfig, start_watcher
from baton_relay.watcher.state import Change, Table

Wait = Callable[..., None]


def _consume(client: Client, session: Session, task_id: str, file_id: str,
             groups: tuple[str, ...]) -> pb.Entry:
    entry = client.operator.get_entry(task_id, file_id)
    for group in groups:
        lease = client.consume(task_id, group, file_id, session=session)
        entry = client.ack(task_id, file_id, group, lease.token, session=session)
    return entry


def _file(client: Client, task_id: str, file_id: str) -> Path:
    """The committed attempt's file of an entry."""
    return Path(client.operator.get_entry(task_id, file_id).abs_attempt_path)


def _journalled(client: Client, task_id: str, file_id: str, event: str) -> int:
    return sum(1 for r in client.operator.journal(task_id, file_id) if r.event == event)


@pytest.fixture
def watcher(registry: RegistryHandle, staging: Path) -> Watcher:
    w = start_watcher(WatcherConfig(registry=registry.address, staging=str(staging),
                                    **FAST), retry=TEST_RETRY)
    yield w  # type: ignore[misc]
    w.stop()


def test_only_fully_consumed_unchanged_files_leave_after_their_retention(
    client: Client, session: Session, watcher: Watcher, staging: Path, tmp_path: Path,
    wait_for: Wait,
) -> None:
    """Consumed by every group: gone after 1 s; one group short, changed after
    verification, replaced by a symlink, a planted symlink: all untouched."""
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not staging")
    client.operator.create_task({
        "task_id": "t", "consumers": ["g1", "g2"], "staging_retention_seconds": 1,
        "entries": [{"file_id": "gone", "path": "d/gone.bin"},
                    {"file_id": "half", "path": "d/half.bin"},
                    {"file_id": "changed", "path": "d/changed.bin",
                     "staging_retention_seconds": 3},
                    {"file_id": "linked", "path": "d/linked.bin",
                     "staging_retention_seconds": 3}]})
    for f in ("gone", "half", "changed", "linked"):
        put_bytes(client, session, "t", f, f"bytes of {f}".encode() * 100)
    for f in ("gone", "half", "changed", "linked"):
        wait_for(is_state(client, "t", f, pb.ENTRY_STATE_VERIFIED), what=f"{f} verified")
    files = {f: _file(client, "t", f) for f in ("gone", "half", "changed", "linked")}
    planted = staging / "t" / "d" / "planted"
    planted.symlink_to(outside)
    _consume(client, session, "t", "changed", ("g1", "g2"))
    files["changed"].write_bytes(b"other bytes after the acks")
    _consume(client, session, "t", "linked", ("g1", "g2"))
    files["linked"].unlink()
    files["linked"].symlink_to(outside)
    _consume(client, session, "t", "half", ("g1",))
    gone = _consume(client, session, "t", "gone", ("g1", "g2"))
    assert gone.state == pb.ENTRY_STATE_CONSUMED
    wait_for(lambda: not files["gone"].exists(), timeout=15, what="gone.bin removed")
    wait_for(lambda: watcher.metrics.get("staging_files_changed") == 1, timeout=15,
             what="the changed file kept")
    wait_for(lambda: watcher.metrics.get("staging_files_refused") == 1, timeout=15,
             what="the symlink left alone")
    assert files["half"].exists() and files["changed"].exists()
    assert files["linked"].is_symlink() and planted.is_symlink()
    assert outside.read_bytes() == b"not staging"
    assert _journalled(client, "t", "gone", "staging_removed") == 1
    assert _journalled(client, "t", "changed", "staging_changed") == 1
    assert not client.operator.get_entry("t", "changed").staging_removed_at
    assert not client.operator.get_entry("t", "linked").staging_removed_at
    assert watcher.metrics.get("staging_files_removed") == 1
    assert watcher.metrics.get("staging_bytes_removed") == gone.size
    held = sum(client.operator.get_entry("t", f).size for f in ("half", "changed", "linked"))
    assert client.operator.get_task("t").staging_bytes == held


def test_a_finished_tasks_files_go_and_its_directory_once_archived(
    registry_factory: Callable[..., RegistryHandle], staging: Path, tmp_path: Path,
    wait_for: Wait,
) -> None:
    """A completed task (no longer followed) loses its files; archived, its emptied
    directory goes too."""
    registry = registry_factory(archive_dir=str(tmp_path / "archive"), archive_after=2.0,
                                archive_interval=0.3)
    w = start_watcher(WatcherConfig(registry=registry.address, staging=str(staging),
                                    **FAST), retry=TEST_RETRY)
    try:
        with Client(registry.address, timeout=10, retry=TEST_RETRY) as client, \
                client.open_session("agent", ttl=10) as session:
            client.operator.create_task({"task_id": "t", "staging_retention_seconds": 0,
                                         "entries": [
                {"file_id": f"f{i}", "path": f"sub/f{i}.bin"} for i in range(3)]})
            for i in range(3):
                put_bytes(client, session, "t", f"f{i}", os.urandom(300))
            for i in range(3):
                wait_for(is_state(client, "t", f"f{i}", pb.ENTRY_STATE_VERIFIED), what="verified")
            for i in range(3):
                _consume(client, session, "t", f"f{i}", ("default",))
            wait_for(lambda: client.operator.get_task("t").status in (pb.TASK_STATUS_COMPLETED,
                                                                      pb.TASK_STATUS_ARCHIVED),
                     what="task completed")
            wait_for(lambda: w.metrics.get("staging_files_removed") == 3, timeout=15,
                     what="three files removed")
            wait_for(lambda: client.operator.get_task("t").status == pb.TASK_STATUS_ARCHIVED,
                     timeout=20,
                     what="task archived")
            wait_for(lambda: not (staging / "t").exists(), timeout=20,
                     what="the task's directory removed")
            # counted just after the removal
            wait_for(lambda: w.metrics.get("staging_dirs_removed") == 1, what="it counted")
    finally:
        w.stop()


def test_a_removal_recorded_but_not_made_is_finished_by_the_next_owner(
    client: Client, session: Session, registry: RegistryHandle, staging: Path,
    wait_for: Wait,
) -> None:
    """A watcher that died between the mark and the unlink: the next owner of the
    shard unlinks the file, unless its bytes changed since (kept, counted)."""
    client.operator.create_task({"task_id": "t", "staging_retention_seconds": 0, "entries": [
        {"file_id": f, "path": f"{f}.bin"} for f in ("a", "b")]})
    for f in ("a", "b"):
        produce_verified(client, session, "t", f)  # reported as a lone watcher would
        _consume(client, session, "t", f, ("default",))
    crashed = client.watcher.register_watcher(str(staging), reporter="crashed", ttl=2)
    epoch = crashed.shards[0].epoch
    for f in ("a", "b"):
        entry = client.operator.get_entry("t", f)
        reply = client.watcher.remove_staged("t", f, entry.size, entry.digest,
                                             watcher_id=crashed.watcher_id, shard_epoch=epoch)
        assert reply.outcome == pb.RemoveStagedResponse.OUTCOME_MARKED
    _file(client, "t", "b").write_bytes(b"changed after the removal was recorded")
    # It never beats again: its registration ends, and the next watcher owns its shards.
    w = start_watcher(WatcherConfig(registry=registry.address, staging=str(staging),
                                    **FAST), retry=TEST_RETRY)
    try:
        wait_for(lambda: not _file(client, "t", "a").exists(), timeout=20,
                 what="the marked file unlinked by the next owner")
        wait_for(lambda: w.metrics.get("staging_files_changed") == 1, timeout=10,
                 what="the changed one kept")
        assert _file(client, "t", "b").read_bytes().startswith(b"changed")
        assert _journalled(client, "t", "a", "staging_removed") == 1
    finally:
        w.stop()


def test_a_directory_with_a_planted_symlink_stays(
    registry_factory: Callable[..., RegistryHandle], staging: Path, tmp_path: Path,
    wait_for: Wait,
) -> None:
    """A deleted task's directory with a symlink in it is kept, the link untouched."""
    registry = registry_factory()
    w = start_watcher(WatcherConfig(registry=registry.address, staging=str(staging),
                                    **{**FAST, "reconcile_interval": 0.5}), retry=TEST_RETRY)
    try:
        with Client(registry.address, timeout=10, retry=TEST_RETRY) as client:
            for task_id in ("kept", "emptied"):
                client.operator.create_task({"task_id": task_id, "entries": [
                    {"file_id": "a", "path": "x/a.bin"}]})
                (staging / task_id / "x").mkdir(parents=True, exist_ok=True)
            (staging / "kept" / "x" / "link").symlink_to(tmp_path)
            for task_id in ("kept", "emptied"):
                client.operator.cancel_task(task_id)
                client.operator.delete_task(task_id)
            wait_for(lambda: not (staging / "emptied").exists(), timeout=15,
                     what="the emptied task's directory removed")
            assert (staging / "kept" / "x" / "link").is_symlink()
            assert tmp_path.is_dir()
    finally:
        w.stop()


def sharded(processes: Callable[..., WatcherProcess], name: str) -> WatcherProcess:
    return processes("--reporter", name, "--shard-ttl", "3", "--reconcile-interval", "5",
                     "--removal-rate", "200", log_name=name)


@pytest.mark.slow
def test_removals_survive_a_watcher_kill_and_a_shard_move(
    registry: RegistryHandle, client: Client, session: Session,
    processes: Callable[..., WatcherProcess], staging: Path, wait_for: Wait,
) -> None:
    """Two watchers, one killed and a shard moved mid-run: every consumed file goes,
    each recorded once; entries one group has not acked keep theirs."""
    tasks = [f"t{i}" for i in range(6)]
    files = [f"f{j:02d}" for j in range(10)]
    for t in tasks:
        client.operator.create_task({"task_id": t, "consumers": ["g1", "g2"],
                                     "staging_retention_seconds": 1,
                                     "entries": [{"file_id": f, "path": f"{f}.bin"}
                                        for f in files]})
    watchers = [sharded(processes, "w0"), sharded(processes, "w1")]
    wait_for(lambda: len(client.operator.list_watchers()) == 2, what="both registered")
    Producing(client, session, [(t, f) for t in tasks for f in files]).join(120)
    wait_for(lambda: all(len(client.operator.list_entries(t, pb.ENTRY_STATE_VERIFIED)) == len(files)
                         for t in tasks), timeout=60, what="every file verified")
    half = [(t, f) for t in tasks for f in files[:2]]  # acked by g1 only
    full = [(t, f) for t in tasks for f in files[2:]]
    for t, f in full[: len(full) // 2]:
        _consume(client, session, t, f, ("g1", "g2"))
    victim = watchers[0]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    for t, f in full[len(full) // 2:]:
        _consume(client, session, t, f, ("g1", "g2"))
    for t, f in half:
        _consume(client, session, t, f, ("g1",))
    wait_for(lambda: len(client.operator.list_watchers()) == 1, timeout=15, what="victim expired")
    watchers.append(sharded(processes, "w2"))
    wait_for(lambda: len(client.operator.list_watchers()) == 2, what="a new watcher")
    ids = {w.reporter: w.watcher_id for w in client.operator.list_watchers()}
    # a shard of the survivor's moves to the newcomer while removals are due
    shard = next(s for s in client.operator.list_shards().shards if s.owner == ids["w1"]
                 and not s.moving_to)
    client.operator.move_shard(shard.shard, ids["w2"])
    wait_for(lambda: all(not _file(client, t, f).exists() for t, f in full),
             timeout=60, what="every fully consumed file removed")
    assert all(_file(client, t, f).exists() for t, f in half)
    for t in tasks:
        hist = histories(registry.etcd, registry.prefix, t, files)
        marks = {f: sum(1 for e in h if e["event"] == "staging_removed")
                 for f, h in hist.items()}
        assert marks == {f: int(f not in files[:2]) for f in files}, (t, marks)
        assert client.operator.get_task(t).staging_bytes == sum(
            client.operator.get_entry(t, f).size for f in files[:2])
    for p in watchers[1:]:
        assert "step failed" not in p.log_tail(10_000), p.log_tail()


class _LateStream:
    """The task streams' view of the table, with the stream's news that ``file_id`` is
    consumed held back: kept aside (the stream is late), to be applied later."""

    def __init__(self, table: Table, file_id: str) -> None:
        self.table, self.file_id = table, file_id
        self.held: list[tuple[str, pb.Entry]] = []

    def apply(self, task_id: str, entry: pb.Entry, **kw: Any) -> Change | None:
        if entry.file_id == self.file_id and entry.state == pb.ENTRY_STATE_CONSUMED:
            self.held.append((task_id, entry))
            return None
        return self.table.apply(task_id, entry, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.table, name)


def test_a_consumed_entry_first_heard_of_in_a_reply_still_leaves_staging(
    client: Client, session: Session, watcher: Watcher, wait_for: Wait,
) -> None:
    """The file of an entry consumed and then changed is looked at before the task's
    stream says it is consumed: the report's answer is the first news of it. Heard from
    that answer, the file is still the retention's (here: changed, so kept and
    journalled); the stream's word, late, is old news and changes nothing."""
    client.operator.create_task({
        "task_id": "t", "consumers": ["g1"], "staging_retention_seconds": 1,
        "entries": [{"file_id": "f", "path": "d/f.bin"},
                    {"file_id": "live", "path": "d/live.bin"}]})
    put_bytes(client, session, "t", "f", b"verified bytes" * 100)
    wait_for(is_state(client, "t", "f", pb.ENTRY_STATE_VERIFIED), what="f verified")
    wait_for(lambda: (e := watcher.table.entry("t", "f")) is not None
             and e.state == pb.ENTRY_STATE_VERIFIED, what="the watcher knows f verified")
    late = _LateStream(watcher.table, "f")
    watcher.streams.table = late  # type: ignore[assignment]
    consumed = _consume(client, session, "t", "f", ("g1",))
    assert consumed.state == pb.ENTRY_STATE_CONSUMED
    wait_for(lambda: late.held, what="the stream's news of f held back")
    _file(client, "t", "f").write_bytes(b"other bytes after the ack")
    # the watcher sees the file change while it still believes f verified: it reports
    # the new bytes, and the answer says f is consumed
    wait_for(lambda: (e := watcher.table.entry("t", "f")) is not None
             and e.state == pb.ENTRY_STATE_CONSUMED, what="the answer's news of f")
    assert late.held  # the stream has said nothing yet
    for task_id, entry in late.held:
        assert watcher.table.apply(task_id, entry) is None  # old news by now
    wait_for(lambda: watcher.metrics.get("staging_files_changed") == 1, timeout=15,
             what="the changed file looked at by the retention")
    assert _journalled(client, "t", "f", "staging_changed") == 1
    assert _file(client, "t", "f").read_bytes() == b"other bytes after the ack"
