"""What every scenario shares: the daemons, statistics, the machine.

* :class:`Stack` runs a private etcd (:class:`local.etcdproc.EtcdProcess`), registry
  processes and a watcher on 127.0.0.1 and stops them all when it closes, also
  after Ctrl-C or SIGTERM (``python -m bench`` turns SIGTERM into KeyboardInterrupt).
* Percentiles, ``VmRSS`` of a process, etcd's request counters, how busy the CPUs are.

The agents' processes are in :mod:`bench.pool`.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self, TypeVar

from baton_relay.kernel import pki
from baton_relay.local.etcdproc import (
    EtcdProcess,
    EtcdTLS,
    etcd_version,
    find_etcd,
    terminate,
    wait_ready,
)

if TYPE_CHECKING:
    from baton_relay.registry.store.etcd import Etcd

T = TypeVar("T")

#: the line ``python -m baton_relay.registry`` prints once it serves
REGISTRY_READY = "baton-registry listening on "
#: the line ``python -m baton_relay.watcher`` prints once it watches
WATCHER_READY = "baton-watcher watching"
START_TIMEOUT = 60.0
#: the checkout the bench runs from (earlier revisions are checked out beside it)
REPO = Path(__file__).resolve().parents[1]

class BenchError(RuntimeError):
    """A scenario could not be measured (a daemon or an agent failed)."""


#: set by ``python -m bench``'s SIGINT/SIGTERM handler. The KeyboardInterrupt it raises
#: can land in a finalizer, where Python prints and drops it; long waits check this too.
INTERRUPTED = threading.Event()


def check_interrupted() -> None:
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt("interrupted")


def die_with_parent() -> None:
    """Have the kernel SIGTERM this process when its parent dies (Linux; else a no-op)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def etcd_binary() -> str:
    """The etcd to run: ``$BATON_BENCH_ETCD`` if set, else the one ``baton up`` would use."""
    return os.environ.get("BATON_BENCH_ETCD") or find_etcd()


# --- daemons ------------------------------------------------------------------------


@dataclass
class Daemon:
    """A registry or watcher process started by :class:`Stack`."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""
    #: (ca, cert, key) of an identity the registry accepts; empty: it serves plaintext
    credentials: tuple[str, str, str] = ("", "", "")

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the process has used so far, all its threads."""
        return cpu_seconds(self.pid)


def _line_in(path: Path, prefix: str) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    return next((line for line in text.splitlines() if line.startswith(prefix)), None)


