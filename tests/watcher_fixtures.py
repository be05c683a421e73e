"""Watchers for tests: started in-process on the test's registry and staging root.

Loaded as a pytest plugin by ``conftest.py`` next to the registry fixtures.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import TEST_RETRY, RegistryHandle

from baton_relay.client import Client, Session, put
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import Keys
from baton_relay.watcher import Watcher, WatcherConfig, start_watcher
from baton_relay.watcher.__main__ import READY

#: settings that keep tests fast; the reconciliation interval is long so that tests
#: prove events (not the periodic sweep) did the work, unless they shorten it
FAST = {"retry_delay": 0.05, "poll_interval": 0.1, "reconcile_interval": 300.0}


@pytest.fixture
def watcher_factory(registry: RegistryHandle, staging: Path) -> Iterator[Callable[..., Watcher]]:
    """Start watchers on this test's registry and staging root; stopped at teardown."""
    started: list[Watcher] = []

    def make(**overrides: Any) -> Watcher:
        settings: dict[str, Any] = {**FAST, **overrides}
        config = WatcherConfig(registry=registry.address, staging=str(staging), **settings)
        w = start_watcher(config, retry=TEST_RETRY)
        started.append(w)
        return w

    yield make
    for w in started:
        w.stop()


class WatcherProcess:
    """``python -m baton_relay.watcher`` on the test's registry; stderr (its log) goes to a file."""

    def __init__(self, registry: RegistryHandle, staging: Path, log_path: Path,
                 *extra: str) -> None:
        self.log_path = log_path
        argv = [sys.executable, "-u", "-m", "baton_relay.watcher", "--registry", registry.address,
                "--staging", str(staging), "--retry-delay", "0.05", *extra]
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log,
                                         stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        assert line.startswith(READY), f"no ready line, got {line!r}: {self.log_tail()}"

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture
def processes(registry: RegistryHandle, staging: Path,
              tmp_path: Path) -> Iterator[Callable[..., WatcherProcess]]:
    """Start watcher processes (``make(*flags, log_name="watcher")``, each logging to
    ``LOG_NAME.log``); any still running are killed at teardown."""
    started: list[WatcherProcess] = []

    def make(*extra: str, log_name: str = "watcher") -> WatcherProcess:
        p = WatcherProcess(registry, staging, tmp_path / f"{log_name}.log", *extra)
        started.append(p)
        return p

    yield make
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait()


@pytest.fixture
def session(client: Client) -> Iterator[Session]:
    """A producer session on the test's registry."""
    with client.open_session("producer", ttl=10) as s:
        yield s


def make_task(client: Client, task_id: str, paths: dict[str, str]) -> pb.Task:
    """Create a task whose entries are ``file_id -> path``."""
    task, _ = client.operator.create_task({
        "task_id": task_id,
        "entries": [{"file_id": f, "path": p} for f, p in paths.items()],
    })
    return task


def put_bytes(client: Client, session: Session, task_id: str, file_id: str,
              data: bytes) -> pb.Entry:
    """Publish ``data`` with the producer helper (temp file, fsync, rename, commit)."""
    return put(client, session, task_id, file_id, io.BytesIO(data))


class Producing:
    """``put_bytes`` of each (task, file id) in turn on a thread of its own, each file
    ``size`` random bytes and its name: files landing while a test breaks something."""

    def __init__(self, client: Client, session: Session, items: list[tuple[str, str]],
                 size: int = 512) -> None:
        self.errors: list[BaseException] = []
        self.done = threading.Event()

        def produce() -> None:
            try:
                for task_id, file_id in items:
                    put_bytes(client, session, task_id, file_id,
                              os.urandom(size) + f"{task_id}/{file_id}".encode())
            except BaseException as e:  # surfaced by join()
                self.errors.append(e)
            finally:
                self.done.set()

        self._thread = threading.Thread(target=produce)
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait until every file was put; fail with what the thread raised."""
        self._thread.join(timeout)
        assert self.done.is_set() and not self.errors, self.errors


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def state_of(client: Client, task_id: str, file_id: str) -> int:
    return int(client.operator.get_entry(task_id, file_id).state)


def is_state(client: Client, task_id: str, file_id: str, state: int) -> Callable[[], bool]:
    return lambda: state_of(client, task_id, file_id) == state


def histories(etcd_endpoint: str, prefix: str, task_id: str,
              file_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each entry's history: its journal records, read straight from etcd."""

    async def read() -> dict[str, list[dict[str, Any]]]:
        etcd = Etcd(etcd_endpoint)
        await etcd.connect()
        try:
            keys = Keys(prefix)
            out = {}
            for f in file_ids:
                out[f] = [json.loads(kv.value)
                          async for kv in etcd.scan(keys.journal_all(task_id, f))]
            return out
        finally:
            await etcd.close()

    return asyncio.run(read())


def verified_events(history: list[dict[str, Any]]) -> int:
    return sum(1 for h in history if h["event"] == "verified")
