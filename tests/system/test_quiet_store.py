"""An idle stack writes nothing to etcd (issue 39): a revision that does not move
leaves etcd's periodic compaction nothing to do, and its cost (a walk of every stored
key, whatever changed) grows with what is stored. The registry and a watcher serving
an idle task run on an etcd of the test's own for several heartbeats: etcd's revision
stays where it was. A heartbeat whose capacity changed is still recorded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from compacting import start_etcd
from registry_fixtures import TEST_RETRY, on_etcd, start_registry
from test_metrics import metrics_port, scrape

from baton_relay.client import Client
from baton_relay.registry.store.etcd import Etcd
from baton_relay.watcher import WatcherConfig, start_watcher


async def revision(etcd: Etcd) -> int:
    _, rev, _ = await etcd.range(b"/", limit=1, keys_only=True)
    return rev


def heartbeats(registry: object) -> float:
    found = scrape(metrics_port(registry))  # type: ignore[arg-type]
    return sum(v for n, labels, v in found.samples
               if n == "baton_grpc_calls_total" and labels.get("method") == "WatcherHeartbeat")


def test_an_idle_stack_moves_no_revision(tmp_path: Path,
                                         wait_for: Callable[..., None]) -> None:
    etcd = start_etcd(tmp_path)
    staging = tmp_path / "staging"
    staging.mkdir()
    registry = start_registry(etcd.endpoint, "/baton-quiet/", staging, metrics="127.0.0.1:0")
    client = Client(registry.address, timeout=10, retry=TEST_RETRY)
    watcher = start_watcher(WatcherConfig(registry=registry.address, staging=str(staging),
                                          shard_ttl=3, retry_delay=0.05), retry=TEST_RETRY)
    try:
        client.operator.create_task({"task_id": "idle", "entries": [
            {"file_id": f"f{i}", "path": f"f{i}"} for i in range(3)]})
        wait_for(lambda: any(w.capacity.tasks == 1 for w in client.operator.list_watchers()),
                 what="the watcher's heartbeat recording the task it serves")
        # settled: the first heartbeats after the task recorded what changed
        wait_for(lambda: heartbeats(registry) >= 3, what="heartbeats")
        before, beats = on_etcd(etcd, revision), heartbeats(registry)
        wait_for(lambda: heartbeats(registry) >= beats + 4, timeout=20,
                 what="four heartbeats (one a second)")
        assert on_etcd(etcd, revision) == before, "an idle stack wrote to etcd"
        client.operator.create_task({"task_id": "second",
                                     "entries": [{"file_id": "a", "path": "a"}]})
        wait_for(lambda: any(w.capacity.tasks == 2 for w in client.operator.list_watchers()),
                 what="a heartbeat recording the capacity that changed")
    finally:
        watcher.stop()
        client.close()
        registry.stop()
        etcd.stop()
