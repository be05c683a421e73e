"""The fused steps of an agent's loop: finish one entry and take the next, in one
etcd transaction.

A producer's loop is claim → write → commit → claim → ...; a consumer's is consume →
read → ack → consume → .... Each finish is followed at once by a take, so the two are
planned together and committed as one guarded transaction: one etcd request and one
message per step instead of two. The finish is what the call is for: when there is
nothing to take next (or the session may take no more), the finish still applies
and the reply says why there is no next (``next_error``), as the take alone would
have failed.

A take refused on the replica's view is decided again on etcd, as every call's is
(``txn``): the whole step is planned again on fresh reads, so a "nothing next" is
never the product of a view that is behind this replica's own writes. A "nothing
next" decided on a view that was current stands, as a lone claim's would.
"""

from __future__ import annotations

from collections.abc import Callable

from ...kernel.errors import (
    Backpressure,
    BatonError,
    InvalidArgument,
    NothingToClaim,
    to_status,
)
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import Caller
from ..records.manifest import check_id, check_traceparent
from ..rules.checks import claim_replayed
from ..store.txn import MAX_TXN_OPS, Txn
from .consumers import Consumers, _consumable, _leased
from .producers import OPS_PER_CLAIM, OPS_PER_COMMIT, Producers


def final(txn: Txn, error: BatonError) -> bool:
    """Whether a take refused with ``error`` stands: decided on etcd, "nothing to
    take" decided on a view that was current (``txn.Transactions.run``), or
    back-pressure (its backlog is always counted on etcd)."""
    return (txn.fresh or isinstance(error, Backpressure)
            or (txn.settled and isinstance(error, NothingToClaim)))


def next_error(error: BatonError) -> pb.CallError:
    """Why there is no next entry, as the take alone would have failed."""
    code, details, metadata = to_status(error)
    return pb.CallError(code=code.name, details=details, metadata=dict(metadata))


