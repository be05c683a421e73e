"""Validation of task manifests: every problem found is reported at once.

Limits (documented in docs/cli.md, "The manifest"):

- ids (task, file, consumer group): ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``
- at most ``MAX_ENTRIES`` entries; paths at most ``MAX_PATH`` bytes, relative,
  normalised, never leaving the task's directory, unique within the task
- ``max_retries`` between 0 and ``MAX_RETRIES``; ``expected_size`` between 0
  and ``MAX_SIZE``; ``expected_digest`` empty or 64 lower-case hex digits
- at most ``MAX_LABELS`` labels per object, keys ≤ 63 and values ≤ 256 chars
- ``depends_on`` names entries of the same task, never itself nor one twice, and no
  cycles; or ``TASK:FILE_ID``, an entry of another task that exists already (so no
  cycle can cross tasks); it may be long (a dependent with hundreds of dependencies
  is released like one with a few)
- ``priority`` 0..9; ``aging_seconds`` 0..86400; backoff values finite, ≥ 0, cap ≤ 86400;
  ``archive_after_seconds`` finite
- ``claim_deadline_seconds``, ``consume_deadline_seconds``, ``stall_after_seconds``
  (task and entries) 0..a week
- ``staging_retention_seconds`` (task and entries) finite, at most ``MAX_RETENTION``
- ``parts`` name other entries of the task, each once; a part belongs to one
  assembly only; an assembly has no ``depends_on`` and is not itself a part; an
  assembly may have hundreds of parts
- ``access`` rules as ``registry.access`` checks them (patterns, directories,
  unix groups and modes; groups named must be consumer groups of the task)
- ``backlog_limits`` name consumer groups of the task, each with ``entries`` in
  1..``MAX_BACKLOG`` (``bytes`` is refused: not counted yet)
- ``routing_rules`` as ``registry.routing`` checks them (at most ``MAX_RULES``,
  each condition a filter it can evaluate, its groups consumer groups of every
  entry the rules route)
- ``fairness``: 1..``fairness.MAX_KEYS`` declared keys (valid ids), weights
  1..``fairness.MAX_WEIGHT``, the default one of them; each entry's ``fairness_key``
  declared (or the task's default)
- the manifest, encoded, at most ``kernel.contract.MAX_MANIFEST_BYTES``

Problems quote the values they are about cut short (``kernel.errors.shown``), so
that a 20,000-character path makes a readable error, not one gRPC cannot carry.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from ...kernel import tracing
from ...kernel.contract import (
    ATTEMPT_MARKER,
    ID_PATTERN,
    MAX_DELAY_SECONDS,
    MAX_FILE_NAME,
    MAX_MANIFEST_BYTES,
    mib,
    parse_attempt,
)
from ...kernel.errors import InvalidArgument, InvalidManifest, shown
from ...kernel.v1 import baton_pb2 as pb
from . import access, fairness, routing
from .model import SCHEMA_VERSION, EntryRecord, now

MAX_ENTRIES = 100_000
MAX_PATH = 1024
MAX_RETRIES = 100
MAX_SIZE = 1 << 50
MAX_LABELS = 32
MAX_GROUPS = 16
DEFAULT_MAX_RETRIES = 3
DEFAULT_GROUP = "default"

ID_RE = re.compile(ID_PATTERN)
#: the longest processing deadline a manifest may set: a week
MAX_DEADLINE = 7 * 86400.0
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
#: the longest staging retention a manifest may set: a year
MAX_RETENTION = 366 * 86400.0
#: the largest backlog limit a manifest may set (a task's entries at most)
MAX_BACKLOG = 100_000


def check_id(kind: str, value: str) -> None:
    """Raise ``InvalidArgument`` unless ``value`` is a valid task/file/group id."""
    if not ID_RE.match(value):
        raise InvalidArgument(f"invalid {kind} {shown(value)}: expected {ID_RE.pattern}",
                              kind=kind)


def check_traceparent(value: str) -> None:
    """Raise ``InvalidArgument`` unless ``value`` is "" (untraced) or a W3C trace
    context of version 00 naming a trace and a span."""
    if value and not tracing.valid(value):
        raise InvalidArgument(f"invalid traceparent {shown(value)}: expected a W3C trace "
                              "context, 00-<32 hex trace id>-<16 hex span id>-<2 hex "
                              "flags>, not all zeros", field="traceparent")


def check_delay(name: str, seconds: float, *, permanent: bool = False) -> None:
    """Raise ``InvalidArgument`` (naming ``name``) unless ``seconds`` is a delay a fail or
    nack may ask for: finite, 0 to ``MAX_DELAY_SECONDS``, and not with ``permanent``
    (an entry that goes dead is never handed out again)."""
    if not math.isfinite(seconds) or seconds < 0 or seconds > MAX_DELAY_SECONDS:
        raise InvalidArgument(
            f"{name} must be between 0 and {MAX_DELAY_SECONDS} seconds (7 days), "
            f"not {seconds}", field=name)
    if permanent and seconds:
        raise InvalidArgument(
            f"{name} with permanent: a permanent failure is never retried, so there is "
            "nothing to delay", field=name)


#: characters of the problems that an InvalidManifest's message lists
SUMMARY_CHARS = 1000


def summary(problems: list[str]) -> str:
    """The message of an ``InvalidManifest``: the first problems, as many as fit in
    ``SUMMARY_CHARS``, and how many more there are."""
    text, listed = "", 0
    for problem in problems:
        if listed and len(text) + len(problem) > SUMMARY_CHARS:
            break
        text += ("; " if listed else "") + problem
        listed += 1
    more = len(problems) - listed
    count = f"{len(problems)} problems: " if len(problems) > 1 else ""
    return f"invalid manifest: {count}{text}" + (f" (and {more} more)" if more else "")


def path_problem(path: str) -> str | None:
    """Why ``path`` is not an acceptable staging path, or None."""
    if not path:
        return "is empty"
    if len(path.encode()) > MAX_PATH:
        return f"is longer than {MAX_PATH} bytes"
    if "\0" in path:
        return "contains a NUL byte"
    if path.startswith("/"):
        return "is absolute"
    parts = path.split("/")
    if ".." in parts:
        return "contains '..'"
    if any(p in ("", ".") for p in parts):
        return "is not normalised (empty or '.' component)"
    if str(PurePosixPath(path)) != path:
        return "is not normalised"
    if len(parts[-1].encode()) > MAX_FILE_NAME:
        return (f"ends with a file name longer than {MAX_FILE_NAME} bytes (an attempt's "
                "file adds its token to it)")
    if parse_attempt(path) is not None:
        return (f"ends like an attempt's file name (NAME{ATTEMPT_MARKER}TOKEN.EXT), which "
                "the watcher would take for one")
    return None


@dataclass(frozen=True)
class ValidTask:
    task_id: str
    consumers: list[str]
    max_retries: int
    labels: dict[str, str]
    entries: list[EntryRecord]
    digest: str
    priority: int = 0
    backoff: tuple[float, ...] | list[float] = (1.0, 2.0, 60.0)
    aging: float = 60.0
    access: dict[str, object] | None = None
    digest_optional: bool = False
    routing_rules: tuple[routing.Rule, ...] = ()
    #: the task's pools ({"produce": NAME, "consume": {GROUP: NAME}}) and every pool
    #: its entries name
    pools: dict[str, object] | None = None
    pools_used: tuple[str, ...] = ()
    #: per consumer group, the most entries its backlog may hold (``backlog_limits``)
    backlog_limits: dict[str, int] = field(default_factory=dict)
    #: fairness keys and their weights (empty: no fair shares)
    fairness: dict[str, int] | None = None
    fairness_default: str = ""


def check_pool_name(name: str) -> None:
    """Raise ``InvalidArgument`` unless ``name`` can name a concurrency pool."""
    if not ID_RE.match(name):
        raise InvalidArgument(f"invalid pool name {shown(name)}: expected {ID_RE.pattern}",
                              field="name")


def _pool_problems(spec: pb.TaskSpec, groups: list[str], owner: dict[str, str]) -> list[str]:
    """What is wrong with the pools a manifest names: a name that is not an id, or a
    consumer group that does not consume the task (the entry)."""
    problems = []
    for where, pools, receivers in [
            ("the task", spec.pools, set(groups) | {g for e in spec.entries
                                                    for g in e.consumers}),
            *((f"entry {shown(e.file_id)}", e.pools, set(e.consumers or groups))
              for e in spec.entries if e.HasField("pools"))]:
        for name in (pools.produce, *pools.consume.values()):
            if name and not ID_RE.match(name):
                problems.append(f"{where}: pool name {shown(name)} is not an id "
                                f"({ID_RE.pattern})")
        for group in pools.consume:
            if group not in receivers:
                problems.append(f"{where}: pools.consume names group {shown(group)}, "
                                f"which does not consume it (groups: {sorted(receivers)})")
    for i, rule in enumerate(spec.routing_rules[:routing.MAX_RULES]):
        for group, name in rule.pools.items():
            if group not in rule.groups:
                problems.append(f"routing_rules[{i}]: pools names group {shown(group)}, "
                                f"which the rule does not route to ({list(rule.groups)})")
            if not ID_RE.match(name):
                problems.append(f"routing_rules[{i}]: pool name {shown(name)} is not an id "
                                f"({ID_RE.pattern})")
    for e in spec.entries:
        if e.file_id in owner and e.HasField("pools") and e.pools.consume:
            problems.append(f"entry {shown(e.file_id)} is a part of {shown(owner[e.file_id])}: "
                            "parts are consumed as their assembly and take no pool")
    return problems


def _backlog_problems(limits: Mapping[str, pb.BacklogLimit], groups: set[str]) -> list[str]:
    """Each limit names a consumer group of the task and a positive number of entries
    (at most ``MAX_BACKLOG``); a limit in bytes is not counted yet, so it is refused
    rather than ignored."""
    out = []
    for group in sorted(limits):
        where = f"backlog_limits[{shown(group)}]"
        limit = limits[group]
        if group not in groups:
            out.append(f"{where}: {shown(group)} is not a consumer group of the task "
                       f"(its groups: {', '.join(sorted(groups))})")
        if limit.bytes:
            out.append(f"{where}.bytes: a backlog limit in bytes is not supported; "
                       "set entries")
        if not 0 < limit.entries <= MAX_BACKLOG:
            out.append(f"{where}.entries: {limit.entries} is not a number of entries "
                       f"within 1..{MAX_BACKLOG}")
    return out


def _labels_problems(where: str, labels: dict[str, str]) -> list[str]:
    out = []
    if len(labels) > MAX_LABELS:
        out.append(f"{where}: more than {MAX_LABELS} labels")
    for k, v in labels.items():
        if not 0 < len(k) <= 63 or len(v) > 256:
            out.append(f"{where}: label {shown(k)} too long or empty (key ≤ 63, value ≤ 256)")
    return out


def _groups_problems(where: str, groups: list[str]) -> list[str]:
    out = [f"{where}: invalid consumer group {shown(g)}" for g in groups if not ID_RE.match(g)]
    if len(groups) > MAX_GROUPS:
        out.append(f"{where}: more than {MAX_GROUPS} consumer groups")
    if len(set(groups)) != len(groups):
        out.append(f"{where}: consumer groups repeated")
    return out


def _cycle(deps: dict[str, list[str]]) -> list[str] | None:
    """One dependency cycle, if any (iterative DFS: manifests can be long)."""
    colour: dict[str, int] = {}
    for root in deps:
        if colour.get(root):
            continue
        stack = [(root, iter(deps[root]))]
        path = [root]
        colour[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child) == 1:
                return [*path[path.index(child) :], child]
            elif not colour.get(child) and child in deps:
                colour[child] = 1
                stack.append((child, iter(deps[child])))
                path.append(child)
    return None


def _routing_problems(spec: pb.TaskSpec, rules: tuple[routing.Rule, ...], groups: list[str],
                      parts: dict[str, str]) -> list[str]:
    """The rules' own problems, and a group a rule names that some entry it routes
    (every entry but the parts, which are consumed as their assembly) does not have."""
    out = routing.problems(rules, groups)
    for i, rule in enumerate(rules[:routing.MAX_RULES]):
        lacking = [e.file_id for e in spec.entries if e.consumers and e.file_id not in parts
                   and not set(rule.groups) <= set(e.consumers)]
        if lacking and set(rule.groups) <= set(groups):
            more = f" and {len(lacking) - 1} more" if len(lacking) > 1 else ""
            out.append(f"routing_rules[{i}]: entry {shown(lacking[0])}{more} has consumers "
                       f"that do not include all of {', '.join(rule.groups)}")
    return out


def validate(spec: pb.TaskSpec) -> ValidTask:
    """Check a manifest and build its entry records; raise ``InvalidManifest``."""
    problems: list[str] = []
    if not ID_RE.match(spec.task_id):
        problems.append(f"task_id {shown(spec.task_id)} is not a valid id ({ID_RE.pattern})")
    if spec.schema_version not in (0, SCHEMA_VERSION):
        problems.append(
            f"schema_version {spec.schema_version} is not supported (this registry: "
            f"{SCHEMA_VERSION})"
        )
    if not spec.entries:
        problems.append("a task needs at least one entry")
    if len(spec.entries) > MAX_ENTRIES:
        problems.append(f"{len(spec.entries)} entries: at most {MAX_ENTRIES} per task")
    task_retries = spec.max_retries if spec.HasField("max_retries") else DEFAULT_MAX_RETRIES
    if not 0 <= task_retries <= MAX_RETRIES:
        problems.append(f"max_retries {task_retries} not within 0..{MAX_RETRIES}")
    groups = list(spec.consumers) or [DEFAULT_GROUP]
    problems += _groups_problems("task", groups)
    problems += _labels_problems("task", dict(spec.labels))

    seen_ids: set[str] = set()
    seen_paths: set[str] = set()
    for i, e in enumerate(spec.entries):
        where = f"entries[{i}] ({shown(e.file_id)})"
        if not ID_RE.match(e.file_id):
            problems.append(f"{where}: file_id is not a valid id ({ID_RE.pattern})")
        elif e.file_id in seen_ids:
            problems.append(f"{where}: duplicate file_id")
        seen_ids.add(e.file_id)
        why = path_problem(e.path)
        if why:
            problems.append(f"{where}: path {shown(e.path)} {why}")
        elif e.path in seen_paths:
            problems.append(f"{where}: path {shown(e.path)} used by another entry")
        seen_paths.add(e.path)
        if not 0 <= e.expected_size <= MAX_SIZE:
            problems.append(f"{where}: expected_size {e.expected_size} out of range")
        if e.expected_digest and not DIGEST_RE.match(e.expected_digest):
            problems.append(f"{where}: expected_digest is not 64 lower-case hex digits")
        if e.HasField("max_retries") and not 0 <= e.max_retries <= MAX_RETRIES:
            problems.append(f"{where}: max_retries {e.max_retries} not within 0..{MAX_RETRIES}")
        problems += _groups_problems(where, list(e.consumers))
        problems += _labels_problems(where, dict(e.labels))
        if e.producers:
            problems += access.patterns_problems(f"{where}: producers", e.producers)
    ids = {e.file_id for e in spec.entries}
    for e in spec.entries:
        for what, names in (("depends_on", e.depends_on), ("parts", e.parts)):
            repeated = sorted(n for n, k in Counter(names).items() if k > 1)
            if repeated:
                more = [f"{len(repeated) - 5} more"] if len(repeated) > 5 else []
                listed = ", ".join([*(shown(n) for n in repeated[:5]), *more])
                problems.append(f"entry {shown(e.file_id)}: {what} names [{listed}] more "
                                "than once")
        for dep in e.depends_on:
            other, sep, file_id = dep.partition(":")
            if sep:  # an entry of another task, which must exist already (tasks.create)
                if other == spec.task_id:
                    problems.append(f"entry {shown(e.file_id)} depends on {shown(dep)}: an "
                                    "entry of its own task is named by its file id alone")
                elif not (ID_RE.match(other) and ID_RE.match(file_id)):
                    problems.append(f"entry {shown(e.file_id)} depends on {shown(dep)}: "
                                    "expected TASK:FILE_ID, both valid ids")
            elif dep == e.file_id:
                problems.append(f"entry {shown(e.file_id)} depends on itself")
            elif dep not in ids:
                problems.append(f"entry {shown(e.file_id)} depends on unknown entry "
                                f"{shown(dep)}")
    if not problems:
        # Only within the task: another task's entries existed before this one, so
        # nothing there can depend on an entry here (no cycle across tasks).
        cycle = _cycle({e.file_id: [d for d in e.depends_on if ":" not in d]
                        for e in spec.entries})
        if cycle:
            path = [shown(n) for n in cycle]
            if len(path) > 12:
                path = [*path[:6], f"… ({len(path) - 12} more)", *path[-6:]]
            problems.append("dependency cycle: " + " -> ".join(path))
    if not 0 <= spec.priority <= 9:
        problems.append(f"priority {spec.priority} not within 0..9")
    if not 0 <= spec.aging_seconds <= 86400:
        problems.append(f"aging_seconds {spec.aging_seconds} not within 0..86400")
    for where, obj in [("the task", spec), *((f"entry {shown(e.file_id)}", e)
                                            for e in spec.entries)]:
        for name in ("claim_deadline_seconds", "consume_deadline_seconds",
                     "stall_after_seconds"):
            value = getattr(obj, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_DEADLINE):
                problems.append(f"{where}: {name} {value} not within 0..{MAX_DEADLINE:.0f} "
                                "(0: none)")
    b = spec.backoff
    values = (b.base_seconds, b.factor, b.cap_seconds)
    if not all(math.isfinite(v) and v >= 0 for v in values) or b.cap_seconds > 86400:
        # NaN passes every comparison, infinity makes delays of NaN (0 times infinity): both refused
        problems.append(f"backoff values must be finite numbers ≥ 0 and cap_seconds ≤ 86400 "
                        f"(given base_seconds {b.base_seconds}, factor {b.factor}, "
                        f"cap_seconds {b.cap_seconds})")
    retentions: list[tuple[str, pb.TaskSpec | pb.EntrySpec]] = [
        ("the task", spec), *((f"entry {shown(e.file_id)}", e) for e in spec.entries)]
    for where, obj in retentions:
        if obj.HasField("staging_retention_seconds"):
            value = obj.staging_retention_seconds
            if not (math.isfinite(value) and value <= MAX_RETENTION):
                problems.append(f"{where}: staging_retention_seconds {value} not a number "
                                f"of seconds up to {MAX_RETENTION:.0f} (0: removed once "
                                "consumed; negative: never)")
    if not math.isfinite(spec.archive_after_seconds):
        problems.append(f"archive_after_seconds {spec.archive_after_seconds} is not a finite "
                        "number (0: the registry's --archive-after; negative: never)")
    owner: dict[str, str] = {}
    for e in spec.entries:
        if e.HasField("priority") and not 0 <= e.priority <= 9:
            problems.append(f"entry {shown(e.file_id)}: priority {e.priority} not within "
                            "0..9")
        if e.parts and e.depends_on:
            problems.append(f"entry {shown(e.file_id)}: an assembly cannot have depends_on")
        for part in dict.fromkeys(e.parts):  # a repeated part is reported above
            if part not in ids or part == e.file_id:
                problems.append(f"entry {shown(e.file_id)}: part {shown(part)} is not another "
                                "entry")
            elif part in owner:
                problems.append(f"entry {shown(part)} is a part of both {shown(owner[part])} "
                                f"and {shown(e.file_id)}")
            else:
                owner[part] = e.file_id
    for e in spec.entries:
        if e.file_id in owner and e.consumers:
            problems.append(f"entry {shown(e.file_id)} is a part of {shown(owner[e.file_id])}: "
                            "parts are consumed as their assembly and take no consumers")
    assemblies = {e.file_id for e in spec.entries if e.parts}
    for part, assembly in owner.items():
        if part in assemblies:
            problems.append(f"entry {shown(part)} is an assembly and a part of "
                            f"{shown(assembly)}")
    all_groups = set(groups) | {g for e in spec.entries for g in e.consumers}
    problems += access.problems(spec.access, all_groups)
    problems += _pool_problems(spec, groups, owner)
    rules = tuple(routing.Rule(r.condition, list(r.groups), dict(r.pools))
                  for r in spec.routing_rules)
    problems += _routing_problems(spec, rules, groups, owner)
    problems += _backlog_problems(spec.backlog_limits, all_groups)
    problems += fairness.problems(spec)
    size = spec.ByteSize()
    if size > MAX_MANIFEST_BYTES:
        problems.append(f"the manifest is {mib(size)} encoded: at most "
                        f"{mib(MAX_MANIFEST_BYTES)}")
    if problems:
        raise InvalidManifest(summary(problems), problems=problems)

    created = now()
    backoff = [b.base_seconds or 1.0, b.factor or 2.0, b.cap_seconds or 60.0]
    aging = spec.aging_seconds or 60.0
    task_priority = spec.priority
    dependents: dict[str, list[str]] = {}
    for e in spec.entries:
        for dep in e.depends_on:
            if ":" not in dep:  # another task's entries learn nothing of this task
                dependents.setdefault(dep, []).append(e.file_id)
    task_retention = (spec.staging_retention_seconds
                      if spec.HasField("staging_retention_seconds") else None)
    entries = [
        EntryRecord(
            task_id=spec.task_id,
            file_id=e.file_id,
            path=e.path,
            # Parts are consumed as their assembly; they have no consumers of their own.
            consumers=[] if e.file_id in owner else (list(e.consumers) or groups),
            depends_on=list(e.depends_on),
            dependents=dependents.get(e.file_id, []),
            parts=list(e.parts),
            assembly=owner.get(e.file_id, ""),
            deps_ok=not (e.depends_on or e.parts),
            max_retries=e.max_retries if e.HasField("max_retries") else task_retries,
            expected_size=e.expected_size,
            expected_digest=e.expected_digest,
            labels=dict(e.labels),
            priority=e.priority if e.HasField("priority") else task_priority,
            backoff=backoff,
            aging=aging,
            created_at=created,
            producers=access.producers_of(spec.access, e.path, e.producers),
            digest_optional=spec.digest_optional,
            routing=bool(rules) and e.file_id not in owner,
            claim_deadline=e.claim_deadline_seconds or spec.claim_deadline_seconds,
            consume_deadline=e.consume_deadline_seconds or spec.consume_deadline_seconds,
            stall_after=e.stall_after_seconds or spec.stall_after_seconds,
            # None: the registry's --staging-retention, filled in at creation
            staging_retention=(e.staging_retention_seconds
                               if e.HasField("staging_retention_seconds") else task_retention),
            pool="" if e.parts else (e.pools.produce or spec.pools.produce),
            consume_pools={g: p for g, p in {**spec.pools.consume, **e.pools.consume}.items()
                           if g in (list(e.consumers) or groups) and e.file_id not in owner},
        )
        for e in spec.entries
    ]
    used = sorted({r.pool for r in entries if r.pool}
                  | {p for r in entries for p in r.consume_pools.values()}
                  | {p for rule in rules for p in rule.pools.values()})
    task_pools: dict[str, object] = {}
    if spec.pools.produce:
        task_pools["produce"] = spec.pools.produce
    if spec.pools.consume:
        task_pools["consume"] = dict(spec.pools.consume)
    fairness.assign(spec, entries)
    digest = hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()
    return ValidTask(spec.task_id, groups, task_retries, dict(spec.labels), entries, digest,
                     task_priority, backoff, aging, access.to_dict(spec.access),
                     spec.digest_optional, rules, task_pools, tuple(used),
                     {g: limit.entries for g, limit in spec.backlog_limits.items()},
                     fairness.weights(spec), spec.fairness.default_key)
