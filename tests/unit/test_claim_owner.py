"""The claim object owns a claim's keys: no registry module but claim.py writes them.

A claim key, its durable twin (``inflight/…``) and the slot it holds are put and
deleted together; a module that writes one of them on its own is how the paths that
end a claim drifted apart before. The check reads each module's syntax tree: a
``txn.put``/``txn.create``/``txn.delete`` whose key is built by ``keys.claim``,
``keys.inflight`` or ``keys.slot`` (directly, through a local name assigned from one,
or as the ``.key`` of a claim or twin read) is an offence outside claim.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNER = "claim.py"
#: the key builders of a claim's three keys (registry/store/keys.py)
BUILDERS = {"claim", "inflight", "slot"}
#: what a transaction writes with
WRITES = {"put", "create", "delete"}
#: names a claim or its twin is read into, whose ``.key`` is then the claim's key
HELD = {"claim", "twin"}


def _builds_claim_key(node: ast.AST, tainted: set[str]) -> bool:
    """Whether ``node`` builds a claim, twin or slot key (or names one built so)."""
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                and sub.func.attr in BUILDERS and _is_keys(sub.func.value)):
            return True
        if isinstance(sub, ast.Name) and sub.id in tainted:
            return True
        if (isinstance(sub, ast.Attribute) and sub.attr == "key"
                and isinstance(sub.value, ast.Name) and sub.value.id in HELD):
            return True
    return False


def _is_keys(node: ast.AST) -> bool:
    """``keys``, ``self.keys``, ``core.keys``, ``self.core.keys``: the key builder."""
    return (isinstance(node, ast.Name) and node.id == "keys") or (
        isinstance(node, ast.Attribute) and node.attr == "keys")


def _names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def offences(source: str, filename: str) -> list[str]:
    """Each write of a claim, twin or slot key in ``source``, as ``file:line``."""
    tree = ast.parse(source, filename)
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module):
            continue
        tainted: set[str] = set()
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
                if isinstance(value, ast.Tuple) and len(targets) == 1 and isinstance(
                        targets[0], ast.Tuple):
                    pairs = list(zip(targets[0].elts, value.elts, strict=False))
                else:
                    pairs = [(t, value) for t in targets]
                for target, val in pairs:
                    if _builds_claim_key(val, tainted):
                        tainted.update(_names(target))
        for node in ast.walk(func):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in WRITES and node.args
                    and _builds_claim_key(node.args[0], tainted)):
                found.append(f"{filename}:{node.lineno}")
    return sorted(set(found))


def test_only_claim_py_writes_claim_twin_and_slot_keys() -> None:
    """No registry module but claim.py puts, creates or deletes a claim, twin or slot key."""
    found: list[str] = []
    for path in sorted((ROOT / "registry").rglob("*.py")):
        if path.name != OWNER:
            found += offences(path.read_text(), path.name)
    assert found == []


def test_claim_py_writes_all_three() -> None:
    """The check sees claim.py's own writes: the claim key, the twin and the slot."""
    source = (ROOT / "registry" / "rules" / OWNER).read_text()
    assert len(offences(source, OWNER)) >= 5  # take: 3 puts (4 lines); end: 3 deletes


def test_the_check_finds_each_way_a_module_wrote_them() -> None:
    """The forms the registry wrote claim keys in, outside the claim object, are found."""
    cases = {
        "direct": "def f(txn, self):\n    txn.delete(self.keys.claim(ref))\n",
        "twin put": "def f(txn, self):\n    txn.put(self.keys.inflight(ref), value)\n",
        "slot create": ("def f(txn, self):\n"
                        "    txn.create(self.keys.slot(s, n), b'', lease=1)\n"),
        "slot helper": "def f(txn, keys):\n    txn.delete(keys.slot(session, 3))\n",
        "local name": ("def f(txn, self):\n    claim_key = self.keys.claim(ref)\n"
                       "    txn.delete(claim_key)\n"),
        "tuple": ("def f(txn, self):\n"
                  "    a, twin_key = self.keys.claim(r), self.keys.inflight(r)\n"
                  "    txn.delete(twin_key)\n"),
        "read claim": "def f(txn, claim):\n    txn.delete(claim.key)\n",
    }
    for what, source in cases.items():
        assert offences(source, what) != [], what
    assert offences("def f(txn, self):\n    txn.delete(self.keys.entry(t, f))\n",
                    "entry") == []


#: the holder's own release gives its entry back as it was (``fail`` with ``release``):
#: its claim is ended by the fail step itself, with the token checked. The one caller
#: of ``give_back`` outside claim.py: nothing is taken from a holder there.
RELEASES = {("producers.py", "fail")}


def _called(node: ast.AST) -> str:
    """The name a call calls: ``f(...)`` or ``x.f(...)``."""
    assert isinstance(node, ast.Call)
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def take_backs(source: str, filename: str) -> list[str]:
    """Each call of ``give_back`` in ``source`` outside ``RELEASES`` (as ``file:line``):
    a module that ends a claim and gives its entry back itself, instead of through
    ``claim.take_back``."""
    tree = ast.parse(source, filename)
    allowed: set[int] = set()
    for func in tree.body:
        for node in ast.walk(func):
            if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and (filename, node.name) in RELEASES):
                allowed |= {id(n) for n in ast.walk(node)}
    return sorted(f"{filename}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and _called(node) == "give_back"
                  and id(node) not in allowed)


def test_a_claim_is_taken_back_only_through_take_back() -> None:
    """Deadline, stall, lost session and lease revoke take a claim back through
    ``claim.take_back``: no registry module but claim.py gives an entry back itself."""
    found: list[str] = []
    for path in sorted((ROOT / "registry").rglob("*.py")):
        if path.name != OWNER:
            found += take_backs(path.read_text(), path.name)
    assert found == []
    callers = {path.name for path in (ROOT / "registry").rglob("*.py")
               if "take_back(" in path.read_text() and path.name != OWNER}
    assert callers == {"deadlines.py", "stalls.py", "sessions.py", "leases.py"}


def test_the_take_back_check_finds_a_module_giving_back_itself() -> None:
    """A module ending a claim and giving its entry back itself is found; the release of
    producers.py's ``fail`` is not, and neither is a call of take_back."""
    glue = ("async def _expire(self, txn):\n"
            "    async def plan(txn):\n"
            "        end(self.core, txn, ref, claim, guard=True)\n"
            "        give_back(self.core, txn, rec, ref, token, spend=True)\n"
            "    return plan\n")
    assert take_backs(glue, "deadlines.py") == ["deadlines.py:4"]
    assert take_backs("def f():\n    claim.give_back(core, txn)\n", "x.py") == ["x.py:2"]
    release = ("class Producers:\n    async def fail(self):\n"
               "        async def planner(txn):\n            give_back(core, txn)\n")
    assert take_backs(release, "producers.py") == []
    assert take_backs(release, "consumers.py") == ["consumers.py:4"]
    assert take_backs("def f():\n    take_back(core, txn, ref, claim, rec)\n", "x.py") == []
