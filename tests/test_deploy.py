"""The deployment files (deploy/): validated offline, and wired to what the daemons read.

Every Kustomize overlay is rendered (deploy/kustomize.py) and each object checked
against Kubernetes' schemas; every YAML file passes yamllint; the systemd units pass
``systemd-analyze verify`` and keep their ``security`` scores; the compose file
passes the compose-spec schema. The wiring: ports, probes, the staging hostPath, the
disruption budget, every TOML key a setting, every flag in ``--help``, every host
named in a configuration carried by the certificates deploy/pki.py makes. And the
daemons' side of it: sd_notify on a real socket, the probe against a real registry.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from registry_fixtures import RegistryHandle, allow_suite_etcd

from baton_relay.client import pki
from baton_relay.client.contract import REGISTRY_PORT
from baton_relay.client.sdnotify import Notifier
from baton_relay.registry import health
from baton_relay.registry.config import RegistryConfig
from baton_relay.registry.config import load_config as registry_config
from baton_relay.watcher.config import WatcherConfig
from baton_relay.watcher.config import load_config as watcher_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
KUSTOMIZATIONS = [KUBE / "base", *sorted((KUBE / "overlays").iterdir())]
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
COMPOSE = DEPLOY / "compose" / "compose.yaml"
#: the oldest Kubernetes these manifests are for, and a current one
KUBERNETES_VERSIONS = ("1.30.0", "1.34.0")
HEALTH = "baton_relay.registry.health"

sys.path.insert(0, str(DEPLOY))
import kustomize  # noqa: E402  (deploy/ is not a package)

sys.path.pop(0)


# --- what the daemons accept ---------------------------------------------------------


@cache
def help_text(module: str) -> str:
    out = subprocess.run([sys.executable, "-m", f"baton_relay.{module}", "--help"],
                         capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return out.stdout


def flags(module: str) -> set[str]:
    found = set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text(module)))
    if module == HEALTH.removeprefix("baton_relay."):  # and the registry's own settings
        found |= flags("registry")
    return found


def metrics_pending(module: str) -> bool:
    """``metrics`` is being added to both daemons; until it is, it is the one key
    the files may name that the daemon does not have (test_metrics_is_a_setting)."""
    return "--metrics" not in flags(module)


def check_toml(path: Path, module: str, scratch: Path) -> Any:
    """Load ``path`` as the daemon's settings, the way the daemon does."""
    text = path.read_text()
    if metrics_pending(module):
        text = re.sub(r"(?m)^metrics\s*=.*$", "", text)
    copy = scratch / f"{path.parent.name}-{path.name}"
    copy.write_text(text)
    load = registry_config if module == "registry" else watcher_config
    return load(["--config", str(copy)], {})


# --- the rendered manifests --------------------------------------------------------------


@cache
def rendered(root: Path) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize.render(root))


