"""The checker: what the agents recorded, held against the registry's journal and state.

Five kinds of violation fail a run:

- ``lost``: an entry that was created but is gone, is not terminal and cannot move on
  by itself (no index key while pending, no claim nor twin while writing, written and
  never verified, verified with a group that can neither take it nor holds it), whose
  journal has a gap, or a call an agent was told had applied that the journal lacks;
- ``double``: one consumer group handed or acking one entry twice;
- ``stale``: a claim, commit or ack accepted while its token was not the live one;
- ``badverify``: a verification whose digest is not the digest of the bytes the
  producer of the accepted commit wrote, or a commit accepted for bytes its producer
  did not write (no successful write of that size recorded, or a failed one);
- ``badread``: a consumer given a lease on an entry that was not verified, or whose
  digest is not the verified one, or that read bytes other than the verified ones
  (every payload names its producer attempt, see ``payload.py``);
- ``badcheckpoint``: a claim handed a checkpoint that no earlier, unfinished attempt
  of its entry sent, or an older one than an earlier attempt's that the registry
  accepted, or none when one was accepted (since the last accepted commit: a commit
  drops the checkpoint). Counted, like ``badremove``, among the figures after ``|``;
- ``badremove``: the staging retention recorded the removal of a file whose entry was
  not consumed, or (when the run's files are known: tasks with a short retention) a
  verified entry's file is gone from staging. A consumed entry's file is expected to
  be gone; one marked removed and still there at the end (a watcher killed between
  the mark and the unlink, not yet healed) is counted (``staging_left``).

The journal is the ground truth of what applied (calls whose outcome the agents never
learnt included); the histories say what each agent was told and what it wrote and read.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from baton_relay.kernel.contract import attempt_path
from baton_relay.registry.store.keys import ClaimRef

from .state import EntryKey, JournalRecord, Snapshot

KINDS = ("lost", "double", "stale", "badverify", "badread")
#: a violation of the staging retention: it fails the run like the others, and is
#: counted among the figures after ``|`` (the verdict keeps the five kinds every
#: recorded run printed)
BADREMOVE = "badremove"
#: a claim handed the wrong checkpoint (see above); counted after ``|`` as well
BADCHECKPOINT = "badcheckpoint"
#: more units of a concurrency pool held than its limit (sampled during the run, or
#: producer claims of its entries overlapping in the journal), and a unit left held
#: without its claim; counted after ``|`` as well
POOLOVER = "poolover"
POOLLEAK = "poolleak"
TERMINAL = ("consumed", "dead")
#: history operations that are calls to the registry (their completions count as ops)
CALLS = ("open-session", "claim", "commit", "fail", "consume", "ack", "nack", "create-task",
         "checkpoint")


@dataclass(frozen=True)
class Violation:
    kind: str
    task: str
    file: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.task}/{self.file}: {self.detail}"


@dataclass
class Report:
    ops: int = 0
    nemeses: int = 0
    violations: list[Violation] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    #: what is worth knowing but fails nothing (e.g. whose bytes a mismatch found)
    notes: list[str] = field(default_factory=list)

    def add(self, kind: str, entry: EntryKey, detail: str) -> None:
        self.violations.append(Violation(kind, entry[0], entry[1], detail))

    def count(self, kind: str) -> int:
        return sum(1 for v in self.violations if v.kind == kind)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        """The one line a run prints: ops, nemeses, the five counts, then context."""
        head = " ".join([f"ops={self.ops}", f"nemeses={self.nemeses}",
                         *(f"{k}={self.count(k)}" for k in KINDS)])
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.stats.items()))
        return f"faults: {head}" + (f" | {extra}" if extra else "")


class _Histories:
    """What the agents recorded, indexed by (task, file, token)."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.writes: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.leases: dict[EntryKey, list[dict[str, Any]]] = defaultdict(list)
        self.ok: dict[str, list[dict[str, Any]]] = defaultdict(list)
        #: attempts whose write or publish failed (ENOSPC...): nothing may be committed
        self.write_failures: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.reads: list[dict[str, Any]] = []
        self.read_failures = 0
        #: checkpoints sent, by entry: (token, bytes) -> "ok" or "info" (may have applied:
        #: the reply was lost, or the agent died with the call in flight)
        self.checkpoints: dict[EntryKey, dict[tuple[int, int], str]] = defaultdict(dict)
        self.unknown = 0
        #: calls refused because etcd was at its quota
        self.storage_full = 0
        #: producers' claims refused (after the helper's wait) by a task's back-pressure
        self.backpressured = 0
        self.ops = 0
        for r in records:
            op, phase = r.get("op", ""), r.get("phase", "")
            if op in CALLS and phase in ("ok", "fail", "info"):
                self.ops += 1
                self.unknown += phase == "info"
                self.storage_full += r.get("error") == "StorageFull"
                self.backpressured += r.get("error") == "Backpressure"
            if op == "write" and phase == "ok":
                self.writes[(r["task"], r["file"], int(r["token"]))] = r
            elif op == "write" and phase == "fail":
                self.write_failures[(r["task"], r["file"], int(r.get("token") or 0))] = r
            elif op == "consume" and phase == "ok":
                self.leases[(r["task"], r["file"])].append(r)
            elif op == "read":
                if phase == "ok":
                    self.reads.append(r)
                else:
                    self.read_failures += 1
            if phase == "ok" and op in ("claim", "commit", "ack"):
                self.ok[op].append(r)
            if op == "checkpoint":
                self._checkpoint(r, phase)
        # a checkpoint invoked and never completed (its agent SIGKILLed) may have applied
        for sent in self.checkpoints.values():
            for at, phase in sent.items():
                if phase == "invoke":
                    sent[at] = "info"

    def _checkpoint(self, r: dict[str, Any], phase: str) -> None:
        sent = self.checkpoints[(r["task"], r["file"])]
        at = (int(r["token"]), int(r["n"]))
        if phase == "ok":
            sent[at] = "ok"
        elif phase == "fail":  # refused: it did not apply
            if sent.get(at) == "invoke":
                del sent[at]
        elif sent.get(at) != "ok":
            sent[at] = "info" if phase == "info" else sent.get(at, "invoke")


