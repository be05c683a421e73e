"""docs/testing.md's worked example is a test that passes as written: copied out of the
page into a folder of its own and run by pytest in a process of its own, which finds
the ``baton_registry`` fixture through the installed package's entry point alone."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_worked_example_passes_as_written(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    example = next(b for b in blocks if b.startswith("# test_translator.py"))
    (tmp_path / "test_translator.py").write_text(example)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_translator.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout


def test_the_extra_named_is_the_one_that_brings_the_fixture() -> None:
    """The page's install line names pyproject's ``testing`` extra, which brings what the
    in-process registry and its watcher need, and the fixture's entry point."""
    page = (ROOT / "docs" / "testing.md").read_text()
    assert "pip install 'baton-relay[testing]'" in page
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["optional-dependencies"]["testing"]) == {
        "baton-relay[registry]", "baton-relay[watcher]"}
    assert project["entry-points"]["pytest11"] == {
        "baton_relay": "baton_relay.testing.pytest_plugin"}
