"""Every test marked ``real_time`` names its twin on the test's clock, and the twin is
there: the fast tier runs the twin in the original's place (``-m "not real_time"``), so a
twin renamed or removed would leave the promise untested there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def real_time_marks() -> list[tuple[str, str]]:
    """(the marked test, the twin it names) across the integration tier."""
    found = []
    for path in sorted(INTEGRATION.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                        and deco.func.attr == "real_time"):
                    arg = deco.args[0]
                    assert isinstance(arg, ast.Constant), f"{path.name}::{node.name}"
                    found.append((f"{path.name}::{node.name}", str(arg.value)))
    return found


def test_every_real_time_test_names_a_twin_that_exists() -> None:
    marks = real_time_marks()
    assert len(marks) >= 9
    for marked, twin in marks:
        module, _, name = twin.partition("::")
        tree = ast.parse((INTEGRATION / module).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{marked} names {twin}, which is not there"
        # the twin says which original it stands for, in its docstring
        twin_node = next(n for n in tree.body
                         if isinstance(n, ast.FunctionDef) and n.name == name)
        doc = re.sub(r"_\s+", "_", ast.get_docstring(twin_node) or "")
        assert f"Twin of {marked}" in doc, f"{twin}'s docstring does not name {marked}"
