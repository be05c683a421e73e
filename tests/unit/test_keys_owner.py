"""Keys are built in registry/store/keys.py only: no other registry module spells a key.

Every key lives under a namespace (``tasks/``, ``cready/``, ``inflight/``, ...) that
keys.py names once, in its ``_k`` calls. The check reads each other registry module's
syntax tree: a string or bytes literal (an f-string's text too; docstrings aside) that
holds a namespace followed by ``/``, or a ``b"/"`` joined onto a key by ``+``, is a key
spelled outside keys.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNER = "keys.py"


def namespaces() -> set[str]:
    """The first segment of every key keys.py builds (its ``self._k("NAME", ...)``)."""
    tree = ast.parse((ROOT / "registry" / "store" / OWNER).read_text(), OWNER)
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "_k" and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)}


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
        value = node.value
        return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


def offences(source: str, filename: str, names: set[str]) -> list[str]:
    """Each literal in ``source`` that spells a key of ``names``, or joins a ``b"/"`` onto
    one with ``+``, as ``file:line``."""
    found = []
    tree = ast.parse(source, filename)
    docs = {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if id(node) in docs:
            continue  # a docstring speaks of keys, it builds none
        text = _text(node)
        if text is not None and any(f"{n}/" in text for n in names):
            # a namespace at the start of the literal, or after a "/" or a placeholder
            for n in names:
                at = text.find(f"{n}/")
                if at >= 0 and (at == 0 or text[at - 1] in "/}"):
                    found.append(f"{filename}:{node.lineno}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and side.value == b"/":
                    found.append(f"{filename}:{node.lineno}")
        if isinstance(node, ast.JoinedStr):
            parts = [_text(v) or "" for v in node.values]
            joined = "{}".join(parts)
            if any(f"}}{n}/" in joined or joined.startswith(f"{n}/") or f"/{n}/" in joined
                   for n in names):
                found.append(f"{filename}:{node.lineno}")
    return sorted(set(found))


def test_the_namespaces_are_read_from_keys_py() -> None:
    """The consumer indexes and the claims' keys are among the namespaces keys.py builds."""
    assert {"tasks", "entries", "cready", "cdelayed", "claims", "inflight", "election",
            "poolunits"} <= namespaces()


def test_no_registry_module_but_keys_py_spells_a_key() -> None:
    """Every key (consumer indexes included) is built by a function of keys.py."""
    names = namespaces()
    found: list[str] = []
    for path in sorted((ROOT / "registry").rglob("*.py")):
        if path.name != OWNER:
            found += offences(path.read_text(), path.name, names)
    assert found == []


def test_the_check_finds_a_key_spelled_out() -> None:
    """The ways a key was spelled outside keys.py are found; other text is not."""
    names = namespaces()
    cases = {
        "f-string": 'def f(prefix, t, g):\n    return f"{prefix}cready/{t}/{g}/".encode()\n',
        "bytes": 'def f(base):\n    return base + b"inflight/c/"\n',
        "joined": "def f(base, t):\n    return base + t.encode() + b\"/\"\n",
        "election": 'def f(prefix, name):\n    return f"{prefix}election/{name}/"\n',
    }
    for what, source in cases.items():
        assert offences(source, what, names) != [], what
    for text in ('x = "the claims of a task"\n', 'x = f"{n} entries"\n',
                 'x = "see docs/architecture.md"\n'):
        assert offences(text, "ok", names) == [], text
