"""Stalls: an attempt that stopped checkpointing is taken back, as at a deadline.

An entry may carry ``stall_after`` (the manifest's ``stall_after_seconds``, the
entry's or its task's): an attempt, its session alive, that goes that long without a
checkpoint (counting from its claim or consume until the first) is stalled. The
transaction making such a claim writes ``stalls/{due}/{claim}`` (``Core.arm_stall``;
``due`` in epoch milliseconds, so the keys sort by it); a checkpoint does not touch
it, so checkpoints stay one small transaction each. When the key falls due, the sweep
reads it with the claim and the claim's checkpoint in one guarded transaction:

- the claim ended (or another claim took its place): the key is deleted alone;
- the claim checkpointed less than ``after`` seconds ago: the key is put again at
  that checkpoint's time plus ``after``, naming the token;
- otherwise the claim is revoked as ``deadlines.Deadlines`` revokes one: claim, twin,
  slot and key go together (the token dies), a producer's entry takes the retry path
  (journal ``stalled``), a consumer's goes back to its group.
"""

from __future__ import annotations

import json
import logging

from ...kernel import logs
from ..records.model import EntryRecord
from ..rules.checks import actor_of, claim_holder, voided
from ..rules.claim import take_back
from ..rules.core import Core
from ..rules.sweeping import Alarm, Complaints, Dues, SweepWatch, follow_due, swept_due
from ..store.etcd import KV
from ..store.txn import Txn, write
from ..verbs.checkpoints import CheckpointRecord
from .deadlines import sweep_due

log = logging.getLogger("baton.registry")


class Stalls:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys
        #: claims this replica took back as stalled (for metrics)
        self.stalled = 0
        self._complain = Complaints("stalls")
        #: when its next key is due, as far as the elected replica knows
        self.dues = Dues()

    def follow(self, watch: SweepWatch) -> Alarm:
        """Follow the keys put under ``stalls/`` on the leader's watch; its sweeps' alarm."""
        return follow_due(watch, self.keys.stalls(), self.dues)

    async def woken(self, whole: bool) -> int:
        """The elected replica's sweep, when a key is due (a full look is the same)."""
        return await swept_due(self.core, self.keys.stalls(), self.dues, self.sweep)

    async def sweep(self) -> int:
        """Take back every claim stalled by now; move on the keys of claims that
        checkpointed or ended."""
        taken = await sweep_due(self.core, self.keys.stalls(), self.keys.parse_stall,
                                self._check, self._complain)
        self.stalled += taken
        return taken

    async def _check(self, listed: KV) -> bool:
        _, ref = self.keys.parse_stall(listed.key)
        claim_key = self.keys.claim(ref)
        entry_key = self.keys.entry(ref.task_id, ref.file_id)

        async def plan(txn: Txn) -> bool:
            kv, claim, kept_kv = await txn.get_many(
                [listed.key, claim_key, self.keys.checkpoint(ref)])
            if kv is None:
                return False  # another replica got there first
            txn.delete(listed.key)
            value = json.loads(kv.value)
            token, after = int(value.get("token") or kv.create_revision), float(value["after"])
            if claim is None or claim.create_revision != token:
                return False  # that claim ended (committed, acked, reaped): forget it
            kept = CheckpointRecord.load(kept_kv)
            now = self.core.clock()
            if kept is not None and kept.token == token and kept.at + after > now:
                # it checkpointed since: stalled only if it stops from there
                self.core.arm_stall(txn, ref, after, token=token, since=kept.at)
                return False
            holder = claim_holder(claim) or "?"
            since = "its last checkpoint" if kept is not None and kept.token == token else (
                "the claim" if ref.kind == "p" else "the consume")
            reason = f"stalled: no checkpoint within {after:g} s of {since} by {holder}"
            entry, task = await txn.get_many([entry_key, self.keys.task(ref.task_id)])
            take_back(self.core, txn, ref, claim,
                      EntryRecord.load(entry.value) if entry is not None else None,
                      cancelled=voided(task), guard=True, actor=actor_of(claim),
                      reason=reason, spend=True, event="stalled",
                      details={"reason": reason} if ref.kind == "c" else None)
            txn.after(lambda: logs.log(
                log, logging.WARNING, "stalled claim taken back", task=ref.task_id,
                file_id=ref.file_id, revision=txn.revision, kind=ref.kind,
                group=ref.group or None, token=token, agent=holder))
            return True

        return await write(self.core.txns, plan)
