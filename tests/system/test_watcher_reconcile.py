"""Reconciliation proportional to change (issue 39): what a periodic pass reads.

A routine pass (every ``reconcile_interval``) lists nothing from the registry for a
task whose Watch stream is current and walks no tree: it checks the entries this
watcher has not seen verified, the files of directories that had events, and the
files of trees no emitter watches. A full pass (start, overflow, lost registry)
lists and checks everything, and finds what events missed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from watcher_fixtures import is_state, make_task, put_bytes

from baton_relay.client import Client, Session
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher import Watcher
from baton_relay.watcher._inotify import IN_Q_OVERFLOW, RawEvent
from baton_relay.watcher.emitter import InotifyEmitter

Wait = Callable[..., None]

#: what reconciliations read: from the registry, then from the disk
READS = ("reconcile_listings", "reconcile_entries_listed", "reconcile_entries_checked",
         "reconcile_trees_walked")


def store(client: Client, session: Session, prefix: str, tasks: int, entries: int) -> int:
    """``tasks`` tasks of ``entries`` entries in three directories, every other one
    verified (its file on disk), the rest pending; how many were put."""
    put = 0
    for t in range(tasks):
        task_id = f"{prefix}{t}"
        make_task(client, task_id, {f"f{i:03d}": f"d{i % 3}/f{i:03d}.bin"
                                    for i in range(entries)})
        for i in range(0, entries, 2):
            put_bytes(client, session, task_id, f"f{i:03d}", os.urandom(64))
            put += 1
    return put


def verified(w: Watcher) -> int:
    return w.table.census()[0].get("verified", 0)


def periodic(w: Watcher, wait_for: Wait, passes: int = 3) -> dict[str, int]:
    """What the next ``passes`` (or a few more) periodic reconciliations read, with how
    many ran (``reconciliations``) and how many were full."""
    wait_for(w.jobs.idle, what="the watcher idle")
    first = w.metrics.get("reconciliations")
    wait_for(lambda: w.metrics.get("reconciliations") > first, what="a reconciliation")
    before = w.metrics.snapshot()
    wait_for(lambda: w.metrics.get("reconciliations") >= before["reconciliations"] + passes,
             what=f"{passes} reconciliations")
    after = w.metrics.snapshot()
    return {n: after.get(n, 0) - before.get(n, 0)
            for n in (*READS, "reconciliations", "full_reconciliations")}


def test_a_periodic_reconciliation_at_rest_reads_nothing_however_much_is_stored(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
) -> None:
    """At rest a periodic pass lists nothing and walks no tree, with 24 entries stored
    or 144; it checks only the one entry not seen verified (a claim being written)."""
    w = watcher_factory(reconcile_interval=0.2)
    stored = store(client, session, "small", 2, 12)
    wait_for(lambda: verified(w) == stored, timeout=30, what="the small tasks verified")
    small = periodic(w, wait_for)

    stored += store(client, session, "large", 2, 60)
    claim = client.claim("large0", "f001", session=session)  # writing, its file landed
    Path(claim.path).parent.mkdir(parents=True, exist_ok=True)
    Path(claim.path).write_bytes(b"still being written")
    wait_for(lambda: verified(w) == stored, timeout=60, what="the large tasks verified")
    large = periodic(w, wait_for)

    print(f"stored 24: {small}\nstored 144: {large}")
    for seen in (small, large):
        assert seen["full_reconciliations"] == 0, seen
        assert seen["reconcile_listings"] == seen["reconcile_entries_listed"] == 0, seen
        assert seen["reconcile_trees_walked"] == 0, seen
    assert small["reconcile_entries_checked"] == 0, small
    assert large["reconcile_entries_checked"] == large["reconciliations"], large


def test_a_periodic_reconciliation_checks_the_files_of_directories_with_events_once(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path,
) -> None:
    """An event in one directory of a task makes the next periodic pass check that
    directory's entries (and no other's), once."""
    w = watcher_factory(reconcile_interval=0.2)
    stored = store(client, session, "t", 1, 12)  # d0, d1, d2: two verified in each
    wait_for(lambda: verified(w) == stored, what="t0 verified")
    assert periodic(w, wait_for, passes=1)["reconcile_entries_checked"] == 0
    before = w.metrics.snapshot()
    (staging / "t0" / "d1" / "not-an-entry.txt").write_bytes(b"x")
    wait_for(lambda: w.metrics.get("events") > before["events"], what="the event")
    wait_for(lambda: w.metrics.get("reconciliations") >= before["reconciliations"] + 3,
             what="3 reconciliations")
    checked = (w.metrics.get("reconcile_entries_checked")
               - before.get("reconcile_entries_checked", 0))
    assert checked == 2


def test_after_an_overflow_a_full_pass_finds_what_the_events_missed(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    staging: Path,
) -> None:
    """Changes made while events were lost (a tampered file, a new directory) are
    found by the full pass an overflow makes, between periodic passes: the file leaves
    verified, and the new directory is watched again."""
    w = watcher_factory(reconcile_interval=0.2)
    make_task(client, "t1", {"a": "a.bin", "b": "sub/b.bin"})
    put_bytes(client, session, "t1", "a", b"first")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    emitter = w.watches._inotify
    assert isinstance(emitter, InotifyEmitter)
    # Events lost: nothing watches the tree while a is changed and sub/ made.
    w.watches.unwatch_tree(str(staging / "t1"))
    Path(client.operator.get_entry("t1", "a").abs_attempt_path).write_bytes(b"changed unseen")
    put_bytes(client, session, "t1", "b", b"in a directory made unseen")
    wait_for(is_state(client, "t1", "b", pb.ENTRY_STATE_VERIFIED), what="b verified")
    full = w.metrics.get("full_reconciliations")

    emitter.handle([RawEvent(-1, IN_Q_OVERFLOW, 0, "")])
    wait_for(lambda: w.metrics.get("full_reconciliations") > full, what="a full pass")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_PENDING), what="a unverified")
    Path(client.operator.get_entry("t1", "b").abs_attempt_path).write_bytes(b"changed, seen")
    wait_for(is_state(client, "t1", "b", pb.ENTRY_STATE_PENDING), what="b unverified")


def test_what_changed_while_the_watcher_was_stopped_is_found_at_its_start(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    tmp_path: Path,
) -> None:
    """A file tampered with and another landed while no watcher ran: the next one's
    start (a full pass) takes the first out of verified and verifies the second."""
    state = str(tmp_path / "watcher-state.sqlite")  # the restart takes its shards back
    first = watcher_factory(state_file=state)
    make_task(client, "t1", {"a": "a.bin", "b": "b.bin"})
    put_bytes(client, session, "t1", "a", b"verified before the stop")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
    first.stop()
    Path(client.operator.get_entry("t1", "a").abs_attempt_path).write_bytes(b"changed while down")
    put_bytes(client, session, "t1", "b", b"landed while down")
    second = watcher_factory(state_file=state)
    assert second.metrics.get("full_reconciliations") >= 1  # its start
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_PENDING), what="a unverified")
    wait_for(is_state(client, "t1", "b", pb.ENTRY_STATE_VERIFIED), what="b verified")
