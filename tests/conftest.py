"""Shared fixtures: one real etcd for the whole session, a fresh key prefix per test.

Like kazoo's test harness, the server is never restarted between tests; isolation
comes from giving every test its own key prefix and staging directory. When a test
fails, the tail of every daemon log it used is attached to its report.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable
from uuid import uuid4

import pytest

from baton_relay.local.etcdproc import EtcdProcess

#: the tiers' folders (README, "Tests"): unit, integration (the session's etcd,
#: registries in process), system (processes, private etcds, deploy files, docs)
TIERS = ("unit", "integration", "system")
# Test modules share helpers by name across tiers (``from test_cli import invoke``): each
# tier's folder is on the import path, as pytest puts the folder of a test it collects.
for _tier in TIERS:
    sys.path.insert(0, str(Path(__file__).parent / _tier))

# Real registry replicas (tests/registry_fixtures.py), built on the fixtures below.
pytest_plugins = ["registry_fixtures", "watcher_fixtures", "s3_fixtures"]

#: where pytest_runtest_makereport files each phase's report ("setup", "call", "teardown")
phase_report_key = pytest.StashKey[dict[str, pytest.TestReport]]()

LOG_TAIL_LINES = 30


def pytest_configure(config: pytest.Config) -> None:
    """Tests stop CLI processes with SIGINT (Ctrl-C). A shell without job control starts
    a background command (``make test &``) with SIGINT ignored, which its children
    inherit, and a Python started with SIGINT ignored never raises KeyboardInterrupt:
    the processes would not stop. Catching it here puts it back to the default in the
    children (exec resets caught signals, not ignored ones)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@runtime_checkable
class HasLogTail(Protocol):
    """A fixture value whose log is worth reading when a test fails (EtcdProcess, ...)."""

    def log_tail(self, n: int = ...) -> str: ...


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item and attach daemon log tails to failures."""
    report = yield
    item.stash.setdefault(phase_report_key, {})[report.when] = report
    if report.failed and isinstance(item, pytest.Function):
        # funcargs holds every fixture the test used, directly or through other fixtures.
        for name, value in item.funcargs.items():
            if isinstance(value, HasLogTail):
                report.sections.append(
                    (f"{name} log (last {LOG_TAIL_LINES} lines)", value.log_tail(LOG_TAIL_LINES))
                )
    return report


def has_failed(request: pytest.FixtureRequest) -> bool:
    """Whether the test that ``request`` belongs to has failed so far (for fixture teardown)."""
    reports = request.node.stash.get(phase_report_key, {})
    return any(report.failed for report in reports.values())


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """A real single-member etcd shared by the whole session."""
    root = tmp_path_factory.mktemp("etcd")
    # BATON_TEST_ETCD picks the etcd binary, so CI runs the suite on 3.4 and 3.5.
    binary = os.environ.get("BATON_TEST_ETCD") or None
    process = EtcdProcess(root / "data", log_path=root / "etcd.log", binary=binary)
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses, so tests never see each other's keys."""
    return f"/baton-test/{uuid4().hex}/"


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    """An empty staging root private to the test."""
    path = tmp_path / "staging"
    path.mkdir()
    return path


@pytest.fixture
def wait_for() -> Callable[..., None]:
    """Poll a condition until it holds, failing after a deadline (never a bare sleep)."""

    def wait(condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() >= deadline:
                pytest.fail(f"timed out after {timeout:g} s waiting for {what or condition}")
            time.sleep(0.02)

    return wait


# --- registry fixtures (added by the registry work) ---
