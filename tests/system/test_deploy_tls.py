"""Every registry a deployment file starts reaches its etcd the way that etcd requires.

Each kustomization under deploy/kubernetes (found in the tree, not listed here) is
rendered with ``kubectl kustomize``, and deploy/compose/compose.yaml read. What an etcd
requires comes from the etcd itself, never from the registry settings being checked:
an etcd the rendering deploys, from its own flags and ``ETCD_*`` variables (https
client URLs mean TLS; ``--client-cert-auth``, or ``--trusted-ca-file``, which turns it
on whatever the former says, mean a client certificate); an etcd outside it, from what
docs/deploy.md promises every deployment's etcd is (mutual TLS). Each registry
container's settings are then loaded as the registry loads them (its TOML from the
ConfigMap or config it mounts, its ``BATON_*`` variables, its flags), and must carry
``etcd_ca`` towards a TLS etcd and ``etcd_cert``/``etcd_key`` towards one that wants a
client certificate, each a file a volume of the registry's own pod provides.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from test_deploy import COMPOSE, DEPLOY, KUBE, ROOT, KubectlUnfit, find_kubectl, kustomize

from baton_relay.registry.edge.config import RegistryConfig
from baton_relay.registry.edge.config import load_config as registry_config

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
#: every directory under deploy/kubernetes that kustomize builds: the base and each overlay
KUSTOMIZATIONS = sorted({p.parent for name in KUSTOMIZATION_FILES for p in KUBE.rglob(name)})
#: what docs/deploy.md promises of every deployment's etcd, the external one included
MUTUAL_TLS_PROMISE = ("Everything speaks mutual TLS", "the registry presents its own client "
                      "certificate to etcd")
TLS_SETTINGS = ("etcd_ca", "etcd_cert", "etcd_key")
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod")


# --- what an etcd requires ----------------------------------------------------------------


@dataclass(frozen=True)
class Etcd:
    """An etcd as its clients see it: where it is, and what it asks of them."""

    where: str
    tls: bool
    client_certs: bool
    client_ports: frozenset[int] = frozenset()

    def required(self) -> tuple[str, ...]:
        """The registry settings a client of this etcd cannot do without."""
        if self.client_certs:
            return TLS_SETTINGS
        return ("etcd_ca",) if self.tls else ()


def etcd_settings(argv: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """etcd's settings from its flags and ``ETCD_*`` variables (a flag wins)."""
    found = {k[5:].lower().replace("_", "-"): v for k, v in env.items() if k.startswith("ETCD_")}
    args = list(argv)
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        name, eq, value = arg.lstrip("-").partition("=")
        if not eq:
            following = args[i + 1] if i + 1 < len(args) else ""
            value = "true" if not following or following.startswith("-") else following
        found[name] = value
    return found


def etcd_requires(where: str, argv: Sequence[str], env: Mapping[str, str]) -> Etcd:
    settings = etcd_settings(argv, env)
    # etcd's default: plain HTTP on localhost
    urls = settings.get("listen-client-urls", "http://localhost:2379").split(",")
    tls = all(u.startswith(("https://", "unixs://")) for u in urls)
    certs = tls and (settings.get("client-cert-auth", "false").lower() == "true"
                     or bool(settings.get("trusted-ca-file")))
    ports = frozenset(int(u.rsplit(":", 1)[1]) for u in urls if re.search(r":\d+$", u))
    return Etcd(where, tls, certs, ports)


def external_etcd() -> Etcd:
    """An etcd no deployment file starts: what docs/deploy.md says every etcd is."""
    doc = " ".join((ROOT / "docs/deploy.md").read_text().split())
    missing = [p for p in MUTUAL_TLS_PROMISE if p not in doc]
    assert not missing, f"docs/deploy.md no longer promises {missing}: update this test"
    return Etcd("an etcd outside the deployment (docs/deploy.md)", True, True)


def is_etcd(argv: Sequence[str], image: str) -> bool:
    if argv:
        return PurePosixPath(argv[0]).name == "etcd"
    return image.rsplit("/", 1)[-1].split(":")[0].split("@")[0] == "etcd"


