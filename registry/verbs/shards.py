"""Watcher membership and shards: which watcher checks which task's files.

Every watcher registers on its own lease (``watchers/{id}``). Tasks map to a
fixed number of shards (``kernel.contract.shard_of``, fixed in ``shardmap`` when
the first watcher registers); ``shards/{n}`` names the shard's owner and an
epoch that grows at every change of owner. A report is believed only from the
owner at the current epoch (:func:`check_reporter`, inside the report's own
transaction), so two watchers over one shared staging root never race.

Ownership moves in two phases, as a lease handoff between workers: the record
gets ``moving_to`` and a deadline; the owner sees it at its next heartbeat,
stops taking events for the shard, finishes the checks in hand and calls
``ReleaseShard``, which gives the shard to ``moving_to`` at the next epoch. An
owner that does not release by the deadline loses the shard anyway. A dead
owner's shards (its registration expired with its lease) are owned again at
once. Every change is one guarded transaction; replicas race safely.

The :class:`Assigner` sweep keeps every shard owned and the watchers balanced:
it moves shards only when counts differ by more than one, so nothing moves
while load merely jitters, and adding a watcher to ``n`` moves at most
``ceil(S / (n + 1))`` shards (:func:`plan_moves`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ...kernel import logs
from ...kernel.contract import shard_of
from ...kernel.errors import (
    BatonError,
    InvalidArgument,
    NotFound,
    NotShardOwner,
)
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import Caller
from ..records.model import EntryRecord, TaskRecord, now
from ..rules.checks import check_owner, need_entry
from ..rules.core import Core, every, on_change
from ..store.etcd import KV
from ..store.txn import Txn, write

log = logging.getLogger("baton.registry")

#: seconds a watcher has to hand over a shard before it is taken (shard_move_deadline)
MOVE_DEADLINE = 30.0

#: seconds a watcher's registration may outlive its last heartbeat
MIN_TTL, MAX_TTL = 2, 600
#: a watcher using this share of its inotify watches gets no more shards
FULL_WATCHES = 0.95
#: task states whose tasks no watcher serves any more
_FINISHED = ("completed", "cancelled")


@dataclass
class ShardRecord:
    """``shards/{n}``: who owns the shard, at which epoch, and a move in progress."""

    owner: str = ""
    epoch: int = 0
    moving_to: str = ""
    deadline: float = 0.0

    @classmethod
    def load(cls, kv: KV | None) -> ShardRecord:
        if kv is None:
            return cls()
        data = json.loads(kv.value)
        return cls(owner=str(data.get("owner", "")), epoch=int(data.get("epoch", 0)),
                   moving_to=str(data.get("moving_to", "")),
                   deadline=float(data.get("deadline", 0.0)))

    def dump(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    def handed(self, to: str) -> ShardRecord:
        """The record once ``to`` owns the shard (the next epoch, no move pending)."""
        return ShardRecord(owner=to, epoch=self.epoch + 1)


@dataclass
class WatcherRecord:
    """``watchers/{id}``: a registered watcher, leased; ``kv`` as read."""

    watcher_id: str
    kv: KV
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, watcher_id: str, kv: KV) -> WatcherRecord:
        try:
            info = json.loads(kv.value)
        except ValueError:
            info = {}
        return cls(watcher_id, kv, info if isinstance(info, dict) else {})

    @property
    def draining(self) -> bool:
        return bool(self.info.get("draining"))

    @property
    def full(self) -> bool:
        """Near its inotify limit: it keeps its shards and takes no more."""
        cap = self.info.get("capacity") or {}
        used, most = int(cap.get("watches_used", 0)), int(cap.get("watches_max", 0))
        return most > 0 and used >= most * FULL_WATCHES

    @property
    def takes_shards(self) -> bool:
        return not self.draining and not self.full


def plan_moves(owned: Mapping[str, Sequence[tuple[int, int]]],
               receivers: Sequence[str], keepers: Sequence[str] = ()) -> list[
                   tuple[int, str, str]]:
    """The fewest moves that balance shards among ``receivers``: (shard, from, to).

    ``owned`` maps every live watcher to the (shard, epoch) pairs it owns.
    ``receivers`` may gain shards; ``keepers`` (near their limits) keep what they
    own and gain none; every other watcher (draining) gives all of its shards up.
    Receivers end with ``floor`` or ``ceil`` of their fair share, the extra ones
    going to those that already hold the most (sticky), and a donor gives up the
    shards it got most recently last (lowest epoch first).
    """
    if not receivers:
        return []
    keep = {w: len(owned.get(w, ())) for w in keepers}
    total = sum(len(s) for s in owned.values()) - sum(keep.values())
    base, extra = divmod(max(total, 0), len(receivers))
    ranked = sorted(receivers, key=lambda w: (-len(owned.get(w, ())), w))
    target = {w: base + (1 if i < extra else 0) for i, w in enumerate(ranked)}
    target.update(keep)
    surplus: list[tuple[int, str]] = []
    for w, shards in sorted(owned.items()):
        give = len(shards) - target.get(w, 0)
        if give > 0:
            by_age = sorted(shards, key=lambda s: (s[1], s[0]))
            surplus += [(n, w) for n, _ in by_age[:give]]
    moves = []
    for w in ranked:
        need = target[w] - len(owned.get(w, ()))
        while need > 0 and surplus:
            n, donor = surplus.pop(0)
            moves.append((n, donor, w))
            need -= 1
    return moves


def _count_of(kv: KV | None) -> int:
    return int(json.loads(kv.value)["count"]) if kv is not None else 0


async def check_reporter(txn: Txn, keys: Any, task_id: str, watcher_id: str,
                         epoch: int, caller: Caller) -> None:
    """Refuse a report unless it comes from the owner of the task's shard at the
    current epoch, called by the identity that registered that watcher: the shard,
    and the watcher's registration are pinned, so a move racing the report makes the
    report's transaction plan again (and be refused). A watcher id and an epoch are
    not capabilities on their own: another certificate naming them is refused with
    ``PermissionDenied``. Before any watcher has registered there are no shards, and a
    lone watcher reports as it always did."""
    count = _count_of(await txn.get(keys.shardmap()))
    if not count:
        return
    n = shard_of(task_id, count)
    shard = ShardRecord.load(await txn.get(keys.shard(n)))
    if watcher_id and shard.owner == watcher_id:
        # The owner's registration: its identity must be the caller's.
        check_owner(caller, await txn.get(keys.watcher(watcher_id)), f"watcher {watcher_id}")
        if shard.epoch == epoch:
            return
    who = f"watcher {watcher_id} at epoch {epoch}" if watcher_id else "an unregistered watcher"
    owner = f"watcher {shard.owner} at epoch {shard.epoch}" if shard.owner else "nobody yet"
    raise NotShardOwner(f"task {task_id!r} is in shard {n}, owned by {owner}; the report "
                        f"came from {who} and was not believed", shard=n,
                        owner=shard.owner, epoch=shard.epoch)



class WatcherRequest(Protocol):
    """What every watcher's request about one entry names: the entry, and the watcher
    and shard epoch it speaks as."""

    task_id: str
    file_id: str
    watcher_id: str
    shard_epoch: int


async def reported_entry(txn: Txn, keys: Any, req: WatcherRequest, caller: Caller
                         ) -> tuple[KV | None, EntryRecord]:
    """The entry a watcher's request is about (its key-value and record), once
    ``check_reporter`` believed the watcher; ``NotFound`` if there is none."""
    await check_reporter(txn, keys, req.task_id, req.watcher_id, req.shard_epoch, caller)
    kv = await txn.get(keys.entry(req.task_id, req.file_id))
    return kv, need_entry(kv, req.task_id, req.file_id)

class Shards:
    """The calls of watchers (register, heartbeat, release) and of operators."""

    def __init__(self, core: Core, count: int, move_deadline: float = MOVE_DEADLINE) -> None:
        if not 1 <= count <= 4096:
            raise InvalidArgument(f"shards {count} not within 1..4096")
        self.core = core
        self.keys = core.keys
        self.count = count
        self.move_deadline = move_deadline
        #: shards owned again after their owner died, and moves forced at a deadline
        self.reassigned = 0
        self.forced = 0

    # reading -----------------------------------------------------------------------

    async def _scan(self, prefix: bytes, fresh: bool = False) -> list[KV]:
        if self.core.view is not None and not fresh:
            return await self.core.view.scan(prefix, 0, False)
        return [kv async for kv in self.core.etcd.scan(prefix)]

    async def watchers(self, fresh: bool = False) -> dict[str, WatcherRecord]:
        base = self.keys.watchers()
        return {(wid := kv.key[len(base):].decode()): WatcherRecord.load(wid, kv)
                for kv in await self._scan(base, fresh)}

    async def table(self, fresh: bool = False
                    ) -> tuple[int, dict[int, tuple[KV, ShardRecord]]]:
        """The shard count (0: no watcher ever registered) and every shard record (from
        the view; ``fresh``: from etcd, for a caller that must see its own writes)."""
        count_kv = (await self.core.etcd.get(self.keys.shardmap())
                    if self.core.view is None or fresh
                    else (await self.core.view.get_many([self.keys.shardmap()]))[0])
        base = self.keys.shards()
        shards = {int(kv.key[len(base):]): (kv, ShardRecord.load(kv))
                  for kv in await self._scan(base, fresh)}
        return _count_of(count_kv), shards

    async def _watcher(self, watcher_id: str, caller: Caller, txn: Txn | None = None
                       ) -> WatcherRecord:
        if not watcher_id or len(watcher_id) > 64 or "/" in watcher_id:
            raise InvalidArgument(f"not a watcher id: {watcher_id!r}")
        key = self.keys.watcher(watcher_id)
        if txn is not None:
            kv = await txn.get(key)
        elif self.core.view is not None:
            kv = (await self.core.view.get_many([key]))[0] or await self.core.etcd.get(key)
        else:
            kv = await self.core.etcd.get(key)
        if kv is None:
            raise NotFound(f"watcher {watcher_id} is not registered (its lease expired, or "
                           "it never was): register again", watcher_id=watcher_id)
        check_owner(caller, kv, f"watcher {watcher_id}")
        return WatcherRecord.load(watcher_id, kv)

    # watchers' calls ---------------------------------------------------------------

    async def register(self, req: pb.RegisterWatcherRequest,
                       caller: Caller) -> pb.RegisterWatcherResponse:
        ttl = req.ttl or 10
        if not MIN_TTL <= ttl <= MAX_TTL:
            raise InvalidArgument(f"ttl {ttl} not within {MIN_TTL}..{MAX_TTL} seconds")
        await self._replace(req, caller)
        lease, granted = await self.core.etcd.grant(ttl)
        watcher_id = f"{lease:016x}"
        info = {"host": req.host, "pid": req.pid, "root": req.root, "reporter": req.reporter,
                "version": req.version, "ttl": granted, "registered_at": now(),
                "capacity": _capacity(req.capacity), "draining": False}
        if caller.name:
            info["identity"] = caller.name

        async def plan(txn: Txn) -> int:
            count_kv = await txn.get(self.keys.shardmap())
            if count_kv is None:  # the first watcher fixes the deployment's shard count
                txn.put(self.keys.shardmap(), json.dumps({"count": self.count}).encode())
            txn.create(self.keys.watcher(watcher_id), json.dumps(info).encode(), lease=lease)
            return _count_of(count_kv) or self.count

        try:
            count = await write(self.core.txns, plan)
        except Exception:
            with contextlib.suppress(BatonError):
                await self.core.etcd.revoke(lease)
            raise
        if count != self.count:
            log.warning("shards: the deployment has %d shards (fixed when its first watcher "
                        "registered); --shards %d is ignored", count, self.count)
        logs.log(log, logging.INFO, "watcher registered", watcher=watcher_id, host=req.host,
                 root=req.root, ttl=granted)
        # Shards nobody owns (the first watcher, or one replacing a dead one) are its
        # at once, so that it serves from its first reconciliation.
        await self.assign(fresh=True)
        return pb.RegisterWatcherResponse(watcher_id=watcher_id, ttl=granted,
                                          shard_count=count,
                                          shards=await self._grants(watcher_id, fresh=True))

    async def _replace(self, req: pb.RegisterWatcherRequest, caller: Caller) -> None:
        """A restarted watcher names the registration it had (``previous_watcher_id``):
        that one ends now, so the shards it owned are the new registration's at once
        instead of after the old lease's TTL (the assignment that follows registering
        gives shards without a live owner to it). Only the identity that made it may
        end it; one already gone is nothing to end."""
        previous = req.previous_watcher_id
        if not previous:
            return
        if len(previous) > 64 or "/" in previous:
            raise InvalidArgument(f"not a watcher id: {previous!r}")
        kv = await self.core.etcd.get(self.keys.watcher(previous))
        if kv is None:
            return
        check_owner(caller, kv, f"watcher {previous}")
        await self.core.etcd.revoke(kv.lease)
        logs.log(log, logging.INFO, "watcher replaced by its restart", watcher=previous,
                 host=req.host, root=req.root, identity=caller.name or None)

    async def heartbeat(self, req: pb.WatcherHeartbeatRequest,
                        caller: Caller) -> pb.WatcherHeartbeatResponse:
        """Refresh the watcher's lease, record its capacity, and tell it what it owns."""
        record = await self._watcher(req.watcher_id, caller)
        ttl = await self.core.etcd.keepalive(record.kv.lease)
        if ttl <= 0:
            raise NotFound(f"watcher {req.watcher_id}'s lease has expired: register again",
                           watcher_id=req.watcher_id)

        capacity = _capacity(req.capacity)

        async def plan(txn: Txn) -> None:
            kv = await txn.get(record.kv.key)
            if kv is None:
                return
            info = WatcherRecord.load(req.watcher_id, kv).info
            if info.get("capacity") == capacity:
                return
            info["capacity"] = capacity
            txn.put(kv.key, json.dumps(info).encode(), lease=kv.lease)

        # The record is rewritten only when the capacity it holds changed: the lease
        # keeps the registration alive, and a heartbeat of an idle watcher writes
        # nothing (no etcd revision at rest: etcd's compaction then has nothing to do).
        if record.info.get("capacity") != capacity:
            await write(self.core.txns, plan)
        count, _ = await self.table()
        return pb.WatcherHeartbeatResponse(ttl=ttl, shard_count=count,
                                           shards=await self._grants(req.watcher_id),
                                           draining=record.draining)

    async def _grants(self, watcher_id: str, fresh: bool = False) -> list[pb.ShardGrant]:
        """The shards ``watcher_id`` owns, and which of them it is asked to hand over."""
        _, shards = await self.table(fresh)
        return [pb.ShardGrant(shard=n, epoch=rec.epoch, release=bool(rec.moving_to))
                for n, (_, rec) in sorted(shards.items()) if rec.owner == watcher_id]

    async def release(self, req: pb.ReleaseShardRequest,
                      caller: Caller) -> pb.ReleaseShardResponse:
        """The owner hands a shard over: to the watcher it is moving to, if that one
        still takes shards, else to nobody (the assigner picks one at once)."""
        self._check_shard(req.shard)
        await self._watcher(req.watcher_id, caller)
        key = self.keys.shard(req.shard)

        async def plan(txn: Txn) -> ShardRecord:
            rec = ShardRecord.load(await txn.get(key))
            if rec.owner != req.watcher_id or rec.epoch != req.epoch:
                return rec  # released already, or moved on: nothing to hand over
            to = ""
            if rec.moving_to:
                kv = await txn.get(self.keys.watcher(rec.moving_to))
                if kv is not None and WatcherRecord.load(rec.moving_to, kv).takes_shards:
                    to = rec.moving_to
            new = rec.handed(to)
            txn.put(key, new.dump())
            txn.after(lambda: logs.log(log, logging.INFO, "shard released", shard=req.shard,
                                       by=req.watcher_id, to=to or None, epoch=new.epoch))
            return new

        rec = await write(self.core.txns, plan)
        return pb.ReleaseShardResponse(shard=self._info(req.shard, rec, {}, {}, {}))

    # operators' calls --------------------------------------------------------------

    def _check_shard(self, n: int) -> None:
        if not 0 <= n < 4096:
            raise InvalidArgument(f"shard {n} is not a shard number")

    async def list_watchers(self) -> pb.ListWatchersResponse:
        watchers = await self.watchers()
        _, shards = await self.table()
        owned: dict[str, int] = {}
        for _, rec in shards.values():
            owned[rec.owner] = owned.get(rec.owner, 0) + 1
        ttls = await asyncio.gather(*(self.core.etcd.time_to_live(w.kv.lease)
                                      for w in watchers.values()))
        return pb.ListWatchersResponse(watchers=[
            _watcher_info(w, ttl, owned.get(w.watcher_id, 0))
            for w, ttl in zip(watchers.values(), ttls, strict=True)])

    async def list_shards(self) -> pb.ListShardsResponse:
        count, shards = await self.table()
        watchers = await self.watchers()
        tasks: dict[int, int] = {}
        if count:
            for kv in await self._scan(self.keys.tasks()):
                with contextlib.suppress(ValueError, KeyError):
                    task = TaskRecord.load(kv.value)
                    if task.status not in _FINISHED:
                        n = shard_of(task.task_id, count)
                        tasks[n] = tasks.get(n, 0) + 1
        backlog: dict[int, int] = {}
        for n, (_, rec) in shards.items():
            owner = watchers.get(rec.owner)
            if owner is not None:
                per = (owner.info.get("capacity") or {}).get("shard_backlog") or {}
                backlog[n] = int(per.get(str(n), 0))
        hosts = {w.watcher_id: str(w.info.get("host", "")) for w in watchers.values()}
        return pb.ListShardsResponse(shard_count=count, shards=[
            self._info(n, shards[n][1] if n in shards else ShardRecord(), hosts, tasks,
                       backlog) for n in range(count)])

    def _info(self, n: int, rec: ShardRecord, hosts: Mapping[str, str],
              tasks: Mapping[int, int], backlog: Mapping[int, int]) -> pb.ShardInfo:
        return pb.ShardInfo(shard=n, owner=rec.owner, host=hosts.get(rec.owner, ""),
                            epoch=rec.epoch, moving_to=rec.moving_to,
                            move_deadline=rec.deadline, tasks=tasks.get(n, 0),
                            backlog=backlog.get(n, 0))

    async def move(self, req: pb.MoveShardRequest, caller: Caller) -> pb.ShardInfo:
        """Start moving one shard to a watcher (two-phase; at once if nobody owns it)."""
        count, _ = await self.table(fresh=True)
        if not count:
            raise NotFound("no watcher has registered yet: there are no shards")
        if not 0 <= req.shard < count:
            raise InvalidArgument(f"shard {req.shard} not within 0..{count - 1}")
        if req.deadline < 0:
            raise InvalidArgument(f"deadline {req.deadline} must be ≥ 0 seconds")
        deadline = req.deadline or self.move_deadline
        to = await self._target(req.to_watcher)
        rec = await self._start_move(req.shard, to, deadline, by=caller.name or "operator",
                                     why={"reason": req.reason, "evidence": req.evidence})
        hosts = {w.watcher_id: str(w.info.get("host", "")) for w in
                 (await self.watchers()).values()}
        return self._info(req.shard, rec, hosts, {}, {})

    async def _target(self, watcher_id: str) -> str:
        watchers = await self.watchers(fresh=True)
        target = watchers.get(watcher_id)
        if target is None:
            raise NotFound(f"watcher {watcher_id!r} is not registered", watcher_id=watcher_id)
        if target.draining:
            raise InvalidArgument(f"watcher {watcher_id} is draining: it takes no shards")
        return watcher_id

    async def _start_move(self, n: int, to: str, deadline: float,
                          by: str = "assigner",
                          why: dict[str, str] | None = None) -> ShardRecord:
        """Start moving shard ``n`` to watcher ``to``; ``by``: the operator who asked, or
        the assigner; ``why``: the operator's reason and evidence, logged with the move."""
        key = self.keys.shard(n)

        async def plan(txn: Txn) -> ShardRecord:
            kv, target = await txn.get_many([key, self.keys.watcher(to)])
            if target is None:
                raise NotFound(f"watcher {to!r} is not registered", watcher_id=to)
            rec = ShardRecord.load(kv)
            if rec.owner == to:
                if rec.moving_to:  # moving back to its owner: the move is called off
                    rec.moving_to, rec.deadline = "", 0.0
                    txn.put(key, rec.dump())
                return rec
            owner_kv = await txn.get(self.keys.watcher(rec.owner)) if rec.owner else None
            if owner_kv is None:  # nobody holds it: no handoff to wait for
                new = rec.handed(to)
            else:
                new = ShardRecord(rec.owner, rec.epoch, to, self.core.clock() + deadline)
            txn.put(key, new.dump())
            txn.after(lambda: logs.log(
                log, logging.INFO, "shard move started" if new.moving_to else "shard owned",
                shard=n, owner=new.owner, to=to, epoch=new.epoch,
                by=by, **{k: v for k, v in (why or {}).items() if v}))
            return new

        return await write(self.core.txns, plan)

    async def rebalance(self, req: pb.RebalanceRequest, caller: Caller) -> pb.RebalanceResponse:
        moves = await self.balance_moves(fresh=True)
        if not req.dry_run:
            for n, _, to in moves:
                await self._start_move(n, to, self.move_deadline, by=caller.name or "operator")
        return pb.RebalanceResponse(moves=[pb.ShardMove(shard=n, from_watcher=a, to_watcher=b)
                                           for n, a, b in moves])

    async def balance_moves(self, fresh: bool = False) -> list[tuple[int, str, str]]:
        """The moves that would balance the shards now (none while a move runs)."""
        count, shards = await self.table(fresh)
        watchers = await self.watchers(fresh)
        if not count or any(rec.moving_to for _, rec in shards.values()):
            return []
        owned: dict[str, list[tuple[int, int]]] = {w: [] for w in watchers}
        for n, (_, rec) in shards.items():
            if rec.owner in owned:
                owned[rec.owner].append((n, rec.epoch))
        receivers = [w for w, r in watchers.items() if r.takes_shards]
        keepers = [w for w, r in watchers.items() if r.full and not r.draining]
        return plan_moves(owned, receivers, keepers)

    async def drain(self, req: pb.DrainWatcherRequest, caller: Caller) -> pb.DrainWatcherResponse:
        """Mark a watcher draining (its shards move away; it takes none), or undo it."""
        key = self.keys.watcher(req.watcher_id)

        async def plan(txn: Txn) -> WatcherRecord:
            kv = await txn.get(key)
            if kv is None:
                raise NotFound(f"watcher {req.watcher_id!r} is not registered",
                               watcher_id=req.watcher_id)
            record = WatcherRecord.load(req.watcher_id, kv)
            if record.draining != (not req.undo):
                record.info["draining"] = not req.undo
                txn.put(key, json.dumps(record.info).encode(), lease=kv.lease)
            return record

        record = await write(self.core.txns, plan)
        moves = await self.balance_moves(fresh=True)
        for n, _, to in moves:
            await self._start_move(n, to, self.move_deadline)
        _, shards = await self.table(fresh=True)
        if not req.undo:
            # Every move under way away from it: those started here, and those the
            # assigner started on seeing the drain first (then none are started here).
            moves = [(n, rec.owner, rec.moving_to) for n, (_, rec) in sorted(shards.items())
                     if rec.owner == req.watcher_id and rec.moving_to]
        logs.log(log, logging.INFO, "watcher undrained" if req.undo else "watcher draining",
                 watcher=req.watcher_id, moves=len(moves), by=caller.name or "operator")
        ttl = await self.core.etcd.time_to_live(record.kv.lease)
        owned = sum(1 for _, rec in shards.values() if rec.owner == req.watcher_id)
        return pb.DrainWatcherResponse(
            watcher=_watcher_info(record, ttl, owned),
            moves=[pb.ShardMove(shard=n, from_watcher=a, to_watcher=b) for n, a, b in moves])


    async def assign(self, fresh: bool = False) -> float:
        """Keep every shard owned by a live watcher and the watchers balanced.

        A shard whose owner is gone is owned again at once (by the watcher owning
        fewest); a move whose target left is called off; a move past its deadline is
        forced; then, with no move in flight, a rebalance starts if the counts differ
        by more than one. ``fresh``: read etcd, not the view (which may lag). Returns
        the earliest deadline of a move left in flight (inf: none).
        """
        count, shards = await self.table(fresh)
        if not count:
            return math.inf
        watchers = await self.watchers(fresh)
        takers = [w for w, r in watchers.items() if r.takes_shards]
        load = {w: 0 for w in takers}
        for _, rec in shards.values():
            for w in (rec.owner, rec.moving_to):
                if w in load:
                    load[w] += 1
        clock = self.core.clock()
        for n in range(count):
            kv, rec = shards.get(n, (None, ShardRecord()))
            if rec.owner not in watchers:
                if takers:
                    to = min(takers, key=lambda w: (load[w], w))
                    event = "shard owned again" if rec.owner else "shard owned"
                    if await self._set(n, kv, rec.handed(to), event, was=rec.owner or None):
                        load[to] += 1
                        self.reassigned += 1
            elif rec.moving_to and (rec.moving_to not in watchers
                                    or not watchers[rec.moving_to].takes_shards):
                await self._set(n, kv, ShardRecord(rec.owner, rec.epoch),
                                "shard move called off", to=rec.moving_to)
            elif rec.moving_to and clock > rec.deadline and await self._set(
                    n, kv, rec.handed(rec.moving_to), "shard move forced", was=rec.owner,
                    level=logging.WARNING):
                self.forced += 1
        for n, _, to in await self.balance_moves(fresh):
            await self._start_move(n, to, self.move_deadline)
        # (a move started or ended just now changed a shard: the view tells the assigner)
        return min((rec.deadline for _, rec in shards.values() if rec.moving_to),
                   default=math.inf)

    async def _set(self, n: int, kv: KV | None, new: ShardRecord, event: str,
                   level: int = logging.INFO, **details: Any) -> bool:
        """Write a shard's record if it is still as read; False if it changed."""
        key = self.keys.shard(n)

        async def plan(txn: Txn) -> bool:
            now_kv = await txn.get(key)
            if (now_kv.mod_revision if now_kv else 0) != (kv.mod_revision if kv else 0):
                return False
            if new.owner and await txn.get(self.keys.watcher(new.owner)) is None:
                return False  # gone meanwhile: the next sweep picks another
            txn.put(key, new.dump())
            txn.after(lambda: logs.log(log, level, event, shard=n, owner=new.owner or None,
                                       epoch=new.epoch, **details))
            return True

        return await write(self.core.txns, plan, fresh=True)


