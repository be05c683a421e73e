"""Watchers report many digests per message: each report of a batch stands alone."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
from test_transitions import digest, write
from watcher_fixtures import make_task, put_bytes

from baton_relay.client import Client, Session
from baton_relay.kernel import errors
from baton_relay.kernel.contract import MAX_REPORT_BATCH
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher import Watcher
from baton_relay.watcher.reporter import Outcome, Reporter

Wait = Callable[..., None]


def _committed(client: Client, session: Session, task: str, files: dict[str, bytes]
               ) -> None:
    """Each file claimed, written and committed: its entry waits for a watcher's report."""
    for file_id, data in files.items():
        claim = client.claim(task, file_id, session=session)
        write(claim.path, data)
        client.commit(task, file_id, claim.token, len(data), digest(data), session=session)


def _report(task: str, file_id: str, data: bytes, **fields: Any) -> pb.ReportVerificationRequest:
    return pb.ReportVerificationRequest(task_id=task, file_id=file_id, size=len(data),
                                        digest=digest(data), reporter="w@test", **fields)


def test_each_report_of_a_batch_has_its_own_answer(client: Client, session: Session) -> None:
    """A batch's reports are applied on their own and answered in order: a good one
    verifies its entry, a wrong digest sends its entry down the retry path, a report
    of an entry that does not exist is that report's NotFound — and none stops the
    others."""
    files = {"a": b"alpha", "b": b"bravo", "c": b"charlie"}
    make_task(client, "t1", {f: f"out/{f}.bin" for f in files})
    _committed(client, session, "t1", files)
    outcomes = client.watcher.report_batch([
        _report("t1", "a", files["a"]),
        _report("t1", "nope", b"x"),
        _report("t1", "b", b"not bravo"),
        _report("t1", "c", files["c"]),
    ])
    assert len(outcomes) == 4
    a, missing, b, c = outcomes
    assert isinstance(a, pb.Entry) and a.state == pb.ENTRY_STATE_VERIFIED
    assert isinstance(missing, errors.NotFound)
    assert isinstance(b, pb.Entry) and b.state == pb.ENTRY_STATE_PENDING
    assert "checksum mismatch" in b.error
    assert isinstance(c, pb.Entry) and c.state == pb.ENTRY_STATE_VERIFIED
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_VERIFIED


def test_a_batch_sent_again_applies_nothing_twice(client: Client, session: Session) -> None:
    """The same batch sent twice (a reply lost): each report carries its request id,
    so the second answers from the first's records and the journal holds one
    verification per entry."""
    files = {"a": b"alpha", "b": b"bravo"}
    make_task(client, "t1", {f: f"out/{f}.bin" for f in files})
    _committed(client, session, "t1", files)
    batch = [_report("t1", f, data) for f, data in files.items()]
    first = client.watcher.report_batch(batch)
    assert all(r.request_id for r in batch)  # given by the client, kept for the retry
    again = client.watcher.report_batch(batch)
    assert [e.revision for e in again if isinstance(e, pb.Entry)] == [
        e.revision for e in first if isinstance(e, pb.Entry)]
    for file_id in files:
        events = [r.event for r in client.operator.journal("t1", file_id)]
        assert events.count("verified") == 1, events


def test_one_entrys_reports_apply_in_the_order_sent(client: Client, session: Session) -> None:
    """Several reports of one entry in a batch (a file reported while being written):
    they apply one after the other, in order — each answer newer than the one before,
    and the last bytes reported are the ones the commit then settles on."""
    make_task(client, "t1", {"a": "out/a.bin"})
    claim = client.claim("t1", "a", session=session)
    versions = [f"version {i}".encode() for i in range(8)]
    outcomes = client.watcher.report_batch([_report("t1", "a", v) for v in versions])
    revisions = [e.revision for e in outcomes if isinstance(e, pb.Entry)]
    assert len(revisions) == len(versions) and revisions == sorted(revisions)
    assert len(set(revisions)) == len(revisions)
    write(claim.path, versions[-1])
    entry = client.commit("t1", "a", claim.token, len(versions[-1]), digest(versions[-1]),
                          session=session)
    assert entry.state == pb.ENTRY_STATE_VERIFIED  # the last report, kept, settled it


