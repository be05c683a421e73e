"""The checker on hand-made histories and journals: a clean run passes, and each kind
of violation is found (a checker that never fails proves nothing)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from baton_relay.registry.store.keys import ClaimRef

from . import payload
from .checker import Report, check, leftover_temp_files
from .state import JournalRecord, Snapshot

PREFIX = "/p/"
TASK, FILE = "t0", "f0"
ORIGIN = payload.Origin(TASK, FILE, 10, "p0.0", 100)
DATA = payload.make(ORIGIN)
DIGEST = payload.digest(DATA)


def rec(rev: int, seq: int, event: str, frm: str, to: str, **kw: Any) -> JournalRecord:
    return JournalRecord(rev=rev, seq=seq, event=event, from_state=frm, to_state=to, **kw)


def clean_journal() -> list[JournalRecord]:
    return [
        rec(10, 1, "claimed", "pending", "writing"),
        rec(11, 2, "committed", "writing", "verified", token=10, size=len(DATA)),
        rec(11, 3, "verified", "writing", "verified", digest=DIGEST),
        rec(12, 3, "consuming", "verified", "verified", group="g1", aside=True),
        rec(13, 4, "acked", "verified", "verified", group="g1", token=12),
        rec(14, 4, "consuming", "verified", "verified", group="g2", aside=True),
        rec(15, 5, "acked", "verified", "consumed", group="g2", token=14),
    ]


def clean_history() -> list[dict[str, Any]]:
    h: list[dict[str, Any]] = [
        {"op": "claim", "phase": "ok", "task": TASK, "file": FILE, "token": 10,
         "process": "p0.0"},
        {"op": "write", "phase": "ok", "task": TASK, "file": FILE, "token": 10,
         "size": len(DATA), "digest": DIGEST, "process": "p0.0"},
        {"op": "commit", "phase": "ok", "task": TASK, "file": FILE, "token": 10,
         "process": "p0.0"},
    ]
    for group, token in (("g1", 12), ("g2", 14)):
        ident = {"task": TASK, "file": FILE, "group": group, "token": token,
                 "process": f"c-{group}"}
        h += [{"op": "consume", "phase": "ok", **ident, "digest": DIGEST, "size": len(DATA)},
              {"op": "read", "phase": "ok", **ident, "digest": DIGEST, "size": len(DATA),
               "origin": dataclasses.asdict(ORIGIN)},
              {"op": "ack", "phase": "ok", **ident}]
    return h


def snapshot(journal: list[JournalRecord], state: str = "consumed",
             keys: tuple[bytes, ...] = (), **entry: Any) -> Snapshot:
    snap = Snapshot(PREFIX)
    seq = max((r.seq for r in journal), default=0)
    snap.entries[(TASK, FILE)] = {"state": state, "seq": seq, "consumers": ["g1", "g2"],
                                  "consumed_by": ["g1", "g2"], **entry}
    snap.journal[(TASK, FILE)] = sorted(journal, key=lambda r: (r.rev, r.seq))
    snap.keys.update(keys)
    return snap


def run(journal: list[JournalRecord] | None = None, history: list[dict[str, Any]] | None = None,
        **snap: Any) -> Report:
    return check(clean_history() if history is None else history,
                 snapshot(clean_journal() if journal is None else journal, **snap),
                 {TASK: [FILE]})


def kinds(report: Report) -> set[str]:
    return {v.kind for v in report.violations}


def test_a_clean_run_passes() -> None:
    """A produced, verified and twice-consumed entry with matching histories passes."""
    report = run()
    assert report.ok, report.violations
    assert report.summary().startswith(
        "faults: ops=6 nemeses=0 lost=0 double=0 stale=0 badverify=0 badread=0")


def test_an_entry_that_vanished_is_lost() -> None:
    """An entry created by the feeder but absent from etcd is lost."""
    report = check(clean_history(), Snapshot(PREFIX), {TASK: [FILE]})
    assert "lost" in kinds(report)


@pytest.mark.parametrize(("state", "keys", "entry"), [
    ("pending", (), {"index": "/p/ready/t0/000000000000001/f0"}),
    ("writing", (), {}),
    ("written", (), {}),
    ("verified", (), {"consumed_by": ["g1"]}),
])
def test_an_entry_that_cannot_move_on_is_lost(state: str, keys: tuple[bytes, ...],
                                              entry: dict[str, Any]) -> None:
    """Not terminal, and nothing (index, claim, twin, cready key) can move it on."""
    journal = [r for r in clean_journal() if r.seq < 2] if state != "verified" else \
        clean_journal()[:5]
    if state in ("pending", "written"):
        journal = []
    report = run(journal, history=clean_history()[:3], state=state, keys=keys, **entry)
    assert kinds(report) == {"lost"}, report.violations


def test_a_pending_entry_with_its_index_is_only_unfinished() -> None:
    """Claimable but not claimed when the run ended: explained, not lost."""
    index = "/p/ready/t0/000000000000001/f0"
    report = run([], history=[], state="pending", keys=(index.encode(),), index=index)
    assert report.ok and report.stats["unfinished"] == 1


def test_an_acknowledged_ack_missing_from_the_journal_is_lost() -> None:
    """The agent was told its ack applied, but the journal has no such ack."""
    journal = [r for r in clean_journal() if r.rev != 15]
    report = run(journal, state="verified", keys=(b"/p/cready/t0/g2/f0",),
                 consumed_by=["g1"])
    assert "lost" in kinds(report)


def test_a_gap_in_the_journal_is_lost() -> None:
    """A transition whose journal record is missing."""
    journal = [r for r in clean_journal() if r.seq != 2]
    assert "lost" in kinds(run(journal))


def test_two_acks_of_one_group_are_double() -> None:
    journal = [*clean_journal()[:5],
               rec(14, 4, "consuming", "verified", "verified", group="g1", aside=True),
               rec(15, 5, "acked", "verified", "consumed", group="g1", token=14)]
    assert "double" in kinds(run(journal, history=clean_history()[:6]))


def test_a_commit_with_a_dead_token_is_stale() -> None:
    """The claim was reaped (failed), yet a commit with its token was accepted."""
    journal = [rec(10, 1, "claimed", "pending", "writing"),
               rec(11, 2, "failed", "writing", "pending", token=10),
               rec(12, 3, "committed", "pending", "written", token=10, size=len(DATA))]
    report = run(journal, history=clean_history()[:3], state="written")
    assert "stale" in kinds(report)


def test_an_ack_with_a_token_never_granted_is_stale() -> None:
    journal = [r for r in clean_journal() if r.rev != 14]
    assert "stale" in kinds(run(journal))


def test_a_verification_of_other_bytes_is_badverify() -> None:
    journal = clean_journal()
    journal[2] = dataclasses.replace(journal[2], digest="0" * 64)
    assert "badverify" in kinds(run(journal))


def test_a_lease_on_an_unverified_entry_is_badread() -> None:
    journal = [rec(10, 1, "claimed", "pending", "writing"),
               rec(11, 1, "consuming", "writing", "writing", group="g1", aside=True)]
    report = run(journal, history=[], state="writing",
                 keys=(b"/p/claims/p/t0/f0",))
    assert "badread" in kinds(report)


def test_bytes_that_are_no_payload_are_badread() -> None:
    history = clean_history()
    history[4] = {**history[4], "origin": None}
    assert "badread" in kinds(run(history=history))


def test_a_commit_of_bytes_never_written_is_badverify() -> None:
    """A commit accepted although its producer recorded no write of those bytes (the
    watcher then sent it back: no verification ever named it)."""
    journal = [rec(10, 1, "claimed", "pending", "writing"),
               rec(11, 2, "committed", "writing", "written", token=10, size=len(DATA)),
               rec(12, 3, "failed", "written", "pending", token=10,
                   reason="checksum mismatch")]
    history = clean_history()[:1]
    report = run(journal, history=history, state="pending",
                 keys=(b"/p/ready/t0/000000000000001/f0",),
                 index="/p/ready/t0/000000000000001/f0")
    assert kinds(report) == {"badverify"}, report.violations


def test_a_commit_whose_write_failed_is_badverify() -> None:
    """The producer's write failed (ENOSPC: a full staging root), yet a commit of that
    attempt was accepted."""
    history = clean_history()
    history[1] = {"op": "write", "phase": "fail", "task": TASK, "file": FILE, "token": 10,
                  "error": "OSError", "message": "[Errno 28] No space left on device",
                  "process": "p0.0"}
    report = run(history=history)
    assert "badverify" in kinds(report)
    assert report.stats["write_failed"] == 1


def test_a_failed_write_that_took_the_retry_path_passes() -> None:
    """ENOSPC on the first attempt (failed, retried), the second one committed."""
    journal = [rec(8, 1, "claimed", "pending", "writing"),
               rec(9, 2, "failed", "writing", "pending", token=8,
                   reason="OSError: [Errno 28] No space left on device"),
               *(dataclasses.replace(r, seq=r.seq + 2) for r in clean_journal())]
    history = [{"op": "claim", "phase": "ok", "task": TASK, "file": FILE, "token": 8,
                "process": "p1.0"},
               {"op": "write", "phase": "fail", "task": TASK, "file": FILE, "token": 8,
                "error": "OSError", "message": "[Errno 28] No space left on device",
                "process": "p1.0"},
               *clean_history()]
    report = run(journal, history=history)
    assert report.ok, report.violations
    assert report.stats["write_failed"] == 1


def test_temp_files_left_by_ended_attempts_are_told_apart() -> None:
    """A temp file of an attempt that ended (its write failed, or it committed) is left
    behind wrongly; one whose producer was SIGKILLed mid-attempt cannot be removed."""
    history = [
        {"op": "claim", "phase": "ok", "task": TASK, "token": 7, "process": "p0.0"},
        {"op": "write", "phase": "fail", "task": TASK, "token": 7, "process": "p0.0"},
        {"op": "claim", "phase": "ok", "task": TASK, "token": 9, "process": "p1.0"},
        {"op": "write", "phase": "ok", "task": TASK, "token": 9, "process": "p1.0"},
        {"op": "claim", "phase": "ok", "task": TASK, "token": 11, "process": "p1.1"},
        {"op": "commit", "phase": "ok", "task": TASK, "token": 11, "process": "p1.1"},
    ]
    paths = [f"{TASK}/d0/.f0.bin.baton-tmp-7-{'a' * 16}",
             f"{TASK}/d1/.f1.bin.baton-tmp-9-{'b' * 16}",
             f"{TASK}/d2/.f2.bin.baton-tmp-11-{'c' * 16}",
             f"{TASK}/d0/.f3.bin.baton-tmp-13-{'d' * 16}"]
    left, killed, kept = leftover_temp_files(paths, history)
    assert killed == [paths[1]]
    assert left == [paths[0], paths[2], paths[3]] and kept == []


def test_a_resumable_attempts_partial_is_kept_only_once_it_recorded_a_point() -> None:
    """A resumable attempt that ended after a resume point keeps its partial file on
    purpose; one that recorded none (or was not resumable) has none to keep."""
    history = [
        {"op": "claim", "phase": "ok", "task": TASK, "token": 7, "resumable": True},
        {"op": "checkpoint", "phase": "ok", "task": TASK, "token": 7, "n": 65536},
        {"op": "fail", "phase": "ok", "task": TASK, "token": 7},
        {"op": "claim", "phase": "ok", "task": TASK, "token": 9, "resumable": True},
        {"op": "fail", "phase": "ok", "task": TASK, "token": 9},
        {"op": "claim", "phase": "ok", "task": TASK, "token": 11},
        {"op": "checkpoint", "phase": "ok", "task": TASK, "token": 11, "n": 65536},
        {"op": "fail", "phase": "ok", "task": TASK, "token": 11},
    ]
    paths = [f"{TASK}/d0/.f0~t7.bin.baton-tmp-7-{'a' * 16}",
             f"{TASK}/d1/.f1~t9.bin.baton-tmp-9-{'b' * 16}",
             f"{TASK}/d2/.f2~t11.bin.baton-tmp-11-{'c' * 16}"]
    left, killed, kept = leftover_temp_files(paths, history)
    assert (left, killed, kept) == ([paths[1], paths[2]], [], [paths[0]])


def resumed(origin_token: int | None) -> tuple[list[JournalRecord], list[dict[str, Any]]]:
    """Token 10 writes part of ORIGIN's payload, records a resume point and fails;
    token 16 adopts the partial file, writes the rest and commits; both groups read
    ORIGIN's payload. ``origin_token``: what token 16's write record says it went on
    from (None: nothing)."""
    journal = [
        rec(10, 1, "claimed", "pending", "writing"),
        rec(11, 2, "failed", "writing", "pending", token=10),
        rec(16, 3, "claimed", "pending", "writing"),
        rec(17, 4, "committed", "writing", "verified", token=16, size=len(DATA)),
        rec(17, 5, "verified", "writing", "verified", digest=DIGEST),
        rec(18, 5, "consuming", "verified", "verified", group="g1", aside=True),
        rec(19, 6, "acked", "verified", "verified", group="g1", token=18),
        rec(20, 6, "consuming", "verified", "verified", group="g2", aside=True),
        rec(21, 7, "acked", "verified", "consumed", group="g2", token=20),
    ]
    p1 = {"task": TASK, "file": FILE, "process": "p0.0"}
    p2 = {"task": TASK, "file": FILE, "process": "p1.0"}
    write = {"op": "write", "phase": "ok", **p2, "token": 16, "size": len(DATA),
             "digest": DIGEST, "resumed_at": 50}
    if origin_token is not None:
        write["origin_token"] = origin_token
    history: list[dict[str, Any]] = [
        {"op": "claim", "phase": "ok", **p1, "token": 10, "resumable": True},
        {"op": "checkpoint", "phase": "ok", **p1, "token": 10, "n": 50},
        {"op": "fail", "phase": "ok", **p1, "token": 10},
        {"op": "claim", "phase": "ok", **p2, "token": 16, "resumable": True,
         "resumed_from": {"token": 10, "n": 50}},
        {"op": "checkpoint", "phase": "ok", **p2, "token": 16, "n": 50, "adopted": True},
        write,
        {"op": "commit", "phase": "ok", **p2, "token": 16},
    ]
    for group, token in (("g1", 18), ("g2", 20)):
        ident = {"task": TASK, "file": FILE, "group": group, "token": token}
        history += [{"op": "consume", "phase": "ok", **ident, "digest": DIGEST,
                     "size": len(DATA)},
                    {"op": "read", "phase": "ok", **ident, "digest": DIGEST,
                     "size": len(DATA), "origin": dataclasses.asdict(ORIGIN)},
                    {"op": "ack", "phase": "ok", **ident}]
    return journal, history


def test_a_resumed_write_is_the_payload_of_the_attempt_it_went_on_from() -> None:
    """Readers of a resumed write read the first attempt's payload, verified under the
    second's commit; without the write saying so, those bytes were never verified."""
    journal, history = resumed(10)
    report = check(history, snapshot(journal), {TASK: [FILE]})
    assert report.ok, report.violations
    assert (report.stats["resumed"], report.stats["checkpoints"]) == (1, 2)
    journal, history = resumed(None)
    assert kinds(check(history, snapshot(journal), {TASK: [FILE]})) == {"badread"}


