"""The ``baton`` CLI imports only what a command needs (its speed is measured by
``python -m bench.cli_startup``, not here: these tests check the imports, not time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from baton_relay.client.cli._root import COMMANDS, _plugins, cli

#: modules a command may or may not need, checked below
HEAVY = ("grpc", "google.protobuf", "rich", "blake3", "baton_relay.local.stack",
         "baton_relay.local.demo", "baton_relay.client.consumer",
         "baton_relay.client.producer", "baton_relay.kernel.v1.baton_pb2_grpc")

PROBE = """
import json, sys
args, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
from baton_relay.client.cli import cli
try:
    cli.main(args, prog_name="baton")  # what main() runs, before it ends the process
except SystemExit:
    pass
sys.__stderr__.write(json.dumps(sorted(m for m in heavy if m in sys.modules)) + "\\n")
"""


def loaded_after(args: list[str], registry: str = "127.0.0.1:9") -> list[str]:
    """Which of HEAVY a fresh process has imported after running ``baton ARGS``."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args), json.dumps(HEAVY)],
        capture_output=True, text=True, timeout=60, check=False,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("BATON_")},
             "BATON_REGISTRY": registry, "BATON_TIMEOUT": "2"},
    )
    assert done.stderr.strip(), done
    loaded: list[str] = json.loads(done.stderr.strip().splitlines()[-1])
    return loaded


def test_every_command_is_in_the_lazy_table() -> None:
    """COMMANDS names every command the modules define, and each where it is defined."""
    for module in sorted(set(COMMANDS.values())):
        __import__(f"baton_relay.client.cli.{module}")
    plugins = set(_plugins())  # another test may have loaded one (``up``) already
    assert not plugins & set(COMMANDS), "a plugin must not shadow a client command"
    assert set(cli.commands) - plugins == set(COMMANDS)
    for name, command in cli.commands.items():
        if name in plugins:
            continue
        callback: Any = command.callback
        assert callback.__module__ == f"baton_relay.client.cli.{COMMANDS[name]}", name


def test_help_of_a_command_loads_no_grpc_protobuf_or_rich() -> None:
    """`baton task ls --help` and `baton claim --help` import none of the heavy modules."""
    assert loaded_after(["task", "ls", "--help"]) == []
    assert loaded_after(["claim", "--help"]) == []


@pytest.mark.parametrize("args", [["claim", "t1", "a", "--ttl", "5"],
                                  ["commit", "t1", "a", "--token", "3", "--size", "1"]])
def test_agent_commands_load_grpc_but_not_rich_or_the_stack(
    registry: Any, args: list[str]
) -> None:
    """claim and commit load gRPC and the messages, not rich, BLAKE3, the stack or the stubs."""
    loaded = loaded_after(args, registry.address)
    assert {"grpc", "google.protobuf"} <= set(loaded)
    assert not {"rich", "blake3", "baton_relay.local.stack",
                "baton_relay.local.demo", "baton_relay.client.consumer",
                "baton_relay.client.producer", "baton_relay.kernel.v1.baton_pb2_grpc"
                } & set(loaded), loaded


def test_task_ls_loads_rich_for_its_table_only(registry: Any) -> None:
    """`task ls` loads rich for its table, and `-o json` does without it."""
    assert "rich" in loaded_after(["task", "ls"], registry.address)
    assert "rich" not in loaded_after(["task", "ls", "-o", "json"], registry.address)


def test_importing_the_cli_imports_no_command_module() -> None:
    """`import baton_relay.client.cli` (what the console script does first) defines no
    command yet."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, baton_relay.client.cli; print(' '.join(sorted("
         "m for m in sys.modules if m.startswith('baton_relay'))))"],
        capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == [
        "baton_relay", "baton_relay.client", "baton_relay.client.cli",
        "baton_relay.client.cli._common", "baton_relay.client.cli._root",
        "baton_relay.kernel", "baton_relay.kernel.contract", "baton_relay.kernel.errors"]


def test_the_process_ends_with_its_status_and_all_its_output() -> None:
    """main() ends the process at once, yet with the command's status and output flushed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env["BATON_REGISTRY"] = "127.0.0.1:9"
    shown = subprocess.run([sys.executable, "-m", "baton_relay.client.cli", "--help"],
                           capture_output=True, text=True, timeout=60, env=env, check=False)
    assert shown.returncode == 0
    assert shown.stdout.startswith("Usage: baton [OPTIONS] COMMAND [ARGS]...")
    # the last sentence of the help: all of it reached the pipe
    assert " ".join(shown.stdout.split()).endswith(
        "8 the session's host is drained (no new work).")
    usage = subprocess.run([sys.executable, "-m", "baton_relay.client.cli", "claim"],
                           capture_output=True, text=True, timeout=60, env=env, check=False)
    assert usage.returncode == 2
    assert usage.stderr.startswith("baton: claim: missing argument 'TASK'")
    down = subprocess.run([sys.executable, "-m", "baton_relay.client.cli", "--timeout", "1",
                           "task", "ls"], capture_output=True, text=True, timeout=60, env=env,
                          check=False)
    assert down.returncode == 6 and down.stderr.startswith("baton: registry 127.0.0.1:9")


def test_exit_status_of_system_exit_codes() -> None:
    """None is 0, an int is itself, a message is 1 (as Python's own exit would be)."""
    from baton_relay.client.cli._root import exit_status

    assert (exit_status(None), exit_status(4), exit_status("bye")) == (0, 4, 1)
