"""``--metrics`` of the two daemons as processes (``baton-registry``, ``baton-watcher``): both
serve /metrics, and a bad address ends either at start with the same one-line error."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import RegistryHandle, allow_suite_etcd
from test_metrics import scrape
from watcher_fixtures import make_task, put_bytes

from baton_relay.client import Client, Session
from baton_relay.watcher.__main__ import READY

BIN = Path(sys.executable).parent
#: the line each daemon logs once its endpoint is up (``--log-format kv``)
SERVING = re.compile(r'msg="serving metrics" url=http://127\.0\.0\.1:(\d+)/metrics')
#: a documentation address (TEST-NET-1, RFC 5737): no machine of a test run has it
NOT_LOCAL = "192.0.2.1"
FORM = "expected HOST:PORT (an IPv6 host in brackets; port 0 = pick one)"

Wait = Callable[..., None]


class Daemon:
    """A daemon's entry point run from the virtualenv's bin; stderr (its log) to a file."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log,
                                         stdin=subprocess.DEVNULL, text=True)

    def ready_line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics_port(self) -> int:
        """The port the daemon logged (it binds before it says it is ready)."""
        m = SERVING.search(self.log())
        assert m, f"no 'serving metrics' line in the log:\n{self.log()}"
        return int(m.group(1))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture
def daemons() -> Iterator[Callable[[list[str], Path], Daemon]]:
    started: list[Daemon] = []

    def start(argv: list[str], log_path: Path) -> Daemon:
        d = Daemon(argv, log_path)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
        d.proc.wait()


def registry_argv(etcd: Any, prefix: str, staging: Path, metrics: str) -> list[str]:
    return [str(BIN / "baton-registry"), "--insecure", "--etcd", etcd.endpoint,
            *allow_suite_etcd(), "--listen", "127.0.0.1:0", "--staging", str(staging),
            "--prefix", prefix, "--log-format", "kv", "--metrics", metrics]


def watcher_argv(registry: str, staging: Path, metrics: str) -> list[str]:
    return [str(BIN / "baton-watcher"), "--registry", registry, "--staging", str(staging),
            "--retry-delay", "0.05", "--log-format", "kv", "--metrics", metrics]


def test_registry_process_serves_metrics(
    etcd: Any, prefix: str, staging: Path, tmp_path: Path,
    daemons: Callable[[list[str], Path], Daemon], wait_for: Wait,
) -> None:
    """baton-registry --metrics 127.0.0.1:0 serves /metrics: its calls and the levels it
    reads on its event loop (a task created shows in baton_tasks); SIGTERM exits 0."""
    registry = daemons(registry_argv(etcd, prefix, staging, "127.0.0.1:0"),
                       tmp_path / "registry.log")
    line = registry.ready_line()
    assert line.startswith("baton-registry listening on "), registry.log()
    port = registry.metrics_port()
    with Client(line.split()[-1]) as client:
        make_task(client, "t1", {"a": "a.bin"})
    wait_for(lambda: scrape(port).value("baton_tasks", status="active") == 1,
             what="the task counted")
    s = scrape(port)
    assert s.value("baton_grpc_calls_total", method="CreateTask", code="OK") == 1
    assert s.value("baton_view_ready") == 1
    assert registry.stop() == 0, registry.log()