def test_a_checkpoint_of_a_claim_no_agent_was_told_of_may_be_handed() -> None:
    """Token 10's claim applied but its agent never learnt it (killed, or produce()
    failed taking up a partial): a point of it is unknown, not wrong; a point of a
    token no claim had is still a badcheckpoint."""
    journal, history = resumed(10)
    history = [r for r in history if r.get("token") != 10 or r["op"] == "read"]
    assert check(history, snapshot(journal), {TASK: [FILE]}).ok
    history[0] = {**history[0], "resumed_from": {"token": 12, "n": 50}}
    assert kinds(check(history, snapshot(journal), {TASK: [FILE]})) == {"badcheckpoint"}


# --- the staging retention ------------------------------------------------------------

REMOVED = rec(16, 6, "staging_removed", "consumed", "consumed")


def test_a_consumed_entrys_file_gone_after_its_recorded_removal_passes() -> None:
    """Removal recorded once on a consumed entry, its file gone: a clean run."""
    report = check(clean_history(), snapshot([*clean_journal(), REMOVED], path="a.bin",
                                             staging_removed={"at": "now"}),
                   {TASK: [FILE]}, staged=set())
    assert report.ok, report.violations
    assert report.stats["staging_removed"] == 1 and report.stats["staging_left"] == 0


