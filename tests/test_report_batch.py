"""Watchers report many digests per message: each report of a batch stands alone."""

from __future__ import annotations

import os
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
    outcomes = client.report_batch([
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
    assert client.get_entry("t1", "a").state == pb.ENTRY_STATE_VERIFIED


def test_a_batch_sent_again_applies_nothing_twice(client: Client, session: Session) -> None:
    """The same batch sent twice (a reply lost): each report carries its request id,
    so the second answers from the first's records and the journal holds one
    verification per entry."""
    files = {"a": b"alpha", "b": b"bravo"}
    make_task(client, "t1", {f: f"out/{f}.bin" for f in files})
    _committed(client, session, "t1", files)
    batch = [_report("t1", f, data) for f, data in files.items()]
    first = client.report_batch(batch)
    assert all(r.request_id for r in batch)  # given by the client, kept for the retry
    again = client.report_batch(batch)
    assert [e.revision for e in again if isinstance(e, pb.Entry)] == [
        e.revision for e in first if isinstance(e, pb.Entry)]
    for file_id in files:
        events = [r.event for r in client.journal("t1", file_id)]
        assert events.count("verified") == 1, events


def test_a_batch_over_the_limit_is_refused_whole(client: Client, session: Session) -> None:
    """More reports than a batch may carry: INVALID_ARGUMENT naming the limit, and no
    report of it applied."""
    make_task(client, "t1", {"a": "out/a.bin"})
    _committed(client, session, "t1", {"a": b"alpha"})
    batch = [_report("t1", "a", b"alpha") for _ in range(MAX_REPORT_BATCH + 1)]
    with pytest.raises(errors.InvalidArgument, match=str(MAX_REPORT_BATCH)):
        client.report_batch(batch)
    assert client.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITTEN


def test_a_busy_watcher_sends_its_reports_in_batches(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher], wait_for: Wait,
) -> None:
    """Many files waiting when the watcher starts (faster than one report's round trip
    could carry them one by one): its reports travel several to a message, and every
    entry is verified once."""
    ids = [f"f{i:03d}" for i in range(120)]
    make_task(client, "t1", {f: f"d{int(f[1:]) % 4}/{f}.bin" for f in ids})
    for f in ids:
        put_bytes(client, session, "t1", f, os.urandom(2048))
    w = watcher_factory()
    wait_for(lambda: all(e.state == pb.ENTRY_STATE_VERIFIED for e in client.list_entries("t1")),
             timeout=60, what="all verified")
    assert w.reports.reports >= len(ids)
    assert w.reports.batches < w.reports.reports, (w.reports.batches, w.reports.reports)
    for f in ids:
        assert [r.event for r in client.journal("t1", f)].count("verified") == 1