def test_etcd_requirements_are_read_from_the_etcd() -> None:
    """The reading of an etcd's flags and variables this file relies on."""
    plain = etcd_requires("e", ["etcd"], {})
    assert (plain.tls, plain.client_certs, plain.required()) == (False, False, ())
    https = etcd_requires("e", ["etcd", "--listen-client-urls", "https://0.0.0.0:2379"], {})
    assert (https.tls, https.client_certs, https.required()) == (True, False, ("etcd_ca",))
    assert https.client_ports == {2379}
    for argv, env in (
            (["etcd", "--listen-client-urls=https://0.0.0.0:2379", "--client-cert-auth"], {}),
            (["etcd", "--client-cert-auth", "--listen-client-urls=https://0.0.0.0:2379"], {}),
            (["etcd", "--listen-client-urls=https://0.0.0.0:2379", "--trusted-ca-file=/ca"], {}),
            (["etcd"], {"ETCD_LISTEN_CLIENT_URLS": "https://0.0.0.0:2379",
                        "ETCD_CLIENT_CERT_AUTH": "true"})):
        assert etcd_requires("e", argv, env).required() == TLS_SETTINGS, (argv, env)
    mixed = ["etcd", "--listen-client-urls=https://a:2379,http://b:2379", "--client-cert-auth"]
    assert etcd_requires("e", mixed, {}).required() == ()


# --- Kubernetes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kubectl() -> str:
    try:
        return find_kubectl()
    except KubectlUnfit as e:
        pytest.skip(str(e))


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "Pod":
        return dict(obj["spec"])
    if obj["kind"] == "CronJob":
        return dict(obj["spec"]["jobTemplate"]["spec"]["template"]["spec"])
    return dict(obj["spec"]["template"]["spec"])


def pod_labels(obj: dict[str, Any]) -> dict[str, str]:
    if obj["kind"] == "Pod":
        return dict(obj["metadata"].get("labels", {}))
    if obj["kind"] == "CronJob":
        return dict(obj["spec"]["jobTemplate"]["spec"]["template"]["metadata"].get("labels", {}))
    return dict(obj["spec"]["template"]["metadata"].get("labels", {}))


def namespace(obj: dict[str, Any]) -> str:
    return str(obj["metadata"].get("namespace", "default"))


def argv_of(c: dict[str, Any]) -> list[str]:
    return [*c.get("command", []), *c.get("args", [])]


def env_of(c: dict[str, Any]) -> dict[str, str]:
    """A container's literal variables (a value from a Secret stands as a placeholder)."""
    return {e["name"]: str(e["value"]) if "value" in e else f"<{e['name']} from a reference>"
            for e in c.get("env", [])}


@dataclass(frozen=True)
class Pod:
    """One container of one workload's pods, with what a client finds it by."""

    workload: dict[str, Any]
    container: dict[str, Any]

    @property
    def where(self) -> str:
        w = self.workload
        return f"{w['kind']} {namespace(w)}/{w['metadata']['name']} ({self.container['name']})"


def containers(objs: Sequence[dict[str, Any]]) -> Iterator[Pod]:
    for obj in objs:
        if obj["kind"] in WORKLOADS:
            spec = pod_spec(obj)
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                yield Pod(obj, c)


def port_number(pod: Pod, port: int | str) -> int | None:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in pod.container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    return None


def service_names(service: dict[str, Any], client_ns: str) -> list[str]:
    """The DNS names a pod in ``client_ns`` reaches ``service`` by."""
    name, ns = service["metadata"]["name"], namespace(service)
    names = [f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]
    return [name, *names] if ns == client_ns else names


def resolve(objs: Sequence[dict[str, Any]], client_ns: str, host: str, port: int
            ) -> tuple[dict[str, Any], list[Pod], int] | None:
    """The Service ``host`` names in the rendering, the pods it leads to, and the port
    they receive on; None for a host the rendering does not name."""
    for svc in (o for o in objs if o["kind"] == "Service"):
        selector = svc["spec"].get("selector") or {}
        selected = [p for p in containers(objs) if namespace(p.workload) == namespace(svc)
                    and selector and selector.items() <= pod_labels(p.workload).items()]
        names = service_names(svc, client_ns)
        if host in names:
            for sp in svc["spec"].get("ports", []):
                if sp["port"] == port:
                    target = sp.get("targetPort", sp["port"])
                    ports = [n for p in selected if (n := port_number(p, target)) is not None]
                    return svc, selected, ports[0] if ports else -1
            return svc, selected, -1
        # a member of a StatefulSet governed by a headless Service: POD.SERVICE...
        pod_name, _, rest = host.partition(".")
        if rest in names and svc["spec"].get("clusterIP") == "None":
            members = [p for p in selected if p.workload["kind"] == "StatefulSet"
                       and p.workload["spec"].get("serviceName") == svc["metadata"]["name"]
                       and re.fullmatch(rf"{re.escape(p.workload['metadata']['name'])}-(\d+)",
                                        pod_name)
                       and int(pod_name.rsplit("-", 1)[1]) < p.workload["spec"].get("replicas", 1)]
            return svc, members, port
    return None