def test_a_removal_recorded_before_every_group_acked_is_badremove() -> None:
    """A removal recorded while the entry was still verified is a violation."""
    journal = [*clean_journal()[:5], rec(14, 5, "staging_removed", "verified", "verified"),
               rec(15, 6, "acked", "verified", "consumed", group="g2", token=14)]
    journal.insert(5, rec(14, 4, "consuming", "verified", "verified", group="g2",
                          aside=True))
    report = run(journal=journal)
    assert kinds(report) == {"badremove"}


def test_a_verified_entrys_file_missing_from_staging_is_badremove() -> None:
    """A verified entry whose file is gone from staging at the end is a violation."""
    journal = clean_journal()[:3]
    report = check(clean_history()[:3], snapshot(journal, state="verified", path="a.bin",
                                                 consumed_by=[], keys=(
                                                     b"/p/cready/t0/g1/f0",
                                                     b"/p/cready/t0/g2/f0")),
                   {TASK: [FILE]}, staged=set())
    assert "badremove" in kinds(report)
    ok = check(clean_history()[:3], snapshot(journal, state="verified", path="a.bin",
                                             consumed_by=[]), {TASK: [FILE]},
               staged={"t0/a.bin"})
    assert "badremove" not in kinds(ok)


def test_a_marked_file_still_there_at_the_end_is_counted_not_failed() -> None:
    """A removal recorded whose unlink never happened is counted (staging_left)."""
    report = check(clean_history(), snapshot([*clean_journal(), REMOVED], path="a.bin",
                                             staging_removed={"at": "now"}),
                   {TASK: [FILE]}, staged={"t0/a.bin"})
    assert report.ok, report.violations
    assert report.stats["staging_left"] == 1


