"""The install step of ``make test``: it names every missing program the same way the
tests that need it fail, and installs nothing where it cannot."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import tools

#: programs every Debian machine has, which the script itself runs or looks up
BASICS = ("make", "sh", "env")


def bare_path(tmp_path: Path, keep: tuple[str, ...] = BASICS) -> str:
    """A PATH of one directory holding only ``keep`` (links to the real programs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in keep:
        found = shutil.which(name)
        if found:
            (bin_dir / name).symlink_to(found)
    bin_dir.chmod(0o755)
    return str(bin_dir)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory any user can read (pytest's tmp_path is private to its user)."""
    path = Path(tempfile.mkdtemp(prefix="baton-install-deps-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def run_unprivileged(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``script`` as a user who cannot install anything (nobody, when the tests run as
    root), with a Python that user can run."""
    argv = [sys.executable, str(script)]
    if os.geteuid() == 0:
        system_python = Path("/usr/bin/python3")
        python = str(system_python) if system_python.exists() else sys.executable
        setpriv = shutil.which("setpriv")
        assert setpriv is not None, "setpriv (util-linux) runs the script as nobody"
        argv = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python,
                str(script)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def test_the_install_step_names_each_missing_program_and_installs_nothing(
    open_dir: Path,
) -> None:
    """Not root, with a PATH that lacks b3sum, jq, promtool, nft and ip: the script
    prints, for each, the line the tests fail with, exits 0 (so the tests run and say
    it), and installs nothing."""
    script = open_dir / tools.SCRIPT.name
    shutil.copy(tools.SCRIPT, script)
    script.chmod(0o644)
    env = {"PATH": bare_path(open_dir), "HOME": str(open_dir)}
    done = run_unprivileged(script, env)
    assert done.returncode == 0, done.stderr
    assert "apt-get" not in done.stdout  # nothing was tried
    printed = done.stderr.splitlines()
    for name in ("b3sum", "jq", "promtool", "nft", "ip", "systemd-analyze"):
        assert tools.missing_line(name) in printed, (name, done.stderr)
    assert tools.missing_line("make") not in printed


def test_a_line_says_what_the_program_is_for_and_how_to_get_it() -> None:
    """Each line names the program, what needs it, and how to get it here and elsewhere."""
    line = tools.missing_line("promtool")
    assert line.startswith("promtool is missing: tests/system/test_metrics.py")
    assert "prometheus package" in line and "https://prometheus.io/download/" in line
    assert "\n" not in line
    assert "apt-get install b3sum" in tools.missing_line("b3sum")


def test_a_test_that_needs_a_missing_program_fails_with_that_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """require() fails (never skips) with the install step's line for each missing
    program, and returns the path of one that is there."""
    monkeypatch.setenv("PATH", bare_path(tmp_path))
    with pytest.raises(pytest.fail.Exception) as failed:
        tools.require("b3sum", "jq")
    assert str(failed.value) == "\n".join([tools.missing_line("b3sum"),
                                           tools.missing_line("jq")])
    assert tools.require("make") == str(tmp_path / "bin" / "make")


def test_with_everything_there_the_install_step_does_nothing() -> None:
    """On this machine (make test ran the install step) every program is there: the
    script finds them all, prints no missing line and runs no installer, quickly."""
    missing = [t.missing_line() for t in tools.TOOLS if t.find() is None]
    assert not missing, "\n".join(missing)
    done = subprocess.run([sys.executable, str(tools.SCRIPT)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0
    assert done.stdout == ""
    assert "is missing:" not in done.stderr.replace(tools.KUBECTL_LINE, "")
