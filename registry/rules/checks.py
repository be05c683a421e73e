"""What claims of both kinds share: the claim key's value, claim slots, and the
checks every planner makes on what it read (task, session, entry)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ...kernel.contract import attempt_path
from ...kernel.errors import (
    Draining,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SessionExpired,
    SlotsExhausted,
    StaleToken,
    TaskNotActive,
)
from ...kernel.v1 import baton_pb2 as pb
from ..records.identity import ANONYMOUS, Caller
from ..records.model import EntryRecord, TaskRecord, now
from ..store.etcd import KV
from ..store.keys import Keys
from ..store.txn import Txn
from .pools import Pools


def claim_value(agent: str, session: int, slot: int = -1, identity: str = "",
                unit: tuple[str, int] | None = None) -> bytes:
    """A claim key's value: who holds it, under which session (the claim's lease is the
    session's lease of the moment, which a rotation changes), which slot, since when,
    and the concurrency pool's unit it holds (``unit``: pool and number)."""
    value: dict[str, object] = {"agent": agent, "session": session, "slot": slot,
                                "at": now()}
    if identity:
        value["identity"] = identity
    if unit is not None:
        value["pool"], value["unit"] = unit
    return json.dumps(value).encode()


def _json(kv: KV | None) -> dict[str, Any]:
    if kv is None:
        return {}
    try:
        data = json.loads(kv.value)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def claim_session(claim: KV) -> int:
    """The session a claim (or its twin) names in its value (0: none named)."""
    try:
        return int(_json(claim).get("session", 0) or 0)
    except (TypeError, ValueError):
        return 0


def claim_slot(claim: KV) -> int:
    """The slot a claim holds, as its value names it (-1: none)."""
    try:
        return int(_json(claim).get("slot", -1))
    except (TypeError, ValueError):
        return -1


def claim_unit(claim: KV | None) -> tuple[str, int] | None:
    """The concurrency pool's unit a claim (or its twin) holds: pool and number."""
    data = _json(claim)
    pool, unit = data.get("pool"), data.get("unit")
    if isinstance(pool, str) and pool and isinstance(unit, int):
        return pool, unit
    return None


def claimed_at(claim: KV) -> str:
    """When a claim was made (its value says; "" for a claim from before it did)."""
    return str(_json(claim).get("at", ""))


@dataclass(frozen=True)
class SessionRecord:
    """An agent session's record (``agents/{session}``) as read: its id comes from the
    key, its lease of the moment from the key's lease."""

    session_id: int
    lease: int
    info: dict[str, Any]

    @classmethod
    def of(cls, kv: KV, session_id: int) -> SessionRecord:
        return cls(session_id, kv.lease, _json(kv))

    @property
    def agent(self) -> str:
        return str(self.info.get("agent", "")) or "?"

    @property
    def host(self) -> str:
        return str(self.info.get("host", ""))

    @property
    def ttl(self) -> int:
        return int(self.info.get("ttl", 0) or 0)

    @property
    def draining(self) -> bool:
        return bool(self.info.get("draining"))

    @property
    def revoked(self) -> bool:
        return bool(self.info.get("revoked"))

    @property
    def rotating_from(self) -> int:
        """The old lease of a rotation under way (0: none): it still holds keys."""
        return int(self.info.get("rotating_from", 0) or 0)

    @property
    def leases(self) -> list[int]:
        """Every lease holding keys of the session now (two during a rotation)."""
        return [self.lease] + ([self.rotating_from] if self.rotating_from else [])

    def with_info(self, **changes: Any) -> bytes:
        """The record's value with ``changes`` (a value of None removes the field)."""
        info = {**self.info, **changes}
        return json.dumps({k: v for k, v in info.items() if v is not None}).encode()


def identity_of(kv: KV | None) -> str:
    """The identity that opened a session (its record) or holds a claim (its key)."""
    if kv is None:
        return ""
    try:
        return str(json.loads(kv.value).get("identity", ""))
    except ValueError:
        return ""


def check_owner(caller: Caller, kv: KV | None, what: str) -> None:
    """Refuse ``caller`` unless it is the identity behind ``kv`` (a session record or a
    claim): a session id or a token is not a capability on its own."""
    if caller is ANONYMOUS or caller.name == identity_of(kv):
        return
    raise PermissionDenied(f"{what} belongs to another identity, not to {caller.describe()}",
                           identity=caller.name)