def etcd_of(objs: Sequence[dict[str, Any]], client_ns: str, endpoint: str) -> Etcd:
    """What the etcd ``endpoint`` (host:port, as the registry's ``etcd`` writes it)
    requires: the one the rendering deploys there, else an external one."""
    host, _, port = endpoint.strip().rpartition(":")
    found = resolve(objs, client_ns, host.strip("[]"), int(port))
    if found is None:
        return external_etcd()
    svc, pods, target = found
    etcds = [p for p in pods if is_etcd(argv_of(p.container), p.container.get("image", ""))]
    assert etcds, f"{endpoint} is Service {svc['metadata']['name']}, which leads to no etcd pod"
    reqs = {etcd_requires(p.where, argv_of(p.container), env_of(p.container)) for p in etcds}
    for req in reqs:
        assert target in req.client_ports, f"{endpoint}: port {target} of {req.where} " \
            f"is not a client port ({sorted(req.client_ports)})"
    # the strictest member decides (a client must satisfy every one)
    return max(reqs, key=lambda r: len(r.required()))


def documented_secret_keys() -> set[str]:
    """The files each Secret docs/deploy.md has created holds (its ``secret()`` helper)."""
    doc = (ROOT / "docs/deploy.md").read_text()
    helper = re.search(r"^ *secret\(\) \{(.*)\}", doc, re.MULTILINE)
    assert helper, "docs/deploy.md creates the Secrets with a secret() helper"
    keys = set(re.findall(r"--from-file=([^=\s]+)=", helper.group(1)))
    assert keys
    return keys


def mounted(objs: Sequence[dict[str, Any]], pod: Pod, path: str) -> str | None:
    """Why ``path`` is no file a volume of the pod gives its container (None: it is)."""
    mounts = [m for m in pod.container.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not mounts:
        return "no volume is mounted there"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in pod_spec(pod.workload).get("volumes", [])}
    volume = volumes.get(mount["name"])
    if volume is None:
        return f"its mount names no volume of the pod ({mount['name']})"
    if mount.get("subPath"):
        if path != mount["mountPath"]:
            return f"mount {mount['mountPath']} is the single file {mount['subPath']}"
        relative = mount["subPath"]
    else:
        relative = str(PurePosixPath(path).relative_to(mount["mountPath"]))
    if "secret" in volume:
        name = volume["secret"]["secretName"]
        items = volume["secret"].get("items")
        if items:
            files = {i["path"] for i in items}
        else:
            made = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == name]
            files = ({k for o in made for k in (*o.get("data", {}), *o.get("stringData", {}))}
                     if made else documented_secret_keys())
        if relative not in files:
            return f"Secret {name} (volume {mount['name']}) holds {sorted(files)}, not {relative}"
        return None
    if "projected" in volume:
        sources = volume["projected"].get("sources", [])
        files = {i["path"] for s in sources for v in s.values() if isinstance(v, dict)
                 for i in v.get("items", [])}
        if files and relative not in files:
            return f"projected volume {mount['name']} holds {sorted(files)}, not {relative}"
        return None
    if "csi" in volume:
        return None
    return f"volume {mount['name']} is {sorted(set(volume) - {'name'})}, not a Secret"


def is_registry(argv: Sequence[str]) -> bool:
    if not argv:
        return False
    if PurePosixPath(argv[0]).name == "baton-registry":
        return True
    return list(argv[1:3]) == ["-m", "baton_relay.registry"]


def config_file(objs: Sequence[dict[str, Any]], pod: Pod, path: str) -> str:
    """The text of the file ``path`` in the container, from the ConfigMap it mounts."""
    mounts = [m for m in pod.container.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{pod.where}: --config {path} is not mounted"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volume = next(v for v in pod_spec(pod.workload)["volumes"] if v["name"] == mount["name"])
    assert "configMap" in volume, f"{pod.where}: --config {path} is not from a ConfigMap"
    key = mount.get("subPath") or str(PurePosixPath(path).relative_to(mount["mountPath"]))
    for item in volume["configMap"].get("items", []):
        if item["path"] == key:
            key = item["key"]
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and namespace(o) == namespace(
        pod.workload) and o["metadata"]["name"] == volume["configMap"]["name"]]
    return str(cm["data"][key])


