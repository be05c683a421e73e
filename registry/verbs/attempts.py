"""An entry's producer attempts, as its journal tells them: who claimed it, on which
host, under which token, what its commit declared, and how each attempt ended.

They are derived from the journal rather than kept on the entry: the journal already
holds each attempt's records (the claim's carries the session's host, the commit's its
digest, the retry path's the attempt's digest and size), so the entry's record keeps
its size on the hot path and the history is never cut short; an archived task's
entries are explained from their archived journal the same way.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from ...kernel.v1 import baton_pb2 as pb
from ..records.model import DEAD, PENDING, VERIFIED, WRITING, WRITTEN
from ..rules.core import Core

#: the most attempts an explanation carries (the newest): each claim of an entry is
#: one, and requeues give a dead entry fresh ones without end
MAX_ATTEMPTS = 1000
#: the states a producer attempt ends from (to pending or dead: the retry path's
#: records, a revoke, a permanent failure)
ENDS_FROM = frozenset({WRITING, WRITTEN, VERIFIED})


async def read(core: Core, task_id: str, file_id: str, page: int) -> list[pb.Attempt]:
    """Every attempt at an entry, from its journal in etcd (``page`` records a read)."""
    records: list[tuple[int, dict[str, Any]]] = []
    pages = core.etcd.scan(core.keys.journal_all(task_id, file_id), page=page)
    async with contextlib.aclosing(pages):
        async for kv in pages:
            records.append((kv.create_revision, _fields(kv.value)))
    return of(records)


def of(records: Sequence[tuple[int, dict[str, Any]]]) -> list[pb.Attempt]:
    """The attempts an entry's journal records (revision, fields) tell of, oldest
    first: each ``claimed`` record opens one (its revision is the token), its
    ``committed`` record ends it (when, outcome ``committed``) with the size and digest,
    and the first record after it that takes the entry from writing, written or verified
    back to pending, or to dead (failed, deadline, revoked, a permanent nack…) ends it
    instead, with its reason: the attempt's bytes were taken back."""
    out: list[pb.Attempt] = []
    current: pb.Attempt | None = None
    for revision, data in sorted(records, key=lambda r: r[0]):
        event = str(data.get("event", ""))
        if event == "claimed":
            current = pb.Attempt(
                number=len(out) + 1, who=str(data.get("who") or ""),
                label=str(data.get("label") or ""), host=str(data.get("host") or ""),
                token=_int(data.get("token")) or revision, claimed_at=str(data.get("at", "")))
            out.append(current)
        elif current is None:
            continue
        elif event == "committed":
            # The producer's part is done; it stays the entry's attempt (not closed)
            # until a later record takes its bytes back.
            current.ended_at = str(data.get("at", ""))
            current.outcome = event
            current.size = _int(data.get("size"))
            current.digest = str(data.get("digest") or current.digest)
        elif data.get("from") in ENDS_FROM and data.get("to") in (PENDING, DEAD):
            current.ended_at = str(data.get("at", ""))
            current.outcome = event
            current.error = str(data.get("reason") or "")
            current.digest = str(data.get("digest") or current.digest)
            current.size = _int(data.get("size")) or current.size
            current.permanent = bool(data.get("permanent"))
            current = None
    return out


def explained(entry: pb.Entry, text: str, attempts: list[pb.Attempt],
              dead: bool) -> pb.ExplainResponse:
    """An explanation's reply, with the newest ``MAX_ATTEMPTS`` attempts; a dead
    entry's paragraph ends with them, one line each."""
    total = len(attempts)
    attempts = attempts[-MAX_ATTEMPTS:]
    if dead and attempts:
        more = f" (the last {len(attempts)} of {total})" if total > len(attempts) else ""
        lines = [f"Attempts{more}:"]
        for a in attempts:
            where = f" on {a.host}" if a.host else ""
            label = f' "{a.label}"' if a.label else ""
            how = (f"{a.outcome}: {a.error}" if a.error else a.outcome) if a.ended_at else (
                "in progress")
            digest = f", digest {a.digest}" if a.digest else ""
            lines.append(f"#{a.number} {a.claimed_at} by {a.who or '-'}{label}{where}, "
                         f"token {a.token}{digest}, ended {a.ended_at or '-'}, {how}.")
        text = f"{text}\n" + "\n".join(lines)
    return pb.ExplainResponse(entry=entry, text=text, attempts=attempts,
                              attempts_total=total)


def _fields(value: bytes) -> dict[str, Any]:
    """A journal record's fields ({} when it is not a JSON object)."""
    try:
        data = json.loads(value)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _int(value: object) -> int:
    """A number from a JSON record (0 when absent or not a number)."""
    if isinstance(value, int | float | str):
        with contextlib.suppress(ValueError):
            return int(value)
    return 0
