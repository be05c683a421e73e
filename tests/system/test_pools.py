"""Concurrency pools (docs/architecture.md, "Concurrency pools"): a claim of an entry
that names a pool takes one of its units in its own transaction; at the limit its
entries are passed over, and every way a claim ends gives its unit back."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import RegistryHandle, on_etcd

from baton_relay.client import Client
from baton_relay.kernel.errors import InvalidArgument, InvalidManifest, NotFound, NothingToClaim
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.model import TaskRecord
from baton_relay.registry.store.etcd import Etcd, Put
from baton_relay.registry.store.keys import Keys
from tests.faults.checker import most_at_once

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

Wait = Callable[..., None]


def units(registry: RegistryHandle, pool: str) -> list[dict[str, Any]]:
    """The unit keys of ``pool`` in etcd (what a claim holds), as their values say."""
    base = Keys(registry.prefix).pool_units(pool)

    async def read(etcd: Etcd) -> list[dict[str, Any]]:
        return [json.loads(kv.value) async for kv in etcd.scan(base)]

    return on_etcd(registry.etcd, read)


def task(client: Client, task_id: str, n: int, **spec: Any) -> None:
    client.operator.create_task({"task_id": task_id, "digest_optional": True, **spec,
                                 "entries": [{"file_id": f"e{i}",
                                              "path": f"e{i}"} for i in range(n)]})


def commit(client: Client, claim: Any, session: Any) -> pb.Entry:
    return client.commit(claim.task_id, claim.file_id, claim.token, 1,
                         blake3.blake3(b"x").hexdigest(), session=session)


def test_claims_hold_at_most_the_limit_and_commits_give_units_back(
        client: Client, registry: RegistryHandle) -> None:
    client.operator.set_pool("gpu", 2, reason="two cards")
    task(client, "t", 4, pools={"produce": "gpu"})
    with client.open_session("p", ttl=30, keepalive=False) as s:
        first = [client.claim("t", session=s) for _ in range(2)]
        assert len(units(registry, "gpu")) == 2
        with pytest.raises(NothingToClaim, match="pool 'gpu' is at its limit") as refused:
            client.claim("t", session=s)
        assert refused.value.fields["pool"] == "gpu" and refused.value.fields["limit"] == 2
        assert client.operator.get_task("t").states["pending"] == 2  # nothing changed
        commit(client, first[0], s)
        assert len(units(registry, "gpu")) == 1
        third = client.claim("t", session=s)
        held = {(u["task"], u["file"]) for u in units(registry, "gpu")}
        assert held == {("t", first[1].file_id), ("t", third.file_id)}
        (info,) = client.operator.list_pools()
        assert (info.name, info.limit, info.in_use, info.waiting) == ("gpu", 2, 2, 1)
        assert {h.file_id for h in info.holders} == {first[1].file_id, third.file_id}
        assert all(h.agent == "p" and h.token > 0 for h in info.holders)


def test_a_full_pool_passes_its_entries_over_and_others_are_claimed(
        client: Client, registry: RegistryHandle) -> None:
    client.operator.set_pool("api", 1)
    client.operator.create_task({"task_id": "t", "digest_optional": True, "entries": [
        *({"file_id": f"p{i}", "path": f"p{i}", "priority": 9, "pools": {"produce": "api"}}
          for i in range(3)),
        {"file_id": "free", "path": "free", "priority": 0}]})
    with client.open_session("p", ttl=30, keepalive=False) as s:
        taken = client.claim("t", session=s)
        assert taken.file_id.startswith("p")  # the higher priority first
        # the pooled ones ahead of it are passed over: the free one is claimed
        assert client.claim("t", session=s).file_id == "free"
        with pytest.raises(NothingToClaim, match="2 passed over: pool 'api' is at its limit"):
            client.claim("t", session=s)


def test_every_way_a_claim_ends_gives_its_unit_back(
        client: Client, registry: RegistryHandle, wait_for: Wait) -> None:
    """fail, a deadline, an operator's revoke, a lost session (the reaper), ack and
    nack of a consumer group's pool: each leaves no unit held."""
    client.operator.set_pool("p", 10)
    task(client, "t", 6, pools={"produce": "p", "consume": {"g": "p"}}, consumers=["g"],
         backoff={"base_seconds": 0.001}, claim_deadline_seconds=0)
    client.operator.create_task({"task_id": "late", "digest_optional": True,
                                 "claim_deadline_seconds": 1, "pools": {"produce": "p"},
                                 "entries": [{"file_id": "d", "path": "d"}]})
    with client.open_session("p", ttl=30, keepalive=False) as s:
        c = client.claim("t", "e0", session=s)
        client.fail("t", "e0", c.token, "no", session=s)
        assert units(registry, "p") == []
        client.claim("late", "d", session=s)
        wait_for(lambda: units(registry, "p") == [], what="the deadline's give-back")
        client.claim("t", "e1", session=s)
        client.operator.revoke_sessions(s.session_id, reason="test")
        assert units(registry, "p") == []
    lost = client.open_session("gone", ttl=2, keepalive=False)  # never kept alive
    client.claim("t", "e2", session=lost)
    assert len(units(registry, "p")) == 1
    wait_for(lambda: units(registry, "p") == [], timeout=20, what="the reaper's give-back")
    assert client.operator.get_entry("t", "e2").state == pb.ENTRY_STATE_PENDING
    with client.open_session("c", ttl=30, keepalive=False) as s:
        for f in ("e3", "e4"):
            claim = client.claim("t", f, session=s)
            commit(client, claim, s)
            client.watcher.report("t", f, 1, blake3.blake3(b"x").hexdigest(), reporter="w")
        first = client.consume("t", "g", "e3", session=s)
        assert [u["group"] for u in units(registry, "p")] == ["g"]
        client.ack("t", "e3", "g", first.token, session=s)
        assert units(registry, "p") == []
        second = client.consume("t", "g", "e4", session=s)
        client.nack("t", "e4", "g", second.token, "later", session=s)
        assert units(registry, "p") == []


