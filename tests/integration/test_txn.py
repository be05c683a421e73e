"""The guarded-transaction object, group commit and the watch-fed view, on a real etcd."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from registry_fixtures import on_etcd

from baton_relay.kernel.errors import Conflict, NotFound
from baton_relay.local.etcdproc import EtcdProcess
from baton_relay.registry.store.etcd import Etcd, Put
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.store.txn import Transactions, Txn, write
from baton_relay.registry.store.view import View

T = TypeVar("T")


def test_reads_become_compares_and_a_changed_read_replans(etcd: EtcdProcess, prefix: str) -> None:
    """A planner whose read changed before its commit runs again on the new value."""
    key = f"{prefix}counter".encode()

    async def body(client: Etcd) -> tuple[int, int]:
        txns = Transactions(client, Keys(prefix).request)
        runs = 0

        async def bump(txn: Txn) -> int:
            nonlocal runs
            runs += 1
            kv = await txn.get(key)
            value = int(kv.value) if kv else 0
            if runs == 1:  # someone else writes between our read and our commit
                await client.txn([], [Put(key, b"41")])
            txn.put(key, str(value + 1).encode())
            return value + 1

        result = await write(txns, bump)
        return result, runs

    result, runs = on_etcd(etcd, body)
    assert (result, runs) == (42, 2)


def test_group_commit_carries_many_callers_in_few_requests(
        etcd: EtcdProcess, prefix: str) -> None:
    """Concurrent transactions share requests; one caller's failed compare fails only it."""
    async def body(client: Etcd) -> tuple[int, int, list[str]]:
        txns = Transactions(client, Keys(prefix).request)
        taken = f"{prefix}taken".encode()
        await client.txn([], [Put(taken, b"x")])

        async def create(i: int) -> str:
            key = f"{prefix}k{i}".encode() if i != 7 else taken

            async def plan(txn: Txn) -> str:
                txn.create(key, b"v")
                return "ok"

            try:
                return await write(txns, plan, attempts=1)
            except Conflict:
                return "conflict"

        outcomes = await asyncio.gather(*(create(i) for i in range(64)))
        return txns.committer.requests, txns.committer.carried, outcomes

    requests, carried, outcomes = on_etcd(etcd, body)
    assert carried == 64
    assert requests < 32, f"{requests} requests for 64 transactions: no grouping"
    assert outcomes.count("conflict") == 1 and outcomes[7] == "conflict"


def test_callers_touching_one_key_never_share_a_group(etcd: EtcdProcess, prefix: str) -> None:
    """Increments of one counter from many callers all apply: none is lost to a group."""
    key = f"{prefix}n".encode()

    async def body(client: Etcd) -> int:
        txns = Transactions(client, Keys(prefix).request)

        async def bump(txn: Txn) -> None:
            kv = await txn.get(key)
            txn.put(key, str((int(kv.value) if kv else 0) + 1).encode())

        await asyncio.gather(*(write(txns, bump) for _ in range(40)))
        kv = await client.get(key)
        assert kv is not None
        return int(kv.value)

    assert on_etcd(etcd, body) == 40


def test_an_error_from_the_view_is_confirmed_on_etcd(etcd: EtcdProcess, prefix: str) -> None:
    """A domain error raised on the view's reads is decided again on etcd's own state."""
    keys = Keys(prefix)

    async def body(client: Etcd) -> list[bool]:
        view = View(client, keys)
        await view.start()
        try:
            txns = Transactions(client, keys.request, view)
            seen: list[bool] = []
                # Written behind the view's back, before its watch can bring it.
            await client.txn([], [Put(keys.task("t"), b"{}")])

            async def plan(txn: Txn) -> bool:
                seen.append(txn.fresh)
                if await txn.get(keys.task("t")) is None:
                    raise NotFound("no task")
                return True

            view._mirror.pop(keys.task("t"), None)  # as if the watch were behind
            assert await write(txns, plan)
            return seen
        finally:
            await view.stop()

    seen = on_etcd(etcd, body)
    assert seen[-1] is True  # the answer came from a read of etcd itself


def test_view_follows_writes_made_elsewhere(etcd: EtcdProcess, prefix: str) -> None:
    """A session key written by another client shows up in the view through its watch."""
    keys = Keys(prefix)

    async def body(client: Etcd) -> bool:
        view = View(client, keys)
        await view.start()
        try:
            await client.txn([], [Put(keys.agent(77), b"{}")])
            deadline = asyncio.get_running_loop().time() + 10
            while asyncio.get_running_loop().time() < deadline:
                (kv,) = await view.get_many([keys.agent(77)])
                if kv is not None:
                    return True
                await asyncio.sleep(0.01)
            return False
        finally:
            await view.stop()

    assert on_etcd(etcd, body)


@pytest.mark.parametrize("n", [300])
def test_a_group_never_exceeds_etcds_limits(etcd: EtcdProcess, prefix: str, n: int) -> None:
    """More concurrent callers than one request may carry are split over several requests."""
    async def body(client: Etcd) -> int:
        txns = Transactions(client, Keys(prefix).request)

        def plan_for(i: int) -> Callable[[Txn], Awaitable[None]]:
            async def plan(txn: Txn) -> None:
                txn.create(f"{prefix}g{i}".encode(), b"v")
            return plan

        await asyncio.gather(*(write(txns, plan_for(i)) for i in range(n)))
        kvs, _, _ = await client.range(f"{prefix}g".encode())
        return len(kvs)

    assert on_etcd(etcd, body) == n
