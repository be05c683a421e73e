"""The records the registry keeps in etcd (JSON values) and their wire forms."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import msgspec

from ...kernel.contract import attempt_path
from ...kernel.v1 import baton_pb2 as pb
from .access import from_dict as access_from_dict
from .clock import wall

SCHEMA_VERSION = 1



class State(StrEnum):
    """An entry's state. A ``StrEnum`` so that stored records keep their strings: a
    record written before the enum existed loads unchanged. Moves between states are
    declared in ``machine.py`` and made only by its ``apply``."""

    PENDING = "pending"
    WRITING = "writing"
    WRITTEN = "written"
    VERIFIED = "verified"
    CONSUMED = "consumed"
    DEAD = "dead"


PENDING = State.PENDING
WRITING = State.WRITING
WRITTEN = State.WRITTEN
VERIFIED = State.VERIFIED
CONSUMED = State.CONSUMED
DEAD = State.DEAD
#: typed as strings: counts keyed by them are indexed with a loaded record's state
STATES: tuple[str, ...] = tuple(State)

_STATE_PB: dict[str, pb.EntryState.ValueType] = {
    PENDING: pb.ENTRY_STATE_PENDING,
    WRITING: pb.ENTRY_STATE_WRITING,
    WRITTEN: pb.ENTRY_STATE_WRITTEN,
    VERIFIED: pb.ENTRY_STATE_VERIFIED,
    CONSUMED: pb.ENTRY_STATE_CONSUMED,
    DEAD: pb.ENTRY_STATE_DEAD,
}
STATE_FROM_PB = {v: k for k, v in _STATE_PB.items()}

_TASK_STATUS_PB = {
    "creating": pb.TASK_STATUS_CREATING,
    "active": pb.TASK_STATUS_ACTIVE,
    "paused": pb.TASK_STATUS_PAUSED,
    "cancelled": pb.TASK_STATUS_CANCELLED,
    "completed": pb.TASK_STATUS_COMPLETED,
    "deleting": pb.TASK_STATUS_DELETING,
    "archiving": pb.TASK_STATUS_ARCHIVING,
    "archived": pb.TASK_STATUS_ARCHIVED,
}
#: statuses of a task that is done with: nothing more happens to its entries
FINISHED = ("completed", "cancelled")


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def now() -> str:
    """UTC timestamp, RFC 3339 with milliseconds: every record uses this form."""
    t = wall()
    second = int(t)
    return f"{_second(second)}.{int((t - second) * 1000):03d}Z"


@functools.lru_cache(maxsize=4)
def _second(second: int) -> str:
    """The date and time of an epoch second (records are written many to a second)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


def epoch_of(stamp: str) -> float:
    """A timestamp as :func:`now` writes it, in epoch seconds (0 if empty or not one)."""
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _load(cls: type[Any], raw: bytes) -> Any:
    """A new ``cls`` record from its stored bytes (the fields it knows; a field stored
    by a later version is left out). Records are loaded several times per entry per
    hand-off, so the bytes go straight into the record through a compiled decoder made
    once per class. One it refuses (a value of another type than the field's, which an
    older registry may have stored, or a field missing) is loaded as before, field by
    field, with the constructor's own refusal."""
    try:
        rec = _decoder(cls).decode(raw)
    except msgspec.DecodeError:
        return _load_fields(cls, raw)
    # The decoder sets the fields it read (and those with a default factory); the
    # others would read through to the class's defaults. Every field is set, in the
    # constructor's order, so that a loaded record is the one the constructor makes.
    rec.__dict__ = {**_form(cls).template, **rec.__dict__}
    return rec


def _decoder(cls: type[Any]) -> msgspec.json.Decoder[Any]:
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.json.Decoder(cls)
    return decoder


_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def _load_fields(cls: type[Any], raw: bytes) -> Any:
    """:func:`_load` without the decoder: what the dataclass's constructor would do,
    without its call per field: the attributes in the same order, a default factory's
    value for each field not stored."""
    form = _form(cls)
    values = {k: v for k, v in json.loads(raw).items() if k in form.template}
    if not form.required <= values.keys():
        return cls(**values)  # refused as the constructor refuses it
    state = {**form.template, **values}
    for name, factory in form.factories:
        if name not in values:
            state[name] = factory()
    rec = object.__new__(cls)
    rec.__dict__.update(state)
    if form.post_init:
        rec.__post_init__()
    return rec


