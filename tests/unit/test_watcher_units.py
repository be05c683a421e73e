"""Watcher parts on their own: config, job queue, hasher, inotify emitter, statfs, logs."""

from __future__ import annotations

import io
import json
import logging
import os
import queue
from collections.abc import Callable
from pathlib import Path

import blake3
import pytest

from baton_relay.kernel.errors import BatonError
from baton_relay.kernel.logs import formatter, log
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher import Watcher, WatcherConfig, load_config
from baton_relay.watcher.emitter import InotifyEmitter
from baton_relay.watcher.errors import FileChanged, Refused
from baton_relay.watcher.events import FsEvent, Intake, Kind
from baton_relay.watcher.fsinfo import REMOTE_MAGIC, blind_spot, fs_type
from baton_relay.watcher.hashing import Hashed, Hasher
from baton_relay.watcher.jobs import JobQueue
from baton_relay.watcher.state import CONSUMED, Table


def test_config_precedence_flag_env_file_default(tmp_path: Path) -> None:
    """A flag beats BATON_* which beats the TOML file which beats the default."""
    toml = tmp_path / "w.toml"
    toml.write_text('staging = "/from/file"\nhash_workers = 7\nobserver = "poll"\n')
    env = {"BATON_CONFIG": str(toml), "BATON_HASH_WORKERS": "5"}
    cfg = load_config(["--observer", "inotify"], env)
    assert cfg == WatcherConfig(staging="/from/file", hash_workers=5, observer="inotify")
    assert load_config([], {}) == WatcherConfig()


def test_config_tls_files_from_flags_variables_and_file(tmp_path: Path) -> None:
    """--ca/--cert/--key, BATON_CA/CERT/KEY and the TOML keys land; unset means ""."""
    toml = tmp_path / "w.toml"
    toml.write_text('ca = "/file/ca.pem"\ncert = "/file/w.pem"\nkey = "/file/w.key"\n')
    env = {"BATON_CONFIG": str(toml), "BATON_CERT": "/env/w.pem", "BATON_KEY": "/env/w.key"}
    cfg = load_config(["--key", "/flag/w.key"], env)
    assert (cfg.ca, cfg.cert, cfg.key) == ("/file/ca.pem", "/env/w.pem", "/flag/w.key")
    cfg = load_config(["--ca", "/c", "--cert", "/w", "--key", "/k"], {})
    assert (cfg.ca, cfg.cert, cfg.key) == ("/c", "/w", "/k")
    env = {"BATON_CA": "/e/ca", "BATON_CERT": "/e/w", "BATON_KEY": "/e/k"}
    assert load_config([], env) == WatcherConfig(ca="/e/ca", cert="/e/w", key="/e/k")
    assert (WatcherConfig().ca, WatcherConfig().cert, WatcherConfig().key) == ("", "", "")


def test_watcher_client_uses_the_configured_tls_files_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The watcher's client takes its files from the configuration, never straight
    from the process environment: with none configured it speaks plaintext."""
    monkeypatch.setenv("BATON_CA", "/not/read.pem")
    plain = Watcher(WatcherConfig(staging=str(tmp_path / "a")))
    try:
        assert not plain.client.credentials.tls
    finally:
        plain.client.close()
        plain.cache.close()
    files = {"ca": "/c.pem", "cert": "/w.pem", "key": "/w.key"}
    with pytest.raises(BatonError, match="cannot read the CA"):
        Watcher(WatcherConfig(staging=str(tmp_path / "b"), **files))


@pytest.mark.parametrize("argv", [["--observer", "fanotify"], ["--hash-workers", "0"],
                                  ["--log-format", "xml"], ["--reconcile-interval", "x"]])
def test_config_refuses_bad_values(argv: list[str]) -> None:
    """Unknown choices, non-positive counts and non-numbers are usage errors."""
    with pytest.raises(SystemExit):
        load_config(argv, {})


def test_job_queue_coalesces_and_never_loses_the_last_event() -> None:
    """Repeated submits of a key give one job; a submit while held gives exactly one more."""
    jobs = JobQueue()
    for _ in range(5):
        jobs.submit(("t", "a"))
    jobs.submit(("t", "b"))
    assert len(jobs) == 2
    first = jobs.get()
    assert first == ("t", "a")
    jobs.submit(("t", "a"))  # while held: handed out again after done()
    jobs.submit(("t", "a"))
    assert jobs.get() == ("t", "b")
    jobs.done(("t", "b"))
    assert len(jobs) == 0
    jobs.done(first)
    assert jobs.get() == ("t", "a")
    jobs.done(("t", "a"))
    assert jobs.idle()


def test_job_queue_delays_and_earlier_submission_wins() -> None:
    """A delayed key is not due before its time; submitting it now makes it due now."""
    now = [100.0]
    jobs = JobQueue(clock=lambda: now[0])
    jobs.submit(("t", "a"), delay=5.0)
    jobs.submit(("t", "b"), delay=1.0)
    now[0] = 101.5
    assert jobs.get() == ("t", "b")
    jobs.submit(("t", "a"))
    assert jobs.get() == ("t", "a")
    jobs.close()
    assert jobs.get() is None


def test_intake_overflow_becomes_an_overflow_event() -> None:
    """A full intake drops events and reports one OVERFLOW before the queued ones."""
    intake = Intake(2)
    for name in "abc":
        intake.put(FsEvent(Kind.LANDED, name))
    assert intake.get(0) == FsEvent(Kind.OVERFLOW)
    assert intake.get(0) == FsEvent(Kind.LANDED, "a")
    assert intake.get(0) == FsEvent(Kind.LANDED, "b")
    assert intake.get(0) is None


@pytest.fixture
def hasher(tmp_path: Path) -> Hasher:
    """A hasher on a root with one task directory ``t``; large files from 1 MiB."""
    (tmp_path / "root" / "t").mkdir(parents=True)
    h = Hasher(str(tmp_path / "root"), large_file=1 << 20)
    yield h  # type: ignore[misc]
    h.close()


@pytest.mark.parametrize("size", [0, 1, 100_000, (1 << 20) - 1, 1 << 20, 5_000_001])
def test_hash_matches_blake3_small_and_large(hasher: Hasher, size: int) -> None:
    """Single-thread reads and the mapping helper both give the file's BLAKE3."""
    data = os.urandom(size)
    Path(hasher.root, "t", "f").write_bytes(data)
    hashed = hasher.hash("t", "f")
    assert hashed.digest == blake3.blake3(data).hexdigest()
    assert hashed.identity.size == size


