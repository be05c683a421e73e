"""The watcher end to end: real inotify on real directories, a real registry and etcd."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from registry_fixtures import RegistryHandle
from watcher_fixtures import (
    digest,
    histories,
    is_state,
    make_task,
    put_bytes,
    state_of,
    verified_events,
)

from baton_relay.client import Client, Session
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher import Watcher

Wait = Callable[..., None]


def test_published_by_rename_becomes_verified(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait
) -> None:
    """A file published by the producer helper (temp file + rename) becomes verified."""
    watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    data = os.urandom(64 << 10)
    put_bytes(client, session, "t1", "a", data)
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    assert client.operator.get_entry("t1", "a").digest == digest(data)


def test_written_in_place_and_closed_becomes_verified(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait
) -> None:
    """A file written under its final name and closed becomes verified after the commit."""
    watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    claim = client.claim("t1", "a", session=session)
    data = b"in place " * 1000
    Path(claim.path).parent.mkdir(parents=True, exist_ok=True)
    with open(claim.path, "wb") as f:
        f.write(data)
    client.commit("t1", "a", claim.token, len(data), digest(data))
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")


def test_mismatching_digest_takes_the_retry_path(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait
) -> None:
    """When the producer's declared digest differs from the file's, the entry is retried."""
    watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    claim = client.claim("t1", "a", session=session)
    Path(claim.path).parent.mkdir(parents=True, exist_ok=True)
    Path(claim.path).write_bytes(b"actual bytes")
    client.commit("t1", "a", claim.token, 12, digest(b"other bytes!"))
    wait_for(lambda: client.operator.get_entry("t1", "a").retry_count == 1, what="a retried")
    entry = client.operator.get_entry("t1", "a")
    assert entry.state == pb.ENTRY_STATE_PENDING
    assert "checksum mismatch" in entry.error


def test_report_before_the_commit_settles_at_the_commit(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait
) -> None:
    """A report kept while the entry is writing makes the commit itself verify it."""
    w = watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    claim = client.claim("t1", "a", session=session)
    data = os.urandom(1000)
    Path(claim.path).parent.mkdir(parents=True, exist_ok=True)
    # landed whole (renamed into place, as producers do): one report, of these bytes
    Path(claim.path + ".tmp").write_bytes(data)
    os.rename(claim.path + ".tmp", claim.path)
    wait_for(lambda: w.metrics.reports_of("t1", "a") == 1, what="the report before the commit")
    assert state_of(client, "t1", "a") == pb.ENTRY_STATE_WRITING
    committed = client.commit("t1", "a", claim.token, len(data), digest(data))
    assert committed.state == pb.ENTRY_STATE_VERIFIED


def test_report_after_the_commit_verifies(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait
) -> None:
    """A file committed while no watcher ran is verified by the watcher that starts later."""
    make_task(client, "t1", {"a": "a.bin"})
    put_bytes(client, session, "t1", "a", b"committed first")
    assert state_of(client, "t1", "a") == pb.ENTRY_STATE_WRITTEN
    w = watcher_factory()
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    # The watcher counts a report once its call returns, which may be after the entry
    # shows verified to others.
    wait_for(lambda: w.metrics.reports_of("t1", "a") >= 1, what="the report counted")
    assert w.metrics.reports_of("t1", "a") == 1


def test_new_task_and_directory_created_a_moment_earlier(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait
) -> None:
    """A task created after start is found by its directory, files in fresh subdirs too."""
    watcher_factory()
    make_task(client, "late", {"a": "x/y/z/a.bin", "b": "x/b.bin"})
    put_bytes(client, session, "late", "a", b"deep")  # creates x/y/z and the file at once
    put_bytes(client, session, "late", "b", b"shallow")
    wait_for(is_state(client, "late", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    wait_for(is_state(client, "late", "b", pb.ENTRY_STATE_VERIFIED), what="b verified")


def test_symlink_pointing_outside_the_root_is_refused(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    tmp_path: Path,
) -> None:
    """A symlinked file or directory is never verified; the entry takes the retry path."""
    watcher_factory()
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    secret = outside / "secret"
    secret.write_bytes(b"not staged")
    make_task(client, "t1", {"a": "a.bin", "c": "linked/c.bin"})
    for file_id, target, link in (("a", secret, ""), ("c", outside / "dir", "linked")):
        claim = client.claim("t1", file_id, session=session)
        task_dir = Path(claim.path).parents[1 if file_id == "c" else 0]
        task_dir.mkdir(parents=True, exist_ok=True)
        # the attempt's file name, as a link, or in the linked directory
        (outside / "dir" / Path(claim.path).name).write_bytes(b"not staged")
        (task_dir / (link or Path(claim.path).name)).symlink_to(target)
        client.commit("t1", file_id, claim.token, 10, digest(b"not staged"))
    for file_id in ("a", "c"):
        wait_for(lambda f=file_id: client.operator.get_entry("t1", f).retry_count == 1,
                 what=f"{file_id} refused")
        entry = client.operator.get_entry("t1", file_id)
        assert entry.state == pb.ENTRY_STATE_PENDING
        assert "symlink" in entry.error


def test_verified_file_modified_replaced_or_deleted_leaves_verified(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path,
) -> None:
    """Changing a verified file in place, replacing it or deleting it un-verifies the entry."""
    watcher_factory()
    make_task(client, "t1", {"m": "m.bin", "r": "r.bin", "d": "d.bin"})
    for f in ("m", "r", "d"):
        put_bytes(client, session, "t1", f, f"original {f}".encode() * 100)
    for f in ("m", "r", "d"):
        wait_for(is_state(client, "t1", f, pb.ENTRY_STATE_VERIFIED), what=f"{f} verified")
    task_dir = staging / "t1"
    m, r, d = (Path(client.operator.get_entry("t1", f).abs_attempt_path) for f in ("m", "r", "d"))
    with open(m, "r+b") as fh:
        fh.write(b"X")
    (task_dir / "new").write_bytes(b"replacement")
    os.rename(task_dir / "new", r)
    d.unlink()
    for f, why in (("m", "changed"), ("r", "changed"), ("d", "missing")):
        wait_for(lambda f=f: state_of(client, "t1", f) == pb.ENTRY_STATE_PENDING,
                 what=f"{f} unverified")
        assert why in client.operator.get_entry("t1", f).error


def test_polling_fallback_verifies(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path,
) -> None:
    """With --observer poll the files of a new task are verified too, and tampering seen."""
    w = watcher_factory(observer="poll")
    assert w.watches.root_backend == "poll"
    make_task(client, "t1", {"a": "sub/a.bin"})
    put_bytes(client, session, "t1", "a", b"polled")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    assert w.watches.backend_of(str(staging / "t1")) == "poll"
    Path(client.operator.get_entry("t1", "a").abs_attempt_path).write_bytes(b"tampered")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_PENDING), what="a unverified")


def test_each_entry_verified_exactly_once(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    registry: RegistryHandle,
) -> None:
    """Many files, several events each: one verification per entry, no retries."""
    w = watcher_factory(reconcile_interval=0.5)
    ids = [f"f{i:03d}" for i in range(40)]
    make_task(client, "t1", {f: f"d{int(f[1:]) % 4}/{f}.bin" for f in ids})
    for f in ids:
        put_bytes(client, session, "t1", f, os.urandom(4096))
    wait_for(lambda: all(e.state == pb.ENTRY_STATE_VERIFIED
                         for e in client.operator.list_entries("t1")),
             what="all verified")
    wait_for(lambda: w.metrics.get("reconciliations") >= 3, what="reconciliations")
    hist = histories(registry.etcd, registry.prefix, "t1", ids)
    assert {f: verified_events(h) for f, h in hist.items()} == dict.fromkeys(ids, 1)
    assert sum(w.metrics.reports_of("t1", f) for f in ids) == len(ids)


def test_assembly_is_left_to_the_registry(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
) -> None:
    """Parts are hashed; the assembly (no file of its own) is never reported missing."""
    w = watcher_factory(reconcile_interval=0.3)
    client.operator.create_task({"task_id": "asm", "entries": [
        {"file_id": "p1", "path": "p1"}, {"file_id": "p2", "path": "p2"},
        {"file_id": "big", "path": "big", "parts": ["p1", "p2"]}]})
    put_bytes(client, session, "asm", "p1", b"part one")
    put_bytes(client, session, "asm", "p2", b"part two")
    wait_for(is_state(client, "asm", "big", pb.ENTRY_STATE_VERIFIED), what="the assembly verified")
    wait_for(lambda: w.metrics.get("reconciliations") >= 3, what="reconciliations")
    assert w.metrics.get("problems") == 0
    assert state_of(client, "asm", "big") == pb.ENTRY_STATE_VERIFIED


def test_task_whose_directory_existed_is_served_at_once(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path,
) -> None:
    """A task created over an existing directory is served from the task stream, not later."""
    (staging / "pre").mkdir()
    watcher_factory(reconcile_interval=3600.0)  # only the task stream can find it
    make_task(client, "pre", {"a": "a.bin"})
    put_bytes(client, session, "pre", "a", b"was already there")
    wait_for(is_state(client, "pre", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")


def test_hard_linked_file_changed_from_outside_the_tree_leaves_verified(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    tmp_path: Path,
) -> None:
    """A verified file also linked outside the staging tree is polled: a write there un-verifies."""
    w = watcher_factory()  # reconcile_interval 300 s: only the polling can notice in time
    make_task(client, "t1", {"a": "a.bin"})
    outside = tmp_path / "outside"
    outside.mkdir()
    claim = client.claim("t1", "a", session=session)
    data = b"written outside, linked in " * 100
    (outside / "a.bin").write_bytes(data)
    Path(claim.path).parent.mkdir(parents=True, exist_ok=True)
    os.link(outside / "a.bin", claim.path)
    client.commit("t1", "a", claim.token, len(data), digest(data))
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    wait_for(lambda: ("t1", "a") in w.checker.links, what="a polled for its other name")
    assert w.metrics.get("linked") == 1

    with open(outside / "a.bin", "r+b") as fh:  # no inotify event reaches the staging tree
        fh.write(b"X")
    wait_for(lambda: state_of(client, "t1", "a") == pb.ENTRY_STATE_PENDING, what="a unverified")
    assert "changed" in client.operator.get_entry("t1", "a").error
    assert ("t1", "a") not in w.checker.links


def test_a_file_with_one_name_is_not_polled(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
) -> None:
    """An ordinary verified file (one name) is left to inotify, not polled."""
    w = watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    put_bytes(client, session, "t1", "a", b"one name")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    wait_for(w.jobs.idle, what="the watcher idle")
    assert len(w.checker.links) == 0 and w.metrics.get("linked") == 0


def _again(client: Client, task_id: str) -> None:
    """``task_id`` cancelled, deleted and created anew under the same id."""
    client.operator.cancel_task(task_id)
    client.operator.delete_task(task_id, discard_history=True)
    make_task(client, task_id, {"a": "a.bin"})


def test_late_news_of_a_deleted_task_leaves_its_successor_served(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait
) -> None:
    """A task created again under its id is served: the old incarnation's stream,
    ending late with "not found", stops only the old one's serving."""
    w = watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    wait_for(lambda: w.table.task("t1") is not None, what="t1 served")
    old = w.table.task("t1")
    _again(client, "t1")
    wait_for(lambda: w.table.task("t1") not in (None, old), what="the new t1 served")
    w.streams.on_gone(old)  # what the old stream does when it learns its task is gone
    assert w.table.task("t1") is not None
    put_bytes(client, session, "t1", "a", b"the new incarnation's")
    # No reconciliation comes to the rescue: FAST's is minutes away.
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a of the new t1 verified")


