"""Regression test for a bug the fault runs found (seed 4, ``pause-agent`` while a
producer held a written but unpublished payload; docs/faults.md).

A producer whose claim died while it was paused published its file when it woke up,
over the file of the attempt that had replaced it: ``produce`` renamed the temp file
onto the final path without checking that its claim was still live. The registry
refused the stale commit and the watcher then saw the verified file change and sent
the entry back, so no wrong bytes were verified or consumed, but a verified entry was
thrown away and consumers in between were handed bytes that failed their digest check.
``produce`` now checks its session before the rename; and since each attempt writes a
file of its own (named for its token, ``a~tN.bin``), even a rename past that check
lands beside the live attempt's file, never over it (tests/system/test_fenced_writes.py).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from baton_relay.client import Client, put
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb

from .cluster import REPO
from .stale_producer import PAYLOAD

pytestmark = pytest.mark.faults
OTHER = b"B" * 2000


@pytest.fixture
def paused_producer(registry: object) -> Iterator[subprocess.Popen[str]]:
    """A producer of t1/a (TTL 2 s) that wrote its payload and is now SIGSTOPped."""
    address = registry.address  # type: ignore[attr-defined]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.faults.stale_producer", address, "t1", "a", "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        json.loads(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGSTOP)
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def until(condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {condition}"
        time.sleep(0.05)


def test_a_stale_producer_does_not_overwrite_the_live_attempt(
        client: Client, staging: Path, request: pytest.FixtureRequest) -> None:
    """The bytes on disk stay those of the attempt whose commit was accepted."""
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a.bin"}],
                                 "backoff": {"base_seconds": 0.001}})
    stale = request.getfixturevalue("paused_producer")
    # Its lease expires while it is stopped; the reaper sends the entry back.
    until(lambda: client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_PENDING, 10)
    with client.open_session("live", ttl=10) as session:
        entry = put(client, session, "t1", "a", io.BytesIO(OTHER))
    assert entry.state == pb.ENTRY_STATE_WRITTEN
    os.kill(stale.pid, signal.SIGCONT)
    stale.stdin.write("publish\n")
    stale.stdin.flush()
    # its own session check refuses first: a lost session's claims are not used
    assert json.loads(stale.stdout.readline()) == {"outcome": errors.SessionExpired.__name__}
    data = Path(client.operator.get_entry("t1", "a").abs_attempt_path).read_bytes()
    assert data != PAYLOAD, "the refused producer's bytes replaced the committed ones"
    assert data == OTHER
