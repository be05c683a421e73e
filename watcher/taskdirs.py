"""A task's directories, given the unix group and mode its access rules ask for.

A manifest's ``access.paths`` may name a directory of the task (``raw``,
``raw/pages``) with a ``unix_group`` and a ``mode`` (octal, setgid allowed:
``2770``), so that the producers allowed there can write and nobody else can.
The registry cannot do this: it does not see the staging tree. The watcher does,
and usually runs as root: when it starts serving a task, and again at every
reconciliation (putting back what drifted), it creates ``STAGING/TASK/DIR``
(missing parents with the default mode) and gives ``DIR`` that group and mode.
Nothing is changed when everything is already as asked.

Paths are opened one component at a time from the staging root with
``O_NOFOLLOW | O_DIRECTORY`` and changed through the descriptor (``fchown``,
``fchmod``): a symlink planted at or along the path (a producer can write in the
task's tree) is refused instead of followed, so no chown or chmod ever lands
outside the task directory.

Once a task is archived or deleted its directory goes when nothing but empty
directories is left in it (:func:`only_dirs`, :func:`remove_empty`), walked the same
way: through descriptors, never following a symlink, which keeps the directory.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass

from ..kernel.logs import log
from ..kernel.v1 import baton_pb2 as pb
from .errors import WatcherError

logger = logging.getLogger("baton.watcher")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MODE = re.compile(r"^[0-7]{1,4}$")


class TaskDirFailed(WatcherError):
    """The directory ``dir`` of task ``task_id`` could not be made as its access rules
    ask (an unknown group, no permission, a symlink on the path...): ``reason``."""

    def __init__(self, task_id: str, dir: str, reason: str) -> None:
        super().__init__(f"{task_id}/{dir}: {reason}")
        self.task_id = task_id
        self.dir = dir
        self.reason = reason


@dataclass(frozen=True, slots=True)
class DirRule:
    """What one ``PathAccess`` asks of the disk ("" = leave that alone)."""

    dir: str
    group: str = ""
    mode: str = ""

    @property
    def depth(self) -> int:
        return self.dir.count("/")


def dir_rules(spec: pb.TaskSpec) -> tuple[DirRule, ...]:
    """The task's directories that have a group or a mode, parents before children
    (a child made after a setgid parent inherits its group)."""
    rules = {DirRule(p.dir, p.unix_group, p.mode)
             for p in spec.access.paths if p.unix_group or p.mode}
    return tuple(sorted(rules, key=lambda r: (r.depth, r.dir, r.group, r.mode)))


def prepare_dir(root: str, task_id: str, rule: DirRule) -> list[str]:
    """Make ``root/task_id/rule.dir`` as ``rule`` asks; what had to change (empty: nothing).

    Raises :class:`TaskDirFailed` for a group or mode that cannot be had, an
    ``OSError`` on the way (as its reason), or a symlink or non-directory on the path.
    """
    parts = [task_id, *rule.dir.split("/")]
    if rule.dir.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise TaskDirFailed(task_id, rule.dir, "not a directory inside the task")
    gid = _gid(task_id, rule)
    mode = _mode(task_id, rule)
    changed: list[str] = []
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as e:
        raise TaskDirFailed(task_id, rule.dir, f"staging root: {e.strerror}") from e
    try:
        for i, name in enumerate(parts):
            where = "/".join(parts[1 : i + 1]) or "the task directory"
            child, created = _open_or_make(fd, name, task_id, rule.dir, where)
            os.close(fd)
            fd = child
            if created:
                changed.append(f"created {where}")
        try:
            st = os.fstat(fd)
            if gid is not None and st.st_gid != gid:
                os.fchown(fd, -1, gid)
                changed.append(f"group {rule.group}")
                st = os.fstat(fd)
            if mode is not None and stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)
                kept = stat.S_IMODE(os.fstat(fd).st_mode)
                if kept != mode:  # setgid silently dropped: not a member, no CAP_FSETID
                    raise TaskDirFailed(task_id, rule.dir,
                                        f"mode {mode:04o} did not hold (got {kept:04o})")
                changed.append(f"mode {mode:04o}")
        except OSError as e:
            raise TaskDirFailed(task_id, rule.dir, e.strerror or str(e)) from e
    finally:
        os.close(fd)
    return changed


def _gid(task_id: str, rule: DirRule) -> int | None:
    if not rule.group:
        return None
    try:
        return grp.getgrnam(rule.group).gr_gid
    except KeyError:
        raise TaskDirFailed(task_id, rule.dir, f"unknown group {rule.group!r}") from None


def _mode(task_id: str, rule: DirRule) -> int | None:
    if not rule.mode:
        return None
    if not _MODE.match(rule.mode):
        raise TaskDirFailed(task_id, rule.dir, f"mode {rule.mode!r} is not octal (e.g. 2770)")
    return int(rule.mode, 8)


def _open_or_make(parent: int, name: str, task_id: str, dir: str,
                  where: str) -> tuple[int, bool]:
    """The directory ``name`` in ``parent`` opened without following it, made if missing."""
    created = False
    try:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent), False
        except FileNotFoundError:
            pass
        try:
            os.mkdir(name, dir_fd=parent)  # 0o777 less the umask: the default mode
            created = True
        except FileExistsError:
            pass  # made by someone else in between: opened (and checked) below
        return os.open(name, _DIR_FLAGS, dir_fd=parent), created
    except OSError as e:
        # O_DIRECTORY | O_NOFOLLOW on a symlink fails with ENOTDIR or ELOOP.
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(parent, name):
            reason = f"{where} is a symlink (refused)"
        elif e.errno == errno.ENOTDIR:
            reason = f"{where} is not a directory"
        else:
            reason = f"{where}: {e.strerror or e}"
        raise TaskDirFailed(task_id, dir, reason) from e


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


class TaskDirs:
    """The directories of every served task. Thread-safe.

    A failure is logged once per task and directory (until that directory
    succeeds), and never stops the watcher, the task's other directories or
    other tasks: the task is served all the same.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._prepared: dict[str, tuple[DirRule, ...]] = {}
        self._failing: dict[str, set[str]] = {}

    def prepare(self, task: pb.Task, *, again: bool = False) -> None:
        """Give the task's directories their group and mode, the first time the task
        is seen (or its rules differ), and every time with ``again``."""
        task_id = task.spec.task_id
        rules = dir_rules(task.spec)
        with self._lock:
            if not again and self._prepared.get(task_id) == rules:
                return
            self._prepared[task_id] = rules
            self._apply(task_id, rules)

    def again(self) -> None:
        """Put back the group and mode of every prepared task's directories, from the
        rules last seen (a routine reconciliation, which lists no task)."""
        with self._lock:
            for task_id, rules in list(self._prepared.items()):
                self._apply(task_id, rules)

    def _apply(self, task_id: str, rules: tuple[DirRule, ...]) -> None:
        """Under the lock."""
        failing = self._failing.setdefault(task_id, set())
        for rule in rules:
            try:
                changed = prepare_dir(self.root, task_id, rule)
            except TaskDirFailed as e:
                if rule.dir not in failing:
                    failing.add(rule.dir)
                    log(logger, logging.WARNING, "task directory not prepared",
                        task=task_id, dir=rule.dir, group=rule.group, mode=rule.mode,
                        error=e.reason)
                continue
            failing.discard(rule.dir)
            if changed:
                log(logger, logging.INFO, "task directory prepared", task=task_id,
                    dir=rule.dir, group=rule.group, mode=rule.mode,
                    changed=", ".join(changed))

    def forget(self, task_id: str) -> None:
        with self._lock:
            self._prepared.pop(task_id, None)
            self._failing.pop(task_id, None)


