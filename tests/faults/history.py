"""Histories: every process appends one JSON object per line, flushed line by line.

A call is recorded twice, Jepsen-style: ``invoke`` before it is sent, then ``ok``
(it applied), ``fail`` (it certainly did not apply: the registry refused it) or
``info`` (unknown: the reply was lost, the registry was unreachable). A SIGKILL
loses at most the completion of the call in flight, which then reads as unknown.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from baton_relay.kernel import errors

#: errors after which the call certainly did not apply (refused before any write)
DEFINITE = (
    errors.StaleToken,
    errors.IllegalTransition,  # AlreadyClaimed too
    errors.NothingToClaim,
    errors.NotFound,
    errors.SessionExpired,
    errors.TaskNotActive,
    errors.SlotsExhausted,
    errors.InvalidArgument,
    errors.ChecksumMismatch,
    errors.Conflict,  # the guarded transaction never applied
)


def phase_of(error: BaseException) -> str:
    """``fail`` if ``error`` proves the call did not apply, else ``info`` (unknown)."""
    return "fail" if isinstance(error, DEFINITE) else "info"


class History:
    """An append-only history file of one process (one agent incarnation, the driver...)."""

    def __init__(self, path: Path, process: str) -> None:
        self.path = path
        self.process = process
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, op: str, phase: str, **fields: Any) -> None:
        record = {"t": round(time.time(), 6), "process": self.process, "pid": os.getpid(),
                  "op": op, "phase": phase, **fields}
        self._file.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        self._file.flush()

    def invoke(self, op: str, **fields: Any) -> None:
        self.write(op, "invoke", **fields)

    def ok(self, op: str, **fields: Any) -> None:
        self.write(op, "ok", **fields)

    def error(self, op: str, error: BaseException, **fields: Any) -> None:
        """The completion of a call that raised ``error`` (``fail`` or ``info``)."""
        self.write(op, phase_of(error), error=type(error).__name__,
                   message=str(error)[:300], **fields)

    def close(self) -> None:
        self._file.close()


def read(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one history file; a torn last line (SIGKILL mid-write) is skipped."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def read_all(directory: Path) -> list[dict[str, Any]]:
    """Every record of every ``*.jsonl`` history in ``directory``, in time order."""
    records = [r for path in sorted(directory.glob("*.jsonl")) for r in read(path)]
    records.sort(key=lambda r: r.get("t", 0.0))
    return records
