"""Baton's domain errors and the one table that maps them to gRPC status codes.

The registry raises these; its service layer turns them into a status code plus
trailing metadata (``baton-error`` = the class name, ``baton-fields`` = JSON of
the attributes). The client turns such a status back into the same class, so
both sides speak in the same nouns. Anything unmapped travels as ``INTERNAL``.

gRPC drops trailing metadata over 8 KiB now and then and over 16 KiB always, so
what an error carries is bounded (:func:`to_status`): its message, values echoed
from the request and long lists are cut short, saying how much was left out.
A status without ``baton-error`` did not come from a registry's handler but from
the transport (a deadline, a size limit, a connection); :func:`from_status` turns
it into one of the transport's errors, never into a domain error that merely
shares its code.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import grpc

ERROR_KEY = "baton-error"
FIELDS_KEY = "baton-fields"

#: the message of an error as sent (gRPC percent-encodes it: ``≤`` takes 9 bytes)
MAX_DETAILS_BYTES = 2048
#: the JSON of an error's fields
MAX_FIELDS_BYTES = 2048
#: one string among the fields (or one item of a list), in characters
MAX_VALUE_CHARS = 200
#: items of a list field that travel; ``<name>_more`` says how many did not
MAX_LIST_ITEMS = 10
#: characters of a value that a message quotes (see :func:`shown`)
SHOWN_CHARS = 60


class _Code:
    """A class's gRPC status code, named here and looked up when first read: every
    ``baton`` command imports these errors, and most need no gRPC (``--help``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> grpc.StatusCode:
        import grpc

        return grpc.StatusCode[self.name]


class BatonError(Exception):
    """Root of every error Baton raises on purpose."""

    code = _Code("INTERNAL")
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

    code = _Code("INVALID_ARGUMENT")
    exit_code = 2


class InvalidManifest(InvalidArgument):
    """A task manifest failed validation; ``problems`` lists the reasons.

    Over the wire at most ``MAX_LIST_ITEMS`` of them travel; ``problems_more``
    then says how many more the registry found.
    """


class MessageTooLarge(InvalidArgument):
    """A request is larger than a registry accepts (``size`` and ``limit`` in bytes,
    when the client refused it before sending), or the transport refused a message
    as too large (gRPC's ``RESOURCE_EXHAUSTED`` without Baton's error name)."""

    code = _Code("RESOURCE_EXHAUSTED")


class TaskExists(BatonError):
    """A different manifest already exists under this task id (``task_id``)."""

    code = _Code("ALREADY_EXISTS")
    exit_code = 4


class NotFound(BatonError):
    """The task, entry or session named does not exist."""

    code = _Code("NOT_FOUND")
    exit_code = 5


class NothingToClaim(BatonError):
    """No entry of the task can be claimed (or consumed) right now."""

    code = _Code("NOT_FOUND")
    exit_code = 3


class Backpressure(BatonError):
    """A producer's claim on a task one of whose consumer groups is at its backlog
    limit (the manifest's ``backlog_limits``): ``task_id``, ``group``, ``backlog``
    (the group's verified entries not yet acked, plus the task's producer claims in
    flight), ``limit`` and ``over`` (backlog - limit). Nothing changed; the claim may
    succeed once the group has acked some, so the client's producing helpers wait."""

    code = _Code("RESOURCE_EXHAUSTED")
    exit_code = 9


class IllegalTransition(BatonError):
    """The entry is not in a state that allows the requested transition."""

    code = _Code("FAILED_PRECONDITION")
    exit_code = 4


class AlreadyClaimed(IllegalTransition):
    """Someone else holds the claim on this entry."""


class StaleToken(BatonError):
    """The fencing token is not the live claim's: the claim was lost or superseded."""

    code = _Code("FAILED_PRECONDITION")
    exit_code = 4



class StaleReport(BatonError):
    """A watcher's report that would fail an entry which moved since the watcher read
    the file (a commit came meanwhile): not judged; the watcher looks again."""

    code = _Code("FAILED_PRECONDITION")
    exit_code = 4


class SessionExpired(BatonError):
    """The agent session's lease is gone; claims made under it are dead."""

    code = _Code("FAILED_PRECONDITION")
    exit_code = 4


class Draining(BatonError):
    """The session's host is drained (``baton lease drain``): it takes no new claims
    or consume leases; those it holds may still be committed, failed, acked or
    nacked until the drain's deadline (``session_id``, ``host``). An agent's cue to
    finish what it holds and stop."""

    code = _Code("FAILED_PRECONDITION")
    exit_code = 8


class TaskNotActive(BatonError):
    """The task is being created, paused, cancelled or completed."""

    code = _Code("FAILED_PRECONDITION")
    exit_code = 4


class SlotsExhausted(BatonError):
    """The agent session already holds as many claims as its slot limit allows."""

    code = _Code("RESOURCE_EXHAUSTED")
    exit_code = 3


class ChecksumMismatch(BatonError):
    """Bytes read do not match the verified digest (raised client-side by consumers)."""

    code = _Code("DATA_LOSS")
    exit_code = 4


class Conflict(BatonError):
    """A compare-and-swap kept losing to concurrent writers; safe to retry."""

    code = _Code("ABORTED")
    exit_code = 4


class Unavailable(BatonError):
    """The registry (or etcd behind it) could not be reached in time."""

    code = _Code("UNAVAILABLE")
    exit_code = 6


class Compacted(Unavailable):
    """A ``Watch`` resumed from a revision etcd's compaction has removed: the registry
    is reachable, the stream's place in the task's history is gone. Start over with a
    snapshot of that task (``start_revision`` 0). An older client sees it as
    ``Unavailable``."""


class StorageFull(BatonError):
    """etcd's database reached its quota (``NOSPACE``): every write is refused until an
    operator frees space (archive or remove finished tasks, compact, defragment) and
    disarms the alarm (docs/operations.md, "etcd upkeep"); reads still work. Nothing
    changed. Not retried: it lasts until someone acts."""

    code = _Code("RESOURCE_EXHAUSTED")
    exit_code = 6


class DeadlineExceeded(Unavailable):
    """No reply came within the call's timeout: the registry was slow, or the
    request took that long to send (``method``, ``timeout`` in seconds). The
    registry may have applied it; a retry with the same request id is safe."""

    code = _Code("DEADLINE_EXCEEDED")


class OutcomeUnknown(Unavailable):
    """A call went out but its reply never will: the session carrying it was lost
    while it was in flight (``session_id``, ``call``). The registry may have applied
    it; a retry with the same request id is safe where the call allows one."""


class ClientClosed(BatonError):
    """A call on a ``Client`` after ``close()``; nothing was sent."""

    exit_code = 1


class PermissionDenied(BatonError):
    """The caller's identity may not do this: its role is not allowed the call
    (``role``, ``method``), the claim or session belongs to another identity, or
    the task's access rules leave it out. Nothing changed."""

    code = _Code("PERMISSION_DENIED")
    exit_code = 7


class NotShardOwner(PermissionDenied):
    """A watcher reported on a task whose shard it does not own at the epoch it
    names: the shard moved (``shard``, ``owner``, ``epoch``), or the report is not the
    owner's at all. It is not believed, so nothing changed; the current owner reports
    instead."""


class Internal(BatonError):
    """Anything unexpected; the registry logs the cause."""

    code = _Code("INTERNAL")


_BY_NAME: dict[str, type[BatonError]] = {
    cls.__name__: cls
    for cls in (
        InvalidArgument,
        InvalidManifest,
        TaskExists,
        NotFound,
        NothingToClaim,
        Backpressure,
        IllegalTransition,
        AlreadyClaimed,
        StaleToken,
        StaleReport,
        NotShardOwner,
        SessionExpired,
        Draining,
        TaskNotActive,
        SlotsExhausted,
        ChecksumMismatch,
        Conflict,
        Unavailable,
        Compacted,
        DeadlineExceeded,
        OutcomeUnknown,
        StorageFull,
        MessageTooLarge,
        PermissionDenied,
        ClientClosed,
        Internal,
    )
}

#: the names of Baton's errors (metrics use them as label values, a bounded set)
ERROR_NAMES = frozenset({*_BY_NAME, BatonError.__name__})

#: the error a status without a ``baton-error`` name becomes: it came from the
#: transport (or a proxy), not from a registry's handler, so a code such as
#: ``RESOURCE_EXHAUSTED`` means a size limit, never a session's full slots
_TRANSPORT: dict[str, type[BatonError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "RESOURCE_EXHAUSTED": MessageTooLarge,
    "PERMISSION_DENIED": PermissionDenied,
    "UNAUTHENTICATED": PermissionDenied,
}


#: attributes of every error, which no field sent with one may replace
_RESERVED = frozenset({"message", "fields", "code", "exit_code", "args"})


def clip(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit:,} more characters)"


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for a message that quotes its input, cut short when long."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value):,} characters)"


def _wire_len(text: str) -> int:
    """Bytes of ``text`` as gRPC sends a status message (percent-encoded)."""
    return sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in text.encode())


