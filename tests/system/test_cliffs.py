"""Cliffs: sizes where a registry that works for a handful of keys used to stop working.

Assemblies and dependency lists longer than one etcd transaction may compare
(128), listings longer than one page (or than gRPC's 4 MiB message), and one
corrupt record among many. Page sizes are module constants, made small here so
a few dozen keys cross several pages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import blake3
import pytest
from click.testing import CliRunner
from registry_fixtures import TEST_RETRY, RegistryHandle, on_etcd

from baton_relay.client import Client, Session
from baton_relay.client.cli import cli
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import EtcdProcess
from baton_relay.registry.records.model import PENDING, VERIFIED, EntryRecord, TaskRecord
from baton_relay.registry.rules.core import Core
from baton_relay.registry.store import etcd as etcd_mod
from baton_relay.registry.store.etcd import KV, Etcd, Put
from baton_relay.registry.store.keys import ClaimRef, Keys
from baton_relay.registry.store.txn import Txn, write
from baton_relay.registry.sweeps import scheduler as scheduler_mod
from baton_relay.registry.sweeps.scheduler import assembly_digest
from baton_relay.registry.verbs import operators as operators_mod
from baton_relay.registry.verbs import sessions as sessions_mod

T = TypeVar("T")
FAST = {"base_seconds": 0.001}


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def entries(*ids: str, **fields: Any) -> list[dict[str, Any]]:
    return [{"file_id": i, "path": i, **fields} for i in ids]


def wait_for(condition: Callable[[], T], timeout: float = 20.0, what: str = "") -> T:
    """Poll ``condition`` until it returns something true (returned); fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what or condition}")
        time.sleep(0.02)


def produce_all(client: Client, s: Session, task: str, data: dict[str, bytes]) -> None:
    """Claim, commit and verify the entries named in ``data`` (batches of 20)."""
    ids = list(data)
    for i in range(0, len(ids), 20):
        chunk = ids[i:i + 20]
        claims = [client.claim(task, f, session=s) for f in chunk]
        client.commit_batch([(task, c.file_id, c.token, len(data[c.file_id]),
                              digest(data[c.file_id])) for c in claims])
        for f in chunk:
            assert client.watcher.report(task, f, len(data[f]),
                                         digest(data[f])).state == pb.ENTRY_STATE_VERIFIED


def verified(client: Client, task: str, file_id: str) -> pb.Entry | None:
    """The entry once verified (read through Explain: GetEntry cannot yet answer for an
    entry waiting on more than 128 others, see the xfail below)."""
    entry = client.operator.explain(task, file_id).entry
    return entry if entry.state == pb.ENTRY_STATE_VERIFIED else None


def raw_keys(etcd: EtcdProcess, prefix: bytes) -> list[bytes]:
    async def body(conn: Etcd) -> list[bytes]:
        return [kv.key async for kv in conn.scan(prefix, keys_only=True)]

    return on_etcd(etcd, body)


