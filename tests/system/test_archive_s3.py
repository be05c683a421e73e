"""The S3 archive store against a real S3-compatible server (moto's, a process): written
whole or not at all, the same bytes whoever writes them, checksum checked on read; an
unreachable store is a clear error and the task stays in etcd."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from registry_fixtures import RegistryHandle
from s3_fixtures import S3Server, keys
from test_archive import finish, on_loop, task_keys

from baton_relay.client import Client
from baton_relay.kernel.errors import BatonError
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.edge.config import load_config
from baton_relay.registry.records.archive_store import ArchiveCorrupt
from baton_relay.registry.sweeps.archive_s3 import ArchiveStoreUnavailable, S3Store

RECORDS = [{"kind": "entry", "file_id": f"f{i}", "n": i} for i in range(50)]


def store(server: S3Server, bucket: str, prefix: str = "archive/") -> S3Store:
    return S3Store(bucket, prefix, server.endpoint, timeout=5)


def test_an_archive_round_trips_through_s3(s3_server: S3Server, bucket: str) -> None:
    """Written, listed, checked, read back in order and deleted, on a real S3 server."""
    s = store(s3_server, bucket)
    info = s.write("t1", 41, iter(RECORDS), header_revision=40)
    assert (info.records, info.revision, info.header_revision) == (50, 41, 40)
    assert info.location == f"s3://{bucket}/archive/t1.jsonl.gz"
    assert keys(s3_server, bucket) == ["archive/t1.jsonl.gz", "archive/t1.meta.json"]
    assert s.info("t1") == info
    assert list(s.read("t1")) == RECORDS
    assert [i.task_id for i in s.list()] == ["t1"]
    assert s.info("t2") is None
    s.delete("t1")
    assert keys(s3_server, bucket) == [] and s.info("t1") is None and s.list() == []


def test_the_same_records_make_the_same_bytes(s3_server: S3Server, bucket: str) -> None:
    """Two writers of one task's records store identical objects (no name/time in gzip)."""
    a = store(s3_server, bucket, "a/").write("t1", 1, iter(RECORDS))
    b = store(s3_server, bucket, "b/").write("t1", 1, iter(RECORDS))
    assert (a.digest, a.size) == (b.digest, b.size)
    c = s3_server.client()
    assert c.get_object(Bucket=bucket, Key="a/t1.jsonl.gz")["Body"].read() == \
        c.get_object(Bucket=bucket, Key="b/t1.jsonl.gz")["Body"].read()


def test_list_pages_past_one_thousand_objects(s3_server: S3Server, bucket: str) -> None:
    """``list`` reads every page of the bucket listing, not the first 1000 keys."""
    s = store(s3_server, bucket)
    c = s3_server.client()
    meta = json.dumps({"task_id": "x", "location": "", "digest": "", "size": 0,
                       "records": 0, "revision": 1, "created_at": ""})
    for i in range(1001):  # 1001 meta objects: more than one page
        c.put_object(Bucket=bucket, Key=f"archive/t{i:04}.meta.json", Body=meta)
    assert len(s.list()) == 1001


def test_a_write_that_fails_midway_leaves_nothing(s3_server: S3Server, bucket: str) -> None:
    """Records that stop with an error midway: no object under the final key, no
    temporary object, and the task's earlier archive is no longer an archive."""
    s = store(s3_server, bucket)
    s.write("t1", 1, iter(RECORDS))

    def failing() -> Iterator[dict[str, Any]]:
        yield from RECORDS[:10]
        raise RuntimeError("etcd went away")

    with pytest.raises(RuntimeError, match="etcd went away"):
        s.write("t2", 2, failing())
    assert keys(s3_server, bucket) == ["archive/t1.jsonl.gz", "archive/t1.meta.json"]
    assert s.info("t2") is None


def test_a_bucket_that_refuses_leaves_nothing(s3_server: S3Server, bucket: str) -> None:
    """A write the server refuses (no such bucket) is a clear error naming the place."""
    s = store(s3_server, bucket + "-missing")
    with pytest.raises(ArchiveStoreUnavailable, match="NoSuchBucket"):
        s.write("t1", 1, iter(RECORDS))
    assert keys(s3_server, bucket) == []


def test_the_server_stopping_mid_write_is_an_error(tmp_path: Any) -> None:
    """The S3 server killed while the records are read: the write fails with a clear
    error; a new server (same endpoint) holds nothing of it."""
    from s3_fixtures import start_s3_server
    server = start_s3_server()
    try:
        server.client().create_bucket(Bucket="baton-stop")
        s = store(server, "baton-stop")

        def records() -> Iterator[dict[str, Any]]:
            yield from RECORDS[:10]
            server.stop()  # the store goes away mid-write
            yield from RECORDS[10:]

        with pytest.raises(ArchiveStoreUnavailable, match="cannot"):
            s.write("t1", 1, records())
    finally:
        server.stop()


