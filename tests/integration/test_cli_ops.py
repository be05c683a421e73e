"""The ``baton`` operator commands and batch/slot options, against a real registry.

Task control (pause, resume, cancel), requeue, the journal (``log``), ``explain``,
``agents``, the progress shown by ``status`` and ``task ls``, ``claim --batch``,
``commit-batch`` and session slot limits. Helpers come from ``test_cli``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import blake3
import pytest
from test_cli import MANIFEST, TWO, create, invoke, ok_json, one_error_line, run

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb

#: the BLAKE3 digest of no bytes: the commits of size 0 here publish no file
EMPTY = blake3.blake3(b"").hexdigest()

GROUPS = {
    "task_id": "t1",
    "consumers": ["ocr", "archive"],
    "entries": [
        {"file_id": "a", "path": "a.json"},
        {"file_id": "b", "path": "b.json", "max_retries": 0},
        {"file_id": "index", "path": "index.json", "depends_on": ["b"],
         "consumers": ["archive"]},
    ],
}


@pytest.fixture(autouse=True)
def plain_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables as a pipe gets them (one line per row, no colour), whatever the shell set."""
    for name in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)


def many(n: int) -> dict[str, Any]:
    return {"task_id": "t1", "entries": [{"file_id": f"f{i}", "path": f"f{i}.bin"}
                                         for i in range(n)]}


def produce_verified(client: Client, task_id: str, file_id: str, data: bytes = b"x\n") -> None:
    """Claim, commit and report an entry as a producer and the watcher would."""
    digest = blake3.blake3(data).hexdigest()
    with client.open_session("maker", 30) as session:
        c = client.claim(task_id, file_id, session=session)
        client.commit(task_id, file_id, c.token, len(data), digest)
    assert client.watcher.report(task_id, file_id, len(data),
                                 digest).state == pb.ENTRY_STATE_VERIFIED


def kill(registry: Any, task_id: str, file_id: str, reason: str = "broken") -> None:
    """Claim an entry with no retries left and fail it through the CLI: it is dead."""
    c = ok_json(invoke(registry, "claim", task_id, file_id, "-o", "json"))
    dead = ok_json(invoke(registry, "fail", task_id, file_id, "--token", str(c["token"]),
                          "--reason", reason, "-o", "json"))
    assert dead["state"] == "dead"


def table_rows(stdout: str) -> dict[str, list[str]]:
    """Cells of each table row, keyed by its first cell."""
    rows = {}
    for line in stdout.splitlines():
        if line.count("│") > 2:
            cells = [c.strip() for c in line.split("│")[1:-1]]
            rows[cells[0]] = cells
    return rows


# --- task control -------------------------------------------------------------------


def test_pause_refuses_claims_and_consumes_and_resume_allows_them(registry: Any) -> None:
    """A paused task refuses claims and consumes with exit 4, naming the pause and its
    reason (as `task pause --help` says); once resumed, claims succeed."""
    create(registry, MANIFEST)
    paused = invoke(registry, "task", "pause", "t1", "--reason", "disk swap")
    assert paused.exit_code == 0, paused.output
    assert paused.stdout.strip() == "task t1: paused (pause: disk swap)"
    for refused in (run(registry, "claim", "t1"), run(registry, "consume", "t1")):
        assert refused.returncode == 4
        assert "task 't1' is paused (pause: disk swap): it hands out no new claims or " \
            "consumes" in one_error_line(refused.stderr)
    helped = invoke(registry, "task", "pause", "--help").stdout
    assert "claims and consumes" in helped and "may still take" not in helped
    shown = ok_json(invoke(registry, "task", "get", "t1", "-o", "json"))
    assert shown["status"] == "paused" and shown["status_reason"] == "pause: disk swap"
    resumed = ok_json(invoke(registry, "task", "resume", "t1", "-o", "json"))
    assert resumed["status"] == "active"
    assert ok_json(invoke(registry, "claim", "t1", "-o", "json"))["file_id"] == "a"


def test_cancel_kills_claim_tokens_and_cannot_be_undone(registry: Any) -> None:
    """After `task cancel`, a claim's token is refused on commit (4) and resume is refused."""
    create(registry, MANIFEST)
    claimed = ok_json(run(registry, "claim", "t1", "-o", "json"))
    cancelled = invoke(registry, "task", "cancel", "t1")
    assert cancelled.exit_code == 0 and cancelled.stdout.strip() == "task t1: cancelled"
    late = run(registry, "commit", "t1", "a", "--token", str(claimed["token"]), "--size", "0")
    assert late.returncode == 4 and one_error_line(late.stderr)
    again = invoke(registry, "task", "resume", "t1")
    assert again.exit_code == 4 and "cancelled" in one_error_line(again.stderr)
    assert invoke(registry, "task", "pause", "nope").exit_code == 5


