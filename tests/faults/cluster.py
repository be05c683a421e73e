"""The processes of a fault run: etcd members, registry replicas, the watcher, agents.

Every process is a child of the harness (its own session, so a Ctrl-C reaches only
the harness), with its output appended to a log that marks each start with a banner.
etcd members are started through ``deploy/local/etcd-cluster.sh member``, so the
cluster the tests use is the one that script gives a developer.

Unless the run is plaintext, Baton's processes speak mutual TLS with certificates
from a CA made for the run (:func:`make_pki`): the registries present a server
certificate for loopback, the watcher a ``watcher`` identity, each agent process an
``agent`` identity of its own name, and the driver an ``operator`` one.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from baton_relay.kernel import pki
from baton_relay.local.etcdproc import (
    etcd_version,
    find_etcd,
    port_in_use,
    tail,
    terminate,
    wait_ready,
    write_banner,
)
from baton_relay.local.stack import LocalPKI, grpc_health_probe, log_line_probe
from baton_relay.registry.store.keys import prefix_end

from .netns import Network

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "local" / "etcd-cluster.sh"
MEMBERS = 3
WATCHER_READY = "baton-watcher watching"

#: what the registries' certificate is good for, besides the replicas' addresses in a
#: run's network namespaces
SERVER_NAMES = ("127.0.0.1", "localhost")
#: the certificate names of a run's identities (each NAME.crt and NAME.key in the PKI
#: directory); the readiness probe presents the operator's, as the driver does
REGISTRY, WATCHER, OPERATOR = "registry", "watcher", "operator"

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


Probe = Callable[[], bool]


class Proc:
    """One daemon: start, SIGKILL, SIGSTOP/SIGCONT, restart, stop.

    ``ready`` makes a fresh readiness probe for each start (a log probe only looks
    past the banner of the start it was made for).
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path,
                 ready: Callable[[], Probe] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.ready = ready
        self.env = dict(env) if env is not None else None
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.starts = 0
        #: the harness ended it (kill or stop); a process that exits otherwise crashed
        self.ended = False

    def __repr__(self) -> str:
        return f"<Proc {self.name} pid={self.pid} alive={self.alive}>"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def crashed(self) -> bool:
        """It exited by itself (not killed nor stopped by the harness)."""
        return self.process is not None and not self.alive and not self.ended

    def spawn(self) -> None:
        """Start the process without waiting for it to be ready."""
        if self.alive:
            raise RuntimeError(f"{self.name} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        write_banner(self.log_path, self.argv)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=REPO, env=self.env, start_new_session=True)
        self.paused = self.ended = False
        self.starts += 1

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.process is not None
        if self.ready is not None:
            wait_ready(self.ready(), self.process, daemon=self.name, log_path=self.log_path,
                       timeout=timeout)

    def start(self, timeout: float = 60.0) -> None:
        self.spawn()
        self.wait_ready(timeout)

    def kill(self) -> None:
        self.ended = True
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait()
        self.paused = False

    def pause(self) -> None:
        if self.alive and self.pid is not None:
            os.kill(self.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.alive and self.pid is not None:
            os.kill(self.pid, signal.SIGCONT)
        self.paused = False

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGCONT (a paused process cannot handle SIGTERM), SIGTERM, then SIGKILL."""
        if self.process is None:
            return None
        self.ended = True
        self.resume()
        return terminate(self.process, timeout)

    def log_tail(self, n: int = 30) -> str:
        return tail(self.log_path, n)


# --- etcd --------------------------------------------------------------------------


def _post(address: str, path: str, body: dict[str, Any], timeout: float = 2.0
          ) -> dict[str, Any]:
    request = urllib.request.Request(f"http://{address}{path}",
                                     data=json.dumps(body).encode(), method="POST")
    with _OPENER.open(request, timeout=timeout) as response:
        data: dict[str, Any] = json.load(response)
        return data


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def refusal(error: urllib.error.HTTPError) -> str:
    """What etcd's JSON gateway said when it refused a call."""
    text = error.read().decode(errors="replace")
    try:
        return str(json.loads(text).get("error") or text)[:300]
    except ValueError:
        return text[:300] or str(error)


def free_base_port(count: int = 2 * MEMBERS, start: int = 24000) -> int:
    """A base port such that ``count`` consecutive ports from it are free."""
    base = start + (os.getpid() % 500) * 8
    for _ in range(2000):
        if not any(port_in_use(base + i) for i in range(count)):
            return base
        base = 20000 + (base + count - 20000) % 30000
    raise RuntimeError("no free block of loopback ports")


class EtcdCluster:
    """Three etcd members, each launched by ``etcd-cluster.sh member``: on loopback, or
    each in its own namespace of ``network`` (node ``eN``, see :func:`etcd_node`)."""

    def __init__(self, data_dir: Path, binary: str | None = None,
                 extra_args: str = "--snapshot-count 5000",
                 network: Network | None = None, quota: int = 0,
                 compaction: str = "") -> None:
        """``quota``: ``--quota-backend-bytes`` (0: etcd's default); ``compaction``:
        ``--auto-compaction-retention`` in periodic mode, e.g. ``5m`` ("": none)."""
        self.data_dir = data_dir
        self.base = free_base_port()
        self.hosts = [network.address(etcd_node(n)) if network else "127.0.0.1"
                      for n in range(MEMBERS)]
        self.quota = quota
        if quota:
            extra_args += f" --quota-backend-bytes {quota}"
        if compaction:
            extra_args += (" --auto-compaction-mode periodic "
                           f"--auto-compaction-retention {compaction}")
        env = dict(os.environ)
        env["PYTHON"] = sys.executable
        env["BATON_ETCD_ARGS"] = extra_args
        env["BATON_ETCD_HOSTS"] = ",".join(self.hosts)
        # Chosen here, not by the script: the registries are told its exact release.
        self.binary = binary or find_etcd()
        #: the release the members run (a registry on them allows exactly it: the suite
        #: runs on releases with known bugs on purpose, to find what they do)
        self.version = etcd_version(self.binary)
        env["BATON_ETCD"] = self.binary
        self.members = []
        for n in range(MEMBERS):
            argv = ["bash", str(SCRIPT), "member", str(data_dir), str(self.base), str(n)]
            if network is not None:
                argv = network.wrap(etcd_node(n), argv)
            self.members.append(Proc(f"etcd-m{n}", argv, data_dir / f"m{n}.log",
                                     ready=self._health_probe(n), env=env))

    def port(self, n: int) -> int:
        return self.base + 2 * n

    def endpoint(self, n: int) -> str:
        return f"{self.hosts[n]}:{self.port(n)}"

    def _health_probe(self, n: int) -> Callable[[], Probe]:
        return lambda: lambda: self.member_healthy(n)

    def member_healthy(self, n: int) -> bool:
        """Whether member ``n``'s ``/health`` says it serves (it has a leader)."""
        try:
            with _OPENER.open(f"http://{self.endpoint(n)}/health", timeout=1.0) as r:
                return bool(json.load(r).get("health") == "true")
        except (OSError, ValueError):
            return False

    def start(self, timeout: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)
        for m in self.members:
            m.spawn()
        for m in self.members:
            m.wait_ready(timeout)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def status(self, n: int) -> dict[str, Any] | None:
        """Member ``n``'s maintenance status, None if it does not answer."""
        if not self.members[n].alive or self.members[n].paused:
            return None
        try:
            return _post(self.endpoint(n), "/v3/maintenance/status", {})
        except (OSError, ValueError):
            return None

    def leader(self) -> int | None:
        """The index of the member that leads, as the members that answer say."""
        ids: dict[str, int] = {}
        leaders: list[str] = []
        for n in range(MEMBERS):
            s = self.status(n)
            if s is not None:
                ids[str(s["header"]["member_id"])] = n
                leaders.append(str(s.get("leader", "")))
        for lead in leaders:
            if lead in ids:
                return ids[lead]
        return None

    def answering(self) -> int | None:
        """Any member that answers."""
        for n in range(MEMBERS):
            if self.status(n) is not None:
                return n
        return None

    def revision(self) -> int:
        n = self.answering()
        if n is None:
            raise RuntimeError("no etcd member answers")
        status = self.status(n)
        assert status is not None
        return int(status["header"]["revision"])

    def compact(self, revision: int) -> str:
        """Compact the keyspace up to ``revision``; "" or why it was refused."""
        n = self.answering()
        if n is None:
            return "no member answers"
        try:
            _post(self.endpoint(n), "/v3/kv/compaction", {"revision": revision, "physical": True},
                  timeout=10.0)
        except urllib.error.HTTPError as e:
            return e.read().decode(errors="replace")[:200]
        except OSError as e:
            return str(e)
        return ""

    def divergence(self, timeout: float = 20.0) -> str:
        """"" if every member, having applied the same raft log, holds the same revision
        and the same number of keys; else what differs. Meant for a quiet cluster.

        A member that lost applied writes (etcd-io/etcd#13766, 3.5.0 to 3.5.2 after a
        crash) serves a different history: Baton's reads and compares on it go wrong.
        """
        deadline = time.monotonic() + timeout
        while True:
            states = [self.status(n) for n in range(MEMBERS)]
            if all(s is not None for s in states):
                applied = {int(s["raftAppliedIndex"]) for s in states if s is not None}
                if len(applied) == 1:
                    revisions = [int(s["header"]["revision"]) for s in states if s is not None]
                    keys = [self._count(n) for n in range(MEMBERS)]
                    if len(set(revisions)) == 1 and len(set(keys)) == 1:
                        return ""
                    return (f"members diverged at applied index {applied.pop()}: revisions "
                            f"{revisions}, keys {keys} (m0, m1, m2)")
            if time.monotonic() > deadline:
                return f"members did not settle on one applied index within {timeout:g} s"
            time.sleep(0.2)

    def _count(self, n: int) -> int:
        """Keys in member ``n``'s own store (a serializable read: no leader involved)."""
        everything = {"key": "AA==", "range_end": "AA==", "count_only": True,
                      "serializable": True}
        return int(_post(self.endpoint(n), "/v3/kv/range", everything).get("count", 0))

    def healthy(self) -> bool:
        return all(m.alive and not m.paused and self.member_healthy(n)
                   for n, m in enumerate(self.members))

    # --- the quota (the etcd-quota nemesis): every call through :meth:`gateway` ------

    def gateway(self, n: int, path: str, body: dict[str, Any],
                timeout: float = 2.0) -> dict[str, Any]:
        """A call to member ``n``'s v3 JSON gateway (``path`` is ``/v3/...``); an
        ``urllib.error.HTTPError`` when etcd refuses it (:func:`refusal` reads why)."""
        return _post(self.endpoint(n), path, body, timeout)

    def put(self, n: int, key: bytes, value: bytes, timeout: float = 10.0) -> str:
        """Put ``key`` through member ``n``: "" or why etcd refused it (at the quota
        ``etcdserver: mvcc: database space exceeded``)."""
        try:
            self.gateway(n, "/v3/kv/put", {"key": _b64(key), "value": _b64(value)}, timeout)
        except urllib.error.HTTPError as e:
            return refusal(e)
        return ""

    def delete_prefix(self, n: int, prefix: bytes, timeout: float = 30.0) -> int:
        """Delete every key under ``prefix`` through member ``n`` (etcd accepts deletes
        at its quota); how many were deleted."""
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        return int(self.gateway(n, "/v3/kv/deleterange", body, timeout).get("deleted", 0))

    def db_size(self, n: int) -> int | None:
        """Member ``n``'s backend size in bytes (what the quota is held against)."""
        status = self.status(n)
        return int(status["dbSize"]) if status is not None else None

    def defragment(self, n: int, timeout: float = 60.0) -> None:
        """Defragment member ``n``'s backend: the space compaction freed goes back."""
        self.gateway(n, "/v3/maintenance/defragment", {}, timeout)

    def alarms(self, n: int) -> list[dict[str, Any]]:
        """The alarms raised in the cluster, as member ``n`` lists them: each a
        ``memberID`` and an ``alarm`` (``NOSPACE``, ``CORRUPT``)."""
        raised = self.gateway(n, "/v3/maintenance/alarm", {"action": "GET"}).get("alarms")
        return list(raised or [])

    def disarm(self, n: int, alarm: dict[str, Any]) -> None:
        """Deactivate one alarm of :meth:`alarms`, through member ``n``."""
        self.gateway(n, "/v3/maintenance/alarm", {
            "action": "DEACTIVATE", "memberID": alarm.get("memberID", "0"),
            "alarm": alarm.get("alarm", "NOSPACE")})


# --- where each process runs ----------------------------------------------------------
#
# With a network (``netns.Network``), every process has a namespace of its own: a node,
# named by kind and index, whose address is the subnet's host number below.


def etcd_node(n: int) -> str:
    return f"e{n}"


def registry_node(n: int) -> str:
    return f"r{n}"


def watcher_node(n: int) -> str:
    return f"w{n}"


def agent_node(index: int) -> str:
    """An agent position's node (its incarnations share it)."""
    return f"a{index}"


HOST_NUMBERS = {"e": 10, "r": 20, "w": 30, "a": 40}


def host_number(node: str) -> int:
    return HOST_NUMBERS[node[0]] + int(node[1:])


def confine(proc: Proc, network: Network | None, node: str) -> Proc:
    """``proc`` run in ``node``'s namespace (as it is without a network)."""
    if network is not None:
        proc.argv = network.wrap(node, proc.argv)
    return proc


# --- identities ---------------------------------------------------------------------


def make_pki(directory: Path, hosts: Sequence[str] = ()) -> LocalPKI:
    """A CA in ``directory`` with the registries' server certificate (for loopback and
    ``hosts``, the replicas' addresses) and the watcher's and the operator's identities;
    each agent gets its own when it starts (:func:`agent_proc`)."""
    pki.create_ca(directory)
    pki.issue(directory, REGISTRY, directory,
              server_names=tuple(dict.fromkeys((*SERVER_NAMES, *hosts))))
    pki.issue(directory, WATCHER, directory, roles=("watcher",))
    pki.issue(directory, OPERATOR, directory, roles=("operator",))
    return LocalPKI(directory)


def credentials(tls: LocalPKI | None, name: str) -> dict[str, str]:
    """``client.Client``'s keyword arguments for identity ``name``; without a PKI, empty
    ones: plaintext, whatever ``BATON_CA`` and the like say."""
    if tls is None:
        return {"ca": "", "cert": "", "key": ""}
    return {"ca": tls.ca, "cert": tls.cert(name), "key": tls.key(name)}


def daemon_env() -> dict[str, str]:
    """The harness's environment without its ``BATON_*`` variables: a daemon's settings
    are the flags it is given (a ``BATON_CA`` from the shell would put a plaintext run's
    clients on TLS)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}


# --- Baton's daemons ---------------------------------------------------------------


def registry_proc(name: str, etcd_endpoint: str, address: str, staging: Path, prefix: str,
                  log_path: Path, tls: LocalPKI | None, etcd_version: str,
                  metrics: str = "") -> Proc:
    """A registry process on ``etcd_endpoint``, whose members run ``etcd_version``
    (``EtcdCluster.version``: served even if it has known bugs), serving its
    ``/metrics`` on ``metrics`` (HOST:PORT; empty: not)."""
    # --insecure runs only on the run's private network (or loopback)
    security = (list(tls.client_flags(REGISTRY, "tls")) if tls
                else ["--insecure", "--insecure-beyond-loopback"])
    argv = [sys.executable, "-u", "-m", "baton_relay.registry", *security, "--etcd", etcd_endpoint,
            "--listen", address, "--staging", str(staging), "--prefix", prefix,
            "--reap-interval", "0.5", "--grace", "1", "--allow-etcd-version", etcd_version]
    if metrics:
        argv += ["--metrics", metrics]
    return Proc(name, argv, log_path, ready=lambda: grpc_health_probe(address, pki=tls),
                env=daemon_env())


def pool_units_repaired(metrics: str, timeout: float = 10.0) -> int:
    """A registry's ``baton_pool_units_repaired_total``, read from its ``/metrics`` at
    ``metrics`` (HOST:PORT)."""
    with _OPENER.open(f"http://{metrics}/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith("baton_pool_units_repaired_total "):
            return int(float(line.split()[1]))
    raise ValueError(f"{metrics}/metrics has no baton_pool_units_repaired_total")


def watcher_proc(registries: Sequence[str], staging: Path, state_file: Path,
                 log_path: Path, tls: LocalPKI | None, name: str = "watcher",
                 ttl: int = 4) -> Proc:
    """A watcher process named ``name`` (its reporter name too); several share the
    staging root's shards, each registered for ``ttl`` seconds."""
    # gRPC's ipv4: scheme takes a list; pick_first moves on when a replica dies. Over
    # TLS the replicas' certificates are checked against the list's first host.
    target = "ipv4:" + ",".join(registries)
    security = [] if tls is None else list(tls.client_flags(WATCHER))
    argv = [sys.executable, "-u", "-m", "baton_relay.watcher", "--registry", target, *security,
            "--staging", str(staging), "--state-file", str(state_file),
            "--reconcile-interval", "5", "--stream-timeout", "10", "--retry-delay", "0.1",
            "--reporter", name, "--shard-ttl", str(ttl)]
    return Proc(name, argv, log_path, env=daemon_env(),
                ready=lambda: log_line_probe(log_path, WATCHER_READY))


def agent_proc(role: str, name: str, registries: Sequence[str], history: Path, seed: int,
               ttl: int, group: str, log_path: Path, tls: LocalPKI | None) -> Proc:
    """An agent process; over TLS with an ``agent`` identity of its own ``name``, issued
    here (a restarted agent is a new process, and what its predecessor held is not its own)."""
    argv = [sys.executable, "-u", "-m", "tests.faults.agent", "--role", role, "--name", name,
            "--registries", ",".join(registries), "--history", str(history),
            "--seed", str(seed), "--ttl", str(ttl), "--group", group]
    if tls is not None:
        pki.issue(tls.root, name, tls.root, roles=("agent",))
        argv += [*tls.client_flags(name)]
    env = daemon_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return Proc(name, argv, log_path, env=env)
