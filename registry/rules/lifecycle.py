"""The task lifecycle, as a table: ``(status, event) -> status``, beside the entries'
state machine (``machine.py``). Every change of a task's status in the registry goes
through :func:`apply`, which makes the move the table lists or refuses it; no other
module assigns a task's status (tests/unit/test_task_lifecycle.py reads their syntax trees).

The table is the guard each writer used to spell as its own set of statuses: what
else a move requires (a task that never ran, every entry finished, an archive
written) its writer still checks in the same transaction. A refusal is the caller's
own error (``refuse``), so each call keeps the message it always gave.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import StrEnum

from ...kernel.errors import BatonError, IllegalTransition
from ..records.model import TaskRecord

CREATING = "creating"
ACTIVE = "active"
PAUSED = "paused"
COMPLETED = "completed"
CANCELLED = "cancelled"
DELETING = "deleting"
ARCHIVING = "archiving"
ARCHIVED = "archived"

#: every status a task header can have
STATUSES = (CREATING, ACTIVE, PAUSED, COMPLETED, CANCELLED, DELETING, ARCHIVING, ARCHIVED)
#: the status a task is created in (its entries are written, a chunk at a time)
INITIAL = CREATING


class TaskEvent(StrEnum):
    """What happens to a task."""

    ACTIVATE = "activate"    # its last chunk of entries is written (CreateTask)
    PAUSE = "pause"          # an operator: no new claims, running ones finish
    RESUME = "resume"        # an operator: claims again (a completed task reopened)
    CANCEL = "cancel"        # an operator: stopped for good, every token void
    COMPLETE = "complete"    # the scheduler: every entry consumed or dead
    REOPEN = "reopen"        # an entry of a completed task requeued (or replayed)
    ARCHIVE = "archive"      # the archiver (or an operator) starts writing its archive
    STORE = "store"          # its archive is written: the header stays, ``archived``
    DELETE = "delete"        # an operator removes it (DeleteTask): its keys go


#: from which statuses each event moves a task, and where to
MOVES: dict[TaskEvent, tuple[frozenset[str], str]] = {
    TaskEvent.ACTIVATE: (frozenset({CREATING}), ACTIVE),
    TaskEvent.PAUSE: (frozenset({ACTIVE}), PAUSED),
    TaskEvent.RESUME: (frozenset({PAUSED, COMPLETED}), ACTIVE),
    TaskEvent.CANCEL: (frozenset({ACTIVE, PAUSED, CREATING, COMPLETED}), CANCELLED),
    TaskEvent.COMPLETE: (frozenset({ACTIVE}), COMPLETED),
    TaskEvent.REOPEN: (frozenset({COMPLETED}), ACTIVE),
    TaskEvent.ARCHIVE: (frozenset({COMPLETED, CANCELLED}), ARCHIVING),
    TaskEvent.STORE: (frozenset({ARCHIVING}), ARCHIVED),
    # a task that ran is deleted only once cancelled: removal.py checks its journal
    TaskEvent.DELETE: (frozenset({CREATING, ACTIVE, PAUSED, COMPLETED, CANCELLED}),
                       DELETING),
}

#: the table: (status, event) -> status
TABLE: dict[tuple[str, TaskEvent], str] = {
    (status, event): to for event, (froms, to) in MOVES.items() for status in froms}


def target(event: TaskEvent) -> str:
    """The status ``event`` moves a task to."""
    return MOVES[event][1]


def allowed(status: str, event: TaskEvent) -> bool:
    """Whether the table moves a task in ``status`` on ``event``."""
    return (status, event) in TABLE


def refused(task: TaskRecord, event: TaskEvent) -> IllegalTransition:
    """The refusal of a move the table does not list, when the caller has none of its
    own."""
    return IllegalTransition(f"cannot {event} task {task.task_id!r}: it is {task.status}",
                             task_id=task.task_id, status=task.status)


def apply(task: TaskRecord, event: TaskEvent,
          refuse: Callable[[], BatonError] | None = None) -> str:
    """Move ``task`` (its record, which the caller writes) on ``event``: its new
    status. A move the table does not list raises ``refuse()`` (the caller's own
    error), else :func:`refused`; the record is then unchanged."""
    to = TABLE.get((task.status, event))
    if to is None:
        raise refuse() if refuse is not None else refused(task, event)
    task.status = to
    return to


def mermaid() -> str:
    """The table as a mermaid state diagram (docs/architecture.md carries it)."""
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {INITIAL}"]
    for event, (froms, to) in MOVES.items():
        for status in sorted(froms, key=STATUSES.index):
            lines.append(f"    {status} --> {to}: {event}")
    lines.append("```")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m baton_relay.registry.rules.lifecycle --mermaid
    if sys.argv[1:] != ["--mermaid"]:
        sys.exit("usage: python -m baton_relay.registry.rules.lifecycle --mermaid")
    sys.stdout.write(mermaid())
