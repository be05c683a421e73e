"""What claims of both kinds share: the claim key's value, claim slots, and the
checks every planner makes on what it read (task, session, entry)."""

from __future__ import annotations

import json
import random

from baton_relay.client.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SessionExpired,
    SlotsExhausted,
    StaleToken,
    TaskNotActive,
)
from baton_relay.client.v1 import baton_pb2 as pb

from ._etcd import KV
from .identity import ANONYMOUS, Caller
from .keys import Keys
from .model import EntryRecord, TaskRecord
from .txn import Txn


def claim_value(agent: str, session: int, slot: int = -1, identity: str = "") -> bytes:
    value: dict[str, object] = {"agent": agent, "session": session, "slot": slot}
    if identity:
        value["identity"] = identity
    return json.dumps(value).encode()


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
    if session_id and claim.lease != session_id:
        raise PermissionDenied(f"{what} is held by another session than {session_id:x}",
                               session_id=session_id)


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
    """The task a read returned; ``NotFound``, or ``TaskNotActive`` if ``active``."""
    if kv is None:
        raise NotFound(f"no task {task_id!r}", task_id=task_id)
    task = TaskRecord.load(kv.value)
    # A completed task has nothing left to hand out: callers then find nothing.
    if active and task.status not in ("active", "completed"):
        raise TaskNotActive(f"task {task_id!r} is {task.status}", task_id=task_id,
                            status=task.status)
    return task


#: statuses in which every token of a task is void (its claims are being revoked, or gone)
VOID = ("cancelled", "deleting")


def check_tokens_live(kv: KV | None, task_id: str, what: str, token: int) -> None:
    """Refuse a token call (commit, fail, ack, nack) on a cancelled task. Read with the
    claim in the call's own transaction (the header is pinned), so the status change
    alone stops it: cancel deletes a large task's claims a chunk at a time after it."""
    task = need_task(kv, task_id)
    if task.status in VOID:
        raise StaleToken(f"{what} is void: task {task_id!r} is {task.status}",
                         task_id=task_id, token=token, status=task.status)


def need_session(kv: KV | None, session_id: int) -> str:
    """The agent name of a session a read returned; ``SessionExpired`` if none."""
    if kv is None:
        raise SessionExpired(f"session {session_id:x} has expired or never existed",
                             session_id=session_id)
    return claim_holder(kv) or "?"


class Slots:
    """A session's claim slots as one planner sees them.

    Slots are leased keys ``slots/{session}/{n}``, ``n < slots``: taking one is a
    create-only put in the claim's own transaction, so two concurrent claims
    can never both take the last slot.
    """

    def __init__(self, keys: Keys, session: KV, used: list[KV]) -> None:
        self.keys = keys
        self.session_id = session.lease
        self.agent = claim_holder(session)
        self.limit = int(json.loads(session.value).get("slots", 0) or 0)
        self.taken = {int(kv.key.rsplit(b"/", 1)[-1]) for kv in used}

    @classmethod
    async def read(cls, txn: Txn, keys: Keys, session: KV) -> Slots:
        limit = int(json.loads(session.value).get("slots", 0) or 0)
        used = await txn.scan(keys.slots(session.lease)) if limit > 0 else []
        return cls(keys, session, used)

    @property
    def free(self) -> int | None:
        """How many more claims the session may hold (None: no limit)."""
        return None if self.limit <= 0 else max(0, self.limit - len(self.taken))

    def take(self, txn: Txn, rng: random.Random) -> int:
        """Reserve a free slot in ``txn`` (-1 when the session has no limit)."""
        if self.limit <= 0:
            return -1
        free = [n for n in range(self.limit) if n not in self.taken]
        if not free:
            raise SlotsExhausted(
                f"agent {self.agent} holds {self.limit} claims already (its slot limit); "
                "finish one first", session_id=self.session_id, slots=self.limit)
        n = rng.choice(free)
        txn.create(self.keys.slot(self.session_id, n), b"", lease=self.session_id)
        self.taken.add(n)  # later claims of the same transaction (a batch) take others
        return n


def release_slot(keys: Keys, claim: KV, txn: Txn) -> None:
    """Free the slot a claim holds (its value names it), in the caller's transaction."""
    try:
        info = json.loads(claim.value)
    except ValueError:
        return
    if int(info.get("slot", -1)) >= 0 and claim.lease:
        txn.delete(keys.slot(claim.lease, int(info["slot"])))


def check_session_id(session_id: int) -> None:
    if session_id <= 0:
        raise InvalidArgument("this call needs a session_id (open a session first)")


def entry_replay(raw: bytes, revision: int) -> pb.Entry:
    """The recorded reply of an entry-returning call, as first sent."""
    entry = pb.Entry.FromString(raw)
    entry.revision = revision
    return entry
