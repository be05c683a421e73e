"""The deployment files (deploy/): validated offline, and wired to what the daemons read.

Every kustomization is rendered by ``kubectl kustomize`` (kubectl 1.27 or newer; the
Kubernetes checks skip, saying so in one line, where there is none), with no warning,
and each object checked against Kubernetes' schemas; every YAML file passes yamllint;
the systemd units pass ``systemd-analyze verify`` and keep their ``security`` scores;
the compose file passes the compose-spec schema. The wiring: ports, probes, the
staging hostPath, the disruption budget, generated names, every TOML key a setting,
every flag in ``--help``, every name docs/deploy.md uses, every host named in a
configuration carried by the certificates deploy/pki.py makes. And the daemons' side
of it: sd_notify on a real socket, the probe against a real registry.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from registry_fixtures import RegistryHandle, allow_suite_etcd
from tools import KUBECTL_LINE, KUBECTL_WANTED, require

from baton_relay.kernel import pki
from baton_relay.kernel.contract import REGISTRY_PORT
from baton_relay.kernel.sdnotify import Notifier
from baton_relay.registry.edge import health
from baton_relay.registry.edge.config import RegistryConfig
from baton_relay.registry.edge.config import load_config as registry_config
from baton_relay.watcher.config import WatcherConfig
from baton_relay.watcher.config import load_config as watcher_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
KUSTOMIZATIONS = [KUBE / "base", *sorted((KUBE / "overlays").iterdir())]
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
COMPOSE = DEPLOY / "compose" / "compose.yaml"
#: the oldest Kubernetes these manifests are for, and a current one
KUBERNETES_VERSIONS = ("1.30.0", "1.34.0")
HEALTH = "baton_relay.registry.edge.health"


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


def settings_files() -> list[Path]:
    """Every daemon settings file (TOML) under deploy/."""
    return sorted({*DEPLOY.glob("*.toml"), *DEPLOY.glob("*/*.toml"), *KUBE.glob("**/*.toml")})


def check_toml(path: Path, module: str) -> Any:
    """Load ``path`` as the daemon's settings, the way the daemon does (it refuses
    unknown keys)."""
    load = registry_config if module == "registry" else watcher_config
    return load(["--config", str(path)], {})


# --- the rendered manifests --------------------------------------------------------------

#: kubectl carries Kustomize v5 from 1.27 on
KUBECTL_OLDEST = (1, 27)


class KubectlUnfit(Exception):
    """No kubectl that renders with Kustomize v5: none on the path, one older than 1.27,
    or one that does not tell its version. The message is one line: which, and how to
    get one."""


def find_kubectl(search_path: str | None = None) -> str:
    """The kubectl on ``search_path`` (PATH when None), if it is 1.27 or newer."""
    found = shutil.which("kubectl", path=search_path)
    if found is None:
        raise KubectlUnfit(KUBECTL_LINE)
    out = subprocess.run([found, "version", "--client", "-o", "json"],
                         capture_output=True, text=True)
    try:
        version = json.loads(out.stdout)["clientVersion"]["gitVersion"]
    except (ValueError, KeyError, TypeError):
        version = ""
    # "v1.32.4", or a vendor's "v1.32.4-gke.100": only major and minor count
    match = re.match(r"v(\d+)\.(\d+)\.", str(version))
    if match is None:
        said = " ".join((out.stdout + out.stderr).split())[:100]
        raise KubectlUnfit(f"{found} version --client -o json gave no version ({said!r}); "
                           f"{KUBECTL_WANTED}")
    if (int(match[1]), int(match[2])) < KUBECTL_OLDEST:
        raise KubectlUnfit(f"{found} is {version}, too old; {KUBECTL_WANTED}")
    return found


@pytest.fixture(scope="module")
def kubectl() -> str:
    try:
        return find_kubectl()
    except KubectlUnfit as e:
        pytest.skip(str(e))


@dataclass(frozen=True)
class Rendered:
    objects: tuple[dict[str, Any], ...]
    warnings: str


@cache
def kustomize(kubectl: str, root: Path) -> Rendered:
    """``kubectl kustomize root``: what ``kubectl apply -k root`` sends, and its stderr."""
    out = subprocess.run([kubectl, "kustomize", str(root)], capture_output=True, text=True)
    assert out.returncode == 0, f"kubectl kustomize {root}: {out.stderr}"
    return Rendered(tuple(d for d in yaml.safe_load_all(out.stdout) if d), out.stderr)


def rendered(kubectl: str, root: Path) -> tuple[dict[str, Any], ...]:
    return kustomize(kubectl, root).objects


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
def test_every_kustomization_renders_without_a_warning(kubectl: str, root: Path) -> None:
    """``kubectl kustomize`` renders each kustomization and says nothing on stderr (a
    field Kustomize deprecates is caught when it starts warning)."""
    assert kustomize(kubectl, root).warnings == ""


@pytest.mark.parametrize("root", KUSTOMIZATIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(
        kubectl: str, root: Path, version: str) -> None:
    """Each object of each rendered kustomization passes kubernetes-validate --strict."""
    import kubernetes_validate

    objs = rendered(kubectl, root)
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
    return require("systemd-analyze")


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


def test_every_toml_key_is_a_setting_the_daemon_reads() -> None:
    """Each example and Kubernetes/compose TOML loads as its daemon's settings
    (the loader refuses unknown keys)."""
    tomls = settings_files()
    assert len(tomls) >= 6
    for path in tomls:
        module = "watcher" if path.name.startswith("watcher") else "registry"
        assert path.name.startswith(module), path
        check_toml(path, module)


def test_every_config_map_holds_settings_the_daemon_reads(kubectl: str) -> None:
    """The generated ConfigMaps of each kustomization carry one TOML each whose keys
    are the daemon's settings."""
    for root in KUSTOMIZATIONS:
        objs = rendered(kubectl, root)
        for name, module in (("baton-registry", "registry"), ("baton-watcher", "watcher")):
            data = config_map_toml(objs, name)
            assert set(data) <= {f.replace("-", "_")[2:] for f in flags(module)}