def _bounded_message(message: str) -> str:
    if _wire_len(message) <= MAX_DETAILS_BYTES:
        return message
    budget, used, kept = MAX_DETAILS_BYTES - 64, 0, 0  # room for the note
    for ch in message:
        used += _wire_len(ch)
        if used > budget:
            break
        kept += 1
    return f"{message[:kept]}… ({len(message) - kept:,} more characters)"


def _bounded_value(value: Any, chars: int) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return clip(value, chars)
    text = json.dumps(value, default=str, sort_keys=True)
    return value if len(text) <= chars else clip(text, chars)


def _bounded_fields(fields: dict[str, Any]) -> str:
    """The JSON of ``fields`` within ``MAX_FIELDS_BYTES``: long strings and lists cut
    shorter until it fits (a list says how many items it lost), else only a note."""
    for items, chars in ((MAX_LIST_ITEMS, MAX_VALUE_CHARS), (5, 80), (1, 40)):
        data: dict[str, Any] = {}
        for name, value in fields.items():
            if isinstance(value, list | tuple):
                data[name] = [_bounded_value(v, chars) for v in value[:items]]
                if len(value) > items:
                    data[f"{name}_more"] = len(value) - items
            else:
                data[name] = _bounded_value(value, chars)
        text = json.dumps(data, default=str, sort_keys=True)
        if len(text) <= MAX_FIELDS_BYTES:
            return text
    return json.dumps({"fields_left_out": len(fields)})


