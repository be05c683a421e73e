"""The names people read for the contract's enums: ``pending``, ``active``.

The wire names carry their enum's prefix, as the API conventions ask
(``ENTRY_STATE_PENDING``, ``TASK_STATUS_ACTIVE``); tables, logs, metrics labels and
messages show the short lowercase name.
"""

from __future__ import annotations

from .v1 import baton_pb2 as pb


def state_name(state: int) -> str:
    """An entry state's short name: ``pending``, ``writing``, ... (``entry_state_unspecified``
    keeps its prefix: no entry is in it)."""
    name = pb.EntryState.Name(pb.EntryState.ValueType(state))
    return name.removeprefix("ENTRY_STATE_").lower() if state else name.lower()


def status_name(status: int) -> str:
    """A task status's short name: ``active``, ``paused``, ..."""
    name = pb.TaskStatus.Name(pb.TaskStatus.ValueType(status))
    return name.removeprefix("TASK_STATUS_").lower() if status else name.lower()


def kind_name(kind: int) -> str:
    """A problem report's kind, short: ``corrupted``, ``missing``."""
    name = pb.ReportProblemRequest.Kind.Name(pb.ReportProblemRequest.Kind.ValueType(kind))
    return name.removeprefix("KIND_").lower()