# --- requeue, log, explain ------------------------------------------------------------


def test_requeue_brings_a_dead_entry_back_to_pending(registry: Any, client: Client) -> None:
    """A dead entry is requeued to pending with a fresh retry budget; a live one is refused."""
    create(registry, {**MANIFEST, "max_retries": 0})
    kill(registry, "t1", "a")
    back = invoke(registry, "requeue", "t1", "a")
    assert back.exit_code == 0, back.output
    assert back.stdout.startswith("t1/a: pending")
    entry = client.operator.get_entry("t1", "a")
    assert entry.state == pb.ENTRY_STATE_PENDING and entry.retry_count == 0
    again = invoke(registry, "requeue", "t1", "a")
    assert again.exit_code == 4 and "only dead entries" in one_error_line(again.stderr)
    assert ok_json(invoke(registry, "claim", "t1", "-o", "json"))["file_id"] == "a"


def test_operator_actions_keep_their_reason_and_evidence(registry: Any,
                                                        client: Client) -> None:
    """`requeue`, `lease revoke` and `task pause` take --evidence next to --reason: the
    journal's records (and the task's status reason) keep both, and `log` shows them."""
    create(registry, {**MANIFEST, "max_retries": 0})
    kill(registry, "t1", "a")
    back = invoke(registry, "requeue", "t1", "a", "--reason", "disk replaced",
                  "--evidence", "https://tickets.example/OPS-9")
    assert back.exit_code == 0, back.output
    requeued = [r for r in client.operator.journal("t1", "a") if r.event == "requeued"]
    assert [(r.reason, r.evidence) for r in requeued] == [
        ("disk replaced (after: producer failed: broken)", "https://tickets.example/OPS-9")]
    logged = [json.loads(line) for line in invoke(registry, "log", "t1", "a", "-o",
                                                  "json").stdout.splitlines()]
    assert logged[-1]["evidence"] == "https://tickets.example/OPS-9"
    assert "(evidence: https://tickets.example/OPS-9)" in " ".join(
        invoke(registry, "log", "t1", "a").stdout.split())
    with client.open_session("hung", 30, keepalive=False) as session:
        client.claim("t1", "a", session=session)
        revoked = invoke(registry, "lease", "revoke", str(session.session_id), "--reason",
                         "hung", "--evidence", "strace in OPS-10")
        assert revoked.exit_code == 0, revoked.output
    assert [(r.who, r.evidence) for r in client.operator.journal("t1",
                                                                 "a") if r.event == "revoked"] \
        == [("operator", "strace in OPS-10")]
    paused = invoke(registry, "task", "pause", "t1", "--reason", "swap", "--evidence", "CH-3")
    assert paused.stdout.strip() == "task t1: paused (pause: swap (evidence: CH-3))"


def test_log_shows_transitions_in_order(registry: Any, tmp_path: Path) -> None:
    """`log` lists claimed then committed with from → to, oldest first; --limit keeps the last."""
    create(registry, TWO)
    claimed = ok_json(invoke(registry, "claim", "t1", "a", "--agent", "writer-1", "-o", "json"))
    ok_json(invoke(registry, "commit", "t1", "a", "--token", str(claimed["token"]),
                   "--size", "3", "--digest", blake3.blake3(b"abc").hexdigest(),
                   "-o", "json"))
    ok_json(invoke(registry, "claim", "t1", "b", "-o", "json"))
    lines = invoke(registry, "log", "t1", "a", "-o", "json")
    assert lines.exit_code == 0, lines.output
    records = [json.loads(line) for line in lines.stdout.splitlines()]
    assert [(r["event"], r["from_state"], r["to_state"]) for r in records] == [
        ("claimed", "pending", "writing"), ("committed", "writing", "written")]
    assert records[0]["label"] == "writer-1" and records[1]["token"] == claimed["token"]
    assert records[0]["revision"] < records[1]["revision"]
    whole = [json.loads(line) for line in invoke(registry, "log", "t1", "-o", "json")
             .stdout.splitlines()]
    assert [r["file_id"] for r in whole] == ["a", "a", "b"]
    last = [json.loads(line) for line in invoke(registry, "log", "t1", "a", "--limit", "1",
                                                "-o", "json").stdout.splitlines()]
    assert [r["event"] for r in last] == ["committed"]
    table = invoke(registry, "log", "t1", "a")
    rows = table_rows(table.stdout)
    # no identities here (plaintext): who is the name the agent gave, in quotes
    assert rows[str(records[0]["revision"])][3:6] == ["claimed", "pending → writing",
                                                      '"writer-1"']
    assert rows[str(records[1]["revision"])][6] == str(claimed["token"])