@dataclass
class _Seen:
    """What the journals showed, for the checks of what agents were handed."""

    #: (task, file, commit token) -> the digest its verification recorded
    verified: dict[tuple[str, str, int], str] = field(default_factory=dict)
    #: (task, file, consume token) -> the verified digest then in force (None: none)
    consumes: dict[tuple[str, str, int], str | None] = field(default_factory=dict)


def check(records: list[dict[str, Any]], snap: Snapshot,
          created: dict[str, list[str]], nemeses: int = 0,
          staged: set[str] | None = None,
          pool_samples: list[tuple[str, int, int]] | None = None,
          pool_repaired: dict[str, int] | None = None) -> Report:
    """Check a run: agents' ``records``, the final ``snap``, the entries ``created`` per
    task; ``staged``: the files under the staging root at the end (``TASK/PATH``), when
    the staging retention removed files during the run; ``pool_samples``: the pools
    as sampled during the run (pool, units in use, limit); ``pool_repaired``: each
    registry's ``baton_pool_units_repaired_total`` at the end."""
    hist = _Histories(records)
    report = Report(ops=hist.ops, nemeses=nemeses)
    # Counted below only when they happen; the summary line shows them at 0 too, so
    # every run's line carries the same keys (a reader's grep finds them).
    for always in ("reaped", "retries", "tmp_left", "pool_claims", "pool_peak",
                   "pool_repaired"):
        report.stats[always] += 0
    seen = _Seen()
    for key in sorted(set(snap.entries) | set(snap.journal)):
        _walk(key, snap.journal.get(key, []), hist, report, seen)
    _check_final(snap, created, report)
    _check_acknowledged(snap, hist, report)
    _check_leases(hist, seen, report)
    _check_reads(hist, seen, report)
    _explain_retries(snap, hist, report)
    _check_removals(snap, staged, report)
    _check_checkpoints(snap, hist, report)
    _check_pools(snap, pool_samples or [], report)
    _check_repaired(pool_repaired or {}, report)
    report.stats[BADREMOVE] = report.count(BADREMOVE)
    report.stats[BADCHECKPOINT] = report.count(BADCHECKPOINT)
    report.stats[POOLOVER] = report.count(POOLOVER)
    report.stats[POOLLEAK] = report.count(POOLLEAK)
    report.stats["unknown"] = hist.unknown
    report.stats["mismatched_reads"] = hist.read_failures
    report.stats["write_failed"] = len(hist.write_failures)
    report.stats["storage_full"] = hist.storage_full
    report.stats["backpressured"] = hist.backpressured
    return report


