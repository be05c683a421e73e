"""The documentation's examples run as written, in order, against a real ``baton up``.

Every fenced ``sh`` and ``python`` block of README.md is run, except those that set up
what this test provides itself (listed in ``NOT_RUN``): the stack, which ``make up``
runs as ``baton up --demo`` and this test starts the same way on free ports, the test
suite, and installation. The shell blocks run in bash, as a user's terminal would,
from a directory that has the repository's ``.venv`` and ``README.md``, with a home
of their own where the stack keeps its data: they find its address and identity by
sourcing the ``env`` file ``baton up`` writes there, as the README says.

docs/cli.md: its manifests are created, its opening tour runs line by line against a
stack, and its shell producer and consumer run as written. Its console transcripts run
in tests/system/test_docs_run.py, with the other docs' examples; every ``baton`` command of
every example is also parsed by the CLI here, so a renamed command or option fails at
once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from test_cli import Lines
from tools import require

from baton_relay.client import Client
from baton_relay.client.cli import cli
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import free_port
from baton_relay.local.stack import LocalPKI

ROOT = Path(__file__).resolve().parents[2]
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
    #: the user's home: ``baton up`` keeps its data (and ``env`` file) under it
    home: Path

    @property
    def pki(self) -> LocalPKI:
        return LocalPKI(self.home / ".local" / "share" / "baton" / "pki")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of the user's other terminal once it sourced the env file."""
        return clean_env(HOME=str(self.home), BATON_REGISTRY=self.address,
                         **self.pki.environ("operator"), **extra)

    def client(self) -> Client:
        pki = self.pki
        return Client(self.address, ca=pki.ca, cert=pki.cert("operator"),
                      key=pki.key("operator"))