def test_log_names_the_group_and_token_of_consumer_records(
    registry: Any, client: Client
) -> None:
    """With two groups, `log` says which group took and acked, and consuming has its token."""
    create(registry, GROUPS)
    produce_verified(client, "t1", "a")
    leases = {g: ok_json(invoke(registry, "consume", "t1", "a", "--group", g, "-o", "json"))
              for g in ("ocr", "archive")}
    for group, lease in leases.items():
        ok_json(invoke(registry, "ack", "t1", "a", "--group", group, "--token",
                       str(lease["token"]), "-o", "json"))
    records = [json.loads(line) for line in invoke(registry, "log", "t1", "a", "-o", "json")
               .stdout.splitlines()]
    taken = [(r["event"], r["group"], r["token"]) for r in records
             if r["event"] in ("consuming", "acked")]
    assert sorted(taken) == sorted(
        (event, g, lease["token"]) for g, lease in leases.items()
        for event in ("consuming", "acked"))
    assert all(r["group"] == "" for r in records if r["event"] in ("claimed", "committed"))
    table = invoke(registry, "log", "t1", "a")
    headers = next(line for line in table.stdout.splitlines() if "revision" in line)
    assert "group" in headers.split("┃")[7]
    acked = {cells[6]: cells[7] for cells in table_rows(table.stdout).values()
             if cells[3] == "acked"}
    assert acked == {g: str(lease["token"]) for g, lease in leases.items()}


def test_log_of_an_unknown_task_exits_5(registry: Any) -> None:
    """`log` of a task that does not exist is not found (exit 5), like every other command."""
    assert invoke(registry, "log", "nope").exit_code == 5


def test_explain_pending_writing_and_dead(registry: Any) -> None:
    """`explain` says a pending entry is claimable, who writes a writing one, why one is dead."""
    create(registry, {**MANIFEST, "max_retries": 0})
    pending = invoke(registry, "explain", "t1", "a")
    assert pending.exit_code == 0 and "is pending" in pending.stdout
    assert "claimable" in pending.stdout
    claimed = ok_json(invoke(registry, "claim", "t1", "a", "--agent", "writer-7", "-o", "json"))
    writing = ok_json(invoke(registry, "explain", "t1", "a", "-o", "json"))
    assert writing["entry"]["state"] == "writing"
    assert "writer-7" in writing["text"] and str(claimed["token"]) in writing["text"]
    ok_json(invoke(registry, "fail", "t1", "a", "--token", str(claimed["token"]),
                   "--reason", "toner out", "-o", "json"))
    dead = invoke(registry, "explain", "t1", "a")
    assert "is dead" in dead.stdout and "toner out" in dead.stdout
    assert "requeue" in dead.stdout
    assert invoke(registry, "explain", "t1", "nope").exit_code == 5


# --- agents and slots -------------------------------------------------------------------


def test_lease_show_lists_a_session_with_its_claim(registry: Any) -> None:
    """`lease ls` (`agents`) shows the claiming session; `lease show` its slots and claim."""
    create(registry, MANIFEST)
    claimed = ok_json(invoke(registry, "claim", "t1", "--agent", "ops-1", "--slots", "3",
                             "--ttl", "120", "-o", "json"))
    rows = ok_json(invoke(registry, "agents", "-o", "json"))
    (mine,) = [a for a in rows if a["session"] == claimed["session"]]
    assert mine["agent"] == "ops-1" and mine["ttl"] == 120 and mine["claims"] == 1
    assert 0 < mine["ttl_left"] <= 120
    shown = ok_json(invoke(registry, "lease", "show", claimed["session"], "-o", "json"))
    assert shown["slots"] == 3
    assert [(c["task"], c["file_id"], c["kind"], c["token"]) for c in shown["claims"]] == [
        ("t1", "a", "produce", claimed["token"])]
    row = table_rows(invoke(registry, "lease", "ls").stdout)[claimed["session"]]
    assert row[1] == "ops-1" and row[6] == "1"


def test_slot_limit_refuses_one_claim_too_many(registry: Any, client: Client) -> None:
    """A session with one slot holds one claim: the next is SlotsExhausted (exit status 3)."""
    create(registry, TWO)
    with client.open_session("slotted", 30, slots=1) as session:
        first = client.claim("t1", session=session)
        with pytest.raises(errors.SlotsExhausted) as refused:
            client.claim("t1", session=session)
        assert refused.value.exit_code == 3
        mine = ok_json(invoke(registry, "lease", "show", str(session.session_id), "-o",
                              "json"))
        assert (mine["slots"], [c["file_id"] for c in mine["claims"]]) == (1, [first.file_id])
        # Committing frees the slot for the next claim.
        client.commit("t1", first.file_id, first.token, 0, EMPTY)
        assert client.claim("t1", session=session).file_id != first.file_id