#: every settings file deploy/ ships and where its daemon serves Prometheus metrics:
#: the registry on 9390, the watcher on 9391 (as docs/deploy.md says, and the pods'
#: ports and annotations); written out here, not read from deploy/ or the daemons
METRICS = {
    "registry.example.toml": "0.0.0.0:9390",
    "watcher.example.toml": "0.0.0.0:9391",
    "compose/registry.toml": "0.0.0.0:9390",
    "compose/watcher.toml": "0.0.0.0:9391",
    "kubernetes/base/registry.toml": "0.0.0.0:9390",
    "kubernetes/base/watcher.toml": "0.0.0.0:9391",
    "kubernetes/overlays/etcd-statefulset/registry.toml": "0.0.0.0:9390",
    "kubernetes/overlays/external-etcd/registry.toml": "0.0.0.0:9390",
    "kubernetes/overlays/shared-volume/registry.toml": "0.0.0.0:9390",
}


def test_every_settings_file_serves_metrics_on_its_port() -> None:
    """Each daemon settings file under deploy/ is one :data:`METRICS` lists, and the
    daemon's own loader reads from it the metrics address listed there: the setting
    exists in both daemons, and no file leaves metrics off or moves their port."""
    assert sorted(str(p.relative_to(DEPLOY)) for p in settings_files()) == sorted(METRICS)
    for name, address in METRICS.items():
        module = "watcher" if Path(name).name.startswith("watcher") else "registry"
        assert check_toml(DEPLOY / name, module).metrics == address, name


def command_flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def module_of(argv: list[str]) -> str:
    program = argv[0].rsplit("/", 1)[-1]
    if program == "python":
        return argv[2].removeprefix("baton_relay.")
    return {"baton-registry": "registry", "baton-watcher": "watcher"}[program]


def check_commands(commands: list[list[str]], env_names: set[tuple[str, str]]) -> None:
    """Each command's flags are in its daemon's --help, each (daemon, BATON_*) a setting."""
    for argv in commands:
        module = module_of(argv)
        assert command_flags(argv) <= flags(module), (argv, command_flags(argv) - flags(module))
    for module, env in env_names:
        assert f"--{env[6:].lower().replace('_', '-')}" in flags(module), (module, env)