def test_the_limit_changes_live_and_lowering_it_takes_nothing_away(
        client: Client, registry: RegistryHandle) -> None:
    client.operator.set_pool("p", 3)
    task(client, "t", 6, pools={"produce": "p"})
    with client.open_session("a", ttl=30, keepalive=False) as s:
        held = [client.claim("t", session=s) for _ in range(3)]
        client.operator.set_pool("p", 1, reason="supplier cut our quota")
        assert len(units(registry, "p")) == 3  # nothing taken away
        commit(client, held[0], s)
        commit(client, held[1], s)
        with pytest.raises(NothingToClaim, match="at its limit"):
            client.claim("t", session=s)  # one held, limit one: wait
        commit(client, held[2], s)
        client.claim("t", session=s)
        client.operator.set_pool("p", 4)
        assert len([client.claim("t", session=s) for _ in range(2)]) == 2


def test_entries_of_an_undefined_pool_wait_and_say_why(
        client: Client, registry: RegistryHandle) -> None:
    task(client, "t", 1, pools={"produce": "nowhere"})
    with client.open_session("a", ttl=30, keepalive=False) as s:
        with pytest.raises(NothingToClaim, match="pool 'nowhere' is not defined"):
            client.claim("t", session=s)
        client.operator.set_pool("nowhere", 1)
        client.claim("t", session=s)
        assert client.operator.delete_pool("nowhere")
        assert not client.operator.delete_pool("nowhere")
        (info,) = client.operator.list_pools()  # a unit still held: listed, limit 0
        assert (info.name, info.limit, info.in_use) == ("nowhere", 0, 1)


def test_a_cancelled_tasks_units_come_back(client: Client, registry: RegistryHandle,
                                           wait_for: Wait) -> None:
    """A cancel deletes claims (and twins of claims whose lease ended) in bulk: every
    unit comes back, the lost ones' through the repair."""
    client.operator.set_pool("p", 5)
    task(client, "t", 3, pools={"produce": "p"})
    with client.open_session("a", ttl=30, keepalive=False) as s:
        client.claim("t", session=s)
    lost = client.open_session("gone", ttl=2, keepalive=False)
    client.claim("t", session=lost)
    client.operator.cancel_task("t", reason="test")
    wait_for(lambda: units(registry, "p") == [], timeout=30, what="every unit back")


@pytest.mark.parametrize(("manifest", "said"), [
    ({"pools": {"produce": "no spaces"}}, "pool name 'no spaces' is not an id"),
    ({"consumers": ["g"], "pools": {"consume": {"other": "p"}}},
     "pools.consume names group 'other'"),
])
def test_a_manifest_naming_pools_wrongly_is_refused(client: Client, manifest: dict[str, Any],
                                                   said: str) -> None:
    with pytest.raises(InvalidManifest, match=said):
        client.operator.create_task({"task_id": "t", **manifest,
                                     "entries": [{"file_id": "a", "path": "a"}]})
    with pytest.raises(NotFound):
        client.operator.get_task("t")