@pytest.fixture
def up_stack(tmp_path: Path) -> Iterator[UpStack]:
    """``baton up --demo`` as its own process, on free ports, until the test ends; its
    data in the default place under a home of its own (where the docs source it from)."""
    registry_port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    process = subprocess.Popen(
        [str(PYTHON), "-m", "baton_relay.client.cli", "up", "--demo",
         "--etcd-port", str(free_port()), "--registry-port", str(registry_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=clean_env(HOME=str(home)),
    )
    output = Lines(process)
    try:
        output.until(lambda line: line.startswith("ready"), timeout=60)
        yield UpStack(f"127.0.0.1:{registry_port}", process, output, home)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("BATON_") and k not in ("VIRTUAL_ENV", "XDG_DATA_HOME")}
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
    # Only the home: the README's own `. ~/.local/share/baton/env` sets the rest.
    env = clean_env(HOME=str(up_stack.home))
    ran = []
    for language, text in blocks:
        if language not in ("sh", "python") or is_skipped(text):
            continue
        # One terminal: what a shell block exports is there for the blocks after it.
        saved = tmp_path / "env-after"
        argv = (["bash", "-e", "-c", f"{text}\nenv -0 > {shlex.quote(str(saved))}"]
                if language == "sh" else [str(PYTHON), "-c", text])
        done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT, check=False)
        if language == "sh" and saved.exists():
            env = dict(item.split("=", 1) for item in saved.read_text().split("\0") if item)
        assert done.returncode == 0, (
            f"README {language} block failed (exit {done.returncode}):\n{text}\n"
            f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
        ran.append((language, done.stdout))
    assert [language for language, _ in ran] == ["sh", "python"]
    printed = ran[-1][1].split()
    assert printed[0] in ("a", "c"), ran[-1][1]

    with up_stack.client() as c:
        states = {e.file_id: e.state for e in c.operator.list_entries("hello")}
    assert states["b"] == pb.ENTRY_STATE_WRITING  # the shell agent's claim, alive for its TTL
    assert pb.ENTRY_STATE_CONSUMED in (states["a"], states["c"])


# --- docs/cli.md ----------------------------------------------------------------------

#: docs/cli.md blocks this test does not run, and why (their commands are parsed below)
CLI_NOT_RUN = {
    "baton up ": "the tour: run by its own test below, with the stack it starts already up",
}


def test_the_cli_docs_manifests_and_shell_agents_run_as_written(
    up_stack: UpStack, tmp_path: Path
) -> None:
    """docs/cli.md's manifests are valid, and its shell producer and consumer do their work."""
    require("b3sum", "jq")
    blocks = fenced_blocks(ROOT / "docs" / "cli.md")
    manifests = [json.loads(text) for language, text in blocks if language == "json"]
    assert [m["task_id"] for m in manifests] == ["t1", "scan-42", "book-7", "compliance-3",
                                                "scans"]
    with up_stack.client() as c:
        for manifest in manifests:
            assert c.operator.create_task(manifest)[1], manifest["task_id"]
    scripts = [text for language, text in blocks if language == "sh"]
    for skip in CLI_NOT_RUN:
        assert any(text.startswith(skip) for text in scripts), f"update CLI_NOT_RUN: {skip!r}"
    scripts = [text for text in scripts if not any(text.startswith(s) for s in CLI_NOT_RUN)]
    assert len(scripts) == 2  # the producer, then the consumer
    workdir = tmp_path / "agent"
    workdir.mkdir()
    # As in a shell where the README's `. .venv/bin/activate` ran: baton is on PATH.
    env = up_stack.env(PATH=f"{PYTHON.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for text in scripts:
        done = subprocess.run(["sh", "-c", text], cwd=workdir, env=env, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT, check=False)
        assert done.returncode == 0 and not done.stderr, (
            f"docs/cli.md shell agent failed (exit {done.returncode}):\n{text}\n"
            f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    with up_stack.client() as c:
        page = c.operator.get_entry("scan-42", "p1")  # the highest priority: what the producer took
    assert list(page.consumed_by) == ["ocr"]
    assert (workdir / "out" / "p1.txt").read_text().strip() == "2"  # "page p1": two words


def test_the_cli_tour_runs_as_written(up_stack: UpStack, tmp_path: Path) -> None:
    """docs/cli.md's opening tour runs, line by line, against the stack it starts."""
    blocks = fenced_blocks(ROOT / "docs" / "cli.md")
    (tour,) = [text for language, text in blocks if language == "sh"
               and text.startswith("baton up ")]
    first, *rest = tour.splitlines()
    assert first.startswith("baton up "), first  # the stack: up_stack is that
    # The reader's files: the manifest of the task the tour goes on to use, and a page.
    (scan,) = [json.loads(text) for language, text in blocks
               if language == "json" and '"scan-42"' in text]
    (tmp_path / "manifest.json").write_text(json.dumps(scan))
    (tmp_path / "p1.png").write_bytes(b"\x89PNG page one")
    # `baton up` keeps its export lines in its env file; the tour sources it.
    script = "set -e\n" + "\n".join(rest)
    env = clean_env(HOME=str(up_stack.home),
                    PATH=f"{PYTHON.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run(["sh", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, check=False)
    assert done.returncode == 0, (f"the tour failed (exit {done.returncode}):\n{script}\n"
                                  f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    assert "index" in done.stdout and "p1" in done.stdout  # status --entries, explain
    with up_stack.client() as c:
        assert c.operator.get_entry("scan-42", "p1").state in (pb.ENTRY_STATE_WRITTEN,
                                                               pb.ENTRY_STATE_VERIFIED)


def baton_lines(path: Path) -> list[str]:
    """Every ``baton …`` command of a file's examples: shell lines and ``$ `` console
    lines (after a pipe too), without comments and redirections, variables as 1."""
    out = []
    for language, text in fenced_blocks(path):
        if language not in ("sh", "console"):
            continue
        for line in text.replace("\\\n", " ").splitlines():  # continued lines joined
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            # A shell variable stands for a value: 1 suits an id, a token and a path.
            line = re.sub(r"\$\{?\w+\}?", "1", line)
            for part in line.split(" | "):
                words = shlex.split(part, comments=True)
                if words[:1] == ["baton"]:
                    cut = next((i for i, w in enumerate(words) if w in (">", "<", "&")), None)
                    out.append(shlex.join(words[:cut]))
    return out


def parse_baton(args: list[str]) -> None:
    """Parse ``baton ARGS`` as the CLI would, down to the command, without running it.

    Files the example names need not exist here: click's complaint about that is
    the only usage error accepted."""
    ctx = cli.make_context("baton", list(args))
    group: click.Group = cli
    rest = [*ctx._protected_args, *ctx.args]
    while True:
        name, command, rest = group.resolve_command(ctx, rest)
        assert command is not None and name is not None, args
        try:
            ctx = command.make_context(name, rest, parent=ctx)
        except click.BadParameter as e:
            if "does not exist" in e.format_message() or "No such file" in e.format_message():
                return
            raise
        if not isinstance(command, click.Group):
            return
        group, rest = command, [*ctx._protected_args, *ctx.args]


DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS)
def test_every_baton_command_in_the_docs_parses(doc: str) -> None:
    """Each `baton` command an example shows names a real command with real options."""
    lines = baton_lines(ROOT / doc)
    if doc in ("README.md", "docs/cli.md"):
        assert len(lines) >= 4, lines  # they show many; finding none means a broken parser
    for line in lines:
        try:
            parse_baton(shlex.split(line)[1:])
        except click.ClickException as e:
            pytest.fail(f"{doc}: `{line}`: {e.format_message()}")
