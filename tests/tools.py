"""The programs tests run, found or failed with the line ``scripts/install_deps.py`` prints.

``make test`` installs them on Debian as root; elsewhere the install step prints one line
per missing program and a test that needs one fails with that same line: never a silent
skip, never a traceback.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install_deps.py"


def _load() -> ModuleType:
    """The install script as a module (scripts/ is not a package: it runs before the
    virtualenv exists)."""
    spec = importlib.util.spec_from_file_location("baton_install_deps", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while executing
    spec.loader.exec_module(module)
    return module


_script = sys.modules.get("baton_install_deps") or _load()
#: the install step's table of programs
TOOLS: tuple[Any, ...] = _script.TOOLS
#: what it prints when kubectl is missing (the deploy tests skip with that line)
KUBECTL_LINE: str = _script.KUBECTL_LINE
#: what kubectl the Kubernetes checks want, and how to get it
KUBECTL_WANTED: str = _script.KUBECTL_WANTED


def missing_line(name: str) -> str:
    """What the install step prints when ``name`` (a name of its table) is missing."""
    line: str = _script.by_name(name).missing_line()
    return line


def find(name: str) -> str | None:
    """Where ``name`` (a name of the install step's table) is, or None."""
    found: str | None = _script.by_name(name).find()
    return found


def require(*names: str) -> str:
    """The path of the first of ``names``; the test fails with the install step's line for
    every one that is missing."""
    lines = [missing_line(name) for name in names if find(name) is None]
    if lines:
        pytest.fail("\n".join(lines), pytrace=False)
    found = find(names[0])
    assert found is not None
    return found
