"""Usage errors of ``baton``: one ``baton: <message>`` line on stderr, exit 2.

Missing arguments, unknown options and commands, bad choices and values, at every
depth of the command tree and in the commands of the local stack (``up``,
``console``): the line names the command and what was wrong, and nothing else is
printed. ``--help`` still prints the help. No registry is needed: nothing is called.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from baton_relay.client.cli import cli

CASES = [
    (["task", "create"], "baton: task create: missing argument 'FILE'"),
    (["task", "create", "--bogus", "m.json"], "baton: task create: no such option '--bogus'"),
    (["task", "ls", "-o", "xml"],
     "baton: task ls: invalid value for '-o' / '--output': 'xml' is not one of"),
    (["bogus"], "baton: no such command 'bogus'"),
    (["task", "bogus"], "baton: task: no such command 'bogus'"),
    (["--timeout", "abc", "task", "ls"], "baton: invalid value for '--timeout'"),
    (["--bogus"], "baton: no such option '--bogus'"),
    (["claim"], "baton: claim: missing argument 'TASK'"),
    (["claim", "t", "--batch", "2", "f"],
     "baton: claim: --batch claims the next claimable entries; leave out FILE_ID"),
    (["keepalive", "nope"], "baton: keepalive: invalid value for 'SESSION_ID'"),
    (["task", "get", "t", "extra"], "baton: task get: got unexpected extra argument"),
    (["watcher", "drain"], "baton: watcher drain: missing argument"),
    (["shard", "move", "--bogus"], "baton: shard move: no such option '--bogus'"),
    (["up", "--watchers", "0"], "baton: up: invalid value for '--watchers'"),
    (["up", "--bogus"], "baton: up: no such option '--bogus'"),
    (["demo", "--files", "0"], "baton: demo: invalid value for '--files'"),
    (["console", "--listen", "x"], "baton: console: invalid value for --listen: 'x'"),
]


@pytest.mark.parametrize(("args", "start"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_usage_error_is_one_line_naming_the_command(args: list[str], start: str) -> None:
    """A usage error prints one `baton: COMMAND: what was wrong` line (with the help to
    read) on stderr, nothing on stdout, and exits 2."""
    result = CliRunner().invoke(cli, args, prog_name="baton", env={"BATON_REGISTRY":
                                                                   "127.0.0.1:9"})
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(start), lines[0]
    assert lines[0].endswith("--help'"), lines[0]


@pytest.mark.parametrize("args", [["--help"], ["task", "create", "--help"], ["up", "-h"]])
def test_help_still_prints_the_help(args: list[str]) -> None:
    """`--help` at any depth prints the command's help on stdout and exits 0."""
    result = CliRunner().invoke(cli, args, prog_name="baton")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Usage: baton"), result.stdout


def test_the_installed_command_prints_one_line_for_a_usage_error() -> None:
    """The `baton` process itself (not only the click group) keeps a usage error to
    one stderr line and exit 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    done = subprocess.run([sys.executable, "-m", "baton_relay.client.cli", "task", "create"],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == ("baton: task create: missing argument 'FILE'; "
                           "see 'baton task create --help'\n")
