"""docs/architecture.md's map of the registry follows the tree: the layers it draws are
the registry's folders, in the order of the import contract that holds them, and its
table of what moved where names, once each, modules that exist where it says, and no
module where it was."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def drawn_layers() -> list[str]:
    """The folders of the ``registry/`` tree drawn in "The registry's layers", in order."""
    block = re.search(r"```\nregistry/\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/architecture.md draws no registry/ tree"
    return re.findall(r"^  (\w+)/", block.group(1), re.M)


def moved_table() -> list[tuple[str, str]]:
    """(was, is) rows of the table of what moved where."""
    start = DOC.read_text().index("| was | is |")
    rows = re.findall(r"^\| `(registry/[\w/]+\.py)` \| `(registry/[\w/]+\.py)` \|$",
                      DOC.read_text()[start:], re.M)
    assert rows, "docs/architecture.md has no table of what moved where"
    return rows


def test_the_drawn_layers_are_the_registry_folders_in_the_contract_order() -> None:
    folders = sorted(p.parent.name for p in (ROOT / "registry").glob("*/__init__.py"))
    assert sorted(drawn_layers()) == folders
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["name"].startswith("the registry in layers"))
    order = [name.strip().removeprefix("baton_relay.registry.")
             for layer in contract["layers"] for name in layer.split("|")]
    assert drawn_layers() == order


def test_the_moved_table_names_each_module_where_it_is() -> None:
    rows = moved_table()
    now = [is_ for _, is_ in rows]
    assert all((ROOT / path).is_file() for path in now), \
        [p for p in now if not (ROOT / p).is_file()]
    assert len(set(now)) == len(now)
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "registry").glob("*/*.py")
               if p.name != "__init__.py"}
    assert set(now) <= modules
    assert all(not (ROOT / was).exists() for was, _ in rows)