def _walk(key: EntryKey, journal: list[JournalRecord], hist: _Histories, report: Report,
          seen: _Seen) -> None:
    """Replay one entry's journal: who held which token when, and what was verified."""
    state = ""
    live_p: int | None = None  # the producer claim's token while writing
    committed: JournalRecord | None = None  # the accepted commit of this attempt
    verified: str | None = None  # the digest in force while verified
    live_c: dict[str, set[int]] = defaultdict(set)
    acked: dict[str, list[int]] = defaultdict(list)
    for r in journal:
        rev = r.rev
        if r.event == "claimed":
            if live_p is not None:
                report.add("stale", key, f"claim {rev} accepted while claim {live_p} lives")
            live_p, committed = rev, None
        elif r.event == "committed":
            if r.token != live_p:
                report.add("stale", key, f"commit with token {r.token} accepted at revision "
                           f"{rev}; the live claim was {live_p}")
            _check_written(key, r, hist, report)
            committed, live_p = r, None
        elif r.event == "verified":
            _check_verified(key, r, committed, hist, report)
            verified = r.digest
            if committed is not None:
                seen.verified[(key[0], key[1], committed.token)] = r.digest
                # a resumed write's bytes are the payload of the attempt it went on from
                write = hist.writes.get((key[0], key[1], committed.token), {})
                origin = int(write.get("origin_token") or committed.token)
                seen.verified[(key[0], key[1], origin)] = r.digest
        elif r.event == "consuming":  # a consume lease: its token is this revision
            seen.consumes[(key[0], key[1], rev)] = verified
            if state != "verified":
                report.add("badread", key, f"group {r.group} was granted token {rev} while "
                           f"the entry was {state or 'not yet created'}")
            if acked[r.group]:
                report.add("double", key, f"group {r.group} granted token {rev} after it "
                           f"acked token {acked[r.group][0]}")
            if live_c[r.group]:
                report.add("double", key, f"group {r.group} granted token {rev} while it "
                           f"holds {sorted(live_c[r.group])}")
            live_c[r.group].add(rev)
        elif r.event == "acked":
            if r.token not in live_c[r.group]:
                report.add("stale", key, f"ack of group {r.group} with token {r.token} "
                           f"accepted at revision {rev}; live: {sorted(live_c[r.group])}")
            live_c[r.group].discard(r.token)
            acked[r.group].append(r.token)
            if len(acked[r.group]) > 1:
                report.add("double", key, f"group {r.group} acked twice: {acked[r.group]}")
        elif r.event in ("nacked", "consumer lost"):
            live_c[r.group].discard(r.token)
        if r.from_state == "writing" and r.to_state != "writing":
            live_p = None
        if r.from_state == "verified" and r.to_state not in ("verified", "consumed"):
            live_c.clear()  # unverified: every consume-claim was revoked with it
            verified = None
        state = r.to_state


def _check_written(key: EntryKey, r: JournalRecord, hist: _Histories,
                   report: Report) -> None:
    """A commit is accepted only for bytes its producer wrote: a successful write of
    that size recorded under its token, and no failed write or publish."""
    attempt = (key[0], key[1], r.token)
    write = hist.writes.get(attempt)
    failed = hist.write_failures.get(attempt)
    if failed is not None:
        report.add("badverify", key, f"commit of token {r.token} accepted at revision "
                   f"{r.rev}, but {failed['process']}'s write of it failed: "
                   f"{failed.get('error')}: {failed.get('message', '')[:120]}")
    elif write is None:
        report.add("badverify", key, f"commit of token {r.token} accepted at revision "
                   f"{r.rev}, but no producer recorded writing its bytes")
    elif int(write["size"]) != r.size:
        report.add("badverify", key, f"commit of token {r.token} accepted at revision "
                   f"{r.rev} with size {r.size}; {write['process']} wrote {write['size']} "
                   "bytes")