@pytest.mark.parametrize(("name", "limit"), [("bad name", 1), ("p", 0), ("p", 10_001)])
def test_a_bad_pool_definition_is_refused(client: Client, name: str, limit: int) -> None:
    with pytest.raises(InvalidArgument):
        client.operator.set_pool(name, limit)
    assert client.operator.list_pools() == []


POOL_AGENT = Path(__file__).parents[1] / "pool_agent.py"


def claim_intervals(registry: RegistryHandle, tasks: list[str]) -> list[tuple[int, int]]:
    """From the journal: each producer claim, from the revision of its ``claimed``
    record to that of the record that ended it (committed, failed, revoked)."""
    keys = Keys(registry.prefix)

    async def read(etcd: Etcd) -> list[tuple[int, int]]:
        out = []
        for t in tasks:
            by_entry: dict[str, list[tuple[int, str]]] = {}
            base = keys.journal_all(t)
            async for kv in etcd.scan(base):
                file_id = kv.key[len(base):].split(b"/", 1)[0].decode()
                by_entry.setdefault(file_id, []).append(
                    (kv.create_revision, json.loads(kv.value)["event"]))
            for records in by_entry.values():
                records.sort()
                for (rev, event), (end, _) in itertools.pairwise(records):
                    if event == "claimed":
                        out.append((rev, end))
        return out

    return on_etcd(registry.etcd, read)


@pytest.mark.slow
def test_thirty_two_agents_on_four_tasks_never_hold_more_than_the_pools_limit(
        client: Client, registry_factory: Callable[..., RegistryHandle],
        registry: RegistryHandle, wait_for: Wait) -> None:
    """32 agent processes on 4 tasks sharing a pool of 5, through two registry
    replicas, three agents SIGKILLed and two sessions revoked meanwhile: at no instant
    more than 5 units held (etcd sampled throughout; the journal's claims, each from
    its claim to its end, never overlap more than 5), the dead agents' units come
    back with their claims, every entry is produced, and no unit is left held."""
    other = registry_factory()
    client.operator.set_pool("shared", 5)
    tasks = [f"t{i}" for i in range(4)]
    for t in tasks:
        task(client, t, 60, pools={"produce": "shared"})
    keys = Keys(registry.prefix)
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        async def loop(etcd: Etcd) -> None:
            while not stop.is_set():
                seen.append(await etcd.count(keys.pool_units("shared")))
                await asyncio.sleep(0.005)

        on_etcd(registry.etcd, loop, timeout=30)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    procs: list[subprocess.Popen[str]] = []
    try:
        for n in range(32):
            target = (registry, other)[n % 2]
            procs.append(subprocess.Popen(
                [sys.executable, str(POOL_AGENT), target.address, tasks[n % 4], f"a{n}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        wait_for(lambda: sum(client.operator.get_task(t).states.get("written",
                                                                    0) for t in tasks) >= 40,
                 timeout=120, what="work under way")
        for p in procs[:3]:
            p.kill()
        for name in ("a5", "a6"):
            client.operator.revoke_sessions(agent=name, reason="test: revoked while holding units")
        for p in procs[3:]:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, (p.args, out, err)
    finally:
        stop.set()
        sampler.join(30)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert all(client.operator.get_task(t).states.get("written", 0) == 60 for t in tasks)
    assert seen and max(seen) <= 5, max(seen)
    assert max(seen) == 5  # the pool was the bound: it was full at times
    intervals = claim_intervals(registry, tasks)
    assert len(intervals) >= 240
    assert most_at_once(intervals) <= 5
    wait_for(lambda: units(registry, "shared") == [], what="no unit left held")


def test_a_routing_rule_chooses_a_groups_pool_by_attributes(
        client: Client, registry: RegistryHandle) -> None:
    """The rule that routes an entry may name the pool of its groups' leases: a big
    file's consume takes a unit of `heavy`, a small one's none."""
    client.operator.set_pool("heavy", 1)
    client.operator.create_task({"task_id": "t", "consumers": ["ocr"], "routing_rules": [
        {"condition": "$[?(@.pages > 100)]", "groups": ["ocr"], "pools": {"ocr": "heavy"}},
        {"condition": "$[?(@.pages <= 100)]", "groups": ["ocr"]}],
        "entries": [{"file_id": f, "path": f} for f in ("big", "big2", "small")]})
    digest = blake3.blake3(b"x").hexdigest()
    with client.open_session("a", ttl=30, keepalive=False) as s:
        for f, pages in (("big", 500), ("big2", 300), ("small", 3)):
            c = client.claim("t", f, session=s)
            client.commit("t", f, c.token, 1, digest, session=s, attributes={"pages": pages})
            client.watcher.report("t", f, 1, digest, reporter="w")
        assert dict(client.operator.get_entry("t", "big").pools.consume) == {"ocr": "heavy"}
        assert not client.operator.get_entry("t", "small").HasField("pools")
        client.consume("t", "ocr", "big", session=s)
        assert [u["file"] for u in units(registry, "heavy")] == ["big"]
        with pytest.raises(NothingToClaim, match="heavy"):
            client.consume("t", "ocr", "big2", session=s)
        client.consume("t", "ocr", "small", session=s)  # its rule names no pool
        assert len(units(registry, "heavy")) == 1


