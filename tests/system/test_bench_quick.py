"""The benchmark's quick mode runs every scenario end to end and writes its report."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tools import require

SCENARIOS = ("Claims", "Producer loops", "The stack", "Batches", "Scale", "Watcher",
             "CLI startup", "Lifetime", "At rest")


@pytest.mark.slow
def test_quick_benchmark_writes_every_scenario(tmp_path: Path) -> None:
    """`python -m bench --quick --out FILE` writes a table and no failure for each scenario."""
    require("postgres")
    out = tmp_path / "report.md"
    env = dict(os.environ)
    # The suite's etcd (CI runs it on 3.4 and 3.5) is the benchmark's etcd too.
    if env.get("BATON_TEST_ETCD"):
        env["BATON_BENCH_ETCD"] = env["BATON_TEST_ETCD"]
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
        timeout=480, check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    report = out.read_text()
    assert "## Machine" in report
    for title in SCENARIOS:
        section = report.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
        assert re.search(r"^\|---\|", section, re.MULTILINE), f"no table under {title}"
        assert "FAILED" not in section
    for plot in re.findall(r"!\[\]\((benchmarks/[\w.]+\.png)\)", report):
        assert (tmp_path / plot).stat().st_size > 0


def test_the_full_run_leaves_out_the_long_scenarios_unless_named() -> None:
    """`python -m bench` runs every scenario but the lifetime (hours at full size); named,
    or with --quick, the lifetime runs too."""
    from bench.__main__ import LONG, SCENARIOS, parse

    assert LONG == ("lifetime",)
    assert parse([]).only == [s for s in SCENARIOS if s != "lifetime"]
    assert parse(["--quick"]).only == list(SCENARIOS)
    assert parse(["--only", "lifetime"]).only == ["lifetime"]
    assert parse(["--only", "claims,lifetime"]).only == ["claims", "lifetime"]


def test_the_rest_scenario_runs_etcd_as_baton_up_does() -> None:
    """The rest scenario's etcd has `baton up`'s flags (local.stack.ETCD_UPKEEP), the
    compaction retention and the progress interval set; its durations read as etcd's."""
    from baton_relay.local.stack import ETCD_UPKEEP
    from bench.rest import etcd_flags, notify_interval, seconds_of

    assert etcd_flags("1m", notify_interval()) == ETCD_UPKEEP
    flags = etcd_flags("5s", "1s")
    assert "--auto-compaction-retention=5s" in flags
    assert "--experimental-watch-progress-notify-interval=1s" in flags
    assert len(flags) == len(ETCD_UPKEEP)
    assert [seconds_of(d) for d in ("1m", "5s", "200ms", "1h", "2")] == [
        60.0, 5.0, 0.2, 3600.0, 7200.0]


def test_the_rest_scenario_reads_counters_by_label() -> None:
    """Prometheus samples summed by name (with or without _total) and labels."""
    from bench.rest import total

    samples = {'baton_grpc_calls_total{code="OK",method="ListEntries"}': 3.0,
               'baton_grpc_calls_total{code="NOT_FOUND",method="ListEntries"}': 1.0,
               'baton_grpc_calls_total{code="OK",method="Watch"}': 7.0,
               'baton_grpc_calls_created{code="OK",method="Watch"}': 1e9,
               "baton_watcher_stream_snapshots_total": 2.0}
    assert total(samples, "baton_grpc_calls", method="ListEntries") == 4.0
    assert total(samples, "baton_grpc_calls") == 11.0
    assert total(samples, "baton_watcher_stream_snapshots") == 2.0
