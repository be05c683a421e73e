"""A task's access rules: who may produce its entries and consume them per group.

A manifest's ``access`` (docs/security.md, "Roles per task") names identities by
shell patterns on their name. Producers are decided per entry when the task is
created — the entry's own ``producers``, else those of the longest directory rule
its path lies under, else the task's — and kept in the entry's record, so a claim
checks them without reading anything more. Consumers are decided per group from
the task's header, which a consume reads anyway.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ...kernel.errors import PermissionDenied, shown
from ...kernel.v1 import baton_pb2 as pb
from .identity import WATCHER, Caller, may

MAX_PATTERNS = 64
MAX_PATTERN = 128
MAX_RULES = 256
#: a POSIX group name, as useradd/groupadd accept it
UNIX_GROUP_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
MODE_RE = re.compile(r"^0?[0-7]{3,4}$")


def patterns_problems(where: str, patterns: Sequence[str]) -> list[str]:
    out = []
    if len(patterns) > MAX_PATTERNS:
        out.append(f"{where}: more than {MAX_PATTERNS} patterns")
    for p in patterns:
        if not p or len(p) > MAX_PATTERN or any(c.isspace() for c in p):
            out.append(f"{where}: pattern {shown(p)} must be 1-{MAX_PATTERN} characters "
                       "without spaces")
    return out


def _dir_problem(d: str) -> str | None:
    if not d or d.startswith("/") or d.endswith("/"):
        return "must be relative, without a slash at either end"
    parts = d.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\0" in d:
        return "must be normalised (no empty, '.' or '..' component)"
    return None


def problems(access: pb.Access, groups: set[str]) -> list[str]:
    """Everything wrong with a manifest's ``access``; ``groups`` are the task's
    consumer groups (entries' included)."""
    out = patterns_problems("access.producers", access.producers)
    if len(access.paths) > MAX_RULES or len(access.groups) > MAX_RULES:
        out.append(f"access: more than {MAX_RULES} rules")
    seen: set[str] = set()
    for i, rule in enumerate(access.paths):
        where = f"access.paths[{i}] ({shown(rule.dir)})"
        why = _dir_problem(rule.dir)
        if why:
            out.append(f"{where}: dir {why}")
        if rule.dir in seen:
            out.append(f"{where}: dir listed twice")
        seen.add(rule.dir)
        out += patterns_problems(where, rule.producers)
        if rule.unix_group and not UNIX_GROUP_RE.match(rule.unix_group):
            out.append(f"{where}: unix_group {shown(rule.unix_group)} is not a group name")
        if rule.mode and not MODE_RE.match(rule.mode):
            out.append(f"{where}: mode {shown(rule.mode)} is not an octal mode like 2770")
    named: set[str] = set()
    for i, g in enumerate(access.groups):
        where = f"access.groups[{i}] ({shown(g.group)})"
        if g.group not in groups:
            out.append(f"{where}: not a consumer group of the task "
                       f"({', '.join(sorted(groups))})")
        if g.group in named:
            out.append(f"{where}: group listed twice")
        named.add(g.group)
        out += patterns_problems(where, g.consumers)
    return out


def producers_of(access: pb.Access, path: str, own: Sequence[str]) -> list[str]:
    """The patterns that decide who may produce the entry at ``path``."""
    if own:
        return list(own)
    best: pb.PathAccess | None = None
    for rule in access.paths:
        if rule.producers and (path + "/").startswith(rule.dir + "/") and (
                best is None or len(rule.dir) > len(best.dir)):
            best = rule
    return list(best.producers if best is not None else access.producers)


def to_dict(access: pb.Access) -> dict[str, Any]:
    """The rules as the task header keeps them (empty parts left out)."""
    out: dict[str, Any] = {}
    if access.producers:
        out["producers"] = list(access.producers)
    if access.paths:
        out["paths"] = [{k: v for k, v in (("dir", r.dir), ("producers", list(r.producers)),
                                           ("unix_group", r.unix_group), ("mode", r.mode))
                         if v} for r in access.paths]
    if access.groups:
        out["groups"] = [{"group": g.group, "consumers": list(g.consumers)}
                         for g in access.groups]
    return out


def from_dict(data: dict[str, Any]) -> pb.Access:
    return pb.Access(
        producers=data.get("producers", []),
        paths=[pb.PathAccess(**r) for r in data.get("paths", [])],
        groups=[pb.GroupAccess(**g) for g in data.get("groups", [])],
    )


def consumers_of(access: dict[str, Any], group: str) -> list[str]:
    """The patterns that decide who may consume for ``group`` (none: everyone)."""
    for g in access.get("groups", []):
        if g.get("group") == group:
            return list(g.get("consumers", []))
    return []


def check_producer(caller: Caller, task_id: str, file_id: str,
                   patterns: Sequence[str]) -> None:
    if not may(caller, patterns):
        raise PermissionDenied(
            f"{caller.describe()} may not produce {task_id}/{file_id}: the task's access "
            f"rules allow {', '.join(patterns)}", task_id=task_id, file_id=file_id,
            identity=caller.name)


def check_consumer(caller: Caller, task_id: str, group: str,
                   patterns: Sequence[str]) -> None:
    if not may(caller, patterns):
        raise PermissionDenied(
            f"{caller.describe()} may not consume for group {group!r} of task {task_id!r}: "
            f"the task's access rules allow {', '.join(patterns)}", task_id=task_id,
            group=group, identity=caller.name)


def readers_of(access: dict[str, Any], entries: Sequence[Any],
               groups: Sequence[str]) -> list[str] | None:
    """Who may read a task's contents: whoever its rules let produce an entry or consume
    for a group — the patterns of all those rules. None when some entry or group has no
    rule (anyone may produce or consume there, so anyone may read)."""
    patterns: set[str] = set()
    for e in entries:
        if not e.producers:
            return None
        patterns.update(e.producers)
    for g in {*groups, *(g for e in entries for g in e.consumers)}:
        consumers = consumers_of(access, g)
        if not consumers:
            return None
        patterns.update(consumers)
    return sorted(patterns)


def check_reader(caller: Caller, task_id: str, readers: Sequence[str] | None) -> None:
    """Refuse to show a task's contents (its header, entries, journal, explanations,
    watch events) to an identity its rules let neither produce nor consume there.
    Operators read everything, and so do watchers (they verify every task's files)."""
    if readers is None or caller.operator or WATCHER in caller.roles or may(caller, readers):
        return
    raise PermissionDenied(
        f"{caller.describe()} may not read task {task_id!r}: its access rules let only "
        f"{', '.join(readers)} produce or consume there", task_id=task_id,
        identity=caller.name)


def explain(caller: Caller, producers: Sequence[str], groups: dict[str, list[str]]) -> str:
    """What the access rules say about ``caller`` and one entry, as a sentence."""
    parts = []
    if producers:
        verdict = "may" if may(caller, producers) else "may not"
        parts.append(f"Producers must match {', '.join(producers)}: "
                     f"{caller.name or 'you'} {verdict} produce it.")
    for group, patterns in sorted(groups.items()):
        if patterns:
            verdict = "may" if may(caller, patterns) else "may not"
            parts.append(f"Group {group} consumers must match {', '.join(patterns)}: "
                         f"{caller.name or 'you'} {verdict} consume it for {group}.")
    return " ".join(parts)
