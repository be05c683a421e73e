"""Watch streams at rest: an idle task's stream lasts while it is healthy, across
etcd's compactions, on the watcher's one stream thread (issue 39).

Each test runs its own etcd that compacts every second and, where the test says so,
tells idle watches their revision every 200 ms. Unrelated writes move etcd's revision
on while the task stays idle, as a live stack's do (heartbeats, other tasks). A
watcher's streams are resumed after ``SILENCE`` seconds without a message, five of
those progress intervals (where a test does not set a timer of its own).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from compacting import COMPACTING, compacted, start_etcd, tick
from registry_fixtures import TEST_RETRY, RegistryHandle, on_etcd, start_registry

from baton_relay.client import Client, put
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import Etcd
from baton_relay.watcher import Watcher, WatcherConfig, start_watcher
from baton_relay.watcher.sync import NEWS_WORKERS

#: etcd tells idle watches their revision every 200 ms
NOTIFYING = ("--experimental-watch-progress-notify-interval=200ms",)
#: seconds without a message before a watcher resumes a stream
SILENCE = 1.0


class Stack:
    """An etcd of the test's own, a registry on it, a client, and watchers."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.etcd = start_etcd(tmp_path, *flags)
        self.staging = tmp_path / "staging"
        self.staging.mkdir()
        self.registry: RegistryHandle = start_registry(
            self.etcd.endpoint, "/baton-idle/", self.staging)
        self.client = Client(self.registry.address, timeout=10, retry=TEST_RETRY)
        self.watchers: list[Watcher] = []

    def watcher(self, **settings: Any) -> Watcher:
        config = WatcherConfig(**{
            "registry": self.registry.address, "staging": str(self.staging),
            "stream_silence": SILENCE, "reconcile_interval": 300.0, "retry_delay": 0.05,
            "poll_interval": 0.1, **settings})
        w = start_watcher(config, retry=TEST_RETRY)
        self.watchers.append(w)
        return w

    def tick(self) -> int:
        """Write a key outside Baton's prefix (etcd's revision moves on); its revision."""
        return on_etcd(self.etcd, tick)

    def compacted(self, revision: int) -> bool:
        """Whether etcd has compacted ``revision`` away (a read at it is refused)."""
        async def read(etcd: Etcd) -> bool:
            return await compacted(etcd, revision)
        return on_etcd(self.etcd, read)

    def put(self, task_id: str, file_id: str) -> bytes:
        """Write an entry's file into staging and commit it; its content."""
        data = os.urandom(1000) + f"{task_id}/{file_id}".encode()
        with self.client.open_session("producer", ttl=10) as session:
            put(self.client, session, task_id, file_id, io.BytesIO(data))
        return data

    def verified(self, task_id: str, file_id: str) -> Callable[[], bool]:
        return lambda: (self.client.operator.get_entry(task_id, file_id).state
                        == pb.ENTRY_STATE_VERIFIED)

    def close(self) -> None:
        for w in self.watchers:
            w.stop()
        self.client.close()
        self.registry.stop()
        self.etcd.stop()

    def log_tail(self, n: int = 30) -> str:
        return self.etcd.log_tail(n)


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    made: list[Stack] = []

    def make(*flags: str) -> Stack:
        made.append(Stack(tmp_path, *flags))
        return made[-1]

    yield make
    for s in made:
        s.close()


def idle_across_compactions(stack: Stack, w: Watcher, wait_for: Callable[..., None],
                            resumes: int = 3) -> int:
    """Serve an idle task; move etcd's revision on until the revision the task's stream
    started after is compacted, then until its stream has been resumed ``resumes`` more
    times (or has taken another snapshot). The watcher's reconciliations once the
    task was served (those of its start done)."""
    stack.client.operator.create_task({"task_id": "idle", "entries": [
        {"file_id": f"f{i}", "path": f"f{i}.bin"} for i in range(3)]})
    wait_for(lambda: w.metrics.get("stream_snapshots") >= 1, what="the task's snapshot")
    wait_for(lambda: not w._reconcile_now.is_set(), what="the start's reconciliations")
    reconciled = w.metrics.get("reconciliations")
    started = stack.tick()
    wait_for(lambda: stack.tick() > 0 and stack.compacted(started), timeout=20,
             what="etcd compacting past the stream's start")
    before = w.metrics.get("stream_resumes")
    wait_for(lambda: stack.tick() > 0 and (
        w.metrics.get("stream_resumes") >= before + resumes
        or w.metrics.get("stream_snapshots") > 1), timeout=20,
        what=f"{resumes} more resumes of the stream")
    return reconciled


