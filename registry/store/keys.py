"""Every etcd key Baton uses, built in this one module.

Layout under the prefix (default ``/baton/v1/``)::

    tasks/{task}                       task header (JSON)
    entries/{task}/{file}              one entry per file (JSON)
    ready/{task}/{order}/{file}        index: pending and claimable; ``order`` sorts
                                       by priority with aging, then age (then, with
                                       fair shares, ``{order}.{virtual time}``)
    delayed/{task}/{due}/{file}        index: pending, in retry backoff until ``due``
    waiting/{task}/{file}              index: pending, waits for dependencies (or an
                                       assembly for its parts)
    cready/{task}/{group}/{file}       index: entry is verified, group has not consumed it
    cdelayed/{task}/{due}/{group}/{file}  index: verified, nacked by group with a delay;
                                       handed back to the group at ``due`` (epoch ms)
    open/{task}/{file}                 index: entry not done yet (task completion)
    finishing/{task}/{file}            index: the entry finished (its open key went, same
                                       transaction): the leader looks at its task's
                                       completion, then deletes it
    wakes/{task}/{file}                index: the entry became verified and has dependents
                                       or an assembly (same transaction): the leader checks
                                       them, then deletes it
    cancels/{due}/{task}               the task was cancelled (same transaction as its
                                       header); its cancel deletes it once every claim and
                                       index key is revoked, else the leader finishes the
                                       cancel from ``due`` (epoch ms) on
    dead/{task}/{file}                 index: entry is dead
    journal/{task}/{file}/{seq}        one record per transition, same transaction
    checkpoints/{task}/p/{file}        the latest checkpoint of a producer's attempt
    checkpoints/{task}/c/{group}/{file}  and of a consumer group's lease (durable)
    stalls/{due}/p/{task}/{file}       when an attempt counts as stalled (epoch ms) unless
    stalls/{due}/c/{task}/{group}/{file}  it checkpoints: {token, after}
    slots/{session}/{n}                leased: one of the session's claim slots
    claims/p/{task}/{file}             leased producer claim   (lease = the session's)
    claims/c/{task}/{group}/{file}     leased consume-claim    (lease = the session's)
    inflight/p/{task}/{file}           durable twin of a claim; same create revision
    inflight/c/{task}/{group}/{file}   durable twin of a consume-claim
    deadlines/{due}/p/{task}/{file}    a claim's processing deadline (epoch ms), written with
    deadlines/{due}/c/{task}/{group}/{file}  the claim: same create revision
    agents/{session}                   leased agent session record (JSON)
    drains/{host}                      a drained host: {deadline, by, reason}
    watchers/{watcher}                 leased watcher registration (its capacity, draining)
    shards/{n}                         owner and epoch of shard n (docs/architecture.md)
    shardmap                           how many shards the deployment's tasks map to
    requests/{request_id}              outcome of a mutating call, for retries (leased,
                                       10 min; a new lease every 15 s)

A session's id is the id of the first etcd lease it had; ``baton lease rotate``
moves it onto another lease, so the key ``agents/{session}`` stays while its lease
changes. The record's lease (``kv.lease``) is the session's lease now: every key
of the session (record, claims, slots) is attached to it, and a claim names its
session in its value (``session``), never through its lease. The record holds
agent, host, pid, version, ttl, slots, opened_at, identity, and while something
is under way: ``rotating_from`` (the old lease of a rotation moving keys in
chunks; both leases are kept alive until it is cleared), ``draining`` (the host
is drained: no new claims) and ``revoked`` ({by, reason}: an operator revokes
it; nothing more is handed to it while its claims go back).

A claim key and its inflight twin are written by the same transaction, so both
carry the same create revision: that revision is the fencing token. When the
lease dies etcd deletes the claim but not its twin; the reaper finds twins
without a claim and moves their entries on.

Ids are restricted to ``[A-Za-z0-9._-]`` by validation, so a ``/`` can never
appear inside one path segment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClaimRef:
    """What a claim (or inflight) key names, parsed back from the key."""

    kind: str  # "p" producer, "c" consumer
    task_id: str
    file_id: str
    group: str = ""


@dataclass(frozen=True)
class Keys:
    """Key builder bound to one prefix (tests give each case its own)."""

    prefix: str = "/baton/v1/"

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or not self.prefix.endswith("/"):
            raise ValueError(f"key prefix must start and end with '/': {self.prefix!r}")

    def _k(self, *parts: str) -> bytes:
        return (self.prefix + "/".join(parts)).encode()

    # tasks and entries
    def task(self, task_id: str) -> bytes:
        return self._k("tasks", task_id)

    def tasks(self) -> bytes:
        return self._k("tasks", "")

    def entry(self, task_id: str, file_id: str) -> bytes:
        return self._k("entries", task_id, file_id)

    def dependency(self, task_id: str, name: str) -> bytes:
        """The entry a ``depends_on`` name of an entry of ``task_id`` means: a file id of
        the same task, or ``other-task:file_id``."""
        other, sep, file_id = name.partition(":")
        return self.entry(other, file_id) if sep else self.entry(task_id, name)

    def entries(self, task_id: str) -> bytes:
        return self._k("entries", task_id, "")

    def entries_all(self) -> bytes:
        return self._k("entries", "")

    # claimable indexes
    def ready(self, task_id: str, order: int, file_id: str) -> bytes:
        return self._k("ready", task_id, f"{order:015d}", file_id)

    def ready_fair(self, task_id: str, order: int, fair_time: int, file_id: str) -> bytes:
        """A ready key of an entry with a fairness key: ``order``, then its virtual
        time, sort it (registry.fairness)."""
        return self._k("ready", task_id, f"{order:015d}.{fair_time:013d}", file_id)

    def ready_all(self, task_id: str) -> bytes:
        return self._k("ready", task_id, "")

    def ready_root(self) -> bytes:
        return self._k("ready", "")

    def delayed(self, task_id: str, due_ms: int, file_id: str) -> bytes:
        return self._k("delayed", task_id, f"{due_ms:015d}", file_id)

    def delayed_of_task(self, task_id: str) -> bytes:
        return self._k("delayed", task_id, "")

    def delayed_all(self) -> bytes:
        return self._k("delayed", "")

    def waiting(self, task_id: str, file_id: str) -> bytes:
        return self._k("waiting", task_id, file_id)

    def waiting_all(self) -> bytes:
        return self._k("waiting", "")

    def open(self, task_id: str, file_id: str) -> bytes:
        return self._k("open", task_id, file_id)

    def open_all(self, task_id: str) -> bytes:
        return self._k("open", task_id, "")

    def open_root(self) -> bytes:
        """Every task's ``open`` index."""
        return self._k("open", "")

    def finishing(self, task_id: str, file_id: str) -> bytes:
        return self._k("finishing", task_id, file_id)

    def finishing_of_task(self, task_id: str) -> bytes:
        return self._k("finishing", task_id, "")

    def finishing_all(self) -> bytes:
        return self._k("finishing", "")

    def wake(self, task_id: str, file_id: str) -> bytes:
        return self._k("wakes", task_id, file_id)

    def wakes_of_task(self, task_id: str) -> bytes:
        return self._k("wakes", task_id, "")

    def wakes(self) -> bytes:
        return self._k("wakes", "")

    def cancel(self, due_ms: int, task_id: str) -> bytes:
        return self._k("cancels", f"{due_ms:015d}", task_id)

    def cancels(self) -> bytes:
        return self._k("cancels", "")

    def due_until(self, base: bytes, now_ms: int) -> bytes:
        """The end of the range of keys under ``base`` (``{due}/…``, due in epoch ms) due by
        ``now_ms``: a range [base, this) reads, and makes etcd walk, only what is due."""
        return base + f"{now_ms + 1:015d}".encode()

    def dead(self, task_id: str, file_id: str) -> bytes:
        return self._k("dead", task_id, file_id)

    def dead_all(self, task_id: str) -> bytes:
        return self._k("dead", task_id, "")

    def dead_root(self) -> bytes:
        """Every task's ``dead`` index."""
        return self._k("dead", "")

    def journal(self, task_id: str, file_id: str, seq: int) -> bytes:
        return self._k("journal", task_id, file_id, f"{seq:08d}")

    def journal_all(self, task_id: str, file_id: str = "") -> bytes:
        return self._k("journal", task_id, file_id, "") if file_id else self._k(
            "journal", task_id, "")

    def slot(self, session_id: int, n: int) -> bytes:
        return self._k("slots", f"{session_id:016x}", f"{n:04d}")

    def slots(self, session_id: int) -> bytes:
        return self._k("slots", f"{session_id:016x}", "")

    def slots_all(self) -> bytes:
        return self._k("slots", "")

    # elections: a candidate's key per lease under each election's name
    def election(self, name: str) -> bytes:
        return self._k("election", name, "")

    def candidate(self, name: str, lease: int) -> bytes:
        return self._k("election", name, f"{lease:x}")

    # concurrency pools: a definition (its limit) and one key per unit held
    def pool(self, name: str) -> bytes:
        return self._k("pools", name)

    def pools(self) -> bytes:
        return self._k("pools", "")

    def pool_unit(self, name: str, n: int) -> bytes:
        return self._k("poolunits", name, f"{n:05d}")

    def pool_units(self, name: str) -> bytes:
        return self._k("poolunits", name, "")

    def pool_units_all(self) -> bytes:
        return self._k("poolunits", "")

    def claims_of_task(self, kind: str, task_id: str) -> bytes:
        return self._k("claims", kind, task_id, "")

    def inflight_of_task(self, kind: str, task_id: str) -> bytes:
        return self._k("inflight", kind, task_id, "")

    def inflight_of_kind(self, kind: str) -> bytes:
        """Every task's durable twins of one kind (``p`` producers', ``c`` consumers')."""
        return self._k("inflight", kind, "")

    def inflight_of_group(self, task_id: str, group: str) -> bytes:
        """The durable twins of a consumer group's consume-claims in a task."""
        return self._k("inflight", "c", task_id, group, "")

    def cready_of_task(self, task_id: str) -> bytes:
        return self._k("cready", task_id, "")

    def last_segment(self, key: bytes) -> str:
        """The id at the end of an index key (the file id)."""
        return key.rsplit(b"/", 1)[-1].decode()

    @staticmethod
    def below(base: bytes, *segments: str) -> bytes:
        """The prefix of ``segments`` under the prefix ``base`` (one task's part of an
        index of every task: ``below(keys.delayed_all(), task_id)``)."""
        return base + "".join(f"{s}/" for s in segments).encode()

    @staticmethod
    def unit_number(key: bytes) -> int:
        """The number at the end of a pool unit's or a slot's key."""
        return int(key.rsplit(b"/", 1)[-1])

    def parse_tail(self, key: bytes, base: bytes) -> list[str]:
        """The segments of ``key`` after ``base``."""
        return key[len(base):].decode().split("/")

    def cready(self, task_id: str, group: str, file_id: str) -> bytes:
        return self._k("cready", task_id, group, file_id)

    def cready_all(self, task_id: str, group: str) -> bytes:
        return self._k("cready", task_id, group, "")

    def cready_root(self) -> bytes:
        return self._k("cready", "")

    def cdelayed(self, task_id: str, due_ms: int, group: str, file_id: str) -> bytes:
        return self._k("cdelayed", task_id, f"{due_ms:015d}", group, file_id)

    def cdelayed_of_task(self, task_id: str) -> bytes:
        return self._k("cdelayed", task_id, "")

    def cdelayed_all(self) -> bytes:
        return self._k("cdelayed", "")

    # claims and their durable twins
    def claim(self, ref: ClaimRef) -> bytes:
        return self._k("claims", *self._ref_parts(ref))

    def inflight(self, ref: ClaimRef) -> bytes:
        return self._k("inflight", *self._ref_parts(ref))

    def claims_all(self) -> bytes:
        return self._k("claims", "")

    def inflight_all(self) -> bytes:
        return self._k("inflight", "")

    def parse_inflight(self, key: bytes) -> ClaimRef:
        return self._parse_ref(key, self.inflight_all())

    def parse_claim(self, key: bytes) -> ClaimRef:
        return self._parse_ref(key, self.claims_all())

    @staticmethod
    def _ref_parts(ref: ClaimRef) -> tuple[str, ...]:
        if ref.kind == "p":
            return ("p", ref.task_id, ref.file_id)
        return ("c", ref.task_id, ref.group, ref.file_id)

    @staticmethod
    def _parse_ref(key: bytes, base: bytes) -> ClaimRef:
        parts = key[len(base) :].decode().split("/")
        if parts[0] == "p" and len(parts) == 3:
            return ClaimRef("p", parts[1], parts[2])
        if parts[0] == "c" and len(parts) == 4:
            return ClaimRef("c", parts[1], parts[3], group=parts[2])
        raise ValueError(f"not a claim key: {key!r}")

    # checkpoints and stalls
    def checkpoint(self, ref: ClaimRef) -> bytes:
        """The latest checkpoint of the attempts on a claim's entry (and group)."""
        if ref.kind == "p":
            return self._k("checkpoints", ref.task_id, "p", ref.file_id)
        return self._k("checkpoints", ref.task_id, "c", ref.group, ref.file_id)

    def checkpoints_of_task(self, task_id: str) -> bytes:
        return self._k("checkpoints", task_id, "")

    def stall(self, due_ms: int, ref: ClaimRef) -> bytes:
        return self._k("stalls", f"{due_ms:015d}", *self._ref_parts(ref))

    def stalls(self) -> bytes:
        return self._k("stalls", "")

    def parse_stall(self, key: bytes) -> tuple[int, ClaimRef]:
        """(due, in epoch ms; the claim) of a stall key."""
        due, _, rest = key[len(self.stalls()):].partition(b"/")
        return int(due), self._parse_ref(rest, b"")

    # processing deadlines
    def deadline(self, due_ms: int, ref: ClaimRef) -> bytes:
        return self._k("deadlines", f"{due_ms:015d}", *self._ref_parts(ref))

    def deadlines(self) -> bytes:
        return self._k("deadlines", "")

    def parse_deadline(self, key: bytes) -> tuple[int, ClaimRef]:
        """(due, in epoch ms; the claim) of a deadline key."""
        due, _, rest = key[len(self.deadlines()):].partition(b"/")
        return int(due), self._parse_ref(rest, b"")

    # sessions and request outcomes
    def agent(self, session_id: int) -> bytes:
        return self._k("agents", f"{session_id:016x}")

    def agents(self) -> bytes:
        return self._k("agents", "")

    def session_of(self, key: bytes) -> int:
        """The session id an ``agents/`` key names."""
        return int(self.last_segment(key), 16)

    def drain(self, host: str) -> bytes:
        return self._k("drains", host)

    def drains(self) -> bytes:
        return self._k("drains", "")

    # watchers and shards
    def watcher(self, watcher_id: str) -> bytes:
        return self._k("watchers", watcher_id)

    def watchers(self) -> bytes:
        return self._k("watchers", "")

    def shard(self, n: int) -> bytes:
        return self._k("shards", f"{n:05d}")

    def shards(self) -> bytes:
        return self._k("shards", "")

    def shardmap(self) -> bytes:
        return self._k("shardmap")

    def request(self, request_id: str) -> bytes:
        return self._k("requests", request_id)


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that covers every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"