def load_registry(argv: Sequence[str], env: Mapping[str, str], read: Any,
                  scratch: Path) -> RegistryConfig:
    """The registry's settings as it loads them: its flags, variables and ``--config``
    (``read(path)`` gives that file's text as the container sees it)."""
    args = list(argv[3:] if list(argv[1:3]) == ["-m", "baton_relay.registry"] else argv[1:])
    env = dict(env)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name == "--config":
            path = value if eq else args[i + 1]
            copy = scratch / f"registry-{len(list(scratch.iterdir()))}.toml"
            copy.write_text(read(path))
            if eq:
                args[i] = f"--config={copy}"
            else:
                args[i + 1] = str(copy)
    if "BATON_CONFIG" in env and "--config" not in {a.partition("=")[0] for a in args}:
        copy = scratch / f"registry-{len(list(scratch.iterdir()))}.toml"
        copy.write_text(read(env["BATON_CONFIG"]))
        env["BATON_CONFIG"] = str(copy)
    return registry_config(args, env)


def check_registry(where: str, config: RegistryConfig, etcds: list[Etcd],
                   mounted_why: Any) -> list[str]:
    """What a registry with ``config`` lacks towards ``etcds``."""
    problems = []
    for etcd in etcds:
        for setting in etcd.required():
            value = getattr(config, setting)
            if not value:
                problems.append(f"{where}: no {setting}, and {etcd.where} requires "
                                f"{'a client certificate' if etcd.client_certs else 'TLS'}")
                continue
            why = mounted_why(value)
            if why:
                problems.append(f"{where}: {setting} = {value}: {why}")
    return problems


def kubernetes_problems(objs: Sequence[dict[str, Any]], label: str, scratch: Path
                        ) -> tuple[list[str], int]:
    """What each registry of a rendering lacks towards its etcd, and how many there are."""
    problems: list[str] = []
    registries = [p for p in containers(objs) if is_registry(argv_of(p.container))]
    for pod in registries:
        config = load_registry(argv_of(pod.container), env_of(pod.container),
                               lambda path, pod=pod: config_file(objs, pod, path), scratch)
        etcds = [etcd_of(objs, namespace(pod.workload), e) for e in config.etcd.split(",")]
        problems += check_registry(f"{label}: {pod.where}", config, etcds,
                                   lambda path, pod=pod: mounted(objs, pod, path))
    return list(dict.fromkeys(problems)), len(registries)


def test_kustomizations_are_found_in_the_tree() -> None:
    """The base and every overlay directory are rendered below."""
    overlays = sorted(p for p in (KUBE / "overlays").iterdir() if p.is_dir())
    assert KUBE / "base" in KUSTOMIZATIONS and overlays
    assert set(overlays) <= set(KUSTOMIZATIONS), set(overlays) - set(KUSTOMIZATIONS)


@pytest.mark.parametrize("root", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(KUBE)))
def test_every_registry_carries_the_tls_its_etcd_requires(
        kubectl: str, root: Path, tmp_path: Path) -> None:
    """Each registry container of the rendering has etcd_ca (and etcd_cert, etcd_key) as
    its etcd requires, each a file from a Secret its pod mounts."""
    objs = kustomize(kubectl, root).objects
    problems, registries = kubernetes_problems(objs, str(root.relative_to(KUBE)), tmp_path)
    assert registries, f"{root}: no registry in the rendering"
    assert not problems, "\n".join(problems)