def test_watcher_process_serves_metrics(
    registry: RegistryHandle, client: Client, session: Session, staging: Path,
    tmp_path: Path, daemons: Callable[[list[str], Path], Daemon], wait_for: Wait,
) -> None:
    """baton-watcher --metrics 127.0.0.1:0 on a real directory serves /metrics: a file
    landed shows as hashed; SIGTERM exits 0."""
    watcher = daemons(watcher_argv(registry.address, staging, "127.0.0.1:0"),
                      tmp_path / "watcher.log")
    assert watcher.ready_line().startswith(READY), watcher.log()
    port = watcher.metrics_port()
    assert scrape(port).value("baton_watcher_reconciliations_total") >= 1
    make_task(client, "t1", {"a": "a.bin"})
    put_bytes(client, session, "t1", "a", b"bytes for the metrics")
    wait_for(lambda: scrape(port).value("baton_watcher_files_hashed_total") == 1,
             what="the file counted as hashed")
    assert scrape(port).value("baton_watcher_hashed_bytes_total") == 21
    assert watcher.stop() == 0, watcher.log()


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def refused(prog: str, address: str, etcd: Any, prefix: str, registry: RegistryHandle,
            staging: Path) -> list[str]:
    """``prog --metrics ADDRESS`` (on the test's etcd, or its registry) run to its end:
    the lines it wrote to stderr, once it has exited 1 writing nothing on stdout."""
    argv = (registry_argv(etcd, prefix, staging, address) if prog == "baton-registry"
            else watcher_argv(registry.address, staging, address))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert (done.returncode, done.stdout) == (1, ""), (prog, done)
    return done.stderr.splitlines()


@pytest.mark.parametrize("case", ["in use", "not HOST:PORT", "out of range", "not local"])
def test_a_bad_address_ends_both_daemons_with_one_line(
    case: str, busy_port: int, etcd: Any, prefix: str, registry: RegistryHandle,
    staging: Path,
) -> None:
    """Given a --metrics address it cannot serve, each daemon exits 1 at start, its only
    output one line naming the setting, the address and the reason: the same line."""
    address, reason = {
        "in use": (f"127.0.0.1:{busy_port}", "cannot listen: address already in use"),
        "not HOST:PORT": ("localhost", FORM),
        "out of range": ("127.0.0.1:65536", "port 65536 is out of range (0-65535)"),
        "not local": (f"{NOT_LOCAL}:9390",
                      "cannot listen: the host is not an address of this machine"),
    }[case]
    for prog in ("baton-registry", "baton-watcher"):
        assert refused(prog, address, etcd, prefix, registry, staging) == [
            f"{prog}: --metrics {address}: {reason}"], prog


def test_the_documented_errors_are_what_the_daemons_print(
    etcd: Any, prefix: str, registry: RegistryHandle, staging: Path,
) -> None:
    """Each line of docs/operations.md's block of --metrics errors is what that daemon
    prints given that address (its port held by another socket for "in use")."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    (block,) = re.findall(r"^```\n(baton-registry: --metrics .*?)^```", doc, re.S | re.M)
    lines = block.splitlines()
    assert len(lines) >= 4
    for line in lines:
        m = re.fullmatch(r"(baton-registry|baton-watcher): --metrics (\S+): (.*)", line)
        assert m, line
        prog, address, reason = m.groups()
        with socket.socket() as holder:
            if "in use" in reason:
                host, _, port = address.rpartition(":")
                try:
                    holder.bind((host, int(port)))
                    holder.listen()
                except OSError:  # another process holds it: in use all the same
                    pass
            assert refused(prog, address, etcd, prefix, registry, staging) == [line]


def test_an_endpoint_whose_serving_loop_is_stuck_still_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon stops even when its /metrics server's loop never comes back (here held
    inside a request's acceptance): ``close`` gives up within its bound, says the
    thread did not end, and the port is free again."""
    import logging
    import threading
    import time

    from prometheus_client import CollectorRegistry

    from baton_relay.kernel import metrics_endpoint

    monkeypatch.setattr(metrics_endpoint, "CLOSE_TIMEOUT", 0.5)
    endpoint = metrics_endpoint.serve_metrics("127.0.0.1:0", CollectorRegistry(),
                                              logging.getLogger("test"))
    held, release = threading.Event(), threading.Event()

    def stuck(request: Any, address: Any) -> bool:
        held.set()
        release.wait(30)
        return False

    monkeypatch.setattr(endpoint._server, "verify_request", stuck)
    port = endpoint.port
    with socket.create_connection(("127.0.0.1", port)):
        assert held.wait(10), "the serving loop never took the connection"
        started = time.monotonic()
        try:
            assert endpoint.close() is False
            assert time.monotonic() - started < 5 * metrics_endpoint.CLOSE_TIMEOUT
        finally:
            release.set()
    with socket.socket() as again:  # the listener is gone (Linux refuses a second one)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen()