def test_every_flag_passed_is_in_the_daemons_help() -> None:
    """Flags in units, compose commands and health checks exist, and each BATON_*
    variable compose gives is a setting."""
    commands: list[list[str]] = []
    for unit in UNITS:
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart="):
                commands.append(line.split("=", 1)[1].split())
    env_names: set[tuple[str, str]] = set()
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        if name.startswith(("registry", "watcher")):
            commands.append(service["command"])
            env_names |= {(service["command"][0].split("-")[1], k)
                          for k in service.get("environment", {}) if k.startswith("BATON_")}
        if "healthcheck" in service:
            commands.append(service["healthcheck"]["test"][1:])
    assert len(commands) >= 7 and env_names
    check_commands(commands, env_names)


def test_every_flag_the_manifests_pass_is_in_the_daemons_help(kubectl: str) -> None:
    """Flags in the pods' commands and probes exist, and each BATON_* variable a pod
    sets is a setting."""
    commands: list[list[str]] = []
    env_names: set[tuple[str, str]] = set()
    for root in KUSTOMIZATIONS:
        for obj in rendered(kubectl, root):
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
    assert len(commands) >= 5 * len(KUSTOMIZATIONS) and env_names
    check_commands(commands, env_names)


def test_ports_agree_everywhere() -> None:
    """gRPC is 7390 in the contract, every registry TOML and compose."""
    assert REGISTRY_PORT == 7390
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["registry-1"]["ports"] == ["7390:7390"]
    assert services["registry-2"]["ports"] == ["7391:7390"]
    for path in DEPLOY.glob("**/registry*.toml"):
        assert tomllib.loads(path.read_text())["listen"].endswith(":7390"), path


def test_ports_agree_in_the_manifests(kubectl: str) -> None:
    """gRPC is 7390 in the ConfigMaps, the pods and the Service; metrics are 9390
    (registry) and 9391 (watcher) in the ConfigMaps, the pods and their annotations."""
    for root in KUSTOMIZATIONS:
        objs = rendered(kubectl, root)
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