def test_consume_takes_a_slot_limit(registry: Any, client: Client) -> None:
    """`consume --slots N` opens its session with that limit, as `lease show` shows."""
    create(registry, MANIFEST)
    produce_verified(client, "t1", "a")
    lease = ok_json(invoke(registry, "consume", "t1", "--slots", "2", "-o", "json"))
    mine = ok_json(invoke(registry, "lease", "show", lease["session"], "-o", "json"))
    assert mine["slots"] == 2
    assert [(c["task"], c["file_id"], c["kind"], c["group"], c["token"])
            for c in mine["claims"]] == [("t1", "a", "consume default", "default",
                                          lease["token"])]


def test_claim_batch_beyond_the_slot_limit_is_not_an_internal_error(registry: Any) -> None:
    """`claim --batch 5 --slots 2` claims at most 2, or is refused with exit 3."""
    create(registry, many(6))
    result = invoke(registry, "claim", "t1", "--batch", "5", "--slots", "2", "-o", "json")
    assert result.exit_code in (0, 3), result.output
    if result.exit_code == 0:
        assert 1 <= len(json.loads(result.stdout)) <= 2


# --- progress ---------------------------------------------------------------------------


def test_status_shows_group_progress_blocked_and_reason(registry: Any, client: Client) -> None:
    """`status` counts acks per consumer group out of its entries, and blocked entries."""
    create(registry, GROUPS)
    produce_verified(client, "t1", "a")
    lease = ok_json(invoke(registry, "consume", "t1", "a", "--group", "ocr", "-o", "json"))
    ok_json(invoke(registry, "ack", "t1", "a", "--group", "ocr", "--token", str(lease["token"]),
                   "-o", "json"))
    kill(registry, "t1", "b")  # index depends on b: blocked
    invoke(registry, "task", "pause", "t1", "--reason", "look at b")
    data = ok_json(invoke(registry, "status", "t1", "-o", "json"))
    assert data["groups"] == {"ocr": {"consumed": 1, "total": 2},
                              "archive": {"consumed": 0, "total": 3}}
    assert data["blocked"] == 1 and data["states"]["dead"] == 1 and data["done"] == 1
    assert data["status"] == "paused" and data["status_reason"] == "pause: look at b"
    table = invoke(registry, "status", "t1")
    assert table.exit_code == 0, table.output
    rows = table_rows(table.stdout)
    assert rows["ocr"][1] == "1/2" and rows["archive"][1] == "0/3"
    assert rows["blocked"][1] == "1" and rows["pending"][1] == "1"
    assert "t1 (paused)" in table.stdout and "pause: look at b" in table.stdout


def test_status_without_blocked_entries_keeps_its_rows(registry: Any) -> None:
    """With nothing blocked, the state table has just the states and the total."""
    create(registry, TWO)
    rows = table_rows(invoke(registry, "status", "t1").stdout)
    assert "blocked" not in rows
    assert rows["pending"][1] == "2" and rows["total"][1] == "2"
    assert rows["default"][1] == "0/2"


def test_status_shows_the_bytes_held_in_staging(registry: Any, client: Client) -> None:
    """`status` shows the bytes of files still in staging; a removal takes its off."""
    client.operator.create_task({"task_id": "t1", "staging_retention_seconds": 0,
                                 "entries": [{"file_id": f, "path": f} for f in ("a", "b")]})
    data = b"y" * 3000
    for f in ("a", "b"):
        produce_verified(client, "t1", f, data)
    assert ok_json(invoke(registry, "status", "t1", "-o", "json"))["staging_bytes"] == 6000
    assert table_rows(invoke(registry, "status", "t1").stdout)["in staging"][1] == "5.9 KiB"
    with client.open_session("reader", 30) as session:
        lease = client.consume("t1", "default", "a", session=session)
        client.ack("t1", "a", "default", lease.token, session=session)
    digest = blake3.blake3(data).hexdigest()
    assert client.watcher.remove_staged("t1", "a", len(data), digest).outcome == (
        pb.RemoveStagedResponse.OUTCOME_MARKED)
    assert ok_json(invoke(registry, "status", "t1", "-o", "json"))["staging_bytes"] == 3000
    assert table_rows(invoke(registry, "status", "t1").stdout)["in staging"][1] == "2.9 KiB"


