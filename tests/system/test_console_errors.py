"""The console's answer to a task or entry that does not exist, or an id that cannot
name one: a 404 page that says so, on every route that takes an id (never a 502, which
would blame the registry). `baton console` runs as a process against a real registry."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import blake3
import pytest
from test_cli import SUBPROCESS_TIMEOUT, Lines, cli_env

from baton_relay.client import Client
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import free_port


@pytest.fixture
def console(registry: Any, wait_for: Callable[..., None]) -> Iterator[str]:
    """`baton console` on a free port, talking to the test's registry; its base URL."""
    port = free_port()
    listen = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.client.cli", "console", "--listen", listen],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(registry.address))
    try:
        Lines(proc).until(lambda line: line.startswith("console: http"),
                          timeout=SUBPROCESS_TIMEOUT)
        # The line comes just before the server binds: wait until it answers.
        wait_for(lambda: listening(port) or proc.poll() is not None,
                 timeout=SUBPROCESS_TIMEOUT, what="the console to listen")
        assert proc.poll() is None, "the console exited"
        yield f"http://{listen}"
    finally:
        proc.terminate()
        proc.wait(SUBPROCESS_TIMEOUT)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=SUBPROCESS_TIMEOUT) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def quoted(text: str) -> str:
    return urllib.parse.quote(text, safe="")


@pytest.mark.parametrize(("path", "says"), [
    ("/tasks/nope", "nope"),
    ("/tasks/nope/entries/a", "nope"),
    ("/tasks/t1/entries/nope", "nope"),
    (f"/tasks/{quoted('no such!')}", "not a valid"),
    (f"/tasks/t1/entries/{quoted('bad id!')}", "not a valid"),
    (f"/tasks/{quoted('x' * 300)}", "not a valid"),
])
def test_an_unknown_or_invalid_id_is_a_404_page_that_says_so(
        console: str, client: Client, path: str, says: str) -> None:
    """A task or entry that does not exist, or an id no task or entry can have, is a
    404 "Not found" page naming what was not found."""
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a.bin"}]})
    status, body = get(console + path)
    assert status == 404, (path, status, body)
    assert "Not found" in body and says in body, body


@pytest.mark.parametrize("action", ["pause", "resume", "cancel", "requeue"])
def test_an_action_on_a_task_that_does_not_exist_is_a_404(console: str, client: Client,
                                                          action: str) -> None:
    """Asking to act on a task that does not exist answers 404, not a confirmation."""
    status, body = get(f"{console}/act/{action}?task_id=nope&file_id=a&group=g")
    assert status == 404, (action, status, body)
    assert "nope" in body


def test_a_consumed_entrys_page_ends_its_attempt_with_the_commit(
        console: str, client: Client) -> None:
    """The entry page of a consumed entry shows its attempt ended with its commit
    ("committed", the commit's time), not "in progress"."""
    data = b"payload"
    digest = blake3.blake3(data).hexdigest()
    client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a.bin"}]})
    with client.open_session("p", ttl=30) as s:
        claim = client.claim("t1", "a", session=s)
        client.commit("t1", "a", claim.token, len(data), digest, session=s)
        client.watcher.report("t1", "a", len(data), digest)
        lease = client.consume("t1", "default", "a", session=s)
        assert client.ack("t1", "a", "default", lease.token).state == pb.ENTRY_STATE_CONSUMED
    (committed,) = [r for r in client.operator.journal("t1", "a") if r.event == "committed"]
    status, body = get(f"{console}/tasks/t1/entries/a")
    assert status == 200, body
    table = body[body.index('<table id="attempts">'):]
    row = table[:table.index("</table>")]
    assert "in progress" not in row, row
    assert f"<td>{committed.at}</td><td>committed</td>" in row.replace("\n", ""), row
