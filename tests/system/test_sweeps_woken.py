"""The elected replica's sweeps are woken by what is written, not by a timer (issue 39,
"cost at rest"): an idle registry asks etcd nothing, and due work is still done at its
time — a backoff over, a lease lost, a cross-task dependency verified, a deadline, a
stall — and by another replica once the elected one is killed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import RegistryHandle, allow_suite_etcd, on_etcd, produce_verified

from baton_relay.client import Client
from baton_relay.registry.records.model import EntryRecord
from baton_relay.registry.rules.sweeping import SweepWatch
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import Keys

Wait = Callable[..., None]

#: seconds a due move may come after its due time: the coalescing period (the
#: fixture's --reap-interval, 0.2 s) and a loaded test machine's slack
LATE = 1.5


def watch_of(replica: RegistryHandle) -> SweepWatch:
    watch = replica._running.sweep_watch
    assert watch is not None
    return watch


def settled(replica: RegistryHandle) -> bool:
    """The replica leads, its watch is up, every sweep has made its first look and none
    has anything to do now."""
    watch = watch_of(replica)
    return (replica._running.sweeper is not None and replica._running.sweeper.is_leader
            and watch.starts >= 1
            and all(a.swept >= 1 and not a.ready() for a in watch.alarms))


def kv_requests(etcd: Any) -> dict[str, int]:
    """etcd's key-value requests served so far, by method (its own metrics)."""
    text = etcd.get("/metrics", timeout=5).decode()
    counts: dict[str, int] = {}
    for labels, value in re.findall(r'^grpc_server_handled_total\{([^}]*)\} (\S+)$', text,
                                    re.MULTILINE):
        if 'grpc_service="etcdserverpb.KV"' in labels:
            method = re.search(r'grpc_method="(\w+)"', labels)
            if method:
                counts[method.group(1)] = counts.get(method.group(1), 0) + int(float(value))
    return counts


class Requests:
    """The registry's own count of its etcd requests, by kind (``Etcd.observe``)."""

    def __init__(self, replica: RegistryHandle) -> None:
        self.by_kind: dict[str, int] = {}
        replica._running.etcd.observe = self._seen

    def _seen(self, kind: str, seconds: float, ok: bool) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def reads(self) -> int:
        return self.by_kind.get("range", 0)


def entry(where: Any, prefix: str, task: str, file_id: str) -> EntryRecord:
    """An entry as etcd holds it (read with a connection of the test's own)."""

    async def read(conn: Etcd) -> EntryRecord:
        kv = await conn.get(Keys(prefix).entry(task, file_id))
        assert kv is not None
        return EntryRecord.load(kv.value)

    return on_etcd(where, read)


def promoted(rec: EntryRecord, prefix: str) -> bool:
    return rec.index.startswith(Keys(prefix).ready_all(rec.task_id).decode())


def leader_of(replicas: list[RegistryHandle]) -> RegistryHandle | None:
    leading = [r for r in replicas if settled(r)]
    return leading[0] if len(leading) == 1 else None


# an idle registry ------------------------------------------------------------------


def test_an_idle_registry_asks_etcd_nothing(
        etcd: Any, registry_factory: Callable[..., RegistryHandle], wait_for: Wait) -> None:
    """Elected, over stored entries (pending, waiting, verified), two claims in flight
    held by a live session (one with its deadline and stall an hour ahead) and an entry
    in a retry backoff due in an hour, with a second replica beside it: over a window of
    several coalescing periods etcd serves no Range and no Txn request at all (the
    sweeps, the shard assigner and the drain loop sleep; keepalives are lease requests)."""
    first = registry_factory()
    second = registry_factory()
    with Client(first.address, timeout=10) as client:
        client.operator.create_task({"task_id": "idle", "entries": [
            {"file_id": f"e{i}", "path": f"e{i}"} for i in range(50)] + [
            {"file_id": "late", "path": "late", "depends_on": ["e0"]}]})
        client.operator.create_task({"task_id": "held", "entries": [
            {"file_id": "a", "path": "a", "claim_deadline_seconds": 3600,
             "stall_after_seconds": 3600},
            {"file_id": "b", "path": "b"}, {"file_id": "c", "path": "c"},
            {"file_id": "v", "path": "v"}]})
        with client.open_session("holder", ttl=10) as session:
            produce_verified(client, session, "held", "v")
            client.claim("held", "a", session=session)
            client.claim("held", "b", session=session)
            later = client.claim("held", "c", session=session)
            client.fail("held", "c", later.token, reason="later", delay=3600,
                        session=session)
            wait_for(lambda: leader_of([first, second]) is not None, timeout=15,
                     what="a leader whose sweeps have all looked once")
            for replica in (first, second):  # the assigner and the drain loop ran once
                running = replica._running
                assert running.assigner is not None
                wait_for(lambda running=running: running.assigner.runs >= 1,  # type: ignore[misc]
                         what="the assigner's first run")
            before = kv_requests(etcd)
            window = 3.0  # fifteen coalescing periods of the fixture's 0.2 s
            time.sleep(window)  # a window over which nothing is to happen
            after = kv_requests(etcd)
            assert session.session_id  # the session lived throughout (kept alive)
    served = {m: after.get(m, 0) - before.get(m, 0) for m in ("Range", "Txn")}
    assert served == {"Range": 0, "Txn": 0}, f"etcd served at rest: {served}"


