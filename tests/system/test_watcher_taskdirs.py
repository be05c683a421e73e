"""Task directories with the unix group and mode of the task's access rules.

The module on its own on a real directory, then a real watcher on a real staging
root with a real registry. The suite runs as root, so existing groups (``users``,
``daemon``) can be given to directories.
"""

from __future__ import annotations

import grp
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from watcher_fixtures import is_state, put_bytes

from baton_relay.client import Client, Session
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher import Watcher
from baton_relay.watcher.taskdirs import DirRule, TaskDirFailed, TaskDirs, dir_rules, prepare_dir

Wait = Callable[..., None]

USERS = grp.getgrnam("users").gr_gid
DAEMON = grp.getgrnam("daemon").gr_gid
UNKNOWN_GROUP = "baton-no-such-group"


def gid_mode(path: Path) -> tuple[int, int]:
    st = os.stat(path, follow_symlinks=False)
    return st.st_gid, stat.S_IMODE(st.st_mode)


def task_spec(task_id: str, paths: list[dict[str, Any]]) -> pb.Task:
    return pb.Task(spec=pb.TaskSpec(task_id=task_id, access=pb.Access(
        paths=[pb.PathAccess(**p) for p in paths])))


def warnings_about(caplog: pytest.LogCaptureFixture, task_id: str) -> list[dict[str, Any]]:
    """The fields of every "task directory not prepared" line about ``task_id``."""
    out = []
    for r in caplog.records:
        fields: dict[str, Any] = getattr(r, "baton_fields", {})
        if r.getMessage() == "task directory not prepared" and fields.get("task") == task_id:
            out.append(fields)
    return out


# --- the module on its own -----------------------------------------------------------


def test_prepare_dir_makes_parents_and_sets_group_and_mode(tmp_path: Path) -> None:
    """DIR and its missing parents are made; DIR alone gets the group and the mode."""
    changed = prepare_dir(str(tmp_path), "t1", DirRule("raw/pages", "users", "2770"))
    assert changed == ["created the task directory", "created raw", "created raw/pages",
                       "group users", "mode 2770"]
    assert gid_mode(tmp_path / "t1" / "raw" / "pages") == (USERS, 0o2770)
    umask = os.umask(0)
    os.umask(umask)
    assert gid_mode(tmp_path / "t1" / "raw") == (os.getgid(), 0o777 & ~umask)


def test_prepare_dir_twice_changes_nothing(tmp_path: Path) -> None:
    """A second run finds everything as asked: nothing changes, not even the ctime."""
    rule = DirRule("raw", "daemon", "0750")
    prepare_dir(str(tmp_path), "t1", rule)
    before = os.stat(tmp_path / "t1" / "raw")
    assert prepare_dir(str(tmp_path), "t1", rule) == []
    after = os.stat(tmp_path / "t1" / "raw")
    assert (after.st_gid, after.st_mode, after.st_ctime_ns) == (
        before.st_gid, before.st_mode, before.st_ctime_ns)


def test_prepare_dir_puts_back_what_drifted(tmp_path: Path) -> None:
    """A directory whose group or mode was changed by hand gets the rule's back."""
    rule = DirRule("raw", "users", "2770")
    prepare_dir(str(tmp_path), "t1", rule)
    os.chown(tmp_path / "t1" / "raw", -1, DAEMON)
    os.chmod(tmp_path / "t1" / "raw", 0o755)
    assert prepare_dir(str(tmp_path), "t1", rule) == ["group users", "mode 2770"]
    assert gid_mode(tmp_path / "t1" / "raw") == (USERS, 0o2770)


def test_prepare_dir_with_only_a_mode_leaves_the_group(tmp_path: Path) -> None:
    """An empty unix_group leaves the group alone; an empty mode leaves the mode."""
    (tmp_path / "t1" / "raw").mkdir(parents=True)
    os.chown(tmp_path / "t1" / "raw", -1, DAEMON)
    prepare_dir(str(tmp_path), "t1", DirRule("raw", mode="700"))
    assert gid_mode(tmp_path / "t1" / "raw") == (DAEMON, 0o700)
    prepare_dir(str(tmp_path), "t1", DirRule("raw", group="users"))
    assert gid_mode(tmp_path / "t1" / "raw") == (USERS, 0o700)


