"""Finished tasks out of etcd: archived (header, entries, journal) into the archive
store, checked, then removed by guarded deletes; read back from the archive; an
archive interrupted anywhere finishes when run again, leaving one copy (real etcd,
real registry, a real directory store)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from click.testing import CliRunner
from registry_fixtures import RegistryHandle, on_etcd, produce_verified
from test_metrics import scrape

from baton_relay.client import Client, Session
from baton_relay.client.cli import cli
from baton_relay.kernel.errors import IllegalTransition, InvalidManifest, NotFound
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import Etcd, Put
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.sweeps import archive as archive_mod
from baton_relay.registry.sweeps.archive import Archiver, ArchiveStore, DirectoryStore
from baton_relay.registry.verbs import operators as operators_mod
from baton_relay.registry.verbs import removal

T = TypeVar("T")
Wait = Callable[..., None]
FILES = ["a", "b", "c"]


@pytest.fixture
def archive_dir(tmp_path: Path) -> Path:
    return tmp_path / "archive"


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryHandle], archive_dir: Path
             ) -> RegistryHandle:
    return registry_factory(archive_dir=str(archive_dir), metrics="127.0.0.1:0")


def on_loop(registry: RegistryHandle, coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on the registry's own event loop (its archiver lives there)."""
    return asyncio.run_coroutine_threadsafe(coro, registry._loop).result(60)


def archiver(registry: RegistryHandle) -> Archiver:
    found = registry._running.core.archive
    assert found is not None
    return found


def finish(client: Client, session: Session, task_id: str, wait_for: Wait) -> None:
    """Create a task, produce, verify (as a lone watcher would) and consume every entry,
    and wait until the registry completes it."""
    client.operator.create_task({"task_id": task_id,
                                 "entries": [{"file_id": f, "path": f"{f}.bin"} for f in FILES]})
    for f in FILES:
        produce_verified(client, session, task_id, f)
        lease = client.consume(task_id, "default", f, session=session)
        client.ack(task_id, f, "default", lease.token, session=session)
    wait_for(lambda: client.operator.get_task(task_id).status == pb.TASK_STATUS_COMPLETED,
             what="task completed")


def task_keys(registry: RegistryHandle, task_id: str) -> list[str]:
    """Every key naming the task, straight from etcd."""
    keys = Keys(registry.prefix)

    async def read(etcd: Etcd) -> list[str]:
        kvs, _, _ = await etcd.range(registry.prefix.encode())
        return [kv.key.decode() for kv in kvs if f"/{task_id}/" in kv.key.decode()
                or kv.key == keys.task(task_id)]

    return on_etcd(registry.etcd, read)


def before_archive(client: Client, task_id: str) -> tuple[list[pb.Entry], list[pb.JournalRecord]]:
    return client.operator.list_entries(task_id), client.operator.journal(task_id)


def test_a_finished_task_is_archived_and_read_back_from_the_archive(
    client: Client, session: Session, registry: RegistryHandle, archive_dir: Path,
    wait_for: Wait,
) -> None:
    finish(client, session, "t1", wait_for)
    entries, journal = before_archive(client, "t1")
    explained = client.operator.explain("t1", "b").entry
    task = client.operator.archive_task("t1", reason="test")
    assert task.status == pb.TASK_STATUS_ARCHIVED and task.archive and task.archived_at
    # etcd keeps the header only
    assert task_keys(registry, "t1") == [Keys(registry.prefix).task("t1").decode()]
    assert sorted(p.name for p in archive_dir.iterdir()) == ["t1.jsonl.gz", "t1.meta.json"]
    # every read answers from the archive, as before
    got = client.operator.get_task("t1")
    assert got.status == pb.TASK_STATUS_ARCHIVED and got.states["consumed"] == 3
    assert [(e.file_id, e.state, e.digest,
             e.revision) for e in client.operator.list_entries("t1")] \
        == [(e.file_id, e.state, e.digest, e.revision) for e in entries]
    assert [e.file_id for e in client.operator.list_entries("t1", pb.ENTRY_STATE_CONSUMED)] == FILES
    assert [(r.file_id, r.event, r.revision) for r in client.operator.journal("t1")] == \
        [(r.file_id, r.event, r.revision) for r in journal]
    assert [r.event for r in client.operator.journal("t1", "a")] == \
        [r.event for r in journal if r.file_id == "a"]
    # the archive's journal has the same bound on a reply as a live one
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(operators_mod, "MAX_JOURNAL_RECORDS", 2)
        bounded = client.operator.journal_reply("t1")
    assert bounded.total == len(journal) > 2
    assert [r.revision for r in bounded.records] == [r.revision for r in journal[-2:]]
    assert client.operator.get_entry("t1", "b").digest == explained.digest
    text = client.operator.explain("t1", "b").text
    assert "was consumed" in text and "archived" in text
    with pytest.raises(NotFound):
        client.operator.get_entry("t1", "zz")
    assert [t.spec.task_id for t in client.operator.list_tasks()] == []
    assert [t.spec.task_id for t in client.operator.list_tasks(archived=True)] == ["t1"]
    # again: nothing to do
    assert client.operator.archive_task("t1").status == pb.TASK_STATUS_ARCHIVED
    with pytest.raises(IllegalTransition, match="its archive is kept"):
        client.operator.delete_task("t1", discard_history=True)
    scraped = scrape(registry._running.metrics_port)
    assert scraped.value("baton_tasks_archived_total") == 1
    assert scraped.value("baton_tasks", status="archived") == 1


