"""``baton up``: a private etcd plus the Baton daemons, supervised in the foreground.

The stack is etcd first, then every :class:`ChildSpec` that :func:`child_specs`
returns, in order: the registry, then the watchers on the staging directory (so a
file put into the stack is verified with no other step; one by default, several
sharing the tasks' shards with ``--watchers N``). Each is started only once
the previous one is ready, and they are stopped in reverse. The registry and each
watcher serve Prometheus metrics on 127.0.0.1, on ports chosen when the stack starts (or given in
:class:`UpOptions`); the summary prints their ``/metrics`` addresses.
A process that dies on its own is started again after a backoff, and the console
says so (``local.supervisor``); only one that keeps crashing (5 times within 60 s)
stops the stack, and ``run_up`` returns 1.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

from ..kernel.contract import LOCAL_ETCD_PORT, REGISTRY_PORT, REGISTRY_SERVICE
from ..kernel.errors import BatonError
from ..registry.store.etcd_versions import parse_version, warning_lines
from .etcdproc import (
    BANNER_PREFIX,
    DaemonFailed,
    EtcdChoice,
    EtcdProcess,
    EtcdTLS,
    StartCancelled,
    choose_etcd,
    free_port,
    port_in_use,
    terminate,
    wait_ready,
    write_banner,
)
from .supervisor import RestartPolicy, Supervisor

__all__ = [
    "ChildSpec",
    "ExtraNotInstalled",
    "LocalPKI",
    "RestartPolicy",
    "StackAlreadyRunning",
    "UpOptions",
    "child_specs",
    "default_data_dir",
    "default_staging",
    "grpc_health_probe",
    "log_line_probe",
    "run_up",
]

READY_TIMEOUT = 30.0
#: the most watchers one stack runs: more only compete for the same disk and cores
MAX_WATCHERS = 16
#: the line ``python -m baton_relay.watcher`` prints once it watches the staging directory
WATCHER_READY = "baton-watcher watching"
STOP_TIMEOUT = 10.0


class ExtraNotInstalled(BatonError):
    """A server-side dependency is missing; ``extra`` names the pip extra providing it."""

    extra: str


#: the private etcd keeps a minute of history (periodic compaction), so deleted and
#: rewritten keys free their space; docs/operations.md, "Compaction: what the
#: retention costs" (an hour of history at a busy pace nears etcd's quota). Idle watches
#: are told their revision every 10 s (not etcd's default 10 minutes), well within
#: that minute: an idle task's Watch stream resumes without a snapshot (docs/watcher.md)
ETCD_UPKEEP = ("--auto-compaction-mode=periodic", "--auto-compaction-retention=1m",
               "--experimental-watch-progress-notify-interval=10s")


class StackAlreadyRunning(BatonError):
    """Another ``baton up`` holds the data directory ``data_dir`` (its pid is ``pid``)."""

    data_dir: str
    pid: str


@dataclass(frozen=True)
class UpOptions:
    """What ``baton up`` runs and where; see :func:`default_data_dir`, :func:`default_staging`."""

    data_dir: Path
    staging: Path
    etcd_port: int = LOCAL_ETCD_PORT
    registry_port: int = REGISTRY_PORT
    prefix: str = "/baton/v1/"
    #: plaintext everywhere and no identities (the stack of earlier versions)
    insecure: bool = False
    #: watcher processes over the staging root (they share its tasks' shards)
    watchers: int = 1
    #: where the registry and each watcher serve Prometheus metrics, on 127.0.0.1
    #: (0, or no port for a watcher: a free port, chosen once when the stack starts
    #: and kept across restarts)
    registry_metrics_port: int = 0
    watcher_metrics_ports: tuple[int, ...] = ()
    #: the registry's archive settings, (name, value) as ``baton-registry`` takes them
    #: (``("archive_s3_bucket", "b")`` is ``--archive-s3-bucket b``); with neither
    #: ``archive_dir`` nor ``archive_s3_bucket``, it archives to ``DATA_DIR/archive``
    archive: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.watchers <= MAX_WATCHERS:
            raise ValueError(f"watchers {self.watchers} not within 1..{MAX_WATCHERS}")

    def archive_flags(self) -> tuple[str, ...]:
        """The registry's archive flags: ``archive`` as given, and the default store."""
        given = dict(self.archive)
        flags: tuple[str, ...] = ()
        if not given.get("archive_dir") and not given.get("archive_s3_bucket"):
            flags = ("--archive-dir", str(self.data_dir / "archive"))
        for name, value in self.archive:
            flags += ("--" + name.replace("_", "-"), value)
        return flags