@pytest.mark.parametrize("where", ["raw", "raw/pages"])
def test_prepare_dir_refuses_a_symlink_at_or_along_the_path(tmp_path: Path, where: str) -> None:
    """A symlink at DIR or at a directory above it is refused, its target left alone."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    root = tmp_path / "staging"
    (root / "t1").mkdir(parents=True)
    (root / "t1" / "raw").symlink_to(outside)
    with pytest.raises(TaskDirFailed) as e:
        prepare_dir(str(root), "t1", DirRule(where, "users", "2777"))
    assert e.value.reason == "raw is a symlink (refused)"
    assert (e.value.task_id, e.value.dir) == ("t1", where)
    assert gid_mode(outside) == (os.getgid(), 0o755)
    assert list(outside.iterdir()) == []


def test_prepare_dir_refuses_a_symlinked_task_directory(tmp_path: Path) -> None:
    """The task directory itself may not be a symlink either."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    root = tmp_path / "staging"
    root.mkdir()
    (root / "t1").symlink_to(outside)
    with pytest.raises(TaskDirFailed, match="the task directory is a symlink"):
        prepare_dir(str(root), "t1", DirRule("raw", "users", "2770"))
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("rule, reason", [
    (DirRule("raw", UNKNOWN_GROUP, "2770"), f"unknown group {UNKNOWN_GROUP!r}"),
    (DirRule("raw", "users", "rwx"), "mode 'rwx' is not octal (e.g. 2770)"),
    (DirRule("raw", "users", "17777"), "mode '17777' is not octal (e.g. 2770)"),
    (DirRule("../raw", "users", "2770"), "not a directory inside the task"),
    (DirRule("/raw", "users", "2770"), "not a directory inside the task"),
    (DirRule("raw/", "users", "2770"), "not a directory inside the task"),
])
def test_prepare_dir_refuses_what_cannot_be_had(tmp_path: Path, rule: DirRule,
                                                reason: str) -> None:
    """Unknown groups, modes that are not octal and escaping dirs fail before any change."""
    with pytest.raises(TaskDirFailed) as e:
        prepare_dir(str(tmp_path), "t1", rule)
    assert e.value.reason == reason
    assert not (tmp_path / "t1").exists()


def test_prepare_dir_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    """A regular file where a directory should be is refused, not replaced."""
    (tmp_path / "t1").mkdir()
    (tmp_path / "t1" / "raw").write_bytes(b"x")
    with pytest.raises(TaskDirFailed, match="raw is not a directory"):
        prepare_dir(str(tmp_path), "t1", DirRule("raw/pages", "users", "2770"))


def test_dir_rules_keep_paths_with_a_group_or_mode_parents_first() -> None:
    """Paths with neither a group nor a mode are not the watcher's business."""
    task = task_spec("t1", [{"dir": "raw/pages", "mode": "750"},
                            {"dir": "out", "producers": ["agent-*"]},
                            {"dir": "raw", "unix_group": "users"}])
    assert dir_rules(task.spec) == (DirRule("raw", "users"), DirRule("raw/pages", mode="750"))


def test_task_dirs_log_a_failure_once_and_do_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A failing directory is logged once per task, however often it is tried again;
    the task's other directories are made all the same."""
    caplog.set_level(logging.INFO, logger="baton.watcher")
    dirs = TaskDirs(str(tmp_path))
    task = task_spec("t1", [{"dir": "bad", "unix_group": UNKNOWN_GROUP},
                            {"dir": "good", "unix_group": "users", "mode": "2770"}])
    for _ in range(3):
        dirs.prepare(task, again=True)
    assert warnings_about(caplog, "t1") == [{
        "task": "t1", "dir": "bad", "group": UNKNOWN_GROUP, "mode": "",
        "error": f"unknown group {UNKNOWN_GROUP!r}"}]
    assert gid_mode(tmp_path / "t1" / "good") == (USERS, 0o2770)
    dirs.forget("t1")
    dirs.prepare(task)
    assert len(warnings_about(caplog, "t1")) == 2  # a task served anew is told anew


# --- a real watcher ------------------------------------------------------------------


def test_new_task_gets_its_directories(
    client: Client, session: Session, staging: Path,
    watcher_factory: Callable[..., Watcher], wait_for: Wait,
) -> None:
    """A task created while the watcher runs gets its directories with group and mode,
    and its files are verified as usual."""
    watcher_factory()
    client.operator.create_task({
        "task_id": "t1",
        "entries": [{"file_id": "a", "path": "raw/pages/a.bin"}],
        "access": {"paths": [{"dir": "raw", "unix_group": "users", "mode": "2770"},
                             {"dir": "raw/pages", "unix_group": "daemon", "mode": "0750"}]},
    })
    pages = staging / "t1" / "raw" / "pages"
    wait_for(lambda: pages.is_dir() and gid_mode(pages) == (DAEMON, 0o750),
             what="raw/pages made with its group and mode")
    assert gid_mode(staging / "t1" / "raw") == (USERS, 0o2770)
    put_bytes(client, session, "t1", "a", b"a page")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")


