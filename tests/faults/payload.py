"""Payloads every byte of which can be traced to one producer attempt.

A payload is a one-line JSON header naming (task, file, token, agent, size) followed
by ``size`` bytes of BLAKE3 output keyed by that header. Anyone holding the bytes can
read the header, regenerate the whole payload and so prove whose bytes they are, and
that none was changed, lost or mixed in from another attempt.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import blake3

MAGIC = b"BATON-FAULTS "
#: bytes at most read to find the header's end
HEADER_MAX = 4096


@dataclass(frozen=True)
class Origin:
    """Which producer attempt wrote a payload."""

    task: str
    file: str
    token: int
    agent: str
    size: int

    def header(self) -> bytes:
        fields = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return MAGIC + fields.encode() + b"\n"


def make(origin: Origin) -> bytes:
    """The payload of ``origin``: its header, then ``origin.size`` keyed bytes."""
    header = origin.header()
    body = blake3.blake3(header).digest(length=origin.size) if origin.size else b""
    return header + body


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def parse(data: bytes) -> Origin | None:
    """The origin named by ``data``'s header, or None if it has none."""
    if not data.startswith(MAGIC):
        return None
    end = data.find(b"\n", 0, HEADER_MAX)
    if end < 0:
        return None
    try:
        fields = json.loads(data[len(MAGIC):end])
        return Origin(str(fields["task"]), str(fields["file"]), int(fields["token"]),
                      str(fields["agent"]), int(fields["size"]))
    except (ValueError, KeyError, TypeError):
        return None


def traced(data: bytes) -> Origin | None:
    """The origin of ``data`` if ``data`` is exactly that origin's payload, else None."""
    origin = parse(data)
    if origin is None or make(origin) != data:
        return None
    return origin
