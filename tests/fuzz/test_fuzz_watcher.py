"""Fuzzing the watcher's reading of hostile staging trees, on a real filesystem.

Each input is a tree built for real under a fresh staging root — files, directories,
symlinks pointing inside, outside, at the root, nowhere or at themselves, FIFOs,
hard links to a file outside the root, odd names (any bytes but '/' and NUL, up to 255)
and deep nesting — and entries (a task id and a path, as a manifest may give them)
that the watcher's hasher is asked to stat and hash. What it must do is checked
against the tree itself, walked with ``lstat``: a regular file reached without any
symlink is hashed to the digest of its bytes; a symlink anywhere on the way, or
something that is not a regular file, is refused; a missing one is missing. Anything
else — another exception, a wrong digest, a file read through a link — is a finding.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from baton_relay.registry.records.manifest import path_problem
from baton_relay.watcher.errors import FileMissing, HashFailed, Refused
from baton_relay.watcher.hashing import Hasher

from .strategies import fuzz_settings

SECRET = b"outside the staging root"
#: names a node may have: odd ones, and a few that queries name on purpose
NAMES = st.one_of(
    st.sampled_from(("a", "b", "t", "d", "f.bin", " ", "-", "~", "\\", "é", "\n", "a b",
                     "x" * 255, "..a", "a..", ".hidden")),
    st.text(alphabet=st.characters(blacklist_characters="/\x00",
                                   blacklist_categories=("Cs",)), min_size=1, max_size=12)
    .filter(lambda s: s not in (".", "..") and len(s.encode()) <= 255))
KINDS = ("file", "file", "dir", "dir", "link-inside", "link-outside", "link-root",
         "link-dangling", "link-self", "link-dir", "fifo", "hardlink-outside", "deep")


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="baton-fuzz-tree-") as tmp:
        yield Path(tmp)


@st.composite
def trees(draw: st.DrawFn) -> tuple[str, list[tuple[str, str, bytes]]]:
    """A task id and the nodes to make below ``STAGING/TASK``: (relative path, kind,
    content)."""
    task = draw(st.sampled_from(("t", "task-1", "T_2")))
    nodes: list[tuple[str, str, bytes]] = []
    dirs = [""]
    for _ in range(draw(st.integers(1, 12))):
        parent = draw(st.sampled_from(dirs))
        name = draw(NAMES)
        rel = f"{parent}/{name}" if parent else name
        kind = draw(st.sampled_from(KINDS))
        nodes.append((rel, kind, draw(st.binary(max_size=300))))
        if kind == "dir":
            dirs.append(rel)
    return task, nodes


def build(root: Path, outside: Path, task: str, nodes: list[tuple[str, str, bytes]]
          ) -> list[str]:
    """Make the nodes that can be made (a name may already be taken); their paths."""
    top = root / task
    if not top.exists():
        top.mkdir()
    made = []
    for rel, kind, data in nodes:
        path = top / rel
        if not path.parent.is_dir() or path.is_symlink() or path.exists():
            continue
        try:
            if kind == "file":
                path.write_bytes(data)
            elif kind == "dir":
                path.mkdir()
            elif kind == "link-inside":
                os.symlink(made[0] if made else ".", path)
            elif kind == "link-outside":
                os.symlink(outside / "secret", path)
            elif kind == "link-root":
                os.symlink("/", path)
            elif kind == "link-dangling":
                os.symlink("nowhere-at-all", path)
            elif kind == "link-self":
                os.symlink(path.name, path)
            elif kind == "link-dir":
                os.symlink(outside, path, target_is_directory=True)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "hardlink-outside":
                os.link(outside / "secret", path)
            elif kind == "deep":
                deep = path
                for i in range(40):
                    deep = deep / f"d{i}"
                deep.mkdir(parents=True)
                (deep / "leaf").write_bytes(data)
                made.append(str((deep / "leaf").relative_to(top)))
        except OSError:
            continue  # a name too long for a path, say: not a tree this input can make
        made.append(rel)
    return made


def expected(root: Path, task: str, rel: str) -> tuple[str, str]:
    """What the hasher must say of ``task/rel``, from an ``lstat`` walk: ("ok", digest),
    ("refused", ""), ("missing", "")."""
    parts = [task, *rel.split("/")]
    here = root
    for i, name in enumerate(parts):
        here = here / name
        try:
            st_ = os.lstat(here)
        except FileNotFoundError:
            return "missing", ""
        if stat.S_ISLNK(st_.st_mode):
            return "refused", ""
        last = i == len(parts) - 1
        if not last and not stat.S_ISDIR(st_.st_mode):
            return "refused", ""
        if last and not stat.S_ISREG(st_.st_mode):
            return "refused", ""
    return "ok", blake3.blake3(here.read_bytes()).hexdigest()


def outcome(hasher: Hasher, task: str, rel: str) -> tuple[str, str]:
    try:
        return "ok", hasher.hash(task, rel).digest
    except FileMissing:
        return "missing", ""
    except Refused:
        return "refused", ""
    except HashFailed as e:
        return "failed", str(e)


@fuzz_settings(150)
@given(tree=trees(), extra=st.lists(NAMES, max_size=3), n=st.integers(0, 10**9))
def test_the_hasher_reads_only_regular_files_reached_without_links(
        base: Path, tree: tuple[str, list[tuple[str, str, bytes]]], extra: list[str],
        n: int) -> None:
    """Every path of a hostile tree (and some that are not there): hashed right when it
    is a regular file reached without a symlink, else refused or missing, and stat
    agrees; never another exception, never the bytes outside the root."""
    case = base / f"{n}-{os.urandom(4).hex()}"
    root, outside = case / "staging", case / "outside"
    root.mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    task, nodes = tree
    made = build(root, outside, task, nodes)
    queries = [r for r in [*made, *extra, *(f"{m}/{e}" for m in made[:2] for e in extra)]
               if path_problem(r) is None]
    hasher = Hasher(str(root))
    secret = blake3.blake3(SECRET).hexdigest()
    try:
        for rel in queries:
            want = expected(root, task, rel)
            got = outcome(hasher, task, rel)
            assert got[0] != "failed", f"{rel!r}: {got[1]}"
            assert got == want, f"{rel!r}: hashed {got}, the tree says {want}"
            if got[1] == secret:  # the same bytes through a hard link are inside the root
                assert os.lstat(root / task / rel).st_nlink > 1
            try:
                identity = hasher.stat(task, rel)
            except Refused:
                assert want[0] == "refused", f"{rel!r}: stat refused a {want[0]} file"
            else:
                assert (identity is None) == (want[0] == "missing"), rel
    finally:
        hasher.close()
