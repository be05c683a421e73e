"""Concurrency pools: a limit on claims across agents and tasks, per protected resource.

A pool is a definition ``pools/{name}`` (its limit) and one key per unit held,
``poolunits/{name}/{n}`` with ``n`` below the limit. A claim (or consume) of an entry
that names a pool creates a free unit's key in its own transaction, create-only, so
two claims can never hold one unit and at no instant are more units held than the
limit allows. The claim's value (and its twin's) names the unit; every path that ends
a claim frees it in the same transaction (``claim.end``), so a unit comes back on
commit, fail, ack, nack, revoke, deadline, stall and, through the reaper, session
death. Units are not leased: a dead agent's unit is held until the reaper gives its
claim back, as the journal shows.

No key is hot: the definition is read from the replica's view (it mirrors pools and
units), never written by a claim, and each claim writes the one unit key it took,
chosen at random among the free ones (and among those not reserved by a planner of
the same replica in flight).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...kernel.errors import InvalidArgument, NotFound, NothingToClaim
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import Caller
from ..records.manifest import check_pool_name
from ..records.model import EntryRecord, TaskRecord, now
from ..store.etcd import KV
from ..store.keys import ClaimRef, Keys
from ..store.txn import Txn, write

if TYPE_CHECKING:
    from .core import Core

log = logging.getLogger("baton.registry")

#: the most units a pool may have
MAX_LIMIT = 10_000
#: entries read per request when counting those waiting for a pool
PAGE_ENTRIES = 256


@dataclass
class _Pool:
    """One pool as a planner sees it: its limit (0: not defined) and its units held."""

    limit: int
    held: dict[int, KV]
    #: units this transaction took
    taken: set[int] = field(default_factory=set)


class Pools:
    """The pools a transaction being planned takes units of (one per planner)."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self._pools: dict[str, _Pool] = {}

    async def load(self, txn: Txn, name: str) -> _Pool:
        pool = self._pools.get(name)
        if pool is None:
            (kv,) = await txn.peek_many([self.keys.pool(name)])
            limit = int(json.loads(kv.value).get("limit", 0)) if kv is not None else 0
            held = {}
            for unit in await txn.scan(self.keys.pool_units(name)):
                held[self.keys.unit_number(unit.key)] = unit
            pool = self._pools[name] = _Pool(limit, held)
        return pool

    def _free(self, txn: Txn, name: str, pool: _Pool) -> list[tuple[int, KV | None]]:
        """Units a claim of this transaction may take: below the limit, not held (or
        freed by this very transaction, as a fused commit-and-claim frees its own),
        not taken by this transaction already; none while as many as the limit are
        held (a lowered limit: units above it are still held)."""
        freed = {n: kv for n, kv in pool.held.items() if txn.deletes(kv.key)}
        in_use = len(pool.held) - len(freed) + len(pool.taken)
        if in_use >= pool.limit:
            return []
        return [(n, freed.get(n)) for n in range(pool.limit)
                if n not in pool.taken and (n not in pool.held or n in freed)]

    async def room(self, txn: Txn, name: str, more: int = 0) -> bool:
        """Whether one more claim of this transaction could take a unit of ``name`` now,
        ``more`` claims of it taking one first."""
        pool = await self.load(txn, name)
        return len(self._free(txn, name, pool)) > more

    async def nothing(self, txn: Txn, task_id: str, passed: dict[str, int]) -> NothingToClaim:
        """Why nothing was picked: entries were passed over, ``passed`` per pool."""
        said = []
        for name, n in sorted(passed.items()):
            pool = await self.load(txn, name)
            said.append(f"{n} passed over: {full(name, pool.limit, len(pool.held))}")
        first = min(passed)
        pool = await self.load(txn, first)
        return NothingToClaim(f"nothing to claim in task {task_id!r} now: "
                              + "; ".join(said), task_id=task_id, pool=first,
                              limit=pool.limit, in_use=len(pool.held))

    async def take(self, txn: Txn, name: str, ref: ClaimRef, holder: dict[str, Any],
                   rng: random.Random, reserve: Any = None) -> int:
        """Write a free unit of ``name`` into the transaction for the claim ``ref``:
        its number. ``NothingToClaim`` naming the pool when none is free. ``reserve``:
        the view's reservation of a key for this planner (None: no view)."""
        pool = await self.load(txn, name)
        free = self._free(txn, name, pool)
        rng.shuffle(free)
        for n, freed in free:
            key = self.keys.pool_unit(name, n)
            if reserve is not None and not reserve(txn, key):
                continue  # another planner of this replica is taking it
            value = json.dumps({**holder, "kind": ref.kind, "task": ref.task_id,
                                "file": ref.file_id, "group": ref.group}).encode()
            if freed is not None:  # freed by this transaction: taken again, guarded
                txn.pin(key, freed)
                txn.put(key, value)
            else:
                txn.create(key, value)
            pool.taken.add(n)
            return n
        raise NothingToClaim(full(name, pool.limit, len(pool.held)), pool=name,
                             limit=pool.limit)