def test_a_task_back_before_its_old_stream_said_gone_is_served_again(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait
) -> None:
    """When the stream of a served view ends with "not found" after the task was created
    again (whose header, arriving while that view was served, started nothing), the
    watcher looks once more and serves the task that is there."""
    w = watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    wait_for(lambda: w.table.task("t1") is not None, what="t1 served")
    view = w.table.task("t1")
    assert view is not None
    w.streams.on_gone(view)  # the registry has a t1: it is this view that is stale
    wait_for(lambda: w.table.task("t1") not in (None, view), what="t1 served again")
    put_bytes(client, session, "t1", "a", b"served again")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")


@pytest.mark.parametrize("listed", ["cancelled", "deleted"])
def test_a_reconciliation_listed_before_a_task_came_back_leaves_it_served(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    monkeypatch: pytest.MonkeyPatch, listed: str,
) -> None:
    """A reconciliation whose listing shows a task finished (or gone), and which acts on
    it after the task was created again and served, leaves the new one served."""
    w = watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    wait_for(lambda: w.table.task("t1") is not None, what="t1 served")
    client.operator.cancel_task("t1")
    if listed == "deleted":
        client.operator.delete_task("t1", discard_history=True)
    wait_for(lambda: w.table.task("t1") is None, what="the finished t1 no longer served")
    list_tasks, test = w.client.operator.list_tasks, threading.current_thread()

    def listing_then_t1_again() -> list[pb.Task]:
        tasks = list_tasks()
        if threading.current_thread() is test:  # this reconciliation, not the daemon's
            if listed == "cancelled":
                client.operator.delete_task("t1", discard_history=True)
            make_task(client, "t1", {"a": "a.bin"})
            wait_for(lambda: w.table.task("t1") is not None, what="the new t1 served")
        return tasks

    monkeypatch.setattr(w.client.operator, "list_tasks", listing_then_t1_again)
    assert w.reconcile("test")
    monkeypatch.undo()
    assert w.table.task("t1") is not None
    put_bytes(client, session, "t1", "a", b"the new incarnation's")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a of the new t1 verified")