def test_an_idle_tasks_stream_resumes_after_compaction_without_a_snapshot(
        stack_factory: Callable[..., Stack], wait_for: Callable[..., None]) -> None:
    """With etcd's progress notifications, an idle task's stream ended by a timer
    (``stream_timeout``) is resumed across compactions from where it stood: one
    snapshot in all, no reconciliation asked for."""
    stack = stack_factory(*COMPACTING, *NOTIFYING)
    w = stack.watcher(stream_timeout=1.0)
    reconciled = idle_across_compactions(stack, w, wait_for)
    assert w.metrics.get("stream_snapshots") == 1
    assert w.metrics.get("stream_resumes") >= 3
    assert w.metrics.get("reconciliations") == reconciled


def test_a_silent_stream_is_resumed_and_caught_up_without_a_snapshot(
        stack_factory: Callable[..., Stack], wait_for: Callable[..., None]) -> None:
    """Without progress notifications (etcd's default 10 minutes: as from a registry
    that sends none), an idle stream says nothing: it is resumed each time the
    silence limit passes, from a compacted revision, and the registry catches it up
    (what was written since). No second snapshot, no reconciliation asked for, and a
    file committed between two silences is verified."""
    stack = stack_factory(*COMPACTING)
    w = stack.watcher()
    reconciled = idle_across_compactions(stack, w, wait_for)
    assert w.metrics.get("stream_resumes") == w.metrics.get("stream_silences") >= 3
    silences = w.metrics.get("stream_silences")
    data = stack.put("idle", "f1")
    wait_for(stack.verified("idle", "f1"), what="f1 verified")
    assert stack.client.operator.get_entry("idle", "f1").digest == blake3.blake3(data).hexdigest()
    wait_for(lambda: w.metrics.get("stream_silences") >= silences + 2,
             timeout=4 * SILENCE, what="two more silences, each within the limit")
    stack.put("idle", "f2")
    wait_for(stack.verified("idle", "f2"), what="f2 verified")
    assert w.metrics.get("stream_snapshots") == 1
    assert w.metrics.get("reconciliations") == reconciled


def test_the_streams_of_idle_tasks_share_one_thread(
        stack_factory: Callable[..., Stack], wait_for: Callable[..., None]) -> None:
    """However many tasks a watcher serves, their streams run on the one thread of
    the client's event loop; their news is handled on a few threads, not one per
    task."""
    stack = stack_factory(*NOTIFYING)
    w = stack.watcher()
    before = {t.ident for t in threading.enumerate()}
    tasks = 3 * NEWS_WORKERS
    for n in range(tasks):
        stack.client.operator.create_task({"task_id": f"t{n}", "entries": [
            {"file_id": "a", "path": "a.bin"}]})
    wait_for(lambda: w.metrics.get("stream_snapshots") >= tasks, what="every snapshot")
    assert sorted(w.table.task_ids()) == sorted(f"t{n}" for n in range(tasks))
    threads = threading.enumerate()
    assert [t.name for t in threads if t.name == "baton-streams"] == ["baton-streams"]
    new = [t.name for t in threads if t.ident not in before and t.name.startswith(
        ("watcher", "baton"))]
    assert len(new) <= NEWS_WORKERS and all(n.startswith("watcher-news") for n in new), new
    stack.put("t0", "a")
    wait_for(stack.verified("t0", "a"), what="t0/a verified")


def test_an_idle_stream_lasts_across_compactions(
        stack_factory: Callable[..., Stack], wait_for: Callable[..., None]) -> None:
    """With progress notifications, an idle task's stream is neither ended nor resumed
    while etcd compacts past the revision it started from, several times over, for
    longer than several silence limits (and the timer streams once had); a file
    committed afterwards comes on that same stream and is verified."""
    stack = stack_factory(*COMPACTING, *NOTIFYING)
    w = stack.watcher()
    stack.client.operator.create_task({"task_id": "idle", "entries": [
        {"file_id": f"f{i}", "path": f"f{i}.bin"} for i in range(3)]})
    wait_for(lambda: w.metrics.get("stream_snapshots") >= 1, what="the task's snapshot")
    for _ in range(4):  # four compactions, each past a revision written after the last
        revision = stack.tick()
        wait_for(lambda r=revision: stack.tick() > 0 and stack.compacted(r), timeout=20,
                 what="etcd compacting past the last tick")
    assert w.metrics.get("stream_resumes") == 0
    assert w.metrics.get("stream_silences") == 0
    assert w.metrics.get("stream_snapshots") == 1
    data = stack.put("idle", "f0")
    wait_for(stack.verified("idle", "f0"), what="f0 verified")
    assert stack.client.operator.get_entry("idle", "f0").digest == blake3.blake3(data).hexdigest()
    assert w.metrics.get("stream_resumes") == 0
    assert w.metrics.get("stream_snapshots") == 1


