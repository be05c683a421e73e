"""The watcher under faults: overflows, failing hashes, watch limits, blind mounts, stops."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import RegistryHandle
from watcher_fixtures import (
    digest,
    histories,
    is_state,
    make_task,
    put_bytes,
    verified_events,
)

from baton_relay.client import Client, Session
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher import Watcher
from baton_relay.watcher.emitter import InotifyEmitter
from baton_relay.watcher.errors import FileChanged, WatchLimitReached
from baton_relay.watcher.events import FsEvent
from baton_relay.watcher.hashing import Hashed, Hasher, Identity

Wait = Callable[..., None]


def test_overflow_of_a_shrunk_queue_still_verifies_everything_once(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    registry: RegistryHandle, monkeypatch: pytest.MonkeyPatch, staging: Path,
) -> None:
    """Events dropped by a full intake force a reconciliation; each entry verified once."""
    ids = [f"f{i:03d}" for i in range(60)]
    make_task(client, "t1", {f: f"{f}.bin" for f in ids})
    gate = threading.Event()
    handle = Watcher._handle

    def stalled(self: Watcher, event: FsEvent) -> None:
        gate.wait(30)  # the dispatcher is held while the burst lands
        handle(self, event)

    monkeypatch.setattr(Watcher, "_handle", stalled)
    (staging / "t1").mkdir()  # watched from the start
    w = watcher_factory(event_queue=2)
    claims = [client.claim("t1", f, session=session) for f in ids]
    for c in claims:  # 60 closes into a queue of 2
        Path(c.path).write_bytes(c.file_id.encode() * 500)
    gate.set()
    for c in claims:
        client.commit("t1", c.file_id, c.token, 2000, digest(c.file_id.encode() * 500))
    wait_for(lambda: all(e.state == pb.ENTRY_STATE_VERIFIED
                         for e in client.operator.list_entries("t1")),
             timeout=30, what="all verified")
    assert w.metrics.get("overflows") >= 1
    assert w.metrics.get("reconciliations") >= 2  # the one at start, one after the overflow
    hist = histories(registry.etcd, registry.prefix, "t1", ids)
    assert {f: verified_events(h) for f, h in hist.items()} == dict.fromkeys(ids, 1)


def test_kernel_overflow_event_forces_a_reconciliation(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path,
) -> None:
    """An IN_Q_OVERFLOW injected into the emitter makes the watcher find what it missed."""
    w = watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    put_bytes(client, session, "t1", "a", b"first")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    emitter = w.watches._inotify
    assert isinstance(emitter, InotifyEmitter)
    # A change whose event is "lost": tamper while the tree is not watched...
    w.watches.unwatch_tree(str(staging / "t1"))
    Path(client.operator.get_entry("t1", "a").abs_attempt_path).write_bytes(b"changed unseen")
    before = w.metrics.get("reconciliations")
    from baton_relay.watcher._inotify import IN_Q_OVERFLOW, RawEvent

    emitter.handle([RawEvent(-1, IN_Q_OVERFLOW, 0, "")])
    wait_for(lambda: w.metrics.get("reconciliations") > before, what="a reconciliation")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_PENDING), what="a unverified")


class FlakyHasher(Hasher):
    """Every hash fails as if the file kept changing (small files are hashed by look)."""

    def hash(self, task_id: str, rel: str) -> Hashed:
        raise FileChanged(rel, "changed while hashed", "")

    def look(self, task_id: str, rel: str, *,
             known: Identity | None = None) -> Identity | Hashed | None:
        raise FileChanged(rel, "changed while hashed", "")


def test_three_failed_hashes_report_the_file_corrupted(
    client: Client, session: Session, registry: RegistryHandle, staging: Path, wait_for: Wait,
    watcher_factory: Callable[..., Watcher], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file that cannot be hashed three times in a row is reported CORRUPTED and retried."""
    monkeypatch.setattr("baton_relay.watcher.daemon.Hasher", FlakyHasher)
    w = watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    put_bytes(client, session, "t1", "a", b"never settles")
    wait_for(lambda: client.operator.get_entry("t1", "a").retry_count == 1, what="a retried")
    entry = client.operator.get_entry("t1", "a")
    assert entry.state == pb.ENTRY_STATE_PENDING
    assert entry.error.startswith("corrupted: 3 failed attempts")
    assert w.metrics.get("problems") == 1