#: page sizes of the paging tests: a few dozen keys cross several pages
REAP_PAGE, LIST_PAGE = 3, 2


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small pages for every listing; asked for before ``client``, so set before the
    registry starts (no sweep is ever under way with the default page)."""
    monkeypatch.setattr(sessions_mod, "REAP_PAGE", REAP_PAGE)
    monkeypatch.setattr(operators_mod, "LIST_PAGE", LIST_PAGE)
    monkeypatch.setattr(scheduler_mod, "SCAN_PAGE", LIST_PAGE)


@pytest.fixture
def ranges(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[bytes, int]]]:
    """Every range request any replica of this process sends: (prefix, limit)."""
    calls: list[tuple[bytes, int]] = []
    original = Etcd.range

    async def spy(self: Etcd, prefix: bytes, **kw: Any) -> tuple[list[KV], int, bool]:
        calls.append((prefix, int(kw.get("limit", 0))))
        return await original(self, prefix, **kw)

    monkeypatch.setattr(Etcd, "range", spy)
    yield calls


def paged(calls: list[tuple[bytes, int]], prefix: str, page: int) -> int:
    """How many range requests read under ``prefix``; each must have been a page at most."""
    under = [(p, limit) for p, limit in calls if p.startswith(prefix.encode())]
    assert all(0 < limit <= page for _, limit in under), under
    return len(under)


# 1. assemblies and dependency lists longer than a transaction's compares ----------

def test_assembly_of_300_parts_is_verified_when_every_part_is(client: Client) -> None:
    """An assembly of 300 parts is verified once all 300 are, and again after a part changes."""
    parts = [f"p{i:03d}" for i in range(300)]
    data = {p: f"page {i} of the scan".encode() for i, p in enumerate(parts)}
    client.operator.create_task({"task_id": "ocr", "backoff": FAST, "entries": [
        *entries(*parts), {"file_id": "doc", "path": "doc", "parts": parts}]})
    with client.open_session("ocr", ttl=30) as s:
        produce_all(client, s, "ocr", {p: data[p] for p in parts[:-1]})
        waiting = client.operator.explain("ocr", "doc")
        assert waiting.entry.state == pb.ENTRY_STATE_PENDING
        assert waiting.text.endswith("It waits for parts: p299 (pending).")
        produce_all(client, s, "ocr", {parts[-1]: data[parts[-1]]})
        doc = wait_for(lambda: verified(client, "ocr", "doc"), what="the assembly verified")
        assert doc is not None and doc.size == sum(len(d) for d in data.values())
        assert doc.digest == assembly_digest([digest(data[p]) for p in parts])

        # A part's file changes: the assembly leaves verified, and comes back once
        # the part is produced again (a check of all 300 parts, unpinned, again).
        client.watcher.report("ocr", "p150", 3, digest(b"new"))
        assert client.operator.explain("ocr", "doc").entry.state == pb.ENTRY_STATE_PENDING
        data["p150"] = b"page 150, again"
        produce_all(client, s, "ocr", {"p150": data["p150"]})
        doc = wait_for(lambda: verified(client, "ocr", "doc"), what="the assembly verified again")
        assert doc is not None and doc.digest == assembly_digest([digest(data[p]) for p in parts])
        lease = client.consume("ocr", "default", session=s)
        assert lease.file_id == "doc"
        client.ack("ocr", "doc", "default", lease.token)


def test_entry_with_300_dependencies_is_released(client: Client) -> None:
    """An entry depending on 300 others waits until the last is verified, then is claimable."""
    deps = [f"d{i:03d}" for i in range(300)]
    client.operator.create_task({"task_id": "t", "entries": [
        *entries(*deps), {"file_id": "final", "path": "final", "depends_on": deps}]})
    with client.open_session("p", ttl=30) as s:
        produce_all(client, s, "t", {d: d.encode() for d in deps[:-1]})
        with pytest.raises(errors.IllegalTransition, match="waits"):
            client.claim("t", "final", session=s)
        assert "d299" in client.operator.explain("t", "final").text

        produce_all(client, s, "t", {deps[-1]: b"last"})

        def claim_final() -> Any:
            try:
                return client.claim("t", "final", session=s)
            except errors.IllegalTransition:
                return None

        claim = wait_for(claim_final, what="the dependent released")
        assert client.operator.get_entry("t", "final").state == pb.ENTRY_STATE_WRITING
        assert claim.token > 0
    released = [r for r in client.operator.journal("t", "final") if r.event == "released"]
    assert len(released) == 1


def test_get_entry_of_an_entry_waiting_for_300_dependencies(client: Client) -> None:
    """GetEntry answers for an entry waiting on 300 dependencies (and says if one is dead)."""
    deps = [f"d{i:03d}" for i in range(300)]
    client.operator.create_task({"task_id": "t", "entries": [
        *entries(*deps), {"file_id": "final", "path": "final", "depends_on": deps}]})
    entry = client.operator.get_entry("t", "final")
    assert entry.state == pb.ENTRY_STATE_PENDING and not entry.blocked


def test_dependencies_read_in_chunks_must_hold_together(
        etcd: EtcdProcess, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dependencies read unpinned, in chunks, release only if all were verified at one instant."""
    monkeypatch.setattr(scheduler_mod, "PIN_MAX", 2)
    monkeypatch.setattr(etcd_mod, "READ_CHUNK", 2)
    keys = Keys(prefix)
    deps = [f"d{i}" for i in range(6)]

    async def body(conn: Etcd) -> tuple[bool, str, int]:
        core = Core(conn, keys, "/staging", view=False)

        async def seed(txn: Txn) -> None:
            task = TaskRecord("t", "active", "/staging/t", 7, "", ["g"], 3)
            txn.put(keys.task("t"), task.dump())
            for d in deps:  # every one verified but the last
                state = VERIFIED if d != "d5" else PENDING
                core.put_entry(EntryRecord("t", d, d, state=state, consumers=["g"]), txn)
            core.put_entry(EntryRecord("t", "x", "x", depends_on=deps, deps_ok=False), txn)

        await write(core.txns, seed)
        first_chunk = [keys.entry("t", "d0"), keys.entry("t", "d1")]
        reads = 0
        original = conn.txn

        async def flip(key: bytes, state: str) -> None:
            rec = EntryRecord.load((await conn.get(key)).value)  # type: ignore[union-attr]
            rec.state = state
            await original([], [Put(key, rec.dump())])

        async def spy(compares: Any, success: Any, failure: Any = ()) -> Any:
            nonlocal reads
            result = await original(compares, success, failure)
            if not compares and [getattr(op, "key", b"") for op in success] == first_chunk:
                reads += 1
                if reads == 1:
                    # After d0 was read verified: d0 leaves verified, then d5 (not
                    # read yet) becomes verified. Each was verified when read, but
                    # never all of them at once.
                    await flip(keys.entry("t", "d0"), PENDING)
                    await flip(keys.entry("t", "d5"), VERIFIED)
            return result

        monkeypatch.setattr(conn, "txn", spy)
        released = await scheduler_mod.Scheduler(core).check_waiting("t", "x")
        x = EntryRecord.load((await conn.get(keys.entry("t", "x"))).value)  # type: ignore[union-attr]
        await core.stop()
        return released, x.index, reads

    released, index, reads = on_etcd(etcd, body)
    assert not released and reads == 2  # planned again, and then d0 is seen pending
    assert index == keys.waiting("t", "x").decode()