def test_hash_refuses_symlinks_anywhere_and_escapes(hasher: Hasher, tmp_path: Path) -> None:
    """A symlinked file, a symlinked directory on the way, or '..' is refused."""
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "f").write_bytes(b"x")
    task = Path(hasher.root, "t")
    (task / "link").symlink_to(outside / "d" / "f")
    (task / "dirlink").symlink_to(outside / "d")
    for rel in ("link", "dirlink/f", "../t/link", "/etc/passwd"):
        with pytest.raises(Refused):
            hasher.hash("t", rel)
    with pytest.raises(Refused):
        hasher.stat("t", "link")
    assert hasher.stat("t", "absent") is None


def test_look_with_a_known_identity_reads_nothing_and_refuses_symlinks(
        hasher: Hasher, tmp_path: Path) -> None:
    """``look`` of the file whose identity the caller knows returns that identity (no
    bytes read); the same file behind a symlink, on the way or at its end, is refused
    as by the walk, and a changed or missing one is looked at as without it."""
    task = Path(hasher.root, "t")
    (task / "d").mkdir()
    (task / "d" / "f").write_bytes(b"one")
    first = hasher.look("t", "d/f")
    assert isinstance(first, Hashed) and first.digest == blake3.blake3(b"one").hexdigest()
    assert hasher.look("t", "d/f", known=first.identity) == first.identity
    (task / "dirlink").symlink_to(task / "d")
    (task / "link").symlink_to(task / "d" / "f")
    for rel in ("dirlink/f", "link"):
        with pytest.raises(Refused):
            hasher.look("t", rel, known=first.identity)
    (task / "d" / "g").write_bytes(b"two!")
    os.rename(task / "d" / "g", task / "d" / "f")
    again = hasher.look("t", "d/f", known=first.identity)
    assert isinstance(again, Hashed) and again.digest == blake3.blake3(b"two!").hexdigest()
    assert hasher.look("t", "d/absent", known=first.identity) is None


