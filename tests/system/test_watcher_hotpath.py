"""The watcher's per-file path: small files checked where their event is read, reports
of a batch in one call, the queue and intake hand-offs that make it so."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import blake3
import pytest
from watcher_fixtures import is_state, make_task, put_bytes

from baton_relay.client import Client, Session
from baton_relay.kernel.errors import BatonError
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher import Watcher
from baton_relay.watcher.events import FsEvent, Intake, Kind
from baton_relay.watcher.hashing import Hashed, Hasher, Identity
from baton_relay.watcher.jobs import JobQueue
from baton_relay.watcher.reporter import Outcome, Reporter

Wait = Callable[..., None]


def test_small_files_are_verified_without_a_hash_worker(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path,
) -> None:
    """Small files published one after the other into a watched tree are checked where
    their events and news are read, not by a hash worker: not one, even when a file's
    event, the news of its commit and its report's answer race (the thread that holds
    the entry checks it again itself)."""
    w = watcher_factory()
    (staging / "hp" / "d").mkdir(parents=True)
    make_task(client, "hp", {f"f{i}": f"d/f{i}.bin" for i in range(20)})
    wait_for(lambda: w.table.needs_watch("hp") == (True, True), what="hp watched")
    before = w.metrics.snapshot()
    for i in range(20):
        put_bytes(client, session, "hp", f"f{i}", os.urandom(1000 + i))
    for i in range(20):
        wait_for(is_state(client, "hp", f"f{i}", pb.ENTRY_STATE_VERIFIED), what=f"f{i}")
    wait_for(w.jobs.idle, what="the watcher idle")
    after = w.metrics.snapshot()
    workers = after.get("worker_checks", 0) - before.get("worker_checks", 0)
    assert workers == 0, (workers, before, after)
    assert after["inline_checks"] - before.get("inline_checks", 0) >= 20 - workers
    assert after["hashes"] - before.get("hashes", 0) >= 20


def test_a_large_file_is_handed_to_the_hash_workers(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path,
) -> None:
    """A file from the small-file bound up is hashed by a worker, not where its event
    was read, and verified all the same."""
    w = watcher_factory()
    (staging / "hl").mkdir()
    make_task(client, "hl", {"big": "big.bin"})
    wait_for(lambda: w.table.needs_watch("hl") == (True, True), what="hl watched")
    before = w.metrics.get("worker_checks")
    put_bytes(client, session, "hl", "big", os.urandom(w.hasher.small_file + 1))
    wait_for(is_state(client, "hl", "big", pb.ENTRY_STATE_VERIFIED), what="big verified")
    assert w.metrics.get("worker_checks") > before


def test_reports_submitted_together_leave_in_one_call(client: Client, wait_for: Wait) -> None:
    """Reports a thread submits while gathering wake the reporter once: one
    ReportVerificationBatch carries them all, and each gets its own answer."""
    reporter = Reporter(client).start()
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def done(outcome: Outcome) -> None:
        with lock:
            outcomes.append(outcome)

    try:
        wait_for(lambda: reporter._idle, what="the reporter waiting")
        with reporter.gathering():
            for i in range(10):
                reporter.submit(pb.ReportVerificationRequest(
                    task_id="no-such-task", file_id=f"f{i}", size=1, digest="0" * 64,
                    reporter="test"), done)
        wait_for(lambda: len(outcomes) == 10, what="ten answers")
    finally:
        reporter.close()
    assert reporter.batches == 1 and reporter.reports == 10
    assert all(isinstance(o, BatonError) for o in outcomes)  # no such task: each told


def test_job_queue_hold_is_a_worker_of_its_own() -> None:
    """A held key is taken out of the queue; one submitted while held, or held while a
    worker has it, is handed out again once released, never to two at once."""
    jobs = JobQueue()
    jobs.submit(("t", "a"))
    assert jobs.hold([("t", "a"), ("t", "b")]) == [("t", "a"), ("t", "b")]
    assert jobs.pending() == []  # the queued one is the holder's now
    jobs.submit(("t", "a"))  # an event while held
    assert jobs.pending() == []
    jobs.release([("t", "a"), ("t", "b")])
    assert jobs.get() == ("t", "a")  # checked once more, by a worker
    assert jobs.hold([("t", "a")]) == []  # the worker has it
    jobs.done(("t", "a"))
    assert jobs.get() == ("t", "a")  # the hold that could not be, made up for
    jobs.done(("t", "a"))
    assert jobs.idle()
    jobs.close()


def test_job_queue_keeps_for_an_inline_check_what_another_one_asked_for_meanwhile(
) -> None:
    """A key another inline check asked for while it was held (its event and its news
    raced) stays with the holder on ``release(keep_again=True)``, to check again on its
    thread; one submitted while held (a large file, a retry) goes to the workers."""
    jobs = JobQueue()
    a, b = ("t", "a"), ("t", "b")
    assert jobs.hold([a, b]) == [a, b]
    assert jobs.hold([a]) == []  # the other thread's news of a: the holder's to redo
    jobs.submit(b)  # b turned out large: a worker's
    assert jobs.release([a, b], keep_again=True) == [a]
    assert jobs.hold([a]) == []  # still held: no one else checks it meanwhile
    assert jobs.get() == b
    jobs.done(b)
    assert jobs.release([a], keep_again=True) == [a]  # asked again while held, again
    assert jobs.release([a], keep_again=True) == []
    assert jobs.idle()
    assert jobs.hold([a]) == [a]
    jobs.hold([a])
    jobs.submit(a)  # asked by both: a submit wants a worker
    assert jobs.release([a], keep_again=True) == []
    assert jobs.get() == a
    jobs.done(a)
    assert jobs.idle()
    jobs.close()


def test_intake_take_returns_every_waiting_event_overflow_first() -> None:
    """One take is every event queued, in order, after an OVERFLOW if any were dropped;
    it waits for one when none is there, and returns nothing once closed."""
    intake = Intake(3)
    intake.put_all([FsEvent(Kind.LANDED, p) for p in "abcd"])
    assert intake.take(0) == [FsEvent(Kind.OVERFLOW),
                              *(FsEvent(Kind.LANDED, p) for p in "abc")]
    assert intake.take(0) == []
    got: list[list[FsEvent]] = []
    taker = threading.Thread(target=lambda: got.append(intake.take(10)))
    taker.start()
    intake.put(FsEvent(Kind.GONE, "x"))
    taker.join(10)
    assert got == [[FsEvent(Kind.GONE, "x")]]
    intake.close()
    assert intake.take(10) == []


@pytest.fixture
def hasher(tmp_path: Path) -> Hasher:
    """A hasher on a root with one task directory ``t``; small files below 4 KiB."""
    (tmp_path / "root" / "t").mkdir(parents=True)
    return Hasher(str(tmp_path / "root"), small_file=4096)


def test_look_hashes_a_small_file_and_only_stats_a_large_or_known_one(
    hasher: Hasher,
) -> None:
    """look: a small file's digest and identity; a large file's identity alone; a small
    file whose identity the caller knows, its identity alone; a missing file, None."""
    small, large = os.urandom(100), os.urandom(5000)
    Path(hasher.root, "t", "s").write_bytes(small)
    Path(hasher.root, "t", "l").write_bytes(large)
    found = hasher.look("t", "s")
    assert isinstance(found, Hashed)
    assert found.digest == blake3.blake3(small).hexdigest()
    assert found.identity.size == 100
    assert hasher.look("t", "s", known=found.identity) == found.identity
    big = hasher.look("t", "l")
    assert isinstance(big, Identity) and big.size == 5000
    assert hasher.look("t", "nope") is None
    assert hasher.look("t", "no/such/dir") is None


def test_attempts_lists_a_directory_once_for_all_its_entries(hasher: Hasher) -> None:
    """attempts: the newest attempt's file of each entry in a directory, by its path."""
    d = Path(hasher.root, "t", "x")
    d.mkdir()
    for name in ("a~t5.bin", "a~t7.bin", "b.bin", ".a~t9.bin.baton-tmp-9-n", "c~t3"):
        (d / name).write_bytes(b"")
    assert hasher.attempts("t", "x") == {"x/a.bin": ("x/a~t7.bin", 7), "x/c": ("x/c~t3", 3)}
    assert hasher.attempts("t", "missing") == {}
