"""An idle poller's empty claim or consume, decided on a current view, reads nothing from etcd;
a view that may be behind this replica's own writes still decides again on etcd."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from baton_relay.kernel.errors import NothingToClaim
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.identity import ANONYMOUS
from baton_relay.registry.rules.core import Core
from baton_relay.registry.store.etcd import Put
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.verbs.consumers import Consumers
from baton_relay.registry.verbs.producers import Producers
from baton_relay.registry.verbs.sessions import Sessions
from baton_relay.registry.verbs.tasks import Tasks
from tests.integration.test_hotpath import EMPTY, CountingEtcd

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores


async def _current(core: Core) -> None:
    """Wait (5 s at most) until the view's watch has seen every write of this replica."""
    assert core.view is not None
    deadline = time.monotonic() + 5
    while not core.view.current():
        assert time.monotonic() < deadline, "the view never caught up with its own writes"
        await asyncio.sleep(0.01)


async def _setup(endpoint: str, prefix: str, entries: int = 1,
                 clock: Callable[[], float] = time.time) -> tuple[CountingEtcd, Core, int]:
    etcd = CountingEtcd(endpoint, timeout=60)
    await etcd.connect()
    core = Core(etcd, Keys(prefix), "/staging", clock=clock)
    await core.start()
    spec = pb.TaskSpec(task_id="t", consumers=["g"], entries=[
        pb.EntrySpec(file_id=f"e{i}", path=f"e{i}") for i in range(entries)])
    await Tasks(core).create(pb.CreateTaskRequest(spec=spec))
    session = await Sessions(core).open(pb.OpenSessionRequest(agent="a", ttl=30), ANONYMOUS)
    return etcd, core, session.session_id


async def _stop(etcd: CountingEtcd, core: Core) -> None:
    await core.stop()
    await etcd.close()


def _claim(core: Core, session: int) -> Any:
    return Producers(core).claim(pb.ClaimRequest(task_id="t", session_id=session), ANONYMOUS)


def test_empty_claim_on_a_current_view_reads_nothing(etcd: Any, prefix: str) -> None:
    """With every entry done and the view current, a claim costs 0 etcd requests and the
    same NothingToClaim as on etcd."""
    async def body() -> tuple[int, str, str]:
        client, core, session = await _setup(etcd.endpoint, prefix)
        try:
            got = await _claim(core, session)
            await Producers(core).commit(pb.CommitRequest(
                task_id="t", file_id=got.entry.file_id, token=got.token, digest=EMPTY),
                ANONYMOUS)
            await _current(core)
            client.requests = 0
            with pytest.raises(NothingToClaim) as on_view:
                await _claim(core, session)
            requests = client.requests
            core.txns.view = None  # the same question asked of etcd alone
            with pytest.raises(NothingToClaim) as on_etcd:
                await _claim(core, session)
            return requests, str(on_view.value), str(on_etcd.value)
        finally:
            await _stop(client, core)

    requests, on_view, on_etcd = asyncio.run(body())
    assert requests == 0
    assert on_view == on_etcd == "nothing to claim in task 't'"


def test_empty_consume_on_a_current_view_reads_nothing(etcd: Any, prefix: str) -> None:
    """With nothing committed for group g and the view current, a consume costs 0 etcd
    requests and says there is nothing to consume."""
    async def body() -> tuple[int, str]:
        client, core, session = await _setup(etcd.endpoint, prefix)
        consumers = Consumers(core)
        req = pb.ConsumeBatchRequest(task_id="t", group="g", session_id=session, max=1)
        try:
            with pytest.raises(NothingToClaim):  # fills the view's window of the index
                await consumers.consume_batch(req, ANONYMOUS)
            await _current(core)
            client.requests = 0
            with pytest.raises(NothingToClaim) as empty:
                await consumers.consume_batch(req, ANONYMOUS)
            return client.requests, str(empty.value)
        finally:
            await _stop(client, core)

    requests, message = asyncio.run(body())
    assert requests == 0
    assert message == "nothing to consume for group 'g' in task 't'"


async def _requeue_behind_the_view(client: CountingEtcd, core: Core, session: int,
                                   pause: bool) -> pb.ClaimResponse:
    """Claim and commit the one entry, then this replica puts it back in the ready index
    by a write the view learns only from its watch (as bulk writers do); with ``pause``
    the watch is stopped first (a stalled stream). Then claim again."""
    keys = Keys(core.keys.prefix)
    pending = await client.get(keys.entry("t", "e0"))
    ready, _, _ = await client.range(keys.ready_all("t"))
    assert pending is not None and len(ready) == 1
    got = await _claim(core, session)
    await Producers(core).commit(pb.CommitRequest(
        task_id="t", file_id="e0", token=got.token, digest=EMPTY), ANONYMOUS)
    await _current(core)
    with pytest.raises(NothingToClaim):
        await _claim(core, session)
    assert core.view is not None
    if pause:
        await core.view.stop()
        core.view.ready = True  # still taken for live: only its revision tells
    await client.txn([], [Put(pending.key, pending.value), Put(ready[0].key, b"")])
    return await _claim(core, session)


def test_own_write_is_claimable_at_once(etcd: Any, prefix: str) -> None:
    """Right after this replica puts an entry back, a claim finds it (no stale nothing)."""
    async def body() -> str:
        client, core, session = await _setup(etcd.endpoint, prefix)
        try:
            got = await _requeue_behind_the_view(client, core, session, pause=False)
            return got.entry.file_id
        finally:
            await _stop(client, core)

    assert asyncio.run(body()) == "e0"


def test_a_view_behind_its_own_writes_checks_etcd(etcd: Any, prefix: str) -> None:
    """A view whose watch stalled before this replica's write decides again on etcd and
    claims the entry."""
    async def body() -> tuple[str, int]:
        client, core, session = await _setup(etcd.endpoint, prefix)
        try:
            got = await _requeue_behind_the_view(client, core, session, pause=True)
            return got.entry.file_id, core.txns.replans["confirm"]
        finally:
            await _stop(client, core)

    file_id, confirmed = asyncio.run(body())
    assert file_id == "e0"
    assert confirmed >= 1


def test_a_retry_that_comes_due_is_claimable(etcd: Any, prefix: str) -> None:
    """An entry in retry backoff is nothing to claim (from the view, 0 requests) until its
    due time, then claimable."""
    now = [time.time()]

    async def body() -> tuple[int, str]:
        client, core, session = await _setup(etcd.endpoint, prefix, clock=lambda: now[0])
        try:
            got = await _claim(core, session)
            await Producers(core).fail(pb.FailRequest(
                task_id="t", file_id="e0", token=got.token, reason="try again"), ANONYMOUS)
            with pytest.raises(NothingToClaim):  # the backoff is not over
                await _claim(core, session)
            await _current(core)
            client.requests = 0
            with pytest.raises(NothingToClaim):
                await _claim(core, session)
            requests = client.requests
            now[0] += 3600  # past any backoff
            again = await _claim(core, session)
            return requests, again.entry.file_id
        finally:
            await _stop(client, core)

    requests, file_id = asyncio.run(body())
    assert requests == 0
    assert file_id == "e0"


def test_the_empty_poll_benchmark_measures_no_request(etcd: Any) -> None:
    """`python -m bench.empty_poll` (docs/performance.md) counts 0 etcd requests per
    empty claim."""
    from bench.empty_poll import run

    requests, _ = asyncio.run(run(etcd.endpoint, 20))
    assert requests == 0