def test_hash_notices_a_file_replaced_while_hashed(hasher: Hasher,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """If the path points to another inode after the read, the result is not trusted."""
    path = Path(hasher.root, "t", "f")
    path.write_bytes(b"one")
    real = hasher._read

    def read_then_replace(fd: int) -> tuple[str, int]:
        result = real(fd)
        Path(hasher.root, "t", "g").write_bytes(b"two")
        os.rename(Path(hasher.root, "t", "g"), path)
        return result

    monkeypatch.setattr(hasher, "_read", read_then_replace)
    with pytest.raises(FileChanged, match=r"changed|replaced"):
        hasher.hash("t", "f")


def test_helper_death_is_a_changed_file(hasher: Hasher) -> None:
    """A mapping helper that dies (SIGBUS on truncation) makes the hash fail, not the daemon."""
    path = Path(hasher.root, "t", "big")
    path.write_bytes(os.urandom(2 << 20))
    hasher.hash("t", "big")  # starts this thread's helper
    helper = hasher._mapped._local.helper
    helper.process.kill()
    helper.process.wait()
    with pytest.raises(FileChanged, match="truncated"):
        hasher.hash("t", "big")
    assert hasher.hash("t", "big").identity.size == 2 << 20  # a new helper takes over


def test_emitter_watches_a_new_directory_before_announcing_it(
    tmp_path: Path, wait_for: Callable[..., None]
) -> None:
    """mkdir -p is followed down: announced once watched, later files seen, temp files not."""
    events: queue.Queue[FsEvent] = queue.Queue()

    def sink(batch: list[FsEvent]) -> None:
        for e in batch:
            events.put(e)

    em = InotifyEmitter(sink)
    em.start()

    def until(wanted: FsEvent) -> list[FsEvent]:
        seen: list[FsEvent] = []
        while wanted not in seen:
            seen.append(events.get(timeout=5))
        return seen

    try:
        em.watch(str(tmp_path), recursive=True)
        deep = tmp_path / "a" / "b"
        deep.mkdir(parents=True)
        (deep / "early").write_bytes(b"x")  # may beat the watch on b: the announcement
        until(FsEvent(Kind.DIR_CREATED, str(tmp_path / "a")))  # tells to look inside
        wait_for(lambda: em.watch_count == 3, timeout=5, what="a and a/b watched")
        (deep / ".late.baton-tmp-7").write_bytes(b"ignored")
        (deep / "late").write_bytes(b"y")
        seen = until(FsEvent(Kind.LANDED, str(deep / "late")))
        assert not any("baton-tmp" in e.path for e in seen)
        em.unwatch(str(tmp_path / "a"))
        assert em.watch_count == 1
    finally:
        em.stop()


def test_statfs_reads_the_filesystem_type(tmp_path: Path) -> None:
    """f_type comes from statfs; a local directory is no blind spot for inotify."""
    assert fs_type(str(tmp_path)) not in (None, 0)
    assert fs_type("/proc") == 0x9FA0  # PROC_SUPER_MAGIC
    assert blind_spot(str(tmp_path)) is None
    assert REMOTE_MAGIC[0x6969] == "NFS"


def test_structured_logs_carry_task_and_file_id() -> None:
    """Both formats put the fields next to the message."""
    for fmt, check in (
        (formatter("kv"), lambda s: 'msg=reported task=t1 file_id=a reason="two words"' in s),
        (formatter("json"), lambda s: json.loads(s)["file_id"] == "a"),
    ):
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(fmt)
        logger = logging.getLogger("baton.test.logs")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            log(logger, logging.INFO, "reported", task="t1", file_id="a", reason="two words")
        finally:
            logger.removeHandler(handler)
        assert check(stream.getvalue().strip()), stream.getvalue()


def test_per_entry_report_counts_are_kept_for_the_latest_entries_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A watcher verifies millions of files over its life: the report counts it keeps per
    entry are bounded, the longest known given up first, a recent one still counted
    (each report, a repeat too, in the total)."""
    from baton_relay.watcher import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "REPORTS_KEPT", 3)
    m = metrics_module.Metrics()
    for f in ("a", "b", "c"):
        m.reported("t", f)
    m.reported("t", "a")  # a repeat is not a new entry: nothing given up
    assert [m.reports_of("t", f) for f in ("a", "b", "c")] == [2, 1, 1]
    m.reported("t", "d")
    assert [m.reports_of("t", f) for f in ("a", "b", "c", "d")] == [0, 1, 1, 1]
    assert len(m._reports) == 3
    assert m.get("reports") == 5


def test_the_table_tells_of_a_consumed_entry_once_whichever_source_brings_it(
        tmp_path: Path) -> None:
    """A reply that brings the news first (a report's answer) is heard; the stream's
    word of the same revision after it is old news, told to nobody; a snapshot's
    consumed entries are heard too, and news of other states is not, nor the
    retention's own answers."""
    heard: list[tuple[str, str, int]] = []
    table = Table(str(tmp_path), on_consumed=lambda task_id, entries: heard.extend(
        (task_id, e.file_id, e.revision) for e in entries))
    table.add_task("t")

    def entry(file_id: str, state: int, revision: int) -> pb.Entry:
        return pb.Entry(file_id=file_id, path=f"{file_id}.bin", state=state,
                        revision=revision, digest="ab" * 32,
                        consumed_at="2026-12-07T21:00:00Z" if state == CONSUMED else "")

    assert table.apply("t", entry("a", pb.ENTRY_STATE_VERIFIED, 5)) is not None
    assert heard == []
    assert table.apply("t", entry("a", CONSUMED, 7), failures=0) is not None  # a reply
    assert heard == [("t", "a", 7)]
    assert table.apply("t", entry("a", CONSUMED, 7)) is None  # the stream, after it
    assert heard == [("t", "a", 7)]
    changes = table.replace("t", [entry("a", CONSUMED, 7), entry("b", CONSUMED, 9),
                                  entry("c", pb.ENTRY_STATE_WRITING, 9)])
    assert [c.entry.file_id for c in changes] == ["b", "c"]
    assert heard == [("t", "a", 7), ("t", "b", 9)]
    assert table.apply("elsewhere", entry("d", CONSUMED, 11)) is None  # not served
    assert heard == [("t", "a", 7), ("t", "b", 9)]
    # the retention's own answer (quiet) is recorded, and the retention not told of it
    assert table.apply("t", entry("b", CONSUMED, 12), quiet=True) is not None
    assert table.entry("t", "b").revision == 12  # type: ignore[union-attr]
    assert heard == [("t", "a", 7), ("t", "b", 9)]