@dataclass(frozen=True)
class LocalPKI:
    """The certificates ``baton up`` keeps in ``DATA_DIR/pki`` (``kernel.pki.local_pki``)."""

    root: Path

    def cert(self, name: str) -> str:
        return str(self.root / f"{name}.crt")

    def key(self, name: str) -> str:
        return str(self.root / f"{name}.key")

    @property
    def ca(self) -> str:
        return str(self.root / "ca.crt")

    def client_flags(self, name: str, prefix: str = "") -> tuple[str, ...]:
        """``--ca/--cert/--key`` (with ``prefix``: ``--PREFIX-ca`` ...) for identity ``name``."""
        dash = f"--{prefix}-" if prefix else "--"
        return (f"{dash}ca", self.ca, f"{dash}cert", self.cert(name), f"{dash}key",
                self.key(name))

    def environ(self, name: str = "operator") -> dict[str, str]:
        return {"BATON_CA": self.ca, "BATON_CERT": self.cert(name),
                "BATON_KEY": self.key(name)}


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_DATA_HOME/baton``, else ``~/.local/share/baton``."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_DATA_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "baton"
    return Path.home() / ".local" / "share" / "baton"


def default_staging(data_dir: Path) -> Path:
    return data_dir / "staging"


# --- the daemons beside etcd ------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    """One daemon of the stack: how to run it and how to tell it is ready."""

    name: str
    argv: tuple[str, ...]
    log_path: Path
    #: returns True once the daemon serves; polled every 50 ms while it starts
    ready: Callable[[], bool]
    #: where it listens, for the summary printed once the stack is up
    address: str
    #: the rest of its summary line, e.g. "staging: /srv/baton/staging"
    details: str = ""
    #: where it serves Prometheus metrics ("": it does not)
    metrics: str = ""


def child_specs(opts: UpOptions, etcd_endpoint: str,
                pki: LocalPKI | None = None, allow_etcd_version: str = "") -> list[ChildSpec]:
    """The daemons run after etcd, in start order (stopped in reverse).

    The watchers come after the registry they report to. With ``pki`` the registry
    serves mutual TLS, reaches etcd over TLS with its client certificate, and the
    watchers present the watcher identity; without, all is plaintext.
    ``allow_etcd_version`` is the affected etcd release the stack runs (after
    ``run_up`` warned about it), which the registry would refuse otherwise.
    """
    registry_address = f"127.0.0.1:{opts.registry_port}"
    registry_metrics = f"127.0.0.1:{opts.registry_metrics_port}"
    registry_log = opts.data_dir / "registry.log"
    registry_tls: tuple[str, ...] = ("--insecure",)
    watcher_tls: tuple[str, ...] = ()
    if pki is not None:
        registry_tls = (
            "--tls-ca", pki.ca, "--tls-cert", pki.cert("registry"),
            "--tls-key", pki.key("registry"),
            *pki.client_flags("etcd-client", prefix="etcd"),
        )  # fmt: skip
        watcher_tls = pki.client_flags("watcher")
    registry_argv = (
        sys.executable,
        "-u",  # unbuffered, so registry.log is current when we quote its tail
        "-m", "baton_relay.registry",
        "--etcd", etcd_endpoint,
        "--listen", registry_address,
        "--staging", str(opts.staging),
        "--prefix", opts.prefix,
        *opts.archive_flags(),
        *registry_tls,
        "--metrics", registry_metrics,
        *(("--allow-etcd-version", allow_etcd_version) if allow_etcd_version else ()),
    )  # fmt: skip
    registry = ChildSpec(
        name="registry",
        argv=registry_argv,
        log_path=registry_log,
        ready=grpc_health_probe(registry_address, pki=pki),
        address=registry_address,
        details=f"staging: {opts.staging}, log: {registry_log}",
        metrics=f"http://{registry_metrics}/metrics",
    )
    return [registry, *(watcher_spec(opts, n, registry_address, watcher_tls)
                        for n in range(1, opts.watchers + 1))]