# due work at its time --------------------------------------------------------------


def test_a_backoff_ends_at_its_due_time_without_polling(
        registry: RegistryHandle, client: Client, prefix: str, etcd: Any,
        wait_for: Wait) -> None:
    """An entry failed with a 2 s delay is promoted (its ready key written) within
    ``LATE`` of its due time; until then the registry read etcd no more than a look at
    the delayed index's head (the watch told it when the key is due)."""
    client.operator.create_task({"task_id": "t", "entries": [{"file_id": "a", "path": "a"}]})
    wait_for(lambda: settled(registry), what="the registry settled")
    with client.open_session("p", ttl=30) as session:
        claim = client.claim("t", "a", session=session)
        wait_for(lambda: settled(registry), what="the registry settled after the claim")
        counted = Requests(registry)
        client.fail("t", "a", claim.token, reason="soon", delay=2, session=session)
        due = entry(etcd, prefix, "t", "a").not_before
        assert due > time.time()
        wait_for(lambda: promoted(entry(etcd, prefix, "t", "a"), prefix),
                 timeout=2 + LATE + 1, what="the entry promoted")
        late = time.time() - due
    assert late < LATE, f"promoted {late:.2f} s after its due time"
    # the fail's own reads and the sweep's: the task's delayed keys and its entry
    assert counted.reads() <= 6, f"the registry read etcd {counted.by_kind}"


def test_a_lost_lease_is_reaped_promptly(
        registry: RegistryHandle, client: Client, prefix: str, etcd: Any,
        wait_for: Wait) -> None:
    """A claim whose session's lease expires goes back to pending soon after etcd
    deletes the claim key, found from that deletion (no full look at the claims)."""
    client.operator.create_task({"task_id": "t", "backoff": {"base_seconds": 0.1},
                                 "entries": [{"file_id": "a", "path": "a"}]})
    wait_for(lambda: settled(registry), what="the registry settled")
    reaper = registry.reaper
    looks = reaper._sweeps
    lost = client.open_session("lost", ttl=2, keepalive=False)
    client.claim("t", "a", session=lost)
    claimed = time.monotonic()
    wait_for(lambda: entry(etcd, prefix, "t", "a").retry_count == 1, timeout=10,
             what="the lost claim reaped")
    took = time.monotonic() - claimed
    assert took < 2 + 1 + LATE, f"reaped {took:.2f} s after the claim (lease TTL 2 s)"
    assert reaper._sweeps == looks  # found from the claim key's deletion alone
    # The reaper counts a move once its transaction has returned to it, a moment
    # after etcd shows the entry moved: wait for the count.
    wait_for(lambda: reaper.reaped >= 1, timeout=2, what="the reap counted")


def test_a_cross_task_dependency_releases_its_dependent_promptly(
        registry: RegistryHandle, client: Client, prefix: str, etcd: Any,
        wait_for: Wait) -> None:
    """An entry of task B waiting on ``A:a`` is released within ``LATE`` of ``A:a``'s
    verification, told by the watch of A's entries (kept only while something waits)."""
    client.operator.create_task({"task_id": "A", "entries": [{"file_id": "a", "path": "a"},
                                                     {"file_id": "x", "path": "x"}]})
    client.operator.create_task({"task_id": "B", "entries": [
        {"file_id": "b", "path": "b", "depends_on": ["A:a"]}]})
    scheduler = registry._running.scheduler
    wait_for(lambda: settled(registry) and scheduler.cross is not None
             and scheduler.cross.followed == ["A"], what="task A followed")
    with client.open_session("p", ttl=30) as session:
        produce_verified(client, session, "A", "x")  # another entry of A: nothing to do
        assert not entry(etcd, prefix, "B", "b").deps_ok
        produce_verified(client, session, "A", "a")
        verified = time.monotonic()
        wait_for(lambda: entry(etcd, prefix, "B", "b").deps_ok, timeout=LATE + 2,
                 what="B's entry released")
        took = time.monotonic() - verified
    assert took < LATE, f"released {took:.2f} s after its dependency was verified"
    wait_for(lambda: scheduler.cross.followed == [],  # type: ignore[union-attr]
             what="task A no longer watched")


