"""The records the registry keeps in etcd (JSON values) and their wire forms."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any

from client.v1 import baton_pb2 as pb

SCHEMA_VERSION = 1

PENDING = "pending"
WRITING = "writing"
WRITTEN = "written"
VERIFIED = "verified"
CONSUMED = "consumed"
DEAD = "dead"
STATES = (PENDING, WRITING, WRITTEN, VERIFIED, CONSUMED, DEAD)

_STATE_PB = {
    PENDING: pb.PENDING,
    WRITING: pb.WRITING,
    WRITTEN: pb.WRITTEN,
    VERIFIED: pb.VERIFIED,
    CONSUMED: pb.CONSUMED,
    DEAD: pb.DEAD,
}
STATE_FROM_PB = {v: k for k, v in _STATE_PB.items()}

_TASK_STATUS_PB = {
    "creating": pb.TASK_CREATING,
    "active": pb.TASK_ACTIVE,
    "paused": pb.TASK_PAUSED,
    "cancelled": pb.TASK_CANCELLED,
    "completed": pb.TASK_COMPLETED,
}

#: attempts kept in an entry's history (older ones live in the journal)
HISTORY_LIMIT = 20


def now() -> str:
    """UTC timestamp, RFC 3339 with milliseconds: every record uses this form."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _load(cls: type[Any], raw: bytes) -> Any:
    data = json.loads(raw)
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Observation:
    """What a watcher saw on disk for an entry."""

    size: int
    digest: str
    inode: int = 0
    device: int = 0
    mtime_ns: int = 0
    reporter: str = ""
    at: str = ""


@dataclass
class EntryRecord:
    task_id: str
    file_id: str
    path: str
    state: str = PENDING
    consumers: list[str] = field(default_factory=list)
    consumed_by: list[str] = field(default_factory=list)
    depends_on: list[str] = field(default_factory=list)
    max_retries: int = 3
    retry_count: int = 0
    expected_size: int = 0
    expected_digest: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    # the producer attempt
    owner: str = ""
    session: int = 0
    size: int = 0
    digest: str = ""
    committed_digest: str = ""
    observed: dict[str, Any] | None = None
    error: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)
    created_at: str = ""
    updated_at: str = ""

    @classmethod
    def load(cls, raw: bytes) -> EntryRecord:
        rec: EntryRecord = _load(cls, raw)
        return rec

    def dump(self) -> bytes:
        self.updated_at = now()
        # Every field is already a JSON value: skip asdict()'s deep copy (hot path).
        return json.dumps(vars(self), separators=(",", ":"), sort_keys=True).encode()

    def observation(self) -> Observation | None:
        return Observation(**self.observed) if self.observed else None

    def remember(self, event: str, **details: Any) -> None:
        """Append to the bounded attempt history kept on the entry itself."""
        self.history.append({"at": now(), "event": event, **details})
        del self.history[:-HISTORY_LIMIT]

    def to_pb(
        self,
        staging_dir: str,
        revision: int = 0,
        token: int = 0,
        consuming: dict[str, str] | None = None,
    ) -> pb.Entry:
        return pb.Entry(
            task_id=self.task_id,
            file_id=self.file_id,
            path=self.path,
            abs_path=str(PurePosixPath(staging_dir) / self.path),
            state=_STATE_PB[self.state],
            size=self.size,
            digest=self.digest,
            retry_count=self.retry_count,
            max_retries=self.max_retries,
            owner=self.owner,
            token=token,
            consumers=self.consumers,
            consumed_by=self.consumed_by,
            depends_on=self.depends_on,
            error=self.error,
            updated_at=self.updated_at,
            revision=revision,
            consuming=consuming or {},
        )


@dataclass
class TaskRecord:
    task_id: str
    status: str
    staging_dir: str
    entry_count: int
    manifest_digest: str
    consumers: list[str]
    max_retries: int
    labels: dict[str, str] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    created_at: str = ""
    updated_at: str = ""

    @classmethod
    def load(cls, raw: bytes) -> TaskRecord:
        rec: TaskRecord = _load(cls, raw)
        return rec

    def dump(self) -> bytes:
        self.updated_at = now()
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    def to_pb(self, states: dict[str, int] | None = None) -> pb.Task:
        spec = pb.TaskSpec(
            task_id=self.task_id,
            schema_version=self.schema_version,
            consumers=self.consumers,
            max_retries=self.max_retries,
            labels=self.labels,
        )
        return pb.Task(
            spec=spec,
            status=_TASK_STATUS_PB[self.status],
            staging_dir=self.staging_dir,
            entry_count=self.entry_count,
            created_at=self.created_at,
            manifest_digest=self.manifest_digest,
            states=states or {},
        )
