"""`baton console` against a real `baton up` stack, driven through Debian's chromium.

The stack and two consoles (one as the operator, one as an agent identity) run as
processes; the browser is Playwright's, pointed at /usr/bin/chromium (no browser is
downloaded). Each page's screenshot is written under the test's tmp dir and copied
into docs/console/ for docs/console.md.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_cli import SUBPROCESS_TIMEOUT, Lines, cli_env
from tools import require

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import free_port
from baton_relay.local.stack import LocalPKI

pytestmark = pytest.mark.slow

DOCS_SHOTS = Path(__file__).resolve().parents[2] / "docs" / "console"


@dataclass
class Stack:
    address: str
    pki: LocalPKI
    operator_url: str
    reader_url: str

    def env(self, who: str = "operator") -> dict[str, str]:
        return cli_env(self.address, tuple(self.pki.environ(who).items()))

    def client(self, who: str = "operator") -> Client:
        env = self.pki.environ(who)
        return Client(self.address, ca=env["BATON_CA"], cert=env["BATON_CERT"],
                      key=env["BATON_KEY"])

    def baton(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "baton_relay.client.cli", *args],
                              input=stdin, capture_output=True, text=True, env=self.env(),
                              timeout=SUBPROCESS_TIMEOUT, check=False)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=SUBPROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`baton up`, then `baton console` as the operator and as the stack's agent."""
    data = tmp_path_factory.mktemp("console") / "data"
    port = free_port()
    address = f"127.0.0.1:{port}"
    base = [sys.executable, "-m", "baton_relay.client.cli"]
    up = subprocess.Popen([*base, "up", "--data-dir", str(data), "--etcd-port",
                           str(free_port()), "--registry-port", str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=cli_env(address))
    procs = [up]
    try:
        said = Lines(up).until(lambda line: line.startswith("ready"), timeout=60)
        assert said
        pki = LocalPKI(data / "pki")
        urls = []
        for who in ("operator", "agent"):
            listen = f"127.0.0.1:{free_port()}"
            # The agent's console names its registry with --registry, over a
            # BATON_REGISTRY where nothing listens.
            named = ["--registry", address] if who == "agent" else []
            env = cli_env(address if not named else f"127.0.0.1:{free_port()}",
                          tuple(pki.environ(who).items()))
            console = subprocess.Popen([*base, "console", "--listen", listen, *named],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=env)
            procs.append(console)
            Lines(console).until(lambda line: line.startswith("console: http"), timeout=30)
            urls.append(f"http://{listen}")
        yield Stack(address, pki, urls[0], urls[1])
    finally:
        for proc in reversed(procs):
            _stop(proc)


@pytest.fixture(scope="module")
def browser(stack: Stack) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=require("chromium"),
                                     args=["--no-sandbox", "--headless"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    tab = context.new_page()
    tab.set_default_timeout(20_000)
    try:
        yield tab
    finally:
        context.close()


def shot(page: Any, tmp_path: Path, name: str) -> None:
    """The page as a PNG under the test's tmp dir, and a copy for the docs."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    DOCS_SHOTS.mkdir(exist_ok=True)
    shutil.copy(path, DOCS_SHOTS / path.name)


def create(stack: Stack, spec: dict[str, Any]) -> None:
    with stack.client() as c:
        c.operator.create_task(spec)


def entries(*names: str) -> list[dict[str, str]]:
    return [{"file_id": n, "path": f"{n}.txt"} for n in names]


#: the trace id of the doomed attempt (as a traced producer's claim carries it)
DOOMED_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def kill_entry(stack: Stack, task_id: str, file_id: str) -> None:
    """Claim the entry and fail it: with no retries left it is dead."""
    with stack.client() as c:
        session = c.open_session("doomed", ttl=30)
        claim = c.claim(task_id, file_id, session=session,
                        traceparent=f"00-{DOOMED_TRACE}-00f067aa0ba902b7-01")
        c.fail(task_id, file_id, claim.token, "disk full on the producer", session=session)
        session.close()
        assert c.operator.get_entry(task_id, file_id).state == pb.ENTRY_STATE_DEAD


def test_the_tasks_page_shows_a_task_advancing_live(stack: Stack, page: Any,
                                                    tmp_path: Path,
                                                    wait_for: Callable[..., None]) -> None:
    """Files put and consumed while the page is open change its progress cell and the
    task page's state counts, without a reload (server-sent events)."""
    names = [f"f{i}" for i in range(4)]
    create(stack, {"task_id": "live", "entries": entries(*names), "consumers": ["g"]})
    page.goto(f"{stack.operator_url}/tasks")
    row = page.locator('tr[data-task="live"]')
    assert row.locator('[data-field="progress"]').inner_text() == "0/4 (0%)"
    page.wait_for_selector("#live.on")  # the event stream is open
    page.evaluate("window.notReloaded = true")
    with stack.client() as c:
        session = c.open_session("pipe", ttl=30)
        for n in names[:2]:
            done = stack.baton("put", "live", n, "-", "--agent", "pipe", stdin=f"{n}\n")
            assert done.returncode == 0, done.stderr
        # the stack's watcher verifies what was put before a consumer gets it
        wait_for(lambda: c.operator.get_task("live").states["verified"] == 2, timeout=30,
                 what="the watcher to verify f0 and f1")
        for _ in range(2):
            lease = c.consume("live", "g", session=session)
            c.ack("live", lease.file_id, "g", lease.token, session=session)
        session.close()
    page.wait_for_function(
        """() => document.querySelector('tr[data-task="live"] [data-field="progress"]')
                 .textContent === '2/4 (50%)'""")
    assert page.evaluate("window.notReloaded") is True
    shot(page, tmp_path, "tasks")

    page.goto(f"{stack.operator_url}/tasks/live")
    page.wait_for_selector("#live.on")
    page.evaluate("window.notReloaded = true")
    assert page.locator('[data-state="pending"]').inner_text() == "2"
    done = stack.baton("put", "live", "f2", "-", "--agent", "pipe", stdin="f2\n")
    assert done.returncode == 0, done.stderr
    page.wait_for_function(
        "() => document.querySelector('[data-state=\"pending\"]').textContent === '1'")
    assert page.evaluate("window.notReloaded") is True
    assert page.locator("svg.chart").count() == 1  # the throughput chart
    shot(page, tmp_path, "task")


def test_a_dead_entry_is_requeued_from_the_page_with_a_reason(stack: Stack, page: Any,
                                                            tmp_path: Path) -> None:
    """The dead entry's row shows its error; Requeue shows the impact, asks a reason
    and evidence, and both land in the journal `baton log` prints."""
    create(stack, {"task_id": "dead", "entries": entries("a"), "max_retries": 0})
    kill_entry(stack, "dead", "a")
    page.goto(f"{stack.operator_url}/tasks/dead")
    dead = page.locator('#dead tr[data-entry="a"]')
    assert "disk full on the producer" in dead.inner_text()
    with stack.client() as c:
        (attempt,) = c.operator.explain("dead", "a").attempts
    tried = dead.locator("ol.attempts li").inner_text()
    assert f"operator on {socket.gethostname()}, token {attempt.token}" in tried
    assert "disk full on the producer" in tried
    dead.get_by_role("link", name="Requeue").click()
    assert "1 entry: a is dead" in page.locator("#impact").inner_text()
    shot(page, tmp_path, "action")
    page.fill("#reason", "the producer's disk was cleaned")
    page.fill("#evidence", "https://tickets.example/OPS-42")
    page.click("#confirm")
    assert page.locator("#outcome").inner_text() == "a is pending"
    with stack.client() as c:
        assert c.operator.get_entry("dead", "a").state == pb.ENTRY_STATE_PENDING
    log = stack.baton("log", "dead", "a", "-o", "json")
    assert log.returncode == 0, log.stderr
    requeued = [json.loads(line) for line in log.stdout.splitlines()
                if json.loads(line)["event"] == "requeued"]
    assert len(requeued) == 1
    assert requeued[0]["who"] == "operator"
    assert requeued[0]["reason"].startswith("the producer's disk was cleaned")
    assert requeued[0]["evidence"] == "https://tickets.example/OPS-42"
    table = stack.baton("log", "dead", "a")
    assert "OPS-42" in table.stdout
    page.goto(f"{stack.operator_url}/tasks/dead/entries/a")
    assert "OPS-42" in page.locator("#journal").inner_text()
    row = page.locator("#attempts tr").nth(1).inner_text()
    assert "doomed" in row and str(attempt.token) in row and socket.gethostname() in row
    assert page.locator("#explain").inner_text()
    assert page.locator("#trace").inner_text() == DOOMED_TRACE  # its last attempt's trace
    shot(page, tmp_path, "entry")


def test_one_consumer_group_is_handed_its_entries_again_from_the_page(
        stack: Stack, page: Any, tmp_path: Path, wait_for: Callable[..., None]) -> None:
    """Both groups consumed the entries; "Hand again" for g1 shows the impact, asks a
    reason and evidence, and g1 alone gets the entries back: g2 is not handed them,
    and the journal keeps who, why and the evidence."""
    create(stack, {"task_id": "replay", "entries": entries("a", "b"),
                   "consumers": ["g1", "g2"]})
    with stack.client() as c:
        for n in ("a", "b"):
            done = stack.baton("put", "replay", n, "-", "--agent", "pipe", stdin=f"{n}\n")
            assert done.returncode == 0, done.stderr
        wait_for(lambda: c.operator.get_task("replay").states["verified"] == 2, timeout=30,
                 what="the watcher to verify a and b")
        session = c.open_session("reader", ttl=30)
        for group in ("g1", "g2"):
            for _ in range(2):
                lease = c.consume("replay", group, session=session)
                c.ack("replay", lease.file_id, group, lease.token, session=session)
        assert c.operator.get_task("replay").states["consumed"] == 2
        page.goto(f"{stack.operator_url}/tasks/replay")
        page.locator('#groups tr[data-group="g1"]').get_by_role(
            "link", name="Hand again").click()
        impact = page.locator("#impact").inner_text()
        assert "the 2 entries g1 acked go back to it" in impact and "(g2)" in impact
        shot(page, tmp_path, "replay-group")
        page.fill("#reason", "g1's index was rebuilt")
        page.fill("#evidence", "https://tickets.example/OPS-77")
        page.click("#confirm")
        assert page.locator("#outcome").inner_text() == "2 entries handed to group g1 again"
        got = sorted(c.consume("replay", "g1", session=session).file_id for _ in range(2))
        assert got == ["a", "b"]
        with pytest.raises(errors.NothingToClaim):
            c.consume("replay", "g2", session=session)
        session.close()
    log = stack.baton("log", "replay", "a", "-o", "json")
    assert log.returncode == 0, log.stderr
    (requeued,) = [r for r in map(json.loads, log.stdout.splitlines())
                   if r["event"] == "requeued"]
    assert requeued["who"] == "operator" and requeued["reason"].startswith("g1's index")
    assert requeued["evidence"] == "https://tickets.example/OPS-77"


def test_a_session_is_revoked_from_the_page(stack: Stack, page: Any, tmp_path: Path) -> None:
    """Revoke shows the session's claims first; then its claim goes back and the
    journal says who, why and on what evidence."""
    create(stack, {"task_id": "held", "entries": entries("a", "b")})
    with stack.client() as c:
        session = c.open_session("stuck-agent", ttl=60, keepalive=False)
        c.claim("held", "a", session=session)
        b = c.claim("held", "b", session=session)
        c.checkpoint("held", "b", b.token, data=b"row 40", progress=0.4, session=session)
        sid = f"{session.session_id:x}"
        page.goto(f"{stack.operator_url}/sessions")
        row = page.locator(f'#sessions tr[data-session="{sid}"]')
        claims = row.inner_text()
        assert "held/a" in claims and "no checkpoint" in claims
        assert re.search(r"held/b token \d+ 40%, checkpointed \d+ s ago", claims), claims
        shot(page, tmp_path, "sessions")
        row.get_by_role("link", name="Revoke").click()
        assert "2 claims go back now" in page.locator("#impact").inner_text()
        page.fill("#reason", "agent hung for an hour")
        page.fill("#evidence", "stack dump in OPS-7")
        page.click("#confirm")
        assert "2 claims returned" in page.locator("#outcome").inner_text()
        assert c.operator.get_entry("held", "a").state == pb.ENTRY_STATE_PENDING
        assert all(a.session_id != session.session_id for a in c.operator.list_agents())
        revoked = [r for r in c.operator.journal("held", "a") if r.event == "revoked"]
        assert [(r.who, r.evidence) for r in revoked] == [("operator", "stack dump in OPS-7")]
    page.goto(f"{stack.operator_url}/watchers")
    assert page.locator("#watchers tr").count() >= 2
    shot(page, tmp_path, "watchers")


def _post(url: str, form: dict[str, str],
          headers: dict[str, str] | None = None) -> tuple[int, str]:
    data = urllib.parse.urlencode(form).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_an_action_without_a_reason_is_refused_by_the_server(stack: Stack) -> None:
    """A POST without a reason (or without evidence), or from another site, changes
    nothing: the browser's `required` is not what refuses it."""
    create(stack, {"task_id": "noreason", "entries": entries("a")})
    url = f"{stack.operator_url}/act/pause"
    for form in ({"task_id": "noreason"}, {"task_id": "noreason", "reason": "  "},
                 {"task_id": "noreason", "reason": "why", "evidence": ""}):
        status, body = _post(url, form)
        assert status == 400 and "Refused" in body, (form, status)
    # another site's page posting through the operator's browser is refused too
    full = {"task_id": "noreason", "reason": "maintenance", "evidence": "change CH-1"}
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        status, body = _post(url, full, headers)
        assert status == 403 and "only from the console" in body, headers
    with stack.client() as c:
        assert c.operator.get_task("noreason").status == pb.TASK_STATUS_ACTIVE
    status, body = _post(url, full, {"Origin": stack.operator_url})
    assert status == 200 and "is paused" in body
    with stack.client() as c:
        task = c.operator.get_task("noreason")
        assert task.status == pb.TASK_STATUS_PAUSED
        assert task.status_reason == "pause: maintenance (evidence: change CH-1)"


def test_an_identity_without_the_operator_role_reads_only_and_has_no_buttons(
        stack: Stack, page: Any, tmp_path: Path) -> None:
    """The agent's console lists the tasks its rules let it read, offers no action,
    and its actions are refused by the console; the registry refuses its session list."""
    create(stack, {"task_id": "open-task", "entries": entries("a"), "max_retries": 0})
    create(stack, {"task_id": "private", "entries": entries("a"),
                   "access": {"producers": ["someone-else"],
                              "groups": [{"group": "default",
                                          "consumers": ["someone-else"]}]}})
    kill_entry(stack, "open-task", "a")
    page.goto(f"{stack.reader_url}/tasks")
    listed = page.locator("#tasks tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.task)")
    assert "open-task" in listed and "private" not in listed
    assert "read only" in page.locator("#me").inner_text()
    page.goto(f"{stack.reader_url}/tasks/open-task")
    assert page.locator('#dead tr[data-entry="a"]').count() == 1
    assert page.locator(".actions, a.button, button").count() == 0
    shot(page, tmp_path, "read-only")
    page.goto(f"{stack.reader_url}/sessions")
    assert "ListAgents" in page.locator(".refused").inner_text()
    status, _ = _post(f"{stack.reader_url}/act/requeue",
                      {"task_id": "open-task", "file_id": "a", "reason": "r", "evidence": "e"})
    assert status == 403
    with stack.client() as c:
        assert c.operator.get_entry("open-task", "a").state == pb.ENTRY_STATE_DEAD