def test_task_ls_shows_done_over_total_and_dead(registry: Any) -> None:
    """`task ls` shows done/total (dead entries are done) and the dead count."""
    create(registry, {**TWO, "max_retries": 0})
    kill(registry, "t1", "a")
    listed = ok_json(invoke(registry, "task", "ls", "-o", "json"))
    assert [(t["entry_count"], t["open"], t["dead"]) for t in listed] == [(2, 1, 1)]
    row = table_rows(invoke(registry, "task", "ls").stdout)["t1"]
    assert row[1:4] == ["active", "1/2", "1"]


# --- batches ------------------------------------------------------------------------------


def test_claim_batch_then_commit_batch(registry: Any, client: Client, tmp_path: Path) -> None:
    """`claim --batch 5` claims 5 distinct entries at once; `commit-batch` commits them all."""
    create(registry, many(6))
    claims = ok_json(invoke(registry, "claim", "t1", "--batch", "5", "-o", "json"))
    assert isinstance(claims, list) and len(claims) == 5
    assert len({c["file_id"] for c in claims}) == 5
    assert len({c["session"] for c in claims}) == 1
    assert len({c["token"] for c in claims}) == 1  # one transaction
    commits = []
    for c in claims:
        data = c["file_id"].encode()
        commits.append({**c, "size": len(data), "digest": blake3.blake3(data).hexdigest()})
    batch = tmp_path / "commits.json"
    batch.write_text(json.dumps(commits))
    entries = ok_json(invoke(registry, "commit-batch", str(batch), "-o", "json"))
    assert sorted(e["file_id"] for e in entries) == sorted(c["file_id"] for c in claims)
    assert {e["state"] for e in entries} == {"written"}
    for c in commits:
        assert client.operator.get_entry("t1", c["file_id"]).size == c["size"]
    # The sixth, as a table: one row per claim, then the session line.
    table = invoke(registry, "claim", "t1", "--batch", "5")
    assert table.exit_code == 0, table.output
    assert len([r for r in table_rows(table.stdout) if r.startswith("f")]) == 1
    assert table.stdout.splitlines()[-1].startswith("session  ")
    assert invoke(registry, "claim", "t1", "--batch", "5").exit_code == 3


def test_commit_batch_is_all_or_nothing(registry: Any, client: Client) -> None:
    """One stale token in a batch refuses the whole batch (exit 4): nothing is committed."""
    create(registry, TWO)
    claims = ok_json(invoke(registry, "claim", "t1", "--batch", "2", "-o", "json"))
    commits = [{**c, "size": 0, "digest": EMPTY} for c in claims]
    commits[1]["token"] += 1000
    result = run(registry, "commit-batch", "-", stdin=json.dumps(commits))
    assert result.returncode == 4 and "not the live claim" in one_error_line(result.stderr)
    assert result.stdout == ""
    assert {client.operator.get_entry("t1", c["file_id"]).state
            for c in claims} == {pb.ENTRY_STATE_WRITING}
    done = invoke(registry, "commit-batch", "-", stdin=json.dumps(
        [{**c, "size": 0, "digest": EMPTY} for c in claims]))
    assert done.exit_code == 0, done.output
    assert sorted(done.stdout.splitlines()) == ["t1/a: written, 0 bytes",
                                                "t1/b: written, 0 bytes"]


@pytest.mark.parametrize(("stdin", "message"), [
    ("not json", "not valid JSON"),
    ('{"task": "t1"}', "non-empty JSON list"),
    ("[]", "non-empty JSON list"),
    ('[{"task": "t1", "file_id": "a", "token": 5}]', "size must be an integer"),
    ('[{"task": "t1", "file_id": "a", "token": true, "size": 0}]', "token must be an integer"),
    ('[{"task": "t1", "file_id": "a", "token": 5, "size": 0, "sise": 1}]', "unknown field"),
])
def test_commit_batch_rejects_malformed_input(registry: Any, stdin: str, message: str) -> None:
    """A commit-batch file that is not a list of well-formed commits is exit 2, one line."""
    result = invoke(registry, "commit-batch", "-", stdin=stdin)
    assert result.exit_code == 2 and message in one_error_line(result.stderr)


def test_claim_batch_with_a_file_id_is_a_usage_error(registry: Any) -> None:
    """--batch takes the next claimable entries, so it does not go with FILE_ID."""
    create(registry, MANIFEST)
    assert invoke(registry, "claim", "t1", "a", "--batch", "2").exit_code == 2
    assert invoke(registry, "claim", "t1", "--batch", "0").exit_code == 2