def find(objs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    for obj in objs:
        if obj["kind"] == kind and obj["metadata"]["name"].startswith(name):
            return obj
    raise AssertionError(f"no {kind} {name}")


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (only,) = obj["spec"]["template"]["spec"]["containers"]
    return only


def config_map_toml(objs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    data = find(objs, "ConfigMap", name)["data"]
    (text,) = data.values()
    return tomllib.loads(text)


# --- validators ------------------------------------------------------------------------


def test_yamllint_passes_on_every_yaml_file() -> None:
    """Every YAML file under deploy/ passes yamllint --strict."""
    out = subprocess.run([sys.executable, "-m", "yamllint", "-c", str(DEPLOY / "yamllint.yaml"),
                          "--strict", str(DEPLOY)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("root", KUSTOMIZATIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(root: Path, version: str) -> None:
    """Each object of each rendered kustomization passes kubernetes-validate --strict."""
    import kubernetes_validate

    objs = rendered(root)
    assert objs
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{root.name}: {obj['kind']} {obj['metadata']['name']}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


def test_compose_file_matches_the_compose_spec() -> None:
    """compose.yaml passes the compose-spec JSON schema (vendored in check-jsonschema)."""
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                          "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing (.ci/run installs Debian's systemd)")
        pytest.skip("systemd-analyze is missing: apt-get install systemd")
    return found


def test_systemd_units_verify(systemd_analyze: str, tmp_path: Path) -> None:
    """systemd-analyze verify passes with no warning, in a root where the programs
    the units start exist (a missing ExecStart binary is still an error)."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(unit, units)
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart="):
                program = root / line.split("=", 1)[1].split()[0].lstrip("/")
                program.parent.mkdir(parents=True, exist_ok=True)
                program.write_text("#!/bin/sh\n")
                program.chmod(0o755)
    out = subprocess.run([systemd_analyze, "verify", f"--root={root}", *(u.name for u in UNITS)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip(), out.stdout + out.stderr
    (units / UNITS[0].name).write_text(UNITS[0].read_text().replace("/opt/baton/", "/nowhere/"))
    out = subprocess.run([systemd_analyze, "verify", f"--root={root}", UNITS[0].name],
                         capture_output=True, text=True)
    assert out.returncode != 0, "verify must fail for a program that does not exist"


def test_systemd_security_scores_are_the_documented_ones(systemd_analyze: str) -> None:
    """systemd-analyze security --offline scores each unit as docs/deploy.md says."""
    doc = (ROOT / "docs/deploy.md").read_text()
    for unit in UNITS:
        out = subprocess.run([systemd_analyze, "security", "--offline=yes", str(unit)],
                             capture_output=True, text=True, cwd=unit.parent)
        match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", out.stdout)
        assert match, out.stdout + out.stderr
        assert f"| `{unit.name}` | {match.group(1)} |" in doc, (unit.name, match.group(1))


# --- wiring ------------------------------------------------------------------------------


def test_every_toml_key_is_a_setting_the_daemon_reads(tmp_path: Path) -> None:
    """Each example and Kubernetes/compose TOML loads as its daemon's settings
    (the loader refuses unknown keys)."""
    tomls = [*DEPLOY.glob("*.toml"), *DEPLOY.glob("*/*.toml"), *KUBE.glob("**/*.toml")]
    assert len(tomls) >= 6
    for path in tomls:
        module = "watcher" if path.name.startswith("watcher") else "registry"
        assert path.name.startswith(module), path
        check_toml(path, module, tmp_path)
    for root in KUSTOMIZATIONS:
        objs = rendered(root)
        for name, module in (("baton-registry", "registry"), ("baton-watcher", "watcher")):
            data = config_map_toml(objs, name)
            assert set(data) - {"metrics"} <= {f.replace("-", "_")[2:] for f in flags(module)}


def test_metrics_is_a_setting() -> None:
    """Both daemons have the ``metrics`` setting the files use."""
    missing = [m for m in ("registry", "watcher") if metrics_pending(m)]
    if missing:
        pytest.xfail(f"--metrics is not a setting of {', '.join(missing)} yet")


def command_flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def module_of(argv: list[str]) -> str:
    program = argv[0].rsplit("/", 1)[-1]
    if program == "python":
        return argv[2].removeprefix("baton_relay.")
    return {"baton-registry": "registry", "baton-watcher": "watcher"}[program]


def test_every_flag_passed_is_in_the_daemons_help() -> None:
    """Flags in units, manifests, probes and compose commands exist, and each
    BATON_* variable given is a setting."""
    commands: list[list[str]] = []
    for unit in UNITS:
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart="):
                commands.append(line.split("=", 1)[1].split())
    env_names: set[tuple[str, str]] = set()
    for root in KUSTOMIZATIONS:
        for obj in rendered(root):
            if obj["kind"] not in ("Deployment", "DaemonSet"):
                continue
            c = container(obj)
            commands.append(c["command"] + c.get("args", []))
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    commands.append(c[probe]["exec"]["command"])
            module = module_of(c["command"])
            env_names |= {(module, e["name"]) for e in c.get("env", [])
                          if e["name"].startswith("BATON_")}
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        if name.startswith(("registry", "watcher")):
            commands.append(service["command"])
            env_names |= {(service["command"][0].split("-")[1], k)
                          for k in service.get("environment", {}) if k.startswith("BATON_")}
        if "healthcheck" in service:
            commands.append(service["healthcheck"]["test"][1:])
    assert len(commands) >= 10
    for argv in commands:
        module = module_of(argv)
        assert command_flags(argv) <= flags(module), (argv, command_flags(argv) - flags(module))
    for module, env in env_names:
        assert f"--{env[6:].lower().replace('_', '-')}" in flags(module), (module, env)


def test_ports_agree_everywhere() -> None:
    """gRPC is 7390 in the contract, the TOMLs, the pods, the Service and compose;
    metrics are 9390 (registry) and 9391 (watcher) in the TOMLs and the pods."""
    assert REGISTRY_PORT == 7390
    for root in KUSTOMIZATIONS:
        objs = rendered(root)
        reg, wat = find(objs, "Deployment", "baton-registry"), find(objs, "DaemonSet", "baton-")
        ports = {p["name"]: p["containerPort"] for p in container(reg)["ports"]}
        assert ports == {"grpc": 7390, "metrics": 9390}
        assert {p["name"]: p["containerPort"] for p in container(wat)["ports"]} == {
            "metrics": 9391}
        toml = config_map_toml(objs, "baton-registry")
        assert toml["listen"].endswith(":7390") and toml["metrics"].endswith(":9390")
        assert config_map_toml(objs, "baton-watcher")["metrics"].endswith(":9391")
        for obj, port in ((reg, "9390"), (wat, "9391")):
            assert obj["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == port
        (svc_port,) = find(objs, "Service", "baton-registry")["spec"]["ports"]
        assert (svc_port["port"], svc_port["targetPort"]) == (7390, "grpc")
        assert config_map_toml(objs, "baton-watcher")["registry"].endswith(":7390")
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["registry-1"]["ports"] == ["7390:7390"]
    assert services["registry-2"]["ports"] == ["7391:7390"]
    for path in DEPLOY.glob("**/registry*.toml"):
        assert tomllib.loads(path.read_text())["listen"].endswith(":7390"), path


def test_registry_probes_ask_grpc_health_with_the_registry_settings() -> None:
    """Startup, readiness and liveness run registry.health on the mounted TOML; the
    compose health check does the same."""
    for root in KUSTOMIZATIONS:
        reg = container(find(rendered(root), "Deployment", "baton-registry"))
        mounts = {m["mountPath"]: m for m in reg["volumeMounts"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            argv = reg[probe]["exec"]["command"]
            assert argv[:3] == ["/opt/baton/bin/python", "-m", HEALTH], argv
            config = argv[argv.index("--config") + 1]
            assert config in mounts and config == reg["command"][-1]
            timeout = float(argv[argv.index("--timeout") + 1])
            assert timeout < reg[probe]["timeoutSeconds"]
        assert reg["livenessProbe"]["exec"]["command"][-2:] == ["--service", ""]
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["registry-1"]["healthcheck"]["test"][1:4] == ["python", "-m", HEALTH]


def test_every_object_is_in_the_namespace_and_labelled() -> None:
    """Each namespaced object of each kustomization is in ``baton`` and labelled as
    part of Baton (an overlay's own resources too)."""
    for root in KUSTOMIZATIONS:
        for obj in rendered(root):
            meta = obj["metadata"]
            assert meta["labels"]["app.kubernetes.io/part-of"] == "baton", (root, meta)
            if obj["kind"] != "Namespace":
                assert meta.get("namespace") == "baton", (root.name, obj["kind"], meta["name"])


def test_registry_replicas_and_disruption_budget() -> None:
    """At least two replicas, rolled with none unavailable; the PDB selects exactly
    the registry's pods and lets one go at a time."""
    for root in KUSTOMIZATIONS:
        objs = rendered(root)
        reg, pdb = find(objs, "Deployment", "baton-registry"), find(
            objs, "PodDisruptionBudget", "baton-registry")
        assert reg["spec"]["replicas"] >= 2
        assert reg["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == reg["spec"]["selector"]["matchLabels"]
        labels = reg["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        svc = find(objs, "Service", "baton-registry")
        assert svc["spec"]["selector"].items() <= labels.items()


def test_watcher_mounts_the_staging_root_it_watches() -> None:
    """The DaemonSet's hostPath is the watcher's staging root, writable (it makes task
    directories), and its state file lives on the node too; the unit's
    ReadWritePaths= is the example's staging root."""
    for root in KUSTOMIZATIONS:
        objs = rendered(root)
        ds = find(objs, "DaemonSet", "baton-watcher")
        toml = config_map_toml(objs, "baton-watcher")
        pod = ds["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in container(ds)["volumeMounts"]}
        staging = mounts[toml["staging"]]
        assert volumes[staging["name"]]["hostPath"]["path"] == toml["staging"]
        assert not staging.get("readOnly", False)
        state = mounts[str(Path(toml["state_file"]).parent)]
        assert "hostPath" in volumes[state["name"]]
        caps = container(ds)["securityContext"]["capabilities"]
        assert caps == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER", "FSETID", "DAC_READ_SEARCH"]}
        assert pod["nodeSelector"] == {"baton/staging": "true"}
    unit = (DEPLOY / "systemd/baton-watcher.service").read_text()
    example = tomllib.loads((DEPLOY / "watcher.example.toml").read_text())
    assert f"ReadWritePaths={example['staging']}\n" in unit
    assert f"RequiresMountsFor={example['staging']}\n" in unit
    assert "StateDirectory=" + Path(example["state_file"]).parent.name in unit


def test_certificates_name_every_host_the_configurations_dial(tmp_path: Path) -> None:
    """deploy/pki.py's certificates carry each etcd member and registry host that the
    Kubernetes and compose settings name (TLS checks the host as written)."""
    from cryptography import x509

    def names(cert: Path) -> set[str]:
        c = x509.load_pem_x509_certificate(cert.read_bytes())
        alt = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return set(alt.get_values_for_type(x509.DNSName))

    def hosts(endpoints: str) -> set[str]:
        return {e.rpartition(":")[0] for e in endpoints.split(",")}

    script = [sys.executable, str(DEPLOY / "pki.py")]
    subprocess.run([*script, str(tmp_path / "k"), "--kubernetes", "baton"], check=True,
                   capture_output=True)
    subprocess.run([*script, str(tmp_path / "c"), "--compose"], check=True, capture_output=True)
    objs = rendered(KUBE / "overlays/etcd-statefulset")
    assert hosts(config_map_toml(objs, "baton-registry")["etcd"]) <= names(tmp_path / "k/etcd.crt")
    assert hosts(config_map_toml(objs, "baton-watcher")["registry"]) <= names(
        tmp_path / "k/registry.crt")
    compose = DEPLOY / "compose"
    assert hosts(tomllib.loads((compose / "registry.toml").read_text())["etcd"]) <= names(
        tmp_path / "c/etcd.crt")
    assert hosts(tomllib.loads((compose / "watcher.toml").read_text())["registry"]) <= names(
        tmp_path / "c/registry.crt")
    watcher = (tmp_path / "k/watcher.crt").read_bytes()
    assert pki.identity(watcher)[1] == ("watcher",)


# --- the renderer -------------------------------------------------------------------------


def test_renderer_merges_patches_and_follows_generated_names(tmp_path: Path) -> None:
    """Named list items merge by name, a changed ConfigMap gets a new name that the
    pods follow, and anything it does not understand is refused."""
    base, overlay = tmp_path / "base", tmp_path / "overlay"
    base.mkdir()
    overlay.mkdir()
    (base / "kustomization.yaml").write_text(
        "namespace: ns\ncommonLabels: {a: b}\nresources: [d.yaml]\n"
        "configMapGenerator: [{name: cfg, files: [x.toml]}]\n")
    (base / "x.toml").write_text("k = 1\n")
    (base / "d.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
        "spec": {"selector": {"matchLabels": {"app": "d"}}, "template": {
            "metadata": {"labels": {"app": "d"}},
            "spec": {"containers": [{"name": "c", "image": "img:1", "args": ["x"]},
                                    {"name": "s", "image": "side:1"}],
                     "volumes": [{"name": "v", "configMap": {"name": "cfg"}}]}}}}))
    (overlay / "kustomization.yaml").write_text(
        "resources: [../base]\npatches: [{path: p.yaml}]\n"
        "configMapGenerator: [{name: cfg, behavior: replace, files: [x.toml]}]\n"
        "images: [{name: img, newName: reg/img, newTag: '2'}]\n")
    (overlay / "x.toml").write_text("k = 2\n")
    (overlay / "p.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
        "spec": {"template": {"spec": {"containers": [{"name": "c", "args": ["y"]}]}}}}))
    b, o = kustomize.render(base), kustomize.render(overlay)
    cm_b, cm_o = find(tuple(b), "ConfigMap", "cfg"), find(tuple(o), "ConfigMap", "cfg")
    assert cm_b["metadata"]["name"] != cm_o["metadata"]["name"]
    assert cm_o["data"] == {"x.toml": "k = 2\n"}
    dep = find(tuple(o), "Deployment", "d")
    pod = dep["spec"]["template"]["spec"]
    assert pod["volumes"][0]["configMap"]["name"] == cm_o["metadata"]["name"]
    assert [(c["name"], c["image"], c.get("args")) for c in pod["containers"]] == [
        ("c", "reg/img:2", ["y"]), ("s", "side:1", None)]
    assert dep["metadata"]["namespace"] == "ns"
    assert dep["spec"]["selector"]["matchLabels"] == {"app": "d", "a": "b"}
    (overlay / "kustomization.yaml").write_text("resources: [../base]\nreplicas: []\n")
    with pytest.raises(kustomize.KustomizeError, match="replicas"):
        kustomize.render(overlay)


# --- sd_notify ----------------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd's, and its address."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(30)
    yield sock, path
    sock.close()


def messages(sock: socket.socket, until: Callable[[dict[str, str]], bool]) -> list[dict[str, str]]:
    """Datagrams received, parsed, up to the first that ``until`` accepts."""
    got = []
    while True:
        data = sock.recv(4096).decode()
        fields = dict(line.split("=", 1) for line in data.splitlines())
        got.append(fields)
        if until(fields):
            return got


def test_notifier_abstract_socket_and_no_socket() -> None:
    """An @ address is in the abstract namespace; no NOTIFY_SOCKET sends nothing; the
    watchdog is for the process WATCHDOG_PID names only."""
    name = f"baton-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        notifier = Notifier.from_environ({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "3000000"})
        assert notifier.ready("up")
        assert sock.recv(100) == b"READY=1\nSTATUS=up"
        assert notifier.watchdog_interval == 1.5
    assert not Notifier.from_environ({}).ready("up")
    assert Notifier.from_environ({}).watchdog_interval is None
    other = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}
    assert Notifier.from_environ(other, pid=2).watchdog_interval is None
    assert Notifier.from_environ(other, pid=1).watchdog_interval == 0.5


def test_registry_tells_systemd_it_serves_and_stops(
        etcd: Any, prefix: str, tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    """A registry started with NOTIFY_SOCKET sends READY=1 once it serves, pings the
    watchdog every WATCHDOG_USEC/2, and sends STOPPING=1 on SIGTERM, then exits 0."""
    sock, path = notify_socket
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.registry", "--insecure", "--etcd", etcd.endpoint,
         *allow_suite_etcd(), "--listen",
         "127.0.0.1:0", "--staging", str(tmp_path), "--prefix", prefix],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        address = line.split()[-1]
        ready = messages(sock, lambda m: "READY" in m)[-1]
        assert ready["READY"] == "1" and address in ready["STATUS"]
        code, said = health.check(["--insecure", "--address", address], {})
        assert code == 0, said
        pings = messages(sock, lambda m: True) + messages(sock, lambda m: True)
        assert pings == [{"WATCHDOG": "1"}] * 2
        proc.send_signal(signal.SIGTERM)
        stopping = messages(sock, lambda m: "STOPPING" in m)[-1]
        assert stopping["STOPPING"] == "1"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watcher_tells_systemd_it_watches_and_stops(
        registry: RegistryHandle, staging: Path, notify_socket: tuple[socket.socket, str]) -> None:
    """A watcher started with NOTIFY_SOCKET sends READY=1 with its root, and STOPPING=1
    on SIGTERM."""
    sock, path = notify_socket
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.watcher", "--registry", registry.address, "--staging",
         str(staging)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        ready = messages(sock, lambda m: "READY" in m)[-1]
        assert ready["READY"] == "1" and os.path.realpath(staging) in ready["STATUS"]
        assert messages(sock, lambda m: True) == [{"WATCHDOG": "1"}]
        proc.send_signal(signal.SIGTERM)
        assert messages(sock, lambda m: "STOPPING" in m)[-1]["STOPPING"] == "1"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- the probe ----------------------------------------------------------------------------


def test_health_probe_presents_the_registry_certificate(
        registry_factory: Callable[..., RegistryHandle], tmp_path: Path) -> None:
    """Against a replica serving mutual TLS, the probe with the replica's own settings
    answers 0 (as ``python -m baton_relay.registry.health`` too); without them, or with nothing
    listening, 1."""
    made = pki.local_pki(tmp_path / "pki")
    tls = {"tls_ca": str(made["ca"].cert), "tls_cert": str(made["registry"].cert),
           "tls_key": str(made["registry"].key)}
    replica = registry_factory(**tls)
    settings = ["--listen", f"0.0.0.0:{replica.port}", "--tls-ca", tls["tls_ca"],
                "--tls-cert", tls["tls_cert"], "--tls-key", tls["tls_key"]]
    code, said = health.check(settings, {})
    assert code == 0, said
    assert said.startswith(f"127.0.0.1:{replica.port} baton.v1.Registry: SERVING (etcd members: ")
    out = subprocess.run([sys.executable, "-m", HEALTH, *settings, "--service", ""],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "server: SERVING (etcd members: " in out.stdout, out
    code, said = health.check(["--insecure", "--listen", f"127.0.0.1:{replica.port}",
                               "--timeout", "1"], {})
    assert code == 1, said
    replica.stop()
    code, said = health.check([*settings, "--timeout", "1"], {})
    assert code == 1 and ("UNAVAILABLE" in said or "DEADLINE" in said), said


def test_health_probe_dials_loopback_for_a_wildcard_listen() -> None:
    """0.0.0.0 and [::] become loopback; a named host is kept."""
    assert health.local_address("0.0.0.0:7390") == "127.0.0.1:7390"
    assert health.local_address("[::]:7390") == "[::1]:7390"
    assert health.local_address("10.1.2.3:7390") == "10.1.2.3:7390"
    assert RegistryConfig().listen.endswith(":7390")
    assert WatcherConfig().registry.endswith(":7390")
