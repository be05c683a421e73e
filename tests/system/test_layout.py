"""The repository's layout: one import name per file, no links, the layers held."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernel", "client", "registry", "watcher", "local")


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_refuses_a_second_import_name(package: str) -> None:
    """From the repository's root, `import FOLDER` stops with an error naming the one
    import name, baton_relay.FOLDER, instead of loading a second copy of its modules."""
    done = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"{package} is baton_relay.{package}: import it by that name" in done.stderr


def test_each_package_loads_from_its_folder() -> None:
    """baton_relay.FOLDER is the repository's FOLDER/ (no copy, no link in between)."""
    code = ("import importlib; print('\\n'.join(importlib.import_module("
            f"'baton_relay.' + p).__file__ for p in {PACKAGES!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.split() == [str(ROOT / p / "__init__.py") for p in PACKAGES]


def test_the_repository_holds_no_symbolic_link() -> None:
    """git records no link (mode 120000): a checkout works on any filesystem."""
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    assert [line for line in listed if line.startswith("120000")] == []


def test_the_layer_contracts_are_kept() -> None:
    """import-linter's contracts (pyproject.toml) hold: local | testing above registry | watcher,
    above client, above kernel; the registry off the client library."""
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def _circles(graph: Any, package: str) -> list[list[str]]:
    """The import circles among ``package``'s modules (Tarjan's strongly connected
    components of more than one module, or of one that imports itself)."""
    modules = sorted(graph.find_descendants(package))
    edges = {m: sorted(set(graph.find_modules_directly_imported_by(m)) & set(modules))
             for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in edges[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1 or m in edges[m]:
                found.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_has_an_import_circle(package: str) -> None:
    """No module of a package reaches itself through imports, those made for type
    checking included (a tool drawing the imports sees them too)."""
    import grimp  # import-linter's import graph (the dev extra)
    graph = grimp.build_graph("baton_relay", cache_dir=None)
    assert _circles(graph, f"baton_relay.{package}") == []
