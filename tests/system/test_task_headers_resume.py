"""The task headers' stream resumes where it stood (issue 39): progress messages keep
its revision current while no header changes, a resume sends only the headers written
since, and a resume from a revision etcd compacted is caught up, not refused.

Each test runs its own etcd that compacts every second (and, where it says so, tells
idle watches their revision every 200 ms); unrelated writes move etcd's revision on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from compacting import COMPACTING, compacted, start_etcd, tick
from registry_fixtures import TEST_RETRY, RegistryHandle, on_etcd, start_registry

from baton_relay.client import Client
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import EtcdProcess
from baton_relay.registry.store.etcd import Etcd

NOTIFYING = ("--experimental-watch-progress-notify-interval=200ms",)


class Headers:
    """An etcd of the test's own, a registry on it, a client."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.etcd: EtcdProcess = start_etcd(tmp_path, *flags)
        self.staging = tmp_path / "staging"
        self.staging.mkdir()
        self.registry: RegistryHandle = start_registry(self.etcd.endpoint, "/baton-heads/",
                                                       self.staging)
        self.client = Client(self.registry.address, timeout=10, retry=TEST_RETRY)

    def create(self, task_id: str) -> None:
        self.client.operator.create_task({"task_id": task_id, "entries": [
            {"file_id": "a", "path": "a"}]})

    def stream(self, start_revision: int = 0, progress: bool = True
               ) -> Iterator[pb.WatchTasksResponse]:
        """The raw WatchTasks replies (20 s at most)."""
        call = self.client._method("WatchTasks")(
            pb.WatchTasksRequest(start_revision=start_revision, progress=progress),
            timeout=20)
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise
        finally:
            call.cancel()

    def restart(self) -> None:
        """The registry stopped, and another started on its address."""
        self.registry.stop()
        self.registry = start_registry(self.etcd.endpoint, "/baton-heads/", self.staging,
                                       listen=self.registry.address)
        # the client's channel reconnects on gRPC's own backoff (a second or more after
        # the refused attempts of the stop), longer than the tests' short retry policy
        grpc.channel_ready_future(self.client._channel).result(timeout=20)

    def tick(self) -> int:
        return on_etcd(self.etcd, tick)

    def compacted(self, revision: int) -> bool:
        async def read(etcd: Etcd) -> bool:
            return await compacted(etcd, revision)
        return on_etcd(self.etcd, read)

    def close(self) -> None:
        self.client.close()
        self.registry.stop()
        self.etcd.stop()

    def log_tail(self, n: int = 30) -> str:
        return self.etcd.log_tail(n)


@pytest.fixture
def heads(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Headers]:
    flags = getattr(request, "param", ())
    h = Headers(tmp_path, *COMPACTING, *flags)
    yield h
    h.close()


@pytest.mark.parametrize("heads", [NOTIFYING], indirect=True)
def test_an_idle_header_stream_is_told_its_revision_and_resumes_with_nothing_resent(
        heads: Headers, wait_for: object) -> None:
    """After the snapshot a progress message names the snapshot's revision; while no
    header changes, later ones move on with etcd's revision; a resume from there, once
    etcd has compacted past the snapshot, sends no header until one changes."""
    for t in ("t1", "t2"):
        heads.create(t)
    stream = heads.stream()
    snapshot = [next(stream), next(stream)]
    assert sorted(r.task.spec.task_id for r in snapshot) == ["t1", "t2"]
    assert all(r.revision > 0 for r in snapshot)
    synced = next(stream)
    assert not synced.HasField("task") and synced.revision >= max(r.revision for r in snapshot)
    moved = heads.tick()
    last = synced.revision
    for reply in stream:
        assert not reply.HasField("task"), "no header changed"
        assert reply.revision >= last
        last = reply.revision
        if last >= moved:
            break
    stream.close()  # type: ignore[attr-defined]
    while not heads.compacted(synced.revision + 1):
        heads.tick()
    resumed = heads.stream(start_revision=last + 1)
    heads.client.operator.pause_task("t2", reason="a change after the resume point")
    first = next(reply for reply in resumed if reply.HasField("task"))
    resumed.close()  # type: ignore[attr-defined]
    assert first.task.spec.task_id == "t2" and first.revision > last


def test_a_resume_from_a_compacted_revision_sends_only_what_changed_since(
        heads: Headers) -> None:
    """A resume from a revision etcd has compacted (a long partition) is sent the
    headers written since that revision, as they are now, then a progress message
    and the changes that follow; the headers that did not change are not sent."""
    heads.create("old")
    since = heads.tick() + 1
    heads.create("new")
    while not heads.compacted(since):
        heads.tick()
    stream = heads.stream(start_revision=since)
    first = next(stream)
    assert first.task.spec.task_id == "new" and first.revision >= since
    caught_up = next(stream)
    assert not caught_up.HasField("task") and caught_up.revision >= first.revision
    heads.client.operator.pause_task("old", reason="changed after the catch-up")
    later = next(reply for reply in stream if reply.HasField("task"))
    stream.close()  # type: ignore[attr-defined]
    assert later.task.spec.task_id == "old"


def test_a_stream_without_progress_is_headers_only_as_before(heads: Headers) -> None:
    """A client that asks for no progress (an older one) is sent headers only."""
    heads.create("t")
    stream = heads.stream(progress=False)
    first = next(stream)
    heads.client.operator.pause_task("t", reason="a change")
    second = next(stream)
    stream.close()  # type: ignore[attr-defined]
    assert first.HasField("task") and second.HasField("task")
    assert second.task.status == pb.TASK_STATUS_PAUSED


def test_follow_tasks_resumes_after_the_registry_restarts_without_resending(
        heads: Headers, wait_for: object) -> None:
    """The client's follow_tasks sends each header once, survives the registry going
    away and coming back, and after that sends only the headers that changed."""
    heads.create("a")
    heads.create("b")
    stop = threading.Event()
    seen: list[str] = []
    lost: list[BaseException] = []

    def follow() -> None:
        for task in heads.client.operator.follow_tasks(stop, retry=0.05, on_lost=lost.append):
            seen.append(f"{task.spec.task_id}:{pb.TaskStatus.Name(task.status)}")

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    wait_for(lambda: len(seen) == 2, what="the snapshot")  # type: ignore[operator]
    heads.restart()
    heads.client.operator.pause_task("b", reason="while followed")
    wait_for(lambda: len(seen) == 3, what="the change after the restart")  # type: ignore[operator]
    stop.set()
    heads.client.operator.pause_task("a", reason="after the stop: not followed")
    thread.join(10)
    assert sorted(seen[:2]) == ["a:TASK_STATUS_ACTIVE", "b:TASK_STATUS_ACTIVE"]
    assert seen[2] == "b:TASK_STATUS_PAUSED"
    assert lost, "the restart broke the stream once at least"
