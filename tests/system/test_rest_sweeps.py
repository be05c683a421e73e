"""Sweeps at rest (issue 39): what the registry's periodic sweeps read from etcd when
nothing is due does not grow with the entries (and tasks) stored."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aetcd import rpc
from registry_fixtures import RegistryHandle, on_etcd, produce_verified

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.identity import ANONYMOUS
from baton_relay.registry.rules.core import Core
from baton_relay.registry.rules.election import Election
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.sweeps.deadlines import Deadlines
from baton_relay.registry.sweeps.scheduler import Scheduler
from baton_relay.registry.sweeps.stalls import Stalls
from baton_relay.registry.verbs.producers import Producers
from baton_relay.registry.verbs.sessions import Reaper, Sessions
from baton_relay.registry.verbs.tasks import Tasks


class ReadCounter(Etcd):
    """The real etcd client, counting its key-value requests, the keys etcd sent back and
    the keys etcd walked to answer them (a range's count: etcd visits every key of a
    range, ``limit`` or not, to count it)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.requests = self.returned = self.walked = 0

    def reset(self) -> tuple[int, int, int]:
        """(requests, keys returned, keys walked) since the last reset; back to zero."""
        seen = self.requests, self.returned, self.walked
        self.requests = self.returned = self.walked = 0
        return seen

    def _unary(self, method: Callable[..., Any], request: Any) -> Awaitable[Any]:
        sent = super()._unary(method, request)

        async def counted() -> Any:
            resp = await sent
            if isinstance(resp, rpc.RangeResponse | rpc.TxnResponse):
                self.requests += 1
                self._count(resp)
            return resp

        return counted()

    def _count(self, resp: Any) -> None:
        if isinstance(resp, rpc.RangeResponse):
            self.returned += len(resp.kvs)
            self.walked += resp.count
            return
        for r in resp.responses:
            kind = r.WhichOneof("response")
            if kind == "response_range":
                self._count(r.response_range)
            elif kind == "response_txn":
                self._count(r.response_txn)


async def _store(etcd: ReadCounter, core: Core, tasks: int, entries: int) -> None:
    """``tasks`` idle tasks of ``entries`` pending entries each, a tenth of them waiting
    for an entry never produced; and one busy task, the same at every size, with a claim
    whose deadline and stall are far off and an entry in a long retry backoff."""
    for t in range(tasks):
        spec = pb.TaskSpec(task_id=f"t{t:03d}", entries=[
            pb.EntrySpec(file_id=f"e{i:06d}", path=f"e{i:06d}",
                         depends_on=["gate"] if i % 10 == 1 else [])
            for i in range(entries)] + [pb.EntrySpec(file_id="gate", path="gate")])
        await Tasks(core).create(pb.CreateTaskRequest(spec=spec))
    spec = pb.TaskSpec(task_id="busy", entries=[
        pb.EntrySpec(file_id=f"b{i}", path=f"b{i}", claim_deadline_seconds=3600,
                     stall_after_seconds=3600) for i in range(3)])
    await Tasks(core).create(pb.CreateTaskRequest(spec=spec))
    session = await Sessions(core).open(pb.OpenSessionRequest(agent="a", ttl=60), ANONYMOUS)
    producers = Producers(core)
    await producers.claim(pb.ClaimRequest(task_id="busy", file_id="b0",
                                          session_id=session.session_id), ANONYMOUS)
    failing = await producers.claim(pb.ClaimRequest(task_id="busy", file_id="b1",
                                                    session_id=session.session_id), ANONYMOUS)
    await producers.fail(pb.FailRequest(task_id="busy", file_id="b1", token=failing.token,
                                        reason="later", delay_seconds=3600), ANONYMOUS)