def watcher_spec(opts: UpOptions, n: int, registry_address: str,
                 tls: tuple[str, ...]) -> ChildSpec:
    """The ``n``-th watcher (from 1). A lone one is ``watcher`` with the files it always
    had; of several, each is ``watcher-N`` with its own log, state file, metrics port
    and name in reports, so they can be told apart (the registry tells them apart by
    the id each registers with)."""
    name = "watcher" if opts.watchers == 1 else f"watcher-{n}"
    ports = opts.watcher_metrics_ports
    metrics = f"127.0.0.1:{ports[n - 1] if n <= len(ports) else 0}"
    log_path = opts.data_dir / f"{name}.log"
    reporter = () if opts.watchers == 1 else ("--reporter", f"{name}@{socket.gethostname()}")
    argv = (
        sys.executable,
        "-u",
        "-m", "baton_relay.watcher",
        "--registry", registry_address,
        "--staging", str(opts.staging),
        "--state-file", str(opts.data_dir / f"{name}-state.sqlite"),
        *reporter,
        *tls,
        "--metrics", metrics,
    )  # fmt: skip
    return ChildSpec(
        name=name,
        argv=argv,
        log_path=log_path,
        ready=log_line_probe(log_path, WATCHER_READY),
        address=str(opts.staging),
        details=f"reports to {registry_address}, log: {log_path}",
        metrics=f"http://{metrics}/metrics",
    )


def _distinct_ports(opts: UpOptions) -> list[int]:
    """The ports ``opts`` names (0: any free one); DaemonFailed if one is named twice,
    since two daemons cannot listen on it (and a probe could ask the wrong one)."""
    named = [(opts.etcd_port, "etcd", "--etcd-port"),
             (opts.registry_port, "registry", "--registry-port"),
             (opts.registry_metrics_port, "registry", "the registry's metrics port"),
             *((port, "watcher", "a watcher's metrics port")
               for port in opts.watcher_metrics_ports)]
    seen: dict[int, str] = {}
    for port, daemon, what in named:
        if not port:
            continue
        if port in seen:
            raise DaemonFailed(f"port {port} is given twice ({seen[port]} and {what}); "
                               "each daemon needs a port of its own", daemon=daemon)
        seen[port] = what
    return list(seen)


def log_line_probe(log_path: Path, text: str) -> Callable[[], bool]:
    """A probe that is True once a line starting with ``text`` follows the log's last banner.

    The log is appended to across runs; only the current run (after the banner
    written at its start) counts. Reads only what was appended since the last call.
    """
    offset, tail = -1, ""

    def probe() -> bool:
        nonlocal offset, tail
        try:
            with log_path.open("r", encoding="utf-8", errors="replace") as f:
                if offset < 0:
                    whole = f.read()
                    chunk = whole[max(whole.rfind(BANNER_PREFIX), 0) :]
                else:
                    f.seek(offset)
                    chunk = tail + f.read()
                offset = f.tell()
        except FileNotFoundError:
            return False
        lines = chunk.split("\n")
        tail = lines.pop()  # an unfinished last line is read again next time
        return any(line.startswith(text) for line in lines)

    return probe


def _health_modules() -> tuple[Any, Any]:
    """``grpc_health.v1.health_pb2`` and ``health_pb2_grpc``, imported on first need."""
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError as e:
        raise ExtraNotInstalled(
            "`baton up` needs the registry's dependencies (grpcio-health-checking, ...); "
            "install them with: pip install 'baton-relay[local]'",
            extra="local",
        ) from e
    return health_pb2, health_pb2_grpc


