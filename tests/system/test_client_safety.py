"""The producer and consumer helpers in a shared staging tree: no symlink is followed,
no temp name can be guessed or reused, and no read is unbounded or can hang."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import RegistryHandle

from baton_relay.client import Client, Session, consume, produce, put, read_verified
from baton_relay.client.producer import NAME_MAX, TEMP_MARKER, temp_name
from baton_relay.kernel import errors
from baton_relay.kernel.contract import attempt_path, parse_attempt
from baton_relay.kernel.v1 import baton_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]

#: a temp file of entry ``a.bin``: the watcher's marker, the claim's token, 64 random bits
TEMP_NAME = re.compile(r"\.a~t\d+\.bin\.baton-tmp-(\d+)-([0-9a-f]{16})")

#: how long a consumer may take to refuse a path (it must not read or wait at all)
DEADLINE = 20.0

#: consume() in a process of its own, its address space capped once it is connected:
#: reading /dev/zero, or waiting on a FIFO, ends in MemoryError or a killed child, not
#: in a test run that eats the machine's memory or never ends.
CONSUMER = """
import resource, sys, time
from baton_relay.client import Client, consume
from baton_relay.kernel import errors
address, task, headroom = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Client(address, timeout=10) as c, c.open_session("reader", ttl=10) as s:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) << 10
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.RLIM_INFINITY))
    start = time.monotonic()
    try:
        with consume(c, s, task, timeout=5) as got:
            print("read", len(got.data))
    except errors.BatonError as e:
        print(type(e).__name__, round(time.monotonic() - start, 3), e)
"""


def task(client: Client, path: str = "a.bin", task_id: str = "t1") -> None:
    client.operator.create_task({"task_id": task_id, "entries": [{"file_id": "a", "path": path}]})


def verified(client: Client, session: Session, data: bytes) -> pb.Entry:
    """Produce ``data`` as entry t1/a and report it as the watcher would: verified."""
    put(client, session, "t1", "a", io.BytesIO(data))
    return client.watcher.report("t1", "a", len(data), blake3.blake3(data).hexdigest())


def handed_back(client: Client) -> bool:
    """The entry was nacked: verified again, consumed by no group, held by no consumer."""
    entry = client.operator.get_entry("t1", "a")
    return entry.state == pb.ENTRY_STATE_VERIFIED and not entry.consumed_by and not entry.consuming


def consume_elsewhere(registry: RegistryHandle, headroom: int = 256 << 20) -> str:
    """consume() t1 in a child with at most ``headroom`` more address space; its report."""
    done = subprocess.run(
        [sys.executable, "-c", CONSUMER, registry.address, "t1", str(headroom)],
        cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


# --- producer ----------------------------------------------------------------------


def test_produce_refuses_a_symlink_at_the_final_name(
        client: Client, staging: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A symlink planted at the attempt's name fails the entry; its target is untouched."""
    task(client)
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (staging / "t1").mkdir()
    # at the attempt's name, once the token is known
    _planting(client, monkeypatch, lambda token: (
        staging / "t1" / attempt_path("a.bin", token)).symlink_to(target))
    with (client.open_session("p", ttl=10) as s,
          pytest.raises(errors.InvalidArgument, match="symlink"),
          produce(client, s, "t1")):
        pytest.fail("the body must not run when the path cannot be published to")
    assert target.read_bytes() == b"precious"
    [final] = (staging / "t1").iterdir()  # no temp file
    assert final.is_symlink() and parse_attempt(final.name) is not None
    entry = client.operator.get_entry("t1", "a")
    assert entry.state == pb.ENTRY_STATE_PENDING and "symlink" in entry.error


@pytest.mark.parametrize("link", ["t1", "t1/sub"])
def test_produce_refuses_a_symlinked_directory_on_the_path(
        client: Client, staging: Path, tmp_path: Path, link: str) -> None:
    """A symlink as the task's directory or one below it fails the entry; nothing lands
    where it points."""
    task(client, "sub/a.bin")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (staging / link).parent.mkdir(parents=True, exist_ok=True)
    (staging / link).symlink_to(elsewhere, target_is_directory=True)
    with (client.open_session("p", ttl=10) as s,
          pytest.raises(errors.InvalidArgument, match=f"{link} is a symlink")):
        put(client, s, "t1", "a", io.BytesIO(b"payload"))
    assert not any(elsewhere.iterdir())
    entry = client.operator.get_entry("t1", "a")
    assert entry.state == pb.ENTRY_STATE_PENDING and "symlink" in entry.error


