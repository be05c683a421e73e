"""``deploy/local/etcd-cluster.sh``: the 3-member loopback cluster a developer starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .cluster import SCRIPT, free_base_port

pytestmark = pytest.mark.faults


def script(*args: str) -> str:
    env = {**os.environ, "PYTHON": sys.executable}
    if os.environ.get("BATON_TEST_ETCD"):
        env["BATON_ETCD"] = os.environ["BATON_TEST_ETCD"]
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet (it is not our child)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_start_status_restart_stop(tmp_path: Path) -> None:
    """Three members elect a leader; a killed member comes back with ``start``; ``stop``
    ends them all."""
    data = tmp_path / "cluster"
    base = free_base_port()
    try:
        endpoints = script("start", str(data), str(base)).strip().split(",")
        assert endpoints == [f"127.0.0.1:{base + 2 * n}" for n in range(3)]
        status = script("status", str(data)).splitlines()
        assert len(status) == 3 and sum("LEADER" in line for line in status) == 1
        pid = int((data / "m1.pid").read_text())
        os.kill(pid, 9)
        deadline = time.monotonic() + 10
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"m1 127.0.0.1:{base + 2} pid=- down" in script("status", str(data))
        script("start", str(data))
        status = script("status", str(data)).splitlines()
        assert all(" up " in line for line in status), status
        assert int((data / "m1.pid").read_text()) != pid
    finally:
        script("stop", str(data))
    assert all("pid=- down" in line for line in script("status", str(data)).splitlines())