def _check_verified(key: EntryKey, r: JournalRecord, committed: JournalRecord | None,
                    hist: _Histories, report: Report) -> None:
    if committed is None:
        report.add("badverify", key, f"verified at revision {r.rev} with no accepted commit")
        return
    write = hist.writes.get((key[0], key[1], committed.token))
    if write is None:
        report.add("badverify", key, f"verified at revision {r.rev}, but no producer "
                   f"recorded writing the bytes of token {committed.token}")
    elif write["digest"] != r.digest or int(write["size"]) != committed.size:
        report.add("badverify", key, f"verified digest {r.digest} at revision {r.rev}; the "
                   f"producer of token {committed.token} wrote {write['size']} bytes with "
                   f"digest {write['digest']}")


def _check_final(snap: Snapshot, created: dict[str, list[str]], report: Report) -> None:
    """Every created entry exists, its journal is whole, and it is done or can move on."""
    for task, files in created.items():
        for file in files:
            if (task, file) not in snap.entries:
                report.add("lost", (task, file), "created, but the entry is gone")
    report.stats["dead"] += 0  # always shown: entries that used up their retries
    for key, rec in snap.entries.items():
        state = str(rec.get("state", "pending"))  # left out at its default
        report.stats[state] += 1
        report.stats["retries"] += int(rec.get("retry_count", 0))
        journal = [r for r in snap.journal.get(key, []) if r.transition]
        seqs = sorted(r.seq for r in journal)
        if seqs != list(range(1, int(rec.get("seq", 0)) + 1)):
            report.add("lost", key, f"journal records {seqs} do not match seq {rec.get('seq')}")
        elif journal and journal[-1].to_state != state:
            report.add("lost", key, f"entry is {state}, its journal ends in "
                       f"{journal[-1].to_state}")
        if state in TERMINAL:
            continue
        why = _stuck(snap, key, rec)
        if why:
            report.add("lost", key, why)
        else:
            report.stats["unfinished"] += 1


def _stuck(snap: Snapshot, key: EntryKey, rec: dict[str, Any]) -> str:
    """Why a non-terminal entry can never move on by itself ("" if it can)."""
    task, file = key
    state = str(rec.get("state", "pending"))  # left out at its default
    if state == "pending":
        index = str(rec.get("index", ""))
        if not index or not snap.has(index.encode()):
            return f"pending without its index key ({index or 'none'})"
    elif state == "writing":
        if not snap.has_claim(ClaimRef("p", task, file)):
            return "writing, but neither the claim nor its twin exists"
    elif state == "written":
        return "written, but never verified nor sent back"
    elif state == "verified":
        for group in rec.get("consumers", []):
            if group in rec.get("consumed_by", []):
                continue
            if not (snap.has(snap.k.cready(task, group, file))
                    or snap.has_claim(ClaimRef("c", task, file, group))):
                return f"verified, but group {group} can neither take it nor holds it"
    return ""