def checkpointed(handed: dict[str, int] | None,
                 sent: tuple[tuple[int, int, str], ...] = ((8, 65536, "ok"),)
                 ) -> list[dict[str, Any]]:
    """The clean history, after an earlier attempt (token 8) sent ``sent`` checkpoints
    (token, bytes, phase), its claim of token 10 handed ``handed``."""
    h = clean_history()
    if handed is not None:
        h[0] = {**h[0], "resumed_from": handed}
    earlier = [{"op": "checkpoint", "phase": phase, "task": TASK, "file": FILE, "token": t,
                "n": n, "process": "p0.1"} for t, n, phase in sent]
    return [*earlier, *h]


def test_a_claim_handed_the_last_checkpoint_an_earlier_attempt_sent_passes() -> None:
    report = run(history=checkpointed({"token": 8, "n": 65536}))
    assert report.ok, report.violations
    assert (report.stats["checkpoints"], report.stats["resumed"]) == (1, 1)


def test_a_claim_handed_a_wrong_or_no_checkpoint_is_badcheckpoint() -> None:
    """None when one was accepted; one nobody sent; an older one than one accepted.
    A checkpoint whose outcome is unknown may or may not have been kept."""
    assert kinds(run(history=checkpointed(None))) == {"badcheckpoint"}
    assert kinds(run(history=checkpointed({"token": 9, "n": 1}))) == {"badcheckpoint"}
    later = ((8, 65536, "ok"), (8, 131072, "ok"))
    assert kinds(run(history=checkpointed({"token": 8, "n": 65536}, later))) == {
        "badcheckpoint"}
    unknown = ((8, 65536, "ok"), (8, 131072, "info"))
    assert run(history=checkpointed({"token": 8, "n": 65536}, unknown)).ok
    assert run(history=checkpointed({"token": 8, "n": 131072}, unknown)).ok
    assert run(history=checkpointed(None, ((8, 65536, "fail"),))).ok


