"""Operating sessions' leases (``baton lease``): revoke, rotate, drain a host.

A session keeps its id while its etcd lease changes: the record
``agents/{session}`` is on the session's lease of the moment, and every key of
the session (record, claims, slots) is attached to that lease. Three operator
calls act on that:

- revoke: the record is marked ``revoked`` first (one guarded transaction), so
  claims, consumes and keepalives of the session are refused from then on; its
  claims go back chunk by chunk, each with its entry, twin and slot in one
  guarded transaction and without spending a retry; then its lease is revoked.
  A crash anywhere leaves a record still marked, and a rerun finishes the job.
- rotate: a fresh lease is granted and the record moves onto it with
  ``rotating_from`` naming the old one (claims planned on the old record fail
  their compare and plan again on the new lease; keepalives refresh both). The
  keys still on the old lease, as etcd lists them, are then put again with the
  new lease, each guarded by its revision: a put keeps a key's create revision,
  so every token stays valid, and the twins (not leased) are untouched. When
  they fit one transaction (etcd's ``--max-txn-ops``, 128 by default) the move
  and the clearing of ``rotating_from`` are that one transaction; else chunks
  of ``MOVE_CHUNK`` go first. Last, the old lease is revoked, holding nothing.
  A rerun finds ``rotating_from`` set and finishes the move.
  A rotation never extends liveness: the new lease is granted the whole
  seconds the old one has left (etcd's TimeToLive, rounded down), not the
  session's TTL, and the old one is not refreshed. A session with less left
  than etcd grants (its minimum TTL) is not rotated, nor one still on a lease a
  rotation granted that its agent has not refreshed since (rotated again, it
  would lose up to a second each time). The agent's next keepalive, which
  proves it lives, moves the session onto a lease of its full TTL (``renew``).
  A session whose agent is gone thus dies when its last keepalive runs out,
  however often it is rotated.
- drain: ``drains/{host}`` records the deadline, and every session of the host
  gets ``draining`` in its record: claims and consumes are refused with
  ``Draining``, while what the sessions hold may still be finished. A sweep in
  every replica revokes what is left once the deadline has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from ...kernel.errors import BatonError, InvalidArgument, NotFound
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import Caller
from ..records.manifest import check_id
from ..records.model import EntryRecord
from ..rules.checks import SessionRecord, claim_holder, claim_session, voided
from ..rules.claim import reattach, take_back
from ..rules.core import Core, every, on_change
from ..rules.sweeping import Complaints
from ..store.etcd import KV
from ..store.txn import MAX_TXN_OPS, Txn, write
from .sessions import MAX_TTL, MIN_TTL

log = logging.getLogger("baton.registry")

#: claims returned per transaction by a revoke: each pins its claim and its entry and
#: writes up to eight keys (claim, twin, slot, entry, two index keys, journal record)
RETURN_CHUNK = 12
#: keys re-attached per transaction by a rotation: each is pinned and put, with the
#: record (one compare and one put more) under etcd's --max-txn-ops
MOVE_CHUNK = MAX_TXN_OPS - 8
#: keys read per request when listing sessions or drains
LIST_PAGE = 1000
#: a drain's deadline when none is given, and the longest one may be (seconds)
DEFAULT_DRAIN, MAX_DRAIN = 300, 7 * 24 * 3600


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class Leases:
    def __init__(self, core: Core, interval: float = 0.5) -> None:
        self.core = core
        self.keys = core.keys
        self.interval = interval
        #: claims this replica returned by revoking sessions, sessions it rotated
        self.returned = 0
        self.rotated = 0
        self._complain = Complaints("drain sweep")
        #: the earliest deadline of a drain not yet due; whether one is past its own
        self.next_deadline = math.inf
        self._overdue = False

    # choosing sessions ---------------------------------------------------------

    async def _records(self, host: str = "", agent: str = "") -> AsyncIterator[SessionRecord]:
        """Every live session's record (of ``host``, of ``agent`` when given), read a
        page at a time."""
        pages = self.core.etcd.scan(self.keys.agents(), page=LIST_PAGE)
        async with contextlib.aclosing(pages):
            async for kv in pages:
                record = SessionRecord.of(kv, self.keys.session_of(kv.key))
                if host and record.host != host:
                    continue
                if agent and str(record.info.get("agent", "")) != agent:
                    continue
                yield record

    async def _select(self, session_id: int, agent: str, host: str, every: bool = False,
                      ) -> list[int]:
        """The sessions one operator call names: exactly one way of naming them."""
        named = [bool(session_id), bool(agent), bool(host), every]
        if sum(named) != 1:
            raise InvalidArgument("name the sessions one way: a session id, an agent, a "
                                  "host" + (", or all" if every else ""))
        if session_id:
            if session_id < 0:
                raise InvalidArgument(f"session id {session_id} is negative")
            if await self.core.etcd.get(self.keys.agent(session_id)) is None:
                raise NotFound(f"no live session {session_id:x}", session_id=session_id)
            return [session_id]
        if agent:
            check_id("agent", agent)
        if host:
            check_id("host", host)
        return [r.session_id async for r in self._records(host=host, agent=agent)]

    # revoke ---------------------------------------------------------------------

    async def revoke(self, req: pb.RevokeSessionRequest,
                     caller: Caller) -> pb.RevokeSessionResponse:
        who = caller.name or "operator"
        out = []
        for session_id in await self._select(req.session_id, req.agent, req.host):
            done = await self.revoke_session(session_id, who, req.reason or "no reason given",
                                             evidence=req.evidence)
            if done is not None:
                out.append(done)
        return pb.RevokeSessionResponse(sessions=out)

    async def revoke_session(self, session_id: int, who: str, reason: str,
                             evidence: str = "") -> pb.RevokedSession | None:
        """Revoke one session (see the module's docstring); None if it is gone.
        ``evidence`` backs the reason in the journal records of the claims given back."""
        key = self.keys.agent(session_id)

        async def mark(txn: Txn) -> SessionRecord | None:
            kv = await txn.get(key)
            if kv is None:
                return None
            record = SessionRecord.of(kv, session_id)
            if not record.revoked:
                txn.put(key, record.with_info(revoked={"by": who, "reason": reason}),
                        lease=kv.lease)
            return record

        record = await write(self.core.txns, mark, fresh=True)
        if record is None:
            return None
        returned = 0
        for lease in record.leases:
            _, keys = await self.core.etcd.lease_keys(lease)
            claims = [k for k in keys if k.startswith(self.keys.claims_all())]
            for i in range(0, len(claims), RETURN_CHUNK):
                returned += await self._return(claims[i:i + RETURN_CHUNK], session_id, who,
                                               reason, evidence)
        for lease in record.leases:
            await self.core.etcd.revoke(lease)
        self.returned += returned
        log.info("session %x of %s revoked by %s (%s): %d claims returned", session_id,
                 record.agent, who, reason, returned)
        return pb.RevokedSession(session_id=session_id, agent=record.agent, host=record.host,
                                 claims_returned=returned)

    async def _return(self, keys: list[bytes], session_id: int, who: str,
                      reason: str, evidence: str) -> int:
        """Give back the claims of ``keys`` still held by the session, in one guarded
        transaction: a producer's entry goes back to pending as it was (no retry
        spent, no backoff), a consumer's back to its group; each claim dies with its
        twin and its slot, so its token is refused from then on. An entry of a
        cancelled task (its cancel not done revoking claims) stays as it was."""

        async def plan(txn: Txn) -> int:
            claims = await txn.get_many(keys)
            held = [(k, c) for k, c in zip(keys, claims, strict=True)
                    if c is not None and claim_session(c) == session_id]
            refs = [self.keys.parse_claim(k) for k, _ in held]
            entries = await txn.get_many([self.keys.entry(r.task_id, r.file_id) for r in refs])
            # Pinned: a cancel applied meanwhile fails this transaction's compare.
            task_ids = list(dict.fromkeys(r.task_id for r in refs))
            void = {t for t, kv in zip(task_ids, await txn.get_many(
                [self.keys.task(t) for t in task_ids]), strict=True) if voided(kv)}
            for (_key, claim), ref, kv in zip(held, refs, entries, strict=True):
                # a cancelled task's entry stays as it was: the claim dies
                take_back(self.core, txn, ref, claim,
                          EntryRecord.load(kv.value) if kv is not None else None,
                          cancelled=ref.task_id in void,
                          actor={"who": who, "label": claim_holder(claim)},
                          spend=False, event="revoked",
                          reason=f"claim revoked by {who}: {reason}"
                          if ref.kind == "p" else reason,
                          details={"reason": reason, "agent": claim_holder(claim),
                                   **({"evidence": evidence} if evidence else {})})
            return len(held)

        return await write(self.core.txns, plan, fresh=True)

    # rotate ---------------------------------------------------------------------

    async def rotate(self, req: pb.RotateLeaseRequest, caller: Caller) -> pb.RotateLeaseResponse:
        if req.ttl and not MIN_TTL <= req.ttl <= MAX_TTL:
            raise InvalidArgument(f"ttl {req.ttl} not within {MIN_TTL}..{MAX_TTL} seconds")
        out = []
        for session_id in await self._select(req.session_id, "", req.host, req.all):
            done = await self.rotate_session(session_id, req.ttl,
                                             who=caller.name or "operator")
            if done is not None:
                out.append(done)
        return pb.RotateLeaseResponse(sessions=out)

    async def renew(self, session_id: int) -> int:
        """The session's agent has just refreshed a lease that a rotation granted with
        the time its old lease had left: move the session onto a lease of its full TTL,
        which the refresh proves it is owed. The TTL its lease has now (0: the session
        went meanwhile, or another rotation took it on)."""
        done = await self.rotate_session(session_id, renewed=True, who="its keepalive")
        return int(done.ttl) if done is not None else 0

    async def rotate_session(self, session_id: int, ttl: int = 0, *, renewed: bool = False,
                             who: str = "operator") -> pb.RotatedSession | None:
        """Move one session onto a fresh lease (see the module's docstring), or finish
        a move a crash interrupted; None if the session is gone, being revoked, or not
        to be rotated now (too little left on its lease, or a rotation's lease its agent
        has not renewed yet). ``renewed``: the agent has just refreshed the session's
        lease, so the new lease may have the session's full TTL."""
        kv = await self.core.etcd.get(self.keys.agent(session_id))
        if kv is None:
            return None
        record = SessionRecord.of(kv, session_id)
        if record.revoked:
            return None
        if not record.rotating_from:
            begun = await self.begin_rotation(record, ttl or record.ttl or MIN_TTL,
                                              renewed=renewed)
            if begun is None:
                return None
            record = begun
        moved, transactions = await self.move_keys(record)
        old = record.rotating_from
        # A last look before the revoke: etcd's leader answers for the lease's keys, and
        # may have applied a claim made before the record moved later than the member
        # that answered the move did. Anything still there moves too.
        _, left = await self.core.etcd.lease_keys(old)
        for i in range(0, len(left), MOVE_CHUNK):
            moved += await self._move(record, left[i:i + MOVE_CHUNK], last=False)
            transactions += 1
        await self.core.etcd.revoke(old)
        self.rotated += 1
        log.info("session %x of %s rotated by %s from lease %x to %x (%d keys, %d "
                 "transactions)", session_id, record.agent, who, old, record.lease, moved,
                 transactions)
        return pb.RotatedSession(session_id=session_id, old_lease=old, new_lease=record.lease,
                                 ttl=record.ttl, keys_moved=moved, transactions=transactions)

    async def begin_rotation(self, record: SessionRecord, ttl: int,
                             renewed: bool = False) -> SessionRecord | None:
        """Grant the new lease and move the record onto it, naming the old lease in
        ``rotating_from``; the record as written, its ``ttl`` the session's from then
        on (None: the session is gone, revoked or rotated meanwhile, or not to be
        rotated now, and no new lease is left behind).

        The new lease lives no longer than the old one would have: it is granted the
        whole seconds etcd says the old one has left, or ``ttl`` if that is less; the
        session's own TTL comes back with its agent's next keepalive (``renew``).
        Only ``renewed`` (the agent has just refreshed the old lease) grants ``ttl``.
        """
        key = self.keys.agent(record.session_id)
        left, granted_before = await self.core.etcd.lease_times(record.lease)
        if left <= 0:
            return None  # expired, or about to: the session dies as it would have
        if renewed:
            if granted_before >= ttl:
                return None  # another rotation restored it already
            asked = ttl
        elif granted_before < record.ttl:
            # A rotation's lease its agent has not refreshed since: rotated again, it
            # would lose what etcd's whole seconds round off, each time.
            log.info("session %x of %s not rotated: its agent has not renewed the lease "
                     "the last rotation granted (%d s left)", record.session_id,
                     record.agent, left)
            return None
        else:
            asked = min(ttl, left)
        new, granted = await self.core.etcd.grant(asked)
        if granted > asked and not renewed:
            # etcd raised it to its minimum TTL: that would be time the session never had.
            await self.core.etcd.revoke(new)
            log.info("session %x of %s not rotated: its lease has %d s left, less than "
                     "etcd grants", record.session_id, record.agent, left)
            return None

        async def plan(txn: Txn) -> SessionRecord | None:
            kv = await txn.get(key)
            if kv is None or kv.lease != record.lease:
                return None
            now = SessionRecord.of(kv, record.session_id)
            if now.revoked or now.rotating_from:
                return None
            # The session's TTL: what its agent's keepalives give it from now on.
            value = now.with_info(ttl=granted if renewed else ttl,
                                  rotating_from=record.lease)
            txn.put(key, value, lease=new)
            return SessionRecord(record.session_id, new, json.loads(value))

        try:
            begun = await write(self.core.txns, plan, fresh=True)
        except BaseException:
            with contextlib.suppress(BatonError):
                await self.core.etcd.revoke(new)
            raise
        if begun is None:
            await self.core.etcd.revoke(new)
        return begun

    async def move_keys(self, record: SessionRecord, chunk: int = MOVE_CHUNK,
                        limit: int | None = None) -> tuple[int, int]:
        """Re-attach the keys still on ``record.rotating_from`` to ``record.lease``, then
        clear ``rotating_from``: (keys moved, transactions). ``limit`` stops after that
        many chunks, leaving the rotation half done (for tests of a rerun)."""
        old, key = record.rotating_from, self.keys.agent(record.session_id)
        ttl, keys = await self.core.etcd.lease_keys(old)
        keys = [k for k in keys if k != key] if ttl >= 0 else []
        chunks = [keys[i:i + chunk] for i in range(0, len(keys), chunk)] or [[]]
        moved = 0
        for n, part in enumerate(chunks):
            if limit is not None and n >= limit:
                return moved, n
            moved += await self._move(record, part, last=n == len(chunks) - 1)
        return moved, len(chunks)

    async def _move(self, record: SessionRecord, keys: list[bytes], last: bool) -> int:
        """Put ``keys`` again with the new lease, each as read (a key finished or moved
        meanwhile is left alone); with ``last``, clear ``rotating_from`` in the same
        transaction."""
        old, new = record.rotating_from, record.lease
        record_key = self.keys.agent(record.session_id)

        async def plan(txn: Txn) -> int:
            moved = 0
            for kv in await txn.get_many(keys):
                if kv is not None and kv.lease == old:
                    reattach(txn, kv, new)
                    moved += 1
            if last:
                kv = await txn.get(record_key)
                if kv is not None:
                    now = SessionRecord.of(kv, record.session_id)
                    if now.rotating_from == old:
                        txn.put(record_key, now.with_info(rotating_from=None), lease=kv.lease)
            return moved

        return await write(self.core.txns, plan, fresh=True)

    # drain ----------------------------------------------------------------------

    async def drain(self, req: pb.DrainHostRequest, caller: Caller) -> pb.DrainHostResponse:
        check_id("host", req.host)
        seconds = req.deadline_seconds or DEFAULT_DRAIN
        if not 0 < seconds <= MAX_DRAIN:
            raise InvalidArgument(f"deadline {req.deadline_seconds} s not within "
                                  f"1..{MAX_DRAIN} seconds (0: {DEFAULT_DRAIN})")
        deadline = self.core.clock() + seconds
        value = json.dumps({"deadline": deadline, "by": caller.name or "operator",
                            "reason": req.reason, "evidence": req.evidence}).encode()

        async def plan(txn: Txn) -> None:
            txn.put(self.keys.drain(req.host), value)

        await write(self.core.txns, plan)
        sessions = claims = 0
        async for record in self._records(host=req.host):
            if await self._set_draining(record.session_id, True):
                sessions += 1
                for lease in record.leases:
                    _, keys = await self.core.etcd.lease_keys(lease)
                    claims += sum(k.startswith(self.keys.claims_all()) for k in keys)
        log.info("host %s drained by %s until %s: %d sessions, %d claims", req.host,
                 caller.name or "operator", _iso(deadline), sessions, claims)
        return pb.DrainHostResponse(host=req.host, deadline=_iso(deadline), sessions=sessions,
                                    claims=claims)

    async def undrain(self, req: pb.UndrainHostRequest,
                      caller: Caller) -> pb.UndrainHostResponse:
        check_id("host", req.host)

        async def plan(txn: Txn) -> None:
            txn.delete(self.keys.drain(req.host))

        await write(self.core.txns, plan)
        sessions = 0
        async for record in self._records(host=req.host):
            sessions += await self._set_draining(record.session_id, False)
        log.info("host %s undrained by %s: %d sessions", req.host, caller.name or "operator",
                 sessions)
        return pb.UndrainHostResponse(host=req.host, sessions=sessions)

    async def _set_draining(self, session_id: int, draining: bool) -> bool:
        """Set or clear a session's ``draining`` (guarded on its record); whether the
        session lives."""
        key = self.keys.agent(session_id)

        async def plan(txn: Txn) -> bool:
            kv = await txn.get(key)
            if kv is None:
                return False
            record = SessionRecord.of(kv, session_id)
            if record.draining != draining:
                txn.put(key, record.with_info(draining=draining or None), lease=kv.lease)
            return True

        return await write(self.core.txns, plan, fresh=True)

    async def run(self, stop: asyncio.Event) -> None:
        """Revoke what the sessions of drained hosts whose deadline has passed still
        hold, whichever replica (or none) the drain came through: when a drain is
        written, when a deadline comes, and, while a drain is past its deadline, when a
        session is opened (on that host, perhaps); at most once per ``interval``. The
        drains are read from the view: nothing is asked of etcd until one is due.
        Without a view, every ``interval``."""
        view = self.core.view
        if view is None:
            await every(self.interval, stop, self.sweep, "drain")
            return
        changed = asyncio.Event()
        view.listen(self.keys.drains(), changed.set)
        view.listen(self.keys.agents(), lambda: changed.set() if self._overdue else None)
        await on_change(changed, self._sweep, self.core.clock, self.interval, stop, "drain")

    async def _sweep(self) -> float:
        await self.sweep()
        return self.next_deadline

    async def _drains(self) -> list[KV]:
        """Every drain key: from the view (which mirrors them) once it is loaded."""
        view = self.core.view
        if view is not None and view.ready:
            return await view.scan(self.keys.drains(), 0, False)
        return [kv async for kv in self.core.etcd.scan(self.keys.drains(), page=LIST_PAGE)]

    async def sweep(self) -> int:
        """Revoke every session of each drained host past its deadline; how many."""
        due: dict[str, tuple[str, str]] = {}
        ahead = math.inf
        clock = self.core.clock()
        for kv in await self._drains():
            try:
                drain = json.loads(kv.value)
                deadline, by = float(drain["deadline"]), str(drain.get("by", ""))
            except (ValueError, KeyError, TypeError) as e:
                self._complain(kv.key.decode(errors="replace"), e)
                continue
            if deadline <= clock:
                due[self.keys.last_segment(kv.key)] = (
                    by or "operator", str(drain.get("evidence") or ""))
            else:
                ahead = min(ahead, deadline)
        self.next_deadline, self._overdue = ahead, bool(due)
        revoked = 0
        for host, (by, evidence) in due.items():
            async for record in self._records(host=host):
                if await self.revoke_session(record.session_id, by, "drain deadline",
                                             evidence):
                    revoked += 1
        return revoked
