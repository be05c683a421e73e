"""``baton demo``: the live pipeline against a real registry and watcher."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

from registry_fixtures import RegistryHandle
from test_cli import SUBPROCESS_TIMEOUT, cli_env


def test_demo_into_a_pipe_prints_its_table_and_report_on_lines_of_their_own(
    registry: RegistryHandle, watcher_factory: Callable[..., Any]
) -> None:
    """With stderr not a terminal, the final table ends its line and the report follows it."""
    watcher_factory()
    result = subprocess.run(
        [sys.executable, "-m", "baton_relay.client.cli", "demo", "--files", "3", "--producers", "1",
         "--consumers", "1", "--timeout", "60"],
        capture_output=True, text=True, env=cli_env(registry.address),
        timeout=SUBPROCESS_TIMEOUT, check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    report = next(i for i, line in enumerate(lines) if line.startswith("demo: "))
    assert lines[report].startswith("demo: 3/3 files handed from producers to consumers")
    assert lines[report - 1].startswith("└") and lines[report - 1].endswith("┘"), lines
    assert sum(line.startswith("┏") for line in lines) == 1  # one table, not one per frame