def _check_checkpoints(snap: Snapshot, hist: _Histories, report: Report) -> None:
    """Each claim is handed the latest checkpoint an earlier attempt of its entry left
    since the last accepted commit (which drops it), and only one that was sent."""
    handed_any = 0
    # claims the journal shows that no agent was told of (its process was killed, or
    # produce() failed in taking up a partial file): what they recorded is unknown
    told = {(r["task"], r["file"], int(r["token"])) for r in hist.ok["claim"]}
    untold = {(k[0], k[1], r.rev) for k, rs in snap.journal.items() for r in rs
              if r.event == "claimed"} - told
    for claim in hist.ok["claim"]:
        key: EntryKey = (claim["task"], claim["file"])
        token = int(claim["token"])
        commits = [r.token for r in snap.journal.get(key, [])
                   if r.event == "committed" and r.token < token]
        since = max(commits, default=0)
        sent = {at: phase for at, phase in hist.checkpoints.get(key, {}).items()
                if since < at[0] < token}
        accepted = [at for at, phase in sent.items() if phase == "ok"]
        handed = claim.get("resumed_from")
        if handed is None:
            if accepted:
                report.add(BADCHECKPOINT, key, f"claim {token} was handed no checkpoint; "
                           f"the registry accepted {max(accepted)} (token, bytes) before it")
            continue
        handed_any += 1
        at = (int(handed["token"]), int(handed["n"]))
        if at not in sent and (key[0], key[1], at[0]) in untold and since < at[0] < token:
            report.stats["checkpoints_of_unknown_claims"] += 1
        elif at not in sent:
            report.add(BADCHECKPOINT, key, f"claim {token} was handed checkpoint {at} "
                       "(token, bytes), which no earlier unfinished attempt sent")
        elif accepted and at < max(accepted):
            report.add(BADCHECKPOINT, key, f"claim {token} was handed checkpoint {at}; "
                       f"a later one, {max(accepted)}, had been accepted")
    report.stats["checkpoints"] += sum(
        1 for sent in hist.checkpoints.values() for phase in sent.values() if phase == "ok")
    report.stats["resumed"] += handed_any


def _check_removals(snap: Snapshot, staged: set[str] | None, report: Report) -> None:
    """Only consumed entries' files leave staging, and each removal is recorded once."""
    for key, journal in snap.journal.items():
        marks = [r for r in journal if r.event == "staging_removed"]
        report.stats["staging_removed"] += len(marks)
        for r in marks:
            if r.from_state != "consumed":
                report.add(BADREMOVE, key, f"removal recorded at revision {r.rev} while "
                           f"the entry was {r.from_state}")
        if len(marks) > 1:
            report.add(BADREMOVE, key, f"removal recorded {len(marks)} times")
        report.stats["staging_changed"] += sum(1 for r in journal
                                               if r.event == "staging_changed")
    if staged is None:
        return
    report.stats["staging_left"] += 0
    for (task, file), rec in snap.entries.items():
        # the committed attempt's file (an entry committed before attempts had files
        # of their own has it at its path)
        token = int(rec.get("committed_token", 0))
        path = str(rec.get("path", ""))
        where = f"{task}/{attempt_path(path, token) if token else path}"
        if rec.get("state") == "verified" and where not in staged:
            report.add(BADREMOVE, (task, file), f"verified, but {where} is gone")
        elif rec.get("staging_removed") and where in staged:
            report.stats["staging_left"] += 1
            report.notes.append(f"{where}: its removal was recorded, the file is still "
                                "there (a watcher stopped between the two)")


def _check_acknowledged(snap: Snapshot, hist: _Histories, report: Report) -> None:
    """Every claim, commit and ack an agent was told had applied is in the journal."""
    claimed = {(k, r.rev) for k, rs in snap.journal.items() for r in rs if r.event == "claimed"}
    committed = {(k, r.token) for k, rs in snap.journal.items() for r in rs
                 if r.event == "committed"}
    acked = {(k, r.group, r.token) for k, rs in snap.journal.items() for r in rs
             if r.event == "acked"}
    for r in hist.ok["claim"]:
        if ((r["task"], r["file"]), int(r["token"])) not in claimed:
            report.add("lost", (r["task"], r["file"]), f"claim {r['token']} granted to "
                       f"{r['process']} is not in the journal")
    for r in hist.ok["commit"]:
        if ((r["task"], r["file"]), int(r["token"])) not in committed:
            report.add("lost", (r["task"], r["file"]), f"commit {r['token']} acknowledged "
                       f"to {r['process']} is not in the journal")
    for r in hist.ok["ack"]:
        if ((r["task"], r["file"]), r["group"], int(r["token"])) not in acked:
            report.add("lost", (r["task"], r["file"]), f"ack {r['token']} of group "
                       f"{r['group']} acknowledged to {r['process']} is not in the journal")


