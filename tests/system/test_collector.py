"""The daemons' garbage collector: the youngest generation collected every
``--gc-young`` net allocations, what they hold at start frozen out of its walks, and
Python's own settings kept with 0 (kernel/collector.py)."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import allow_suite_etcd

from baton_relay.kernel import collector

LINE_TIMEOUT = 60.0


@pytest.fixture
def restored() -> Iterator[None]:
    """Python's collector as it was before the test."""
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_tune_sets_the_young_threshold_and_freezes_what_is_held(restored: None) -> None:
    older = gc.get_threshold()[1:]
    held = [object() for _ in range(10)]
    collector.tune(12_345)
    assert gc.get_threshold() == (12_345, *older)
    assert gc.get_freeze_count() >= len(held)


def test_zero_keeps_pythons_own_settings(restored: None) -> None:
    before = gc.get_threshold()
    collector.tune(0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_negative_threshold_is_refused(restored: None) -> None:
    before = gc.get_threshold()
    with pytest.raises(ValueError, match="-1"):
        collector.tune(-1)
    assert gc.get_threshold() == before


def _said(proc: subprocess.Popen[str], pattern: str) -> re.Match[str]:
    """The first line of ``proc``'s stderr matching ``pattern`` (within LINE_TIMEOUT)."""
    assert proc.stderr is not None
    found: list[re.Match[str]] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if m := re.search(pattern, line):
                found.append(m)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(LINE_TIMEOUT)
    assert found, f"no line matching {pattern!r} within {LINE_TIMEOUT:.0f} s: {lines}"
    return found[0]


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("young", [None, 777, 0])
def test_the_registry_process_tunes_its_collector(etcd: Any, young: int | None) -> None:
    """By default every 50,000 allocations; ``--gc-young`` another figure; 0 Python's
    own thresholds, untouched (700 at the youngest). Said at DEBUG: a daemon that
    cannot start prints one line only."""
    flag = [] if young is None else ["--gc-young", str(young)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.registry", "--insecure", "--etcd", etcd.endpoint,
         *allow_suite_etcd(), "--listen", "127.0.0.1:0", "--prefix", f"/gc-{young}/",
         "--log-level", "DEBUG", *flag],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if young == 0:
            m = _said(proc, r"collector: Python's own thresholds \((\d+), ")
            assert int(m.group(1)) == gc.get_threshold()[0] == 700
        else:
            m = _said(proc, r"collector: youngest generation every (\d+) allocations; "
                            r"(\d+) objects frozen")
            assert int(m.group(1)) == (young or collector.YOUNG)
            assert int(m.group(2)) > 10_000  # the modules and what they built at import
    finally:
        _stop(proc)


def test_the_watcher_process_tunes_its_collector(tmp_path: Path) -> None:
    """The watcher the same, from its own ``--gc-young`` (before it reaches a registry:
    none listens here)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.watcher", "--registry", "127.0.0.1:9",
         "--staging", str(tmp_path), "--gc-young", "4321", "--log-level", "DEBUG"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        m = _said(proc, r"collector: youngest generation every (\d+) allocations")
        assert int(m.group(1)) == 4321
        assert time.monotonic() - started < LINE_TIMEOUT
    finally:
        _stop(proc)