def test_watch_limit_falls_back_to_polling(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """When inotify refuses a task's watch with ENOSPC, that tree is polled, with a warning."""
    real = InotifyEmitter.watch

    def no_room(self: InotifyEmitter, path: str, recursive: bool) -> None:
        if recursive:
            raise WatchLimitReached(path, 28, "No space left on device")
        real(self, path, recursive)

    monkeypatch.setattr(InotifyEmitter, "watch", no_room)
    w = watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    put_bytes(client, session, "t1", "a", b"polled after ENOSPC")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    assert w.watches.backend_of(str(staging / "t1")) == "poll"
    assert any("ENOSPC" in str(getattr(r, "baton_fields", {}).get("reason", ""))
               for r in caplog.records)


def test_network_mount_is_polled(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A staging root that statfs says is on NFS is watched by polling, and the log says why."""
    monkeypatch.setattr("baton_relay.watcher.observe.blind_spot",
                        lambda path: "on a NFS mount (f_type 0x6969)")
    monkeypatch.setattr("baton_relay.watcher.observe.Watches.__init__.__defaults__",
                        (lambda path: "on a NFS mount (f_type 0x6969)",))
    w = watcher_factory()
    assert w.watches.root_backend == "poll"
    make_task(client, "t1", {"a": "a.bin"})
    put_bytes(client, session, "t1", "a", b"over nfs")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    reasons = [str(getattr(r, "baton_fields", {}).get("reason", "")) for r in caplog.records]
    assert any("NFS" in r for r in reasons)


def test_watches_of_a_finished_task_are_removed(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path,
) -> None:
    """Once every entry of a task is consumed, its directories are no longer watched."""
    w = watcher_factory()
    make_task(client, "t1", {"a": "sub/a.bin"})
    baseline = w.watches.watch_count()
    put_bytes(client, session, "t1", "a", b"to be consumed")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    assert w.watches.watch_count() == baseline + 2  # t1 and t1/sub
    lease = client.consume("t1", "default", "a", session=session)
    client.ack("t1", "a", "default", lease.token)
    wait_for(lambda: w.watches.backend_of(str(staging / "t1")) is None, what="unwatched")
    wait_for(lambda: w.watches.watch_count() == baseline, what="watches released")


class GatedHasher(Hasher):
    """Hashes only once the test opens the gate; tells the test when it started."""

    started = threading.Event()
    gate = threading.Event()

    def hash(self, task_id: str, rel: str) -> Hashed:
        self.started.set()
        assert self.gate.wait(30)
        return super().hash(task_id, rel)

    def look(self, task_id: str, rel: str, *,
             known: Identity | None = None) -> Identity | Hashed | None:
        self.started.set()
        assert self.gate.wait(30)
        return super().look(task_id, rel, known=known)


def test_stop_finishes_and_reports_the_hash_in_hand(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graceful stop waits for the file being hashed and reports it before returning."""
    monkeypatch.setattr("baton_relay.watcher.daemon.Hasher", GatedHasher)
    GatedHasher.started.clear()
    GatedHasher.gate.clear()
    w = watcher_factory()
    make_task(client, "t1", {"a": "a.bin"})
    put_bytes(client, session, "t1", "a", b"in hand")
    assert GatedHasher.started.wait(10)
    result: dict[str, Any] = {}
    stopper = threading.Thread(target=lambda: result.setdefault("stopped", w.stop()))
    stopper.start()
    stopper.join(0.3)
    assert stopper.is_alive(), "stop() returned while a hash was in hand"
    GatedHasher.gate.set()
    stopper.join(30)
    assert "stopped" in result
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_VERIFIED


def test_committed_file_that_never_appears_is_reported_missing(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
) -> None:
    """A commit with no file behind it is retried three times, then reported MISSING."""
    make_task(client, "t1", {"a": "a.bin"})  # no directory will announce it: known at start
    watcher_factory()
    claim = client.claim("t1", "a", session=session)
    client.commit("t1", "a", claim.token, 5, digest(b"never"))
    wait_for(lambda: client.operator.get_entry("t1", "a").retry_count == 1, what="a retried")
    assert client.operator.get_entry("t1", "a").error.startswith("missing: 3 failed attempts")