def test_task_found_at_start_gets_its_directories(
    client: Client, staging: Path, watcher_factory: Callable[..., Watcher], wait_for: Wait,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A watcher that starts after the task was created makes its directories; later
    reconciliations find them as asked and change nothing."""
    caplog.set_level(logging.INFO, logger="baton.watcher")
    client.operator.create_task({
        "task_id": "t1",
        "entries": [{"file_id": "a", "path": "raw/a.bin"}],
        "access": {"paths": [{"dir": "raw", "unix_group": "users", "mode": "2770"}]},
    })
    w = watcher_factory()
    raw = staging / "t1" / "raw"
    assert gid_mode(raw) == (USERS, 0o2770)  # the reconciliation at start did it
    before = os.stat(raw).st_ctime_ns
    assert w.reconcile("test")
    assert os.stat(raw).st_ctime_ns == before
    prepared = [r for r in caplog.records if r.getMessage() == "task directory prepared"]
    assert len(prepared) == 1
    assert warnings_about(caplog, "t1") == []


def test_symlink_at_a_task_directory_is_refused(
    client: Client, session: Session, staging: Path, tmp_path: Path,
    watcher_factory: Callable[..., Watcher], wait_for: Wait, caplog: pytest.LogCaptureFixture,
) -> None:
    """A symlink planted at DIR is not followed: logged once with task and dir, the
    target untouched, the task still served and other tasks' directories made."""
    caplog.set_level(logging.INFO, logger="baton.watcher")
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    (staging / "t1").mkdir()
    (staging / "t1" / "raw").symlink_to(outside)
    w = watcher_factory()
    for task_id in ("t1", "t2"):
        client.operator.create_task({
            "task_id": task_id,
            "entries": [{"file_id": "a", "path": "out/a.bin"}],
            "access": {"paths": [{"dir": "raw", "unix_group": "users", "mode": "2777"}]},
        })
    raw2 = staging / "t2" / "raw"
    wait_for(lambda: raw2.is_dir() and gid_mode(raw2) == (USERS, 0o2777),
             what="t2's raw made")
    wait_for(lambda: warnings_about(caplog, "t1") != [], what="t1's refusal logged")
    assert w.reconcile("test")  # tried again: refused again, not logged again
    assert warnings_about(caplog, "t1") == [{
        "task": "t1", "dir": "raw", "group": "users", "mode": "2777",
        "error": "raw is a symlink (refused)"}]
    assert gid_mode(outside) == (os.getgid(), 0o755)
    assert (staging / "t1" / "raw").is_symlink()
    put_bytes(client, session, "t1", "a", b"served all the same")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="t1's a verified")


def test_unknown_group_is_logged_and_the_rest_served(
    client: Client, session: Session, staging: Path,
    watcher_factory: Callable[..., Watcher], wait_for: Wait, caplog: pytest.LogCaptureFixture,
) -> None:
    """A group the host does not know fails that directory alone: the task's other
    directories are made and its files verified."""
    caplog.set_level(logging.INFO, logger="baton.watcher")
    watcher_factory()
    client.operator.create_task({
        "task_id": "t1",
        "entries": [{"file_id": "a", "path": "raw/a.bin"}],
        "access": {"paths": [{"dir": "raw", "unix_group": UNKNOWN_GROUP, "mode": "2770"},
                             {"dir": "out", "unix_group": "daemon", "mode": "0770"}]},
    })
    out = staging / "t1" / "out"
    wait_for(lambda: out.is_dir() and gid_mode(out) == (DAEMON, 0o770), what="out made")
    wait_for(lambda: warnings_about(caplog, "t1") != [], what="raw's failure logged")
    assert warnings_about(caplog, "t1") == [{
        "task": "t1", "dir": "raw", "group": UNKNOWN_GROUP, "mode": "2770",
        "error": f"unknown group {UNKNOWN_GROUP!r}"}]
    assert not (staging / "t1" / "raw").exists()
    put_bytes(client, session, "t1", "a", b"served all the same")
    wait_for(is_state(client, "t1", "a", pb.ENTRY_STATE_VERIFIED), what="a verified")