def check_claim_session(claim: KV, session_id: int, what: str) -> None:
    """A token call that names its session must name the one holding the claim."""
    if session_id and claim_session(claim) != session_id:
        raise PermissionDenied(f"{what} is held by another session than {session_id:x}",
                               session_id=session_id)


def actor_of(kv: KV | None) -> dict[str, str]:
    """Who holds a claim or a session, for the journal: ``who`` the authenticated
    identity behind it, ``label`` the name its client gave (free text, shown as such)."""
    return {"who": identity_of(kv), "label": claim_holder(kv)}


def claim_holder(kv: KV | None) -> str:
    if kv is None:
        return ""
    try:
        return str(json.loads(kv.value).get("agent", ""))
    except ValueError:
        return ""


def need_entry(kv: KV | None, task_id: str, file_id: str) -> EntryRecord:
    """The entry a read returned; ``NotFound`` if it returned none."""
    if kv is None:
        raise NotFound(f"no entry {file_id!r} in task {task_id!r}", task_id=task_id,
                       file_id=file_id)
    return EntryRecord.load(kv.value)


def need_task(kv: KV | None, task_id: str, active: bool = False) -> TaskRecord:
    """The task a read returned; ``NotFound``, or with ``active`` (new work is to be
    handed out: a claim, a consume) ``TaskNotActive`` unless it is active."""
    if kv is None:
        raise NotFound(f"no task {task_id!r}", task_id=task_id)
    task = TaskRecord.load(kv.value)
    if active:
        _hands_out_work(task_id, task.status, task.status_reason)
    return task


#: task headers' (status, reason, backlog limits) by (key, revision), as
#: :func:`need_active` read them
_STATUS: dict[tuple[bytes, int], tuple[str, str, dict[str, int]]] = {}
#: headers remembered at most (the whole memory goes when full: it refills at once)
_STATUS_KEPT = 4096


def need_active(kv: KV | None, task_id: str) -> dict[str, int]:
    """``need_task(..., active=True)`` for a caller that wants only the verdict (a
    claim's) and the task's backlog limits (empty: none): the header is parsed once
    per revision, not once per claim."""
    status, reason, limits = _header(kv, task_id)
    _hands_out_work(task_id, status, reason)
    return limits


def task_status(kv: KV | None, task_id: str) -> str:
    """The status of the task whose header a read returned (``NotFound`` if none),
    for a caller that needs nothing else of it: parsed once per revision."""
    return _header(kv, task_id)[0]


def _header(kv: KV | None, task_id: str) -> tuple[str, str, dict[str, int]]:
    """A task header's status, status reason and backlog limits, from the memory of
    headers read (by key and revision) or parsed and remembered."""
    if kv is None:
        raise NotFound(f"no task {task_id!r}", task_id=task_id)
    at = (kv.key, kv.mod_revision)
    known = _STATUS.get(at) if kv.mod_revision else None
    if known is None:
        task = TaskRecord.load(kv.value)
        known = (task.status, task.status_reason, task.backlog_limits)
        if kv.mod_revision:
            if len(_STATUS) >= _STATUS_KEPT:
                _STATUS.clear()
            _STATUS[at] = known
    return known


def _hands_out_work(task_id: str, status: str, reason: str) -> None:
    """``TaskNotActive`` unless a task in ``status`` hands out new work."""
    # A completed task has nothing left to hand out: callers then find nothing.
    if status == "paused":
        # Paused keeps everything as it is and hands out no new work, to producers
        # and consumers alike; what is in hand may still be finished.
        why = f" ({reason})" if reason else ""
        raise TaskNotActive(f"task {task_id!r} is paused{why}: it hands out no new claims "
                            "or consumes until `baton task resume`; claims and consumes "
                            "in hand may still be finished", task_id=task_id, status=status)
    if status not in ("active", "completed"):
        raise TaskNotActive(f"task {task_id!r} is {status}", task_id=task_id, status=status)


#: statuses in which every token of a task is void (its claims are being revoked, or gone)
VOID = ("cancelled", "deleting")


def voided(kv: KV | None) -> bool:
    """Whether a task header (as read) makes every token of its task void."""
    return kv is not None and task_status(kv, "") in VOID