def test_a_stream_silenced_by_a_stuck_registry_is_resumed_and_loses_nothing(
        stack_factory: Callable[..., Stack], wait_for: Callable[..., None]) -> None:
    """A registry that stops answering (its event loop held, the connection still up)
    sends no progress: the stream is resumed within the silence limit, again until the
    registry answers, then goes on from its revision; no snapshot, nothing lost."""
    stack = stack_factory(*NOTIFYING)
    w = stack.watcher()
    stack.client.operator.create_task({"task_id": "idle", "entries": [
        {"file_id": f"f{i}", "path": f"f{i}.bin"} for i in range(2)]})
    wait_for(lambda: w.metrics.get("stream_snapshots") >= 1, what="the task's snapshot")
    stack.put("idle", "f0")
    wait_for(stack.verified("idle", "f0"), what="f0 verified")
    assert w.metrics.get("stream_silences") == 0
    with stack.registry.held():
        wait_for(lambda: w.metrics.get("stream_silences") >= 2, timeout=4 * SILENCE,
                 what="the silent stream resumed twice")
    data = stack.put("idle", "f1")
    wait_for(stack.verified("idle", "f1"), what="f1 verified")
    assert stack.client.operator.get_entry("idle", "f1").digest == blake3.blake3(data).hexdigest()
    assert w.metrics.get("stream_snapshots") == 1


def test_a_caught_up_resume_is_sent_what_was_written_since(
        stack_factory: Callable[..., Stack], wait_for: Callable[..., None]) -> None:
    """A Watch resumed with catch_up from a compacted revision is sent, as changes,
    the entries written since that revision as they are now (not the others), then
    goes on with the task's changes."""
    stack = stack_factory(*COMPACTING)
    stack.client.operator.create_task({"task_id": "t", "entries": [
        {"file_id": f, "path": f} for f in ("a", "b", "c")]})
    old = stack.tick()
    with stack.client.open_session("producer", ttl=10) as session:
        stack.client.claim("t", "b", session=session)
        wait_for(lambda: stack.tick() > 0 and stack.compacted(old + 1), timeout=20,
                 what="a compaction past the resume's revision")
        events = stack.client.watch("t", start_revision=old + 1, timeout=10,
                                    catch_up=True)
        first = next(events)
        assert (first.kind, first.entry.file_id) == (pb.TaskEvent.KIND_CHANGED, "b")
        assert first.entry.state == pb.ENTRY_STATE_WRITING
        stack.client.claim("t", "c", session=session)
        second = next(events)
        events.close()
    assert (second.kind, second.entry.file_id) == (pb.TaskEvent.KIND_CHANGED, "c")


def test_a_resume_from_a_compacted_revision_raises_compacted(
        stack_factory: Callable[..., Stack], wait_for: Callable[..., None]) -> None:
    """A Watch resumed from a compacted revision fails with Compacted (an Unavailable
    older clients still see as such)."""
    stack = stack_factory(*COMPACTING)
    stack.client.operator.create_task({"task_id": "t", "entries": [{"file_id": "a", "path": "a"}]})
    old = stack.tick()
    wait_for(lambda: stack.tick() > 0 and stack.compacted(old), timeout=20,
             what="a compaction")
    with pytest.raises(errors.Compacted) as caught:
        list(stack.client.watch("t", start_revision=old, timeout=5))
    assert isinstance(caught.value, errors.Unavailable)


def test_progress_events_go_only_to_streams_that_ask(
        stack_factory: Callable[..., Stack]) -> None:
    """An idle stream that asks is told its revision now and then, each past the
    last; one that does not ask (an older client) sees only the task's changes."""
    stack = stack_factory(*NOTIFYING)
    stack.client.operator.create_task({"task_id": "t", "entries": [{"file_id": "a", "path": "a"}]})
    plain = stack.client.watch("t", start_revision=-1, timeout=20)
    assert next(plain).kind == pb.TaskEvent.KIND_SYNCED
    told = stack.client.watch("t", start_revision=-1, timeout=20, progress=True)
    synced = next(told)
    assert synced.kind == pb.TaskEvent.KIND_SYNCED
    revisions: list[int] = []
    moved = stack.tick()  # the revision moves on; the task does not change
    reached = 0
    for ev in told:
        assert ev.kind == pb.TaskEvent.KIND_PROGRESS and not ev.HasField("entry")
        # never back: a notification sent before the tick may still name an earlier one
        assert ev.revision >= (revisions[-1] if revisions else synced.revision)
        revisions.append(ev.revision)
        if ev.revision >= moved:  # told of the tick, though the task did not change
            reached += 1
            if reached == 2:
                break
            moved = stack.tick()
    told.close()
    with stack.client.open_session("producer", ttl=10) as session:
        stack.client.claim("t", "a", session=session)
    first: Any = next(plain)
    plain.close()
    assert first.kind == pb.TaskEvent.KIND_CHANGED and first.entry.file_id == "a"
