"""Many agents racing through two registry replicas: every entry claimed exactly once."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
from registry_fixtures import TEST_RETRY

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

AGENTS = 16
ENTRIES = 200
#: a well-formed digest: the agents publish no file and no watcher compares it
DIGEST = "0" * 64


def test_concurrent_claims_through_two_replicas_are_exclusive(
    registry_factory: Callable,  # type: ignore[type-arg]
) -> None:
    """16 agents on 2 replicas claim 200 entries: each exactly once, none left over."""
    replicas = [registry_factory(), registry_factory()]
    setup = Client(replicas[0].address)
    setup.operator.create_task({
        "task_id": "race",
        "entries": [{"file_id": f"e{i:04d}", "path": f"e{i:04d}"} for i in range(ENTRIES)],
    })
    claims: list[tuple[str, int, str]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    go = threading.Barrier(AGENTS)

    def agent(n: int) -> None:
        try:
            with Client(replicas[n % 2].address, retry=TEST_RETRY) as c, \
                    c.open_session(f"agent-{n}", ttl=30) as s:
                go.wait()
                while True:
                    try:
                        claim = c.claim("race", session=s)
                    except errors.NothingToClaim:
                        return
                    with lock:
                        claims.append((claim.file_id, claim.token, f"agent-{n}"))
                    c.commit("race", claim.file_id, claim.token, 1, DIGEST)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(AGENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures
    counts = Counter(file_id for file_id, _, _ in claims)
    assert len(counts) == ENTRIES and set(counts.values()) == {1}
    # A token is the revision its claim was written at: claims group-committed together
    # share one, each checked against its own entry's claim key; never one entry twice.
    by_token: dict[int, list[str]] = {}
    for file_id, token, _ in claims:
        by_token.setdefault(token, []).append(file_id)
    assert all(len(set(files)) == len(files) for files in by_token.values())
    states = Counter(e.state for e in setup.operator.list_entries("race"))
    assert states == {pb.ENTRY_STATE_WRITTEN: ENTRIES}
    assert len({agent for _, _, agent in claims}) > 1  # the work really was shared


def test_replicas_reap_a_lost_claim_exactly_once(
    registry_factory: Callable,  # type: ignore[type-arg]
) -> None:
    """Three replicas sweeping at once move a lost claim's entry on once (one retry)."""
    replicas = [registry_factory(reap_interval=0.05) for _ in range(3)]
    c = Client(replicas[0].address)
    c.operator.create_task({"task_id": "t", "entries": [{"file_id": f"e{i}", "path": f"e{i}"}
                                                for i in range(20)]})
    s = c.open_session("doomed", ttl=10, keepalive=False)
    for _ in range(20):
        c.claim("t", session=s)
    c.close_session(s.session_id)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        entries = c.operator.list_entries("t")
        if all(e.state == pb.ENTRY_STATE_PENDING for e in entries):
            break
        time.sleep(0.05)
    entries = c.operator.list_entries("t")
    assert [e.retry_count for e in entries] == [1] * 20
    # A reaper counts a move once its transaction has returned, a moment after the
    # entry shows it: wait for the count, then a few more sweeps, and it is 20 still.
    while sum(r.reaper.reaped for r in replicas) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    settle = time.monotonic() + 0.5
    while time.monotonic() < settle:
        time.sleep(0.05)
    assert sum(r.reaper.reaped for r in replicas) == 20