async def reads_per_sweep(endpoint: str, prefix: str, tasks: int,
                          entries: int) -> dict[str, tuple[int, int, int]]:
    """Per periodic sweep, (requests, keys returned, keys walked) of one run at rest over
    a store of ``tasks`` x ``entries``."""
    etcd = ReadCounter(endpoint, timeout=60)
    await etcd.connect()
    core = Core(etcd, Keys(prefix), "/staging")
    await core.start()
    try:
        await _store(etcd, core, tasks, entries)
        scheduler = Scheduler(core)
        sweeps: dict[str, Callable[[], Awaitable[object]]] = {
            "reaper": Reaper(core).sweep,
            "backoff promotions": scheduler.promote_due,
            "nacked entries": scheduler.promote_nacked,
            "waiting entries": scheduler.sweep_waiting,
            "task completion": scheduler.complete_tasks,
            "finishing cancels": scheduler.finish_cancels,
            "deadlines": Deadlines(core).sweep,
            "stalls": Stalls(core).sweep,
        }
        for sweep in sweeps.values():  # whatever creating the store left due, done
            await sweep()
        seen = {}
        for name, sweep in sweeps.items():
            etcd.reset()
            assert not await sweep(), f"{name}: work done at rest"
            seen[name] = etcd.reset()
        return seen
    finally:
        await core.stop()
        await etcd.close()


def test_sweeps_at_rest_read_the_same_over_a_larger_store(etcd: Any, prefix: str) -> None:
    """Each periodic sweep at rest sends as many requests and reads (and makes etcd walk)
    as many keys over 20 tasks x 2,000 entries as over 2 tasks x 20."""
    small = asyncio.run(reads_per_sweep(etcd.endpoint, prefix + "small/", 2, 20))
    large = asyncio.run(reads_per_sweep(etcd.endpoint, prefix + "large/", 20, 2000))
    print("\nsweep: (requests, keys returned, keys walked) small → large")
    for name in small:
        print(f"  {name}: {small[name]} → {large[name]}")
    grew = {name: (small[name], large[name]) for name in small if large[name] > small[name]}
    assert not grew, f"sweeps whose reads at rest grew with the store: {grew}"


# only the leader sweeps ----------------------------------------------------------------

TTL = 2


def sweeper(replica: RegistryHandle) -> Election:
    election = replica._running.sweeper
    assert election is not None
    return election


