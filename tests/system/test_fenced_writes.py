"""Fenced file writes: each attempt writes a file of its own, named for its token, and
consumers read the committed attempt's. A producer whose claim died can still write
and rename whatever it likes; it never replaces the bytes consumers of the entry read."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from registry_fixtures import RegistryHandle, agent_processes
from watcher_fixtures import digest, is_state, put_bytes

from baton_relay.client import Client, Session, put, read_verified
from baton_relay.kernel.contract import attempt_path, parse_attempt
from baton_relay.kernel.errors import InvalidManifest
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher import Watcher
from baton_relay.watcher.hashing import Hasher

Wait = Callable[..., None]
ZOMBIE = Path(__file__).parents[1] / "zombie_producer.py"
SUCCESSOR = b"S" * 2000
#: journal events that would say the verified bytes were doubted or lost
TAMPER = {"failed", "unverified", "corrupted", "missing", "changed"}


@pytest.fixture
def zombie(registry: RegistryHandle) -> Iterator[Callable[[str, str, int], subprocess.Popen[str]]]:
    """Start ``zombie_producer.py`` processes (task, file, session TTL); see
    ``agent_processes``."""
    with agent_processes(ZOMBIE, registry) as spawn:
        yield spawn


def _line(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())  # type: ignore[no-any-return]


def test_a_producer_whose_claim_died_never_replaces_the_verified_bytes(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    zombie: Callable[[str, str, int], subprocess.Popen[str]],
) -> None:
    """Paused after writing, its claim expired, a successor verified: its late rename
    leaves the entry verified, consumers read the successor's bytes, no tamper event."""
    w = watcher_factory()
    client.operator.create_task({"task_id": "t1", "consumers": ["g"],
                                 "entries": [{"file_id": "a", "path": "out/a.bin"},
                                    {"file_id": "b", "path": "out/b.bin"}],
                                 "backoff": {"base_seconds": 0.001}})
    proc = zombie("t1", "a", 2)
    claim = _line(proc)
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_PENDING), timeout=15,
             what="the stopped producer's claim expired")
    put(client, session, "t1", "a", io.BytesIO(SUCCESSOR))
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="successor verified")
    verified = client.operator.get_entry("t1", "a")
    successor = parse_attempt(verified.attempt_path)
    assert successor is not None and successor[0] == "out/a.bin"
    assert successor[1] > int(str(claim["token"]))
    assert verified.abs_attempt_path != claim["path"]

    events = w.metrics.get("events")
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.stdin is not None
    proc.stdin.write("publish\n")
    proc.stdin.flush()
    renamed = _line(proc)["renamed"]
    assert Path(str(renamed)).read_bytes() != SUCCESSOR  # its bytes are on disk, beside
    assert _line(proc)["outcome"] != "committed"
    # The watcher saw the late file and checked the entry: nothing came of it.
    put_bytes(client, session, "t1", "b", b"after the zombie")
    wait_for(is_state(client, "t1", "b", pb.ENTRY_STATE_VERIFIED), what="b verified")
    wait_for(lambda: w.metrics.get("events") > events and w.jobs.idle(),
             what="the watcher done with the late file's events")

    after = client.operator.get_entry("t1", "a")
    assert after.state == pb.ENTRY_STATE_VERIFIED and after.revision == verified.revision
    lease = client.consume("t1", "g", "a", session=session)
    assert lease.path == verified.abs_attempt_path
    assert read_verified(lease) == SUCCESSOR
    journal = client.operator.journal("t1", "a")
    since = max(i for i, r in enumerate(journal) if r.event == "verified")
    assert not [r.event for r in journal[since:] if r.event in TAMPER]
    assert [r.event for r in journal].count("verified") == 1


def test_an_attempt_path_keeps_the_extension_and_parses_back() -> None:
    """``NAME~tTOKEN.EXT`` beside the entry's path, and back to (path, token)."""
    assert attempt_path("out/frame-0001.png", 42) == "out/frame-0001~t42.png"
    assert attempt_path("/s/t/x.tar.gz", 7) == "/s/t/x.tar~t7.gz"
    assert attempt_path(".hidden", 3) == ".hidden~t3"
    for path in ("out/frame-0001.png", "a", ".hidden", "d/x.tar.gz", "a.", "x.a~tb"):
        assert parse_attempt(attempt_path(path, 123)) == (path, 123)
    assert parse_attempt("out/frame-0001.png") is None
    assert parse_attempt("a~t007.png") is None  # not a token's spelling
    assert parse_attempt(".a.bin.baton-tmp-42-ff") is None


def test_a_manifest_path_that_looks_like_an_attempt_is_refused(client: Client) -> None:
    """A path the watcher would take for an attempt's file is refused, field named."""
    with pytest.raises(InvalidManifest, match="attempt"):
        client.operator.create_task({"task_id": "t1",
                                     "entries": [{"file_id": "a", "path": "out/a~t5.png"}]})
    with pytest.raises(InvalidManifest, match="longer than"):
        client.operator.create_task({"task_id": "t1",
                                     "entries": [{"file_id": "a", "path": "x" * 240}]})


def test_consume_reads_the_committed_attempt(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
) -> None:
    """The claim's path is its attempt's file; the consume reply names the same file."""
    watcher_factory()
    client.operator.create_task({"task_id": "t1", "consumers": ["g"],
                                 "entries": [{"file_id": "a", "path": "a.json"}]})
    claim = client.claim("t1", "a", session=session)
    assert claim.path.endswith(f"/t1/a~t{claim.token}.json")
    assert claim.entry.attempt_path == f"a~t{claim.token}.json"
    assert claim.entry.path == "a.json"
    Path(claim.path).parent.mkdir(parents=True, exist_ok=True)
    Path(claim.path).write_bytes(b"{}")
    client.commit("t1", "a", claim.token, 2, digest(b"{}"), session=session)
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    lease = client.consume("t1", "g", session=session)
    assert lease.path == claim.path and read_verified(lease) == b"{}"


def test_retention_sweeps_dead_attempts_files(tmp_path: Path) -> None:
    """Older attempts' files beside the entry's go, and the partial (temp) files they
    kept to be resumed; newer ones and other entries' stay."""
    d = tmp_path / "t1" / "out"
    d.mkdir(parents=True)
    kept = (".a~t5.bin.baton-tmp-5-ab", ".a.bin.baton-tmp-4-cd")
    stay = ("a.bin", "a~t12.bin", "b~t3.bin", ".b~t5.bin.baton-tmp-5-ab",
            ".a~t13.bin.baton-tmp-13-ef", ".a~t5.bin.baton-tmp-6-ab")
    for name in ("a~t3.bin", "a~t9.bin", *kept, *stay):
        (d / name).write_bytes(b"x")
    hasher = Hasher(str(tmp_path))
    try:
        assert hasher.newest_attempt("t1", "out/a.bin") == ("out/a~t12.bin", 12)
        assert hasher.remove_dead_attempts("t1", "out/a.bin", 12) == 4
    finally:
        hasher.close()
    assert sorted(p.name for p in d.iterdir()) == sorted(stay)