def to_status(error: BatonError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status code, details and trailing metadata that carry ``error``, bounded
    to well under what gRPC lets through (see the module's docstring)."""
    metadata = (
        (ERROR_KEY, type(error).__name__),
        (FIELDS_KEY, _bounded_fields(error.fields)),
    )
    return error.code, _bounded_message(error.message), metadata


def from_status(
    code: grpc.StatusCode, details: str | None, metadata: Any = ()
) -> BatonError:
    """Rebuild the domain error a registry sent (the inverse of :func:`to_status`),
    or the transport's error when the status carries no Baton error name."""
    meta = {key: value for key, value in (metadata or ())}
    cls = _BY_NAME.get(str(meta.get(ERROR_KEY, "")))
    if cls is None:
        transport = _TRANSPORT.get(code.name, Internal)
        message = clip(details or code.name.lower(), MAX_DETAILS_BYTES)
        if transport is Internal:
            message = f"{code.name}: {message}"
        return transport(message)
    try:
        fields = json.loads(meta.get(FIELDS_KEY, "{}"))
    except ValueError:
        fields = {}
    if not isinstance(fields, dict):
        fields = {}
    # A field must not take the place of what every error has.
    fields = {k: v for k, v in fields.items() if k not in _RESERVED and k.isidentifier()}
    return cls(clip(details or code.name.lower(), MAX_DETAILS_BYTES), **fields)


#: refusals of a claim (or consume) that took nothing: no attempt began, so such a call
#: leaves no trace, in the agent or in the registry
NOTHING_TAKEN: tuple[type[BatonError], ...] = (NothingToClaim, Backpressure, Draining)
