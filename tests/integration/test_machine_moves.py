"""Every move of the state machine's table made on a real etcd through the registry:
one scenario per (state, event), and a check that the scenarios cover the table."""

from __future__ import annotations

from collections.abc import Callable
from io import BytesIO

import blake3
import pytest

from baton_relay.client import Client, Session, put
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.model import (
    CONSUMED,
    DEAD,
    PENDING,
    VERIFIED,
    WRITING,
    WRITTEN,
    State,
)
from baton_relay.registry.rules.machine import TABLE, Event

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

Wait = Callable[..., None]
PB = {PENDING: pb.ENTRY_STATE_PENDING, WRITING: pb.ENTRY_STATE_WRITING,
      WRITTEN: pb.ENTRY_STATE_WRITTEN, VERIFIED: pb.ENTRY_STATE_VERIFIED,
      CONSUMED: pb.ENTRY_STATE_CONSUMED, DEAD: pb.ENTRY_STATE_DEAD}


def _d(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _task(client: Client, retries: int = 3) -> None:
    client.operator.create_task({"task_id": "t", "max_retries": retries,
                                 "consumers": ["g"], "backoff": {"base_seconds": 0.001},
                                 "entries": [{"file_id": "f", "path": "f.bin"}]})


def _to(client: Client, s: Session, state: State, retries: int = 3) -> int:
    """Task t with entry f brought to ``state`` by real calls; the claim's token."""
    _task(client, retries)
    token = client.claim("t", "f", session=s).token
    if state in (WRITTEN, VERIFIED):
        client.commit("t", "f", token, 1, _d(b"x"))
    if state == VERIFIED:
        client.watcher.report("t", "f", 1, _d(b"x"))
    return token


def _state(client: Client) -> int:
    return client.operator.get_entry("t", "f").state


def claim(client: Client, s: Session, wait: Wait) -> None:
    _task(client)
    client.claim("t", "f", session=s)


def commit(client: Client, s: Session, wait: Wait) -> None:
    client.commit("t", "f", _to(client, s, WRITING), 1, _d(b"x"))


def verify(client: Client, s: Session, wait: Wait) -> None:
    _to(client, s, WRITTEN)
    client.watcher.report("t", "f", 1, _d(b"x"))


def consume(client: Client, s: Session, wait: Wait) -> None:
    _to(client, s, VERIFIED)
    lease = client.consume("t", "g", session=s)
    client.ack("t", "f", "g", lease.token)


def fail_writing(retries: int) -> Callable[[Client, Session, Wait], None]:
    def run(client: Client, s: Session, wait: Wait) -> None:
        client.fail("t", "f", _to(client, s, WRITING, retries), "disk full")
    return run


def mismatch_written(retries: int) -> Callable[[Client, Session, Wait], None]:
    def run(client: Client, s: Session, wait: Wait) -> None:
        _to(client, s, WRITTEN, retries)
        client.watcher.report("t", "f", 1, _d(b"other"))
    return run


def missing_verified(retries: int) -> Callable[[Client, Session, Wait], None]:
    def run(client: Client, s: Session, wait: Wait) -> None:
        _to(client, s, VERIFIED, retries)
        client.watcher.report_problem("t", "f", pb.ReportProblemRequest.KIND_MISSING, "gone")
    return run


def revoke(client: Client, s: Session, wait: Wait) -> None:
    _task(client)
    with client.open_session("other", ttl=30) as other:
        client.claim("t", "f", session=other)
        client.operator.revoke_sessions(other.session_id, reason="moved")


def requeue(client: Client, s: Session, wait: Wait) -> None:
    client.fail("t", "f", _to(client, s, WRITING, retries=0), "disk full")
    client.operator.requeue("t", "f")


def give_up_writing(client: Client, s: Session, wait: Wait) -> None:
    client.fail("t", "f", _to(client, s, WRITING), "schema rejected", permanent=True)


def give_up_verified(client: Client, s: Session, wait: Wait) -> None:
    _to(client, s, VERIFIED)
    lease = client.consume("t", "g", session=s)
    client.nack("t", "f", "g", lease.token, "cannot parse", permanent=True)


def replay(client: Client, s: Session, wait: Wait) -> None:
    consume(client, s, wait)
    client.operator.requeue("t", "f", group="g")


PARTS = {"p1": b"first, ", "p2": b"second."}


def _assembly(client: Client, s: Session, wait: Wait) -> None:
    client.operator.create_task({"task_id": "t", "entries": [
        *({"file_id": n, "path": f"f.{n}"} for n in PARTS),
        {"file_id": "f", "path": "f.bin", "parts": list(PARTS)}]})
    for name, data in PARTS.items():
        entry = put(client, s, "t", name, BytesIO(data))
        client.watcher.report("t", name, entry.size, _d(data))
    wait(lambda: _state(client) == pb.ENTRY_STATE_VERIFIED, what="the assembly verified")


def unverify(client: Client, s: Session, wait: Wait) -> None:
    _assembly(client, s, wait)
    client.watcher.report("t", "p1", len(PARTS["p1"]), _d(b"changed"))


#: (state, event) -> the calls that make that move on entry t/f
SCENARIOS: dict[tuple[State, Event], Callable[[Client, Session, Wait], None]] = {
    (PENDING, Event.CLAIM): claim,
    (WRITING, Event.COMMIT): commit,
    (WRITTEN, Event.VERIFY): verify,
    (PENDING, Event.ASSEMBLE): _assembly,
    (VERIFIED, Event.CONSUME): consume,
    (WRITING, Event.RETRY): fail_writing(3),
    (WRITTEN, Event.RETRY): mismatch_written(3),
    (VERIFIED, Event.RETRY): missing_verified(3),
    (WRITING, Event.DIE): fail_writing(0),
    (WRITTEN, Event.DIE): mismatch_written(0),
    (VERIFIED, Event.DIE): missing_verified(0),
    (WRITING, Event.REVOKE): revoke,
    (VERIFIED, Event.UNVERIFY): unverify,
    (DEAD, Event.REQUEUE): requeue,
    (WRITING, Event.GIVE_UP): give_up_writing,
    (VERIFIED, Event.GIVE_UP): give_up_verified,
    (CONSUMED, Event.REPLAY): replay,
}

#: the journal event each move writes (what the entry's history shows of it)
JOURNAL = {Event.CLAIM: "claimed", Event.COMMIT: "committed", Event.VERIFY: "verified",
           Event.ASSEMBLE: "verified", Event.CONSUME: "acked", Event.RETRY: "failed",
           Event.DIE: "failed", Event.REVOKE: "revoked", Event.UNVERIFY: "unverified",
           Event.REQUEUE: "requeued", Event.GIVE_UP: "failed", Event.REPLAY: "requeued"}
#: where a move's record is named after who made it: a consumer gives an entry up by nack
JOURNAL_OF = {(VERIFIED, Event.GIVE_UP): "nacked"}


def test_the_scenarios_cover_the_table() -> None:
    """Every allowed move of the table has a scenario below, and no scenario is extra."""
    assert set(SCENARIOS) == set(TABLE)


@pytest.mark.parametrize(("state", "event"), list(SCENARIOS))
def test_each_allowed_move_happens_on_etcd(client: Client, wait_for: Wait,
                                           state: State, event: Event) -> None:
    """The scenario's calls move entry f to the table's state, journalling the event."""
    with client.open_session("agent", ttl=30) as s:
        SCENARIOS[(state, event)](client, s, wait_for)
        assert _state(client) == PB[TABLE[(state, event)].to]
        journal = [r.event for r in client.operator.journal("t", "f")]
        assert JOURNAL_OF.get((state, event), JOURNAL[event]) in journal, journal
