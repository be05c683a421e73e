"""Producer transitions: claim (pending → writing), commit (→ written), fail; and batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...kernel.errors import (
    AlreadyClaimed,
    IllegalTransition,
    InvalidArgument,
    NothingToClaim,
)
from ...kernel.v1 import baton_pb2 as pb
from ..records.access import check_producer
from ..records.identity import Caller, may
from ..records.manifest import DIGEST_RE, check_delay, check_id, check_traceparent
from ..records.model import PENDING, WRITING, EntryRecord
from ..records.routing import parse_attributes
from ..rules.checks import (
    Slots,
    actor_of,
    batch_replay,
    check_owner,
    check_session_id,
    claim_replayed,
    entry_replay,
    need_active,
    need_entry,
    need_session,
)
from ..rules.claim import PAGE, Ask, Head, check_live, end, give_back, pick, take
from ..rules.core import Core
from ..rules.machine import Event, apply
from ..store.etcd import KV, present
from ..store.keys import ClaimRef
from ..store.txn import MAX_TXN_OPS, Txn
from .checkpoints import drop, resume
from .verify import Verifier

#: compares and operations one claim (one commit) adds to a transaction
OPS_PER_CLAIM = 6
OPS_PER_COMMIT = 6


class Producers:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys
        self.verifier = Verifier(core)
        #: claim calls in flight per task on this replica (how widely to spread picks)
        self._busy: dict[str, int] = {}

    # claim -----------------------------------------------------------------

    async def _claim(self, txn: Txn, rec: EntryRecord, slots: Slots, session_id: int,
                     caller: Caller, traceparent: str = "") -> Callable[[int], pb.ClaimResponse]:
        """Add one claim (pending → writing) to a transaction being planned; returns
        its reply, given the transaction's revision (the token): with the checkpoint an
        earlier attempt left, and this attempt's number. ``traceparent``: the
        producer's span of the attempt (checked by the caller), kept on the entry."""
        check_producer(caller, rec.task_id, rec.file_id, rec.producers)
        claimable = rec.index.startswith(self.keys.ready_all(rec.task_id).decode()) or (
            rec.index.startswith(self.keys.delayed_of_task(rec.task_id).decode())
            and rec.not_before <= self.core.clock())
        if not claimable:
            raise IllegalTransition(f"entry {rec.file_id!r} is not claimable yet")
        # first: a session without a free slot is refused before anything is written
        ref = ClaimRef("p", rec.task_id, rec.file_id)
        await take(self.core, txn, ref, slots, caller.name, rec.claim_deadline,
                   rec.stall_after, pool=rec.pool)
        txn.require(present(rec.index.encode()))
        apply(rec, Event.CLAIM)
        rec.owner, rec.session = slots.agent, session_id
        rec.attempts += 1
        rec.traceparent = traceparent
        rec.remember("claimed", who=caller.name, label=slots.agent, attempt=rec.retry_count,
                     **({"host": slots.host} if slots.host else {}))
        self.core.put_entry(rec, txn)
        checkpoint, attempt = await resume(self.core, txn, rec, ref)
        staging = self.core.staging_dir(rec.task_id)

        def reply(rev: int) -> pb.ClaimResponse:
            entry = rec.to_pb(staging, revision=rev, token=rev)
            return pb.ClaimResponse(entry=entry, token=rev, path=entry.abs_attempt_path,
                                    checkpoint=checkpoint, attempt=attempt)

        return reply

    async def _session(self, txn: Txn, task_id: str, session_id: int,
                       caller: Caller) -> tuple[Slots, dict[str, int]]:
        """The task must hand out work and the session must live, take work (not
        drained, not being revoked) and be the caller's: both pinned. With the
        session's slots, the task's backlog limits (``Backlogs.check`` them once
        something is found to claim). Pinning the record also pins the session's
        lease: a rotation meanwhile makes this plan again on the new lease."""
        task_kv, agent_kv = await txn.get_many([self.keys.task(task_id),
                                                self.keys.agent(session_id)])
        limits = need_active(task_kv, task_id)
        record = need_session(agent_kv, session_id)
        check_owner(caller, agent_kv, f"session {session_id:x}")
        return await Slots.read(txn, self.keys, record), limits

    async def claim(self, req: pb.ClaimRequest, caller: Caller) -> pb.ClaimResponse:
        self._busy[req.task_id] = self._busy.get(req.task_id, 0) + 1
        try:
            return await self._claim_one(req, caller)
        finally:
            self._busy[req.task_id] -= 1
            if not self._busy[req.task_id]:
                del self._busy[req.task_id]

    async def _claim_one(self, req: pb.ClaimRequest, caller: Caller) -> pb.ClaimResponse:
        check_id("task_id", req.task_id)
        if req.file_id:
            check_id("file_id", req.file_id)
        check_session_id(req.session_id)
        check_traceparent(req.traceparent)
        staging = self.core.staging_dir(req.task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.ClaimResponse]:
            slots, limits = await self._session(txn, req.task_id, req.session_id, caller)
            if req.file_id:
                rec = need_entry(await txn.get(self.keys.entry(req.task_id, req.file_id)),
                                 req.task_id, req.file_id)
                check_producer(caller, rec.task_id, rec.file_id, rec.producers)
                self._check_claimable(rec, staging)
            else:
                (rec,) = await self._pick(txn, req.task_id, 1, caller, slots)
            # Last: a producer waits out back-pressure only when there is work for it.
            await self.core.backlogs.check(req.task_id, limits)
            return await self._claim(txn, rec, slots, req.session_id, caller,
                                     req.traceparent)

        def replay(raw: bytes, rev: int) -> pb.ClaimResponse:
            resp = pb.ClaimResponse.FromString(raw)
            claim_replayed(resp, rev)
            return resp

        return await self.core.txns.run(planner, req.request_id, replay)

    def _check_claimable(self, rec: EntryRecord, staging: str) -> None:
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

    async def _candidates(self, txn: Txn, task_id: str) -> list[KV]:
        """Index keys at the head of the task's ready index, and retries whose backoff
        is over and which the scheduler has not moved to the ready index yet (from the
        view's windows of both indexes, or straight from etcd). The view follows the
        delayed index too, so that "nothing to claim" on it is nothing as of now."""
        head = await txn.scan(self.keys.ready_all(task_id), PAGE, keys_only=True)
        now_ms = int(self.core.clock() * 1000)
        base = self.keys.delayed_of_task(task_id)
        delayed = await txn.scan(base, PAGE, keys_only=True)
        return head + [kv for kv in delayed
                       if int(self.keys.parse_tail(kv.key, base)[0]) <= now_ms]

    async def _pick(self, txn: Txn, task_id: str, want: int,
                    caller: Caller, slots: Slots) -> list[EntryRecord]:
        """Up to ``want`` claimable entries from the head of the ready index.

        The index is sorted by priority (with aging) then age, so the head is
        the work to do first; no claim ever scans the task. Concurrent claimers
        on this replica pass over entries another planner holds (the view's
        reservations); claimers on other replicas read the same head, so each
        tries it in a random order. Entries the caller may not produce (the
        task's access rules) are passed over.
        """
        page = await self._candidates(txn, task_id)

        def nothing(denied: int) -> NothingToClaim:
            if denied:
                return NothingToClaim(
                    f"nothing to claim in task {task_id!r} that {caller.name} may produce "
                    f"(the next {denied} are for other producers, by the task's access "
                    "rules)", task_id=task_id)
            return NothingToClaim(f"nothing to claim in task {task_id!r}", task_id=task_id)

        head = Head(task_id, page, min(len(page), want + self._busy.get(task_id, 1) - 1),
                    self.keys.ready_all(task_id),
                    current=lambda rec, key: rec.state == PENDING and rec.index == key.decode(),
                    nothing=nothing, allowed=lambda rec: may(caller, rec.producers),
                    pool_of=lambda rec: rec.pool, pools=slots.pools)
        return [rec for _, rec in await pick(self.core, txn, head, want)]

    async def claim_batch(self, req: pb.ClaimBatchRequest,
                          caller: Caller) -> pb.ClaimBatchResponse:
        """Claim up to ``max`` entries in one transaction (as many as etcd's op limit
        allows); all or nothing. Each claim's token is that transaction's revision."""
        check_id("task_id", req.task_id)
        check_session_id(req.session_id)
        if req.max < 1:
            raise InvalidArgument("max must be at least 1")
        want = min(req.max, MAX_TXN_OPS // OPS_PER_CLAIM)

        async def planner(txn: Txn) -> Callable[[int], pb.ClaimBatchResponse]:
            replies = await self._claim_many(txn, req.task_id, req.session_id, want, caller)

            def reply(rev: int) -> pb.ClaimBatchResponse:
                return pb.ClaimBatchResponse(claims=[r(rev) for r in replies])

            return reply

        def replay(raw: bytes, rev: int) -> pb.ClaimBatchResponse:
            resp = pb.ClaimBatchResponse.FromString(raw)
            for c in resp.claims:
                claim_replayed(c, rev)
            return resp

        return await self.core.txns.run(planner, req.request_id, replay)

    async def _claim_many(self, txn: Txn, task_id: str, session_id: int, want: int,
                          caller: Caller, traceparents: list[str] | None = None
                          ) -> list[Callable[[int], pb.ClaimResponse]]:
        """Add up to ``want`` claims of the task's next entries to a transaction being
        planned (at least one, or the refusal saying why there is none): no more than
        the session's free slots and the task's backlog limits leave room for.
        ``traceparents``: the i-th claim's attempt span."""
        slots, limits = await self._session(txn, task_id, session_id, caller)
        free = slots.free
        picked = await self._pick(txn, task_id, want if free is None else
                                  max(1, min(want, free)), caller, slots)
        # No more than the task's backlog limits leave room for (at least one).
        room = await self.core.backlogs.check(task_id, limits)
        if room is not None:
            picked = picked[:max(1, room)]
        spans = traceparents or []
        return [await self._claim(txn, rec, slots, session_id, caller,
                                  spans[i] if i < len(spans) else "")
                for i, rec in enumerate(picked)]

    # commit and fail -------------------------------------------------------------

    async def _live_claims(
        self, txn: Txn, items: list[tuple[str, str, int, int]], caller: Caller
    ) -> list[tuple[EntryRecord, KV]]:
        """Entry and claim of each (task, file, token, session) whose token is the live
        claim, held by the caller (and by that session, when one is named), in a task
        not cancelled (its header is pinned too)."""
        asks = []
        for task_id, file_id, token, session_id in items:
            check_id("task_id", task_id)
            check_id("file_id", file_id)
            asks.append(Ask(ClaimRef("p", task_id, file_id), token, session_id))
        return [(rec, claim) for claim, rec in await check_live(self.core, txn, asks, caller)]

    def _finish_claim(self, txn: Txn, rec: EntryRecord, claim: KV, token: int) -> None:
        # guarded on the token (the claim read): a claim lost meanwhile fails the commit
        end(self.core, txn, ClaimRef("p", rec.task_id, rec.file_id), claim, guard=True)

    async def _commit(self, txn: Txn, rec: EntryRecord, claim: KV,
                      req: pb.CommitRequest) -> None:
        """Add one commit to a transaction; the scheduler hears if it verified the entry."""
        if req.size < 0:
            raise InvalidArgument(f"size {req.size} is negative")
        if req.digest and not DIGEST_RE.match(req.digest):
            raise InvalidArgument("digest must be 64 lower-case hex digits (BLAKE3)")
        if not req.digest and not rec.digest_optional:
            raise InvalidArgument(
                f"commit of {rec.task_id}/{rec.file_id} needs the producer's BLAKE3 digest "
                "(baton commit --digest HEX, or --file PATH to compute it); the task does "
                "not set digest_optional", task_id=rec.task_id,
                file_id=rec.file_id)
        if rec.expected_size and req.size != rec.expected_size:
            raise InvalidArgument(
                f"size {req.size} differs from the manifest's expected_size "
                f"{rec.expected_size}", task_id=rec.task_id, file_id=rec.file_id)
        if rec.expected_digest and req.digest and req.digest != rec.expected_digest:
            raise InvalidArgument("digest differs from the manifest's expected_digest",
                                  task_id=rec.task_id, file_id=rec.file_id)
        try:
            attributes = parse_attributes(req.attributes) if req.attributes else {}
        except InvalidArgument as e:
            raise InvalidArgument(f"commit of {rec.task_id}/{rec.file_id}: {e.message}",
                                  task_id=rec.task_id, file_id=rec.file_id) from None
        self._finish_claim(txn, rec, claim, req.token)
        # a commit makes the attempt's checkpoint moot: the next attempt, if a report
        # sends the entry back, starts afresh on what is on disk
        drop(self.core, txn, rec, ClaimRef("p", rec.task_id, rec.file_id))
        apply(rec, Event.COMMIT)
        rec.size, rec.committed_digest = req.size, req.digest
        rec.committed_token = req.token  # its attempt's file is the entry's bytes now
        # Kept as sent (numbers keep every digit), and only when there is something.
        rec.attributes = req.attributes if attributes else ""
        rec.remember("committed", **actor_of(claim), token=req.token, size=req.size,
                     **({"digest": req.digest} if req.digest else {}))
        early = self.verifier.early_of(txn, rec.task_id, rec.file_id, req.token)
        obs, rec.observed = early or rec.observation(), None
        expected = req.digest or rec.expected_digest
        if (obs is not None and obs.token in (0, req.token) and expected
                and (obs.size, obs.digest) == (req.size, expected)
                and await self.verifier.settle(txn, rec, obs.size, obs.digest,
                                               who=obs.identity, label=obs.reporter,
                                               traceparent=obs.traceparent)):
            # The watcher's report came first and vouches for exactly these bytes.
            self.verifier.notify(rec, txn)
        # Anything else seen before the commit (another attempt's file, or this one's
        # before it was complete) does not vouch for these bytes: the watcher's report
        # after the commit decides.
        self.core.put_entry(rec, txn)

    async def commit(self, req: pb.CommitRequest, caller: Caller) -> pb.Entry:
        staging = self.core.staging_dir(req.task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.Entry]:
            ((rec, claim),) = await self._live_claims(
                txn, [(req.task_id, req.file_id, req.token, req.session_id)], caller)
            await self._commit(txn, rec, claim, req)
            return lambda rev: rec.to_pb(staging, revision=rev)

        return await self.core.txns.run(planner, req.request_id, entry_replay)

    async def commit_batch(self, req: pb.CommitBatchRequest,
                           caller: Caller) -> pb.CommitBatchResponse:
        """Commit many claims in one transaction, all or nothing."""
        if not req.commits:
            raise InvalidArgument("a batch needs at least one commit")
        if len(req.commits) > MAX_TXN_OPS // OPS_PER_COMMIT:
            raise InvalidArgument(
                f"at most {MAX_TXN_OPS // OPS_PER_COMMIT} commits per batch (etcd's "
                "operation limit per transaction)")
        self.check_distinct(req.commits)

        async def planner(txn: Txn) -> Callable[[int], pb.CommitBatchResponse]:
            live = await self._live_claims(
                txn, [(c.task_id, c.file_id, c.token, c.session_id) for c in req.commits],
                caller)
            for (rec, claim), c in zip(live, req.commits, strict=True):
                await self._commit(txn, rec, claim, c)

            def reply(rev: int) -> pb.CommitBatchResponse:
                return pb.CommitBatchResponse(entries=[
                    rec.to_pb(self.core.staging_dir(rec.task_id), revision=rev)
                    for rec, _ in live])

            return reply

        return await self.core.txns.run(planner, req.request_id,
                                        batch_replay(pb.CommitBatchResponse))

    @staticmethod
    def check_distinct(commits: Sequence[pb.CommitRequest]) -> None:
        """Commits of one entry would share its record (claim.check_live): the second
        would find it written. Refused before anything is read, as AckBatch does."""
        seen: dict[tuple[str, str], int] = {}
        for i, c in enumerate(commits):
            if (c.task_id, c.file_id) in seen:
                raise InvalidArgument(
                    f"commits [{seen[c.task_id, c.file_id]}] and [{i}] both commit "
                    f"{c.task_id}/{c.file_id}")
            seen[c.task_id, c.file_id] = i

    async def fail(self, req: pb.FailRequest, caller: Caller) -> pb.Entry:
        """Give a claim up: the entry takes the retry path (after ``delay_seconds``
        instead of the backoff, when given), or goes dead at once when ``permanent``.
        Bad delays are refused before anything is read."""
        check_delay("delay_seconds", req.delay_seconds, permanent=req.permanent)
        if req.release and (req.permanent or req.delay_seconds):
            raise InvalidArgument("release gives an unbegun claim back as it was: not with "
                                  "permanent or delay_seconds")
        staging = self.core.staging_dir(req.task_id)
        how = " permanently" if req.permanent else ""
        reason = f"producer failed{how}: {req.reason or 'no reason given'}"

        async def planner(txn: Txn) -> Callable[[int], pb.Entry]:
            ((rec, claim),) = await self._live_claims(
                txn, [(req.task_id, req.file_id, req.token, req.session_id)], caller)
            self._finish_claim(txn, rec, claim, req.token)
            if req.release:
                # as it was: its error is still an earlier attempt's, if any
                give_back(self.core, txn, rec, ClaimRef("p", rec.task_id, rec.file_id),
                          req.token, actor=actor_of(claim), spend=False, event="released",
                          reason=rec.error, details={
                              "reason": req.reason or "claimed ahead, not begun"})
                return lambda rev: rec.to_pb(staging, revision=rev)
            self.core.retry_or_dead(rec, reason, token=req.token, who=caller.name,
                                    delay=req.delay_seconds, permanent=req.permanent)
            self.core.put_entry(rec, txn)
            return lambda rev: rec.to_pb(staging, revision=rev)

        return await self.core.txns.run(planner, req.request_id, entry_replay)
