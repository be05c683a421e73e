"""The ``baton`` CLI against a real registry on a real etcd.

Flows that depend on a claim outliving its process, on exit statuses and on
stderr run the CLI as a subprocess (``python -m baton_relay.client.cli``); the rest go
through click's CliRunner, in-process, which is much cheaper.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import pytest
from click.testing import CliRunner, Result

from baton_relay.client import DEFAULT_REGISTRY, Client, RetryPolicy
from baton_relay.client.cli import cli
from baton_relay.client.cli._common import default_agent
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import free_port
from baton_relay.local.stack import LocalPKI

MANIFEST = {"task_id": "t1", "entries": [{"file_id": "a", "path": "a.json"}]}
TWO = {"task_id": "t1", "entries": [{"file_id": "a", "path": "a.json"},
                                    {"file_id": "b", "path": "dir/b.json"}]}
SUBPROCESS_TIMEOUT = 60


# --- helpers ----------------------------------------------------------------------


@dataclass(frozen=True)
class Address:
    """Where a registry serves (what the helpers below need of the fixture), and the
    identity's variables (BATON_CA, ...) when it serves mutual TLS."""

    address: str
    identity: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of_stack(cls, address: str, data_dir: Path) -> Address:
        """A `baton up` stack's registry, with its operator identity."""
        return cls(address, tuple(LocalPKI(data_dir / "pki").environ("operator").items()))

    def client(self) -> Client:
        env = dict(self.identity)
        return Client(self.address, ca=env.get("BATON_CA", ""),
                      cert=env.get("BATON_CERT", ""), key=env.get("BATON_KEY", ""))


