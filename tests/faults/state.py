"""The registry's final state, read straight from etcd at one revision.

The checker needs more than the wire API shows: the journal's own fields (the
digest a verification recorded, the group an ack was for), and the index, claim and
twin keys that decide whether a stuck entry can still move. Everything is read with
paged ranges pinned to the revision of the first page, so it is one consistent cut.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import ClaimRef, Keys

PAGE = 500


@dataclass(frozen=True)
class JournalRecord:
    """One transition of one entry; ``rev`` is the revision of its transaction."""

    rev: int
    seq: int
    event: str
    from_state: str
    to_state: str
    token: int = 0
    group: str = ""
    digest: str = ""
    size: int = 0
    who: str = ""
    reason: str = ""
    #: an event that left the entry unchanged (keyed after transition ``seq``)
    aside: bool = False

    @classmethod
    def load(cls, rev: int, seq: int, raw: bytes, aside: bool = False) -> JournalRecord:
        data: dict[str, Any] = json.loads(raw)
        return cls(rev=rev, seq=seq, aside=aside, event=str(data.get("event", "")),
                   from_state=str(data.get("from", "")), to_state=str(data.get("to", "")),
                   token=int(data.get("token", 0) or 0), group=str(data.get("group", "")),
                   digest=str(data.get("digest", "")), size=int(data.get("size", 0) or 0),
                   who=str(data.get("who") or data.get("owner") or ""),
                   reason=str(data.get("reason", "")))

    @property
    def transition(self) -> bool:
        return not self.aside


EntryKey = tuple[str, str]


@dataclass
class Snapshot:
    """Tasks, entries and journals of one prefix, plus every other key's name."""

    prefix: str
    revision: int = 0
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    entries: dict[EntryKey, dict[str, Any]] = field(default_factory=dict)
    journal: dict[EntryKey, list[JournalRecord]] = field(default_factory=dict)
    keys: set[bytes] = field(default_factory=set)
    #: concurrency pools: each one's limit, and the units held (key → its value)
    pools: dict[str, int] = field(default_factory=dict)
    units: dict[bytes, dict[str, Any]] = field(default_factory=dict)

    @property
    def k(self) -> Keys:
        return Keys(self.prefix)

    def has(self, key: bytes) -> bool:
        return key in self.keys

    def has_claim(self, ref: ClaimRef) -> bool:
        """A live claim or its durable twin: the reaper or its holder will move it on."""
        return self.has(self.k.claim(ref)) or self.has(self.k.inflight(ref))

    def add(self, key: bytes, value: bytes, create_revision: int) -> None:
        parts = key[len(self.prefix):].decode().split("/")
        kind = parts[0]
        if kind == "tasks" and len(parts) == 2:
            self.tasks[parts[1]] = json.loads(value)
        elif kind == "entries" and len(parts) == 3:
            self.entries[(parts[1], parts[2])] = json.loads(value)
        elif kind == "journal" and len(parts) == 4:
            # "{seq}" for a transition, "{seq}~{unique}" for an event that left the
            # entry unchanged (a consume lease taken) after transition seq.
            seq, _, extra = parts[3].partition("~")
            record = JournalRecord.load(create_revision, int(seq), value, bool(extra))
            self.journal.setdefault((parts[1], parts[2]), []).append(record)
        else:
            self.keys.add(key)
            if kind == "pools" and len(parts) == 2:
                self.pools[parts[1]] = int(json.loads(value).get("limit", 0))
            elif kind == "poolunits" and len(parts) == 3:
                self.units[key] = json.loads(value)

    def dump(self, path: Path) -> None:
        """Every journal record, one JSON object per line, with each entry's final state."""
        with path.open("w", encoding="utf-8") as f:
            for (task, file), records in sorted(self.journal.items()):
                final = self.entries.get((task, file), {}).get("state", "")
                for r in records:
                    f.write(json.dumps({"task": task, "file": file, "final": final,
                                        **asdict(r)}, sort_keys=True) + "\n")

    def finish(self) -> Snapshot:
        for records in self.journal.values():
            # One transaction may record several events (a commit that verifies).
            records.sort(key=lambda r: (r.rev, r.seq))
        return self


async def _read(endpoint: str, prefix: str) -> Snapshot:
    etcd = Etcd(endpoint, timeout=30.0)
    await etcd.connect()
    try:
        snap = Snapshot(prefix)
        base = prefix.encode()
        start: bytes | None = None
        while True:
            kvs, revision, more = await etcd.range(base, start=start, limit=PAGE,
                                                   revision=snap.revision)
            snap.revision = snap.revision or revision
            for kv in kvs:
                snap.add(kv.key, kv.value, kv.create_revision)
            if not more or not kvs:
                return snap.finish()
            start = kvs[-1].key + b"\0"
    finally:
        await etcd.close()


def read_snapshot(endpoint: str, prefix: str) -> Snapshot:
    """Everything under ``prefix`` on the etcd at ``endpoint``, at one revision."""
    return asyncio.run(_read(endpoint, prefix))
