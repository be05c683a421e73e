"""The staging retention: a consumed entry's file leaves staging once its retention has
passed since the last ack.

The watcher owning the task's shard does the removing; the registry decides. A removal
is recorded first, in one guarded transaction (:meth:`StagingRetention.mark`), then the
watcher unlinks the file. The transaction believes only the shard's owner at the
current epoch (``shards.check_reporter``, as for reports), and only for an entry that
every receiving group has acked, whose retention has passed, and whose file still has
the bytes it was verified with: the watcher sends the digest it read just now, and a
file that changed after verification is recorded in the journal and kept. A crash
between the record and the unlink leaves a marked entry whose file is still there; the
watcher's next look unlinks it (its digest checked again), so the mark is the truth of
what staging holds (``Task.staging_bytes``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...kernel.errors import InvalidArgument
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import ANONYMOUS, Caller
from ..records.manifest import DIGEST_RE, check_id
from ..records.model import CONSUMED, EntryRecord, now
from ..rules.core import Core
from ..store.txn import Txn
from .shards import reported_entry

log = logging.getLogger("baton.registry")

#: seconds around an entry's staging removal coming due during which the archiver
#: waits for the watcher to make it (a task archived takes its entries out of etcd,
#: and with them the proof a watcher needs); a removal due later than this after the
#: task is due for the archive, or due longer ago, does not hold the archive back
ARCHIVE_GRACE = 300.0
#: entries read per page when looking for files still held
PAGE = 1000

Outcome = pb.RemoveStagedResponse.Outcome


def _replay(raw: bytes, revision: int) -> pb.RemoveStagedResponse:
    """The recorded reply of a removal, as first sent."""
    reply = pb.RemoveStagedResponse.FromString(raw)
    reply.entry.revision = revision
    return reply


async def holds_staging(core: Core, task_id: str, clock: float) -> bool:
    """Whether a task due for the archive should wait for the staging retention: some
    consumed entry's file, not yet removed, falls due within ``ARCHIVE_GRACE`` of
    ``clock`` (before or after). Its defaults (24 h both) put the last entries' removal
    right at the archive time; waiting for them spares their files being left behind."""
    async for kv in core.etcd.scan(core.keys.entries(task_id), page=PAGE):
        due = EntryRecord.load(kv.value).staging_due
        if due is not None and abs(due - clock) < ARCHIVE_GRACE:
            return True
    return False


class StagingRetention:
    """The registry's side of the staging retention: the guarded mark."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys

    async def mark(self, req: pb.RemoveStagedRequest,
                   caller: Caller = ANONYMOUS) -> pb.RemoveStagedResponse:
        """Record that the entry's file leaves staging, if the caller may remove it
        now; the outcome says what the watcher is to do with the file."""
        check_id("task_id", req.task_id)
        check_id("file_id", req.file_id)
        if req.size < 0 or not DIGEST_RE.match(req.digest):
            raise InvalidArgument("a staging removal needs size ≥ 0 and the 64-hex-digit "
                                  "BLAKE3 digest of the file as it is now")
        staging = self.core.staging_dir(req.task_id)

        async def planner(txn: Txn) -> Callable[[int], pb.RemoveStagedResponse]:
            _, rec = await reported_entry(txn, self.keys, req, caller)
            outcome, due_in = self._decide(rec, req)
            if outcome == Outcome.OUTCOME_MARKED and not rec.staging_removed:
                rec.staging_removed = {"at": now(), "watcher": req.watcher_id,
                                       "identity": caller.name, "label": req.reporter}
                rec.remember("staging_removed", who=caller.name, label=req.reporter,
                             watcher=req.watcher_id, size=rec.size, digest=req.digest)
                self.core.put_entry(rec, txn)
            elif outcome == Outcome.OUTCOME_CHANGED and rec.staging_refused != req.digest:
                rec.staging_refused = req.digest
                rec.remember("staging_changed", who=caller.name, label=req.reporter,
                             reason="changed after verification: kept in staging",
                             verified=rec.digest, digest=req.digest, size=req.size)
                self.core.put_entry(rec, txn)

            def reply(rev: int) -> pb.RemoveStagedResponse:
                return pb.RemoveStagedResponse(entry=rec.to_pb(staging, revision=rev),
                                               outcome=outcome, due_in_seconds=due_in)
            return reply

        return await self.core.txns.run(planner, req.request_id, _replay)

    def _decide(self, rec: EntryRecord,
                req: pb.RemoveStagedRequest) -> tuple[Outcome.ValueType, float]:
        """What may happen to the entry's file (and, not due yet, in how long)."""
        if rec.staging_removed:
            # Marked before (a retry, or a crash before the unlink): the unlink is
            # still the watcher's to do, for the verified bytes only.
            same = req.digest == rec.digest
            return (Outcome.OUTCOME_MARKED if same else Outcome.OUTCOME_CHANGED), 0.0
        if rec.state != CONSUMED or rec.parts:
            return Outcome.OUTCOME_NOT_CONSUMED, 0.0
        if rec.retention < 0:
            return Outcome.OUTCOME_KEPT, 0.0
        due_in = rec.consumed_at + rec.retention - self.core.clock()
        if due_in > 0:
            return Outcome.OUTCOME_NOT_DUE, due_in
        if req.digest != rec.digest or req.size != rec.size:
            return Outcome.OUTCOME_CHANGED, 0.0
        return Outcome.OUTCOME_MARKED, 0.0