class Stack:
    """A private etcd plus registry/watcher processes, all on 127.0.0.1, in ``root``.

    With ``etcd_tls`` etcd serves TLS with client certificates (from ``kernel.pki``, in
    ``root/pki``) and the registries connect to it with theirs. With ``registry_tls``
    the registries serve mutual TLS too, as ``baton up`` runs them (``etcd_tls``
    implied), and their ``credentials`` are the operator identity's.
    """

    def __init__(self, root: Path, *, etcd_tls: bool = False,
                 registry_tls: bool = False, etcd_args: tuple[str, ...] = ()) -> None:
        self.root = root
        tls: EtcdTLS | None = None
        #: the registry's --etcd-* flags, and how it serves clients
        self.etcd_flags: list[str] = []
        self.serve_flags: list[str] = ["--insecure"]
        self.credentials = ("", "", "")
        if etcd_tls or registry_tls:
            made = pki.local_pki(root / "pki")
            client = made[pki.ETCD_CLIENT]
            tls = EtcdTLS(cert=made["etcd"].cert, key=made["etcd"].key, ca=made["ca"].cert,
                          client_cert=client.cert, client_key=client.key)
            self.etcd_flags = ["--etcd-ca", str(tls.ca), "--etcd-cert", str(client.cert),
                               "--etcd-key", str(client.key)]
        if registry_tls:
            made = pki.local_pki(root / "pki")
            self.serve_flags = ["--tls-ca", str(made["ca"].cert),
                                "--tls-cert", str(made["registry"].cert),
                                "--tls-key", str(made["registry"].key)]
            self.credentials = (str(made["ca"].cert), str(made["operator"].cert),
                                str(made["operator"].key))
        self.etcd = EtcdProcess(root / "etcd", log_path=root / "etcd.log", binary=etcd_binary(),
                                tls=tls, extra_args=etcd_args)
        self.daemons: list[Daemon] = []

    def __enter__(self) -> Self:
        self.etcd.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        for daemon in reversed(self.daemons):
            terminate(daemon.process, timeout=10)
        self.daemons.clear()
        self.etcd.stop()

    def _spawn(self, name: str, argv: list[str], ready: str,
               env: dict[str, str] | None = None) -> Daemon:
        log_path = self.root / f"{name}-{len(self.daemons)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                # Its own session: Ctrl-C reaches only us, and we stop it in order.
                start_new_session=True, preexec_fn=die_with_parent,
            )
        daemon = Daemon(name, process, log_path)
        self.daemons.append(daemon)
        wait_ready(lambda: _line_in(log_path, ready) is not None, process, daemon=name,
                   log_path=log_path, timeout=START_TIMEOUT)
        return daemon

    def registry(self, staging: Path, prefix: str = "/baton/v1/",
                 extra: tuple[str, ...] = (), tree: Path | None = None) -> Daemon:
        """Start a registry on a free port (``extra``: more of its flags); its address
        is ``.address``. ``tree``: run the registry of that checkout (an earlier
        revision, see :func:`worktree`) instead of this one."""
        staging.mkdir(parents=True, exist_ok=True)
        # a benchmark measures whichever etcd it is given, known bugs or not (a tree from
        # before the flag existed checked no versions)
        allow = ["--allow-etcd-version", etcd_version(self.etcd.binary)]
        if tree is not None and not knows_flag(tree, allow[0]):
            allow = []
        daemon = self._spawn("registry", [
            sys.executable, "-u", "-m", "baton_relay.registry", *self.serve_flags, "--etcd",
            self.etcd.endpoint, *self.etcd_flags, "--listen", "127.0.0.1:0", "--staging",
            str(staging), "--prefix", prefix, "--log-level", "WARNING", *allow, *extra],
            REGISTRY_READY, env=None if tree is None else tree_env(tree))
        line = _line_in(daemon.log_path, REGISTRY_READY) or ""
        daemon.address = line[len(REGISTRY_READY):].strip()
        daemon.credentials = self.credentials
        return daemon

    def watcher(self, registry: str, staging: Path, extra: tuple[str, ...] = ()) -> Daemon:
        """Start a watcher on ``staging`` reporting to ``registry``, as ``baton up`` does
        (``extra``: more of its flags)."""
        return self._spawn("watcher", [
            sys.executable, "-u", "-m", "baton_relay.watcher", "--registry", registry,
            "--staging", str(staging), "--log-level", "WARNING", *extra], WATCHER_READY)

    def stop(self, daemon: Daemon) -> None:
        terminate(daemon.process, timeout=10)
        self.daemons.remove(daemon)


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """The repository at ``rev``, checked out in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="baton-bench-before-") as tmp:
        path = Path(tmp) / "tree"
        done = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach",
                               str(path), rev], check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"cannot check out {rev}: {done.stderr.strip()}")
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                           check=False, capture_output=True)


def tree_env(tree: Path) -> dict[str, str]:
    """The environment under which ``import baton_relay`` loads ``tree``'s package (a
    tree of the linked layout keeps it under ``src/``; later ones are the package)."""
    src = tree / "src"
    if (src / "baton_relay").exists():
        path = src
    else:
        path = tree.parent / "path"
        path.mkdir(exist_ok=True)
        if not (path / "baton_relay").exists():
            (path / "baton_relay").symlink_to(tree, target_is_directory=True)
    return {**os.environ, "PYTHONPATH": str(path)}


def knows_flag(tree: Path, flag: str) -> bool:
    """Whether ``tree``'s registry has command-line flag ``flag``."""
    return any(flag in f.read_text(errors="replace")
               for f in (tree / "registry").rglob("*.py"))


