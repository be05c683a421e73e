"""What both sides of the wire agree on beyond the protobuf messages: where a
registry serves by default, what a request may weigh, what an id looks like, how
a file being written is named, and which version this is.

Imported by the registry (its gRPC receive limit) and by the client (its send
limit, and the check that refuses a larger request before sending it). Kept free
of imports, so that the CLI reads it without loading gRPC.
"""

from __future__ import annotations

import functools

#: the distribution's name on the package index (``baton`` there is another project)
DISTRIBUTION = "baton-relay"


@functools.cache
def version() -> str:
    """This Baton's version, from the installed distribution's metadata (read when
    first asked for: the CLI's common path never pays for it)."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"

#: task ids, file ids, consumer groups and agent names
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

#: the mark in the name of a file being written; watchers never hash such a file
TEMP_MARKER = ".baton-tmp-"

#: the mark between an entry's file name and the fencing token of the attempt that
#: wrote it: each attempt has a file of its own, ``out/frame-0001~t42.png`` for the
#: claim with token 42 of ``out/frame-0001.png`` (the extension is kept)
ATTEMPT_MARKER = "~t"
#: the longest file name (bytes) an entry's path may end with: room is left for the
#: marker and a token of 19 digits within the file system's NAME_MAX of 255
MAX_FILE_NAME = 255 - len(ATTEMPT_MARKER) - 19


def _split_ext(name: str) -> tuple[str, str]:
    """(stem, extension) of a file name: the extension from its last dot, if that
    is not its first character (``.hidden`` has none)."""
    dot = name.rfind(".")
    return (name[:dot], name[dot:]) if dot > 0 else (name, "")


def attempt_path(path: str, token: int) -> str:
    """The file of the attempt with fencing ``token`` at the entry's ``path`` (relative
    or absolute): in the same directory, the token before the extension."""
    head, slash, name = path.rpartition("/")
    stem, ext = _split_ext(name)
    return f"{head}{slash}{stem}{ATTEMPT_MARKER}{token}{ext}"


def parse_attempt(path: str) -> tuple[str, int] | None:
    """(the entry's path, the token) of an attempt's file, or None if ``path`` does
    not name one (the inverse of :func:`attempt_path`)."""
    head, slash, name = path.rpartition("/")
    stem, ext = _split_ext(name)
    base, marker, digits = stem.rpartition(ATTEMPT_MARKER)
    if not (marker and base and digits.isdigit() and digits.isascii()
            and digits[0] != "0" and len(digits) <= 19):
        return None
    return f"{head}{slash}{base}{ext}", int(digits)


def parse_temp(name: str) -> tuple[str, int] | None:
    """(the entry's file name, the token) of a temp file's name — ``.NAME.baton-tmp-
    TOKEN-NONCE``, NAME the attempt's file name (or, for an entry without attempt
    files, its own) — or None if ``name`` is not one whose NAME is whole."""
    if not name.startswith("."):
        return None
    head, marker, tail = name[1:].rpartition(TEMP_MARKER)
    digits, dash, nonce = tail.partition("-")
    if not (marker and head and dash and nonce and digits.isdigit() and digits.isascii()
            and digits[0] != "0" and len(digits) <= 19):
        return None
    token = int(digits)
    attempt = parse_attempt(head)
    if attempt is None:
        return head, token
    return (attempt[0], token) if attempt[1] == token else None


def assembly_digest(part_digests: list[str]) -> str:
    """An assembly's digest: BLAKE3 of its parts' hex digests, in order, joined by
    newlines. The registry verifies an assembly with it; a consumer checks with it that
    the parts it reads are the ones the assembly was verified with."""
    import blake3

    return str(blake3.blake3("\n".join(part_digests).encode()).hexdigest())


#: shards a deployment's tasks map to unless its registry is told otherwise
DEFAULT_SHARDS = 64


def shard_of(task_id: str, count: int) -> int:
    """The shard a task belongs to among ``count``: a stable hash of its id, the same
    on every host and in every version (watchers and registries must agree)."""
    import hashlib

    digest = hashlib.blake2b(task_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


#: where `baton up` serves the registry, and where clients look by default
DEFAULT_REGISTRY = "127.0.0.1:7390"
REGISTRY_PORT = int(DEFAULT_REGISTRY.rpartition(":")[2])
#: the gRPC services a registry serves, one per audience (kernel/proto/baton/v1/baton.proto)
AGENT_SERVICE = "baton.v1.AgentService"
WATCHER_SERVICE = "baton.v1.WatcherService"
OPERATOR_SERVICE = "baton.v1.OperatorService"
SERVICES = (AGENT_SERVICE, WATCHER_SERVICE, OPERATOR_SERVICE)
#: the name the health service answers for the registry as a whole (readiness: serving,
#: or not while it shuts down or an etcd member runs a refused release); each of
#: :data:`SERVICES` answers the same
REGISTRY_SERVICE = "baton.v1.Registry"
#: the client port of `baton up`'s private etcd
LOCAL_ETCD_PORT = 2479

MiB = 1 << 20

#: the largest manifest (a ``TaskSpec``, encoded) a registry accepts. The largest
#: valid one by count and field limits — 100,000 entries whose file ids (128) and
#: paths (1024 bytes) are at their limits, with sizes, digests, retries and
#: priorities — encodes to about 124 MB; this leaves it a third more room.
MAX_MANIFEST_BYTES = 160 * MiB

#: the largest request a registry receives (a manifest and its envelope); a larger
#: one is refused by gRPC before it is read, and by the client before it is sent
MAX_REQUEST_BYTES = MAX_MANIFEST_BYTES + MiB

#: the largest ``attributes`` a producer commits with an entry (a JSON object, encoded):
#: they ride on the entry's record, which every transition of it rewrites
MAX_ATTRIBUTES_BYTES = 4096

#: the longest delay a failed or nacked entry may ask for before it is handed out
#: again (``fail --delay``, ``nack --delay``): a week; longer is a mistake, not a plan
MAX_DELAY_SECONDS = 7 * 86400

#: a checkpoint's limits: its opaque ``data`` and its ``message``. The latest of each
#: attempt is kept on a key of its own beside the entry, so its size never rides on
#: the entry's transitions
MAX_CHECKPOINT_BYTES = 64 * 1024
MAX_CHECKPOINT_MESSAGE = 200


def data_digest(data: bytes) -> str:
    """BLAKE3 hex of ``data`` (a checkpoint's, so a resuming agent can check it)."""
    import blake3

    return str(blake3.blake3(data).hexdigest())


#: the largest reply: every entry of a task at its limits, with room to spare
MAX_REPLY_BYTES = 256 * MiB
#: the most digest reports one ReportVerificationBatch carries (a watcher sends what
#: queued while the batch before it was on its way, up to this many)
MAX_REPORT_BATCH = 512
#: the most events one Watch message carries when they are sent together
#: (``WatchRequest.together``), and the bytes after which a message takes no more
MAX_WATCH_EVENTS = 512
MAX_WATCH_BYTES = MiB

#: a client pings its registry this often (ms) when the connection is quiet, and
#: drops the connection when a ping gets no answer within ``KEEPALIVE_TIMEOUT_MS``: a
#: replica that went silent (a partition drops packets, nothing resets the
#: connection) is left within about 10 s for the next one of a list, instead of when
#: TCP gives up, many minutes later
KEEPALIVE_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000
#: the registry accepts pings this often (a bit more often than clients send them;
#: more often, and gRPC would count them as abuse and end the connection)
MIN_PING_INTERVAL_MS = 4_000


def mib(n: int) -> str:
    """``n`` bytes in MiB, as messages about these limits print them."""
    return f"{n / MiB:,.1f} MiB"