def full(name: str, limit: int, in_use: int) -> str:
    if limit <= 0:
        return (f"pool {name!r} is not defined (`baton pool set {name} --limit N`): its "
                "entries wait")
    return f"pool {name!r} is at its limit ({in_use} of {limit} units held)"


# the operators' calls --------------------------------------------------------------

def check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument(f"a pool's limit is 1..{MAX_LIMIT}, not {limit}", field="limit")


def pool_info(name: str, definition: KV | None, units: list[KV], waiting: int = 0
              ) -> pb.PoolInfo:
    data = json.loads(definition.value) if definition is not None else {}
    holders = []
    for unit in units:
        try:
            v = json.loads(unit.value)
        except ValueError:
            v = {}
        holders.append(pb.PoolHolder(
            task_id=str(v.get("task", "")), file_id=str(v.get("file", "")),
            group=str(v.get("group", "")), agent=str(v.get("agent", "")),
            session_id=int(v.get("session", 0) or 0), token=unit.mod_revision,
            unit=Keys.unit_number(unit.key)))
    return pb.PoolInfo(name=name, limit=int(data.get("limit", 0)), in_use=len(units),
                       waiting=waiting, holders=holders,
                       updated_at=str(data.get("updated_at", "")))


def not_defined(name: str) -> NotFound:
    return NotFound(f"no pool {name!r} (`baton pool ls` lists them)", pool=name)



