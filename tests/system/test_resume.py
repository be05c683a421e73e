"""Resumable large writes (``produce(..., resumable=True)``): a producer killed part-way
leaves its partial file and a resume point; the next attempt, another process, adopts
the file when its recorded prefix is intact and writes only the rest; a damaged partial
is thrown away and the write starts over. Real registry, watcher and processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import RegistryHandle, on_etcd
from resume_writer import BLOCK, block

from baton_relay.client import Client, produce
from baton_relay.client.producer import ResumePoint
from baton_relay.kernel.contract import TEMP_MARKER
from baton_relay.kernel.v1 import baton_pb2 as pb

WRITER = Path(__file__).parents[1] / "resume_writer.py"
#: the file: 2 GiB, a resume point every 100 MiB, killed at about 70 %
SIZE = 2 << 30
EVERY = 100 << 20
KILL_AT = 0.70


def writer(registry: RegistryHandle, ttl: int, size: int = SIZE, every: int = EVERY,
           chunk: int = BLOCK) -> subprocess.Popen[str]:
    """A writer process (``resume_writer.py``); ``every`` 0: produce's own resume points."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(WRITER.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-u", str(WRITER), registry.address, "t", "big", str(size),
         str(every), str(ttl), str(chunk)], stdout=subprocess.PIPE, text=True, env=env)


def lines(proc: subprocess.Popen[str]) -> Any:
    assert proc.stdout is not None
    for line in proc.stdout:
        yield json.loads(line)


