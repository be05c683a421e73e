"""A check of a task's tree (a directory created, a tree watched again) looks at what is
live there from the table's indexes, copying no entry (issue 38): it must choose what a
pass over every entry chooses, whatever the news, and an attempt's file found on disk is
taken by an uncommitted entry only."""

from __future__ import annotations

import posixpath
import random

from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher.state import CHECKED, UNCOMMITTED, Table

STATES = [s for s in pb.EntryState.values() if s]
DIRS = ["", "a", "a/b", "a/bc", "ab", "c/d/e"]


def entry(file_id: int, state: int, revision: int) -> pb.Entry:
    d = DIRS[file_id % len(DIRS)]
    return pb.Entry(file_id=f"f{file_id}", path=posixpath.join(d, f"f{file_id}"),
                    state=state, revision=revision)


def by_pass(table: Table, task_id: str, rel_dir: str) -> tuple[set[str], set[str]]:
    """The survey the slow way: every entry of the task, its path below ``rel_dir``."""
    prefix = rel_dir + "/" if rel_dir else ""
    under = [e for e in table.entries(task_id) if e.path.startswith(prefix)]
    return ({posixpath.dirname(e.path) for e in under if e.state in UNCOMMITTED},
            {e.file_id for e in under if e.state in CHECKED})


def test_the_survey_chooses_what_a_pass_over_the_entries_chooses(tmp_path: object) -> None:
    rng = random.Random(38)
    table = Table(str(tmp_path))
    table.add_task("t")
    for step in range(300):
        table.apply("t", entry(rng.randrange(40), rng.choice(STATES), step + 1))
        for rel_dir in ("", *DIRS[1:], "a/", "nowhere"):
            dirs, checked = table.survey("t", rel_dir)
            assert len(checked) == len(set(checked))
            assert (set(dirs), set(checked)) == by_pass(table, "t", rel_dir.rstrip("/")), (
                f"step {step}, below {rel_dir!r}")
    assert table.survey("gone", "") == ([], [])


def test_an_attempt_found_on_disk_is_taken_by_uncommitted_entries_only(
        tmp_path: object) -> None:
    table = Table(str(tmp_path))
    table.add_task("t")
    for i, state in enumerate((pb.ENTRY_STATE_PENDING, pb.ENTRY_STATE_WRITING,
                               pb.ENTRY_STATE_WRITTEN)):
        table.apply("t", pb.Entry(file_id=f"f{i}", path=f"a/f{i}", state=state,
                                  revision=i + 1,
                                  attempt_path=f"a/f{i}~t3" if i == 2 else ""))
    table.saw_attempts("t", {"a/f0": ("a/f0~t7", 7), "a/f1": ("a/f1~t9", 9),
                             "a/f2": ("a/f2~t8", 8), "a/none": ("a/none~t1", 1)})
    seen = {e.file_id: (e.attempt_path, e.token) for e in table.entries("t")}
    assert seen == {"f0": ("a/f0~t7", 7), "f1": ("a/f1~t9", 9), "f2": ("a/f2~t3", 3)}
    table.saw_attempts("t", {"a/f1": ("a/f1~t4", 4)})  # older than the one known
    assert table.entry("t", "f1").token == 9