class Assigner:
    """Runs :meth:`Shards.assign` on every replica (their guarded transactions race
    safely): when the view's watchers, shards or shard map change, and when a move in
    flight reaches its deadline; at most once per ``interval`` seconds. An idle
    deployment's assigner does nothing (it reads only the view in any case). Without a
    view, every ``interval`` seconds."""

    def __init__(self, shards: Shards, interval: float = 0.5) -> None:
        self.shards = shards
        self.interval = interval
        #: times it ran (for tests)
        self.runs = 0

    async def run(self, stop: asyncio.Event) -> None:
        view = self.shards.core.view
        if view is None:
            await every(self.interval, stop, self._assign, "shard assigner")
            return
        changed = asyncio.Event()
        keys = self.shards.keys
        for prefix in (keys.watchers(), keys.shards(), keys.shardmap()):
            view.listen(prefix, changed.set)
        await on_change(changed, self._assign, self.shards.core.clock, self.interval, stop,
                        "shard assigner")

    async def _assign(self) -> float:
        self.runs += 1
        return await self.shards.assign()


def _capacity(cap: pb.WatcherCapacity) -> dict[str, Any]:
    return {"watches_used": cap.watches_used, "watches_max": cap.watches_max,
            "hash_mbps": round(cap.hash_mbps, 2), "backlog": cap.backlog, "tasks": cap.tasks,
            "cold_tasks": cap.cold_tasks,
            "shard_backlog": {str(k): v for k, v in cap.shard_backlog.items() if v}}


def _watcher_info(w: WatcherRecord, ttl: int, shards: int) -> pb.WatcherInfo:
    info, cap = w.info, w.info.get("capacity") or {}
    return pb.WatcherInfo(
        watcher_id=w.watcher_id, host=str(info.get("host", "")), pid=int(info.get("pid", 0)),
        root=str(info.get("root", "")), reporter=str(info.get("reporter", "")),
        identity=str(info.get("identity", "")), ttl_left=max(ttl, 0),
        capacity=pb.WatcherCapacity(
            watches_used=int(cap.get("watches_used", 0)),
            watches_max=int(cap.get("watches_max", 0)),
            hash_mbps=float(cap.get("hash_mbps", 0.0)), backlog=int(cap.get("backlog", 0)),
            tasks=int(cap.get("tasks", 0)), cold_tasks=int(cap.get("cold_tasks", 0)),
            shard_backlog={int(k): int(v) for k, v in (cap.get("shard_backlog") or {}).items()}),
        shards=shards, draining=w.draining, registered_at=str(info.get("registered_at", "")))


def moves_bound(shards: int, watchers: int) -> int:
    """The most shards adding one watcher to ``watchers`` may move (docs, tests)."""
    return math.ceil(shards / (watchers + 1))
