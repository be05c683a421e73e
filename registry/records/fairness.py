"""Fair shares: a task's fairness keys, their weights, and each entry's virtual time.

A task may declare fairness keys (tenants, suppliers), each with a weight; each of
its entries names one (or gets the task's default). Among claimable entries of equal
priority, claims then take the keys in proportion to their weights instead of
draining one key first. The order is start-time fair queuing, built once, when the
task is created: the i-th entry of key k (counted per priority, in manifest order)
gets the virtual time i / w_k, and the ready index sorts by (aged enqueue time,
virtual time, file id) (``Core._index_for``). The entries of one task are created
together and share their enqueue time, so their keys interleave by weight. Nothing
is counted at claim time: the virtual time is on the entry record, and a claim
reads the head of the index as it always does.

A key with nothing claimable takes nothing from the others: nothing is reserved for
it, the next entries of the other keys are simply next. A retried entry re-enters
with a later enqueue time and its virtual time unchanged: it goes behind the work
enqueued before it, as without fairness.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ...kernel.contract import ID_PATTERN
from ...kernel.errors import shown
from ...kernel.v1 import baton_pb2 as pb
from .model import EntryRecord

#: fairness keys a task may declare (each one a label value of a metric)
MAX_KEYS = 256
#: the largest weight of a key (the smallest is 1)
MAX_WEIGHT = 1000
#: virtual time units per claim of a key of weight 1: i / w is kept as i * SCALE // w
#: (integers: the index key sorts as text)
SCALE = 1_000_000
# An index key has 13 digits of virtual time (keys.ready_fair): MAX_ENTRIES
# (100,000) * SCALE fits.

_ID_RE = re.compile(ID_PATTERN)


def declared(spec: pb.TaskSpec) -> bool:
    """Whether the manifest asks for fair shares."""
    return spec.HasField("fairness")


def problems(spec: pb.TaskSpec) -> list[str]:
    """What is wrong with the manifest's ``fairness`` and its entries' ``fairness_key``:
    keys declared (1..``MAX_KEYS``, valid ids, weights 1..``MAX_WEIGHT``), the default
    one of them, each entry's key declared (or a default to fall back on)."""
    if not declared(spec):
        named = [e.file_id for e in spec.entries if e.fairness_key]
        if not named:
            return []
        more = f" (and {len(named) - 1} more)" if len(named) > 1 else ""
        return [f"entry {shown(named[0])}: fairness_key given, but the task declares no "
                f"fairness keys (fairness.keys){more}"]
    fair = spec.fairness
    out: list[str] = []
    if not fair.keys:
        out.append("fairness.keys: declare at least one key (a tenant, a supplier) "
                   "with its weight")
    if len(fair.keys) > MAX_KEYS:
        out.append(f"fairness.keys: {len(fair.keys)} keys, at most {MAX_KEYS}")
    for name, key in sorted(fair.keys.items()):
        if not _ID_RE.match(name):
            out.append(f"fairness.keys: key {shown(name)} is not a valid id "
                       f"({_ID_RE.pattern})")
        if not 1 <= key.weight <= MAX_WEIGHT:
            out.append(f"fairness.keys[{shown(name)}].weight {key.weight} not within "
                       f"1..{MAX_WEIGHT}")
    if fair.default_key and fair.default_key not in fair.keys:
        out.append(f"fairness.default_key {shown(fair.default_key)} is not a declared key")
    undeclared = [(e.file_id, e.fairness_key) for e in spec.entries
                  if e.fairness_key and e.fairness_key not in fair.keys]
    if undeclared:
        file_id, name = undeclared[0]
        more = f" (and {len(undeclared) - 1} more)" if len(undeclared) > 1 else ""
        out.append(f"entry {shown(file_id)}: fairness_key {shown(name)} is not declared in "
                   f"fairness.keys{more}")
    if not fair.default_key:
        keyless = [e.file_id for e in spec.entries if not e.fairness_key]
        if keyless:
            more = f" (and {len(keyless) - 1} more)" if len(keyless) > 1 else ""
            out.append(f"entry {shown(keyless[0])}: no fairness_key, and the task has no "
                       f"fairness.default_key{more}")
    return out


def weights(spec: pb.TaskSpec) -> dict[str, int]:
    """The declared keys and their weights (empty: the task has no fair shares)."""
    return {name: key.weight for name, key in spec.fairness.keys.items()}


def assign(spec: pb.TaskSpec, records: Iterable[EntryRecord]) -> None:
    """Give each entry record (in manifest order, as ``spec.entries``) its fairness key
    and virtual time: the i-th entry of a key, among those of its priority, gets
    i / weight. A manifest that passed ``problems``."""
    if not declared(spec):
        return
    weight = weights(spec)
    default = spec.fairness.default_key
    counts: dict[tuple[str, int], int] = {}
    for e, rec in zip(spec.entries, records, strict=True):
        key = e.fairness_key or default
        i = counts.get((key, rec.priority), 0)
        counts[(key, rec.priority)] = i + 1
        rec.fairness_key = key
        rec.fair_time = i * SCALE // weight[key]
