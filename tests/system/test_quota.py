"""etcd at its quota (``NOSPACE``): writes are refused with ``StorageFull`` (exit 6),
reads go on, finished tasks are archived with deletes only (freeing space), and once
space is freed and the alarm disarmed, work goes on and the archived tasks' headers
come back (a private etcd with a small ``--quota-backend-bytes``, a real registry,
a real archive directory)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner
from registry_fixtures import TEST_RETRY, RegistryHandle, on_etcd, start_registry
from test_archive import (
    Crash,
    archiver,
    finish,
    killed_at_second_chunk,
    on_loop,
    task_keys,
)

from baton_relay.client import Client
from baton_relay.client.cli import cli
from baton_relay.kernel.errors import IllegalTransition, StorageFull, TaskExists
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import EtcdProcess, etcd_version
from baton_relay.registry.store.etcd import Etcd, Guarded, Put
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.sweeps.archive import Archiver, DirectoryStore

QUOTA = ("--quota-backend-bytes=4194304",)  # 4 MiB
PREFIX = "/quota/"
#: entries of each cancelled task the archive tests free space with
BIG = 400


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    # BATON_TEST_ETCD picks the binary, as for the session's etcd (CI: 3.4 and 3.5).
    process = EtcdProcess(tmp_path / "etcd", log_path=tmp_path / "etcd.log", extra_args=QUOTA,
                          binary=os.environ.get("BATON_TEST_ETCD") or None)
    process.start()
    try:
        yield process
    finally:
        process.kill()


@pytest.fixture
def archive_dir(tmp_path: Path) -> Path:
    return tmp_path / "archive"


@pytest.fixture
def archiving(small_etcd: EtcdProcess, tmp_path: Path, archive_dir: Path
              ) -> Iterator[RegistryHandle]:
    """A registry on the small etcd that archives to ``archive_dir`` (its own sweep
    only at start: the tests run it when they mean to)."""
    handle = start_registry(small_etcd.endpoint, PREFIX, tmp_path / "s",
                            archive_dir=str(archive_dir), archive_interval=3600.0)
    try:
        yield handle
    finally:
        handle.stop()


async def _compact_defrag(etcd: Etcd) -> None:
    """`etcdctl compact` at the current revision, then `etcdctl defrag` (through etcd's
    own stubs)."""
    from aetcd import rpc

    channel = etcd._pick()
    _, revision, _ = await etcd.range(PREFIX.encode(), limit=1)
    try:
        await etcd._unary(channel.kv.Compact, rpc.CompactionRequest(revision=revision,
                                                                    physical=True))
    except grpc.aio.AioRpcError as e:  # compacted there already: nothing written since
        if e.code() != grpc.StatusCode.OUT_OF_RANGE:
            raise
    await etcd._unary(channel.maint.Defragment, rpc.DefragmentRequest())


async def _disarm(etcd: Etcd) -> list[int]:
    """`etcdctl alarm disarm`; the alarms that were raised."""
    from aetcd import rpc

    channel = etcd._pick()
    raised = await etcd._unary(channel.maint.Alarm, rpc.AlarmRequest(
        action=rpc.AlarmRequest.GET))
    for alarm in raised.alarms:
        await etcd._unary(channel.maint.Alarm, rpc.AlarmRequest(
            action=rpc.AlarmRequest.DEACTIVATE, memberID=alarm.memberID, alarm=alarm.alarm))
    return [a.alarm for a in raised.alarms]


async def compact_defrag_disarm(etcd: Etcd) -> None:
    """The runbook once space is freed: compact, defragment, disarm."""
    from aetcd import rpc

    await _compact_defrag(etcd)
    assert await _disarm(etcd) == [rpc.NOSPACE]


async def _free_and_disarm(etcd: Etcd) -> None:
    """What an operator does: delete what is not needed (deletes are still accepted),
    compact, defragment, then `etcdctl alarm disarm` (through etcd's own stubs)."""
    from aetcd import rpc

    from baton_relay.registry.store.keys import prefix_end

    channel = etcd._pick()
    kvs, _, _ = await etcd.range(b"/quota/tasks/", keys_only=True)
    for kv in kvs:
        task_id = kv.key.rsplit(b"/", 1)[-1]
        if task_id != b"fill-0":
            for kind in (b"entries", b"ready", b"open", b"journal"):
                key = b"/quota/" + kind + b"/" + task_id + b"/"
                await etcd._unary(channel.kv.DeleteRange, rpc.DeleteRangeRequest(
                    key=key, range_end=prefix_end(key)))
    await compact_defrag_disarm(etcd)


async def _history(etcd: Etcd) -> None:
    """1.6 MB of old revisions of one key, outside the registry's prefix: what
    compaction frees (as it frees a registry's old transitions)."""
    for n in range(16):
        await etcd.txn([], [Put(b"/elsewhere/history", bytes([n]) * 100_000)])


def history(endpoint: str) -> None:
    on_etcd(endpoint, _history)


async def _over_quota(etcd: Etcd) -> None:
    """etcd's database file over its quota, so that etcd 3.5 refuses every transaction.
    ``fill`` stops at the first put etcd refuses, which may leave the file just under the
    quota (etcd refuses a put whose size would cross it, then raises the alarm): puts
    nested in a transaction are not charged against the quota, so old revisions of one
    key outside the prefix (what compaction frees) are written that way until etcd
    refuses those too."""
    for n in range(100):
        try:
            await etcd.txn_group([Guarded([], [Put(b"/elsewhere/history",
                                                   bytes([n % 256]) * 100_000)])])
        except StorageFull:
            break
    else:
        raise AssertionError("etcd took 10 MB of nested puts past its 4 MiB quota")
    with pytest.raises(StorageFull):
        await etcd.txn([], [])


async def _deletes_accepted(etcd: Etcd) -> None:
    """Room for an archive's deletes, as the runbook makes it: compact and defragment
    (the alarm stays raised, so puts are still refused). etcd 3.5 refuses every
    transaction, deletes-only too, while its database file is over the quota, and the
    deletes themselves grow the file: a file just under the quota (a probe that passes)
    can pass it again in the middle of an archive. etcd 3.4 would apply them as it is;
    compacting there changes nothing the tests look at."""
    await _compact_defrag(etcd)
    await etcd.txn([], [])


@contextmanager
def crashing(monkeypatch: pytest.MonkeyPatch, cls: type,
             method: str) -> Iterator[None]:
    """Within: ``cls.method`` dies (``Crash``) as when the registry is killed there."""
    real = getattr(cls, method)

    def dies(self: Any, *args: Any) -> Any:
        raise Crash(f"killed in {cls.__name__}.{method}")

    monkeypatch.setattr(cls, method, dies)
    try:
        yield
    finally:
        monkeypatch.setattr(cls, method, real)


def fill(client: Client) -> int:
    """Create tasks until etcd refuses; how many were created."""
    n = 0
    with pytest.raises(StorageFull, match="database is full") as refused:
        while n < 200:
            client.operator.create_task({"task_id": f"fill-{n}", "labels": {"pad": "x" * 200},
                                         "entries": [{"file_id": f"f{i:04d}", "path": f"p/{i:04d}",
                                             "labels": {"pad": "y" * 200}}
                                            for i in range(500)]})
            n += 1
    assert "etcdctl alarm disarm" in str(refused.value)
    return n


def test_writes_are_refused_with_a_clear_error_and_reads_go_on(
    small_etcd: EtcdProcess, tmp_path: Path,
) -> None:
    registry: RegistryHandle = start_registry(small_etcd.endpoint, "/quota/", tmp_path / "s")
    try:
        with Client(registry.address, timeout=10, retry=TEST_RETRY) as client:
            created = fill(client)
            assert created > 0
            # reads still work: tasks, entries
            assert client.operator.get_task("fill-0").entry_count == 500
            assert len(client.operator.list_entries("fill-0", limit=10)) == 10
            with pytest.raises(StorageFull):  # etcd grants no lease either
                client.open_session("p", ttl=10, keepalive=False)
            result = CliRunner().invoke(cli, ["task", "pause", "fill-0"],
                                        env={"BATON_REGISTRY": registry.address})
            assert result.exit_code == 6 and "database is full" in result.output
        # The operator frees space and disarms the alarm: the same registry goes on.
        on_etcd(small_etcd.endpoint, _free_and_disarm)
        with Client(registry.address, timeout=10, retry=TEST_RETRY) as client:
            assert client.operator.pause_task("fill-0").status == pb.TASK_STATUS_PAUSED
            client.operator.create_task({"task_id": "after", "entries": [{"file_id": "a",
                                                                  "path": "a"}]})
            with client.open_session("p", ttl=10) as s:
                assert client.claim("after", session=s).file_id == "a"
    finally:
        registry.stop()


def test_writes_sent_together_at_the_quota_are_refused_too(
    small_etcd: EtcdProcess, tmp_path: Path,
) -> None:
    """etcd charges a request's own puts against its quota, not those of transactions
    nested in it: once etcd has said it is full, the registry sends every write alone
    (no group commit), so that many callers at once are refused as one would be."""
    registry: RegistryHandle = start_registry(small_etcd.endpoint, "/quota/", tmp_path / "s")
    try:
        with Client(registry.address, timeout=10, retry=TEST_RETRY) as client:
            created = fill(client)
            tasks = [f"fill-{n}" for n in range(min(created, 16))]
            _, before, _ = on_etcd(small_etcd.endpoint, lambda e: e.range(b"/quota/", limit=1))
            barrier = threading.Barrier(len(tasks))

            def pause(task_id: str) -> BaseException | None:
                barrier.wait()
                try:
                    client.operator.pause_task(task_id)
                except StorageFull as e:
                    return e
                return None

            with ThreadPoolExecutor(len(tasks)) as pool:
                outcomes = list(pool.map(pause, tasks))
            landed = [t for t, o in zip(tasks, outcomes, strict=True) if o is None]
            assert landed == [], f"paused at the quota: {landed}"
            _, after, _ = on_etcd(small_etcd.endpoint, lambda e: e.range(b"/quota/", limit=1))
            assert after == before
    finally:
        registry.stop()


# --- archiving at the quota: deletes only ---------------------------------------------


def big_task(client: Client, task_id: str) -> None:
    """A cancelled task of ``BIG`` entries: finished, and worth archiving."""
    client.operator.create_task({"task_id": task_id, "labels": {"pad": "x" * 200},
                                 "entries": [{"file_id": f"f{i:04d}", "path": f"p/{i:04d}",
                                     "labels": {"pad": "y" * 200}} for i in range(BIG)]})
    client.operator.cancel_task(task_id)


def finished_then_full(client: Client, endpoint: str, wait_for: Any
                       ) -> tuple[list[pb.Entry], list[pb.JournalRecord], pb.ExplainResponse]:
    """t1 completed (three entries produced and consumed: a journal), big-0 and big-1
    cancelled, then etcd filled to its quota; t1's entries, journal and an explanation,
    as read before."""
    with client.open_session("producer", ttl=30) as session:
        finish(client, session, "t1", wait_for)
    seen = (client.operator.list_entries("t1"), client.operator.journal("t1"),
            client.operator.explain("t1", "b"))
    big_task(client, "big-0")
    big_task(client, "big-1")
    history(endpoint)
    fill(client)
    on_etcd(endpoint, _deletes_accepted)
    return seen


def header_key(task_id: str) -> str:
    return Keys(PREFIX).task(task_id).decode()


def test_a_finished_task_is_archived_at_the_quota_with_deletes_only(
    small_etcd: EtcdProcess, archiving: RegistryHandle, archive_dir: Path, wait_for: Any,
) -> None:
    """Under NOSPACE `task archive` deletes the task's keys, header included, and frees
    space; every read answers from the archive; a CreateTask of the id is refused. Once
    space is freed and the alarm disarmed, the sweep puts the headers back, archived."""
    env = {"BATON_REGISTRY": archiving.address}
    with Client(archiving.address, timeout=10, retry=TEST_RETRY) as client:
        entries, journal, explained = finished_then_full(client, small_etcd.endpoint,
                                                         wait_for)
        task = client.operator.archive_task("t1", reason="etcd full")
        # etcd 3.5's file can pass the quota again as the deletes are written, and it
        # then refuses even read-only transactions: the runbook compacts and
        # defragments (a no-op on 3.4, which applies them as it is)
        on_etcd(small_etcd.endpoint, _deletes_accepted)
        assert task.status == pb.TASK_STATUS_ARCHIVED and task.archive and task.archived_at
        assert task.status_reason == "archive (every entry consumed): etcd full"
        # nothing of it left in etcd, not even its header: the archive is the record
        assert task_keys(archiving, "t1") == []
        assert sorted(p.name for p in archive_dir.iterdir()) == ["t1.jsonl.gz",
                                                                 "t1.meta.json"]
        got = client.operator.get_task("t1")
        assert got.status == pb.TASK_STATUS_ARCHIVED and got.states["consumed"] == 3
        assert [(e.file_id, e.state, e.digest, e.revision)
                for e in client.operator.list_entries("t1")] == [
            (e.file_id, e.state, e.digest, e.revision) for e in entries]
        assert [(r.file_id, r.event, r.revision) for r in client.operator.journal("t1")] == \
            [(r.file_id, r.event, r.revision) for r in journal]
        assert client.operator.get_entry("t1", "b").digest == explained.entry.digest
        text = client.operator.explain("t1", "b").text
        assert "was consumed" in text and "archived" in text
        assert [t.spec.task_id for t in client.operator.list_tasks(archived=True)] == ["t1"]
        # the CLI, and the library again: the big tasks go too
        done = CliRunner().invoke(cli, ["task", "archive", "big-0", "--reason", "etcd full"],
                                  env=env)
        assert done.exit_code == 0, done.output
        assert done.output.strip() == "task big-0: archived (archive (cancel): etcd full)"
        on_etcd(small_etcd.endpoint, _deletes_accepted)
        assert client.operator.archive_task("big-1").status == pb.TASK_STATUS_ARCHIVED
        on_etcd(small_etcd.endpoint, _deletes_accepted)
        assert task_keys(archiving, "big-0") == task_keys(archiving, "big-1") == []
        assert [t.spec.task_id for t in client.operator.list_tasks(archived=True)] == [
            "big-0", "big-1", "t1"]
        # again: the same
        assert client.operator.archive_task("t1").status == pb.TASK_STATUS_ARCHIVED
        with pytest.raises(IllegalTransition, match="its header is not back in etcd yet"):
            client.operator.create_task({"task_id": "t1",
                                         "entries": [{"file_id": "a", "path": "a"}]})
        with pytest.raises(IllegalTransition, match="it is archived; its archive is kept"):
            client.operator.delete_task("t1", discard_history=True)
        assert sorted(p.name for p in archive_dir.iterdir()) == ["big-0.jsonl.gz",
                                                                 "big-0.meta.json",
                                                                 "big-1.jsonl.gz",
                                                                 "big-1.meta.json",
                                                                 "t1.jsonl.gz",
                                                                 "t1.meta.json"]
        listed = CliRunner().invoke(cli, ["task", "ls", "--archived"], env=env)
        assert listed.exit_code == 0 and "big-1" in listed.output, listed.output
    # The space the archives freed is given back, the alarm disarmed: nothing else.
    on_etcd(small_etcd.endpoint, compact_defrag_disarm)
    with Client(archiving.address, timeout=10, retry=TEST_RETRY) as client:
        # a CreateTask of the id puts the header back first, then answers as for any
        # archived task
        with pytest.raises(TaskExists):
            client.operator.create_task({"task_id": "t1",
                                         "entries": [{"file_id": "z", "path": "z"}]})
        assert task_keys(archiving, "t1") == [header_key("t1")]
        # the archiver's sweep puts back the others
        assert on_loop(archiving, archiver(archiving).sweep()) == 0
        for task_id in ("big-0", "big-1"):
            assert task_keys(archiving, task_id) == [header_key(task_id)]
        back = client.operator.get_task("t1")
        assert back.status == pb.TASK_STATUS_ARCHIVED and back.states["consumed"] == 3
        assert back.archive == task.archive and back.archived_at == task.archived_at
        assert len(client.operator.list_entries("t1")) == 3
        # and the registry carries on
        client.operator.create_task({"task_id": "after",
                                     "entries": [{"file_id": "a", "path": "a"}]})
        with client.open_session("p", ttl=10) as s:
            assert client.claim("after", session=s).file_id == "a"


def test_an_archive_interrupted_at_the_quota_finishes_when_run_again_with_one_copy(
    small_etcd: EtcdProcess, archiving: RegistryHandle, archive_dir: Path, wait_for: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed writing the archive, before the header goes, or half-way through the
    deletes, then run again: one archive, written once, and nothing of the task left
    in etcd but, once it takes puts, its header."""
    arch = archiver(archiving)
    store = arch.store
    with Client(archiving.address, timeout=10, retry=TEST_RETRY) as client:
        finished_then_full(client, small_etcd.endpoint, wait_for)
        keys_before = task_keys(archiving, "big-0")
        # 1. killed while the archive is written: nothing deleted, no archive
        with crashing(monkeypatch, DirectoryStore, "write"), pytest.raises(Crash):
            on_loop(archiving, arch.archive("big-0"))
        assert task_keys(archiving, "big-0") == keys_before and store.info("big-0") is None
        assert client.operator.get_task("big-0").status == pb.TASK_STATUS_CANCELLED
        # 2. killed once the archive is written, before the header goes: kept
        with crashing(monkeypatch, Archiver, "_drop_plan"), pytest.raises(Crash):
            on_loop(archiving, arch.archive("big-0"))
        written = store.info("big-0")
        assert written is not None and task_keys(archiving, "big-0") == keys_before
        # 3. killed half-way through the deletes (the header went first): one chunk
        # of entries stays, and the rest. (etcd 3.5's file may have grown past the
        # quota again meanwhile: as the runbook says, compact and defragment first.)
        on_etcd(small_etcd.endpoint, _deletes_accepted)
        with killed_at_second_chunk(monkeypatch), pytest.raises(Crash):
            on_loop(archiving, arch.archive("big-0"))
        left = task_keys(archiving, "big-0")
        assert header_key("big-0") not in left and 0 < len(left) < len(keys_before)
        assert store.info("big-0") == written  # the same archive, not read again
        # reads answer from the archive meanwhile
        assert client.operator.get_task("big-0").status == pb.TASK_STATUS_ARCHIVED
        assert len(client.operator.list_entries("big-0")) == BIG
        assert "big-0" in [t.spec.task_id for t in client.operator.list_tasks(archived=True)]
        # 4. run again (the CLI): finishes, one copy, nothing left in etcd
        on_etcd(small_etcd.endpoint, _deletes_accepted)
        done = CliRunner().invoke(cli, ["task", "archive", "big-0"],
                                  env={"BATON_REGISTRY": archiving.address})
        assert done.exit_code == 0, done.output
        assert task_keys(archiving, "big-0") == []
        assert store.info("big-0") == written
        assert sorted(p.name for p in archive_dir.iterdir()) == ["big-0.jsonl.gz",
                                                                 "big-0.meta.json"]
    on_etcd(small_etcd.endpoint, compact_defrag_disarm)
    on_loop(archiving, arch.sweep())
    assert task_keys(archiving, "big-0") == [header_key("big-0")]
    assert store.info("big-0") == written


def test_a_key_written_after_the_archive_is_read_at_the_quota_is_not_deleted(
    small_etcd: EtcdProcess, archiving: RegistryHandle, wait_for: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An operator frees space and disarms the alarm while a task is archived with
    deletes only, and an entry of it is written after its archive was read: nothing of
    the task is deleted; archived again, the late write is in the archive."""
    keys = Keys(PREFIX)
    with Client(archiving.address, timeout=10, retry=TEST_RETRY) as client:
        finished_then_full(client, small_etcd.endpoint, wait_for)
        client.operator.archive_task("big-0")  # the space to free
        real_write = DirectoryStore.write

        async def late_write(etcd: Etcd) -> None:
            await compact_defrag_disarm(etcd)
            kv = await etcd.get(keys.entry("t1", "c"))
            assert kv is not None
            record = json.loads(kv.value)
            record["error"] = "written after the archive"
            await etcd.txn([], [Put(kv.key, json.dumps(record).encode())])

        def write_then_late(self: DirectoryStore, task_id: str, *args: Any) -> Any:
            info = real_write(self, task_id, *args)
            on_etcd(small_etcd.endpoint, late_write)
            return info

        keys_before = task_keys(archiving, "t1")
        monkeypatch.setattr(DirectoryStore, "write", write_then_late)
        with pytest.raises(IllegalTransition, match="written after its archive was read"):
            on_loop(archiving, archiver(archiving).archive("t1"))
        monkeypatch.setattr(DirectoryStore, "write", real_write)
        assert task_keys(archiving, "t1") == keys_before
        assert client.operator.get_task("t1").status == pb.TASK_STATUS_COMPLETED
        # etcd takes puts again: archived as usual, the late write with it
        assert client.operator.archive_task("t1").status == pb.TASK_STATUS_ARCHIVED
        assert task_keys(archiving, "t1") == [header_key("t1")]
        assert client.operator.get_entry("t1", "c").error == "written after the archive"


def test_an_etcd_refusing_every_transaction_at_its_quota_is_compacted_first(
    small_etcd: EtcdProcess, archiving: RegistryHandle, wait_for: Any,
) -> None:
    """etcd 3.5 refuses every transaction while its database file is over the quota,
    those that only delete too: archiving is refused, saying what to do, and nothing is
    deleted; once etcd is compacted and defragmented (the alarm still raised), the
    archive goes on with deletes only, the one already written kept."""
    if etcd_version(small_etcd.binary).startswith("3.4."):
        pytest.skip("etcd 3.4 applies transactions without puts at its quota")
    with Client(archiving.address, timeout=10, retry=TEST_RETRY) as client:
        big_task(client, "big-0")
        history(small_etcd.endpoint)
        fill(client)
        on_etcd(small_etcd.endpoint, _over_quota)
        keys_before = task_keys(archiving, "big-0")
        with pytest.raises(StorageFull, match="compact and defragment etcd"):
            client.operator.archive_task("big-0")
        assert task_keys(archiving, "big-0") == keys_before
        assert client.operator.get_task("big-0").status == pb.TASK_STATUS_CANCELLED
        written = archiver(archiving).store.info("big-0")
        on_etcd(small_etcd.endpoint, _compact_defrag)
        with pytest.raises(StorageFull):
            client.operator.pause_task("fill-0")  # puts: still refused
        assert client.operator.archive_task("big-0").status == pb.TASK_STATUS_ARCHIVED
        assert task_keys(archiving, "big-0") == []
        assert archiver(archiving).store.info("big-0") == written