def _at_root(root: str) -> int | None:
    try:
        return os.open(root, _DIR_FLAGS)
    except OSError:
        return None


def only_dirs(root: str, task_id: str) -> bool:
    """Whether ``root/task_id`` is a directory holding nothing but directories (no
    file, no symlink), walked without following symlinks."""
    fd = _at_root(root)
    if fd is None:
        return False
    try:
        st = os.stat(task_id, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            return False
        for _, dirs, files, at in os.fwalk(task_id, dir_fd=fd, follow_symlinks=False):
            # a symlink to a directory is listed with the directories (not walked into)
            if files or any(_is_link(at, d) for d in dirs):
                return False
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_empty(root: str, task_id: str) -> bool:
    """Remove ``root/task_id`` and the empty directories in it, deepest first; False
    if anything stayed (something landed meanwhile, or a directory cannot go)."""
    fd = _at_root(root)
    if fd is None:
        return False
    try:
        for _, dirs, _, at in os.fwalk(task_id, topdown=False, dir_fd=fd,
                                       follow_symlinks=False):
            for name in dirs:
                _rmdir(name, at)
        return _rmdir(task_id, fd)
    except OSError:
        return False
    finally:
        os.close(fd)


def _rmdir(name: str, dir_fd: int) -> bool:
    """Remove an empty directory (False if not empty, gone, a symlink or not removable:
    it stays, and so does every directory above it)."""
    try:
        os.rmdir(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
