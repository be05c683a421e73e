"""The README's examples run exactly as written, in order, against a real ``baton up``.

Every fenced ``sh`` and ``python`` block of README.md is run, except those that set up
what this test provides itself (listed in ``NOT_RUN``): the stack, which ``make up``
runs as ``baton up --demo`` and this test starts the same way on free ports, the test
suite, and installation. The shell blocks run in bash, as a user's terminal would,
from a directory that has the repository's ``.venv`` and ``README.md``; both kinds
find the stack through ``BATON_REGISTRY``, as they would find ``make up``'s by default.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_cli import Lines

from client import Client
from client.etcdproc import free_port
from client.v1 import baton_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
RUN_TIMEOUT = 120

#: README blocks this test does not run, and why
NOT_RUN = {
    "make up\n": "the stack: started by the fixture as `baton up --demo`",
    "make test\n": "this test suite",
    "pip install .": "installation (a block starting with this)",
}


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of a Markdown file, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def is_skipped(text: str) -> bool:
    return any(text == skip or text.startswith(skip) for skip in NOT_RUN)


@dataclass
class UpStack:
    address: str
    process: subprocess.Popen[str]
    output: Lines


@pytest.fixture
def up_stack(tmp_path: Path) -> Iterator[UpStack]:
    """``baton up --demo`` as its own process, on free ports, until the test ends."""
    registry_port = free_port()
    process = subprocess.Popen(
        [str(PYTHON), "-m", "client.cli", "up", "--demo", "--data-dir", str(tmp_path / "up"),
         "--etcd-port", str(free_port()), "--registry-port", str(registry_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
    )
    output = Lines(process)
    try:
        output.until(lambda line: line.startswith("ready"), timeout=60)
        yield UpStack(f"127.0.0.1:{registry_port}", process, output)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("BATON_") and k != "VIRTUAL_ENV"}
    return {**env, **extra}


def test_the_readme_runs_as_written(up_stack: UpStack, tmp_path: Path) -> None:
    """Every README sh and python block, in order, succeeds against a running stack."""
    blocks = fenced_blocks(ROOT / "README.md")
    for skip in NOT_RUN:
        assert any(text == skip or text.startswith(skip) for _, text in blocks), \
            f"README no longer has the block {skip!r}: update NOT_RUN"
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(ROOT / ".venv")
    (workdir / "README.md").write_bytes((ROOT / "README.md").read_bytes())
    env = clean_env(BATON_REGISTRY=up_stack.address)
    ran = []
    for language, text in blocks:
        if language not in ("sh", "python") or is_skipped(text):
            continue
        argv = ["bash", "-e", "-c", text] if language == "sh" else [str(PYTHON), "-c", text]
        done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT, check=False)
        assert done.returncode == 0, (
            f"README {language} block failed (exit {done.returncode}):\n{text}\n"
            f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
        ran.append((language, done.stdout))
    assert [language for language, _ in ran] == ["sh", "python"]
    printed = ran[-1][1].split()
    assert printed[0] in ("a", "c"), ran[-1][1]

    with Client(up_stack.address) as c:
        states = {e.file_id: e.state for e in c.list_entries("hello")}
    assert states["b"] == pb.WRITING  # the shell agent's claim, alive for its TTL
    assert pb.CONSUMED in (states["a"], states["c"])
