"""etcd at its quota (``NOSPACE``): writes are refused with ``StorageFull`` (exit 6),
reads go on, and once the quota is raised and the alarm disarmed, work goes on (a
private etcd with a small ``--quota-backend-bytes``, a real registry)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from registry_fixtures import TEST_RETRY, RegistryHandle, on_etcd, start_registry

from baton_relay.client import Client
from baton_relay.client.cli import cli
from baton_relay.client.errors import StorageFull
from baton_relay.client.v1 import baton_pb2 as pb
from baton_relay.registry._etcd import Etcd
from baton_relay.registry.local.etcdproc import EtcdProcess

QUOTA = ("--quota-backend-bytes=4194304",)  # 4 MiB


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    process = EtcdProcess(tmp_path / "etcd", log_path=tmp_path / "etcd.log", extra_args=QUOTA)
    process.start()
    try:
        yield process
    finally:
        process.kill()


async def _free_and_disarm(etcd: Etcd) -> None:
    """What an operator does: delete what is not needed (deletes are still accepted),
    compact, defragment, then `etcdctl alarm disarm` (through etcd's own stubs)."""
    from aetcd import rpc

    from baton_relay.registry.keys import prefix_end

    channel = etcd._pick()
    kvs, _, _ = await etcd.range(b"/quota/tasks/", keys_only=True)
    for kv in kvs:
        task_id = kv.key.rsplit(b"/", 1)[-1]
        if task_id != b"fill-0":
            for kind in (b"entries", b"ready", b"open", b"journal"):
                key = b"/quota/" + kind + b"/" + task_id + b"/"
                await etcd._unary(channel.kv.DeleteRange, rpc.DeleteRangeRequest(
                    key=key, range_end=prefix_end(key)))
    _, revision, _ = await etcd.range(b"/quota/", limit=1)
    await etcd._unary(channel.kv.Compact, rpc.CompactionRequest(revision=revision,
                                                                physical=True))
    await etcd._unary(channel.maint.Defragment, rpc.DefragmentRequest())
    raised = await etcd._unary(channel.maint.Alarm, rpc.AlarmRequest(
        action=rpc.AlarmRequest.GET))
    assert [a.alarm for a in raised.alarms] == [rpc.NOSPACE]
    for alarm in raised.alarms:
        await etcd._unary(channel.maint.Alarm, rpc.AlarmRequest(
            action=rpc.AlarmRequest.DEACTIVATE, memberID=alarm.memberID, alarm=alarm.alarm))


def fill(client: Client) -> int:
    """Create tasks until etcd refuses; how many were created."""
    n = 0
    with pytest.raises(StorageFull, match="database is full") as refused:
        while n < 200:
            client.create_task({"task_id": f"fill-{n}", "labels": {"pad": "x" * 200},
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
            assert client.get_task("fill-0").entry_count == 500
            assert len(client.list_entries("fill-0", limit=10)) == 10
            with pytest.raises(StorageFull):  # etcd grants no lease either
                client.open_session("p", ttl=10, keepalive=False)
            result = CliRunner().invoke(cli, ["task", "pause", "fill-0"],
                                        env={"BATON_REGISTRY": registry.address})
            assert result.exit_code == 6 and "database is full" in result.output
        # The operator frees space and disarms the alarm: the same registry goes on.
        on_etcd(small_etcd.endpoint, _free_and_disarm)
        with Client(registry.address, timeout=10, retry=TEST_RETRY) as client:
            assert client.pause_task("fill-0").status == pb.TASK_PAUSED
            client.create_task({"task_id": "after", "entries": [{"file_id": "a",
                                                                  "path": "a"}]})
            with client.open_session("p", ttl=10) as s:
                assert client.claim("after", session=s).file_id == "a"
    finally:
        registry.stop()
