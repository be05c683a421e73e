"""Baton's domain errors and the one table that maps them to gRPC status codes.

The registry raises these; its service layer turns them into a status code plus
trailing metadata (``baton-error`` = the class name, ``baton-fields`` = JSON of
the attributes). The client turns such a status back into the same class, so
both sides speak in the same nouns. Anything unmapped travels as ``INTERNAL``.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import grpc

ERROR_KEY = "baton-error"
FIELDS_KEY = "baton-fields"


class BatonError(Exception):
    """Root of every error Baton raises on purpose."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    #: exit status of the ``baton`` CLI when this error ends a command
    exit_code: ClassVar[int] = 1

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)

    def __str__(self) -> str:
        return self.message


class InvalidArgument(BatonError):
    """A request was malformed: a missing id, a negative size, an unknown state."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    exit_code = 2


class InvalidManifest(InvalidArgument):
    """A task manifest failed validation; ``problems`` lists every reason."""


class TaskExists(BatonError):
    """A different manifest already exists under this task id (``task_id``)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    exit_code = 4


class NotFound(BatonError):
    """The task, entry or session named does not exist."""

    code = grpc.StatusCode.NOT_FOUND
    exit_code = 5


class NothingToClaim(BatonError):
    """No entry of the task can be claimed (or consumed) right now."""

    code = grpc.StatusCode.NOT_FOUND
    exit_code = 3


class IllegalTransition(BatonError):
    """The entry is not in a state that allows the requested transition."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    exit_code = 4


class AlreadyClaimed(IllegalTransition):
    """Someone else holds the claim on this entry."""


class StaleToken(BatonError):
    """The fencing token is not the live claim's: the claim was lost or superseded."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    exit_code = 4


class SessionExpired(BatonError):
    """The agent session's lease is gone; claims made under it are dead."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    exit_code = 4


class TaskNotActive(BatonError):
    """The task is being created, paused, cancelled or completed."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    exit_code = 4


class SlotsExhausted(BatonError):
    """The agent session already holds as many claims as its slot limit allows."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    exit_code = 3


class ChecksumMismatch(BatonError):
    """Bytes read do not match the verified digest (raised client-side by consumers)."""

    code = grpc.StatusCode.DATA_LOSS
    exit_code = 4


class Conflict(BatonError):
    """A compare-and-swap kept losing to concurrent writers; safe to retry."""

    code = grpc.StatusCode.ABORTED
    exit_code = 4


class Unavailable(BatonError):
    """The registry (or etcd behind it) could not be reached in time."""

    code = grpc.StatusCode.UNAVAILABLE
    exit_code = 6


class Internal(BatonError):
    """Anything unexpected; the registry logs the cause."""

    code = grpc.StatusCode.INTERNAL


_BY_NAME: dict[str, type[BatonError]] = {
    cls.__name__: cls
    for cls in (
        InvalidArgument,
        InvalidManifest,
        TaskExists,
        NotFound,
        NothingToClaim,
        IllegalTransition,
        AlreadyClaimed,
        StaleToken,
        SessionExpired,
        TaskNotActive,
        SlotsExhausted,
        ChecksumMismatch,
        Conflict,
        Unavailable,
        Internal,
    )
}

#: error raised by the client when a status carries no ``baton-error`` name
_BY_CODE: dict[grpc.StatusCode, type[BatonError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: TaskExists,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: IllegalTransition,
    grpc.StatusCode.ABORTED: Conflict,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.DATA_LOSS: ChecksumMismatch,
    grpc.StatusCode.RESOURCE_EXHAUSTED: SlotsExhausted,
}


def to_status(error: BatonError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status code, details and trailing metadata that carry ``error``."""
    metadata = (
        (ERROR_KEY, type(error).__name__),
        (FIELDS_KEY, json.dumps(error.fields, default=str, sort_keys=True)),
    )
    return error.code, error.message, metadata


def from_status(
    code: grpc.StatusCode, details: str | None, metadata: Any = ()
) -> BatonError:
    """Rebuild the domain error a registry sent (the inverse of :func:`to_status`)."""
    meta = {key: value for key, value in (metadata or ())}
    cls = _BY_NAME.get(str(meta.get(ERROR_KEY, "")))
    if cls is None:
        cls = _BY_CODE.get(code, Internal)
    try:
        fields = json.loads(meta.get(FIELDS_KEY, "{}"))
    except ValueError:
        fields = {}
    message = details or code.name.lower()
    if not isinstance(fields, dict):
        fields = {}
    return cls(message, **fields)
