"""Back-pressure between stages: a producer's claim on a task one of whose consumer
groups is at its backlog limit is refused (``Backpressure``).

A group's backlog is what it has still to consume: the entries verified and not yet
taken by it (its ``cready`` index) and those it holds (its consume-claims' durable
twins, ``inflight/c``), plus the task's producer claims in flight (``inflight/p``):
entries being written now will be the group's to consume. All of it is counted in
one etcd request of count-only ranges, at one revision, and only for a task whose
manifest sets ``backlog_limits``: a task without limits costs nothing more.

The count is not part of the claim's guarded transaction: claims checked against the
same count can each pass, so the backlog may go past the limit by as many claims as
were made at once (at most one per producer in flight). Entries committed and not yet
verified are in none of the counted indexes, so a producer that claims again before
the watcher verified its last entry gets that one for free as well. Entries a group
nacked with a delay (``cdelayed``) are not counted until they are due.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from ...kernel.errors import Backpressure
from ...kernel.v1 import baton_pb2 as pb
from .etcd import Etcd
from .keys import Keys


@dataclass(frozen=True)
class GroupBacklog:
    """One limited group's backlog as last counted."""

    group: str
    backlog: int
    limit: int

    @property
    def over(self) -> bool:
        """Whether a producer's claim is refused at this backlog."""
        return self.backlog >= self.limit

    def to_pb(self) -> pb.GroupBacklog:
        return pb.GroupBacklog(group=self.group, backlog=self.backlog, limit=self.limit,
                               over=self.over)


class Backlogs:
    """Counts limited tasks' backlogs for claims (and ``GetTask``, ``explain``, the
    metrics), and keeps the refusals by (task, group) for the metrics."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self.etcd = etcd
        self.keys = keys
        #: producer claims refused, by (task, group)
        self.refusals: Counter[tuple[str, str]] = Counter()

    async def count(self, task_id: str, limits: Mapping[str, int]) -> list[GroupBacklog]:
        """Each limited group's backlog now, in the order of its name: one etcd
        request of ``1 + 2 * groups`` count-only ranges."""
        groups = sorted(limits)
        prefixes = [self.keys.inflight_of_task("p", task_id)]
        for group in groups:
            prefixes += [self.keys.cready_all(task_id, group),
                         self.keys.inflight_of_group(task_id, group)]
        counts = await self.etcd.counts(prefixes)
        producing = counts[0]
        return [GroupBacklog(group, counts[1 + 2 * i] + counts[2 + 2 * i] + producing,
                             limits[group])
                for i, group in enumerate(groups)]

    async def check(self, task_id: str, limits: Mapping[str, int]) -> int | None:
        """Refuse a producer's claim on ``task_id`` while a group is at its limit
        (the group furthest over is named); else how many claims fit under every
        limit (None: no limit). Nothing is read when there are no limits."""
        if not limits:
            return None
        counted = await self.count(task_id, limits)
        over = [b for b in counted if b.over]
        if not over:
            return min(b.limit - b.backlog for b in counted)
        worst = max(over, key=lambda b: b.backlog - b.limit)
        self.refusals[task_id, worst.group] += 1
        raise Backpressure(
            f"task {task_id!r} is back-pressured: consumer group {worst.group!r} has a "
            f"backlog of {worst.backlog} entries (verified and not yet acked, plus "
            f"claims being produced), at or over its limit of {worst.limit}; claims "
            "resume once it consumes", task_id=task_id, group=worst.group,
            backlog=worst.backlog, limit=worst.limit, over=worst.backlog - worst.limit)