# 2. one poisoned record among many ------------------------------------------------

def test_poisoned_records_do_not_stop_the_sweeps_or_the_reaper(
        small_pages: None, registry_factory: Callable[..., RegistryHandle],
        etcd: EtcdProcess, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """With corrupt records first in every index, the sweeps and reaper still do the rest.

    The records are poisoned before the registry starts: a twin that names no live
    claim is met only by a whole look of the reaper, the one a replica takes when it is
    elected (then every ``--full-sweep-interval``); poisoned after, it would be met only
    if the election happened to come later than the poison."""
    caplog.set_level(logging.WARNING, logger="baton.registry")
    keys = Keys(prefix)
    bad = b"{not json"

    async def poison(conn: Etcd) -> None:
        await conn.txn([], [
            Put(keys.task("a-poison"), bad),
            Put(keys.entry("a-poison", "x"), bad), Put(keys.waiting("a-poison", "x"), b""),
            Put(keys.entry("a-poison", "y"), bad), Put(keys.delayed("a-poison", 1, "y"), b""),
            Put(keys.entry("a-poison", "z"), b'{"task_id": "a-poison"}'),  # fields missing
            Put(keys.waiting("a-poison", "z"), b""),
            # first in the wake index: entries that cannot be read
            Put(keys.wake("a-poison", "x"), b""), Put(keys.wake("a-poison", "z"), b""),
            Put(keys.inflight(ClaimRef("p", "a-poison", "y")), b'{"agent": "gone"}'),
        ])

    on_etcd(etcd, poison)
    registry = registry_factory()
    with Client(registry.address, timeout=10, retry=TEST_RETRY) as client:
        _poisoned_records_run(client, etcd, keys, caplog, prefix)


def _poisoned_records_run(client: Client, etcd: EtcdProcess, keys: Keys,
                          caplog: pytest.LogCaptureFixture, prefix: str) -> None:
    client.operator.create_task({"task_id": "t-dep", "entries": [
        *entries("a", "b", "c"), {"file_id": "z", "path": "z", "depends_on": ["a", "b", "c"]}]})
    client.operator.create_task({"task_id": "t-retry", "backoff": {"base_seconds": 0.2},
                                 "entries": entries("r")})
    client.operator.create_task({"task_id": "t-done", "entries": entries("e")})
    client.operator.create_task({"task_id": "t-lost", "backoff": FAST, "entries": entries("l")})

    async def verify_behind(conn: Etcd) -> None:
        """Dependencies verified behind the registry's back (with their wake keys, as a
        verification writes them): only a sweep releases z."""
        for f in ("a", "b", "c"):
            key = keys.entry("t-dep", f)
            rec = EntryRecord.load((await conn.get(key)).value)  # type: ignore[union-attr]
            rec.state, rec.digest = VERIFIED, digest(b"")
            await conn.txn([], [Put(key, rec.dump()), Put(keys.wake("t-dep", f), b"")])

    on_etcd(etcd, verify_behind)
    with client.open_session("p", ttl=30) as s:
        c = client.claim("t-retry", "r", session=s)
        assert client.fail("t-retry", "r", c.token, "try again").state == pb.ENTRY_STATE_PENDING
        produce_all(client, s, "t-done", {"e": b"e"})
        lease = client.consume("t-done", "default", session=s)
        client.ack("t-done", "e", "default", lease.token)
    lost = client.open_session("lost", ttl=30, keepalive=False)
    client.claim("t-lost", "l", session=lost)
    client.close_session(lost.session_id)

    wait_for(lambda: raw_keys(etcd, keys.ready_all("t-retry")), what="r promoted")
    assert raw_keys(etcd, keys.delayed_of_task("t-retry")) == []
    wait_for(lambda: any(k.endswith(b"/z") for k in raw_keys(etcd, keys.ready_all("t-dep"))),
             what="z released")
    assert client.operator.get_entry("t-dep", "z").state == pb.ENTRY_STATE_PENDING
    assert [r.event for r in client.operator.journal("t-dep", "z")][-1] == "released"
    wait_for(lambda: client.operator.get_task("t-done").status == pb.TASK_STATUS_COMPLETED,
             what="t-done completed")
    wait_for(lambda: client.operator.get_entry("t-lost", "l").state == pb.ENTRY_STATE_PENDING,
             what="l reaped")
    # Each poisoned record is reported (by the sweep or reaper pass that meets it: "l"
    # may have been reaped from its lease's end, before a pass over every twin), once:
    # not again at every sweep.
    def said(item: str) -> list[str]:
        return [line for line in caplog.text.splitlines() if item in line and "failed" in line]

    for item in (f"wake key {prefix}wakes/a-poison/x", f"wake key {prefix}wakes/a-poison/z",
                 "delayed entry a-poison/y", f"task header {prefix}tasks/a-poison",
                 f"twin {prefix}inflight/p/a-poison/y"):
        wait_for(lambda item=item: bool(said(item)), what=f"{item} reported")
        assert len(said(item)) == 1, (item, said(item))


# 3. listings longer than a page ------------------------------------------------------

def test_reaper_pages_through_more_claims_than_a_page(
        small_pages: None, ranges: list[tuple[bytes, int]], registry: RegistryHandle,
        client: Client, prefix: str,
        registry_factory: Callable[..., RegistryHandle]) -> None:
    """With 3 keys a page, a new leader's first look recovers 10 claims whose lease died
    while no replica led, among 10 live ones."""
    ids = [f"e{i:02d}" for i in range(20)]
    client.operator.create_task({"task_id": "t", "backoff": FAST, "entries": entries(*ids)})
    lost = client.open_session("lost", ttl=30, keepalive=False)
    live = client.open_session("live", ttl=30, keepalive=False)
    # Interleaved in key order, so the reaper's merge of the two listings
    # meets live and lost claims on every page.
    held = {f: client.claim("t", f, session=live if i % 2 else lost)
            for i, f in enumerate(ids)}
    registry.stop()  # the only replica: nobody leads now

    async def revoke(conn: Etcd) -> None:
        await conn.revoke(lost.session_id)  # its claims die with its lease at once

    on_etcd(registry.etcd, revoke)
    ranges.clear()
    with Client(registry_factory().address, timeout=10) as again:

        def settled() -> bool:
            got = {e.file_id: e for e in again.operator.list_entries("t")}
            return all(got[f].state == (pb.ENTRY_STATE_WRITING if i % 2 else pb.ENTRY_STATE_PENDING)
                       for i, f in enumerate(ids))

        wait_for(settled, what="the lost claims reaped")
        for i, f in enumerate(ids):
            entry = again.operator.get_entry("t", f)
            assert entry.retry_count == (0 if i % 2 else 1), f
            if i % 2:  # a live claim's token is untouched
                assert again.commit("t", f, held[f].token, 1,
                                    digest(b"x")).state == pb.ENTRY_STATE_WRITTEN
    assert paged(ranges, f"{prefix}inflight/", REAP_PAGE) >= 4
    assert paged(ranges, f"{prefix}claims/", REAP_PAGE) >= 4


def test_reaper_merge_pairs_claims_and_twins_across_pages(
        etcd: EtcdProcess, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reaper's merge of both listings, 2 keys a page, finds exactly the twins left alone."""
    monkeypatch.setattr(sessions_mod, "REAP_PAGE", 2)
    keys = Keys(prefix)
    live = [ClaimRef("p", "t", f) for f in ("a", "c", "e", "h")] + [ClaimRef("c", "t", "a", "g")]
    lone = [ClaimRef("p", "t", f) for f in ("b", "d")] + [ClaimRef("c", "t", "b", "g")]
    renewed = ClaimRef("p", "t", "f")  # a twin and a claim of different create revisions
    value = b'{"agent": "x", "session": 1, "slot": -1}'

    async def body(conn: Etcd) -> list[tuple[bytes, ClaimRef | None]]:
        await conn.txn([], [op for r in live for op in (Put(keys.claim(r), value),
                                                         Put(keys.inflight(r), value))])
        await conn.txn([], [Put(keys.inflight(r), value) for r in lone])
        await conn.txn([], [Put(keys.inflight(renewed), value),
                            Put(keys.claim(ClaimRef("p", "t", "g")), value),  # no twin
                            Put(keys.inflight_all() + b"p/t", value)])  # names no claim
        await conn.txn([], [Put(keys.claim(renewed), value)])
        reaper = sessions_mod.Reaper(Core(conn, keys, "/staging", view=False))
        return [(twin.key, ref) async for twin, ref in reaper.orphans()]

    found = on_etcd(etcd, body)
    assert sorted(k for k, _ in found) == sorted(
        [keys.inflight(r) for r in [*lone, renewed]] + [keys.inflight_all() + b"p/t"])
    assert {ref for _, ref in found} == {*lone, renewed, None}


def test_agents_listing_pages_through_sessions_and_claims(
        small_pages: None, ranges: list[tuple[bytes, int]], client: Client, prefix: str) -> None:
    """With 2 keys a page, ListAgents still returns every session with every claim it holds."""
    client.operator.create_task({"task_id": "t", "entries": entries(*(f"e{i}" for i in range(9)))})
    sessions = [client.open_session(f"agent{i}", ttl=30) for i in range(5)]
    try:
        want: dict[int, set[str]] = {}
        for i, s in enumerate(sessions):
            want[s.session_id] = {client.claim("t", f"e{j}", session=s).file_id
                                  for j in range(i * 2 - 1, i * 2 + 1) if j >= 0}
        ranges.clear()
        agents = client.operator.list_agents()
        got = {a.session_id: {c.file_id for c in a.claims} for a in agents}
        assert got == want
        assert {a.agent for a in agents} == {f"agent{i}" for i in range(5)}
        assert paged(ranges, f"{prefix}agents/", LIST_PAGE) >= 3
        assert paged(ranges, f"{prefix}claims/", REAP_PAGE) >= 5
    finally:
        for s in sessions:
            s.close()


def failed_then_produced(client: Client, failures: int) -> None:
    """Task t: entry a claimed and failed ``failures`` times, entry b produced."""
    client.operator.create_task({"task_id": "t", "backoff": FAST, "max_retries": 5,
                                 "entries": entries("a", "b")})
    with client.open_session("p", ttl=30) as s:
        for _ in range(failures):
            c = wait_for(lambda: _claim(client, s, "a"), what="a claimable")
            client.fail("t", "a", c.token, "again")
        produce_all(client, s, "t", {"b": b"b"})


def test_journal_pages_through_every_record(
        small_pages: None, ranges: list[tuple[bytes, int]], client: Client, etcd: EtcdProcess,
        prefix: str) -> None:
    """With 2 records a page, the journal returns every record in order, or the last N."""
    failed_then_produced(client, 4)
    stored = raw_keys(etcd, Keys(prefix).journal_all("t"))
    ranges.clear()
    whole = [(r.file_id, r.event, r.revision) for r in client.operator.journal("t")]
    assert len(whole) == len(stored) >= 10
    assert [r for _, _, r in whole] == sorted(r for _, _, r in whole)
    last = [(r.file_id, r.event, r.revision) for r in client.operator.journal("t", limit=3)]
    assert last == whole[-3:]
    assert [r.event for r in client.operator.journal("t", "a")].count("failed") == 4
    assert paged(ranges, f"{prefix}journal/", LIST_PAGE) >= 5


def test_a_journal_reply_is_bounded_to_its_newest_records(
        monkeypatch: pytest.MonkeyPatch, client: Client, etcd: EtcdProcess, prefix: str,
        registry: RegistryHandle) -> None:
    """With replies bounded to 4 records, a journal of more returns its newest 4 and how
    many it holds, a smaller limit is kept, one entry's journal is bounded too, and
    `baton log` says on standard error that it shows only the newest."""
    monkeypatch.setattr(operators_mod, "MAX_JOURNAL_RECORDS", 4)
    failed_then_produced(client, 3)
    stored = raw_keys(etcd, Keys(prefix).journal_all("t"))
    assert len(stored) >= 8
    reply = client.operator.journal_reply("t")
    assert reply.total == len(stored) and len(reply.records) == 4
    revisions = sorted(_create_revisions(etcd, prefix))
    assert [r.revision for r in reply.records] == revisions[-4:]
    two = client.operator.journal_reply("t", limit=2)
    assert [r.revision for r in two.records] == revisions[-2:] and two.total == len(stored)
    a = client.operator.journal_reply("t", "a")
    assert len(a.records) == 4
    assert a.total == len(raw_keys(etcd, Keys(prefix).journal_all("t", "a"))) >= 6
    env = {"BATON_REGISTRY": registry.address}
    shown = CliRunner().invoke(cli, ["log", "t", "-o", "json"], env=env)
    assert shown.exit_code == 0, shown.output
    assert len(shown.stdout.splitlines()) == 4
    assert f"the newest 4 of {len(stored)} records" in shown.stderr
    limited = CliRunner().invoke(cli, ["log", "t", "--limit", "2", "-o", "json"], env=env)
    assert limited.exit_code == 0 and limited.stderr == "", limited.output


def _create_revisions(etcd: EtcdProcess, prefix: str) -> list[int]:
    """The create revisions of task t's journal records, straight from etcd."""
    base = Keys(prefix).journal_all("t")

    async def read(conn: Etcd) -> list[int]:
        return [kv.create_revision async for kv in conn.scan(base, page=100)]

    return on_etcd(etcd, read)


def _claim(client: Client, s: Session, file_id: str) -> Any:
    try:
        return client.claim("t", file_id, session=s)
    except errors.IllegalTransition:
        return None


def test_cancel_revokes_more_claims_than_a_chunk_and_frees_their_slots(
        small_pages: None, client: Client, etcd: EtcdProcess, prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancel deletes 7 claims 2 at a time: every token dies and every slot is free again."""
    monkeypatch.setattr(operators_mod, "CLAIM_CHUNK", 2)
    monkeypatch.setattr(operators_mod, "DELETE_CHUNK", 2)
    client.operator.create_task({"task_id": "t", "entries": entries(*(f"e{i}" for i in range(7)))})
    client.operator.create_task({"task_id": "u", "entries": entries(*(f"u{i}" for i in range(8)))})
    keys = Keys(prefix)
    with client.open_session("p", ttl=30, slots=8) as s:
        claims = [client.claim("t", f"e{i}", session=s) for i in range(7)]
        client.operator.cancel_task("t", "wrong input")
        for c in claims:
            with pytest.raises(errors.StaleToken):
                client.commit("t", c.file_id, c.token, 1, digest(b"x"))
        for base in (keys.claims_of_task("p", "t"), keys.inflight_of_task("p", "t"),
                     keys.ready_all("t")):
            assert raw_keys(etcd, base) == []
        # All 8 slots are free again: 8 claims of another task fit.
        assert len([client.claim("u", session=s) for _ in range(8)]) == 8
