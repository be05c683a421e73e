#!/usr/bin/env python3
"""Render a Kustomize directory offline: the subset of kustomize Baton's manifests use.

    python deploy/kustomize.py deploy/kubernetes/overlays/etcd-statefulset > baton.yaml

What it understands in a ``kustomization.yaml`` (anything else is refused, so a
manifest never silently renders differently here and under ``kubectl kustomize``):

- ``resources``: YAML files (several documents each) and directories holding a
  kustomization, rendered first (bases, then overlays on top);
- ``namespace``: set on every namespaced object;
- ``commonLabels``: added to every object's labels, and to the selectors and pod
  templates of workloads, Services and PodDisruptionBudgets, as kustomize does;
- ``configMapGenerator``: ``files`` (``key=path`` or ``path``) and ``literals``,
  ``behavior`` ``create``/``replace``/``merge``; the name gets a suffix hashed from
  the content (so a changed configuration rolls the pods), and references to it from
  pod volumes and ``envFrom``/``valueFrom`` follow;
- ``patches`` with ``path:`` to a strategic-merge patch: maps merge, lists of
  named items (containers, volumes, ports, env) merge by ``name``, other lists are
  replaced, ``$patch: delete`` removes an item;
- ``images``: ``name`` with ``newName`` and/or ``newTag`` (or ``digest``).

The names it generates are not byte-for-byte kustomize's (the hash differs); what
it renders is otherwise what ``kubectl kustomize`` renders for these files.
Needs PyYAML.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

KNOWN = {"apiVersion", "kind", "resources", "namespace", "commonLabels",
         "configMapGenerator", "patches", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass"}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"}

Obj = dict[str, Any]


class KustomizeError(Exception):
    """A kustomization this renderer does not understand, or a broken reference."""


def _key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _load_yaml(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _hash_suffix(obj: Obj) -> str:
    """Ten characters of a hash of the generated object's content."""
    body = json.dumps({"kind": obj["kind"], "name": obj["metadata"]["name"],
                       "data": obj.get("data", {})}, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(body.encode()).hexdigest()[:10]
    # as kustomize does, keep vowels and look-alike digits out of names
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _generate(root: Path, spec: Obj) -> Obj:
    data: dict[str, str] = {}
    for item in spec.get("files", []):
        key, _, rel = item.rpartition("=")
        path = root / rel
        data[key or path.name] = path.read_text()
    for item in spec.get("literals", []):
        key, _, value = item.partition("=")
        data[key] = value
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": spec["name"]}, "data": data}


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge of the simple kind: see the module's docstring."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        out_list = [copy.deepcopy(i) for i in base]
        for item in patch:
            names = [i["name"] for i in out_list]
            if item.get("$patch") == "delete":
                out_list = [i for i in out_list if i["name"] != item["name"]]
            elif item["name"] in names:
                at = names.index(item["name"])
                out_list[at] = merge(out_list[at], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _pod_specs(obj: Obj) -> list[Obj]:
    if obj["kind"] in WORKLOADS:
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    return []


def _containers(pod: Obj) -> list[Obj]:
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def _rename_config_maps(objs: list[Obj], renamed: dict[str, str]) -> None:
    """Point pod volumes and env at the generated (suffixed) ConfigMap names."""
    def fix(ref: Obj, field: str = "name") -> None:
        if ref.get(field) in renamed:
            ref[field] = renamed[ref[field]]

    for obj in objs:
        for pod in _pod_specs(obj):
            for volume in pod.get("volumes", []):
                if "configMap" in volume:
                    fix(volume["configMap"])
                for source in volume.get("projected", {}).get("sources", []):
                    if "configMap" in source:
                        fix(source["configMap"])
            for c in _containers(pod):
                for env_from in c.get("envFrom", []):
                    if "configMapRef" in env_from:
                        fix(env_from["configMapRef"])
                for env in c.get("env", []):
                    ref = env.get("valueFrom", {}).get("configMapKeyRef")
                    if ref:
                        fix(ref)


def _add_labels(obj: Obj, labels: dict[str, str]) -> None:
    obj["metadata"].setdefault("labels", {}).update(labels)
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind in WORKLOADS:
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(labels)
        spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(labels)
    elif kind == "PodDisruptionBudget":
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(labels)
    elif kind == "Service" and spec.get("selector") is not None:
        spec["selector"].update(labels)


def _set_images(objs: list[Obj], images: list[Obj]) -> None:
    for obj in objs:
        for pod in _pod_specs(obj):
            for c in _containers(pod):
                name, sep, tag = c["image"].partition("@")
                if not sep:
                    name, sep, tag = c["image"].rpartition(":")
                    if not sep or "/" in tag:
                        name, sep, tag = c["image"], "", ""
                for image in images:
                    if image["name"] != name:
                        continue
                    new = image.get("newName", name)
                    if "digest" in image:
                        c["image"] = f"{new}@{image['digest']}"
                    elif "newTag" in image:
                        c["image"] = f"{new}:{image['newTag']}"
                    else:
                        c["image"] = new + (("@" if "sha256:" in tag else ":") + tag
                                            if tag else "")


def _render(root: Path) -> tuple[list[Obj], set[str]]:
    """The objects of the kustomization in ``root`` (bases first) and the names of
    the ConfigMaps it generated, not yet suffixed: an overlay may still replace or
    merge them, and the suffix is hashed from what is finally there."""
    file = root / "kustomization.yaml"
    if not file.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    k = yaml.safe_load(file.read_text()) or {}
    unknown = set(k) - KNOWN
    if unknown:
        raise KustomizeError(f"{file}: not supported here: {', '.join(sorted(unknown))}")
    objs: list[Obj] = []
    generators: set[str] = set()
    for res in k.get("resources", []):
        path = root / res
        if path.is_dir():
            sub, made = _render(path)
            objs.extend(sub)
            generators |= made
        else:
            objs.extend(_load_yaml(path))
    index = {_key(o): i for i, o in enumerate(objs)}
    if len(index) != len(objs):
        raise KustomizeError(f"{root}: two resources with the same kind and name")
    for spec in k.get("configMapGenerator", []):
        made_map = _generate(root, spec)
        behavior = spec.get("behavior", "create")
        at = index.get(("ConfigMap", spec["name"]))
        if behavior == "create":
            if at is not None:
                raise KustomizeError(f"ConfigMap {spec['name']} exists: give a behavior")
            index[_key(made_map)] = len(objs)
            objs.append(made_map)
        elif at is None or spec["name"] not in generators:
            raise KustomizeError(f"ConfigMap {spec['name']}: no generated one to {behavior}")
        elif behavior == "replace":
            made_map["metadata"] = objs[at]["metadata"]
            objs[at] = made_map
        elif behavior == "merge":
            objs[at]["data"] = {**objs[at].get("data", {}), **made_map["data"]}
        else:
            raise KustomizeError(f"ConfigMap {spec['name']}: unknown behavior {behavior}")
        generators.add(spec["name"])
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise KustomizeError(f"{file}: only patches with a path are supported")
        for doc in _load_yaml(root / patch["path"]):
            at = index.get(_key(doc))
            if at is None:
                raise KustomizeError(f"patch {patch['path']}: no {_key(doc)} to patch")
            objs[at] = merge(objs[at], doc)
    if k.get("images"):
        _set_images(objs, k["images"])
    for obj in objs:
        if "namespace" in k:
            if obj["kind"] == "Namespace":
                obj["metadata"]["name"] = k["namespace"]
            elif obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
        if k.get("commonLabels"):
            _add_labels(obj, k["commonLabels"])
    return objs, generators


def render(root: Path) -> list[Obj]:
    """The objects the kustomization in ``root`` makes, bases first."""
    objs, generators = _render(root)
    renamed: dict[str, str] = {}
    for obj in objs:
        name = obj["metadata"]["name"]
        if obj["kind"] == "ConfigMap" and name in generators:
            renamed[name] = obj["metadata"]["name"] = f"{name}-{_hash_suffix(obj)}"
    _rename_config_maps(objs, renamed)
    return objs


def render_yaml(root: Path) -> str:
    text: str = yaml.safe_dump_all(render(root), sort_keys=False)
    return text


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        sys.stdout.write(render_yaml(Path(argv[0])))
    except (KustomizeError, OSError, KeyError, yaml.YAMLError) as e:
        print(f"kustomize.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
