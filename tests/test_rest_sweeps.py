"""Sweeps at rest (issue 39): what the registry's periodic sweeps read from etcd when
nothing is due does not grow with the entries (and tasks) stored."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aetcd import rpc

from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry._etcd import Etcd
from baton_relay.registry.core import Core
from baton_relay.registry.deadlines import Deadlines
from baton_relay.registry.identity import ANONYMOUS
from baton_relay.registry.keys import Keys
from baton_relay.registry.producers import Producers
from baton_relay.registry.scheduler import Scheduler
from baton_relay.registry.sessions import Reaper, Sessions
from baton_relay.registry.stalls import Stalls
from baton_relay.registry.tasks import Tasks


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