def test_a_report_read_before_the_commit_is_not_judged_after_it(
        client: Client, session: Session) -> None:
    """A report that says which revision the watcher looked at: bytes read while the
    entry was being written, arriving after the commit, that would fail it, are
    refused (StaleReport) and change nothing; the same bytes seen at the current
    revision are judged (the retry path); bytes that match verify whatever was seen."""
    make_task(client, "t1", {"a": "out/a.bin", "b": "out/b.bin"})
    data = {"a": b"alpha, whole", "b": b"bravo, whole"}
    seen = {}
    for f in data:
        claim = client.claim("t1", f, session=session)
        seen[f] = client.operator.get_entry("t1", f).revision  # the watcher looks: writing
        write(claim.path, data[f])
        client.commit("t1", f, claim.token, len(data[f]), digest(data[f]), session=session)
    written = client.operator.get_entry("t1", "a")
    partial = b"alpha, wh"
    (stale,) = client.watcher.report_batch([_report("t1", "a", partial, seen_revision=seen["a"])])
    assert isinstance(stale, errors.StaleReport)
    after = client.operator.get_entry("t1", "a")
    assert (after.state, after.revision, after.retry_count) == (
        pb.ENTRY_STATE_WRITTEN, written.revision, 0)
    (judged,) = client.watcher.report_batch([_report("t1", "a", partial,
                                                     seen_revision=after.revision)])
    assert isinstance(judged, pb.Entry) and judged.state == pb.ENTRY_STATE_PENDING
    assert judged.retry_count == 1
    (good,) = client.watcher.report_batch([_report("t1", "b", data["b"], seen_revision=seen["b"])])
    assert isinstance(good, pb.Entry) and good.state == pb.ENTRY_STATE_VERIFIED


def test_a_batch_over_the_limit_is_refused_whole(client: Client, session: Session) -> None:
    """More reports than a batch may carry: INVALID_ARGUMENT naming the limit, and no
    report of it applied."""
    make_task(client, "t1", {"a": "out/a.bin"})
    _committed(client, session, "t1", {"a": b"alpha"})
    batch = [_report("t1", "a", b"alpha") for _ in range(MAX_REPORT_BATCH + 1)]
    with pytest.raises(errors.InvalidArgument, match=str(MAX_REPORT_BATCH)):
        client.watcher.report_batch(batch)
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITTEN


def test_reports_handed_over_faster_than_a_round_trip_travel_together(
        client: Client, session: Session) -> None:
    """The watcher's reporter: reports handed over while a batch is on its way leave
    together in the next one — fewer calls than reports — and each report's own
    answer reaches its callback."""
    ids = [f"f{i:03d}" for i in range(200)]
    files = {f: f"bytes of {f}".encode() for f in ids}
    make_task(client, "t1", {f: f"out/{f}.bin" for f in ids})
    _committed(client, session, "t1", files)
    answers: dict[str, Outcome] = {}
    done = threading.Event()

    def answered(file_id: str) -> Callable[[Outcome], None]:
        def take(outcome: Outcome) -> None:
            answers[file_id] = outcome
            if len(answers) == len(ids):
                done.set()
        return take

    reporter = Reporter(client).start()
    try:
        for f in ids:
            reporter.submit(_report("t1", f, files[f]), answered(f))
        assert done.wait(60), f"{len(answers)} of {len(ids)} answered"
    finally:
        reporter.close()
    assert reporter.reports == len(ids) and reporter.batches < len(ids), (
        reporter.batches, reporter.reports)
    assert all(isinstance(answers[f], pb.Entry) and answers[f].file_id == f
               and answers[f].state == pb.ENTRY_STATE_VERIFIED for f in ids)


def test_a_busy_watcher_verifies_each_file_once(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
) -> None:
    """Many files waiting when the watcher starts: its batched reports verify every
    entry once, and it sends one report per file."""
    ids = [f"f{i:03d}" for i in range(120)]
    make_task(client, "t1", {f: f"d{int(f[1:]) % 4}/{f}.bin" for f in ids})
    for f in ids:
        put_bytes(client, session, "t1", f, os.urandom(2048))
    w = watcher_factory()
    wait_for(lambda: all(e.state == pb.ENTRY_STATE_VERIFIED
                         for e in client.operator.list_entries("t1")),
             timeout=60, what="all verified")
    # the last batch's answer reaches the watcher after the registry applied it
    wait_for(lambda: w.reports.reports >= len(ids), what="every report answered")
    assert w.reports.reports == len(ids)
    for f in ids:
        assert [r.event for r in client.operator.journal("t1", f)].count("verified") == 1