def grpc_health_probe(target: str, service: str = REGISTRY_SERVICE,
                      pki: LocalPKI | None = None) -> Callable[[], bool]:
    """A probe that is True when ``target``'s gRPC health service says ``service`` (by
    default a Baton registry's) is SERVING (over mutual TLS as the operator identity of
    ``pki``, when given). Not the server as a whole (""): any gRPC server answers for
    that, etcd among them, which a port mix-up could put where a registry should be."""
    health_pb2, health_pb2_grpc = _health_modules()
    request = health_pb2.HealthCheckRequest(service=service)
    serving = health_pb2.HealthCheckResponse.SERVING
    def channel_credentials() -> grpc.ChannelCredentials | None:
        if pki is None:
            return None
        return grpc.ssl_channel_credentials(
            Path(pki.ca).read_bytes(), Path(pki.key("operator")).read_bytes(),
            Path(pki.cert("operator")).read_bytes())

    def probe() -> bool:
        credentials = channel_credentials()
        # A fresh channel per attempt: a reused one would back off for up to seconds
        # after the first refused connection, delaying "ready" long after it is true.
        # No proxy: an http_proxy setting must not intercept a loopback call.
        options = [("grpc.enable_http_proxy", 0)]
        channel = (grpc.secure_channel(target, credentials, options=options) if credentials
                   else grpc.insecure_channel(target, options=options))
        with channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=1.0)
            except grpc.RpcError:
                return False
        return bool(reply.status == serving)

    return probe


class _Child:
    """A started :class:`ChildSpec` (a ``local.supervisor.Daemon``)."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> Path:
        return self.spec.log_path

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, timeout: float, cancel: threading.Event) -> None:
        argv = list(self.spec.argv)
        write_banner(self.spec.log_path, argv)
        with self.spec.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own session: Ctrl-C in the terminal reaches only run_up, which stops
                # the stack in order.
                start_new_session=True,
            )
        wait_ready(
            self.spec.ready,
            self.process,
            daemon=self.spec.name,
            log_path=self.spec.log_path,
            timeout=timeout,
            cancel=cancel,
        )

    def returncode(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process, STOP_TIMEOUT)


class _Etcd:
    """The stack's etcd as a ``local.supervisor.Daemon``."""

    name = "etcd"

    def __init__(self, etcd: EtcdProcess) -> None:
        self.etcd = etcd

    @property
    def log_path(self) -> Path:
        return self.etcd.log_path

    @property
    def pid(self) -> int | None:
        return self.etcd.pid

    def returncode(self) -> int | None:
        return self.etcd.returncode

    def start(self, timeout: float, cancel: threading.Event) -> None:
        self.etcd.start(timeout, cancel=cancel)

    def stop(self) -> None:
        self.etcd.stop(STOP_TIMEOUT)


# --- run_up -----------------------------------------------------------------------


