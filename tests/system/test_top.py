"""``baton top`` against a real registry: states, throughput, stuck entries, leases."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import blake3
import pytest
from registry_fixtures import TEST_RETRY, RegistryHandle
from test_cli import SUBPROCESS_TIMEOUT, Address, Lines, cli_env, invoke, ok_json
from test_cli_startup import loaded_after

from baton_relay.client import Client, Session
from baton_relay.client.cli.top import age_text
from baton_relay.kernel import pki

#: one entry in each state: f0 consumed, f1 verified, f2 written, f3 writing (held by
#: the session), f4 dead, f5 pending
COUNTS = {"pending": 1, "writing": 1, "written": 1, "verified": 1, "consumed": 1, "dead": 1}
DATA = b"abc"


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


@pytest.fixture
def scan(client: Client) -> Iterator[Session]:
    """Task ``scan`` with one entry in each state; the session holding f3 stays open."""
    client.operator.create_task({
        "task_id": "scan", "digest_optional": True, "consumers": ["ocr"], "max_retries": 0,
        "entries": [{"file_id": f"f{i}", "path": f"pages/f{i}.png"} for i in range(6)],
    })
    with client.open_session("ocr-1", ttl=30) as session:
        for file_id in ("f0", "f1", "f2"):
            claim = client.claim("scan", file_id, session=session)
            client.commit("scan", file_id, claim.token, len(DATA))  # no digest: the watcher's
        for file_id in ("f0", "f1"):
            client.watcher.report("scan", file_id, len(DATA), digest(DATA))  # as a watcher would
        lease = client.consume("scan", "ocr", "f0", session=session)
        client.ack("scan", "f0", "ocr", lease.token)
        client.claim("scan", "f3", session=session)
        claim = client.claim("scan", "f4", session=session)
        client.fail("scan", "f4", claim.token, "scanner jammed")
        yield session


def task_row(output: str, task: str) -> list[str]:
    """The cells of a task's row in the tasks table."""
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if cells[0] == task and len(cells) == 11:
            return cells
    raise AssertionError(f"no row for {task} in:\n{output}")


def test_once_shows_states_stuck_entries_and_sessions(registry: RegistryHandle,
                                                      scan: Session) -> None:
    """`top --once` prints one frame: the task's counts, its stuck entries, the session."""
    out = invoke(registry, "top", "--once", "--stuck-after", "0")
    assert out.exit_code == 0, out.output
    row = task_row(out.output, "scan")
    assert row[1:8] == ["active", *map(str, COUNTS.values())]
    assert row[8:] == ["-", "-", "2"]  # no rates from one frame; f2 and f4 are stuck
    lines = out.output.splitlines()
    assert any("f2" in line and "written" in line and "waiting for verification" in line
               for line in lines)
    assert any("f4" in line and "dead" in line and "scanner jammed" in line for line in lines)
    assert "leases: 1 session, 1 claim" in out.output
    session = next(line for line in lines if str(scan.session_id) in line)
    assert "ocr-1" in session and "scan/f3" in session and "/30 s" in session
    assert "watchers: 1 entry written, waiting for verification; the oldest scan/f2" in out.output
    assert "per-watcher rows come with watcher registration" in out.output
    assert out.output.count("baton top ") == 1


def test_json_once_has_the_same_numbers(registry: RegistryHandle, scan: Session) -> None:
    """`top -o json --once` is one object with the numbers the table shows."""
    table = task_row(invoke(registry, "top", "--once", "--stuck-after", "0").output, "scan")
    frame = ok_json(invoke(registry, "top", "-o", "json", "--once", "--stuck-after", "0"))
    (task,) = frame["tasks"]
    assert task["task"] == "scan" and task["status"] == table[1] == "active"
    assert [*task["states"].values(), task["stuck"]] == [int(n) for n in table[2:8] + table[10:]]
    assert task["states"] == COUNTS and task["entries"] == 6 and task["done"] == 2
    assert task["blocked"] == 0
    assert task["verified_per_s"] is None and frame["elapsed"] is None
    assert frame["totals"]["states"] == COUNTS and frame["totals"]["stuck"] == 2
    stuck = frame["stuck"]
    assert stuck["total"] == 2
    assert [(s["file_id"], s["state"]) for s in stuck["entries"]] == [("f2", "written"),
                                                                      ("f4", "dead")]
    assert "scanner jammed" in stuck["entries"][1]["error"]
    leases = frame["leases"]
    assert leases["available"] and leases["sessions_total"] == 1
    (session,) = leases["sessions"]
    assert session["session_id"] == str(scan.session_id) and session["agent"] == "ocr-1"
    assert [(c["task_id"], c["file_id"]) for c in session["claims"]] == [("scan", "f3")]
    assert 0 < session["ttl_left"] <= session["granted_ttl"] == 30
    watchers = frame["watchers"]
    assert watchers["waiting"] == 1 and watchers["oldest_waiting"]["file_id"] == "f2"
    assert "watcher registration" in watchers["note"]


