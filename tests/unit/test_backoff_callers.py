"""Retries wait with the one backoff (kernel/backoff.py), from the delays they waited
before it: the watcher's checker (a failed hash ``retry_delay`` then twice it, a registry
out of reach 1 s), its reconciliation and its registration (1 s each), the registry's
view (a broken watch 0.2 s) and its sweeps' watch (0.5 s); each grows from there to a
cap."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from baton_relay.registry.rules import sweeping
from baton_relay.registry.store import view
from baton_relay.watcher import checker, daemon, shards

ROOT = Path(__file__).resolve().parents[2]


def test_a_failed_hash_waits_as_it_did_then_grows_to_a_cap() -> None:
    """The waits of the default three attempts are the old ``retry_delay * failures``,
    exactly (no spread); later ones double up to the cap."""
    backoff = checker.hash_backoff(0.2)
    assert [backoff.delay(n) for n in (1, 2)] == [0.2, 0.4]
    assert backoff.delay(3) == 0.8 and backoff.delay(50) == checker.HASH_RETRY_CAP


def test_the_registry_out_of_reach_backs_off_from_one_second() -> None:
    """A check that could not reach the registry waits up to 1 s, then longer for each
    check in a row that could not, spread over half the bound to the bound."""
    backoff = checker.REGISTRY_RETRY
    assert checker.Checker.__dataclass_fields__["registry_backoff"].default is backoff
    assert backoff.bound(1) == checker.REGISTRY_BACKOFF == 1.0
    assert backoff.bound(5) == checker.REGISTRY_BACKOFF_CAP
    assert all(0.5 <= backoff.delay(1) <= 1.0 for _ in range(50))


def test_a_broken_view_watch_backs_off_from_its_old_delay() -> None:
    """The view sets a broken watch up again after up to 0.2 s, growing to 2 s."""
    assert view.REWATCH.bound(1) == view.REWATCH_DELAY == 0.2
    assert view.REWATCH.bound(10) == view.REWATCH_CAP
    assert all(0.1 <= view.REWATCH.delay(1) <= 0.2 for _ in range(50))


@pytest.mark.parametrize(("backoff", "old"), [
    (sweeping.REWATCH, 0.5), (daemon.RECONCILE_BACKOFF, 1.0), (shards.REGISTER_BACKOFF, 1.0),
], ids=["sweeps watch", "reconcile", "register"])
def test_the_other_retries_back_off_from_their_old_delay(backoff: Any, old: float) -> None:
    """The sweeps' watch set up again after 0.5 s, a reconciliation or a registration
    that could not reach the registry after 1 s: the bound after one failure is the old
    fixed delay, later ones grow to a cap of at most 10 s, each wait spread over half its
    bound to it."""
    assert backoff.bound(1) == old
    assert backoff.bound(1) < backoff.bound(2) < backoff.bound(30) == backoff.cap <= 10
    assert all(old / 2 <= backoff.delay(1) <= old for _ in range(50))


#: the calls that wait, and which of their arguments is the delay
WAITS = {"sleep": 0, "submit": 1, "wait": 0, "wait_for": 1}
#: the modules whose retries wait
RETRYING = [ROOT / "registry" / "store" / "view.py", ROOT / "watcher" / "checker.py",
            ROOT / "registry" / "rules" / "sweeping.py", ROOT / "watcher" / "daemon.py",
            ROOT / "watcher" / "shards.py"]


def test_no_retry_waits_a_fixed_delay() -> None:
    """No ``sleep``, ``wait``, ``wait_for`` or job submission in those modules waits a
    bare constant (``REWATCH_DELAY``, ``RECONCILE_RETRY``) or a delay of its own
    arithmetic."""
    for path in RETRYING:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in WAITS and len(node.args) > WAITS[node.func.attr]):
                continue
            delay = node.args[WAITS[node.func.attr]]
            where = f"{path.name}:{node.lineno}"
            assert not (isinstance(delay, ast.Name) and delay.id.isupper()), where
            assert not isinstance(delay, ast.BinOp), where