@dataclass(frozen=True)
class _Form:
    """How :func:`_load` builds a record class without calling its constructor."""

    #: every field, in order: its default, or None for one that has a factory or none
    template: dict[str, Any]
    factories: tuple[tuple[str, Callable[[], Any]], ...]
    required: frozenset[str]
    post_init: bool


def _form(cls: type[Any]) -> _Form:
    form = _FORMS.get(cls)
    if form is None:
        template, factories, required = {}, [], set()
        for f in fields(cls):
            template[f.name] = None if f.default is MISSING else f.default
            if f.default_factory is not MISSING:
                factories.append((f.name, f.default_factory))
            elif f.default is MISSING:
                required.add(f.name)
        form = _FORMS[cls] = _Form(template, tuple(factories), frozenset(required),
                                   hasattr(cls, "__post_init__"))
    return form


_FORMS: dict[type[Any], _Form] = {}

#: a record's stored form: compact JSON (what ``json.dumps`` with compact separators
#: writes, but non-ASCII text is kept as UTF-8 rather than escaped)
_encode = msgspec.json.Encoder().encode
#: the same with every object's keys in order (a record's fields, and nested objects')
_encode_sorted = msgspec.json.Encoder(order="sorted").encode


@dataclass
class Observation:
    """What a watcher saw on disk for an entry."""

    size: int
    digest: str
    inode: int = 0
    device: int = 0
    mtime_ns: int = 0
    reporter: str = ""
    #: the authenticated identity of the watcher that saw it
    identity: str = ""
    at: str = ""
    #: the fencing token of the attempt whose file it was
    token: int = 0
    #: the watcher's verification span (W3C traceparent; "" = untraced)
    traceparent: str = ""


