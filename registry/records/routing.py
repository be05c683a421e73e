"""Routing rules: which consumer groups receive an entry, from the attributes its
producer committed. The only module that imports the JSONPath library.

A rule's condition is a JSONPath filter, ``$[?(@.score > 95)]``, parsed by
``jsonpath-ng``; it holds when the attributes object passes the filter (``@`` is
the object). The library parses; this module evaluates, because the library reads a
decimal literal as a float and counts only ints and floats as numbers, and the point
of a rule like ``@.score > 95`` is that it never gets a score wrong (seed 001 §4.3:
a float comparison once sent high-scoring reports to people): every number — in the
attributes and in the condition — is read from its text as an exact decimal, so
``95.0000000000000000001 > 95`` holds and ``0.1 == 0.10`` too. Comparisons follow
RFC 9535: only two numbers or two strings are ordered, a string is never a number
(``"96" > 95`` does not hold), ``true`` is not ``1``, a missing member equals
nothing. What the evaluator does not implement is refused when the task is
created: regular expressions (``=~``: a pattern from a manifest run on every
verification), arithmetic, ``$`` inside the filter, and queries that select
several nodes (``*``, ``..``, nested filters).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from jsonpath_ng import Child, Fields, Index, JSONPath, Root, This
from jsonpath_ng.exceptions import JSONPathError
from jsonpath_ng.ext.arithmetic import Operation
from jsonpath_ng.ext.filter import And, Expression, Filter, Or
from jsonpath_ng.ext.parser import ExtendedJsonPathLexer, ExtendedJsonPathParser

from ...kernel.contract import MAX_ATTRIBUTES_BYTES
from ...kernel.errors import InvalidArgument, shown

#: rules per task, and characters per condition
MAX_RULES = 32
MAX_CONDITION = 1024
#: nesting of a condition's queries and boolean operators, and of the attributes
MAX_DEPTH = 32

_EQUALITY = {"==", "=", "!="}
_FLOAT = re.compile(r"-?\d+\.\d+")


class RuleError(ValueError):
    """A condition that cannot be parsed or that routing does not support."""


class _ExactLexer(ExtendedJsonPathLexer):
    """The library's lexer, but a decimal literal keeps every digit it was written
    with (the library makes a float of it)."""

    def tokenize(self, string: str) -> Iterator[Any]:
        for token in super().tokenize(string):
            if token.type == "FLOAT":
                match = _FLOAT.match(string, token.lexpos)
                assert match is not None  # the lexer matched this very pattern there
                exact: Any = Decimal(match.group())
                token.value = exact
            yield token


_MISSING = object()


@dataclass(frozen=True)
class Condition:
    """A parsed condition: ``holds(attributes)``."""

    text: str
    filter: Filter

    def holds(self, attributes: Any) -> bool:
        return all(_holds(e, attributes) for e in self.filter.expressions)


@functools.lru_cache(maxsize=4096)
def condition(text: str) -> Condition:
    """Parse ``text``; raise ``RuleError`` saying where and why it is refused.

    Cached: a task's rules are parsed once per replica, not on every verification.
    """
    if len(text) > MAX_CONDITION:
        raise RuleError(f"longer than {MAX_CONDITION} characters")
    try:
        # A parser of its own: PLY's keeps its state on the parser, and conditions are
        # parsed in manifest validation's worker threads and on the event loop at once.
        path = ExtendedJsonPathParser(lexer_class=_ExactLexer).parse(text)
    except (JSONPathError, RecursionError) as e:
        raise RuleError(str(e).strip() or type(e).__name__) from None
    if not (isinstance(path, Child) and isinstance(path.left, Root)
            and isinstance(path.right, Filter)):
        raise RuleError("expected a filter over the attributes, like $[?(@.score > 95)]")
    for expression in path.right.expressions:
        _check(expression, 0)
    return Condition(text, path.right)


def _check(node: JSONPath, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise RuleError(f"nested more than {MAX_DEPTH} deep")
    if isinstance(node, And | Or):
        for operand in node.operands:
            _check(operand, depth + 1)
    elif isinstance(node, Filter):  # a parenthesised conjunction
        for e in node.expressions:
            _check(e, depth + 1)
    elif isinstance(node, Expression):
        _check_query(node.target, depth + 1)
        if node.op == "=~":
            raise RuleError("regular expressions (=~) are not supported in routing rules")
        if isinstance(node.value, JSONPath):
            _check_query(node.value, depth + 1)
        elif node.op not in (None, "!") and not _literal(node.value):
            raise RuleError(f"cannot compare with {node.value!r}")
    else:
        raise RuleError(f"{node} is not a comparison or an existence test")


def _literal(value: Any) -> bool:
    return value is None or isinstance(value, str | int | Decimal)


def _check_query(node: JSONPath, depth: int) -> None:
    """A query routing evaluates: ``@`` followed by single members and indexes."""
    if depth > MAX_DEPTH:
        raise RuleError(f"nested more than {MAX_DEPTH} deep")
    single = ((isinstance(node, Fields) and len(node.fields) == 1 and node.fields[0] != "*")
              or (isinstance(node, Index) and len(node.indices) == 1))
    if isinstance(node, Child):
        _check_query(node.left, depth + 1)
        _check_query(node.right, depth + 1)
    elif isinstance(node, Operation):
        raise RuleError("arithmetic is not supported in routing rules")
    elif not (single or isinstance(node, This)):
        what = "$ (the attributes are @)" if isinstance(node, Root) else (
            str(node).replace("`this`", "@"))
        raise RuleError(f"{what} is not supported: use @ followed by .member or [index]")


def _holds(node: JSONPath, attributes: Any) -> bool:
    if isinstance(node, And):
        return all(_holds(o, attributes) for o in node.operands)
    if isinstance(node, Or):
        return any(_holds(o, attributes) for o in node.operands)
    if isinstance(node, Filter):
        return all(_holds(e, attributes) for e in node.expressions)
    assert isinstance(node, Expression)  # what _check lets through
    found = _select(node.target, attributes)
    if node.op is None:
        return found is not _MISSING
    if node.op == "!":
        return found is _MISSING
    other = _select(node.value, attributes) if isinstance(node.value, JSONPath) else node.value
    return _compare(node.op, found, other)


def _select(node: JSONPath, value: Any) -> Any:
    """The one value a query selects, or ``_MISSING``."""
    if isinstance(node, This):
        return value
    if isinstance(node, Child):
        left = _select(node.left, value)
        return _MISSING if left is _MISSING else _select(node.right, left)
    if isinstance(node, Fields):
        return value.get(node.fields[0], _MISSING) if isinstance(value, dict) else _MISSING
    assert isinstance(node, Index)
    i = node.indices[0]
    return value[i] if isinstance(value, list) and -len(value) <= i < len(value) else _MISSING


def _number(value: Any) -> bool:
    return isinstance(value, int | Decimal) and not isinstance(value, bool)


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: numbers by value, ``true`` never ``1``, arrays and objects deep."""
    if _number(a) and _number(b):
        return bool(a == b)
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(v, b[k]) for k, v in a.items())
    return bool(a == b)