def first_line(e: BaseException) -> str:
    """An exception in one line, for a table cell or a note."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


# --- numbers ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q ≤ 1) of ``values``; NaN if empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


def ms(values: Sequence[float], q: float) -> float:
    """A percentile of durations in seconds, in milliseconds."""
    return 1000 * percentile(values, q)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def rss_kib(pid: int) -> int:
    """The resident set size of ``pid`` (``VmRSS`` in /proc/PID/status), in KiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+)\s+kB", status, re.MULTILINE)
    if match is None:
        raise BenchError(f"no VmRSS for pid {pid}")
    return int(match.group(1))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (``utime`` + ``stime`` in /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces: the fields that follow it come after ")".
    fields = stat[stat.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of the whole line
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def filesystem_of(path: Path) -> str:
    """The filesystem ``path`` is on, as /proc/self/mounts names it: "type (device)"."""
    mounts = Path("/proc/self/mounts")
    if not mounts.exists():
        return "unknown"
    target, best = str(path.resolve()), ("", "unknown")
    for line in mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, f"{fields[2]} ({fields[0]})")
    return best[1]


def etcd_kv_calls(etcd: EtcdProcess) -> dict[str, int]:
    """How many KV requests (Txn, Range, Put, ...) etcd has served so far, by method."""
    text = etcd.get("/metrics", timeout=5).decode()
    counts: dict[str, int] = {}
    pattern = re.compile(r'^grpc_server_handled_total\{([^}]*)\} (\S+)$', re.MULTILINE)
    for labels, value in pattern.findall(text):
        if 'grpc_service="etcdserverpb.KV"' in labels:
            method = re.search(r'grpc_method="(\w+)"', labels)
            if method:
                counts[method.group(1)] = counts.get(method.group(1), 0) + int(float(value))
    return counts


# --- the machine --------------------------------------------------------------------


@dataclass
class Machine:
    """What the report says about where it ran."""

    facts: dict[str, str] = field(default_factory=dict)

    @classmethod
    def describe(cls) -> Machine:
        facts: dict[str, str] = {}
        cpuinfo = Path("/proc/cpuinfo")
        model = ""
        if cpuinfo.exists():
            found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
            model = found.group(1).strip() if found else ""
        facts["CPU cores"] = f"{os.cpu_count()}" + (f" ({model})" if model else "")
        meminfo = Path("/proc/meminfo")
        if meminfo.exists():
            found = re.search(r"^MemTotal:\s+(\d+)", meminfo.read_text(), re.MULTILINE)
            if found:
                facts["RAM"] = f"{int(found.group(1)) / 1024 / 1024:.1f} GiB"
        facts["kernel"] = f"{platform.system()} {platform.release()}"
        facts["Python"] = platform.python_version()
        facts["commit"] = commit()
        binary = etcd_binary()
        facts["etcd"] = f"{etcd_version(binary)} ({binary})"
        b3sum = shutil.which("b3sum")
        if b3sum:
            done = subprocess.run([b3sum, "--version"], capture_output=True, text=True,
                                  timeout=30, check=False)
            facts["b3sum"] = done.stdout.strip() or b3sum
        return cls(facts)


def commit() -> str:
    """The checkout's commit (short), "+ changes" when its tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30, check=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"],
                               capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + (" + changes" if dirty.returncode else "")


def cpu_busy(seconds: float = 1.0) -> float:
    """The share of all CPUs' time that was not idle during the next ``seconds``."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    if not Path("/proc/stat").exists():
        return float("nan")
    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def ensure_b3sum(install: bool) -> tuple[str | None, str]:
    """``b3sum``'s path, installing Debian's package if allowed; else None and why not."""
    return ensure_package("b3sum", lambda: shutil.which("b3sum"), install)


def ensure_package(package: str, find: Callable[[], str | None],
                   install: bool) -> tuple[str | None, str]:
    """What ``find`` finds, after ``apt-get install package`` if it found nothing and
    ``install`` allows; else None and why not."""
    found = find()
    if found:
        return found, ""
    if not install:
        return None, f"{package} is not installed (the quick mode does not install it)"
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None, f"{package} is not installed and apt-get is not usable here (not root?)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for attempt in (["apt-get", "install", "-y", package],
                    ["apt-get", "update"], ["apt-get", "install", "-y", package]):
        try:
            done = subprocess.run(attempt, env=env, capture_output=True, text=True,
                                  timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"`{' '.join(attempt)}` failed: {e}"
        if attempt[1] == "install" and done.returncode == 0 and find():
            return find(), ""
        if attempt[1] == "update" and done.returncode != 0:
            break
    return None, f"`apt-get install -y {package}` did not succeed"


def on_etcd(endpoint: str, body: Callable[[Etcd], Awaitable[T]], timeout: float = 60.0) -> T:
    """Run ``body`` with a connection of its own to etcd, through the registry's client."""
    import asyncio

    from baton_relay.registry.store.etcd import Etcd

    async def main() -> T:
        etcd = Etcd(endpoint, timeout=timeout)
        await etcd.connect()
        try:
            return await body(etcd)
        finally:
            await etcd.close()

    return asyncio.run(main())
