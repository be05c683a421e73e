"""Producer transitions: claim (pending → writing), commit (→ written), fail; and batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from client.errors import (
    AlreadyClaimed,
    IllegalTransition,
    InvalidArgument,
    NothingToClaim,
    StaleToken,
)
from client.v1 import baton_pb2 as pb

from ._etcd import KV, Compare, Delete, Get, Put, TxnOp, created_at, present, unchanged
from .core import (
    Core,
    Plan,
    Reads,
    Retry,
    check_session_id,
    claim_value,
    entry_replay,
    free_slots,
    need_entry,
    need_session,
    need_task,
    release_slot,
    take_slot,
)
from .keys import ClaimRef
from .manifest import DIGEST_RE, check_id
from .model import PENDING, WRITING, WRITTEN, EntryRecord
from .verify import Verifier

#: ready keys read per page when looking for the next claimable entry
PAGE = 64
#: etcd's default limit of operations per transaction, and what one claim needs
MAX_TXN_OPS = 128
OPS_PER_CLAIM = 6
OPS_PER_COMMIT = 6


@dataclass
class _Session:
    key: bytes
    kv: KV
    agent: str
    slots_used: list[KV]


class Producers:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys
        self.verifier = Verifier(core)
        #: claim calls in flight per task on this replica (how widely to spread picks)
        self._busy: dict[str, int] = {}

    # claim -----------------------------------------------------------------

    def _claim_ops(self, kv: KV, rec: EntryRecord, session: _Session, session_id: int,
                   compares: list[Compare], ops: list[TxnOp]) -> None:
        """Add one claim (pending → writing) to a transaction being built."""
        claimable = rec.index.startswith(self.keys.ready_all(rec.task_id).decode()) or (
            rec.index.startswith(self.keys.delayed_of_task(rec.task_id).decode())
            and rec.not_before <= self.core.clock())
        if not claimable:
            raise IllegalTransition(f"entry {rec.file_id!r} is not claimable yet")
        slot = take_slot(self.core, session.kv, session.slots_used, compares, ops)
        ref = ClaimRef("p", rec.task_id, rec.file_id)
        compares += [unchanged(kv), present(rec.index.encode())]
        rec.state, rec.owner, rec.session = WRITING, session.agent, session_id
        rec.observed, rec.error, rec.not_before = None, "", 0.0
        rec.remember("claimed", who=session.agent, attempt=rec.retry_count)
        value = claim_value(session.agent, session_id, slot)
        ops += [Put(self.keys.claim(ref), value, lease=session_id),
                Put(self.keys.inflight(ref), value)]
        self.core.put_entry(rec, ops)

    async def _first_read(self, reads: Reads, task_id: str, session_id: int,
                          target: Get | None) -> tuple[_Session, list[KV]]:
        """One round trip: task, session, its slots, and the entry (``target``) or
        the head of the ready index plus retries whose backoff is over."""
        agent_key = self.keys.agent(session_id)
        heads = [target] if target else [
            Get(self.keys.ready_all(task_id), prefix=True, limit=PAGE, keys_only=True),
            Get(self.keys.delayed_of_task(task_id), prefix=True, limit=PAGE, keys_only=True)]
        task_kvs, agent_kvs, slots, *found = await reads.read(
            Get(self.keys.task(task_id)), Get(agent_key),
            Get(self.keys.slots(session_id), prefix=True), *heads)
        need_task(task_kvs, task_id, active=True)
        agent = need_session(agent_kvs, session_id)
        session = _Session(agent_key, agent_kvs[0], agent, slots)
        if target:
            return session, found[0]
        # Retries whose backoff is over are claimable before the scheduler
        # moves them to the ready index.
        now_ms = int(self.core.clock() * 1000)
        base = self.keys.delayed_of_task(task_id)
        due = [kv for kv in found[1] if int(self.keys.parse_tail(kv.key, base)[0]) <= now_ms]
        return session, found[0] + due

    async def claim(self, req: pb.ClaimRequest) -> pb.ClaimResponse:
        self._busy[req.task_id] = self._busy.get(req.task_id, 0) + 1
        try:
            return await self._claim(req)
        finally:
            self._busy[req.task_id] -= 1
            if not self._busy[req.task_id]:
                del self._busy[req.task_id]

    async def _claim(self, req: pb.ClaimRequest) -> pb.ClaimResponse:
        check_id("task_id", req.task_id)
        if req.file_id:
            check_id("file_id", req.file_id)
        check_session_id(req.session_id)
        staging = self.core.staging_dir(req.task_id)

        def plan_for(kv: KV, rec: EntryRecord, session: _Session) -> Plan[pb.ClaimResponse]:
            compares: list[Compare] = [present(session.key)]
            ops: list[TxnOp] = []
            self._claim_ops(kv, rec, session, req.session_id, compares, ops)

            def reply(rev: int) -> pb.ClaimResponse:
                entry = rec.to_pb(staging, revision=rev, token=rev)
                return pb.ClaimResponse(entry=entry, token=rev, path=entry.abs_path)

            return Plan(compares, ops, reply)

        async def planner(reads: Reads) -> Plan[pb.ClaimResponse]:
            target = Get(self.keys.entry(req.task_id, req.file_id)) if req.file_id else None
            session, found = await self._first_read(reads, req.task_id, req.session_id,
                                                    target)
            if not req.file_id:
                (kv, rec), = await self._pick(req.task_id, found, 1)
                return plan_for(kv, rec, session)
            kv, rec = need_entry(found, req.task_id, req.file_id)
            if rec.state != PENDING:
                cls = AlreadyClaimed if rec.state == WRITING else IllegalTransition
                raise cls(f"entry {rec.file_id!r} is {rec.state}, not pending",
                          task_id=rec.task_id, file_id=rec.file_id, state=rec.state)
            if not rec.deps_ok:
                what = "parts" if rec.parts else f"dependencies {rec.depends_on}"
                raise IllegalTransition(f"entry {rec.file_id!r} waits for its {what}",
                                        task_id=rec.task_id, file_id=rec.file_id)
            if rec.not_before > self.core.clock():
                raise IllegalTransition(
                    f"entry {rec.file_id!r} is in retry backoff until "
                    f"{rec.to_pb(staging).not_before}", task_id=rec.task_id,
                    file_id=rec.file_id)
            return plan_for(kv, rec, session)

        def replay(raw: bytes, rev: int) -> pb.ClaimResponse:
            resp = pb.ClaimResponse.FromString(raw)
            resp.token = resp.entry.token = resp.entry.revision = rev
            return resp

        return await self.core.apply(planner, req.request_id, replay)

    async def _pick(self, task_id: str, page: list[KV],
                    want: int) -> list[tuple[KV, EntryRecord]]:
        """Up to ``want`` claimable entries from the head of the ready index.

        The index is sorted by priority (with aging) then age, so the head is
        the work to do first; no claim ever scans the task. Concurrent claimers
        read the same head, so each tries it in a random order.
        """
        # Strict order for a lone claimer; with k claims of this task in flight on
        # this replica, a random pick among the first k + want spreads them out
        # (they would all collide on the head otherwise).
        window = min(len(page), want + self._busy.get(task_id, 1) - 1)
        head = list(page[:window])
        self.core.rng.shuffle(head)
        order = head + list(page[window:])
        gets = [Get(self.keys.entry(task_id, self.keys.last_segment(k.key)))
                for k in order[: max(want * 2, 8)]]
        picked: list[tuple[KV, EntryRecord]] = []
        moved = False
        if gets:
            for found, ready in zip(await self.core.etcd.read(gets), order, strict=False):
                rec = EntryRecord.load(found[0].value) if found else None
                if found and rec and rec.state == PENDING and rec.index == ready.key.decode():
                    picked.append((found[0], rec))
                    if len(picked) == want:
                        break
                else:
                    moved = True  # taken while we looked
        if picked:
            return picked
        if moved or len(page) >= PAGE:
            raise Retry()  # every candidate moved while we looked; look again
        raise NothingToClaim(f"nothing to claim in task {task_id!r}", task_id=task_id)

    async def claim_batch(self, req: pb.ClaimBatchRequest) -> pb.ClaimBatchResponse:
        """Claim up to ``max`` entries in one transaction (as many as etcd's op limit
        allows); all or nothing. Each claim's token is that transaction's revision."""
        check_id("task_id", req.task_id)
        check_session_id(req.session_id)
        if req.max < 1:
            raise InvalidArgument("max must be at least 1")
        want = min(req.max, MAX_TXN_OPS // OPS_PER_CLAIM)
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.ClaimBatchResponse]:
            session, page = await self._first_read(reads, req.task_id, req.session_id, None)
            free = free_slots(session.kv, session.slots_used)
            picked = await self._pick(req.task_id, page, want if free is None else
                                      max(1, min(want, free)))
            compares: list[Compare] = [present(session.key)]
            ops: list[TxnOp] = []
            for kv, rec in picked:
                self._claim_ops(kv, rec, session, req.session_id, compares, ops)

            def reply(rev: int) -> pb.ClaimBatchResponse:
                out = []
                for _, rec in picked:
                    entry = rec.to_pb(staging, revision=rev, token=rev)
                    out.append(pb.ClaimResponse(entry=entry, token=rev, path=entry.abs_path))
                return pb.ClaimBatchResponse(claims=out)

            return Plan(compares, ops, reply)

        def replay(raw: bytes, rev: int) -> pb.ClaimBatchResponse:
            resp = pb.ClaimBatchResponse.FromString(raw)
            for c in resp.claims:
                c.token = c.entry.token = c.entry.revision = rev
            return resp

        return await self.core.apply(planner, req.request_id, replay)

    # commit and fail -------------------------------------------------------------

    async def _live_claims(
        self, reads: Reads, items: list[tuple[str, str, int]]
    ) -> list[tuple[KV, EntryRecord, KV]]:
        """Entry and claim of each (task, file, token) whose token is the live claim."""
        gets = []
        for task_id, file_id, _ in items:
            check_id("task_id", task_id)
            check_id("file_id", file_id)
            gets += [Get(self.keys.entry(task_id, file_id)),
                     Get(self.keys.claim(ClaimRef("p", task_id, file_id)))]
        found = await reads.read(*gets)
        out = []
        for i, (task_id, file_id, token) in enumerate(items):
            kv, rec = need_entry(found[2 * i], task_id, file_id)
            claims = found[2 * i + 1]
            if token <= 0 or not claims or claims[0].create_revision != token:
                raise StaleToken(
                    f"token {token} is not the live claim on {task_id}/{file_id} "
                    "(the claim was lost, superseded or already finished)",
                    task_id=task_id, file_id=file_id, token=token,
                )
            if rec.state != WRITING:  # cannot happen while the claim lives; refuse anyway
                raise IllegalTransition(f"entry {file_id!r} is {rec.state}, not writing")
            out.append((kv, rec, claims[0]))
        return out

    def _finish_claim(self, kv: KV, rec: EntryRecord, claim: KV, token: int,
                      compares: list[Compare], ops: list[TxnOp]) -> None:
        ref = ClaimRef("p", rec.task_id, rec.file_id)
        compares += [unchanged(kv), created_at(self.keys.claim(ref), token)]
        ops += [Delete(self.keys.claim(ref)), Delete(self.keys.inflight(ref))]
        release_slot(self.core, claim, ops)

    def _commit_ops(self, kv: KV, rec: EntryRecord, claim: KV, req: pb.CommitRequest,
                    compares: list[Compare], ops: list[TxnOp]) -> bool:
        """Add one commit to a transaction; True if it also verified the entry."""
        if req.size < 0:
            raise InvalidArgument(f"size {req.size} is negative")
        if req.digest and not DIGEST_RE.match(req.digest):
            raise InvalidArgument("digest must be 64 lower-case hex digits (BLAKE3)")
        if rec.expected_size and req.size != rec.expected_size:
            raise InvalidArgument(
                f"size {req.size} differs from the manifest's expected_size "
                f"{rec.expected_size}", task_id=rec.task_id, file_id=rec.file_id)
        if rec.expected_digest and req.digest and req.digest != rec.expected_digest:
            raise InvalidArgument("digest differs from the manifest's expected_digest",
                                  task_id=rec.task_id, file_id=rec.file_id)
        self._finish_claim(kv, rec, claim, req.token, compares, ops)
        rec.state, rec.size, rec.committed_digest = WRITTEN, req.size, req.digest
        rec.remember("committed", who=rec.owner, token=req.token, size=req.size)
        obs = rec.observation()
        verified = False
        if obs is not None and obs.size == req.size:
            # The watcher's report came first; settle it now.
            verified = self.verifier.settle(rec, obs.size, obs.digest, ops)
        self.core.put_entry(rec, ops)
        return verified

    async def commit(self, req: pb.CommitRequest) -> pb.Entry:
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.Entry]:
            ((kv, rec, claim),) = await self._live_claims(
                reads, [(req.task_id, req.file_id, req.token)])
            compares: list[Compare] = []
            ops: list[TxnOp] = []
            verified = self._commit_ops(kv, rec, claim, req, compares, ops)
            return Plan(compares, ops, lambda rev: rec.to_pb(staging, revision=rev),
                        self.verifier.notify(rec) if verified else None)

        return await self.core.apply(planner, req.request_id, entry_replay)

    async def commit_batch(self, req: pb.CommitBatchRequest) -> pb.CommitBatchResponse:
        """Commit many claims in one transaction, all or nothing."""
        if not req.commits:
            raise InvalidArgument("a batch needs at least one commit")
        if len(req.commits) > MAX_TXN_OPS // OPS_PER_COMMIT:
            raise InvalidArgument(
                f"at most {MAX_TXN_OPS // OPS_PER_COMMIT} commits per batch (etcd's "
                "operation limit per transaction)")

        async def planner(reads: Reads) -> Plan[pb.CommitBatchResponse]:
            live = await self._live_claims(
                reads, [(c.task_id, c.file_id, c.token) for c in req.commits])
            compares: list[Compare] = []
            ops: list[TxnOp] = []
            hooks: list[Callable[[], None]] = []
            for (kv, rec, claim), c in zip(live, req.commits, strict=True):
                if self._commit_ops(kv, rec, claim, c, compares, ops):
                    hooks.append(self.verifier.notify(rec))

            def reply(rev: int) -> pb.CommitBatchResponse:
                return pb.CommitBatchResponse(entries=[
                    rec.to_pb(self.core.staging_dir(rec.task_id), revision=rev)
                    for _, rec, _ in live])

            def fire() -> None:
                for hook in hooks:
                    hook()

            return Plan(compares, ops, reply, fire)

        def replay(raw: bytes, rev: int) -> pb.CommitBatchResponse:
            resp = pb.CommitBatchResponse.FromString(raw)
            for e in resp.entries:
                e.revision = rev
            return resp

        return await self.core.apply(planner, req.request_id, replay)

    async def fail(self, req: pb.FailRequest) -> pb.Entry:
        staging = self.core.staging_dir(req.task_id)

        async def planner(reads: Reads) -> Plan[pb.Entry]:
            ((kv, rec, claim),) = await self._live_claims(
                reads, [(req.task_id, req.file_id, req.token)])
            compares: list[Compare] = []
            ops: list[TxnOp] = []
            self._finish_claim(kv, rec, claim, req.token, compares, ops)
            self.core.retry_or_dead(rec, f"producer failed: {req.reason or 'no reason given'}",
                                    ops, token=req.token)
            self.core.put_entry(rec, ops)
            return Plan(compares, ops, lambda rev: rec.to_pb(staging, revision=rev))

        return await self.core.apply(planner, req.request_id, entry_replay)