@pytest.fixture
def swept(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Periodic sweeps run, by the ``id`` of the replica's core that ran them."""
    runs: dict[int, int] = {}
    for cls, name in ((Reaper, "sweep"), (Deadlines, "sweep"), (Stalls, "sweep"),
                      (Scheduler, "promote_due"), (Scheduler, "complete_tasks")):
        real = getattr(cls, name)

        def counted(self: Any, *args: Any, real: Any = real, **kw: Any) -> Any:
            runs[id(self.core)] = runs.get(id(self.core), 0) + 1
            return real(self, *args, **kw)

        monkeypatch.setattr(cls, name, counted)
    return runs


def test_only_the_leader_sweeps_and_another_takes_over_within_the_ttl(
        registry_factory: Callable[..., RegistryHandle], swept: dict[int, int],
        wait_for: Callable[..., None]) -> None:
    """Of two replicas only the elected one sweeps (its first look as leader: the reaper,
    deadlines, stalls and task completion); when its lease ends it stops, the other
    sweeps within the lease's TTL, and due work (a lost claim, a finished task) is done
    by it."""
    replicas = [registry_factory(sweep_lease_ttl=TTL) for _ in range(2)]

    def leader() -> RegistryHandle | None:
        leading = [r for r in replicas if sweeper(r).is_leader]
        return leading[0] if len(leading) == 1 else None

    def runs(r: RegistryHandle) -> int:
        return swept.get(id(r._running.core), 0)

    wait_for(lambda: leader() is not None, what="one leader")
    first = leader()
    assert first is not None
    other = next(r for r in replicas if r is not first)
    wait_for(lambda: runs(first) >= 4, what="the leader's first look")
    assert runs(other) == 0

    lease = sweeper(first)._lease

    async def revoke(etcd: Etcd) -> None:
        await etcd.revoke(lease)  # as when the leader dies: its lease ends

    started = time.monotonic()
    on_etcd(first.etcd, revoke)
    wait_for(lambda: sweeper(other).is_leader, timeout=TTL + 1, what="the other leads")
    assert time.monotonic() - started < TTL + 1
    wait_for(lambda: not sweeper(first).is_leader, timeout=TTL, what="the first steps down")
    wait_for(lambda: runs(other) > 0, timeout=TTL, what="the new leader's sweeps")
    stopped_at = runs(first)
    with Client(first.address, timeout=10) as client:
        client.operator.create_task({"task_id": "t", "backoff": {"base_seconds": 0.1},
                                     "entries": [{"file_id": "a", "path": "a"},
                                        {"file_id": "b", "path": "b"}]})
        with client.open_session("p", ttl=30) as s:
            produce_verified(client, s, "t", "a")
            lease_a = client.consume("t", "default", "a", session=s)
            client.ack("t", "a", "default", lease_a.token, session=s)
        lost = client.open_session("lost", ttl=30, keepalive=False)
        client.claim("t", "b", session=lost)
        client.close_session(lost.session_id)
        wait_for(lambda: client.operator.get_entry("t", "b").state == pb.ENTRY_STATE_PENDING
                 and client.operator.get_entry("t", "b").retry_count == 1, what="b reaped")
        with client.open_session("p", ttl=30) as s:

            def produced() -> bool:
                try:
                    produce_verified(client, s, "t", "b")
                except errors.IllegalTransition:  # still in its retry backoff
                    return False
                return True

            wait_for(produced, what="b produced after its backoff")
            lease_b = client.consume("t", "default", "b", session=s)
            client.ack("t", "b", "default", lease_b.token, session=s)
        wait_for(lambda: client.operator.get_task("t").status == pb.TASK_STATUS_COMPLETED,
                 what="t completed")
    assert runs(first) == stopped_at  # the old leader swept no more


def test_a_task_an_older_registry_wrote_is_looked_at_once_by_a_new_leader(
        etcd: Any, prefix: str) -> None:
    """A header without ``cross_deps`` (no wake or finishing keys behind it): ``learn``
    releases what its verified dependencies allow and records that it has none across
    tasks; after that the sweeps read nothing of it."""
    from baton_relay.registry.records.model import VERIFIED, EntryRecord, TaskRecord
    from baton_relay.registry.store.etcd import Put

    async def body() -> tuple[int, str, bool | None, tuple[int, int, int], int]:
        conn = ReadCounter(etcd.endpoint, timeout=60)
        await conn.connect()
        core = Core(conn, Keys(prefix), "/staging")
        await core.start()
        keys = core.keys
        try:
            await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(
                task_id="old", entries=[pb.EntrySpec(file_id="a", path="a"),
                                        pb.EntrySpec(file_id="z", path="z",
                                                     depends_on=["a"])])))
            header = await conn.get(keys.task("old"))
            entry = await conn.get(keys.entry("old", "a"))
            assert header is not None and entry is not None
            old = {k: v for k, v in json.loads(header.value).items() if k != "cross_deps"}
            rec = EntryRecord.load(entry.value)
            rec.state = VERIFIED  # verified as an older registry did: no wake key
            put = await conn.txn([], [Put(header.key, json.dumps(old).encode()),
                                      Put(entry.key, rec.dump())])
            deadline = time.monotonic() + 10  # the view (which learn reads) has it
            while core.view is not None and core.view.revision < put.revision:
                assert time.monotonic() < deadline, "the view never caught up"
                await asyncio.sleep(0.01)
            scheduler = Scheduler(core)
            learnt = await scheduler.learn()
            z = EntryRecord.load((await conn.get(keys.entry("old", "z"))).value)  # type: ignore[union-attr]
            after = TaskRecord.load((await conn.get(keys.task("old"))).value)  # type: ignore[union-attr]
            conn.reset()
            await scheduler.sweep_waiting()
            again = await scheduler.learn()
            return learnt, z.state if z.deps_ok else "waiting", after.cross_deps, \
                conn.reset(), again
        finally:
            await core.stop()
            await conn.close()

    learnt, z, cross, reads, again = asyncio.run(body())
    assert (learnt, z, cross, again) == (1, "pending", False, 0)
    assert reads[1:] == (0, 0)  # no key of it read by the sweep of waiting entries
