"""One check of one entry: look at its file, hash it if needed, tell the registry.

What to do depends on the entry's state when a worker picks it up:

- pending: a file of an attempt newer than any known is reported as a writing one's
  (its claim is most often not news here yet); anything else, nothing (no attempt is
  live: a file on disk is a dead attempt's);
- writing: hash the newest attempt's file and report it, naming its token (the
  registry keeps it and settles it at the commit of that very attempt);
- written: report the committed attempt's file (from the cache if it is the one
  already hashed);
- verified: stat the committed attempt's file; if the identity changed, hash;
  report a different digest (the registry takes the entry out of verified) or
  MISSING if the file is gone.

Each attempt writes a file of its own (``NAME~tTOKEN.EXT``), so only the committed
attempt's file is ever looked at once committed: a dead attempt's file, written or
renamed late, is another file, never reported for the entry.

A verified file with more than one name (hard links) is kept in ``links`` and
polled by the daemon, since a write through a name outside the staging tree
raises no inotify event here (``links.py``).

Hash failures count per entry; after ``max_failures`` in a row the file is
reported CORRUPTED. A registry that cannot be reached is not the file's fault:
the check is retried later and a reconciliation is asked for.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..client import Client
from ..kernel import tracing
from ..kernel.backoff import Backoff
from ..kernel.errors import BatonError, NotFound, NotShardOwner, StaleReport, Unavailable
from ..kernel.logs import log
from ..kernel.names import kind_name, state_name
from ..kernel.v1 import baton_pb2 as pb
from .cache import IdentityCache, Known
from .errors import FileChanged, FileMissing, HashFailed
from .hashing import Hashed, Hasher, Identity
from .jobs import JobQueue, Key
from .links import LinkedFiles
from .metrics import Metrics
from .reporter import Reporter
from .shards import Membership
from .state import CHECKED, STATE_NAMES, UNCOMMITTED, Change, EntryView, Table

logger = logging.getLogger("baton.watcher")

CORRUPTED = pb.ReportProblemRequest.KIND_CORRUPTED
MISSING = pb.ReportProblemRequest.KIND_MISSING
#: the revision of a batched report still on its way (see ``Checker._sent``)
IN_FLIGHT = sys.maxsize
#: batched reports remembered (the newest): one forgotten costs at most a report again
SENT_KEPT = 65536
#: seconds before a check that could not reach the registry is tried again: the
#: bound after the first failure in a row, and the largest (kernel/backoff.py: spread
#: over half the bound and the bound, so the files of a registry lost together do not
#: all come back together)
REGISTRY_BACKOFF = 1.0
REGISTRY_BACKOFF_CAP = 10.0
REGISTRY_RETRY = Backoff(REGISTRY_BACKOFF, REGISTRY_BACKOFF_CAP, floor=0.5)
#: the largest wait before a failed hash is tried again (the first: ``retry_delay``)
HASH_RETRY_CAP = 5.0


def hash_backoff(retry_delay: float) -> Backoff:
    """How long a failed hash waits before it is tried again, by its failures: the bound
    itself (``retry_delay``, twice that, ...), as a file may still settle."""
    return Backoff(retry_delay, max(retry_delay, HASH_RETRY_CAP), floor=1.0)


@dataclass
class Checker:
    table: Table
    cache: IdentityCache
    hasher: Hasher
    client: Client
    jobs: JobQueue
    metrics: Metrics
    reporter: str
    max_failures: int = 3
    retry_delay: float = 0.2
    #: called when the registry could not be reached (the daemon reconciles later)
    registry_lost: Callable[[], None] = lambda: None
    #: verified files with several names, which the daemon polls
    links: LinkedFiles = field(default_factory=LinkedFiles)
    #: the shards this watcher owns (None: it reports as an unregistered watcher)
    membership: Membership | None = None
    #: sends digest reports in batches (None: each report is its own call, answered
    #: before the check returns)
    batches: Reporter | None = None
    #: the last batched report of each entry: its bytes and the revision its answer
    #: brought (``IN_FLIGHT`` until answered), so a check that began before that
    #: answer does not send the same bytes again (the newest ``SENT_KEPT`` entries)
    _sent: OrderedDict[Key, tuple[Identity, str, int]] = field(default_factory=OrderedDict)
    #: how an entry is looked at again after a report's answer found it moved on (the
    #: daemon checks it on the answering thread, a small file hashed there, as its
    #: events are); None: the hash workers do
    look_again: Callable[[Key], None] | None = None
    _sent_lock: threading.Lock = field(default_factory=threading.Lock)
    #: how long a check waits when the registry could not be reached, by how many
    #: checks in a row could not reach it (``_unreachable``)
    registry_backoff: Backoff = REGISTRY_RETRY
    _unreachable: int = 0


    def wants(self, change: Change, *, watched: bool) -> bool:
        """Whether news of ``change`` from the registry calls for a check of its file
        (``watched``: an emitter watched the task's tree before the news came).

        Not for news that a check could do nothing with: a pending entry (no attempt
        is live); a claim of an entry already known in a watched tree, no file of the
        attempt seen yet (its landing is an event naming it, which brings the check;
        were that event missed, the commit names the file); the verified state that
        this watcher's own report brought (its answer said so already).
        """
        entry = change.entry
        if entry.state not in CHECKED:
            return False
        if entry.state == pb.ENTRY_STATE_WRITING:
            return bool(entry.attempt_path) or not watched or change.old_state is None
        if entry.state == pb.ENTRY_STATE_VERIFIED:
            with self._sent_lock:
                sent = self._sent.get((change.task_id, entry.file_id))
            return sent is None or sent[1:] != (entry.digest, entry.revision)
        return True

    def check(self, key: Key, *, inline: bool = False) -> None:
        """Check ``key``'s file. ``inline``: on a thread that must not wait for a large
        file (the dispatcher, a stream): a file that turns out large is left to the
        hash workers (submitted: the caller holds the key, so it is theirs once the
        caller is done with it)."""
        entry = self.table.entry(*key)
        if entry is None or not (entry.attempt_path or entry.state in UNCOMMITTED):
            return  # no attempt's file known yet (the news of its commit brings it)
        if inline and not entry.attempt_path:
            self.jobs.submit(key)  # a directory to list: a worker's
            return
        try:
            if tracing.ENABLED and entry.traceparent:
                with tracing.within(entry.traceparent):  # its lines name the entry's trace
                    self._check(key, entry, inline)
            else:
                self._check(key, entry, inline)
        except _Large:
            self.jobs.submit(key)

    def _check(self, key: Key, entry: EntryView, inline: bool) -> None:
        try:
            if entry.state == pb.ENTRY_STATE_PENDING:
                self._pending(key, entry, inline)
            elif entry.state == pb.ENTRY_STATE_WRITING:
                self._writing(key, entry, inline)
            elif entry.state == pb.ENTRY_STATE_WRITTEN:
                self._written(key, entry, inline)
            elif entry.state == pb.ENTRY_STATE_VERIFIED:
                self._verified(key, entry, inline)
        except BatonError as e:
            self._refused_by_registry(key, e)
        else:
            self._unreachable = 0

    def _refused_by_registry(self, key: Key, error: BatonError) -> None:
        """What a call to the registry for ``key`` ended with, said and acted on."""
        try:
            raise error
        except Unavailable as e:
            log(logger, logging.WARNING, "registry unavailable; will check again",
                task=key[0], file_id=key[1], error=str(e))
            self._unreachable += 1
            self.jobs.submit(key, self.registry_backoff.delay(self._unreachable))
            self.registry_lost()
        except StaleReport as e:
            log(logger, logging.INFO, "the entry moved since the file was read; looking "
                "again", task=key[0], file_id=key[1], error=str(e))
            self.jobs.submit(key)
        except NotFound as e:
            log(logger, logging.INFO, "entry no longer in the registry",
                task=key[0], file_id=key[1], error=str(e))
        except NotShardOwner as e:
            log(logger, logging.INFO, "not this watcher's to report: its shard moved",
                task=key[0], file_id=key[1], error=str(e))
        except BatonError as e:
            log(logger, logging.WARNING, "registry refused", task=key[0], file_id=key[1],
                error=f"{type(e).__name__}: {e}")

    # by state ------------------------------------------------------------------------

    def _look(self, key: Key, entry: EntryView) -> Identity | Hashed | None:
        """The file hashed if it is small and not the one last reported, else its
        identity; None if absent. A failure is handled (counted, reported) and raises
        ``_Handled``."""
        start = self.metrics.clock()
        started_ns = time.time_ns() if tracing.ENABLED else 0
        with self._sent_lock:
            sent = self._sent.get(key)
        try:
            found = self.hasher.look(key[0], entry.attempt_path,
                                     known=sent[0] if sent is not None else None)
        except HashFailed as e:
            self._hash_failed(key, entry, e)
            raise _Handled() from e
        if isinstance(found, Hashed):
            self.metrics.hashed(found.identity.size, self.metrics.clock() - start)
            if started_ns:
                found = dataclasses.replace(found, started_ns=started_ns)
        return found

    def _known(self, key: Key) -> Known | None:
        """What this watcher knows the file's bytes hash to, for which identity: the
        last report of the entry (a recent one is remembered in memory), else the
        state file (large files only)."""
        with self._sent_lock:
            sent = self._sent.get(key)
        if sent is not None:
            return Known(sent[0], sent[1])
        return self.cache.get(*key)

    def _pending(self, key: Key, entry: EntryView, inline: bool) -> None:
        """No attempt is live as far as this table knows. A file of an attempt newer
        than any it knew (``Table.file_at`` took it) is most often a live one whose
        claim is not news here yet: it is reported as a written one's is, naming its
        token, so that the registry has it before the commit (which then verifies at
        once); the registry ignores a dead attempt's. Anything else on disk is a dead
        attempt's."""
        if entry.attempt_path and entry.token:
            self._writing(key, entry, inline)

    def _writing(self, key: Key, entry: EntryView, inline: bool) -> None:
        if not entry.attempt_path:
            # No event named one (the directory may have been made just before it):
            # look for the newest attempt's file.
            try:
                newest = self.hasher.newest_attempt(key[0], entry.path)
            except HashFailed:
                newest = None
            if newest is None:
                return
            entry.attempt_path, entry.token = newest
            self.table.saw_attempt(*key, *newest)
        try:
            found = self._look(key, entry)
        except _Handled:
            return
        if found is None:
            return  # nothing is vouched for before the commit; written will tell
        if isinstance(found, Hashed):
            if not self._on_its_way(key, found.identity):
                self._report(key, entry, found)
            return
        if self._on_its_way(key, found):
            return
        known = self._known(key)
        if known is not None and known.identity == found:
            return  # this very file was reported already
        hashed = self._hash(key, entry, found, inline)
        if hashed is not None:
            self._report(key, entry, hashed)

    def _written(self, key: Key, entry: EntryView, inline: bool) -> None:
        try:
            found = self._look(key, entry)
        except _Handled:
            return
        if found is None:  # committed, but not (yet, on a network mount) visible here
            self._failed(key, entry,
                         FileMissing(entry.attempt_path, "no such file after the commit"))
            return
        identity = found.identity if isinstance(found, Hashed) else found
        if self._on_its_way(key, identity):
            return  # its answer (or a StaleReport) brings this entry back if need be
        if isinstance(found, Hashed):
            self._report(key, entry, found)
            return
        known = self._known(key)
        if known is not None and known.identity == identity:
            self._report(key, entry, Hashed(identity, known.digest))
            return
        hashed = self._hash(key, entry, identity, inline)
        if hashed is not None:
            self._report(key, entry, hashed)

    def _verified(self, key: Key, entry: EntryView, inline: bool) -> None:
        try:
            found = self._look(key, entry)
        except _Handled:
            return
        if found is None:
            self._problem(key, MISSING, "the verified file is gone", entry.token)
            return
        identity = found.identity if isinstance(found, Hashed) else found
        if self._on_its_way(key, identity):
            return  # the report that verified it is answered in a moment
        if isinstance(found, Hashed):
            hashed: Hashed | None = found
        else:
            known = self._known(key)
            if (known is not None and known.identity == identity
                    and known.digest == entry.digest):
                self._mind_links(key, identity)
                return
            hashed = self._hash(key, entry, identity, inline)
        if hashed is None:
            return
        if hashed.digest == entry.digest:
            self._remember(key, hashed)
            if entry.failures:
                self.table.update(*key, failures=0)
            self._mind_links(key, hashed.identity)
            return
        log(logger, logging.WARNING, "verified file changed on disk", task=key[0],
            file_id=key[1], revision=entry.revision, digest=hashed.digest,
            verified_digest=entry.digest)
        self._report(key, entry, hashed)

    def _remember(self, key: Key, hashed: Hashed) -> None:
        """Keep a large file's digest with its identity (a small one is hashed again
        more cheaply than it is looked up)."""
        if hashed.identity.size >= self.hasher.small_file:
            self.cache.put(*key, Known(hashed.identity, hashed.digest))

    # hashing and its failures ------------------------------------------------------------

    def _hash(self, key: Key, entry: EntryView, identity: Identity,
              inline: bool) -> Hashed | None:
        """Hash the file (whose identity was just taken); ``inline``: not a large one,
        which is left to the hash workers (``_Large``)."""
        if inline and identity.size >= self.hasher.small_file:
            raise _Large()
        start = self.metrics.clock()
        started_ns = time.time_ns() if tracing.ENABLED else 0
        try:
            hashed = self.hasher.hash(key[0], entry.attempt_path)
        except HashFailed as e:
            self._hash_failed(key, entry, e)
            return None
        self.metrics.hashed(hashed.identity.size, self.metrics.clock() - start)
        if started_ns:
            hashed = dataclasses.replace(hashed, started_ns=started_ns)
        return hashed

    def _hash_failed(self, key: Key, entry: EntryView, e: HashFailed) -> None:
        """What a failed look at or hash of the entry's file means, acted on."""
        if isinstance(e, FileChanged):
            if entry.state == pb.ENTRY_STATE_VERIFIED and e.digest and e.digest != entry.digest:
                # Whatever it settles to, these are not the verified bytes any more.
                self._problem(key, CORRUPTED, f"verified file changed on disk: {e.reason}",
                              entry.token)
                return
            self._failed(key, entry, e)
        elif isinstance(e, FileMissing):
            if entry.state == pb.ENTRY_STATE_VERIFIED:
                self._problem(key, MISSING, "the verified file is gone", entry.token)
            elif entry.state == pb.ENTRY_STATE_WRITTEN:
                self._failed(key, entry, e)
        elif e.permanent:
            self._refused(key, entry, e)
        else:
            self._failed(key, entry, e)

    def _failed(self, key: Key, entry: EntryView, e: HashFailed) -> None:
        failures = entry.failures + 1
        self.metrics.add("hash_failures")
        if failures < self.max_failures:
            log(logger, logging.INFO, "hash failed; trying again", task=key[0],
                file_id=key[1], revision=entry.revision, attempt=failures, reason=e.reason)
            self.table.update(*key, failures=failures)
            self.jobs.submit(key, hash_backoff(self.retry_delay).delay(failures))
            return
        self.table.update(*key, failures=0)
        kind = MISSING if isinstance(e, FileMissing) else CORRUPTED
        self._problem(key, kind, f"{failures} failed attempts; last: {e.reason}", entry.token)

    def _refused(self, key: Key, entry: EntryView, e: HashFailed) -> None:
        if entry.state in (pb.ENTRY_STATE_WRITTEN, pb.ENTRY_STATE_VERIFIED):
            self._problem(key, CORRUPTED, e.reason, entry.token)
        else:
            log(logger, logging.INFO, "refused", task=key[0], file_id=key[1],
                revision=entry.revision, reason=e.reason)

    # talking to the registry ------------------------------------------------------------

    def _owner(self, task_id: str) -> tuple[str, int] | None:
        """(watcher id, epoch) to report on ``task_id`` under; None when its shard is not
        this watcher's (it moved while the check ran): the new owner reports."""
        if self.membership is None:
            return "", 0
        epoch = self.membership.epoch_of(task_id)
        if epoch is None:
            log(logger, logging.INFO, "not reporting: the task's shard is no longer ours",
                task=task_id)
            return None
        return self.membership.watcher_id, epoch

    def _report(self, key: Key, entry: EntryView, hashed: Hashed) -> None:
        i = hashed.identity
        identity = pb.FileIdentity(inode=i.inode, device=i.device, mtime_ns=i.mtime_ns)
        if (owner := self._owner(key[0])) is None:
            return
        request = pb.ReportVerificationRequest(
            task_id=key[0], file_id=key[1], size=i.size, digest=hashed.digest,
            identity=identity, reporter=self.reporter, watcher_id=owner[0],
            shard_epoch=owner[1], seen_revision=entry.revision, token=entry.token)
        if self.batches is not None:
            with self._sent_lock:  # answers are handled under it too (``_answered``)
                sent = self._sent.get(key)
                if sent is not None and sent[:2] == (i, hashed.digest) and (
                        sent[2] >= entry.revision):
                    # These very bytes are on their way, or their answer is what this
                    # check saw: several events of one file, one report.
                    return
                self._sent[key] = (i, hashed.digest, IN_FLIGHT)
                self._sent.move_to_end(key)
                if len(self._sent) > SENT_KEPT:
                    self._sent.popitem(last=False)
                span = self._verify_span(key, entry, hashed, request)

                def answered(outcome: pb.Entry | BatonError) -> None:
                    try:
                        self._answered(key, entry, hashed, outcome)
                    finally:
                        tracing.end(span, outcome if isinstance(outcome, BatonError)
                                    else None)

                self.batches.submit(request, answered)
            return
        span = self._verify_span(key, entry, hashed, request)
        try:
            reply = self.client.watcher.report(key[0], key[1], i.size, hashed.digest, identity,
                                               self.reporter, watcher_id=owner[0],
                                               shard_epoch=owner[1], token=entry.token,
                                               traceparent=request.traceparent)
        except BatonError as e:
            tracing.end(span, e)
            self.metrics.refused("digest", e)
            raise
        tracing.end(span)
        self._reported(key, entry, hashed, reply)

    @staticmethod
    def _verify_span(key: Key, entry: EntryView, hashed: Hashed,
                     request: pb.ReportVerificationRequest) -> Any:
        """The span of this verification (None when traces are off): the child of the
        entry's trace context, from the start of the read to the registry's answer. The
        report carries it; the registry keeps it on the entry, for the consumers."""
        if not tracing.ENABLED:
            return None
        span = tracing.start("baton.verify", parent=entry.traceparent,
                             start_ns=hashed.started_ns or None, attributes={
                                 "baton.task": key[0], "baton.file_id": key[1],
                                 "baton.token": entry.token, "baton.size": hashed.identity.size,
                                 "baton.digest": hashed.digest})
        request.traceparent = tracing.traceparent(span)
        return span

    def _on_its_way(self, key: Key, identity: Identity) -> bool:
        """Whether a report of this very file (same identity) is still unanswered: a
        second check meanwhile (several events of one file) need not hash it again."""
        with self._sent_lock:
            sent = self._sent.get(key)
        return sent is not None and sent[0] == identity and sent[2] == IN_FLIGHT

    def _answered(self, key: Key, entry: EntryView, hashed: Hashed,
                  outcome: pb.Entry | BatonError) -> None:
        """A batched report's answer, on the reporter's thread."""
        with self._sent_lock:
            try:
                if isinstance(outcome, BatonError):
                    self.metrics.refused("digest", outcome)
                    self._refused_by_registry(key, outcome)
                else:
                    self._took(key, hashed, outcome)
            finally:  # the cache and the table know the answer: a check sees it now
                if self._sent.get(key) == (hashed.identity, hashed.digest, IN_FLIGHT):
                    if isinstance(outcome, BatonError):
                        del self._sent[key]  # not taken: the next check sends it again
                    else:
                        self._sent[key] = (hashed.identity, hashed.digest, outcome.revision)
        if not isinstance(outcome, pb.Entry):
            return
        # Its line once the lock is released: checks on other threads wait for that
        # lock, and the line costs more than all that the lock keeps together.
        self._log_reported(key, entry, hashed, outcome)
        if self.table.revision(*key) > outcome.revision:
            # The entry moved on while the report was on its way (a commit): a check
            # in between sent nothing, these bytes being on their way; look again,
            # against what it is now.
            if self.look_again is not None:
                self.look_again(key)
            else:
                self.jobs.submit(key)

    def _reported(self, key: Key, entry: EntryView, hashed: Hashed, reply: pb.Entry) -> None:
        """The registry took a digest report: the entry is now ``reply``."""
        self._took(key, hashed, reply)
        self._log_reported(key, entry, hashed, reply)

    def _took(self, key: Key, hashed: Hashed, reply: pb.Entry) -> None:
        """What the registry's taking a digest report changes here (``_reported``)."""
        self.metrics.reported(*key, "digest", STATE_NAMES.get(reply.state, ""))
        self._remember(key, hashed)
        self.table.apply(key[0], reply, failures=0)
        if reply.state == pb.ENTRY_STATE_VERIFIED:
            self._mind_links(key, hashed.identity)
        else:
            self.links.drop(key)

    @staticmethod
    def _log_reported(key: Key, entry: EntryView, hashed: Hashed, reply: pb.Entry) -> None:
        """The line of a digest report the registry took (``_reported``): at DEBUG, as
        the registry's line of each move is. One comes for every file, and the entry's
        journal (``baton log TASK FILE_ID``) records each verification with its digest
        anyway (docs/performance.md: its CPU at INFO was below what the stack measures)."""
        if not logger.isEnabledFor(logging.DEBUG):
            return
        state = reply.state  # (the known states' names looked up: one is made per report)
        log(logger, logging.DEBUG, "reported", task=key[0], file_id=key[1],
            revision=reply.revision, size=hashed.identity.size, digest=hashed.digest,
            was=entry.state_name, now=STATE_NAMES.get(state) or state_name(state),
            **({"trace_id": tracing.trace_id(reply.traceparent)} if reply.traceparent else {}))

    def _problem(self, key: Key, kind: int, reason: str, token: int) -> None:
        name = kind_name(kind)
        if (owner := self._owner(key[0])) is None:
            return
        try:
            reply = self.client.watcher.report_problem(key[0], key[1], kind, reason, self.reporter,
                                                       watcher_id=owner[0], shard_epoch=owner[1],
                                                       token=token)
        except BatonError as e:
            self.metrics.refused(name, e)
            raise
        self.metrics.add("problems")
        self.metrics.reported(*key, name, STATE_NAMES.get(reply.state, ""))
        self.cache.drop(*key)
        self.links.drop(key)
        self.table.apply(key[0], reply)
        log(logger, logging.WARNING, "reported a problem", task=key[0], file_id=key[1],
            revision=reply.revision, kind=name, reason=reason,
            now=state_name(reply.state))


    def _mind_links(self, key: Key, identity: Identity) -> None:
        """Poll a verified file with several names; stop once it has one again."""
        if identity.links <= 1:
            self.links.drop(key)
        elif self.links.keep(key, identity):
            self.metrics.add("linked")
            log(logger, logging.WARNING, "verified file has other names (hard links); "
                "polling it, as writes through a name outside the staging tree raise no "
                "event", task=key[0], file_id=key[1], links=identity.links)


class _Handled(Exception):
    """The check already reported what it found; stop here."""


class _Large(Exception):
    """An inline check found a large file: the hash workers hash it."""
