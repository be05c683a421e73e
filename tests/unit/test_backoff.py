"""Baton's one backoff: exponential, capped, jittered, and the only one in the code."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from baton_relay.client.retry import RetryPolicy
from baton_relay.kernel.backoff import Backoff, upper
from baton_relay.local.supervisor import RestartPolicy

ROOT = Path(__file__).resolve().parents[2]


def test_the_bound_grows_by_its_factor_up_to_the_cap() -> None:
    """The bound is 0 before any failure, initial after the first, times factor per
    failure, never above the cap, and stays the cap however many failures (no overflow)."""
    b = Backoff(0.1, 1.0, jitter=upper)
    assert [b.delay(n) for n in range(6)] == pytest.approx([0.0, 0.1, 0.2, 0.4, 0.8, 1.0])
    assert b.delay(10**6) == 1.0
    assert Backoff(1.0, 60.0, factor=3.0, jitter=upper).delay(3) == 9.0
    assert Backoff(5.0, 5.0, factor=1.0, jitter=upper).delay(40) == 5.0


def test_a_wait_is_drawn_between_the_floor_and_the_bound() -> None:
    """Full jitter draws in [0, bound], a floor of 0.5 in [bound/2, bound], and the draws
    spread (callers that failed together come back apart)."""
    rng = random.Random(7)
    full = [Backoff(0.1, 1.0, jitter=rng.uniform).delay(4) for _ in range(500)]
    assert all(0 <= d <= 0.8 for d in full) and min(full) < 0.1 and max(full) > 0.7
    half = [Backoff(1.0, 60.0, floor=0.5, jitter=rng.uniform).delay(3) for _ in range(500)]
    assert all(2.0 <= d <= 4.0 for d in half) and len(set(half)) > 400


def test_a_backoff_that_cannot_be_is_refused() -> None:
    """Negative times or factors, or a floor outside 0..1, are refused when made."""
    for bad in ({"initial": -1.0, "cap": 1.0}, {"initial": 1.0, "cap": -1.0},
                {"initial": 1.0, "cap": 2.0, "factor": -2.0},
                {"initial": 1.0, "cap": 2.0, "floor": 1.5}):
        with pytest.raises(ValueError, match="a backoff needs"):
            Backoff(**bad)  # type: ignore[arg-type]


def test_the_client_and_the_supervisor_wait_with_it() -> None:
    """The client's retry policy and baton up's restart policy give Backoff's waits."""
    assert [RetryPolicy(initial=0.1, cap=0.4, jitter=upper).wait(n) for n in (1, 2, 3, 4)] \
        == pytest.approx([0.1, 0.2, 0.4, 0.4])
    assert [RestartPolicy(initial=0.5, cap=8.0, jitter=upper).delay(n) for n in (0, 1, 5)] \
        == [0.5, 0.5, 8.0]


#: an exponent of a count of failures or attempts, as a hand-written backoff has it
HAND_WRITTEN = re.compile(r"\*\*[^#]{0,24}?(attempt|failure|retr|crash|recent)", re.I)


def test_no_other_backoff_formula_is_written() -> None:
    """Outside kernel/backoff.py, no module of Baton's packages raises anything to the
    power of an attempt, failure, retry or crash count: they all wait with Backoff."""
    found = []
    for package in ("kernel", "client", "registry", "watcher", "local"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "backoff.py" or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if HAND_WRITTEN.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
    for user in ("client/retry.py", "registry/store/txn.py",
                 "registry/rules/core.py",
                 "local/supervisor.py", "watcher/sync.py"):
        assert "Backoff(" in (ROOT / user).read_text(), user