def _check_leases(hist: _Histories, seen: _Seen, report: Report) -> None:
    """Every lease an agent was handed is in the journal and carries the verified digest."""
    for key, leases in hist.leases.items():
        for lease in leases:
            token = int(lease["token"])
            if (key[0], key[1], token) not in seen.consumes:
                report.add("lost", key, f"consume {token} granted to {lease['process']} is "
                           "not in the journal")
            elif lease.get("digest") != seen.consumes[(key[0], key[1], token)]:
                report.add("badread", key, f"lease {token} carries digest "
                           f"{lease.get('digest')}, the verified one was "
                           f"{seen.consumes[(key[0], key[1], token)]}")


def _check_reads(hist: _Histories, seen: _Seen, report: Report) -> None:
    """Bytes a consumer accepted are exactly some producer's payload, and the verified one."""
    leases = {(r["task"], r["file"], int(r["token"])): r
              for rs in hist.leases.values() for r in rs}
    for r in hist.reads:
        key = (r["task"], r["file"])
        lease = leases.get((r["task"], r["file"], int(r["token"])))
        origin = r.get("origin")
        if lease is None or r["digest"] != lease.get("digest"):
            report.add("badread", key, f"read digest {r['digest']} under token {r['token']} "
                       f"is not the lease's {lease and lease.get('digest')}")
        elif origin is None:
            report.add("badread", key, f"read {r['size']} bytes under token {r['token']} that "
                       "are no producer's payload")
        elif (origin["task"], origin["file"]) != key:
            report.add("badread", key, f"read the payload of {origin['task']}/{origin['file']}")
        elif seen.verified.get((key[0], key[1], int(origin["token"]))) != r["digest"]:
            report.add("badread", key, f"read the bytes of token {origin['token']}, which "
                       "were never verified")


_DISK_DIGEST = re.compile(r"digest ([0-9a-f]{64})\)?$")


def _explain_retries(snap: Snapshot, hist: _Histories, report: Report) -> None:
    """Count why entries went back for a retry; for a checksum mismatch or a verified
    file that changed, find whose bytes the watcher found on disk."""
    by_digest = {w["digest"]: w for w in hist.writes.values()}
    for key, journal in snap.journal.items():
        committed = 0
        for r in journal:
            if r.event == "committed":
                committed = r.token
            if r.event != "failed":
                continue
            if "lease of agent" in r.reason:
                report.stats["reaped"] += 1
                continue
            if r.reason.startswith("checksum mismatch"):
                report.stats["mismatch"] += 1
            elif r.from_state == "verified":
                report.stats["unverified"] += 1
            match = _DISK_DIGEST.search(r.reason)
            if match is None:
                continue
            write = by_digest.get(match.group(1))
            if write is not None and (write["task"], write["file"]) == key \
                    and int(write["token"]) != committed:
                report.stats["clobbered"] += 1
                report.notes.append(
                    f"{key[0]}/{key[1]} at revision {r.rev}: the file held the bytes of "
                    f"token {write['token']} ({write['process']}), not those of the "
                    f"accepted commit {committed}: {r.reason}")
            else:
                report.notes.append(f"{key[0]}/{key[1]} at revision {r.rev}: bytes of no "
                                    f"other attempt: {r.reason}")


#: the token in a temp file's name: ``.NAME.baton-tmp-TOKEN-NONCE``
_TEMP_TOKEN = re.compile(r"\.baton-tmp-(\d+)-[0-9a-f]+$")
#: a producer's records that end an attempt (after which its temp file is gone)
_ENDED = {("write", "fail"), ("fail", "ok"), ("fail", "fail"), ("fail", "info"),
          ("commit", "ok"), ("commit", "fail"), ("commit", "info")}