@dataclass
class EntryRecord:
    task_id: str
    file_id: str
    path: str
    state: str = PENDING
    consumers: list[str] = field(default_factory=list)
    consumed_by: list[str] = field(default_factory=list)
    depends_on: list[str] = field(default_factory=list)
    #: entries of the task that depend on this one (filled in at creation)
    dependents: list[str] = field(default_factory=list)
    #: an assembly lists its parts; a part names its assembly
    parts: list[str] = field(default_factory=list)
    assembly: str = ""
    max_retries: int = 3
    retry_count: int = 0
    expected_size: int = 0
    expected_digest: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    priority: int = 0
    #: retry backoff (base, factor, cap) in seconds, and the aging interval
    backoff: list[float] = field(default_factory=lambda: [1.0, 2.0, 60.0])
    aging: float = 60.0
    #: dependencies (or parts) satisfied; False while the entry waits for them
    deps_ok: bool = True
    #: not claimable before this UTC epoch time (retry backoff)
    not_before: float = 0.0
    #: when it last became claimable (UTC epoch seconds), for ordering and aging
    enqueued_at: float = 0.0
    #: its fairness key ("" = the task has no fair shares) and its virtual time among
    #: the entries of that key (registry.fairness), fixed at its creation
    fairness_key: str = ""
    fair_time: int = 0
    #: the index key (full etcd key) the entry is listed under while pending
    index: str = ""
    #: transitions so far: numbers the journal records
    seq: int = 0
    # the producer attempt
    owner: str = ""
    session: int = 0
    size: int = 0
    digest: str = ""
    committed_digest: str = ""
    #: the fencing token of the committed attempt: its file is the entry's bytes
    committed_token: int = 0
    observed: dict[str, Any] | None = None
    error: str = ""
    created_at: str = ""
    updated_at: str = ""
    #: identity patterns that may produce it (the task's access rules; [] = any agent)
    producers: list[str] = field(default_factory=list)
    #: a commit may come without the producer's digest (the task opted out)
    digest_optional: bool = False
    #: the JSON object its producer committed (text: numbers keep every digit)
    attributes: str = ""
    #: the task's routing rules decide who receives it (they stay on the task header)
    routing: bool = False
    #: the rule that decided at its last verification, and the groups it named; -1
    #: and [] while unrouted or when no rule held (then every consumer group)
    rule: int = -1
    routed_to: list[str] = field(default_factory=list)
    #: processing deadlines (seconds; 0: none): claim to commit, consume to ack
    claim_deadline: float = 0.0
    consume_deadline: float = 0.0
    #: seconds an attempt may go without a checkpoint before it is taken back (0: never)
    stall_after: float = 0.0
    #: producer claims made of it so far: the number of the attempt in hand
    attempts: int = 0
    #: a producer's attempt left a checkpoint (``checkpoints/…/p/…``), and the consumer
    #: groups whose leases did: read only then, so entries without any cost nothing
    checkpointed: bool = False
    group_checkpoints: list[str] = field(default_factory=list)
    #: when the journal last recorded a checkpoint of it (at most one per 30 s)
    checkpoint_journalled: float = 0.0
    #: seconds its file stays in staging once consumed (< 0: never), fixed at its
    #: creation; None: a record older than the staging retention, never removed
    staging_retention: float | None = None
    #: when it became consumed (UTC epoch seconds; 0: not consumed)
    consumed_at: float = 0.0
    #: its file was removed from staging: when, by which watcher (id, identity)
    staging_removed: dict[str, Any] | None = None
    #: consumer groups a nack handed it back to later (nack --delay): the epoch
    #: seconds each may take it again; its ``cdelayed`` key names that time
    nacked_until: dict[str, float] = field(default_factory=dict)
    #: the concurrency pool a producer's claim takes a unit of ("" = none), and the
    #: pool of each consumer group's leases (groups not named take none)
    pool: str = ""
    consume_pools: dict[str, str] = field(default_factory=dict)
    #: the pools its routing rule named for the groups it sent it to (reset with it)
    routed_pools: dict[str, str] = field(default_factory=dict)
    #: the trace context of its hand-off (W3C traceparent; "" = untraced): the
    #: producer's attempt's span once claimed, the watcher's verification span once
    #: verified (docs/operations.md, "Traces"); kept after a failed attempt (a dead
    #: entry names the trace of its last), replaced by the next claim
    traceparent: str = ""
    #: the digest last refused for a removal as changed since verification: a
    #: watcher asking again for the same bytes is not journalled twice
    staging_refused: str = ""

    @classmethod
    def load(cls, raw: bytes) -> EntryRecord:
        rec: EntryRecord = _load(cls, raw)
        rec._from = rec.state
        return rec

    def __post_init__(self) -> None:
        #: the state as loaded (None for a new entry) and events not yet journalled
        self._from: str | None = None
        self._events: list[dict[str, Any]] = []

    def dump(self) -> bytes:
        """The stored form: fields at their default value are left out (``load``
        restores them), which keeps a pending entry to about a third of its full size."""
        self.updated_at = now()
        # Every field is already a JSON value: skip asdict()'s deep copy (hot path).
        state = vars(self)
        if len(state) == _ENTRY_ATTRIBUTES:  # its fields, ``_from`` and ``_events``
            data = {k: v for k, d in _ENTRY_FIELD_DEFAULTS
                    if (v := state[k]) is not d and v != d}
        else:  # an attribute set beside the fields is stored too
            data = {k: v for k, v in state.items()
                    if not k.startswith("_") and _ENTRY_DEFAULTS.get(k, _NO_DEFAULT) != v}
        return _encode(data)

    def remember(self, event: str, **details: Any) -> None:
        """Record an event for the journal, written with the entry's next ``put_entry``
        (the journal is the entry's history; the entry itself keeps none)."""
        self._events.append({"at": now(), "event": event, **details})

    def blocked_by(self, states: Mapping[str, str]) -> list[str]:
        """The dependencies (an assembly's parts) whose death keeps this entry from
        being released, given the state of each by name (``Core.dependency_states``):
        none unless it is pending and not released yet. The one rule behind
        ``explain``'s "blocked", an entry's ``blocked`` and a task's count of them."""
        if self.state != PENDING or self.deps_ok:
            return []
        return [n for n in self.parts or self.depends_on if states.get(n) == DEAD]

    def take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    @property
    def from_state(self) -> str | None:
        return self._from

    @property
    def receivers(self) -> list[str]:
        """The consumer groups that receive it: those its routing rule named, or all."""
        return self.routed_to if self.rule >= 0 else self.consumers

    def unroute(self) -> None:
        """Forget the routing decision: the next verification routes it afresh."""
        self.rule, self.routed_to, self.routed_pools = -1, [], {}

    def consume_pool(self, group: str) -> str:
        """The concurrency pool ``group``'s leases of it take a unit of ("" = none): its
        routing rule's for the group, else its own."""
        return self.routed_pools.get(group) or self.consume_pools.get(group, "")

    @property
    def done(self) -> bool:
        """Nothing more will happen to it: consumed, dead, or verified with no consumers."""
        return self.state in (CONSUMED, DEAD) or (self.state == VERIFIED and not self.receivers)

    @property
    def retention(self) -> float:
        """Seconds its file stays in staging once consumed; negative: never removed."""
        return -1.0 if self.staging_retention is None else self.staging_retention

    @property
    def staging_due(self) -> float | None:
        """When its file may be removed from staging (UTC epoch seconds), or None: not
        consumed, its retention negative, or removed already."""
        if (self.state != CONSUMED or self.retention < 0 or self.staging_removed
                or self.parts):
            return None
        return self.consumed_at + self.retention

    @property
    def staged_bytes(self) -> int:
        """Bytes its file holds in staging, as far as the registry knows: its size
        until the retention removed it (an assembly has no file of its own)."""
        return 0 if self.parts or self.staging_removed else self.size

    def attempt_path(self, token: int = 0) -> str:
        """The file of the attempt with ``token`` (else of the committed attempt),
        relative to the task's directory; "" when there is none (not committed, or
        an assembly). An entry committed before attempts had files of their own
        (no committed token) has its file at its path."""
        token = token or self.committed_token
        if self.parts:
            return ""
        if token:
            return attempt_path(self.path, token)
        return self.path if self.state in (WRITTEN, VERIFIED, CONSUMED) else ""

    def observation(self) -> Observation | None:
        return Observation(**self.observed) if self.observed else None

    def to_pb(
        self,
        staging_dir: str,
        revision: int = 0,
        token: int = 0,
        consuming: dict[str, str] | None = None,
    ) -> pb.Entry:
        """The entry as the wire shows it; ``token``: the live claim's, whose attempt
        file it names (else the committed attempt's, if any)."""
        root = staging_dir.rstrip("/")
        attempt = self.attempt_path(token)
        given = {
            "task_id": self.task_id,
            "file_id": self.file_id,
            "path": self.path,
            # Paths are validated relative and normalised: joining is all it takes.
            "abs_path": f"{root}/{self.path}",
            "attempt_path": attempt,
            "abs_attempt_path": f"{root}/{attempt}" if attempt else "",
            "state": _STATE_PB[self.state],
            "size": self.size,
            # verified, else committed: a written entry's reply says what was stored
            "digest": self.digest or self.committed_digest,
            "retry_count": self.retry_count,
            "max_retries": self.max_retries,
            "owner": self.owner,
            "token": token,
            "consumers": self.consumers,
            "consumed_by": self.consumed_by,
            "depends_on": self.depends_on,
            "error": self.error,
            "updated_at": self.updated_at,
            "revision": revision,
            "consuming": consuming,
            "priority": self.priority,
            "not_before": _iso(self.not_before) if self.not_before > wall() else "",
            "parts": self.parts,
            "assembly": self.assembly,
            "attributes": self.attributes,
            "routed_to": self.routed_to,
            "claim_deadline_seconds": self.claim_deadline,
            "consume_deadline_seconds": self.consume_deadline,
            "staging_retention_seconds": self.retention,
            "consumed_at": _iso(self.consumed_at) if self.consumed_at else "",
            "staging_removed_at": (self.staging_removed or {}).get("at", ""),
            "traceparent": self.traceparent,
            "fairness_key": self.fairness_key,
            "expected_size": self.expected_size,
        }
        # Only what holds something goes to the constructor: an empty value is the
        # field's default on the wire, and the constructor costs per argument given
        # (most of an entry's are empty). The fields with presence are added apart.
        out = pb.Entry(**{k: v for k, v in given.items() if v})
        if self.rule >= 0:
            out.routing_rule = self.rule
        if self.pool or self.consume_pools or self.routed_pools:
            out.pools.produce = self.pool
            out.pools.consume.update({**self.consume_pools, **self.routed_pools})
        return out