def check_tokens_live(kv: KV | None, task_id: str, what: str, token: int) -> None:
    """Refuse a token call (commit, fail, ack, nack) on a cancelled task. Read with the
    claim in the call's own transaction (the header is pinned), so the status change
    alone stops it: cancel deletes a large task's claims a chunk at a time after it."""
    status = task_status(kv, task_id)
    if status in VOID:
        raise StaleToken(f"{what} is void: task {task_id!r} is {status}",
                         task_id=task_id, token=token, status=status)


def need_session(kv: KV | None, session_id: int) -> SessionRecord:
    """The record of a session a read returned, for a call that takes new work:
    ``SessionExpired`` if none (or an operator is revoking it), ``Draining`` if its
    host is drained. Both come from the record the claim reads anyway."""
    if kv is None:
        raise SessionExpired(f"session {session_id:x} has expired or never existed",
                             session_id=session_id)
    record = SessionRecord.of(kv, session_id)
    if record.revoked:
        raise SessionExpired(f"session {session_id:x} is being revoked by an operator",
                             session_id=session_id)
    if record.draining:
        raise Draining(f"session {session_id:x} of {record.agent} is on drained host "
                       f"{record.host!r}: it takes no new work (claims held may finish)",
                       session_id=session_id, host=record.host)
    return record


class Slots:
    """A session's claim slots as one planner sees them.

    Slots are leased keys ``slots/{session}/{n}``, ``n < slots``: taking one is a
    create-only put in the claim's own transaction (``claim.take``), so two
    concurrent claims can never both take the last slot.
    """

    def __init__(self, keys: Keys, session: SessionRecord, used: list[KV]) -> None:
        self.keys = keys
        self.session_id = session.session_id
        #: the session's lease now, which its new keys are attached to
        self.lease = session.lease
        self.agent = session.agent
        self.host = session.host
        self.limit = int(session.info.get("slots", 0) or 0)
        self.taken = {keys.unit_number(kv.key) for kv in used}
        #: the concurrency pools this planner's claims take units of
        self.pools = Pools(keys)

    @classmethod
    async def read(cls, txn: Txn, keys: Keys, session: SessionRecord) -> Slots:
        limit = int(session.info.get("slots", 0) or 0)
        used = await txn.scan(keys.slots(session.session_id)) if limit > 0 else []
        return cls(keys, session, used)

    @property
    def free(self) -> int | None:
        """How many more claims the session may hold (None: no limit)."""
        return None if self.limit <= 0 else max(0, self.limit - len(self.taken))

    def reserve(self, rng: random.Random) -> int:
        """A free slot for a claim being planned (-1 when the session has no limit);
        ``claim.take`` writes its key. ``SlotsExhausted`` when none is free."""
        if self.limit <= 0:
            return -1
        free = [n for n in range(self.limit) if n not in self.taken]
        if not free:
            raise SlotsExhausted(
                f"agent {self.agent} holds {self.limit} claims already (its slot limit); "
                "finish one first", session_id=self.session_id, slots=self.limit)
        n = rng.choice(free)
        self.taken.add(n)  # later claims of the same transaction (a batch) take others
        return n


def check_session_id(session_id: int) -> None:
    if session_id <= 0:
        raise InvalidArgument("this call needs a session_id (open a session first)")


def claim_replayed(claim: pb.ClaimResponse, revision: int) -> None:
    """A recorded claim reply as first sent: its token is the revision of the
    transaction that applied it, and so is the token in its attempt's file name (the
    record was written before either was known)."""
    claim.token = claim.entry.token = claim.entry.revision = revision
    entry = claim.entry
    if not entry.parts:
        entry.attempt_path = attempt_path(entry.path, revision)
        entry.abs_attempt_path = claim.path = attempt_path(entry.abs_path, revision)


def entry_replay(raw: bytes, revision: int) -> pb.Entry:
    """The recorded reply of an entry-returning call, as first sent."""
    entry = pb.Entry.FromString(raw)
    entry.revision = revision
    return entry


Batch = TypeVar("Batch", pb.CommitBatchResponse, pb.AckBatchResponse)


def batch_replay(cls: type[Batch]) -> Callable[[bytes, int], Batch]:
    """How a batch call's recorded reply is sent again: every entry at the revision of
    the transaction that applied the batch."""

    def replay(raw: bytes, revision: int) -> Batch:
        resp = cls.FromString(raw)
        for entry in resp.entries:
            entry.revision = revision
        return resp

    return replay