def _temp_file(directory: Path) -> re.Match[str]:
    names = [p.name for p in directory.iterdir() if parse_attempt(p.name) is None]
    assert len(names) == 1 and TEMP_MARKER in names[0], names
    match = TEMP_NAME.fullmatch(names[0])
    assert match, names[0]
    return match


def test_temp_names_carry_the_marker_and_cannot_be_guessed(client: Client, staging: Path) -> None:
    """Each attempt writes under .NAME.baton-tmp-TOKEN-NONCE, with a fresh random nonce."""
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "x/a.bin"},
                                                              {"file_id": "b", "path": "y/a.bin"}]})
    seen = []
    with client.open_session("p", ttl=10) as s:
        for file_id, directory in (("a", "x"), ("b", "y")):
            with produce(client, s, "t1", file_id) as out:
                temp = _temp_file(staging / "t1" / directory)
                assert int(temp[1]) == out.claim.token
                seen.append(temp[2])
                out.write(b"payload")
            assert [p.name for p in (staging / "t1" / directory).iterdir()] == [
                Path(out.claim.path).name]
    assert seen[0] != seen[1]


def _planting(client: Client, monkeypatch: pytest.MonkeyPatch,
              plant: Callable[[int], None]) -> None:
    """Make ``client.claim`` call ``plant(token)`` before returning: the moment the
    temp name's token is known, and the helper has not made the file yet."""
    real_claim = client.claim

    def claim_then_plant(*args: Any, **kw: Any) -> Any:
        claim = real_claim(*args, **kw)
        plant(claim.token)
        return claim

    monkeypatch.setattr(client, "claim", claim_then_plant)


