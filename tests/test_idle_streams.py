"""Watch streams at rest: an idle task's stream survives etcd's compaction (issue 39).

Each test runs its own etcd that compacts every second and, where the test says so,
tells idle watches their revision every 200 ms; the watcher's streams last one second.
Unrelated writes move etcd's revision on while the task stays idle, as a live stack's
do (heartbeats, other tasks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from compacting import COMPACTING, compacted, start_etcd, tick
from registry_fixtures import TEST_RETRY, RegistryHandle, on_etcd, start_registry

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry._etcd import Etcd
from baton_relay.watcher import Watcher, WatcherConfig, start_watcher

#: etcd tells idle watches their revision every 200 ms
NOTIFYING = ("--experimental-watch-progress-notify-interval=200ms",)


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

    def watcher(self) -> Watcher:
        config = WatcherConfig(registry=self.registry.address, staging=str(self.staging),
                               stream_timeout=1.0, reconcile_interval=300.0,
                               retry_delay=0.05, poll_interval=0.1)
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
    stack.client.create_task({"task_id": "idle", "entries": [
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
    """With etcd's progress notifications, an idle task's stream is resumed across
    compactions from where it stood: one snapshot in all, no reconciliation asked for."""
    stack = stack_factory(*COMPACTING, *NOTIFYING)
    w = stack.watcher()
    reconciled = idle_across_compactions(stack, w, wait_for)
    assert w.metrics.get("stream_snapshots") == 1
    assert w.metrics.get("stream_resumes") >= 3
    assert w.metrics.get("reconciliations") == reconciled


def test_a_resume_too_late_for_etcds_history_is_caught_up_without_a_snapshot(
        stack_factory: Callable[..., Stack], wait_for: Callable[..., None]) -> None:
    """Without progress notifications (etcd's default 10 minutes), an idle stream's
    resume is from a compacted revision: the registry catches it up (what was written
    since), and the watcher takes no second snapshot and asks for no reconciliation."""
    stack = stack_factory(*COMPACTING)
    w = stack.watcher()
    reconciled = idle_across_compactions(stack, w, wait_for)
    assert w.metrics.get("stream_snapshots") == 1
    assert w.metrics.get("stream_resumes") >= 3
    assert w.metrics.get("reconciliations") == reconciled


def test_a_caught_up_resume_is_sent_what_was_written_since(
        stack_factory: Callable[..., Stack], wait_for: Callable[..., None]) -> None:
    """A Watch resumed with catch_up from a compacted revision is sent, as changes,
    the entries written since that revision as they are now (not the others), then
    goes on with the task's changes."""
    stack = stack_factory(*COMPACTING)
    stack.client.create_task({"task_id": "t", "entries": [
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
    stack.client.create_task({"task_id": "t", "entries": [{"file_id": "a", "path": "a"}]})
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
    stack.client.create_task({"task_id": "t", "entries": [{"file_id": "a", "path": "a"}]})
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