def leftover_temp_files(paths: list[str], records: list[dict[str, Any]]
                        ) -> tuple[list[str], list[str], list[str]]:
    """Split temp files found under the staging root (``TASK/.../.NAME.baton-tmp-TOKEN-
    NONCE``, relative) into those left by an attempt that ended (a bug: the helper
    removes its temp file whatever happens, but for a resumable one's partial), those
    of attempts a SIGKILL cut short (their producer recorded no end), and the partial
    files resumable attempts that ended kept for the next one."""
    claimed = {(r.get("task"), int(r.get("token") or 0)) for r in records
               if (r.get("op"), r.get("phase")) == ("claim", "ok")}
    ended = {(r.get("task"), int(r.get("token") or 0)) for r in records
             if (r.get("op"), r.get("phase")) in _ENDED}
    # a resumable attempt that recorded a resume point keeps its partial file on
    # purpose: the next attempt takes it up, or it goes with the entry's older files
    resumable = {(r.get("task"), int(r.get("token") or 0)) for r in records
                 if (r.get("op"), r.get("phase")) == ("claim", "ok") and r.get("resumable")}
    pointed = {(r.get("task"), int(r.get("token") or 0)) for r in records
               if r.get("op") == "checkpoint"} & resumable
    left: list[str] = []
    killed: list[str] = []
    kept: list[str] = []
    for path in paths:
        match = _TEMP_TOKEN.search(path)
        attempt = (path.split("/", 1)[0], int(match.group(1)) if match else 0)
        if attempt in claimed and attempt not in ended:
            killed.append(path)
        elif attempt in pointed:
            kept.append(path)
        else:
            left.append(path)
    return left, killed, kept


def pool_claims(snap: Snapshot) -> dict[str, list[tuple[int, int]]]:
    """Producer claims of pooled entries, per pool, from the journal: each from the
    revision of its ``claimed`` record to that of the next transition (the commit, the
    fail, the give-back that ended it); one still open ends at the snapshot's revision."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, entry in snap.entries.items():
        pool = entry.get("pool", "")
        if not pool:
            continue
        moves = [r for r in snap.journal.get(key, []) if r.transition]
        for i, r in enumerate(moves):
            if r.event == "claimed":
                end = moves[i + 1].rev if i + 1 < len(moves) else snap.revision
                out[pool].append((r.rev, end))
    return out


def most_at_once(intervals: list[tuple[int, int]]) -> int:
    """The most intervals open at one revision (one that ends at a revision is closed
    before one that starts there opens: the same transaction freed and took a unit)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = held = 0
    for _, step in events:
        held += step
        most = max(most, held)
    return most


def _check_repaired(repaired: dict[str, int], report: Report) -> None:
    """No registry's repair of pool units found anything: every path that ends a claim
    frees its unit in the same transaction, so a unit the repair freed is one a path
    leaked (a ``poolleak``)."""
    for registry, n in sorted(repaired.items()):
        report.stats["pool_repaired"] += n
        if n:
            report.add(POOLLEAK, ("-", registry), f"its repair freed {n} pool units "
                       "whose claim was gone (baton_pool_units_repaired_total)")


def _check_pools(snap: Snapshot, samples: list[tuple[str, int, int]],
                 report: Report) -> None:
    """Never more units held than a pool's limit (sampled, and the journal's producer
    claims of its entries), and no unit left held by a claim that is gone."""
    for pool, in_use, limit in samples:
        if limit and in_use > limit:
            report.add(POOLOVER, ("-", pool), f"{in_use} units held, limit {limit}")
    for pool, intervals in sorted(pool_claims(snap).items()):
        limit = snap.pools.get(pool, 0)
        most = most_at_once(intervals)
        report.stats["pool_claims"] += len(intervals)
        report.stats["pool_peak"] = max(report.stats["pool_peak"], most)
        if limit and most > limit:
            report.add(POOLOVER, ("-", pool), f"{most} producer claims of its entries "
                       f"held at once in the journal, limit {limit}")
    for key, unit in sorted(snap.units.items()):
        try:
            ref = ClaimRef(str(unit["kind"]), str(unit["task"]), str(unit["file"]),
                           str(unit.get("group", "")))
        except KeyError:
            report.add(POOLLEAK, ("-", key.decode()), f"a unit naming no claim: {unit}")
            continue
        if not snap.has_claim(ref):
            report.add(POOLLEAK, (ref.task_id, ref.file_id),
                       f"unit {key.decode()} held, its claim ({ref.kind} {ref.group}) gone")