def _compare(op: str, a: Any, b: Any) -> bool:
    if a is _MISSING or b is _MISSING:
        equal = a is b  # two missing members are equal (RFC 9535), nothing else is
        return equal if op in ("==", "=", "<=", ">=") else (op == "!=" and not equal)
    if op in _EQUALITY:
        return _equal(a, b) == (op != "!=")
    ordered = (_number(a) and _number(b)) or (isinstance(a, str) and isinstance(b, str))
    if not ordered:
        return op in ("<=", ">=") and _equal(a, b)
    return bool({"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


# attributes ----------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_attributes(text: str) -> dict[str, Any]:
    """The attributes a producer committed (JSON text), numbers as exact decimals;
    raise ``InvalidArgument`` for anything but a JSON object within
    ``MAX_ATTRIBUTES_BYTES``."""
    size = len(text.encode())
    if size > MAX_ATTRIBUTES_BYTES:
        raise InvalidArgument(f"attributes are {size} bytes encoded: at most "
                              f"{MAX_ATTRIBUTES_BYTES}")
    try:
        value = json.loads(text, parse_float=Decimal, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(f"attributes are not valid JSON: {shown(str(e))}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"attributes must be a JSON object, not {type(value).__name__} "
                              f"{shown(text)}")
    if _depth(value) > MAX_DEPTH:
        raise InvalidArgument(f"attributes nest more than {MAX_DEPTH} deep")
    return value


def _depth(value: Any) -> int:
    """How deep arrays and objects nest in ``value`` (without recursion: comparing
    ``@.a == @.b`` recurses, and must never run out of stack at verification)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack += [(child, depth + 1) for child in (
                node.values() if isinstance(node, dict) else node)]
    return deepest


# rules -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    condition: str
    groups: list[str]
    #: group -> the concurrency pool its leases of the entries routed so take from
    pools: dict[str, str] = field(default_factory=dict)


def problems(rules: Sequence[Rule], groups: Sequence[str], where: str = "") -> list[str]:
    """What is wrong with a task's rules, each problem naming the rule by index (and,
    for a condition the parser refuses, the parser's line and column)."""
    out = []
    if len(rules) > MAX_RULES:
        out.append(f"{where}routing_rules: {len(rules)} rules, at most {MAX_RULES}")
    # Only the rules a task may have are looked into: parsing thousands would make a
    # hostile manifest's refusal slow (fuzzing found 2,000 empty rules taking 12 s).
    for i, rule in enumerate(rules[:MAX_RULES]):
        at = f"{where}routing_rules[{i}]"
        try:
            condition(rule.condition)
        except RuleError as e:
            out.append(f"{at}: condition {shown(rule.condition)}: {e}")
        if not rule.groups:
            out.append(f"{at}: names no consumer group")
        unknown = [g for g in rule.groups if g not in groups]
        if unknown:
            out.append(f"{at}: {', '.join(shown(g) for g in unknown)} is not a consumer "
                       f"group of the entries it routes ({', '.join(groups)})")
        if len(set(rule.groups)) != len(rule.groups):
            out.append(f"{at}: consumer groups repeated")
    return out


def route(rules: Sequence[Rule], attributes: str) -> tuple[int, list[str]] | None:
    """The first rule that holds over ``attributes`` (JSON text, "" for none): its
    index and groups; None when no rule holds."""
    value = parse_attributes(attributes) if attributes else {}
    for i, rule in enumerate(rules):
        if condition(rule.condition).holds(value):
            return i, list(rule.groups)
    return None
