"""The claim object: every write of a claim's keys, and the checks on them, written once.

A claim is four keys written together: the claim key (leased to the holder's session:
its create revision is the fencing token), its durable twin ``inflight/…`` (not
leased: the reaper finds it when the lease is gone), the session's slot it holds
(leased) and, when the entry has one, its deadline key. This module is the only one
that puts or deletes the first three (tests/unit/test_claim_owner.py holds it to that):

- :func:`take` writes them in the caller's transaction (a claim, a consume);
- :func:`check_live` refuses a token call (commit, fail, ack, nack) whose token is not
  the live claim, held by the caller, in a task not cancelled;
- :func:`pick` chooses entries from the head of an index (producers' ready index,
  consumers' claimable index);
- :func:`end` deletes a claim with its twin, slot and pool unit (:func:`end_read` for
  claims a bulk path read pinned, :func:`end_twins` for the twins it read: claims
  whose lease is gone);
- :func:`give_back` returns the entry of an ended claim: a producer's down the retry
  path when the attempt counts as failed (deadline, lease lost) or back to
  ``pending`` untouched when it does not (revoked by an operator or a lease
  rotation), a consumer's back to its group;
- :func:`take_back` is the one take-back of a claim from its holder (a deadline, a
  stall, a lost session, a revoked lease): :func:`end`, then :func:`give_back` unless
  the task is cancelled;
- :func:`reattach` puts a session's claim and slot keys again on its new lease.

Commit, fail, ack, nack, the fused steps, the deadline expiry, the reaper, lease
revoke and rotate, cancel, task removal and verification all call these, so the
paths can no longer drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...kernel.errors import BatonError, IllegalTransition, StaleToken
from ..records.identity import Caller
from ..records.model import VERIFIED, WRITING, EntryRecord
from ..store.etcd import KV, created_at
from ..store.keys import ClaimRef
from ..store.txn import Retry, Txn
from .checks import (
    Slots,
    check_claim_session,
    check_owner,
    check_tokens_live,
    claim_session,
    claim_slot,
    claim_unit,
    claim_value,
    need_entry,
)
from .core import Core
from .machine import Event, apply
from .pools import Pools

#: index keys looked at per pick (the head of a ready or claimable index)
PAGE = 64


# take ---------------------------------------------------------------------------

async def take(core: Core, txn: Txn, ref: ClaimRef, slots: Slots, identity: str,
               deadline: float, stall_after: float = 0.0, pool: str = "") -> None:
    """Add a claim to the caller's transaction: a slot of the session (refused with
    ``SlotsExhausted`` before anything is written when none is free), a unit of its
    concurrency ``pool`` if it names one (``NothingToClaim`` naming the pool when none
    is free), the claim key on the session's lease, its twin and its deadline key
    (``deadline`` seconds; none for 0) and, with ``stall_after``, when it counts as
    stalled without a checkpoint. The claim key is created: its create revision, the
    transaction's, is the token (and the unit key's mod revision)."""
    slot = slots.reserve(core.rng)
    if slot >= 0:
        # create-only: two concurrent claims can never both take the last slot
        txn.create(core.keys.slot(slots.session_id, slot), b"", lease=slots.lease)
    unit = None
    if pool:
        reserve = core.view.reserve if core.view is not None and not txn.fresh else None
        unit = (pool, await slots.pools.take(
            txn, pool, ref, {"agent": slots.agent, "session": slots.session_id},
            core.rng, reserve))
    value = claim_value(slots.agent, slots.session_id, slot, identity, unit)
    txn.create(core.keys.claim(ref), value, lease=slots.lease)
    if ref.kind == "p":
        txn.create(core.keys.inflight(ref), value)
    else:
        # A consume is guarded on its claimable key instead, which every path that
        # ends a consume-claim puts back in the transaction that deletes the twin:
        # no twin can be left over, and the put spares the consume a compare.
        txn.put(core.keys.inflight(ref), value)
    core.arm_deadline(txn, ref, deadline)
    core.arm_stall(txn, ref, stall_after)


# check --------------------------------------------------------------------------

@dataclass(frozen=True)
class Ask:
    """A token call on a claim: the claim it names, its token, the session it names
    (0: none named)."""

    ref: ClaimRef
    token: int
    session_id: int = 0


def _stale(ask: Ask) -> StaleToken:
    ref = ask.ref
    if ref.kind == "p":
        return StaleToken(
            f"token {ask.token} is not the live claim on {ref.task_id}/{ref.file_id} "
            "(the claim was lost, superseded or already finished)",
            task_id=ref.task_id, file_id=ref.file_id, token=ask.token)
    return StaleToken(
        f"token {ask.token} is not the live consume-claim of group {ref.group!r} on "
        f"{ref.task_id}/{ref.file_id} (lost, superseded or already acked)",
        task_id=ref.task_id, file_id=ref.file_id, group=ref.group, token=ask.token)


def _what(ask: Ask) -> str:
    ref = ask.ref
    if ref.kind == "p":
        return f"the claim on {ref.task_id}/{ref.file_id} (token {ask.token})"
    return (f"the consume-claim of group {ref.group!r} on {ref.task_id}/{ref.file_id} "
            f"(token {ask.token})")


async def check_live(core: Core, txn: Txn, asks: Sequence[Ask],
                     caller: Caller) -> list[tuple[KV, EntryRecord]]:
    """The claim and entry of each ask, once its token is the live claim
    (``StaleToken``), its task not cancelled (the header is pinned: its status change
    alone voids every token), the claim the caller's (``PermissionDenied``) and the
    named session's; a producer's entry must be writing. Task, entry and claim of
    every ask are read in one round trip, pinned. Asks on one entry share its record,
    so that each sees what the others changed."""
    keys: list[bytes] = []
    for ask in asks:
        ref = ask.ref
        keys += [core.keys.task(ref.task_id), core.keys.entry(ref.task_id, ref.file_id),
                 core.keys.claim(ref)]
    found = dict(zip(keys, await txn.get_many(keys), strict=True))
    records: dict[bytes, EntryRecord] = {}
    out = []
    for ask in asks:
        ref = ask.ref
        entry_key = core.keys.entry(ref.task_id, ref.file_id)
        if entry_key not in records:
            records[entry_key] = need_entry(found[entry_key], ref.task_id, ref.file_id)
        rec = records[entry_key]
        claim = found[core.keys.claim(ref)]
        if ask.token <= 0 or claim is None or claim.create_revision != ask.token:
            raise _stale(ask)
        what = _what(ask)
        check_tokens_live(found[core.keys.task(ref.task_id)], ref.task_id, what, ask.token)
        check_owner(caller, claim, what)
        check_claim_session(claim, ask.session_id, what)
        if ref.kind == "p" and rec.state != WRITING:
            # cannot happen while the claim lives; refuse anyway
            raise IllegalTransition(f"entry {ref.file_id!r} is {rec.state}, not writing")
        out.append((claim, rec))
    return out


# pick ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Head:
    """The head of an index to pick from: ``page`` its first keys as read (keys only,
    ``PAGE`` of each index listed), of which the first ``window`` are tried in a random
    order and the rest in order; ``index`` the prefix the view drops when the head it
    held proved behind."""

    task_id: str
    page: list[KV]
    window: int
    index: bytes
    #: whether an entry read is still the one its index key names (not taken meanwhile)
    current: Callable[[EntryRecord, bytes], bool]
    #: why nothing is picked: given how many entries the caller may not have
    nothing: Callable[[int], BatonError]
    #: whether the caller may have an entry (the task's access rules)
    allowed: Callable[[EntryRecord], bool] = lambda rec: True
    #: the concurrency pool an entry's claim takes a unit of ("" = none), and the
    #: planner's pools (None: no entry here names one)
    pool_of: Callable[[EntryRecord], str] = lambda rec: ""
    pools: Pools | None = None


async def pick(core: Core, txn: Txn, head: Head, want: int) -> list[tuple[KV, EntryRecord]]:
    """Up to ``want`` entries from ``head``, each pinned (entry as read).

    Claimers on other replicas read the same head, so each tries the window in a
    random order; concurrent planners on this replica pass over the keys another
    holds (the view's reservations). Entries whose concurrency pool has no free unit
    are passed over too (then the rest of the page is tried), and said when nothing
    else is claimable. ``Retry`` when every candidate moved while we looked (or the
    page was full of entries passed over): the plan is made again, on etcd;
    ``head.nothing`` otherwise.
    """
    tried = list(head.page[:head.window])
    core.rng.shuffle(tried)
    ordered = tried + list(head.page[head.window:])
    cut = max(want * 2, 8)
    view = core.view if not txn.fresh else None
    picked: list[tuple[KV, EntryRecord]] = []
    moved = False
    #: a candidate another planner of this replica reserved, or took (its index key
    #: left the window), while this one read: the window is current, the page was not
    taken = False
    denied = 0
    #: entries passed over per pool without a free unit, and units this pick needs
    full: dict[str, int] = {}
    needs: dict[str, int] = {}
    for order in (ordered[:cut], ordered[cut:]):
        keys = [core.keys.entry(head.task_id, core.keys.last_segment(k.key)) for k in order]
        for key, listed, kv in zip(keys, order, await txn.peek_many(keys), strict=True):
            if view is not None and view.taken(listed.key):
                taken = True
                continue
            rec = EntryRecord.load(kv.value) if kv is not None else None
            if kv is None or rec is None or not head.current(rec, listed.key):
                moved = True  # taken while we looked
                continue
            if not head.allowed(rec):
                denied += 1
                continue
            pool = head.pool_of(rec) if head.pools is not None else ""
            if pool and not await head.pools.room(txn, pool,  # type: ignore[union-attr]
                                                  needs.get(pool, 0)):
                full[pool] = full.get(pool, 0) + 1
                continue
            if view is not None and not view.reserve(txn, listed.key):
                continue
            txn.pin(key, kv)
            picked.append((kv, rec))
            if pool:
                needs[pool] = needs.get(pool, 0) + 1
            if len(picked) == want:
                return picked
        if picked or not (full or taken):
            break  # the rest of the page only when entries were passed over or taken
    if picked:
        return picked
    if full and not (moved or taken):
        assert head.pools is not None
        core.pool_refusals.update(full.keys())
        raise await head.pools.nothing(txn, head.task_id, full)
    if denied and not (moved or taken):
        raise head.nothing(denied)
    if moved or taken or len(head.page) >= PAGE:
        if view is not None and moved:
            view.invalidate(head.index)  # the window was behind
        raise Retry()
    raise head.nothing(0)


# end ----------------------------------------------------------------------------

def _free_slot(core: Core, txn: Txn, claim: KV) -> None:
    """Free the slot a claim holds (its value names session and slot)."""
    slot, session = claim_slot(claim), claim_session(claim)
    if slot >= 0 and session:
        txn.delete(core.keys.slot(session, slot))


def _free_unit(core: Core, txn: Txn, held: KV | None) -> None:
    """Give back the pool unit a claim holds (its value, or its twin's, names it)."""
    if (unit := claim_unit(held)) is not None:
        txn.delete(core.keys.pool_unit(*unit))


def end(core: Core, txn: Txn, ref: ClaimRef, claim: KV | None, *,
        guard: bool = False, twin: KV | None = None) -> None:
    """End a claim in the caller's transaction: delete its key, its twin, its slot and
    its pool unit. ``claim`` as read; None when the claim key is gone already (its
    lease ended, and its slot with it): the twin is left to delete, and the unit
    its value (``twin``, as read) names. ``guard`` requires the claim key still to be
    the one read (its create revision, the token), for a caller that read it
    unpinned or wants the token compared."""
    if claim is not None:
        if guard:
            txn.require(created_at(core.keys.claim(ref), claim.create_revision))
        txn.delete(core.keys.claim(ref))
        _free_slot(core, txn, claim)
    _free_unit(core, txn, claim if claim is not None else twin)
    txn.delete(core.keys.inflight(ref))


def end_read(core: Core, txn: Txn, read: Iterable[tuple[bytes, KV | None]]) -> int:
    """End each claim of ``read`` (claim key, claim as read pinned) still held, with
    its twin and slot: a claim finished meanwhile may have freed its slot for another
    claim of its session, which keeps it. A key under the claims prefix that names
    no claim is deleted alone. Returns how many claims ended."""
    ended = 0
    for key, claim in read:
        if claim is None:
            continue  # finished (or revoked) meanwhile: its slot is not ours
        try:
            ref = core.keys.parse_claim(key)
        except ValueError:
            txn.delete(key)
            continue
        end(core, txn, ref, claim)
        ended += 1
    return ended


def end_twins(core: Core, txn: Txn, read: Iterable[tuple[bytes, KV | None]]) -> int:
    """End each claim whose twin ``read`` names (twin key, twin as read pinned): the
    twin goes with the pool unit its value names, in this transaction, so a bulk
    delete of a task's twins (a cancel, a task's removal) leaves no unit held. A twin
    gone meanwhile was ended by its own path. A key under the twins prefix that names
    no claim is deleted alone. Returns how many twins went."""
    ended = 0
    for key, twin in read:
        if twin is None:
            continue
        try:
            ref = core.keys.parse_inflight(key)
        except ValueError:
            txn.delete(key)
            continue
        end(core, txn, ref, None, twin=twin)
        ended += 1
    return ended


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


def take_back(core: Core, txn: Txn, ref: ClaimRef, claim: KV | None,
              rec: EntryRecord | None, *, cancelled: bool, actor: Mapping[str, str],
              reason: str, event: str, spend: bool, twin: KV | None = None,
              guard: bool = False, consumer_event: str = "",
              details: Mapping[str, Any] | None = None) -> bool:
    """Take a claim back from its holder, in the caller's transaction: a deadline, a
    stall, a lost session (``claim`` None: its lease is gone, ``twin`` as read) or an
    operator's revoke. The claim ends (:func:`end`, with ``guard``) and its entry
    ``rec`` (as read; None: gone) is given back (:func:`give_back`, with ``actor``,
    ``reason``, ``event``, ``spend``, ``consumer_event``, ``details``), unless its
    task is ``cancelled``: a cancelled task's entries stay as they were, the claim
    dies. The token is the claim's (or its twin's) create revision. True when the
    entry was given back."""
    held = claim if claim is not None else twin
    assert held is not None, "a claim to take back, or its twin"
    end(core, txn, ref, claim, guard=guard, twin=twin)
    if rec is None or cancelled:
        return False
    return give_back(core, txn, rec, ref, held.create_revision, actor=actor, reason=reason,
                     spend=spend, event=event, consumer_event=consumer_event,
                     details=details)


# rotate -------------------------------------------------------------------------

def reattach(txn: Txn, kv: KV, lease: int) -> None:
    """Put a key of a session (a claim, a slot) again as read, on the session's new
    lease: a put keeps the key's create revision, so a claim's token stays valid."""
    txn.put(kv.key, kv.value, lease=lease)