def payload_digest(size: int = SIZE) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for i in range(size // BLOCK):
        h.update(block(i))
    return str(h.hexdigest())


def partials(staging: Path) -> list[Path]:
    if not (staging / "t").is_dir():
        return []
    return [p for p in (staging / "t").iterdir() if TEMP_MARKER in p.name]


def kill_at_seventy_percent(registry: RegistryHandle, size: int = SIZE,
                            every: int = EVERY) -> int:
    """Run a first writer and SIGKILL it once a resume point past 70 % is recorded; the
    last point it recorded."""
    first = writer(registry, ttl=2, size=size, every=every)
    saved = -1
    for said in lines(first):
        assert "done" not in said, "the first writer finished before it was killed"
        saved = said.get("saved", saved)
        if saved >= KILL_AT * size:
            first.send_signal(signal.SIGKILL)
            break
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    return saved


@pytest.fixture
def big_task(client: Client, watcher_factory: Callable[..., Any]) -> Client:
    watcher_factory()
    client.operator.create_task({"task_id": "t", "max_retries": 3,
                                 "backoff": {"base_seconds": 0.01},
                                 "entries": [{"file_id": "big", "path": "big.bin"}]})
    return client


def test_a_killed_large_write_resumes_where_its_last_resume_point_left_it(
        registry: RegistryHandle, staging: Path, big_task: Client,
        wait_for: Callable[..., None]) -> None:
    """2 GiB, a resume point every 100 MiB, SIGKILL at ~70 %: the next attempt (another
    process) adopts the partial file at the last point and writes only the rest — bytes
    written in all at most 1.35 times the size — and the entry is verified with the digest of the
    whole payload."""
    saved = kill_at_seventy_percent(registry)
    (partial,) = partials(staging)
    first_wrote = partial.stat().st_size  # the first attempt wrote sequentially
    second = writer(registry, ttl=10)
    said = list(lines(second))
    assert second.wait(timeout=120) == 0
    start = said[0]
    assert start["start"] == saved and start["attempt"] == 2
    done = said[-1]
    assert done["written"] == SIZE - saved
    assert first_wrote + done["written"] <= 1.35 * SIZE
    wait_for(lambda: big_task.operator.get_entry("t", "big").state == pb.ENTRY_STATE_VERIFIED, 120,
             "the resumed file to be verified")
    entry = big_task.operator.get_entry("t", "big")
    assert (entry.size, entry.digest) == (SIZE, payload_digest())
    assert not partials(staging)  # the adopted partial became the file


def test_a_write_killed_part_way_re_does_at_most_its_resume_bound(
        registry: RegistryHandle, staging: Path, big_task: Client,
        wait_for: Callable[..., None]) -> None:
    """256 MiB with produce's own resume points, in 16 MiB write calls, stopped and
    killed once 60 % is on disk: the next attempt goes on at most 8 MiB (the smaller of
    8 MiB and 5 % of the size) before where the first one stopped, and the whole file
    is verified."""
    size, chunk, bound = 256 << 20, 16 << 20, 8 << 20

    def on_disk() -> int:
        return sum(p.stat().st_size for p in partials(staging))

    first = writer(registry, ttl=2, size=size, every=0, chunk=chunk)
    try:
        wait_for(lambda: on_disk() >= 0.6 * size, 120, "60 % of the file on disk")
        first.send_signal(signal.SIGSTOP)  # nothing more is written while we look
        stopped_at = on_disk()
    finally:
        first.kill()
        first.wait(timeout=30)
    assert stopped_at < size, "the first writer finished before it was stopped"
    second = writer(registry, ttl=10, size=size, every=0, chunk=chunk)
    said = list(lines(second))
    assert second.wait(timeout=120) == 0
    start = said[0]["start"]
    assert said[0]["attempt"] == 2 and 0 <= stopped_at - start <= bound, (stopped_at, start)
    assert said[-1]["written"] == size - start
    wait_for(lambda: big_task.operator.get_entry("t", "big").state == pb.ENTRY_STATE_VERIFIED, 120,
             "the resumed file to be verified")
    entry = big_task.operator.get_entry("t", "big")
    assert (entry.size, entry.digest) == (size, payload_digest(size))


def test_a_damaged_partial_file_is_not_adopted_and_the_write_starts_over(
        registry: RegistryHandle, staging: Path, big_task: Client,
        wait_for: Callable[..., None]) -> None:
    """The same kill, then one byte of the partial file changed within its recorded
    prefix: the next attempt does not adopt it (removes it) and writes the whole file,
    which is verified."""
    kill_at_seventy_percent(registry)
    (partial,) = partials(staging)
    with partial.open("r+b") as f:
        f.seek(12345)
        old = f.read(1)
        f.seek(12345)
        f.write(bytes([old[0] ^ 0xFF]))
    second = writer(registry, ttl=10)
    said = list(lines(second))
    assert second.wait(timeout=120) == 0
    assert said[0]["start"] == 0
    assert said[-1]["written"] == SIZE
    assert not partial.exists()
    wait_for(lambda: big_task.operator.get_entry("t", "big").state == pb.ENTRY_STATE_VERIFIED, 120,
             "the rewritten file to be verified")
    entry = big_task.operator.get_entry("t", "big")
    assert (entry.size, entry.digest) == (SIZE, payload_digest())


def test_an_attempt_that_does_not_resume_removes_the_partial_it_was_handed(
        registry: RegistryHandle, staging: Path, big_task: Client,
        wait_for: Callable[..., None]) -> None:
    """A resumable write killed at 70 %, then an attempt that is not resumable: the
    partial file its resume point names is removed (nobody would resume from it), and
    the new attempt's file is the one verified."""
    kill_at_seventy_percent(registry, size=64 << 20, every=4 << 20)
    (partial,) = partials(staging)
    wait_for(lambda: big_task.operator.get_entry("t", "big").state == pb.ENTRY_STATE_PENDING, 30,
             "the killed writer's claim to be taken back (its session's TTL)")
    wait_for(lambda: "claimable" in big_task.operator.explain("t", "big").text, 10,
             "the backoff to end")
    with big_task.open_session("plain", ttl=10) as s, produce(big_task, s, "t", "big") as out:
        assert out.claim.checkpoint is not None and out.size == 0
        assert not partial.exists()
        out.write(b"small")
    wait_for(lambda: big_task.operator.get_entry("t", "big").state == pb.ENTRY_STATE_VERIFIED, 30,
             "the new file to be verified")
    assert big_task.operator.get_entry("t", "big").digest == blake3.blake3(b"small").hexdigest()
    assert not partials(staging)


def test_a_resume_point_is_followed_only_to_an_earlier_attempt_of_the_same_entry() -> None:
    """The temp file must be one an earlier attempt (a smaller token) of this entry
    wrote: not another entry's beside it, not this attempt's or a later one's."""
    def before(temp: str, name: str = "big~t9.bin", token: int = 9) -> bool:
        return ResumePoint(temp, 10, "0" * 64).before(name, token)

    assert before(f".big~t7.bin{TEMP_MARKER}7-ab")
    assert before(f".big.bin{TEMP_MARKER}7-ab")  # an entry without attempt files
    assert before(f".big.bin{TEMP_MARKER}7-ab", name="big.bin")
    for other in (f".other~t7.bin{TEMP_MARKER}7-ab", f".big~t9.bin{TEMP_MARKER}9-ab",
                  f".big~t12.bin{TEMP_MARKER}12-ab", f".big~t7.bin{TEMP_MARKER}8-ab",
                  f".big~t7.png{TEMP_MARKER}7-ab", f".big~t7.bin{TEMP_MARKER}7-"):
        assert not before(other), other


def test_a_resume_point_naming_anything_but_a_temp_file_beside_the_entry_is_ignored() -> None:
    """A checkpoint's data is the earlier attempt's word, not a path to follow: only a
    Baton temp file's name in the entry's own directory is ever opened."""
    def point(**d: Any) -> ResumePoint | None:
        data = {"format": "baton-resume/1", "temp": f".big.bin{TEMP_MARKER}7-ab",
                "length": 10, "blake3": "0" * 64, **d}
        return ResumePoint.of(pb.Checkpoint(data=json.dumps(data).encode()))

    assert point() == ResumePoint(f".big.bin{TEMP_MARKER}7-ab", 10, "0" * 64)
    for bad in ({"temp": f"../x{TEMP_MARKER}1"}, {"temp": f"sub/.x{TEMP_MARKER}1"},
                {"temp": "big.bin"}, {"temp": ".big.bin"}, {"length": -1},
                {"format": "other"}, {"length": "many"}):
        assert point(**bad) is None, bad
    assert ResumePoint.of(pb.Checkpoint(data=b"not json")) is None
    assert ResumePoint.of(None) is None


def test_baton_put_resume_copies_only_what_the_killed_put_did_not(
        registry: RegistryHandle, staging: Path, big_task: Client, tmp_path: Path,
        wait_for: Callable[..., None]) -> None:
    """`baton put --resume` reading a pipe is killed after its resume points passed 2 MiB;
    a second `baton put --resume` is given a source whose adopted part is zeros: it seeks
    past that part, so the file committed is the first put's bytes there and the source's
    after — the whole payload, which a copy started over would not be."""
    from baton_relay.registry.store.etcd import Etcd
    from baton_relay.registry.store.keys import ClaimRef, Keys
    from baton_relay.registry.verbs.checkpoints import CheckpointRecord

    payload = b"".join(block(i) for i in range(5))  # 5 MiB
    env = {**os.environ, "BATON_REGISTRY": registry.address}
    fifo = tmp_path / "src.fifo"
    os.mkfifo(fifo)
    first = subprocess.Popen([sys.executable, "-m", "baton_relay.client.cli", "put", "t",
                              "big", str(fifo), "--resume", "--resume-every", "1", "--ttl", "2"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    key = Keys(registry.prefix).checkpoint(ClaimRef("p", "t", "big"))

    def resumed_at() -> int:
        async def read(etcd: Etcd) -> int:
            record = CheckpointRecord.load(await etcd.get(key))
            point = ResumePoint.of(record.to_pb()) if record is not None else None
            return point.length if point is not None else -1
        return on_etcd(registry.etcd, read)

    with fifo.open("wb") as pipe:
        pipe.write(payload[:3 << 20])  # and the pipe stays open: the copy waits for more
        pipe.flush()
        wait_for(lambda: resumed_at() >= 2 << 20, 30, "a resume point past 2 MiB")
        first.kill()
        first.wait(timeout=30)
    adopted = resumed_at()
    wait_for(lambda: big_task.operator.get_entry("t", "big").state == pb.ENTRY_STATE_PENDING, 30,
             "the killed put's claim to be taken back (its session's TTL)")
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(adopted) + payload[adopted:])
    second = subprocess.run([sys.executable, "-m", "baton_relay.client.cli", "put", "t", "big",
                             str(src), "--resume", "--resume-every", "1", "-o", "json"],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert second.returncode == 0, second.stdout + second.stderr
    assert json.loads(second.stdout)["size"] == len(payload)
    wait_for(lambda: big_task.operator.get_entry("t", "big").state == pb.ENTRY_STATE_VERIFIED, 30,
             "the file to be verified")
    assert big_task.operator.get_entry("t", "big").digest == blake3.blake3(payload).hexdigest()