def cli_env(address: str, identity: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env["BATON_REGISTRY"] = address
    env.update(identity)
    return env


def run(registry: Any, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI as its own process, talking to ``registry``."""
    return subprocess.run(
        [sys.executable, "-m", "baton_relay.client.cli", *args], input=stdin, capture_output=True,
        text=True, env=cli_env(registry.address, getattr(registry, "identity", ())),
        timeout=SUBPROCESS_TIMEOUT, check=False,
    )


def invoke(registry: Any, *args: str, stdin: str | None = None) -> Result:
    """Run the CLI in this process through click's CliRunner."""
    return CliRunner().invoke(cli, list(args), input=stdin, env={
        "BATON_REGISTRY": registry.address, **dict(getattr(registry, "identity", ()))})


def ok_json(result: subprocess.CompletedProcess[str] | Result) -> Any:
    rc = result.returncode if isinstance(result, subprocess.CompletedProcess) else result.exit_code
    assert rc == 0, (rc, result.stdout, result.stderr)
    return json.loads(result.stdout)


def create(registry: Any, manifest: dict[str, Any]) -> None:
    assert invoke(registry, "task", "create", "-", stdin=json.dumps(manifest)).exit_code == 0


def write(path: str, data: bytes) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)


def one_error_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("baton: "), stderr
    return lines[0]


@pytest.fixture
def lib(registry: Any) -> Iterator[Client]:
    """The client library on the same registry, to set up and check state."""
    retry = RetryPolicy(attempts=3, initial=0.05, cap=0.2, deadline=3.0)
    with Client(registry.address, timeout=10, retry=retry) as c:
        yield c


class Lines:
    """A process's stdout lines, read by a thread, waited for with a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def until(self, match: Callable[[str], bool], timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while True:
            try:
                line = self._q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                pytest.fail(f"no matching line within {timeout} s; it said:\n{''.join(seen)}")
            if line is None:
                pytest.fail(f"the process closed its stdout first (exit {self.proc.wait(10)}); "
                            f"it said:\n{''.join(seen)}")
            seen.append(line)
            if match(line):
                return line


# --- tasks -----------------------------------------------------------------------


def test_task_create_is_idempotent_and_refuses_a_different_manifest(
        registry: Any, tmp_path: Path) -> None:
    """Create prints created, the same manifest again is a no-op, another one exits 4."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps(MANIFEST))
    first = invoke(registry, "task", "create", str(path))
    assert first.exit_code == 0 and first.stdout.startswith("created task t1"), first.output
    again = invoke(registry, "task", "create", str(path))
    assert again.exit_code == 0 and "already exists" in again.stdout, again.output
    path.write_text(json.dumps(TWO))
    other = invoke(registry, "task", "create", str(path))
    assert other.exit_code == 4
    assert "different manifest" in one_error_line(other.stderr)


def test_task_create_from_stdin_as_json(registry: Any) -> None:
    """`task create -` reads stdin; -o json says whether it was created."""
    data = ok_json(invoke(registry, "task", "create", "-", "-o", "json",
                          stdin=json.dumps(TWO)))
    assert data["created"] is True and data["task"]["entry_count"] == 2
    again = ok_json(invoke(registry, "task", "create", "-", "-o", "json",
                           stdin=json.dumps(TWO)))
    assert again["created"] is False


def test_manifest_path_escaping_the_task_exits_2(registry: Any) -> None:
    """A manifest path with '..' is refused as invalid input, in one stderr line."""
    bad = {"task_id": "t1", "entries": [{"file_id": "a", "path": "../../etc/passwd"}]}
    result = run(registry, "task", "create", "-", stdin=json.dumps(bad))
    assert result.returncode == 2
    assert "'..'" in one_error_line(result.stderr)
    assert "Traceback" not in result.stderr


def test_manifest_that_is_not_json_exits_2_with_position(registry: Any) -> None:
    """Broken JSON is exit 2 and the message says where it broke."""
    result = run(registry, "task", "create", "-", stdin='{"task_id": "t1",\n "entries": [}')
    assert result.returncode == 2
    assert "line 2 column" in one_error_line(result.stderr)


def test_manifest_with_unknown_field_exits_2(registry: Any) -> None:
    """A misspelt manifest field is invalid input, not silently ignored."""
    result = invoke(registry, "task", "create", "-",
                    stdin=json.dumps({**MANIFEST, "entriez": []}))
    assert result.exit_code == 2 and "entriez" in one_error_line(result.stderr)


def test_task_get_and_ls(registry: Any) -> None:
    """`task get` and `task ls` show the task, in tables and as JSON."""
    create(registry, TWO)
    got = ok_json(invoke(registry, "task", "get", "t1", "-o", "json"))
    assert got["spec"]["task_id"] == "t1" and got["states"]["pending"] == 2
    assert "pending 2" in invoke(registry, "task", "get", "t1").stdout
    listed = ok_json(invoke(registry, "task", "ls", "-o", "json"))
    assert [t["spec"]["task_id"] for t in listed] == ["t1"]
    assert "t1" in invoke(registry, "task", "ls").stdout
    missing = invoke(registry, "task", "get", "nope")
    assert missing.exit_code == 5, missing.output


# --- status ------------------------------------------------------------------------


def test_status_table_counts_states_and_lists_entries(registry: Any) -> None:
    """`status` counts entries per state; --entries adds a row per entry with its owner."""
    create(registry, TWO)
    ok_json(invoke(registry, "claim", "t1", "a", "--agent", "writer-1", "-o", "json"))
    table = invoke(registry, "status", "t1", "--entries")
    assert table.exit_code == 0, table.output
    rows = {line.split("│")[1].strip(): line for line in table.stdout.splitlines()
            if line.count("│") > 2}
    assert rows["pending"].split("│")[2].strip() == "1"
    assert rows["writing"].split("│")[2].strip() == "1"
    assert rows["verified"].split("│")[2].strip() == "0"
    assert "writer-1" in rows["a"] and "writing" in rows["a"]
    assert "pending" in rows["b"]
    data = ok_json(invoke(registry, "status", "t1", "--entries", "-o", "json"))
    assert data["states"]["writing"] == 1 and data["states"]["pending"] == 1
    assert {e["file_id"]: e["state"] for e in data["entries"]} == {"a": "writing",
                                                                   "b": "pending"}


# --- producers --------------------------------------------------------------------


def test_claim_json_has_token_path_and_session(registry: Any) -> None:
    """`claim -o json` prints task, file_id, token, path and the session id (a string)."""
    create(registry, MANIFEST)
    data = ok_json(invoke(registry, "claim", "t1", "-o", "json"))
    assert {"task", "file_id", "token", "path", "session"} <= data.keys()
    assert data["task"] == "t1" and data["file_id"] == "a" and data["token"] > 0
    assert data["path"] == str(registry.staging / "t1" / f"a~t{data['token']}.json")
    assert data["session"].isdigit()


def test_claim_outlives_its_process_and_commit_from_another_succeeds(
        registry: Any, lib: Client) -> None:
    """A claim made by one CLI process is committed by another with its token."""
    create(registry, MANIFEST)
    claimed = ok_json(run(registry, "claim", "t1", "a", "-o", "json"))
    # the claiming process is gone
    assert lib.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITING
    data = b'{"hello": "world"}\n'
    write(claimed["path"], data)
    done = run(registry, "commit", "t1", "a", "--token", str(claimed["token"]),
               "--file", claimed["path"], "-o", "json")
    entry = ok_json(done)
    assert entry["state"] == "written" and entry["size"] == len(data)
    committed = lib.operator.get_entry("t1", "a")
    assert committed.state == pb.ENTRY_STATE_WRITTEN and committed.size == len(data)


def test_commit_with_wrong_token_exits_4_with_one_line(registry: Any) -> None:
    """A stale token is refused: exit 4, one `baton:` line on stderr, no traceback."""
    create(registry, MANIFEST)
    claimed = ok_json(run(registry, "claim", "t1", "-o", "json"))
    wrong = run(registry, "commit", "t1", "a", "--token", str(claimed["token"] + 1000),
                "--size", "0")
    assert wrong.returncode == 4
    assert "not the live claim" in one_error_line(wrong.stderr)
    assert wrong.stdout == ""


def test_claim_with_nothing_claimable_exits_3_and_revokes_its_session(
        registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every entry claimed, `claim` exits 3 and the session it opened is closed."""
    create(registry, MANIFEST)
    ok_json(invoke(registry, "claim", "t1", "-o", "json"))
    closed: list[int] = []
    original = Client.close_session

    def spy(self: Client, session_id: int) -> None:
        closed.append(session_id)
        original(self, session_id)

    monkeypatch.setattr(Client, "close_session", spy)
    result = invoke(registry, "claim", "t1")
    assert result.exit_code == 3 and "nothing to claim" in one_error_line(result.stderr)
    assert len(closed) == 1
    monkeypatch.undo()
    # The lease is gone: refreshing it is refused.
    assert invoke(registry, "keepalive", str(closed[0])).exit_code == 4


def test_commit_needs_size_or_file_but_not_both(registry: Any, tmp_path: Path) -> None:
    """--size/--digest and --file are alternatives; neither or both is a usage error."""
    f = tmp_path / "x"
    f.write_bytes(b"x")
    neither = invoke(registry, "commit", "t1", "a", "--token", "1")
    both = invoke(registry, "commit", "t1", "a", "--token", "1", "--size", "1", "--file", str(f))
    assert neither.exit_code == 2 and both.exit_code == 2


def test_put_then_status_shows_written(registry: Any, tmp_path: Path, lib: Client) -> None:
    """`put` claims, copies durably and commits; the entry is written with its digest."""
    create(registry, TWO)
    src = tmp_path / "src.bin"
    data = os.urandom(100_000)
    src.write_bytes(data)
    done = run(registry, "put", "t1", "b", str(src), "--agent", "copier")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("t1/b: written")
    assert Path(lib.operator.get_entry("t1", "b").abs_attempt_path).read_bytes() == data
    status = ok_json(run(registry, "status", "t1", "-o", "json"))
    assert status["states"]["written"] == 1 and status["states"]["pending"] == 1
    assert "written" in run(registry, "status", "t1").stdout
    entry = lib.operator.get_entry("t1", "b")
    assert entry.owner == "copier" and entry.size == len(data)


def test_put_reads_stdin(registry: Any, lib: Client) -> None:
    """`put TASK FILE_ID -` copies stdin."""
    create(registry, MANIFEST)
    result = invoke(registry, "put", "t1", "a", "-", stdin="from stdin\n")
    assert result.exit_code == 0, result.output
    assert Path(lib.operator.get_entry("t1", "a").abs_attempt_path).read_text() == "from stdin\n"


def test_fail_returns_entry_for_retry(registry: Any) -> None:
    """`fail --reason` sends the entry back to pending with the reason as its error."""
    create(registry, MANIFEST)
    claimed = ok_json(invoke(registry, "claim", "t1", "-o", "json"))
    entry = ok_json(invoke(registry, "fail", "t1", "a", "--token", str(claimed["token"]),
                           "--reason", "disk full", "-o", "json"))
    assert entry["state"] == "pending" and entry["retry_count"] == 1
    assert "disk full" in entry["error"]


def test_fail_release_gives_an_unbegun_claim_back_as_it_was(registry: Any) -> None:
    """`fail --release` sends the entry back to pending at once: no retry spent, no
    error; with --permanent it is refused (exit 2) and changes nothing."""
    create(registry, MANIFEST)
    claimed = ok_json(invoke(registry, "claim", "t1", "-o", "json"))
    token = str(claimed["token"])
    refused = invoke(registry, "fail", "t1", "a", "--token", token, "--release", "--permanent")
    assert refused.exit_code == 2 and "release" in refused.output
    entry = ok_json(invoke(registry, "fail", "t1", "a", "--token", token, "--release",
                           "-o", "json"))
    assert entry["state"] == "pending" and not entry.get("retry_count")
    assert not entry.get("error")


# --- consumers --------------------------------------------------------------------


def produce_verified(registry: Any, lib: Client, data: bytes = b"payload\n") -> None:
    """Put entry a of t1 and report it as the watcher would, so it is verified."""
    ok_json(invoke(registry, "put", "t1", "a", "-", "-o", "json", stdin=data.decode()))
    entry = lib.watcher.report("t1", "a", len(data), blake3.blake3(data).hexdigest())
    assert entry.state == pb.ENTRY_STATE_VERIFIED


def test_consume_json_then_ack_consumes(registry: Any, lib: Client) -> None:
    """`consume -o json` gives token, path and digest; `ack` with it finishes the entry."""
    create(registry, MANIFEST)
    produce_verified(registry, lib)
    lease = ok_json(run(registry, "consume", "t1", "--group", "default", "-o", "json"))
    assert {"task", "file_id", "token", "path", "digest", "size", "group"} <= lease.keys()
    assert blake3.blake3(Path(lease["path"]).read_bytes()).hexdigest() == lease["digest"]
    wrong = run(registry, "ack", "t1", "a", "--group", "default", "--token", "1")
    assert wrong.returncode == 4 and one_error_line(wrong.stderr)
    done = run(registry, "ack", "t1", "a", "--group", "default", "--token", str(lease["token"]))
    assert done.returncode == 0, done.stderr
    assert lib.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_CONSUMED
    again = run(registry, "consume", "t1")
    assert again.returncode == 3


def test_nack_hands_entry_back_to_group(registry: Any, lib: Client) -> None:
    """After `nack`, the same group can consume the entry again."""
    create(registry, MANIFEST)
    produce_verified(registry, lib)
    first = ok_json(invoke(registry, "consume", "t1", "a", "-o", "json"))
    assert invoke(registry, "consume", "t1").exit_code == 3
    back = invoke(registry, "nack", "t1", "a", "--token", str(first["token"]),
                  "--reason", "try later")
    assert back.exit_code == 0, back.output
    second = ok_json(invoke(registry, "consume", "t1", "-o", "json"))
    assert second["file_id"] == "a" and second["token"] != first["token"]


def test_consume_wait_returns_an_entry_verified_meanwhile(registry: Any, lib: Client) -> None:
    """`consume --wait` blocks until an entry is verified, then prints its lease."""
    create(registry, MANIFEST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.client.cli", "consume", "t1", "--wait", "30", "-o",
         "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(registry.address),
    )
    try:
        produce_verified(registry, lib)
        out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert json.loads(out)["file_id"] == "a"


def test_consume_wait_times_out_with_exit_3(registry: Any) -> None:
    """`consume --wait` with nothing verified in time is exit 3 (nothing to consume)."""
    create(registry, MANIFEST)
    start = time.monotonic()
    result = invoke(registry, "consume", "t1", "--wait", "0.5")
    assert result.exit_code == 3, result.output
    assert time.monotonic() - start < 10


# --- sessions ----------------------------------------------------------------------


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


@pytest.mark.slow
def test_keepalive_extends_a_claim_and_an_unrefreshed_one_dies(
        registry: Any, lib: Client, tmp_path: Path) -> None:
    """Kept alive past its TTL a claim still commits; left alone it is reaped (exit 4)."""
    create(registry, TWO)
    kept = ok_json(run(registry, "claim", "t1", "a", "--ttl", "3", "-o", "json"))
    claimed_at = time.monotonic()
    for _ in range(2):
        time.sleep(1.5)  # time must pass; refreshed well within each 3 s TTL
        refreshed = ok_json(run(registry, "keepalive", kept["session"], "-o", "json"))
        assert refreshed["ttl"] > 0
    time.sleep(max(0.0, 4 - (time.monotonic() - claimed_at)))
    assert time.monotonic() - claimed_at > 3  # beyond the TTL it was granted with
    write(kept["path"], b"kept")
    assert run(registry, "commit", "t1", "a", "--token", str(kept["token"]),
               "--file", kept["path"]).returncode == 0

    lost = ok_json(run(registry, "claim", "t1", "b", "--ttl", "2", "-o", "json"))

    def reaped() -> bool:
        entries = ok_json(invoke(registry, "status", "t1", "--entries", "-o", "json"))["entries"]
        b = next(e for e in entries if e["file_id"] == "b")
        return bool(b["state"] == "pending" and b["retry_count"] == 1)

    wait_until(reaped, 15, "the registry to reap the expired claim")
    late = run(registry, "commit", "t1", "b", "--token", str(lost["token"]), "--size", "0")
    assert late.returncode == 4
    assert "not the live claim" in one_error_line(late.stderr)


def test_release_ends_the_claim_now(registry: Any, lib: Client) -> None:
    """`release SESSION` revokes the lease: the claim's token is dead at once."""
    create(registry, MANIFEST)
    claimed = ok_json(invoke(registry, "claim", "t1", "-o", "json"))
    assert invoke(registry, "release", claimed["session"]).exit_code == 0
    late = invoke(registry, "commit", "t1", "a", "--token", str(claimed["token"]), "--size", "0")
    assert late.exit_code == 4


def test_session_ids_are_checked(registry: Any) -> None:
    """A session id that is not a positive number is a usage error; 0x-hex is accepted."""
    assert invoke(registry, "keepalive", "soon").exit_code == 2
    assert invoke(registry, "keepalive", "-5").exit_code == 2
    create(registry, MANIFEST)
    claimed = ok_json(invoke(registry, "claim", "t1", "-o", "json"))
    assert invoke(registry, "keepalive", hex(int(claimed["session"]))).exit_code == 0


# --- watch, errors, up ----------------------------------------------------------------


def test_watch_prints_events_and_ctrl_c_exits_0(registry: Any, lib: Client) -> None:
    """`watch -o json` prints one JSON object per event and stops cleanly on SIGINT."""
    create(registry, MANIFEST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.client.cli", "watch", "t1", "-o", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(registry.address),
    )
    try:
        lines = Lines(proc)
        lines.until(lambda line: json.loads(line)["kind"] == "synced")
        claimed = ok_json(invoke(registry, "claim", "t1", "-o", "json"))
        event = json.loads(lines.until(lambda line: '"state": "writing"' in line))
        assert event["entry"]["file_id"] == "a" and event["revision"] == claimed["token"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=SUBPROCESS_TIMEOUT) == 0
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_text_lines_from_a_snapshot(registry: Any) -> None:
    """`watch --from-revision 0` starts with every entry: time, file_id, state, revision."""
    create(registry, MANIFEST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.client.cli", "watch", "t1", "--from-revision", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=cli_env(registry.address),
    )
    try:
        fields = Lines(proc).until(lambda line: " a " in line).split()
        assert fields[1:3] == ["a", "pending"] and fields[3].isdigit()
        assert fields[0].endswith("Z")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=SUBPROCESS_TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unreachable_registry_exits_6_within_the_timeout() -> None:
    """With the registry down, a command fails in about --timeout with exit 6."""
    closed = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    result = run(Address(DEFAULT_REGISTRY), "--registry", closed, "--timeout", "1", "task", "ls")
    elapsed = time.monotonic() - start
    assert result.returncode == 6
    assert closed in one_error_line(result.stderr)
    assert elapsed < 8, elapsed


def test_default_agent_name_is_sanitised(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default agent is hostname-pid with characters outside [A-Za-z0-9._-] replaced."""
    monkeypatch.setattr("socket.gethostname", lambda: "my host/ünï")
    assert default_agent() == f"my-host--n--{os.getpid()}"


@pytest.mark.slow
def test_up_serves_a_registry_until_ctrl_c(tmp_path: Path) -> None:
    """`baton up` serves a stack that carries a file from put to ack; SIGINT exits 0."""
    registry_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.client.cli", "up", "--data-dir", str(tmp_path / "data"),
         "--etcd-port", str(free_port()), "--registry-port", str(registry_port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(f"127.0.0.1:{registry_port}"),
    )
    try:
        Lines(proc).until(lambda line: line.startswith("ready"), timeout=45)
        up = Address.of_stack(f"127.0.0.1:{registry_port}", tmp_path / "data")
        create(up, MANIFEST)
        got = ok_json(run(up, "task", "get", "t1", "-o", "json"))
        assert got["staging_dir"] == str(tmp_path / "data" / "staging" / "t1")
        # The stack's watcher verifies what `put` writes, so a consumer gets it.
        assert run(up, "put", "t1", "a", "-", stdin="via up\n").returncode == 0
        lease = ok_json(run(up, "consume", "t1", "--wait", "30", "-o", "json"))
        assert Path(lease["path"]).read_text() == "via up\n"
        assert run(up, "ack", "t1", "a", "--token", str(lease["token"])).returncode == 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=SUBPROCESS_TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_restarted_on_the_same_data_dir_keeps_every_task_and_entry(tmp_path: Path) -> None:
    """Stopping `baton up` with SIGTERM and starting it again loses nothing."""
    registry_port, etcd_port = free_port(), free_port()
    argv = [sys.executable, "-m", "baton_relay.client.cli", "up", "--data-dir",
            str(tmp_path / "data"), "--etcd-port", str(etcd_port), "--registry-port",
            str(registry_port)]
    up = Address.of_stack(f"127.0.0.1:{registry_port}", tmp_path / "data")

    def start() -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=cli_env(up.address))
        Lines(proc).until(lambda line: line.startswith("ready"), timeout=45)
        return proc

    proc = start()
    try:
        create(up, TWO)
        assert run(up, "put", "t1", "a", "-", stdin="kept\n").returncode == 0
        claim = ok_json(run(up, "claim", "t1", "b", "--ttl", "600", "-o", "json"))
        # The stack's watcher verifies `a`; let it finish so nothing moves meanwhile.
        with up.client() as c:
            deadline = time.monotonic() + 30
            while c.operator.get_entry("t1", "a").state != pb.ENTRY_STATE_VERIFIED:
                assert time.monotonic() < deadline, "the watcher did not verify a"
                time.sleep(0.05)
        before = ok_json(run(up, "status", "t1", "-o", "json"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=SUBPROCESS_TIMEOUT) == 0
        proc = start()
        assert ok_json(run(up, "status", "t1", "-o", "json")) == before
        # The claim made before the restart is still live: its token commits.
        done = run(up, "commit", "t1", "b", "--token", str(claim["token"]), "--size", "0",
                   "--digest", blake3.blake3(b"").hexdigest())
        assert done.returncode == 0, done.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=SUBPROCESS_TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