def test_a_routing_rule_naming_a_pool_for_another_group_is_refused(client: Client) -> None:
    with pytest.raises(InvalidManifest, match=r"routing_rules\[0\]: pools names group 'x'"):
        client.operator.create_task({"task_id": "t", "consumers": ["ocr"], "routing_rules": [
            {"condition": "$[?(@.a)]", "groups": ["ocr"], "pools": {"x": "p"}}],
            "entries": [{"file_id": "a", "path": "a"}]})


def _nobody_sweeps(registry_factory: Callable[..., RegistryHandle], etcd: Any,
                   prefix: str, **kw: Any) -> RegistryHandle:
    """A replica that never leads the sweeps: a candidate of ours, planted first, holds
    the election (lowest create revision) for the test, so no reaper gives back a claim
    whose lease ended: only the path under test can end it."""

    async def plant(conn: Etcd) -> None:
        lease, _ = await conn.grant(300)
        await conn.txn([], [Put(f"{prefix}election/sweeps/{lease:x}".encode(),
                                b"test:0", lease=lease)])

    on_etcd(etcd, plant)
    return registry_factory(**kw)


def _claim_keys(registry: RegistryHandle, task_id: str) -> list[bytes]:
    keys = Keys(registry.prefix)

    async def read(conn: Etcd) -> list[bytes]:
        return [kv.key async for kv in conn.scan(keys.claims_of_task("p", task_id),
                                                  keys_only=True)]

    return on_etcd(registry.etcd, read)


def _repair(registry: RegistryHandle) -> int:
    """Run the reaper's repair of pool units once, on the replica's loop: units freed."""
    repaired: int = asyncio.run_coroutine_threadsafe(
        registry.reaper.pools.repair(), registry._loop).result(30)
    return repaired


@pytest.mark.etcd_only("plants an election candidate in etcd before the registry starts")
def test_cancel_and_removal_give_back_every_unit_with_nothing_left_to_repair(
        registry_factory: Callable[..., RegistryHandle], etcd: Any, prefix: str,
        wait_for: Wait) -> None:
    """A cancel and a task's removal end pooled claims, live ones and ones whose
    session's lease already ended (their twin alone left), each with its unit: no
    unit stays held, the repair frees nothing, and /metrics says 0."""
    registry = _nobody_sweeps(registry_factory, etcd, prefix, metrics="127.0.0.1:0")
    keys = Keys(registry.prefix)
    with Client(registry.address, timeout=10) as client:
        client.operator.set_pool("p", 10)
        for t in ("cancelled", "removed"):
            task(client, t, 3, pools={"produce": "p"})
        with client.open_session("live", ttl=60, keepalive=False) as s:
            lost = client.open_session("lost", ttl=2, keepalive=False)
            for t in ("cancelled", "removed"):
                client.claim(t, session=s)
                client.claim(t, session=lost)
            assert len(units(registry, "p")) == 4
            # the lost session's claim keys go with its lease; their twins and units stay
            wait_for(lambda: all(len(_claim_keys(registry, t)) == 1
                                 for t in ("cancelled", "removed")),
                     timeout=15, what="the lost session's claims gone with its lease")
            assert len(units(registry, "p")) == 4

            client.operator.cancel_task("cancelled", reason="test")
            assert [u["task"] for u in units(registry, "p")] == ["removed", "removed"]

            # A cancel whose replica stopped after its first transaction: the header is
            # cancelled, the claims are still there; the removal ends them.
            async def cancelled(conn: Etcd) -> None:
                kv = await conn.get(keys.task("removed"))
                assert kv is not None
                header = TaskRecord.load(kv.value)
                header.status = "cancelled"
                await conn.txn([], [Put(kv.key, header.dump())])

            on_etcd(registry.etcd, cancelled)
            resp = client.operator.delete_task("removed", discard_history=True)
            assert resp.removed["claims"] == 1 and resp.removed["inflight"] == 2
            assert units(registry, "p") == []
        assert _repair(registry) == 0
        port = registry._running.metrics_port
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert "baton_pool_units_repaired_total 0.0" in text.splitlines()
