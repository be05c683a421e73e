"""The watcher as a process (``python -m baton_relay.watcher``): ready line, SIGTERM,
SIGKILL + restart."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from registry_fixtures import RegistryHandle
from watcher_fixtures import (
    Producing,
    WatcherProcess,
    histories,
    make_task,
    put_bytes,
    verified_events,
)

from baton_relay.client import Client, Session
from baton_relay.kernel.v1 import baton_pb2 as pb

Wait = Callable[..., None]


def all_verified(client: Client, task_id: str, n: int) -> Callable[[], bool]:
    def check() -> bool:
        entries = client.operator.list_entries(task_id, pb.ENTRY_STATE_VERIFIED)
        return len(entries) == n

    return check


def test_sigterm_stops_gracefully(
    client: Client, session: Session, processes: Callable[..., WatcherProcess], wait_for: Wait,
) -> None:
    """The process prints its ready line, verifies files, and exits 0 on SIGTERM."""
    w = processes()
    make_task(client, "t1", {"a": "a.bin"})
    put_bytes(client, session, "t1", "a", b"over a process")
    wait_for(all_verified(client, "t1", 1), what="a verified")
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(30) == 0
    assert 'msg=stopped' in w.log_tail(), w.log_tail()


@pytest.mark.slow
def test_killed_and_restarted_while_files_land_verifies_each_once(
    client: Client, session: Session, processes: Callable[..., WatcherProcess], wait_for: Wait,
    registry: RegistryHandle, tmp_path: Path,
) -> None:
    """SIGKILL mid-stream, restart: all 500 files verified, none twice, none retried."""
    ids = [f"f{i:04d}" for i in range(500)]
    make_task(client, "t1", {f: f"d{i % 5}/{f}.bin" for i, f in enumerate(ids)})
    first = processes("--reconcile-interval", "2")
    producer = Producing(client, session, [("t1", f) for f in ids], size=2048)
    wait_for(lambda: len(client.operator.list_entries("t1", pb.ENTRY_STATE_VERIFIED)) >= 150,
             timeout=60,
             what="150 verified before the kill")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    verified_at_kill = len(client.operator.list_entries("t1", pb.ENTRY_STATE_VERIFIED))
    processes("--reconcile-interval", "2")
    producer.join(120)
    wait_for(all_verified(client, "t1", len(ids)), timeout=120, what="all 500 verified")
    hist = histories(registry.etcd, registry.prefix, "t1", ids)
    twice = {f: verified_events(h) for f, h in hist.items() if verified_events(h) != 1}
    retried = [f for f, h in hist.items() if any(e["event"] == "failed" for e in h)]
    assert not twice and not retried, (twice, retried)
    assert verified_at_kill < len(ids)