def test_a_corrupt_object_is_detected_on_read(s3_server: S3Server, bucket: str) -> None:
    """An archive whose object changed after it was written fails its BLAKE3 check."""
    s = store(s3_server, bucket)
    s.write("t1", 1, iter(RECORDS))
    c = s3_server.client()
    body = bytearray(c.get_object(Bucket=bucket, Key="archive/t1.jsonl.gz")["Body"].read())
    body[len(body) // 2] ^= 0xFF
    c.put_object(Bucket=bucket, Key="archive/t1.jsonl.gz", Body=bytes(body))
    with pytest.raises(ArchiveCorrupt, match="does not match its checksum"):
        s.info("t1")
    c.delete_object(Bucket=bucket, Key="archive/t1.jsonl.gz")
    with pytest.raises(ArchiveCorrupt, match="is missing"):
        s.info("t1")


def test_unreachable_endpoint_is_a_clear_error() -> None:
    """Nothing listening at the endpoint: every call is an ArchiveStoreUnavailable."""
    s = S3Store("b", "", "http://127.0.0.1:9", timeout=1)
    with pytest.raises(ArchiveStoreUnavailable, match=r"cannot (delete|write) s3://b/t1"):
        s.write("t1", 1, iter(RECORDS))
    with pytest.raises(ArchiveStoreUnavailable, match="cannot read"):
        s.info("t1")


def test_directory_and_s3_together_are_refused() -> None:
    """One store, not two: both flags set is refused with a clear error."""
    with pytest.raises(BatonError, match="not both"):
        load_config(["--archive-dir", "/x", "--archive-s3-bucket", "b"], {})
    with pytest.raises(BatonError, match="need --archive-s3-bucket"):
        load_config(["--archive-s3-prefix", "p/"], {})
    config = load_config([], {"BATON_ARCHIVE_S3_BUCKET": "b",
                              "BATON_ARCHIVE_S3_ENDPOINT": "http://s3:9000"})
    assert (config.archive_s3_bucket, config.archive_s3_endpoint) == ("b", "http://s3:9000")


def test_a_registry_archives_to_s3_and_reads_it_back(
    registry_factory: Callable[..., RegistryHandle], s3_server: S3Server, bucket: str,
    wait_for: Callable[..., None],
) -> None:
    """A registry with --archive-s3-bucket archives a finished task to the bucket and
    answers reads of it from there."""
    registry = registry_factory(archive_s3_bucket=bucket, archive_s3_prefix="tasks/",
                                archive_s3_endpoint=s3_server.endpoint)
    with Client(registry.address, timeout=10) as client, \
            client.open_session("s3", ttl=10) as session:
        finish(client, session, "t1", wait_for)
        entries = client.operator.list_entries("t1")
        assert client.operator.archive_task("t1").status == pb.TASK_STATUS_ARCHIVED
        assert keys(s3_server, bucket) == ["tasks/t1.jsonl.gz", "tasks/t1.meta.json"]
        assert [e.digest for e in client.operator.list_entries("t1")] == [e.digest for e in entries]
        assert client.operator.get_task("t1").status == pb.TASK_STATUS_ARCHIVED


def test_an_unreachable_store_keeps_the_task_in_etcd(
    registry_factory: Callable[..., RegistryHandle], s3_server: S3Server, bucket: str,
    wait_for: Callable[..., None],
) -> None:
    """The store becomes unreachable before a finished task is archived: archiving it
    fails with a clear error naming the store, and etcd keeps every key of the task."""
    registry = registry_factory(archive_s3_bucket=bucket, archive_s3_endpoint=s3_server.endpoint)
    archiver = registry._running.core.archive
    assert archiver is not None
    with Client(registry.address, timeout=30) as client, \
            client.open_session("s3", ttl=10) as session:
        finish(client, session, "t1", wait_for)
        before = task_keys(registry, "t1")
        archiver.store = S3Store(bucket, "", "http://127.0.0.1:9", timeout=1)  # nobody there
        with pytest.raises(BatonError, match=r"archive store: cannot .* s3://"):
            on_loop(registry, archiver.archive("t1"))
        assert task_keys(registry, "t1") == before
        # marked as being archived (the next sweep finishes it), every entry still there
        assert client.operator.get_task("t1").status == pb.TASK_STATUS_ARCHIVING
        assert len(client.operator.list_entries("t1")) == 3