class PoolAdmin:
    """What operators do with pools (define, change, list, remove) and the repair that
    frees a unit whose claim is gone without giving it back: a safety net, as every
    path that ends a claim (cancel and task removal included) frees its unit in the
    same transaction (``claim.end``)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys
        #: units freed by the repair (``baton_pool_units_repaired_total``: 0 unless a
        #: path ended a claim without its unit)
        self.repaired = 0

    async def define(self, req: pb.SetPoolRequest, caller: Caller) -> pb.PoolInfo:
        check_pool_name(req.name)
        check_limit(req.limit)
        key = self.keys.pool(req.name)

        async def plan(txn: Txn) -> None:
            await txn.get(key)
            txn.put(key, json.dumps({"limit": req.limit, "updated_at": now(),
                                     "by": caller.name, "reason": req.reason,
                                     "evidence": req.evidence}).encode())

        await write(self.core.txns, plan, fresh=True)
        log.info("pool %s: limit %d, set by %s (%s)", req.name, req.limit, caller.name,
                 req.reason or "no reason given")
        (info,) = await self.listed([req.name])
        return info

    async def delete(self, req: pb.DeletePoolRequest, caller: Caller) -> bool:
        check_pool_name(req.name)
        key = self.keys.pool(req.name)

        async def plan(txn: Txn) -> bool:
            if await txn.get(key) is None:
                return False
            txn.delete(key)
            return True

        deleted = await write(self.core.txns, plan, fresh=True)
        if deleted:
            log.info("pool %s removed by %s (%s)", req.name, caller.name,
                     req.reason or "no reason given")
        return deleted

    async def listed(self, names: list[str] | None = None) -> list[pb.PoolInfo]:
        """Every pool defined or with units held (or those ``names``), with the claims
        holding its units and how many claimable entries wait for one."""
        etcd = self.core.etcd
        defs = {self.keys.last_segment(kv.key): kv
                async for kv in etcd.scan(self.keys.pools())}
        units: dict[str, list[KV]] = {}
        base = self.keys.pool_units_all()
        async for kv in etcd.scan(base):
            name = kv.key[len(base):].split(b"/", 1)[0].decode()
            units.setdefault(name, []).append(kv)
        wanted = sorted(set(defs) | set(units)) if names is None else names
        waiting = await self.waiting(set(wanted))
        return [pool_info(n, defs.get(n), units.get(n, []), waiting.get(n, 0))
                for n in wanted]

    async def waiting(self, names: set[str]) -> dict[str, int]:
        """Claimable entries (ready to produce, or verified for a group) needing a unit
        of each pool of ``names``, in the tasks that name them: their index keys read
        a page at a time, their entries too."""
        out: dict[str, int] = {}
        etcd = self.core.etcd
        async for kv in etcd.scan(self.keys.tasks()):
            task = TaskRecord.load(kv.value)
            if task.status not in ("active", "paused") or not names & set(task.pools_used):
                continue
            indexes: list[tuple[bytes, str]] = [(self.keys.ready_all(task.task_id), "")]
            indexes += [(self.keys.cready_all(task.task_id, g), g) for g in task.consumers]
            for prefix, group in indexes:
                page: list[bytes] = []
                async for ix in etcd.scan(prefix, keys_only=True):
                    page.append(self.keys.entry(task.task_id, self.keys.last_segment(ix.key)))
                    if len(page) >= PAGE_ENTRIES:
                        await self._count(page, group, names, out)
                        page = []
                if page:
                    await self._count(page, group, names, out)
        return out

    async def _count(self, keys: list[bytes], group: str, names: set[str],
                     out: dict[str, int]) -> None:
        async for _rev, found in self.core.etcd.get_chunks(keys):
            for _key, kv in found:
                if kv is not None:
                    self._one(kv, group, names, out)

    @staticmethod
    def _one(kv: KV, group: str, names: set[str], out: dict[str, int]) -> None:
        rec = EntryRecord.load(kv.value)
        pool = rec.consume_pool(group) if group else rec.pool
        if pool in names:
            out[pool] = out.get(pool, 0) + 1

    async def repair(self) -> int:
        """Free every unit whose claim is gone: its twin deleted (or another claim's)
        without the unit, which no path does (each ends a claim through ``claim.end``):
        what this frees is counted and logged as a leak. Each in a transaction guarded
        on the unit and the twin as read."""
        freed = 0
        base = self.keys.pool_units_all()
        view = self.core.view
        if view is not None and view.ready and not await view.scan(base, 1, True):
            return 0  # no unit is held (the view mirrors them): nothing to read
        units = [kv async for kv in self.core.etcd.scan(base)]
        twins: list[bytes] = []
        for unit in units:
            try:
                v = json.loads(unit.value)
                ref = ClaimRef(str(v["kind"]), str(v["task"]), str(v["file"]),
                               str(v.get("group", "")))
                twins.append(self.keys.inflight(ref))
            except (ValueError, KeyError, TypeError):
                twins.append(b"")
        found: dict[bytes, KV | None] = {}
        async for _rev, chunk in self.core.etcd.get_chunks([t for t in twins if t]):
            found.update(chunk)
        for unit, twin_key in zip(units, twins, strict=True):
            twin = found.get(twin_key)
            if twin is not None and twin.create_revision == unit.mod_revision:
                continue  # its claim holds it (the common case: one read for all)

            async def plan(txn: Txn, unit: KV = unit, twin_key: bytes = twin_key) -> bool:
                now_unit = await txn.get(unit.key)
                if now_unit is None or now_unit.mod_revision != unit.mod_revision:
                    return False  # given back (or taken again) meanwhile
                if twin_key:
                    twin = await txn.get(twin_key)
                    if twin is not None and twin.create_revision == unit.mod_revision:
                        return False  # its claim holds it
                txn.delete(unit.key)
                return True

            if await write(self.core.txns, plan, fresh=True):
                freed += 1
                log.warning("pool unit %s freed: its claim (twin %s) is gone",
                            unit.key.decode(errors="replace"),
                            twin_key.decode(errors="replace"))
        self.repaired += freed
        return freed
