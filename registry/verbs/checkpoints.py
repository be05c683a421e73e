"""Checkpoints: what an attempt records of its progress, so that the next resumes there.

The holder of a producer claim (or of a consume lease) records a checkpoint: opaque
``data`` (at most ``contract.MAX_CHECKPOINT_BYTES``), a ``progress`` fraction and a
short ``message``. The latest is kept on a key of its own beside the entry
(``checkpoints/{task}/p/{file}``, ``checkpoints/{task}/c/{group}/{file}``), not on
the entry: a checkpoint every few seconds must not bloat every transition of the
entry. The entry carries only a flag (``checkpointed``, ``group_checkpoints``), set
by the first checkpoint, so that a claim reads the key only when there is one.

Each checkpoint is one guarded transaction, refused for a token that is not the live
claim exactly as a commit is (``claim.check_live``). It survives the entry going back
to ``pending`` (a fail, a deadline, a lost session): the next attempt's claim (or
consume) reply carries it. A commit drops the producer's, an ack its group's.

The journal keeps at most one ``checkpoint`` record per entry per
:data:`JOURNAL_EVERY` seconds (the entry remembers when it last did, so a
checkpoint in between writes only its key: one etcd request, the read of the
entry and claim coming from the view); the key always holds the latest.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ...kernel.contract import MAX_CHECKPOINT_BYTES, MAX_CHECKPOINT_MESSAGE, data_digest
from ...kernel.errors import InvalidArgument
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import Caller
from ..records.manifest import check_id
from ..records.model import EntryRecord, _iso
from ..rules.checks import actor_of, check_session_id
from ..rules.claim import Ask, check_live
from ..rules.core import Core
from ..store.etcd import KV
from ..store.keys import ClaimRef
from ..store.txn import Txn

#: the journal records a checkpoint of an entry at most once per this many seconds
JOURNAL_EVERY = 30.0


@dataclass
class CheckpointRecord:
    """The stored checkpoint (JSON; ``data`` in base64)."""

    data: str
    progress: float
    message: str
    token: int
    attempt: int
    at: float
    digest: str

    @classmethod
    def load(cls, kv: KV | None) -> CheckpointRecord | None:
        if kv is None:
            return None
        try:
            return cls(**json.loads(kv.value))
        except (TypeError, ValueError):
            return None  # unreadable: as if none had been kept

    def dump(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @property
    def stamp(self) -> str:
        """When it was recorded, RFC 3339 (UTC)."""
        return _iso(self.at)

    def to_pb(self, with_data: bool = True) -> pb.Checkpoint:
        return pb.Checkpoint(data=base64.b64decode(self.data) if with_data else b"",
                             progress=self.progress, message=self.message,
                             token=self.token, attempt=self.attempt, at=self.stamp,
                             digest=self.digest)


def check_request(req: pb.CheckpointRequest) -> None:
    """Refuse a checkpoint whose fields are out of bounds, naming the field."""
    check_id("task_id", req.task_id)
    check_id("file_id", req.file_id)
    if req.group:
        check_id("group", req.group)
    if req.session_id:  # 0: not said (the identity still is checked)
        check_session_id(req.session_id)
    if len(req.data) > MAX_CHECKPOINT_BYTES:
        raise InvalidArgument(f"data is {len(req.data)} bytes; a checkpoint holds at most "
                              f"{MAX_CHECKPOINT_BYTES}", field="data")
    if not (math.isfinite(req.progress) and 0 <= req.progress <= 1):
        raise InvalidArgument(f"progress {req.progress} is not a fraction within 0..1",
                              field="progress")
    if len(req.message) > MAX_CHECKPOINT_MESSAGE:
        raise InvalidArgument(f"message is {len(req.message)} characters; at most "
                              f"{MAX_CHECKPOINT_MESSAGE}", field="message")


def ref_of(task_id: str, file_id: str, group: str) -> ClaimRef:
    return ClaimRef("c", task_id, file_id, group) if group else ClaimRef("p", task_id, file_id)


def has_checkpoint(rec: EntryRecord, ref: ClaimRef) -> bool:
    return rec.checkpointed if ref.kind == "p" else ref.group in rec.group_checkpoints


async def last(core: Core, txn: Txn, rec: EntryRecord, ref: ClaimRef
               ) -> CheckpointRecord | None:
    """The checkpoint an earlier attempt left on ``rec`` (for ``ref``'s kind and
    group), read in ``txn`` only when the entry says there is one."""
    if not has_checkpoint(rec, ref):
        return None
    return CheckpointRecord.load(await txn.get(core.keys.checkpoint(ref)))


async def peek(core: Core, rec: EntryRecord, ref: ClaimRef) -> CheckpointRecord | None:
    """The checkpoint kept on ``rec`` for ``ref``'s kind and group, read straight
    from etcd outside any transaction (explain)."""
    if not has_checkpoint(rec, ref):
        return None
    return CheckpointRecord.load(await core.etcd.get(core.keys.checkpoint(ref)))


async def resume(core: Core, txn: Txn, rec: EntryRecord, ref: ClaimRef
                 ) -> tuple[pb.Checkpoint | None, int]:
    """What a claim (a consume) made in ``txn`` replies with: the last checkpoint and
    this attempt's number. A producer's attempts are counted on the entry; a
    consumer group's by its checkpoints (one more than the last that checkpointed)."""
    kept = await last(core, txn, rec, ref)
    attempt = (rec.attempts if ref.kind == "p" else
               kept.attempt + 1 if kept is not None else 1)
    return (kept.to_pb() if kept is not None else None), attempt