def test_registry_probes_ask_grpc_health_with_the_registry_settings(kubectl: str) -> None:
    """Startup, readiness and liveness run registry.health on the mounted TOML."""
    for root in KUSTOMIZATIONS:
        reg = container(find(rendered(kubectl, root), "Deployment", "baton-registry"))
        mounts = {m["mountPath"]: m for m in reg["volumeMounts"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            argv = reg[probe]["exec"]["command"]
            assert argv[:3] == ["/opt/baton/bin/python", "-m", HEALTH], argv
            config = argv[argv.index("--config") + 1]
            assert config in mounts and config == reg["command"][-1]
            timeout = float(argv[argv.index("--timeout") + 1])
            assert timeout < reg[probe]["timeoutSeconds"]
        assert reg["livenessProbe"]["exec"]["command"][-2:] == ["--service", ""]


def test_compose_health_check_is_the_registry_probe() -> None:
    """The compose registries' health check runs registry.health, as the pods' probes do."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["registry-1"]["healthcheck"]["test"][1:4] == ["python", "-m", HEALTH]


def test_every_object_is_in_the_namespace_and_labelled(kubectl: str) -> None:
    """Each namespaced object of each kustomization is in ``baton`` and labelled as
    part of Baton (an overlay's own resources too)."""
    for root in KUSTOMIZATIONS:
        for obj in rendered(kubectl, root):
            meta = obj["metadata"]
            assert meta["labels"]["app.kubernetes.io/part-of"] == "baton", (root, meta)
            if obj["kind"] != "Namespace":
                assert meta.get("namespace") == "baton", (root.name, obj["kind"], meta["name"])


def test_registry_replicas_and_disruption_budget(kubectl: str) -> None:
    """At least two replicas, rolled with none unavailable; the PDB selects exactly
    the registry's pods and lets one go at a time."""
    for root in KUSTOMIZATIONS:
        objs = rendered(kubectl, root)
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


def test_watcher_mounts_the_staging_root_it_watches(kubectl: str) -> None:
    """The DaemonSet's hostPath is the watcher's staging root, writable (it makes task
    directories), and its state file lives on the node too."""
    for root in KUSTOMIZATIONS:
        objs = rendered(kubectl, root)
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


def test_watcher_unit_may_write_the_staging_root_it_watches() -> None:
    """The unit's ReadWritePaths= and RequiresMountsFor= are the example's staging
    root, and its StateDirectory= holds the example's state file."""
    unit = (DEPLOY / "systemd/baton-watcher.service").read_text()
    example = tomllib.loads((DEPLOY / "watcher.example.toml").read_text())
    assert f"ReadWritePaths={example['staging']}\n" in unit
    assert f"RequiresMountsFor={example['staging']}\n" in unit
    assert "StateDirectory=" + Path(example["state_file"]).parent.name in unit


def pki_names(cert: Path) -> set[str]:
    """The DNS names a certificate deploy/pki.py made is for."""
    from cryptography import x509

    c = x509.load_pem_x509_certificate(cert.read_bytes())
    alt = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(alt.get_values_for_type(x509.DNSName))


def hosts(endpoints: str) -> set[str]:
    return {e.rpartition(":")[0] for e in endpoints.split(",")}


def make_pki(out: Path, *args: str) -> Path:
    subprocess.run([sys.executable, str(DEPLOY / "pki.py"), str(out), *args], check=True,
                   capture_output=True)
    return out


def test_certificates_name_every_host_the_manifests_dial(kubectl: str, tmp_path: Path) -> None:
    """deploy/pki.py --kubernetes makes certificates carrying each etcd member and the
    registry host the Kubernetes settings name (TLS checks the host as written)."""
    made = make_pki(tmp_path / "k", "--kubernetes", "baton")
    objs = rendered(kubectl, KUBE / "overlays/etcd-statefulset")
    assert hosts(config_map_toml(objs, "baton-registry")["etcd"]) <= pki_names(made / "etcd.crt")
    assert hosts(config_map_toml(objs, "baton-watcher")["registry"]) <= pki_names(
        made / "registry.crt")
    assert pki.identity((made / "watcher.crt").read_bytes())[1] == ("watcher",)


def test_certificates_name_every_host_compose_dials(tmp_path: Path) -> None:
    """deploy/pki.py --compose makes certificates carrying each etcd member and registry
    host that the compose settings name."""
    made = make_pki(tmp_path / "c", "--compose")
    compose = DEPLOY / "compose"
    assert hosts(tomllib.loads((compose / "registry.toml").read_text())["etcd"]) <= pki_names(
        made / "etcd.crt")
    assert hosts(tomllib.loads((compose / "watcher.toml").read_text())["registry"]) <= pki_names(
        made / "registry.crt")


# --- kubectl kustomize -----------------------------------------------------------------------


def fake_kubectl(bin_dir: Path, version: str) -> str:
    """A stand-in ``kubectl`` in ``bin_dir`` that answers ``version`` as ``version`` would
    (a kubectl older than 1.27 cannot be installed here); the search path holding it."""
    bin_dir.mkdir()
    said = json.dumps({"clientVersion": {"gitVersion": version}})
    script = bin_dir / "kubectl"
    script.write_text(f"#!/bin/sh\necho '{said}'\n")
    script.chmod(0o755)
    return str(bin_dir)


def test_kubectl_older_than_1_27_or_missing_is_refused_in_one_line(tmp_path: Path) -> None:
    """A kubectl 1.26 (Kustomize v4) or none at all is refused, saying in one line what
    is missing and where to get it; 1.27, and a vendor's build of it, are taken."""
    for version in ("v1.26.15", "v1.20.15"):
        path = fake_kubectl(tmp_path / version, version)
        with pytest.raises(KubectlUnfit) as refused:
            find_kubectl(path)
        said = str(refused.value)
        assert f"is {version}, too old" in said and "\n" not in said, said
        assert ">= 1.27 (Kustomize v5)" in said and "https://dl.k8s.io/release/" in said, said
    with pytest.raises(KubectlUnfit, match=r"^no kubectl on PATH; .*>= 1\.27") as refused:
        find_kubectl(str(tmp_path / "nowhere"))
    assert "\n" not in str(refused.value)
    for version in ("v1.27.0", "v1.32.4-gke.100"):
        path = fake_kubectl(tmp_path / version, version)
        assert find_kubectl(path) == str(tmp_path / version / "kubectl")
    silent = fake_kubectl(tmp_path / "silent", "")
    with pytest.raises(KubectlUnfit, match="gave no version"):
        find_kubectl(silent)


def config_map_references(obj: dict[str, Any]) -> list[str]:
    """The ConfigMaps a workload's pods mount."""
    pod = obj["spec"]["template"]["spec"]
    return [v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v]


def test_generated_config_maps_are_named_by_their_content(kubectl: str, tmp_path: Path) -> None:
    """Each kustomization's ConfigMaps are ``baton-registry-``/``baton-watcher-`` and a
    hash, the pods mount those; a changed TOML renames its ConfigMap only, and the pods
    follow (docs/deploy.md: a change rolls the pods)."""
    for root in KUSTOMIZATIONS:
        objs = rendered(kubectl, root)
        maps = {o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"}
        assert len(maps) == 2 and all(
            re.fullmatch(r"baton-(registry|watcher)-[a-z0-9]{10}", m) for m in maps), maps
        mounted = [m for o in objs if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
                   for m in config_map_references(o)]
        assert sorted(mounted) == sorted(maps), (root.name, mounted)
    before = rendered(kubectl, KUBE / "overlays/external-etcd")
    shutil.copytree(KUBE, tmp_path / "kubernetes")
    overlay = tmp_path / "kubernetes/overlays/external-etcd"
    with (overlay / "registry.toml").open("a") as toml:
        toml.write('log_level = "DEBUG"\n')
    after = rendered(kubectl, overlay)
    for name, changed in (("baton-registry", True), ("baton-watcher", False)):
        old, new = find(before, "ConfigMap", name), find(after, "ConfigMap", name)
        assert (old["metadata"]["name"] != new["metadata"]["name"]) == changed, name
    assert config_map_references(find(after, "Deployment", "baton-registry")) == [
        find(after, "ConfigMap", "baton-registry")["metadata"]["name"]]


def test_the_docs_apply_and_name_what_the_manifests_make(kubectl: str) -> None:
    """Each ``kubectl apply -k`` of docs/deploy.md and of the kustomizations' comments
    names a kustomization rendered here; the Secrets the docs create are the ones the
    pods mount (one overlay's only where the docs say so); what the docs wait on and
    dial exists in every overlay."""
    doc = (ROOT / "docs/deploy.md").read_text()
    comments = "".join(p.read_text() for p in KUBE.glob("**/kustomization.yaml"))
    applied = set(re.findall(r"kubectl apply -k (\S+)", doc + comments))
    assert applied and {ROOT / a for a in applied} <= set(KUSTOMIZATIONS), applied
    assert 'kubectl kustomize "$d"' in doc, "the offline check renders with kubectl"
    secrets = {name: only for name, only in re.findall(
        r"^ *secret (\S+) \S+ *(?:#.*?(overlays/\S+) only)?", doc, re.MULTILINE)}
    waited = re.findall(r"kubectl -n (\S+) rollout status (deploy|ds)/(\S+)", doc)
    dialled = re.findall(r"`([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)`", doc)
    assert len(secrets) >= 4 and len(waited) == 2 and dialled
    kinds = {"deploy": "Deployment", "ds": "DaemonSet"}
    mounted: set[str] = set()
    for root in KUSTOMIZATIONS[1:]:
        objs = rendered(kubectl, root)
        here = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
                for o in objs}
        for namespace, kind, name in waited:
            assert (kinds[kind], namespace, name) in here, (root.name, kind, name)
        for name, namespace, port in dialled:
            service = here[("Service", namespace, name)]
            assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
        for obj in objs:
            if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
                for volume in obj["spec"]["template"]["spec"]["volumes"]:
                    if "secret" in volume:
                        name = volume["secret"]["secretName"]
                        assert secrets.get(name) in ("", f"overlays/{root.name}"), (root, name)
                        mounted.add(name)
    assert set(secrets) == mounted, (secrets, mounted)


NUMBERS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def test_the_docs_list_every_overlay_in_the_tree() -> None:
    """docs/deploy.md's Kubernetes section counts the overlays under
    deploy/kubernetes/overlays and lists each in its table, and only those."""
    doc = (ROOT / "docs/deploy.md").read_text()
    tree = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
    said = re.search(r"\) and\s+(\w+) overlays:\n\n(.*?)\n\n", doc, re.DOTALL)
    assert said, "docs/deploy.md: no \"... and N overlays:\" before the overlay table"
    count, table = said.groups()
    listed = re.findall(r"^\| `overlays/([^`]+)` \|", table, re.MULTILINE)
    assert sorted(listed) == tree, (listed, tree)
    assert count == NUMBERS[len(tree)], f"docs/deploy.md says {count} overlays, the tree has " \
        f"{len(tree)}"


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
    answers 0 (as ``python -m baton_relay.registry.edge.health`` too); without them, or with nothing
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


# --- every deployment archives -----------------------------------------------------------

def archives(config: dict[str, Any]) -> str:
    """Where a registry TOML archives to ("dir" or "s3"), refused if to neither or both."""
    kinds = [k for k, key in (("dir", "archive_dir"), ("s3", "archive_s3_bucket"))
             if config.get(key)]
    assert len(kinds) == 1, f"a registry must archive to one store, not {kinds or 'none'}"
    return kinds[0]


def test_every_rendered_kubernetes_registry_archives(kubectl: str) -> None:
    """Each kustomization's registry archives: to S3 with the Secret's credentials in
    its environment, or to a directory on a ReadWriteMany volume every replica mounts."""
    stores = {}
    for root in KUSTOMIZATIONS:
        objs = rendered(kubectl, root)
        config = config_map_toml(objs, "baton-registry")
        stores[root.name] = kind = archives(config)
        registry = container(find(objs, "Deployment", "baton-registry"))
        if kind == "s3":
            env = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
                   for e in registry.get("env", ()) if "valueFrom" in e}
            assert env == {"AWS_ACCESS_KEY_ID": "baton-archive-s3",
                           "AWS_SECRET_ACCESS_KEY": "baton-archive-s3"}
            continue
        mount = next(m for m in registry["volumeMounts"]
                     if m["mountPath"] == config["archive_dir"])
        volume = next(v for v in find(objs, "Deployment", "baton-registry")["spec"]["template"]
                      ["spec"]["volumes"] if v["name"] == mount["name"])
        claim = find(objs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert stores["base"] == "s3" and "dir" in stores.values()


def test_compose_registries_archive_to_one_shared_volume() -> None:
    """Both compose replicas archive to the directory of one named volume they mount."""
    compose = yaml.safe_load(COMPOSE.read_text())
    config = tomllib.loads((DEPLOY / "compose/registry.toml").read_text())
    assert archives(config) == "dir"
    registries = [s for name, s in compose["services"].items() if name.startswith("registry")]
    assert len(registries) == 2
    for service in registries:
        assert f"archive:{config['archive_dir']}" in service["volumes"]
    assert "archive" in compose["volumes"]


def test_systemd_registry_may_write_the_archive_it_is_given() -> None:
    """The example settings archive to a directory the unit's sandbox lets it write."""
    config = tomllib.loads((DEPLOY / "registry.example.toml").read_text())
    assert archives(config) == "dir"
    unit = (DEPLOY / "systemd/baton-registry.service").read_text()
    state = re.search(r"^StateDirectory=(\S+)", unit, re.M)
    writable = re.search(r"^ReadWritePaths=(\S+)", unit, re.M)
    assert state and writable
    assert config["archive_dir"] == f"/var/lib/{state.group(1)}" == writable.group(1)
    dropin = (DEPLOY / "systemd/baton-registry-s3.conf").read_text()
    assert "EnvironmentFile=" in dropin and "archive_s3_bucket" in dropin
