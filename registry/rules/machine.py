"""The entry state machine, as a table: ``(state, event) -> state`` plus the fields each
event resets. Every state move in the registry goes through :func:`apply`, so a move
the table does not list is refused in one place rather than by eight if/elif chains,
and the diagram in docs/architecture.md is generated from the table
(``python -m baton_relay.registry.rules.machine --mermaid``) and checked against it by a test.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, dataclass, fields
from enum import StrEnum
from typing import Any

from ...kernel.errors import IllegalTransition
from ..records.clock import wall
from ..records.model import CONSUMED, DEAD, PENDING, VERIFIED, WRITING, WRITTEN, EntryRecord, State


class Event(StrEnum):
    """What happens to an entry; the journal's event names are close to these."""

    CLAIM = "claim"          # a producer takes it
    COMMIT = "commit"        # the producer says it is written
    VERIFY = "verify"        # what is on disk matches the commit
    ASSEMBLE = "assemble"    # every part of an assembly is verified
    CONSUME = "consume"      # every receiving group has acked it
    RETRY = "retry"          # an attempt failed and a retry is left (backoff follows)
    DIE = "die"              # an attempt failed and no retry is left
    REVOKE = "revoke"        # an operator or lease end took the claim back: no retry spent
    UNVERIFY = "unverify"    # an assembly's part left verified: the assembly waits again
    REQUEUE = "requeue"      # an operator gives a dead entry a fresh set of retries
    GIVE_UP = "give_up"      # its producer (or a consumer) says no retry can succeed
    REPLAY = "replay"        # an operator hands a consumed entry to one group again


#: what a failed attempt leaves behind and the next attempt must not see: reset
#: together, written once (every give-back path uses it, not a copy of it)
ATTEMPT = ("owner", "session", "size", "digest", "committed_digest", "committed_token",
           "observed", "attributes", "rule", "routed_to", "routed_pools")


@dataclass(frozen=True)
class Move:
    """One row of the table: the target state, the fields set back to their default
    and the fields set to a fixed value."""

    to: State
    resets: tuple[str, ...] = ()
    sets: tuple[tuple[str, Any], ...] = ()


TABLE: dict[tuple[State, Event], Move] = {
    (PENDING, Event.CLAIM): Move(WRITING, ("observed", "error", "not_before")),
    (WRITING, Event.COMMIT): Move(WRITTEN),
    (WRITTEN, Event.VERIFY): Move(VERIFIED, ("error",)),
    (PENDING, Event.ASSEMBLE): Move(VERIFIED),
    (VERIFIED, Event.CONSUME): Move(CONSUMED),
    # a failed attempt: back to pending while retries are left, dead after
    (WRITING, Event.RETRY): Move(PENDING, ATTEMPT),
    (WRITTEN, Event.RETRY): Move(PENDING, ATTEMPT),
    (VERIFIED, Event.RETRY): Move(PENDING, (*ATTEMPT, "nacked_until")),
    (WRITING, Event.DIE): Move(DEAD, ATTEMPT),
    (WRITTEN, Event.DIE): Move(DEAD, ATTEMPT),
    (VERIFIED, Event.DIE): Move(DEAD, (*ATTEMPT, "nacked_until")),
    (WRITING, Event.REVOKE): Move(PENDING, (*ATTEMPT, "not_before")),
    (VERIFIED, Event.UNVERIFY): Move(PENDING, ("size", "digest", "rule", "routed_to",
                                               "routed_pools", "nacked_until"),
                                     (("deps_ok", False),)),
    (DEAD, Event.REQUEUE): Move(PENDING, ("retry_count", "not_before")),
    # a permanent failure: dead at once, no retry spent (fail/nack --permanent)
    (WRITING, Event.GIVE_UP): Move(DEAD, ATTEMPT),
    (VERIFIED, Event.GIVE_UP): Move(DEAD, (*ATTEMPT, "nacked_until")),
    # requeue --group: the group that acked it is handed it again
    (CONSUMED, Event.REPLAY): Move(VERIFIED, ("consumed_at",)),
}


def _default(name: str) -> Any:
    f = _FIELDS[name]
    if f.default is not MISSING:
        return f.default
    assert f.default_factory is not MISSING  # every reset field has a default
    return f.default_factory()  # a fresh list for each entry, never a shared one


_FIELDS = {f.name: f for f in fields(EntryRecord)}


def apply(rec: EntryRecord, event: Event) -> State:
    """Move ``rec`` by ``event`` and reset the fields the event declares; the move
    the table does not allow raises ``IllegalTransition`` and leaves ``rec`` as it was.
    Returns the new state."""
    try:
        state = State(rec.state)
    except ValueError:
        raise IllegalTransition(f"entry {rec.file_id!r} has unknown state {rec.state!r}",
                                task_id=rec.task_id, file_id=rec.file_id) from None
    move = TABLE.get((state, event))
    if move is None:
        raise IllegalTransition(
            f"entry {rec.file_id!r} is {state}: {event} is not a move from there "
            f"(allowed: {', '.join(allowed(state)) or 'none'})",
            task_id=rec.task_id, file_id=rec.file_id, state=str(state))
    for name in move.resets:
        setattr(rec, name, _default(name))
    for name, value in move.sets:
        setattr(rec, name, value)
    if move.to == CONSUMED:  # the staging retention counts from the last ack
        rec.consumed_at = wall()
    rec.state = move.to
    return move.to


def allowed(state: State) -> list[str]:
    """The events the table allows from ``state``, in declaration order."""
    return [str(e) for (s, e) in TABLE if s == state]


def mermaid() -> str:
    """The state diagram of the table, as the Mermaid block docs/architecture.md holds."""
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {PENDING}"]
    for (state, event), move in TABLE.items():
        lines.append(f"    {state} --> {move.to}: {event}")
    lines.append("```")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--mermaid"]:
        sys.exit("usage: python -m baton_relay.registry.rules.machine --mermaid")
    sys.stdout.write(mermaid())