def drop(core: Core, txn: Txn, rec: EntryRecord, ref: ClaimRef) -> None:
    """Delete the checkpoint of a finished attempt (a commit, an ack), in the
    caller's transaction, which writes the entry."""
    if ref.kind == "p":
        if rec.checkpointed:
            txn.delete(core.keys.checkpoint(ref))
            rec.checkpointed = False
    elif ref.group in rec.group_checkpoints:
        txn.delete(core.keys.checkpoint(ref))
        rec.group_checkpoints.remove(ref.group)


class Checkpoints:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.keys = core.keys

    async def checkpoint(self, req: pb.CheckpointRequest,
                         caller: Caller) -> pb.CheckpointResponse:
        """Record the latest checkpoint of a live claim, in one guarded transaction."""
        check_request(req)
        ref = ref_of(req.task_id, req.file_id, req.group)
        key = self.keys.checkpoint(ref)

        async def planner(txn: Txn) -> Callable[[int], pb.CheckpointResponse]:
            ((claim, rec),) = await check_live(
                self.core, txn, [Ask(ref, req.token, req.session_id)], caller)
            if ref.kind == "p":
                # counted on the entry: the key is written blind, one request in all
                attempt = rec.attempts
            else:
                old = CheckpointRecord.load(await txn.get(key))
                attempt = (1 if old is None else
                           old.attempt if old.token == req.token else old.attempt + 1)
            now = self.core.clock()
            kept = CheckpointRecord(
                data=base64.b64encode(req.data).decode(), progress=req.progress,
                message=req.message, token=req.token, attempt=attempt, at=now,
                digest=data_digest(req.data))
            write_entry = False
            if now - rec.checkpoint_journalled >= JOURNAL_EVERY:
                rec.checkpoint_journalled, write_entry = now, True
                self.core.journal_only(
                    rec, "checkpoint", txn, **actor_of(claim), token=req.token,
                    **({"group": req.group} if req.group else {}), attempt=attempt,
                    reason=f"progress {req.progress:.0%}"
                           + (f": {req.message}" if req.message else ""))
            txn.put(key, kept.dump())
            if not has_checkpoint(rec, ref):  # the first: the entry says there is one
                if ref.kind == "p":
                    rec.checkpointed = True
                else:
                    rec.group_checkpoints.append(ref.group)
                write_entry = True
            if write_entry:
                self.core.put_entry(rec, txn)
            return lambda rev: pb.CheckpointResponse(checkpoint=kept.to_pb(with_data=False))

        def replay(raw: bytes, rev: int) -> pb.CheckpointResponse:
            return pb.CheckpointResponse.FromString(raw)

        return await self.core.txns.run(planner, req.request_id, replay)