_NO_DEFAULT = object()
_ENTRY_DEFAULTS: dict[str, Any] = {
    f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[operator]
    for f in fields(EntryRecord)
    if f.default is not MISSING or f.default_factory is not MISSING
}
#: each field of an entry with its default (or none), in order: what ``dump`` compares
_ENTRY_FIELD_DEFAULTS = tuple((f.name, _ENTRY_DEFAULTS.get(f.name, _NO_DEFAULT))
                              for f in fields(EntryRecord))
_ENTRY_ATTRIBUTES = len(_ENTRY_FIELD_DEFAULTS) + 2


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
    priority: int = 0
    backoff: list[float] = field(default_factory=lambda: [1.0, 2.0, 60.0])
    aging: float = 60.0
    status_reason: str = ""
    created_at: str = ""
    updated_at: str = ""
    #: the manifest's access rules (registry.access.to_dict)
    access: dict[str, Any] = field(default_factory=dict)
    digest_optional: bool = False
    #: seconds after it finished that it is archived (0: the registry's default; < 0: never)
    archive_after: float = 0.0
    #: when it completed or was cancelled (RFC 3339)
    finished_at: str = ""
    #: once archived: when, where (the store's name for it), and its entries by state
    archived_at: str = ""
    archive: str = ""
    archived_states: dict[str, int] = field(default_factory=dict)
    #: the manifest's routing rules: [{"condition": ..., "groups": [...]}, ...]
    routing_rules: list[dict[str, Any]] = field(default_factory=list)
    #: who may read its contents (registry.access.readers_of): the patterns of every
    #: producer and consumer rule; None: every identity may produce or consume
    #: something, so every identity reads it
    readers: list[str] | None = None
    #: its manifest's staging retention (None: the registry's default when created)
    staging_retention: float | None = None
    #: the manifest's concurrency pools ({"produce": NAME, "consume": {GROUP: NAME}}),
    #: and every pool its entries name (what ``baton pool ls`` counts waiting entries of)
    pools: dict[str, Any] = field(default_factory=dict)
    pools_used: list[str] = field(default_factory=list)
    #: per consumer group, the most entries its backlog may hold (producers' claims
    #: are refused with Backpressure at it); empty: no limit, no counting
    backlog_limits: dict[str, int] = field(default_factory=dict)
    #: its fair shares: the declared keys' weights and the default key (empty: none)
    fairness_weights: dict[str, int] = field(default_factory=dict)
    fairness_default: str = ""
    #: whether some entry depends on another task's entry (``task:file_id``): another
    #: task's verification tells nothing, so the scheduler looks at such a task's waiting
    #: entries every few seconds; None: not known (a header an older registry wrote,
    #: learnt once by the leader's scheduler when it starts, ``Scheduler.learn_cross_deps``)
    cross_deps: bool | None = None

    @classmethod
    def load(cls, raw: bytes) -> TaskRecord:
        rec: TaskRecord = _load(cls, raw)
        return rec

    def dump(self) -> bytes:
        self.updated_at = now()
        return _encode_sorted(self)

    def to_pb(self, states: dict[str, int] | None = None) -> pb.Task:
        spec = pb.TaskSpec(
            task_id=self.task_id,
            schema_version=self.schema_version,
            consumers=self.consumers,
            max_retries=self.max_retries,
            labels=self.labels,
            priority=self.priority,
            backoff=pb.RetryBackoff(base_seconds=self.backoff[0], factor=self.backoff[1],
                                    cap_seconds=self.backoff[2]),
            aging_seconds=self.aging,
            access=access_from_dict(self.access),
            digest_optional=self.digest_optional,
            archive_after_seconds=self.archive_after,
            routing_rules=[pb.RoutingRule(condition=r["condition"], groups=r["groups"],
                                          pools=r.get("pools", {}))
                           for r in self.routing_rules],
            staging_retention_seconds=self.staging_retention,
            pools=pb.Pools(produce=self.pools.get("produce", ""),
                           consume=self.pools.get("consume", {})),
            backlog_limits={g: pb.BacklogLimit(entries=n)
                            for g, n in self.backlog_limits.items()},
            fairness=pb.Fairness(
                keys={k: pb.FairnessKey(weight=w) for k, w in self.fairness_weights.items()},
                default_key=self.fairness_default) if self.fairness_weights else None,
        )
        return pb.Task(
            spec=spec,
            status=_TASK_STATUS_PB[self.status],
            staging_dir=self.staging_dir,
            entry_count=self.entry_count,
            created_at=self.created_at,
            manifest_digest=self.manifest_digest,
            states=states or self.archived_states,
            status_reason=self.status_reason,
            finished_at=self.finished_at,
            archived_at=self.archived_at,
            archive=self.archive,
        )