def test_a_checkpoint_whose_agent_died_in_the_call_may_have_applied() -> None:
    """Invoked and never completed (a SIGKILL): handing it over is right, and so is not;
    invoked and refused: handing it over is a badcheckpoint."""
    died = ((8, 65536, "ok"), (8, 131072, "invoke"))
    assert run(history=checkpointed({"token": 8, "n": 131072}, died)).ok
    assert run(history=checkpointed({"token": 8, "n": 65536}, died)).ok
    refused = ((8, 65536, "ok"), (8, 131072, "invoke"), (8, 131072, "fail"))
    assert kinds(run(history=checkpointed({"token": 8, "n": 131072}, refused))) == {
        "badcheckpoint"}


def pooled_snapshot(limit: int, overlapping: int, units: dict[bytes, dict[str, Any]]
                    ) -> Snapshot:
    """``overlapping`` pooled entries whose producer claims all overlap (claimed at
    revisions 10.., committed at 100..), in a pool of ``limit``, with ``units`` held."""
    snap = Snapshot(PREFIX)
    snap.revision = 200
    snap.pools["p"] = limit
    for i in range(overlapping):
        key = (TASK, f"f{i}")
        snap.entries[key] = {"state": "written", "pool": "p"}
        snap.journal[key] = [rec(10 + i, 1, "claimed", "pending", "writing"),
                             rec(100 + i, 2, "committed", "writing", "written")]
    snap.units.update(units)
    return snap