def test_a_fresh_written_entry_is_not_stuck_yet(registry: RegistryHandle, scan: Session) -> None:
    """With the default --stuck-after (60 s) only the dead entry counts as stuck."""
    frame = ok_json(invoke(registry, "top", "-o", "json", "--once"))
    assert frame["stuck_after"] == 60
    assert [s["file_id"] for s in frame["stuck"]["entries"]] == ["f4"]
    assert frame["tasks"][0]["stuck"] == 1
    assert frame["watchers"]["waiting"] == 1  # still waiting, just not for long


def top_process(registry: RegistryHandle, *args: str) -> subprocess.Popen[str]:
    """`baton top -o json ARGS` as its own process, its stdout a pipe."""
    return subprocess.Popen([sys.executable, "-m", "baton_relay.client.cli", "top", "-o", "json",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**cli_env(registry.address), "BATON_TIMEOUT": "2"})


def stop(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C: the view ends with status 0 and says nothing on stderr."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=SUBPROCESS_TIMEOUT) == 0
    assert proc.stderr is not None and proc.stderr.read() == ""


def test_throughput_comes_from_successive_frames(registry: RegistryHandle, client: Client,
                                                 scan: Session) -> None:
    """Entries that reach verified or consumed between frames show as a rate per second,
    into a pipe one JSON object per frame; Ctrl-C ends the view with status 0."""
    proc = top_process(registry, "scan", "--interval", "0.2", "--frames", "200")
    try:
        lines = Lines(proc)
        first = json.loads(lines.until(bool))
        assert first["frame"] == 1 and first["tasks"][0]["verified_per_s"] is None
        client.watcher.report("scan", "f2", len(DATA), digest(DATA))  # written -> verified
        lease = client.consume("scan", "ocr", "f1", session=scan)
        client.ack("scan", "f1", "ocr", lease.token)  # verified -> consumed
        verified = consumed = 0.0
        while True:
            frame = json.loads(lines.until(bool))
            task = frame["tasks"][0]
            assert frame["elapsed"] > 0 and task["verified_per_s"] >= 0
            verified += task["verified_per_s"] * frame["elapsed"]
            consumed += task["consumed_per_s"] * frame["elapsed"]
            if task["states"]["consumed"] == 2 and task["states"]["written"] == 0:
                break
        # one entry reached verified (f2), one went on to consumed (f1)
        assert (round(verified, 6), round(consumed, 6)) == (1, 1)
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_new_task_wakes_the_view_before_the_interval(registry: RegistryHandle,
                                                       client: Client) -> None:
    """A task created while the view waits is shown at once, not at the next interval."""
    client.operator.create_task({"task_id": "old", "entries": [{"file_id": "a", "path": "a"}]})
    proc = top_process(registry, "--interval", "120")
    try:
        lines = Lines(proc)
        assert [t["task"] for t in json.loads(lines.until(bool))["tasks"]] == ["old"]
        client.operator.create_task({"task_id": "new", "entries": [{"file_id": "a", "path": "a"}]})
        woken = json.loads(lines.until(bool, timeout=20))
        assert sorted(t["task"] for t in woken["tasks"]) == ["new", "old"]
        assert woken["elapsed"] < 60
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_registry_gone_is_shown_and_the_view_goes_on(registry: RegistryHandle,
                                                       scan: Session) -> None:
    """After the first frame, a registry that stops answering is a frame with the error,
    not the end of the view."""
    proc = top_process(registry, "--interval", "0.2")
    try:
        lines = Lines(proc)
        assert json.loads(lines.until(bool))["tasks"][0]["task"] == "scan"
        scan.close(revoke=False)  # its keepalive thread would only complain
        registry.stop()
        failed = json.loads(lines.until(lambda line: '"error"' in line, timeout=30))
        assert failed["error"].startswith("registry unavailable") and "tasks" not in failed
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_frames_into_a_pipe_are_printed_whole(registry: RegistryHandle, scan: Session,
                                              wait_for: Callable[..., None]) -> None:
    """Not on a terminal, each refresh is printed in full, a blank line between two; the
    header watch ends with the command."""
    out = invoke(registry, "top", "--frames", "2", "--interval", "0.2")
    assert out.exit_code == 0, out.output
    frames = out.output.split("\n\nbaton top ")
    assert len(frames) == 2 and out.output.startswith("baton top ")
    assert task_row(frames[1], "scan")[8:10] == ["0.0", "0.0"]  # nothing moved meanwhile
    wait_for(lambda: not any(t.name == "baton-top-headers" for t in threading.enumerate()),
             what="the header watch to end")


def test_named_tasks_only_and_a_missing_one_exits_5(registry: RegistryHandle,
                                                    client: Client, scan: Session) -> None:
    """TASK arguments limit the view; naming a task that does not exist is exit 5."""
    client.operator.create_task({"task_id": "other", "entries": [{"file_id": "a", "path": "a"}]})
    both = ok_json(invoke(registry, "top", "-o", "json", "--once"))
    assert [t["task"] for t in both["tasks"]] == ["other", "scan"]
    one = ok_json(invoke(registry, "top", "-o", "json", "--once", "scan"))
    assert [t["task"] for t in one["tasks"]] == ["scan"]
    missing = invoke(registry, "top", "--once", "nope")
    assert missing.exit_code == 5 and missing.stderr == "baton: no task 'nope'\n"


@pytest.fixture
def agent_only(registry_factory: Callable[..., RegistryHandle],
               tmp_path: Path) -> tuple[RegistryHandle, dict[str, str]]:
    """A registry serving mutual TLS, and the variables of an identity with the agent
    role only."""
    root = tmp_path / "pki"
    pki.create_ca(root)
    server = pki.issue(root, "registry", root, server_names=["127.0.0.1"])
    agent = pki.issue(root, "scanner", root, roles=["agent"])
    secure = registry_factory(tls_ca=str(root / "ca.crt"), tls_cert=str(server.cert),
                              tls_key=str(server.key))
    return secure, {"BATON_CA": str(root / "ca.crt"), "BATON_CERT": str(agent.cert),
                    "BATON_KEY": str(agent.key)}


def test_leases_say_they_need_the_operator_role(
    agent_only: tuple[RegistryHandle, dict[str, str]]
) -> None:
    """An identity without the operator role sees every task, and a line instead of the
    sessions it may not list."""
    secure, identity = agent_only
    with Client(secure.address, timeout=10, retry=TEST_RETRY, ca=identity["BATON_CA"],
                cert=identity["BATON_CERT"], key=identity["BATON_KEY"]) as agent:
        agent.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}]})
    where = Address(secure.address, tuple(identity.items()))
    out = invoke(where, "top", "--once")
    assert out.exit_code == 0, out.output
    assert "leases: needs the operator role" in out.output
    assert task_row(out.output, "t1")[1:3] == ["active", "1"]
    frame = ok_json(invoke(where, "top", "--once", "-o", "json"))
    assert frame["leases"] == {"available": False, "reason": "needs the operator role",
                               "sessions_total": 0, "claims_total": 0, "sessions": []}


def test_json_frames_need_no_rich(registry: RegistryHandle) -> None:
    """`top -o json` does without rich, the table loads it; `top --help` needs neither rich
    nor gRPC."""
    assert loaded_after(["top", "--help"]) == []
    assert "rich" not in loaded_after(["top", "--once", "-o", "json"], registry.address)
    assert "rich" in loaded_after(["top", "--once"], registry.address)


@pytest.mark.parametrize(("seconds", "text"), [(0.4, "0s"), (59, "59s"), (65, "1m05s"),
                                               (7260, "2h01m"), (97200, "1d03h")])
def test_ages_read_short(seconds: float, text: str) -> None:
    """Ages in the stuck table: seconds, then minutes, hours, days."""
    assert age_text(seconds) == text