def test_a_deadline_and_a_stall_fire_at_their_time(
        registry: RegistryHandle, client: Client, prefix: str, etcd: Any,
        wait_for: Wait) -> None:
    """A claim with a 2 s deadline and one with a 2 s stall limit are taken back within
    ``LATE`` of their due times, told of by the keys their claims wrote."""
    client.operator.create_task({"task_id": "t", "backoff": {"base_seconds": 0.1}, "entries": [
        {"file_id": "d", "path": "d", "claim_deadline_seconds": 2},
        {"file_id": "s", "path": "s", "stall_after_seconds": 2}]})
    wait_for(lambda: settled(registry), what="the registry settled")
    with client.open_session("p", ttl=30) as session:
        started = time.monotonic()
        client.claim("t", "d", session=session)
        client.claim("t", "s", session=session)
        fired: dict[str, float] = {}

        def taken_back() -> bool:
            for f in ("d", "s"):
                if f not in fired and entry(etcd, prefix, "t", f).retry_count == 1:
                    fired[f] = time.monotonic() - started
            return len(fired) == 2

        wait_for(taken_back, timeout=2 + LATE + 2, what="both taken back")
    assert all(2 - 0.1 <= t < 2 + LATE for t in fired.values()), fired
    assert registry._running.stalls is not None and registry._running.stalls.stalled == 1


# another replica takes over ----------------------------------------------------------


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``baton-registry`` processes; every one left is killed at the end."""
    started: list[subprocess.Popen[str]] = []

    def start(*argv: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-m", "baton_relay.registry", *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


#: the sweeps' lease of the processes: longer than the lost claim's lease (2 s), so
#: that the claim's lease dies while nobody leads
KILLED_TTL = 4


def test_after_the_elected_replica_is_killed_another_does_the_due_work(
        etcd: Any, prefix: str, staging: Path, wait_for: Wait,
        processes: Callable[..., subprocess.Popen[str]]) -> None:
    """Two registry processes; the elected one is killed (SIGKILL) just after a claim
    was made on a 2 s lease never kept alive and an entry failed with a 1 s backoff:
    the other is elected once the killed one's lease ends, and its first look reaps the
    claim whose lease died while nobody led, and promotes the entry."""
    procs, addresses = [], []
    for _ in range(2):
        proc = processes("--insecure", "--etcd", etcd.endpoint, *allow_suite_etcd(),
                         "--listen", "127.0.0.1:0", "--staging", str(staging),
                         "--prefix", prefix, "--reap-interval", "0.2",
                         "--sweep-lease-ttl", str(KILLED_TTL))
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("baton-registry listening on "), line
        procs.append(proc)
        addresses.append(line.split()[-1])
    election = f"{prefix}election/sweeps/".encode()

    def leader_pid() -> int:
        async def read(conn: Etcd) -> int:
            kvs, _, _ = await conn.range(election)
            if not kvs:
                return 0
            oldest = min(kvs, key=lambda kv: kv.create_revision)
            return int(oldest.value.decode().rpartition(":")[2])

        return on_etcd(etcd, read)

    wait_for(lambda: leader_pid() in {p.pid for p in procs}, timeout=15, what="a leader")
    leader = leader_pid()
    survivor = next(a for p, a in zip(procs, addresses, strict=True) if p.pid != leader)
    with Client(survivor, timeout=10) as client:
        client.operator.create_task({"task_id": "t", "backoff": {"base_seconds": 0.1}, "entries": [
            {"file_id": "lost", "path": "lost"}, {"file_id": "later", "path": "later"}]})
        with client.open_session("p", ttl=30) as session:
            claim = client.claim("t", "later", session=session)
            client.fail("t", "later", claim.token, reason="soon", delay=1,
                        session=session)
        lost = client.open_session("lost", ttl=2, keepalive=False)
        client.claim("t", "lost", session=lost)
        os.kill(leader, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: entry(etcd, prefix, "t", "lost").retry_count == 1
                 and promoted(entry(etcd, prefix, "t", "later"), prefix),
                 timeout=KILLED_TTL + 1 + LATE + 5, what="the due work done by the survivor")
        took = time.monotonic() - killed
    # its lease ends within the TTL (and etcd's second of granularity); then one look
    assert took < KILLED_TTL + 1 + LATE, f"done {took:.2f} s after the leader was killed"
    assert leader_pid() != leader
