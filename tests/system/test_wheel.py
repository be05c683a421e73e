"""The distribution: a wheel and an sdist build, and the wheel alone, installed into a
fresh virtualenv, runs the CLI, a registry and a watcher (which catches a module or
a data file the packaging leaves out).

The fresh virtualenv gets its dependencies from the package index, as a user's
would; run from a directory outside the repository, so nothing is imported from
the source tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import allow_suite_etcd

from baton_relay.local.etcdproc import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, **kw)
    assert done.returncode == 0, f"{argv}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # From a copy: building writes build/ and *.egg-info beside the sources.
    tree = tmp_path_factory.mktemp("tree") / "baton"
    shutil.copytree(ROOT, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
          str(out), str(tree)])
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
          f"b.build_sdist({str(out)!r})"], cwd=tree)
    return out


@pytest.mark.slow
def test_the_wheel_and_sdist_carry_every_package_and_data_file(dist: Path) -> None:
    """Both hold the kernel, the three packages, the local stack, the contract and its
    stubs."""
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("kernel/proto/baton/v1/baton.proto", "kernel/v1/baton_pb2.py", "kernel/py.typed",
                   "kernel/pki.py", "client/py.typed", "local/stack.py", "local/etcdproc.py",
                   "local/cli.py", "registry/records/identity.py", "watcher/taskdirs.py",
                   "watcher/py.typed"):
        assert f"baton_relay/{needed}" in names, needed
    # one import root, named after the distribution: nothing else at the top
    assert {n.split("/")[0] for n in names} == {"baton_relay", wheel.name.split("-")[0] + "-"
                                                + wheel.name.split("-")[1] + ".dist-info"}
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md",
            "kernel/proto/baton/v1/baton.proto", "__init__.py"} <= members
    # the packages pyproject.toml lists are every package folder of the repository
    packages = {n.rsplit("/", 1)[0].replace("/", ".") for n in names
                if n.endswith("/__init__.py")}
    folders = {"baton_relay." + str(p.parent.relative_to(ROOT)).replace("/", ".")
               for top in ("kernel", "client", "registry", "watcher", "local", "testing")
               for p in (ROOT / top).rglob("__init__.py")} | {"baton_relay"}
    assert packages == folders, packages ^ folders


@pytest.mark.slow
def test_the_wheel_runs_from_a_fresh_virtualenv(dist: Path, tmp_path: Path,
                                                etcd: Any) -> None:
    """The wheel with its `local` extra, alone in a new virtualenv: `baton`,
    `baton-registry` and `baton-watcher` start, serve, and talk to each other."""
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BATON_", "PYTHON", "VIRTUAL_ENV"))}
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
          f"{wheel}[local]"], env=env, cwd=tmp_path)
    bin_ = venv / "bin"
    version = _run([str(bin_ / "baton"), "--version"], env=env, cwd=tmp_path)
    assert "version" in version.stdout
    where = _run([str(bin_ / "python"), "-c", "from baton_relay import client, registry, watcher;"
                  " print(client.__file__, registry.__file__, watcher.__file__)"],
                 env=env, cwd=tmp_path).stdout
    assert str(ROOT) not in where and str(venv) in where
    port = free_port()
    staging = tmp_path / "staging"
    staging.mkdir()
    with (tmp_path / "registry.log").open("w") as rlog, \
            (tmp_path / "watcher.log").open("w") as wlog:
        registry = subprocess.Popen(
            [str(bin_ / "baton-registry"), "--insecure", "--etcd", etcd.endpoint,
             *allow_suite_etcd(), "--listen", f"127.0.0.1:{port}", "--staging", str(staging),
             "--prefix", f"/wheel-{port}/"], stdout=rlog, stderr=subprocess.STDOUT,
            env=env, cwd=tmp_path)
        watcher = None
        try:
            wait_ready(lambda: "listening on" in (tmp_path / "registry.log").read_text(),
                       registry, daemon="registry", log_path=tmp_path / "registry.log",
                       timeout=60)
            watcher = subprocess.Popen(
                [str(bin_ / "baton-watcher"), "--registry", f"127.0.0.1:{port}",
                 "--staging", str(staging)], stdout=wlog, stderr=subprocess.STDOUT,
                env=env, cwd=tmp_path)
            wait_ready(lambda: "baton-watcher watching" in
                       (tmp_path / "watcher.log").read_text(), watcher, daemon="watcher",
                       log_path=tmp_path / "watcher.log", timeout=60)
            listed = _run([str(bin_ / "baton"), "--registry", f"127.0.0.1:{port}", "task",
                           "ls", "-o", "json"], env=env, cwd=tmp_path)
            assert listed.stdout.strip() == "[]"
        finally:
            for proc in (watcher, registry):
                if proc is not None:
                    proc.terminate()
                    proc.wait(30)