def test_pool_claims_over_the_limit_in_the_journal_are_found() -> None:
    from .checker import POOLOVER, _check_pools

    within, over = Report(), Report()
    _check_pools(pooled_snapshot(3, 3, {}), [], within)
    _check_pools(pooled_snapshot(2, 3, {}), [], over)
    assert within.ok and within.stats["pool_peak"] == 3
    assert kinds(over) == {POOLOVER}


def test_a_pool_sampled_over_its_limit_fails_the_run() -> None:
    from .checker import POOLOVER, _check_pools

    report = Report()
    _check_pools(Snapshot(PREFIX), [("p", 2, 2), ("p", 3, 2), ("q", 1, 0)], report)
    assert [v.kind for v in report.violations] == [POOLOVER]


def test_a_unit_left_held_without_its_claim_is_a_leak() -> None:
    from .checker import POOLLEAK, _check_pools

    unit = {"kind": "p", "task": TASK, "file": "f0", "group": ""}
    snap = pooled_snapshot(3, 1, {b"/p/poolunits/p/00000": unit})
    leaked = Report()
    _check_pools(snap, [], leaked)
    assert kinds(leaked) == {POOLLEAK}
    snap.keys.add(snap.k.inflight(ClaimRef("p", TASK, "f0")))
    held = Report()
    _check_pools(snap, [], held)  # its claim's twin is there: a claim in flight
    assert held.ok