def test_only_a_finished_task_is_archived(
    client: Client, session: Session, registry: RegistryHandle, archive_dir: Path,
) -> None:
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}]})
    keys = task_keys(registry, "t1")
    with pytest.raises(IllegalTransition, match="only a completed or cancelled task"):
        client.operator.archive_task("t1")
    assert task_keys(registry, "t1") == keys and not archive_dir.exists()
    client.claim("t1", "a", session=session)
    client.operator.cancel_task("t1")
    assert client.operator.archive_task("t1").status == pb.TASK_STATUS_ARCHIVED
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITING  # as it was left
    with pytest.raises(IllegalTransition):
        client.operator.resume_task("t1")


class Crash(Exception):
    pass


@contextmanager
def killed_at_second_chunk(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within: the removal's second chunk of deletes dies (``Crash``), the first goes
    through, as when the registry is killed half-way through the deletes."""
    real_chunk = removal.Removal._plain_chunk
    calls = {"n": 0}

    def dies_deleting(self: removal.Removal, kind: str, *args: Any) -> Any:
        handle = real_chunk(self, kind, *args)

        async def counted(kvs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:
                raise Crash("killed while deleting")
            return await handle(kvs)

        return counted

    monkeypatch.setattr(removal.Removal, "_plain_chunk", dies_deleting)
    try:
        yield
    finally:
        monkeypatch.setattr(removal.Removal, "_plain_chunk", real_chunk)


def test_an_archive_interrupted_anywhere_finishes_when_run_again_with_one_copy(
    client: Client, session: Session, registry: RegistryHandle, archive_dir: Path,
    wait_for: Wait, monkeypatch: pytest.MonkeyPatch,
) -> None:
    finish(client, session, "t1", wait_for)
    entries, journal = before_archive(client, "t1")
    store = archiver(registry).store
    # 1. killed while the archive is being written: nothing deleted, no archive kept
    real_write = DirectoryStore.write

    def dies_writing(self: DirectoryStore, *args: Any) -> Any:
        raise Crash("killed while writing")

    monkeypatch.setattr(DirectoryStore, "write", dies_writing)
    with pytest.raises(Exception, match="killed while writing"):
        on_loop(registry, archiver(registry).archive("t1"))
    assert client.operator.get_task("t1").status == pb.TASK_STATUS_ARCHIVING
    assert len(task_keys(registry, "t1")) > 1 and store.info("t1") is None
    monkeypatch.setattr(DirectoryStore, "write", real_write)
    keys_before = task_keys(registry, "t1")
    # 2. killed half-way through the deletes (the entries are gone, the journal not
    # yet): the archive is whole and stays as it is
    with killed_at_second_chunk(monkeypatch), \
            pytest.raises(Exception, match="killed while deleting"):
        on_loop(registry, archiver(registry).archive("t1"))
    written = store.info("t1")
    assert written is not None
    assert 1 < len(task_keys(registry, "t1")) < len(keys_before)
    # 3. run again: finishes, does not write the archive again, one copy
    assert client.operator.archive_task("t1").status == pb.TASK_STATUS_ARCHIVED
    assert store.info("t1") == written
    assert sorted(p.name for p in archive_dir.iterdir()) == ["t1.jsonl.gz", "t1.meta.json"]
    assert task_keys(registry, "t1") == [Keys(registry.prefix).task("t1").decode()]
    assert [e.file_id for e in client.operator.list_entries("t1")] == [e.file_id for e in entries]
    assert len(client.operator.journal("t1")) == len(journal)


def test_a_key_written_after_the_archive_stops_the_deletes(
    client: Client, session: Session, registry: RegistryHandle, wait_for: Wait,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing written after the archive was read is deleted unarchived."""
    finish(client, session, "t1", wait_for)
    keys = Keys(registry.prefix)
    real_sweep = removal.Removal.sweep

    async def late_write_then_sweep(self: removal.Removal, task_id: str,
                                    before: int = 0) -> Any:
        kv = await self.core.etcd.get(keys.entry(task_id, "c"))
        assert kv is not None
        record = json.loads(kv.value)
        record["error"] = "written after the archive"
        await self.core.etcd.txn([], [Put(kv.key, json.dumps(record).encode())])
        return await real_sweep(self, task_id, before)

    monkeypatch.setattr(removal.Removal, "sweep", late_write_then_sweep)
    with pytest.raises(IllegalTransition, match="after the archive"):
        on_loop(registry, archiver(registry).archive("t1"))
    assert client.operator.get_task("t1").status == pb.TASK_STATUS_ARCHIVING
    assert keys.entry("t1", "c").decode() in task_keys(registry, "t1")


def test_finished_tasks_are_archived_after_their_time_and_archives_expire(
    client: Client, session: Session, registry: RegistryHandle, archive_dir: Path,
    wait_for: Wait,
) -> None:
    finish(client, session, "t1", wait_for)
    client.operator.create_task({"task_id": "keep", "archive_after_seconds": -1,
                                 "entries": [{"file_id": "a", "path": "a"}]})
    client.operator.cancel_task("keep")
    arch = archiver(registry)
    arch.after = 3600.0
    assert on_loop(registry, arch.sweep()) == 0  # finished a moment ago: not yet
    arch.after = 0.001
    assert on_loop(registry, arch.sweep()) == 1  # t1; "keep" says never
    assert client.operator.get_task("t1").status == pb.TASK_STATUS_ARCHIVED
    assert client.operator.get_task("keep").status == pb.TASK_STATUS_CANCELLED
    arch.retention = 0.0
    on_loop(registry, arch.sweep())
    with pytest.raises(NotFound):
        client.operator.get_task("t1")
    assert not list(archive_dir.iterdir())


def test_a_manifest_archive_after_is_checked(client: Client) -> None:
    with pytest.raises(InvalidManifest, match="archive_after_seconds"):
        client.operator.create_task({"task_id": "t1", "archive_after_seconds": 10 * 366 * 86400,
                                     "entries": [{"file_id": "a", "path": "a"}]})


def test_a_corrupt_archive_is_refused_not_read(tmp_path: Path) -> None:
    store: ArchiveStore = DirectoryStore(str(tmp_path))
    info = store.write("t1", 7, iter([{"kind": "task", "header": {}}, {"kind": "entry"}]))
    assert (info.records, info.revision) == (2, 7)
    data = tmp_path / "t1.jsonl.gz"
    data.write_bytes(data.read_bytes()[:-3] + b"xyz")
    with pytest.raises(Exception, match="does not match its checksum"):
        store.info("t1")


def test_cli_archives_and_lists_archived_tasks(
    client: Client, session: Session, registry: RegistryHandle, wait_for: Wait,
) -> None:
    finish(client, session, "t1", wait_for)
    env = {"BATON_REGISTRY": registry.address}
    runner = CliRunner()
    done = runner.invoke(cli, ["task", "archive", "t1", "--reason", "tidy"], env=env)
    assert done.exit_code == 0, done.output
    assert done.output.strip() == "task t1: archived (archive (every entry consumed): tidy)"
    listed = runner.invoke(cli, ["task", "ls", "--archived", "-o", "json"], env=env)
    assert listed.exit_code == 0, listed.output
    (only,) = json.loads(listed.output)
    assert only["spec"]["task_id"] == "t1" and only["status"] == "archived"
    active = runner.invoke(cli, ["task", "create", "-"], env=env,
                           input=json.dumps({"task_id": "t2", "entries": [
                               {"file_id": "a", "path": "a"}]}))
    assert active.exit_code == 0, active.output
    refused = runner.invoke(cli, ["task", "archive", "t2"], env=env)
    assert refused.exit_code == 4 and "only a completed or cancelled task" in refused.output


def cancelled(client: Client, task_id: str, entries: int) -> None:
    """A task of ``entries`` entries that never ran, cancelled: ready to archive."""
    client.operator.create_task({"task_id": task_id, "entries": [
        {"file_id": f"f{n}", "path": f"f{n}.bin"} for n in range(entries)]})
    client.operator.cancel_task(task_id, "test")


def test_an_archive_holds_a_few_pages_of_the_task_not_all_of_it(
    client: Client, registry: RegistryHandle, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store writes while etcd is read: it is never more than PAGES_AHEAD pages
    (and the page it is in, and the one being read) behind the reading, so an archive's
    memory does not grow with its task."""
    page = 10
    monkeypatch.setattr(archive_mod, "READ_PAGE", page)
    cancelled(client, "t1", 300)
    entries, journal = before_archive(client, "t1")
    read = 0
    real_records = Archiver._records

    async def counted(self: Archiver, task_id: str, revision: int) -> AsyncIterator[Any]:
        nonlocal read
        async for record in real_records(self, task_id, revision):
            read += 1
            yield record

    behind: list[int] = []
    real_write = DirectoryStore.write

    def watched(self: DirectoryStore, task_id: str, revision: int, records: Iterator[Any],
                header_revision: int = 0) -> Any:
        def seen() -> Iterator[Any]:
            for n, record in enumerate(records):  # n: records before this one, header too
                behind.append(read - n)
                yield record

        return real_write(self, task_id, revision, seen(), header_revision)

    monkeypatch.setattr(Archiver, "_records", counted)
    monkeypatch.setattr(DirectoryStore, "write", watched)
    assert client.operator.archive_task("t1").status == pb.TASK_STATUS_ARCHIVED
    assert len(behind) == 1 + len(entries) + len(journal) == 1 + read
    assert max(behind) <= (archive_mod.PAGES_AHEAD + 2) * page
    assert [e.file_id for e in client.operator.list_entries("t1")] == [e.file_id for e in entries]


def test_an_archive_whose_reading_fails_half_way_keeps_nothing_and_runs_again(
    client: Client, registry: RegistryHandle, archive_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(archive_mod, "READ_PAGE", 10)
    cancelled(client, "t1", 100)
    keys_before = task_keys(registry, "t1")
    real_records = Archiver._records

    async def fails(self: Archiver, task_id: str, revision: int) -> AsyncIterator[Any]:
        n = 0
        async for record in real_records(self, task_id, revision):
            n += 1
            if n > 35:
                raise ConnectionError("etcd went away")
            yield record

    monkeypatch.setattr(Archiver, "_records", fails)
    with pytest.raises(ConnectionError, match="etcd went away"):
        on_loop(registry, archiver(registry).archive("t1"))
    assert archiver(registry).store.info("t1") is None
    assert list(archive_dir.iterdir()) == []  # no half archive, no temporary file
    assert task_keys(registry, "t1") == keys_before
    monkeypatch.setattr(Archiver, "_records", real_records)
    assert client.operator.archive_task("t1").status == pb.TASK_STATUS_ARCHIVED
    assert len(client.operator.list_entries("t1")) == 100


def test_a_store_failing_half_way_stops_the_archive_and_keeps_nothing(
    client: Client, registry: RegistryHandle, archive_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store that fails while writing (a full disk) fails the archive with its error
    at once, however much of the task is left to read, and leaves no file behind."""
    monkeypatch.setattr(archive_mod, "READ_PAGE", 10)
    cancelled(client, "t1", 200)
    keys_before = task_keys(registry, "t1")
    real_write = DirectoryStore.write

    def disk_fills(self: DirectoryStore, task_id: str, revision: int,
                   records: Iterator[Any], header_revision: int = 0) -> Any:
        def until_full() -> Iterator[Any]:
            for n, record in enumerate(records):
                if n == 50:
                    raise OSError(28, "No space left on device")
                yield record

        return real_write(self, task_id, revision, until_full(), header_revision)

    monkeypatch.setattr(DirectoryStore, "write", disk_fills)
    with pytest.raises(OSError, match="No space left on device"):
        on_loop(registry, archiver(registry).archive("t1"))
    assert list(archive_dir.iterdir()) == []
    assert task_keys(registry, "t1") == keys_before
    monkeypatch.setattr(DirectoryStore, "write", real_write)
    assert client.operator.archive_task("t1").status == pb.TASK_STATUS_ARCHIVED


def test_the_sweep_leaves_a_task_this_replica_is_archiving_to_it(
    client: Client, registry: RegistryHandle, archive_dir: Path, wait_for: Wait,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task is `archiving` for as long as its archive is written; the sweep that
    comes by meanwhile (it finishes interrupted archives) does not write it a second
    time beside the first."""
    cancelled(client, "t1", 50)
    writes: list[int] = []
    release = threading.Event()
    real_write = DirectoryStore.write

    def slow(self: DirectoryStore, *args: Any) -> Any:
        writes.append(1)
        assert release.wait(60), "never released"
        return real_write(self, *args)

    monkeypatch.setattr(DirectoryStore, "write", slow)
    done: list[pb.Task] = []
    explicit = threading.Thread(target=lambda: done.append(client.operator.archive_task("t1")))
    explicit.start()
    try:
        wait_for(lambda: len(writes) == 1, what="the archive being written")
        assert client.operator.get_task("t1").status == pb.TASK_STATUS_ARCHIVING
        assert on_loop(registry, archiver(registry).sweep()) == 0
        assert len(writes) == 1
    finally:
        release.set()
        explicit.join(60)
    assert [t.status for t in done] == [pb.TASK_STATUS_ARCHIVED]
    assert len(writes) == 1
    assert sorted(p.name for p in archive_dir.iterdir()) == ["t1.jsonl.gz", "t1.meta.json"]


def test_two_writes_of_one_archive_at_once_do_not_trip_over_each_other(
    tmp_path: Path,
) -> None:
    """Two writers of the same archive at once (two replicas sharing the directory, the
    same process id on their hosts): each writes under a name of its own, and both end
    with the archive whole."""
    store = DirectoryStore(str(tmp_path))
    both_writing = threading.Barrier(2, timeout=30)
    records = [{"kind": "task", "revision": 7, "header": {"task_id": "t1"}},
               *({"kind": "entry", "revision": n, "record": {"n": n}} for n in range(100))]

    def write() -> Any:
        def meeting() -> Iterator[dict[str, Any]]:
            yield from records[:50]
            both_writing.wait()  # both halfway through
            yield from records[50:]

        return store.write("t1", 7, meeting(), 3)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        infos = [f.result(60) for f in [pool.submit(write), pool.submit(write)]]
    assert [i.records for i in infos] == [len(records)] * 2
    assert list(store.read("t1")) == records
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t1.jsonl.gz", "t1.meta.json"]


def test_one_task_whose_store_fails_does_not_stop_the_sweep_archiving_others(
    client: Client, registry: RegistryHandle, monkeypatch: pytest.MonkeyPatch,
) -> None:
    cancelled(client, "t1", 5)
    cancelled(client, "t2", 5)
    real_write = DirectoryStore.write

    def full_for_t1(self: DirectoryStore, task_id: str, *args: Any) -> Any:
        if task_id == "t1":
            raise OSError(28, "No space left on device")
        return real_write(self, task_id, *args)

    monkeypatch.setattr(DirectoryStore, "write", full_for_t1)
    arch = archiver(registry)
    monkeypatch.setattr(arch, "after", 0.001)
    assert on_loop(registry, arch.sweep()) == 1
    assert client.operator.get_task("t2").status == pb.TASK_STATUS_ARCHIVED
    # the next sweep goes on
    assert client.operator.get_task("t1").status == pb.TASK_STATUS_ARCHIVING
    monkeypatch.setattr(DirectoryStore, "write", real_write)
    assert on_loop(registry, arch.sweep()) == 1
    assert client.operator.get_task("t1").status == pb.TASK_STATUS_ARCHIVED


def test_the_index_windows_of_a_finished_task_are_let_go(
    client: Client, session: Session, registry: RegistryHandle, wait_for: Wait,
) -> None:
    """The view's windows on a task's ready indexes (kept while agents claim from it)
    go when the task finishes, on the header's change: not only once a thousand other
    tasks' windows push them out. A task still running keeps its own."""
    view = registry._running.core.view
    assert view is not None
    keys = Keys(registry.prefix)
    for task_id in ("t1", "t10"):
        cancelled_later = {"task_id": task_id, "consumers": ["ocr"],
                           "entries": [{"file_id": f"f{n}", "path": f"f{n}.bin"}
                                       for n in range(4)]}
        client.operator.create_task(cancelled_later)
        produce_verified(client, session, task_id, "f0")
        client.consume(task_id, "ocr", session=session)  # its consumer index too
        client.claim(task_id, session=session)

    def windows(task_id: str) -> list[bytes]:
        mine = (keys.ready_all(task_id), keys.cready_of_task(task_id))
        return [base for base in list(view._windows) if base.startswith(mine)]

    assert len(windows("t1")) == 2 and len(windows("t10")) == 2
    client.operator.cancel_task("t1")
    wait_for(lambda: not windows("t1"), what="t1's windows let go")
    assert len(windows("t10")) == 2
    client.claim("t10", session=session)  # still served from its window
    client.operator.cancel_task("t10")
    wait_for(lambda: not windows("t10"), what="t10's windows let go")
