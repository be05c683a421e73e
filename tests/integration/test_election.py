"""The archiver election (registry/rules/election.py) between two real registry replicas on
one real etcd: one archives at a time, a replica that stops or whose lease ends is
replaced within the lease's TTL, and every finished task is archived once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import RegistryHandle, on_etcd, produce_verified

from baton_relay.client import Client
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.rules.election import Election
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.sweeps.archive import Archiver, DirectoryStore

Wait = Callable[..., None]
TTL = 2


def election(registry: RegistryHandle) -> Election:
    archiver = registry._running.core.archive
    assert isinstance(archiver, Archiver) and archiver.election is not None
    return archiver.election


def leaders(replicas: list[RegistryHandle]) -> list[RegistryHandle]:
    return [r for r in replicas if not r.stopped and election(r).is_leader]


@pytest.fixture
def replicas(registry_factory: Callable[..., RegistryHandle], tmp_path: Path
             ) -> list[RegistryHandle]:
    """Two replicas sharing one directory store, with a short election lease."""
    return [registry_factory(archive_dir=str(tmp_path / "archive"), archive_lease_ttl=TTL,
                             archive_interval=0.2, archive_after=0.0) for _ in range(2)]


def watch_leaders(replicas: list[RegistryHandle], stop: threading.Event,
                  seen: list[int]) -> threading.Thread:
    """Sample how many replicas believe they lead, until ``stop``."""
    def sample() -> None:
        while not stop.is_set():
            seen.append(len(leaders(replicas)))
            stop.wait(0.005)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    return thread


def test_one_leader_and_a_stopped_one_is_replaced(
    replicas: list[RegistryHandle], wait_for: Wait,
) -> None:
    """Exactly one replica leads; when it stops (resigning), the other leads at once,
    and never are two leading at the same time."""
    wait_for(lambda: len(leaders(replicas)) == 1, what="one leader")
    stop, seen = threading.Event(), []
    sampler = watch_leaders(replicas, stop, seen)
    first = leaders(replicas)[0]
    other = next(r for r in replicas if r is not first)
    started = time.monotonic()
    first.stop()
    wait_for(lambda: election(other).is_leader, timeout=TTL, what="the other replica leads")
    assert time.monotonic() - started < TTL
    stop.set()
    sampler.join()
    assert max(seen) == 1


def test_a_leader_whose_lease_ends_is_replaced_within_the_ttl(
    replicas: list[RegistryHandle], wait_for: Wait,
) -> None:
    """The leader's lease revoked in etcd (as when it dies): it stops leading, and the
    other replica leads within the lease's TTL."""
    wait_for(lambda: len(leaders(replicas)) == 1, what="one leader")
    first = leaders(replicas)[0]
    other = next(r for r in replicas if r is not first)
    lease = election(first)._lease

    async def revoke(etcd: Etcd) -> None:
        await etcd.revoke(lease)

    on_etcd(first.etcd, revoke)
    wait_for(lambda: election(other).is_leader, timeout=TTL + 1, what="the other leads")
    wait_for(lambda: not election(first).is_leader, timeout=TTL, what="the first steps down")
    # the first campaigns again, behind the new leader
    wait_for(lambda: election(first)._lease not in (0, lease), what="a new campaign")
    assert leaders(replicas) == [other]


def test_every_finished_task_is_archived_once(
    replicas: list[RegistryHandle], wait_for: Wait, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both replicas' archivers run; only the leader writes, each task's archive once."""
    writes: list[str] = []
    real_write = DirectoryStore.write

    def counted(self: DirectoryStore, task_id: str, *args: Any, **kw: Any) -> Any:
        writes.append(task_id)
        return real_write(self, task_id, *args, **kw)

    monkeypatch.setattr(DirectoryStore, "write", counted)
    wait_for(lambda: len(leaders(replicas)) == 1, what="one leader")
    with Client(replicas[0].address, timeout=10) as client, \
            client.open_session("p", ttl=10) as session:
        ids = [f"t{i}" for i in range(6)]
        for task_id in ids:
            client.operator.create_task({"task_id": task_id,
                                         "entries": [{"file_id": "a", "path": "a.bin"}]})
            produce_verified(client, session, task_id, "a")
            lease = client.consume(task_id, "default", "a", session=session)
            client.ack(task_id, "a", "default", lease.token, session=session)
        wait_for(lambda: all(client.operator.get_task(t).status == pb.TASK_STATUS_ARCHIVED
                             for t in ids),
                 timeout=30, what="every task archived")
    assert sorted(writes) == sorted(ids)
    archived = [r._running.core.archive.archived for r in replicas]  # type: ignore[union-attr]
    assert sorted(archived) == [0, len(ids)]