class Fused:
    def __init__(self, producers: Producers, consumers: Consumers) -> None:
        self.producers = producers
        self.consumers = consumers
        self.core = producers.core

    async def commit_and_claim(self, req: pb.CommitAndClaimRequest,
                               caller: Caller) -> pb.CommitAndClaimResponse:
        """Commit ``req.commit`` and claim the next entry of the task (``req.claim``:
        its task and session default to the commit's)."""
        commit = req.commit
        task_id = req.claim.task_id or commit.task_id
        session_id = req.claim.session_id or commit.session_id
        check_id("task_id", task_id)
        check_traceparent(req.claim.traceparent)
        if req.claim.file_id:
            raise InvalidArgument("the next claim of a fused step is the next claimable "
                                     "entry: it names no file_id")
        producers = self.producers
        staging = self.core.staging_dir(commit.task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.CommitAndClaimResponse]:
            ((rec, claim),) = await producers._live_claims(
                txn, [(commit.task_id, commit.file_id, commit.token, commit.session_id)],
                caller)
            await producers._commit(txn, rec, claim, commit)
            taken = None
            refused: BatonError | None = None
            try:
                slots, limits = await producers._session(txn, task_id, session_id, caller)
                (picked,) = await producers._pick(txn, task_id, 1, caller, slots)
                await self.core.backlogs.check(task_id, limits)
                taken = await producers._claim(txn, picked, slots, session_id, caller,
                                               req.claim.traceparent)
            except BatonError as e:
                if not final(txn, e):
                    raise  # decided on a view that may be behind: plan again on etcd
                refused, taken = e, None

            def reply(rev: int) -> pb.CommitAndClaimResponse:
                out = pb.CommitAndClaimResponse(entry=rec.to_pb(staging, revision=rev))
                if taken is not None:
                    out.next.CopyFrom(taken(rev))
                elif refused is not None:
                    out.next_error.CopyFrom(next_error(refused))
                return out

            return reply

        def replay(raw: bytes, rev: int) -> pb.CommitAndClaimResponse:
            out = pb.CommitAndClaimResponse.FromString(raw)
            out.entry.revision = rev
            if out.HasField("next"):
                claim_replayed(out.next, rev)
            return out

        return await self.core.txns.run(planner, commit.request_id, replay)

    async def commit_and_claim_batch(self, req: pb.CommitAndClaimBatchRequest,
                                     caller: Caller) -> pb.CommitAndClaimBatchResponse:
        """Commit ``req.commits`` and claim up to ``req.max`` next entries of the task, in
        one transaction: a producer loop working several entries per message. The
        commits are what the call is for: they apply when nothing is left to claim
        (``next_error`` says why), as a commit batch would; the claims are as many as
        etcd's operation limit leaves room for after the commits."""
        commits = list(req.commits)
        task_id = req.task_id or (commits[0].task_id if commits else "")
        check_id("task_id", task_id)
        if req.max < 0:
            raise InvalidArgument(f"max {req.max} is negative")
        if not commits and not req.max:
            raise InvalidArgument("a step needs at least one commit or a claim (max ≥ 1)")
        if len(req.traceparents) > max(req.max, 0):
            raise InvalidArgument(f"{len(req.traceparents)} traceparents for at most "
                                  f"{req.max} claims")
        for tp in req.traceparents:
            check_traceparent(tp)
        room = MAX_TXN_OPS - len(commits) * OPS_PER_COMMIT
        if room < 0 or (req.max and room < OPS_PER_CLAIM):
            raise InvalidArgument(
                f"{len(commits)} commits leave no room for a claim in one transaction "
                f"(etcd's operation limit: at most {MAX_TXN_OPS // OPS_PER_COMMIT} commits, "
                f"{(MAX_TXN_OPS - OPS_PER_CLAIM) // OPS_PER_COMMIT} with claims)")
        Producers.check_distinct(commits)
        want = min(req.max, room // OPS_PER_CLAIM)
        producers = self.producers

        async def planner(txn: Txn) -> Callable[[int], pb.CommitAndClaimBatchResponse]:
            live = await producers._live_claims(
                txn, [(c.task_id, c.file_id, c.token, c.session_id) for c in commits], caller)
            for (rec, claim), c in zip(live, commits, strict=True):
                await producers._commit(txn, rec, claim, c)
            taken: list[Callable[[int], pb.ClaimResponse]] = []
            refused: BatonError | None = None
            if want:
                try:
                    taken = await producers._claim_many(txn, task_id, req.session_id, want,
                                                        caller, list(req.traceparents))
                except BatonError as e:
                    if not final(txn, e):
                        raise  # decided on a view that may be behind: plan again on etcd
                    refused = e

            def reply(rev: int) -> pb.CommitAndClaimBatchResponse:
                out = pb.CommitAndClaimBatchResponse(
                    entries=[rec.to_pb(self.core.staging_dir(rec.task_id), revision=rev)
                             for rec, _ in live],
                    next=[t(rev) for t in taken])
                if refused is not None:
                    out.next_error.CopyFrom(next_error(refused))
                return out

            return reply

        def replay(raw: bytes, rev: int) -> pb.CommitAndClaimBatchResponse:
            out = pb.CommitAndClaimBatchResponse.FromString(raw)
            for e in out.entries:
                e.revision = rev
            for c in out.next:
                claim_replayed(c, rev)
            return out

        return await self.core.txns.run(planner, req.request_id, replay)

    async def ack_and_consume(self, req: pb.AckAndConsumeRequest,
                              caller: Caller) -> pb.AckAndConsumeResponse:
        """Ack ``req.ack`` and take the next entry for the group (``req.consume``: its
        task, group and session default to the ack's)."""
        ack = req.ack
        task_id = req.consume.task_id or ack.task_id
        group = req.consume.group or ack.group
        session_id = req.consume.session_id or ack.session_id
        check_id("task_id", task_id)
        check_id("group", group)
        if req.consume.file_id:
            raise InvalidArgument("the next consume of a fused step is the next "
                                     "available entry: it names no file_id")
        consumers = self.consumers
        staging = self.core.staging_dir(ack.task_id)
        next_staging = self.core.staging_dir(task_id)
        consumable = _consumable(group)

        async def planner(txn: Txn) -> Callable[[int], pb.AckAndConsumeResponse]:
            ((claim, rec),) = await consumers._live(txn, [ack], caller)
            consumers._ack(txn, rec, claim, ack)
            self.core.put_entry(rec, txn)
            taken = None
            resumed: tuple[pb.Checkpoint | None, int] = (None, 1)
            refused: BatonError | None = None
            try:
                slots = await consumers._session(txn, task_id, group, session_id, caller)
                ((entry_kv, taken),) = await consumers._pick(txn, task_id, group, consumable,
                                                             slots)
                resumed = await consumers._lease(txn, taken, group, slots, caller)
                read_at = entry_kv.mod_revision
            except BatonError as e:
                if not final(txn, e):
                    raise  # decided on a view that may be behind: plan again on etcd
                refused, taken, read_at = e, None, 0

            def reply(rev: int) -> pb.AckAndConsumeResponse:
                out = pb.AckAndConsumeResponse(entry=rec.to_pb(staging, revision=rev))
                if taken is not None:
                    out.next.CopyFrom(_leased(taken, next_staging, read_at, rev, group,
                                              *resumed))
                elif refused is not None:
                    out.next_error.CopyFrom(next_error(refused))
                return out

            return reply

        def replay(raw: bytes, rev: int) -> pb.AckAndConsumeResponse:
            out = pb.AckAndConsumeResponse.FromString(raw)
            out.entry.revision = rev
            if out.HasField("next"):
                out.next.token = rev
            return out

        return await self.core.txns.run(planner, ack.request_id, replay)