@contextmanager
def _exclusive(data_dir: Path) -> Iterator[None]:
    """Hold a lock on ``data_dir`` so two stacks never share one etcd data dir."""
    with (data_dir / "up.lock").open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            raise StackAlreadyRunning(
                f"another `baton up` (pid {holder}) is using {data_dir}",
                data_dir=str(data_dir),
                pid=holder,
            ) from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        try:
            yield
        finally:
            lock.truncate(0)
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Turn SIGINT/SIGTERM into ``stop.set()`` for the duration (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed there; the caller sets ``stop``
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _check_installed() -> None:
    _health_modules()
    missing = [m for m in ("inotify_simple", "watchdog") if importlib.util.find_spec(m) is None]
    if missing:
        raise ExtraNotInstalled(
            f"`baton up` runs a watcher, which needs {', '.join(missing)}; install it "
            "with: pip install 'baton-relay[local]'",
            extra="local",
        )
    # the registry's own dependencies (this module is part of it, so it is there)
    if importlib.util.find_spec("aetcd") is None:
        raise ExtraNotInstalled(
            "the registry's dependencies are not installed; install Baton with its server "
            "side: pip install 'baton-relay[local]'",
            extra="local",
        )


def run_up(
    opts: UpOptions,
    out: Callable[[str], None] = print,
    *,
    stop: threading.Event | None = None,
    ready_timeout: float = READY_TIMEOUT,
    restart: RestartPolicy | None = None,
) -> int:
    """Run the stack until SIGINT/SIGTERM (or ``stop`` is set); the exit status.

    A daemon that dies on its own is restarted as ``restart`` says. Returns 0 after
    a requested stop, 1 if a daemon kept crashing (its log tail is printed). Raises
    :class:`DaemonFailed`, :class:`ExtraNotInstalled` or :class:`StackAlreadyRunning`
    when the stack cannot start; whatever had started is stopped first.
    """
    stop = stop if stop is not None else threading.Event()
    given = _distinct_ports(opts)
    taken = set(given)

    def chosen(port: int) -> int:
        """``port``, or a free one none of the others uses (0)."""
        if not port:
            port = free_port(avoid=taken)
            taken.add(port)
        return port

    opts = dataclasses.replace(
        opts,
        data_dir=opts.data_dir.expanduser().absolute(),
        staging=opts.staging.expanduser().absolute(),
        # Chosen once: a daemon restarted by the supervisor serves where it did.
        registry_metrics_port=chosen(opts.registry_metrics_port),
        watcher_metrics_ports=tuple(
            chosen(port) for port in
            (*opts.watcher_metrics_ports, *[0] * opts.watchers)[:opts.watchers]),
    )
    etcd_peer_port = chosen(0)
    _check_installed()
    ports = [(opts.etcd_port, "etcd"), (opts.registry_port, "registry"),
             (opts.registry_metrics_port, "registry"),
             *((port, "watcher") for port in opts.watcher_metrics_ports)]
    for port, daemon in ports:
        if port and port_in_use(port):
            raise DaemonFailed(
                f"127.0.0.1:{port} is already in use (another `baton up`?); "
                "free it or choose another port",
                daemon=daemon,
            )
    etcd_choice = _choose_etcd(opts.data_dir, _written_by(opts.data_dir), out)
    opts.data_dir.mkdir(parents=True, exist_ok=True)
    opts.staging.mkdir(parents=True, exist_ok=True)

    with _exclusive(opts.data_dir), _stop_on_signals(stop):
        pki = None if opts.insecure else _local_pki(opts.data_dir / "pki")

        def etcd_process(binary: str) -> EtcdProcess:
            return EtcdProcess(
                opts.data_dir / "etcd",
                client_port=opts.etcd_port,
                peer_port=etcd_peer_port,
                log_path=opts.data_dir / "etcd.log",
                binary=binary,
                extra_args=ETCD_UPKEEP,
                tls=None if pki is None else EtcdTLS(
                    cert=Path(pki.cert("etcd")), key=Path(pki.key("etcd")), ca=Path(pki.ca),
                    client_cert=Path(pki.cert("etcd-client")),
                    client_key=Path(pki.key("etcd-client"))),
            )

        etcd = etcd_process(etcd_choice.binary)
        children: list[_Child] = []
        failure: str | None = None
        try:
            try:
                etcd.start(ready_timeout, cancel=stop)
            except DaemonFailed as e:
                # A data directory of an earlier stack, written by a later etcd than the
                # one chosen now (before its release was recorded): choose again.
                match = _DOWNGRADE.search(e.log_tail)
                if match is None:
                    raise
                written = (int(match.group(1)), int(match.group(2)))
                etcd_choice = _choose_etcd(opts.data_dir, written, out)
                etcd = etcd_process(etcd_choice.binary)
                etcd.start(ready_timeout, cancel=stop)
            _record_release(opts.data_dir, etcd_choice.version)
            allow = etcd_choice.version if etcd_choice.affected else ""
            for spec in child_specs(opts, etcd.endpoint, pki, allow):
                child = _Child(spec)
                children.append(child)  # before start: a failed start is cleaned up too
                child.start(ready_timeout, stop)
            _print_summary(out, etcd_choice.version, etcd, children, pki, opts.data_dir)
            supervisor = Supervisor([_Etcd(etcd), *children], out, restart,
                                    ready_timeout=ready_timeout)
            failure = supervisor.run(stop)
        except StartCancelled:
            pass
        finally:
            _stop_all(etcd, children)
    if failure is not None:
        out(f"error: {failure}")
    out("stopped")
    return 0 if failure is None else 1


#: what etcd logs when it cannot open data a later release wrote
_DOWNGRADE = re.compile(
    r'invalid downgrade.*"determined-cluster-version":"(\d+)\.(\d+)')
#: DATA_DIR's record of the etcd release that last ran on its data
_RELEASE_FILE = "etcd-release"


def _written_by(data_dir: Path) -> tuple[int, int]:
    """(major, minor) of the etcd that last ran on ``DATA_DIR/etcd``; (0, 0) if unknown."""
    if not (data_dir / "etcd").exists():
        return (0, 0)
    try:
        parsed = parse_version((data_dir / _RELEASE_FILE).read_text())
    except OSError:
        return (0, 0)
    return (0, 0) if parsed is None else parsed[:2]


def _record_release(data_dir: Path, version: str) -> None:
    (data_dir / _RELEASE_FILE).write_text(f"{version}\n")


def _choose_etcd(data_dir: Path, written: tuple[int, int],
                 out: Callable[[str], None]) -> EtcdChoice:
    """The etcd to run on ``data_dir`` (at least the release ``written`` that wrote its
    data), saying first when it has known bugs."""
    choice = choose_etcd(at_least=written)
    if choice.affected:
        for line in warning_lines(choice.binary, choice.version):
            out(line)
        if written > (0, 0):
            out(f"WARNING: (its data in {data_dir / 'etcd'} was written by etcd "
                f"{written[0]}.{written[1]}, which an earlier release cannot open: move it "
                "away to start afresh on another etcd)")
    return choice


def _local_pki(root: Path) -> LocalPKI:
    """The stack's certificates, made on first start and kept."""
    try:
        from ..kernel import pki
    except ImportError as e:  # pragma: no cover - kernel.pki itself imports nothing extra
        raise ExtraNotInstalled(str(e), extra="pki") from e
    if importlib.util.find_spec("cryptography") is None:
        raise ExtraNotInstalled(
            "`baton up` makes certificates for its stack, which needs the 'cryptography' "
            "package: pip install 'baton-relay[pki]' (or run `baton up --insecure`)", extra="pki")
    pki.local_pki(root)
    return LocalPKI(root)


def _print_summary(out: Callable[[str], None], version: str, etcd: EtcdProcess,
                   children: list[_Child], pki: LocalPKI | None, data_dir: Path) -> None:
    tls = "TLS, client certificates" if pki is not None else "plaintext"
    out(
        f"{'etcd':<9} {etcd.endpoint}  "
        f"(etcd {version}, {tls}, data: {etcd.data_dir}, log: {etcd.log_path})"
    )
    exports: dict[str, str] = {}
    for child in children:
        out(f"{child.spec.name:<9} {child.spec.address}  ({child.spec.details})")
        if child.spec.name == "registry":
            exports["BATON_REGISTRY"] = child.spec.address
    for child in children:
        if child.spec.metrics:
            out(f"{'metrics':<9} {child.spec.metrics}  ({child.spec.name})")
    if pki is not None:
        exports.update(pki.environ("operator"))
    lines = [f"export {name}={value}" for name, value in exports.items()]
    for line in lines:
        out(line)
    env_file = data_dir / "env"
    env_file.write_text("".join(f"{line}\n" for line in lines))
    if pki is not None:
        out(f"(the operator identity; the same lines are in {env_file}; "
            f"more identities: baton cert issue --pki {pki.root})")
    out("web console, with those variables set: baton console  (http://127.0.0.1:8470/; "
        "pip install 'baton-relay[console]')")
    out("ready; press Ctrl-C to stop")


def _stop_all(etcd: EtcdProcess, children: list[_Child]) -> None:
    """Stop the daemons in reverse start order, etcd last (they need it to drain)."""
    for child in reversed(children):
        child.stop()
    etcd.stop(STOP_TIMEOUT)