def test_a_file_at_the_old_predictable_name_is_not_written_through(
        client: Client, staging: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A symlink planted at .NAME.baton-tmp-TOKEN, once the token is known, is left alone."""
    task(client)
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (staging / "t1").mkdir()
    _planting(client, monkeypatch, lambda token: (
        staging / "t1" / f".{attempt_path('a.bin', token)}{TEMP_MARKER}{token}"
    ).symlink_to(target))
    with client.open_session("p", ttl=10) as s:
        entry = put(client, s, "t1", "a", io.BytesIO(b"payload"))
    assert entry.state == pb.ENTRY_STATE_WRITTEN
    assert Path(entry.abs_attempt_path).read_bytes() == b"payload"
    assert target.read_bytes() == b"precious"


@pytest.mark.parametrize("planted", ["leftover", "symlink"])
def test_a_temp_name_taken_already_is_never_reused(
        client: Client, staging: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        planted: str) -> None:
    """Should a temp name exist already (a crashed attempt's file, a planted symlink),
    O_EXCL fails the attempt rather than truncate, reuse or follow what is there."""
    task(client)
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (staging / "t1").mkdir()
    nonce = "0" * 16

    def plant(token: int) -> None:
        taken = staging / "t1" / temp_name(attempt_path("a.bin", token), token, nonce)
        if planted == "symlink":
            taken.symlink_to(target)
        else:
            taken.write_bytes(b"crashed attempt")

    _planting(client, monkeypatch, plant)
    with (client.open_session("p", ttl=10) as s,
          pytest.raises(FileExistsError),
          produce(client, s, "t1", "a", nonce=lambda: nonce)):
        pytest.fail("the body must not run without a temp file of its own")
    assert target.read_bytes() == b"precious"
    [left] = list((staging / "t1").iterdir())
    assert left.is_symlink() if planted == "symlink" else left.read_bytes() == b"crashed attempt"
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_PENDING


def test_a_long_name_keeps_the_marker_and_the_nonce() -> None:
    """A temp name never grows past NAME_MAX: the entry's name is cut, not the marker."""
    name = "é" * 127  # 254 bytes
    made = temp_name(name, 123456789, "f" * 16)
    assert len(made.encode()) <= NAME_MAX
    assert made.endswith(f"{TEMP_MARKER}123456789-{'f' * 16}") and made.startswith(".é")


def test_produce_makes_missing_directories_and_publishes(client: Client, staging: Path) -> None:
    """Directories below the staging root are made as the path is walked; the file lands."""
    task(client, "x/y/a.bin")
    with client.open_session("p", ttl=10) as s:
        with produce(client, s, "t1") as out:
            out.write(b"hello")
        assert out.entry is not None and out.entry.state == pb.ENTRY_STATE_WRITTEN
    final = Path(out.claim.path)
    assert [p.name for p in (staging / "t1" / "x" / "y").iterdir()] == [final.name]
    assert final.parent == staging / "t1" / "x" / "y" and final.read_bytes() == b"hello"


# --- consumer ----------------------------------------------------------------------


def test_consume_still_reads_and_acks_a_regular_file(client: Client) -> None:
    """The checked path still delivers the verified bytes and acks."""
    task(client, "d/a.bin")
    with client.open_session("c", ttl=10) as s:
        verified(client, s, b"payload")
        with consume(client, s, "t1", timeout=5) as got:
            assert got.data == b"payload"
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_CONSUMED


def test_consume_refuses_a_symlink_to_dev_zero(
        client: Client, registry: RegistryHandle, staging: Path) -> None:
    """A verified file swapped for a symlink to /dev/zero is refused at once and nacked;
    nothing is read through it."""
    task(client)
    with client.open_session("p", ttl=10) as s:
        verified(client, s, b"payload")
    final = Path(client.operator.get_entry("t1", "a").abs_attempt_path)
    final.unlink()
    final.symlink_to("/dev/zero")
    report = consume_elsewhere(registry)
    assert report.startswith("ChecksumMismatch") and "symlink" in report, report
    assert float(report.split()[1]) < 2.0, report
    assert handed_back(client)


def test_consume_refuses_a_fifo_without_waiting(
        client: Client, registry: RegistryHandle, staging: Path) -> None:
    """A FIFO at the path is refused as not a regular file; opening it does not block."""
    task(client)
    with client.open_session("p", ttl=10) as s:
        verified(client, s, b"payload")
    final = Path(client.operator.get_entry("t1", "a").abs_attempt_path)
    final.unlink()
    os.mkfifo(final)
    report = consume_elsewhere(registry)
    assert report.startswith("ChecksumMismatch") and "not a regular file" in report, report
    assert handed_back(client)


@pytest.mark.parametrize("grow", [1, 64 << 30], ids=["one-byte", "sparse-64GiB"])
def test_consume_refuses_a_file_longer_than_the_entry(
        client: Client, registry: RegistryHandle, staging: Path, grow: int) -> None:
    """A file that grew past the verified size is refused without being read, and nacked."""
    task(client)
    with client.open_session("p", ttl=10) as s:
        verified(client, s, b"payload")
    final = Path(client.operator.get_entry("t1", "a").abs_attempt_path)
    os.truncate(final, len(b"payload") + grow)
    report = consume_elsewhere(registry)
    assert report.startswith("ChecksumMismatch") and "longer than the verified 7" in report, report
    assert handed_back(client)


def test_consume_refuses_a_symlinked_directory_even_with_the_right_bytes(
        client: Client, staging: Path, tmp_path: Path) -> None:
    """A directory on the path swapped for a symlink is refused, whatever it leads to."""
    task(client, "d/a.bin")
    with client.open_session("c", ttl=10) as s:
        verified(client, s, b"payload")
        copy = tmp_path / "copy"
        (staging / "t1" / "d").rename(copy)
        (staging / "t1" / "d").symlink_to(copy, target_is_directory=True)
        with pytest.raises(errors.ChecksumMismatch, match="t1/d is a symlink"), \
                consume(client, s, "t1", timeout=5):
            pytest.fail("the body must not run with bytes read through a symlink")
    assert handed_back(client)


def test_read_verified_sizes_its_reads_by_the_file_not_the_lease(
        client: Client, staging: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No read asks for more than the file's size plus one byte, whatever the lease says."""
    task(client)
    asked: list[int] = []
    real_read = os.read

    def counting_read(fd: int, n: int) -> bytes:
        asked.append(n)
        return real_read(fd, n)

    with client.open_session("c", ttl=10) as s:
        verified(client, s, b"payload")
        lease = client.consume("t1", "default", session=s)
        with monkeypatch.context() as m:
            m.setattr(os, "read", counting_read)
            assert read_verified(lease) == b"payload"
            with pytest.raises(errors.ChecksumMismatch, match="read 7 bytes"):
                read_verified(replace(lease, size=1 << 40))
        assert asked and max(asked) == len(b"payload") + 1
        Path(lease.path).write_bytes(b"pay")
        with pytest.raises(errors.ChecksumMismatch, match="read 3 bytes"):
            read_verified(lease)
