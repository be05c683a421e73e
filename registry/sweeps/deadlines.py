"""Processing deadlines: a claim held too long is taken away.

A lease proves an agent's keepalive runs, not that its work moves: a hung agent
whose keepalive thread lives would hold its claim for ever. An entry may carry a
``claim_deadline`` (seconds from a producer's claim to its commit) and a
``consume_deadline`` (from a consume to its ack), from its manifest or its task's.

The transaction that makes such a claim also writes ``deadlines/{due}/{claim}``
(``Core.arm_deadline``)
with ``due`` in epoch milliseconds, so the keys sort by it; the key therefore has the
claim's create revision, its token. Nothing else deletes these keys: a commit,
an ack or a reaped lease leaves its deadline key behind, and the sweep, when the
key falls due, finds the claim gone (or another claim, of another revision) and
deletes the key alone. A claim still there at its due time is revoked in one
guarded transaction, as the reaper moves a lost one on: the producer's entry
takes the retry path (journal event ``deadline``), a consumer's entry goes back to
its group; claim, twin, slot and deadline key go together, so the holder's token
dies and its commit or ack is refused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from ...kernel import logs
from ..records.model import EntryRecord
from ..rules.checks import actor_of, claim_holder, voided
from ..rules.claim import take_back
from ..rules.core import Core, Gate
from ..rules.sweeping import Alarm, Complaints, Dues, SweepWatch, follow_due, swept_due
from ..store.etcd import KV
from ..store.txn import Txn, write

log = logging.getLogger("baton.registry")

#: keys read per request while looking for deadline (or stall) keys due
PAGE = 1000
#: due keys handled at once (each its own guarded transaction)
PARALLEL = 32


async def sweep_due(core: Core, prefix: bytes, parse: Callable[[bytes], tuple[int, object]],
                    handle: Callable[[KV], Awaitable[bool]], complain: Complaints) -> int:
    """Hand ``handle`` every key under ``prefix`` (``{due}/…``, due in epoch ms, as
    ``parse`` reads it) that has fallen due, ``PARALLEL`` at a time, each on its own;
    how many it said it acted on. Keys sort by due time: the listing's range ends at now,
    so etcd reads (and walks) only the keys due; with nothing due, one request of no key,
    however many claims have a deadline ahead. One bad key never stops the others: its
    error is complained of."""
    now_ms = int(core.clock() * 1000)
    gate = Gate(PARALLEL)
    done = 0

    async def one(kv: KV) -> None:
        nonlocal done
        try:
            if await handle(kv):
                done += 1
        except Exception as e:
            complain(kv.key.decode(errors="replace"), e)

    pages = core.etcd.scan(prefix, page=PAGE, keys_only=True,
                           end=core.keys.due_until(prefix, now_ms))
    async with contextlib.aclosing(pages):
        async for kv in pages:
            try:
                due, _ = parse(kv.key)
            except ValueError as e:
                complain(kv.key.decode(errors="replace"), e)
                continue
            if due > now_ms:
                break
            await gate.submit(one(kv))
    await gate.drain()
    return done


class Deadlines:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys
        #: claims this replica took away at their deadline (for metrics)
        self.expired = 0
        self._complain = Complaints("deadlines")
        #: when its next key is due, as far as the elected replica knows
        self.dues = Dues()

    def follow(self, watch: SweepWatch) -> Alarm:
        """Follow the keys put under ``deadlines/`` on the leader's watch; its sweeps' alarm."""
        return follow_due(watch, self.keys.deadlines(), self.dues)

    async def woken(self, whole: bool) -> int:
        """The elected replica's sweep, when a key is due (a full look is the same)."""
        return await swept_due(self.core, self.keys.deadlines(), self.dues, self.sweep)

    async def sweep(self) -> int:
        """Revoke every claim whose deadline has passed; forget deadlines of claims
        that ended."""
        taken = await sweep_due(self.core, self.keys.deadlines(), self.keys.parse_deadline,
                                self._expire, self._complain)
        self.expired += taken
        return taken

    async def _expire(self, deadline: KV) -> bool:
        _, ref = self.keys.parse_deadline(deadline.key)
        claim_key, twin_key = self.keys.claim(ref), self.keys.inflight(ref)
        entry_key = self.keys.entry(ref.task_id, ref.file_id)

        async def plan(txn: Txn) -> bool:
            kv, claim, _twin = await txn.get_many([deadline.key, claim_key, twin_key])
            if kv is None:
                return False  # another replica got there first
            txn.delete(deadline.key)
            if claim is None or claim.create_revision != kv.create_revision:
                return False  # that claim ended (committed, acked, reaped): just forget it
            token = claim.create_revision
            holder = claim_holder(claim) or "?"
            entry, task = await txn.get_many([entry_key, self.keys.task(ref.task_id)])
            rec = EntryRecord.load(entry.value) if entry is not None else None
            reason = "" if rec is None else (
                f"claim deadline: no commit within {rec.claim_deadline:g} s of "
                f"the claim by {holder} (token {token})" if ref.kind == "p" else
                f"consume deadline: no ack within {rec.consume_deadline:g} s")
            take_back(self.core, txn, ref, claim, rec, cancelled=voided(task), guard=True,
                      actor=actor_of(claim), reason=reason, spend=True, event="deadline",
                      details={"reason": reason} if ref.kind == "c" else None)
            txn.after(lambda: logs.log(
                log, logging.WARNING, "claim taken away at its deadline", task=ref.task_id,
                file_id=ref.file_id, revision=txn.revision, kind=ref.kind,
                group=ref.group or None, token=token, agent=holder))
            return True

        return await write(self.core.txns, plan)
