"""Ending a claim and giving its entry back, written once.

A claim ends by deleting its key, its durable twin and the slot it holds; the entry it
was on then goes back: a producer's (``writing``) down the retry path when the attempt
counts as failed (deadline, lease lost) or back to ``pending`` untouched when it does
not (revoked by an operator or a lease rotation), a consumer's back to its group. The
deadline expiry, the reaper and lease revocation all call these, in their own guarded
transaction, so the three can no longer drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._etcd import KV
from .claims import release_slot
from .core import Core
from .keys import ClaimRef
from .machine import Event, apply
from .model import VERIFIED, WRITING, EntryRecord
from .txn import Txn


def end(core: Core, txn: Txn, ref: ClaimRef, claim: KV) -> None:
    """Delete the claim key, its twin and its slot, in the caller's transaction."""
    txn.delete(core.keys.claim(ref))
    txn.delete(core.keys.inflight(ref))
    release_slot(core.keys, claim, txn)


def give_back(core: Core, txn: Txn, rec: EntryRecord, ref: ClaimRef, token: int, *,
              actor: Mapping[str, str], reason: str, spend: bool, event: str,
              consumer_event: str = "",
              details: Mapping[str, Any] | None = None) -> bool:
    """Give back the entry of an ended claim, in the caller's transaction (which
    writes it). A producer's attempt spends a retry when ``spend`` (``event`` is the
    journal's record, ``reason`` the entry's error); otherwise it goes back to pending
    as it was. A consumer's entry becomes claimable again for its group, journalled as
    ``consumer_event`` (or ``event``) with ``details``. ``actor``: the journal's who
    (an authenticated identity) and label (the name a client gave). False when the
    claim no longer held anything: the entry moved on meanwhile."""
    details = details or {}
    if ref.kind == "p" and rec.state == WRITING:
        if spend:
            core.retry_or_dead(rec, reason, token=token, event=event)
        else:
            apply(rec, Event.REVOKE)  # no retry spent: the agent did not fail
            rec.error = reason
            rec.remember(event, **actor, token=token, **details)
    elif ref.kind == "c" and rec.state == VERIFIED and ref.group not in rec.consumed_by:
        rec.remember(consumer_event or event, group=ref.group, **actor, token=token,
                     **details)
        txn.put(core.keys.cready(ref.task_id, ref.group, ref.file_id), b"")
    else:
        return False
    core.put_entry(rec, txn)
    return True
