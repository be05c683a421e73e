"""An etcd member cut off from its peers, as the ``partition-etcd`` nemesis does it: the
registry's calls to it must fail at once (and be retried on another member), not hang
until their deadline, and a watch on it must end rather than go silent.

Three real members, each in a network namespace of its own (``netns.py``); the cut is
nftables rules inside the namespaces. Needs root, iproute2 and nftables (CI has them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tools import require

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.errors import Unavailable
from baton_relay.local.etcdproc import free_port
from baton_relay.registry.store.etcd import Etcd

from . import netns
from .cluster import (
    EtcdCluster,
    Proc,
    confine,
    etcd_node,
    host_number,
    registry_node,
    registry_proc,
)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

#: long enough that a call held until its deadline cannot pass for a refusal
TIMEOUT = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[EtcdCluster, netns.Network]]:
    require("ip", "nft")
    why = netns.available()
    if why:
        pytest.fail(f"network namespaces are needed here: {why}")
    network = netns.Network()
    network.open()
    try:
        for n in range(3):
            network.add(etcd_node(n), host_number(etcd_node(n)))
        etcd = EtcdCluster(tmp_path / "etcd", network=network)
        etcd.start()
        try:
            yield etcd, network
        finally:
            etcd.stop()
    finally:
        network.close()


def cut_off(etcd: EtcdCluster, network: netns.Network) -> int:
    """Cut a follower off from the other two; wait until it knows it has no leader."""
    leader = etcd.leader()
    assert leader is not None
    n = (leader + 1) % 3
    network.cut([etcd_node(n)], [etcd_node(m) for m in range(3) if m != n])
    deadline = time.monotonic() + 30
    while (status := etcd.status(n)) is None or int(status.get("leader", 0)) != 0:
        assert time.monotonic() < deadline, f"m{n} still follows a leader: {status}"
        time.sleep(0.1)
    return n


def test_a_member_without_a_leader_refuses_calls_at_once(
        cluster: tuple[EtcdCluster, netns.Network]) -> None:
    etcd, network = cluster
    n = cut_off(etcd, network)

    async def call() -> tuple[str, float]:
        client = Etcd(etcd.endpoint(n), timeout=TIMEOUT)
        await client.connect()
        started = time.monotonic()
        try:
            with pytest.raises(Unavailable) as refused:
                await client.get(b"/partition/key")
            return str(refused.value), time.monotonic() - started
        finally:
            await client.close()

    message, took = asyncio.run(call())
    assert "no leader" in message
    assert took < TIMEOUT / 2, f"held {took:.1f} s: {message}"
    network.heal()
    ok = asyncio.run(_get_eventually(etcd.endpoint(n)))
    assert ok is None  # the member serves again once the link is back


async def _get_eventually(endpoint: str) -> object:
    client = Etcd(endpoint, timeout=5.0)
    await client.connect()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                return await client.get(b"/partition/key")
            except Unavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
    finally:
        await client.close()


async def _watch_until_it_ends(endpoint: str, act: Callable[[], object]) -> str:
    """Open a watch on the member at ``endpoint``, then ``act`` (in a thread); why the
    watch ended (``Unavailable``), failing if it is still open after ``TIMEOUT``."""
    client = Etcd(endpoint, timeout=TIMEOUT)
    await client.connect()
    _, revision, _ = await client.range(b"/partition/", limit=1)
    try:
        stream = client.watch(b"/partition/", revision + 1)
        acting = asyncio.get_running_loop().run_in_executor(None, act)
        with pytest.raises(Unavailable) as ended:
            async with asyncio.timeout(TIMEOUT):
                async for _ in stream:
                    pass
        await acting
        return str(ended.value)
    finally:
        await client.close()


def test_a_watch_on_a_member_without_a_leader_ends(
        cluster: tuple[EtcdCluster, netns.Network]) -> None:
    etcd, network = cluster
    leader = etcd.leader()
    assert leader is not None
    n = (leader + 1) % 3  # the member cut_off picks
    why = asyncio.run(_watch_until_it_ends(etcd.endpoint(n), lambda: cut_off(etcd, network)))
    assert "no leader" in why


def test_a_watch_on_a_member_that_went_silent_ends(
        cluster: tuple[EtcdCluster, netns.Network]) -> None:
    """The member keeps its leader, but nothing it sends reaches the registry (and
    nothing resets the connection): the watch must end, so that the registry opens it
    again on another member, rather than stay open and silent."""
    etcd, network = cluster

    def go_silent() -> None:
        time.sleep(1.0)
        network.cut_harness(etcd_node(0))

    assert asyncio.run(_watch_until_it_ends(etcd.endpoint(0), go_silent))


# --- a client cut off from the replica it talks to -----------------------------------


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[list[str], netns.Network]]:
    """Two registry replicas on three etcd members, each process in its own namespace;
    the replicas' addresses."""
    require("ip", "nft")
    why = netns.available()
    if why:
        pytest.fail(f"network namespaces are needed here: {why}")
    network = netns.Network()
    network.open()
    procs: list[Proc] = []
    try:
        nodes = [*(etcd_node(n) for n in range(3)), registry_node(0), registry_node(1)]
        for node in nodes:
            network.add(node, host_number(node))
        etcd = EtcdCluster(tmp_path / "etcd", network=network)
        etcd.start()
        procs.extend(etcd.members)
        endpoints = ",".join(etcd.endpoint(n) for n in range(3))
        addresses = [f"{network.address(registry_node(n))}:{free_port()}" for n in range(2)]
        for n, address in enumerate(addresses):
            proc = confine(registry_proc(f"registry-{n}", endpoints, address, tmp_path,
                                         "/partition/", tmp_path / f"registry-{n}.log", None,
                                         etcd.version),
                           network, registry_node(n))
            proc.start()
            procs.append(proc)
        yield addresses, network
    finally:
        for proc in reversed(procs):
            proc.stop()
        network.close()


def test_a_client_on_a_list_of_replicas_leaves_one_it_cannot_reach(
        replicas: tuple[list[str], netns.Network]) -> None:
    """The replica the client's channel picked goes silent (packets dropped, no reset):
    the client must notice and carry on with the other, not wait for TCP to give up."""
    addresses, network = replicas
    client = Client("ipv4:" + ",".join(addresses), timeout=5.0, ca="", cert="", key="")
    try:
        client.operator.list_tasks()  # connected: pick_first took the first replica
        network.cut_harness(registry_node(0))
        started = time.monotonic()
        deadline = started + 120
        while True:
            try:
                client.operator.list_tasks()
                break
            except errors.BatonError as e:
                assert time.monotonic() < deadline, f"still failing: {e}"
        took = time.monotonic() - started
    finally:
        client.close()
    print(f"left the silent replica in {took:.1f} s")
    assert took < 60, f"the client took {took:.0f} s to leave the silent replica"
