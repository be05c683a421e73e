"""Acceptance: two registry processes on one etcd archive 200 finished tasks to one S3
server (moto's); the archiving replica is killed mid-run and the other takes over;
each task is archived once, readable from both replicas, and etcd keeps headers only."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import allow_suite_etcd, on_etcd, produce_verified
from s3_fixtures import S3Server, free_port
from test_metrics import scrape

from baton_relay.client import Client
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import Keys

TASKS = 200
Wait = Callable[..., None]


class Replica:
    """A registry process archiving to the test's bucket."""

    def __init__(self, etcd: str, prefix: str, staging: Path, endpoint: str,
                 bucket: str) -> None:
        self.metrics = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "baton_relay.registry", "--insecure", "--etcd", etcd,
             *allow_suite_etcd(), "--listen", "127.0.0.1:0", "--staging", str(staging),
             "--prefix", prefix, "--metrics", f"127.0.0.1:{self.metrics}",
             "--archive-s3-bucket", bucket, "--archive-s3-prefix", "archive/",
             "--archive-s3-endpoint", endpoint, "--archive-after", "0",
             "--archive-interval", "0.2", "--archive-lease-ttl", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=os.environ)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line, f"registry did not start: {line!r}"
        self.address = line.split()[-1]

    def leads(self) -> bool:
        return self.proc.poll() is None and \
            scrape(self.metrics).value("baton_archiver_leader") == 1

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def replicas(etcd: Any, prefix: str, staging: Path, s3_server: S3Server, bucket: str
             ) -> Iterator[Callable[[], Replica]]:
    made: list[Replica] = []

    def start() -> Replica:
        made.append(Replica(etcd.endpoint, prefix, staging, s3_server.endpoint, bucket))
        return made[-1]

    yield start
    for r in made:
        r.stop()


def keys_outside_election(etcd: Any, prefix: str) -> list[bytes]:
    """Every key under the prefix (paged) but the election's and the outcomes of calls
    kept for retries, which are leased (``txn.REQUEST_TTL``) and go with their lease."""
    async def read(client: Etcd) -> list[bytes]:
        out: list[bytes] = []
        async for kv in client.scan(prefix.encode()):
            if kv.key.startswith(f"{prefix}requests/".encode()):
                assert kv.lease, f"{kv.key!r} has no lease: it would stay"
            elif not kv.key.startswith(f"{prefix}election/".encode()):
                out.append(kv.key)
        return out
    return on_etcd(etcd, read, timeout=30)


@pytest.mark.slow
def test_two_replicas_archive_200_tasks_once_through_a_leader_kill(
    replicas: Callable[[], Replica], etcd: Any, prefix: str, s3_server: S3Server,
    bucket: str, wait_for: Wait,
) -> None:
    """200 tasks finish; the archiving replica is killed mid-run; every task ends archived
    exactly once, readable from both replicas, and etcd keeps only their headers."""
    s3 = s3_server.client()
    # Versioning: every PUT of an archive stays countable.
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    a, b = replicas(), replicas()
    wait_for(lambda: [a.leads(), b.leads()].count(True) == 1, what="one archiver")
    leader, other = (a, b) if a.leads() else (b, a)
    baseline = set(keys_outside_election(etcd, prefix))
    ids = [f"t{i:03}" for i in range(TASKS)]
    killed = False
    with Client(other.address, timeout=10) as client, \
            client.open_session("pipeline", ttl=10) as session:
        for n, task_id in enumerate(ids):
            client.operator.create_task({"task_id": task_id,
                                         "entries": [{"file_id": "a", "path": "a.bin"}]})
            produce_verified(client, session, task_id, "a")
            lease = client.consume(task_id, "default", "a", session=session)
            client.ack(task_id, "a", "default", lease.token, session=session)
            if n == TASKS // 2:
                # mid-run: once the leader has archived some, it dies
                wait_for(lambda: scrape(leader.metrics).value("baton_tasks_archived_total") > 0,
                         what="the leader archiving")
                leader.stop()
                killed = True
        assert killed
        wait_for(other.leads, timeout=5, what="the other replica takes over within the TTL")
        wait_for(lambda: all(t.status == pb.TASK_STATUS_ARCHIVED
                             for t in client.operator.list_tasks(archived=True)) and
                 len(client.operator.list_tasks(archived=True)) == TASKS,
                 timeout=120, what="every task archived")
    restarted = replicas()
    for address in (other.address, restarted.address):
        with Client(address, timeout=10) as reader:
            for task_id in ids:
                assert reader.operator.get_task(task_id).status == pb.TASK_STATUS_ARCHIVED
                (entry,) = reader.operator.list_entries(task_id)
                assert entry.state == pb.ENTRY_STATE_CONSUMED
    versions: dict[str, int] = {}
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
        for v in page.get("Versions", ()):
            versions[v["Key"]] = versions.get(v["Key"], 0) + 1
        assert not page.get("DeleteMarkers")
    data = {k: n for k, n in versions.items() if k.endswith(".jsonl.gz")}
    assert sorted(data) == [f"archive/{t}.jsonl.gz" for t in ids]
    # Once each; only a task the killed leader was writing may have been written again.
    assert sum(data.values()) <= TASKS + 1, {k: n for k, n in data.items() if n > 1}
    # etcd back to its baseline plus one header per archived task, nothing else
    left = keys_outside_election(etcd, prefix)
    assert sorted(left) == sorted(baseline | {Keys(prefix).task(t) for t in ids})