def without_etcd_tls(objs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rendering with etcd_ca, etcd_cert and etcd_key taken out of every registry TOML."""
    out = []
    for obj in objs:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"].startswith("baton-registry"):
            obj = {**obj, "data": {k: re.sub(r"(?m)^etcd_(ca|cert|key)\s*=.*$", "", v)
                                   for k, v in obj["data"].items()}}
        out.append(obj)
    return out


def test_a_registry_without_etcd_tls_is_caught(kubectl: str, tmp_path: Path) -> None:
    """The check fails a registry that drops its etcd settings, naming the etcd the
    rendering deploys where it deploys one, and one whose files are not mounted; and it
    asks nothing of a registry whose etcd the rendering deploys in plain text."""
    for root in KUSTOMIZATIONS:
        objs = kustomize(kubectl, root).objects
        problems, _ = kubernetes_problems(without_etcd_tls(objs), root.name, tmp_path)
        assert any("no etcd_ca" in p for p in problems), (root, problems)
        deployed = [p.where for p in containers(objs)
                    if is_etcd(argv_of(p.container), p.container.get("image", ""))]
        if not deployed:
            continue
        assert all(any(d in p for d in deployed) for p in problems), (root, problems)
        # the same etcd serving plain HTTP: the registry then needs none of it
        plain = yaml.safe_load(yaml.safe_dump(without_etcd_tls(objs)))
        for pod in containers(plain):
            c = pod.container
            if is_etcd(argv_of(c), c.get("image", "")):
                for key in ("command", "args"):
                    c[key] = [a.replace("https://", "http://") for a in c.get(key, [])
                              if not a.startswith(("--client-cert-auth", "--trusted-ca-file"))]
        problems, _ = kubernetes_problems(plain, root.name, tmp_path)
        assert problems == [], (root, problems)
    objs = yaml.safe_load(yaml.safe_dump(list(kustomize(kubectl, KUBE / "base").objects)))
    for pod in containers(objs):
        for m in pod.container.get("volumeMounts", []):
            if m["mountPath"] == "/etc/baton/etcd":
                m["mountPath"] = "/etc/baton/elsewhere"
    problems, _ = kubernetes_problems(objs, "base", tmp_path)
    assert any("etcd_ca = /etc/baton/etcd/ca.crt: no volume is mounted" in p
               for p in problems), problems


# --- compose ------------------------------------------------------------------------------


def compose_argv(service: dict[str, Any]) -> list[str]:
    def words(v: Any) -> list[str]:
        return list(v) if isinstance(v, list) else str(v).split() if v else []
    return [*words(service.get("entrypoint")), *words(service.get("command"))]


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_registries_carry_the_tls_their_etcd_requires(tmp_path: Path) -> None:
    """Each compose registry has the etcd TLS settings its etcd services require, each a
    file the certificate step writes into a volume the registry mounts."""
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    etcds = {name: etcd_requires(f"compose service {name}", compose_argv(s), compose_env(s))
             for name, s in services.items() if is_etcd(compose_argv(s), s.get("image", ""))}
    assert etcds, "compose deploys its etcd"
    # what each named volume holds: the certificates a service writes with deploy/pki.py
    volumes: dict[str, Path] = {}
    for name, service in services.items():
        argv = compose_argv(service)
        if argv and PurePosixPath(argv[0]).name == "baton-pki":
            out = tmp_path / name
            subprocess.run([sys.executable, str(DEPLOY / "pki.py"), str(out), *argv[2:]],
                           check=True, capture_output=True)
            (volume,) = [v.split(":")[0] for v in service["volumes"]
                         if v.split(":")[1] == argv[1]]
            volumes[volume] = out
    problems: list[str] = []
    registries = 0
    for name, service in services.items():
        argv = compose_argv(service)
        if not is_registry(argv):
            continue
        registries += 1
        files = {c["target"]: COMPOSE.parent / compose["configs"][c["source"]]["file"]
                 for c in service.get("configs", [])}
        scratch = tmp_path / f"scratch-{name}"
        scratch.mkdir()
        config = load_registry(argv, compose_env(service),
                               lambda p, files=files: files[p].read_text(), scratch)
        wanted = []
        for endpoint in config.etcd.split(","):
            host = endpoint.strip().rpartition(":")[0]
            wanted.append(etcds.get(host) or external_etcd())
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}

        def why(path: str, mounts: dict[str, str] = mounts) -> str | None:
            under = [t for t in mounts if path.startswith(t.rstrip("/") + "/")]
            if not under:
                return "no volume is mounted there"
            target = max(under, key=len)
            made = volumes.get(mounts[target])
            if made is None:
                return f"volume {mounts[target]} holds no certificates deploy/pki.py made"
            if not (made / PurePosixPath(path).relative_to(target)).is_file():
                return f"deploy/pki.py makes no {PurePosixPath(path).relative_to(target)}"
            return None

        problems += check_registry(f"compose service {name}", config, wanted, why)
    assert registries and not problems, "\n".join(dict.fromkeys(problems))
