"""The asyncio helpers (aproduce, aproduce_each, aconsume, aconsume_each) against a real
registry and watcher: they hand a file off end to end, fail, retry and resume as the
blocking helpers do (the same file work), and refuse bytes that are not the verified ones."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import RegistryHandle

from baton_relay.client import (
    AsyncClient,
    Client,
    aconsume,
    aconsume_each,
    aproduce,
    aproduce_each,
    produce,
)
from baton_relay.kernel import errors
from baton_relay.kernel.contract import parse_temp
from baton_relay.kernel.v1 import baton_pb2 as pb


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def task(client: Client, task_id: str, ids: list[str], **fields: Any) -> None:
    client.operator.create_task({"task_id": task_id, "backoff": {"base_seconds": 0.01},
                                 "entries": [{"file_id": f, "path": f"{f}.bin"} for f in ids],
                                 **fields})


def test_a_file_goes_from_aproduce_through_the_watcher_to_aconsume(
        client: Client, registry: RegistryHandle, staging: Path,
        watcher_factory: Callable[..., Any], wait_for: Callable[..., None]) -> None:
    """aproduce publishes the file under its path and commits it, the watcher verifies it,
    aconsume hands over its checked bytes and acks it."""
    task(client, "t1", ["a"])
    watcher_factory()

    async def produce() -> pb.Entry | None:
        async with AsyncClient(registry.address) as c, c.session("writer") as s:
            async with aproduce(s, "t1", "a") as out:
                await out.write(b"hello, ")
                await out.write(b"async world")
            return out.entry

    entry = asyncio.run(produce())
    # written, or verified already: the watcher may have hashed it before the commit
    assert entry is not None and entry.state in (pb.ENTRY_STATE_WRITTEN,
                                                 pb.ENTRY_STATE_VERIFIED)
    assert Path(entry.abs_attempt_path).read_bytes() == b"hello, async world"
    assert not [p for p in staging.rglob("*") if parse_temp(p.name)]
    wait_for(lambda: client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_VERIFIED,
             what="a verified")

    async def consume() -> bytes:
        async with AsyncClient(registry.address) as c, c.session("reader") as s, \
                aconsume(s, "t1", timeout=10) as got:
            return got.data

    assert asyncio.run(consume()) == b"hello, async world"
    assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_CONSUMED


def test_a_block_that_raises_fails_the_entry_and_the_next_attempt_commits(
        client: Client, registry: RegistryHandle, staging: Path) -> None:
    """A failed aproduce block removes its temp file and fails the entry (a retry spent);
    the entry is claimed again and a second attempt publishes it."""
    task(client, "t1", ["a"])

    async def run() -> pb.Entry | None:
        async with AsyncClient(registry.address) as c, c.session("writer") as s:
            with pytest.raises(RuntimeError, match="disk on fire"):
                async with aproduce(s, "t1", "a") as out:
                    await out.write(b"partial")
                    raise RuntimeError("disk on fire")
            assert not await asyncio.to_thread(
                lambda: [p for p in staging.rglob("*") if parse_temp(p.name)])
            failed = await c.get_entry("t1", "a")
            assert failed.retry_count == 1 and "disk on fire" in failed.error
            for _ in range(500):  # until its retry backoff (10 ms) has passed
                with contextlib.suppress(errors.NothingToClaim, errors.IllegalTransition):
                    async with aproduce(s, "t1", "a") as out:
                        await out.write(b"whole")
                    return out.entry
                await asyncio.sleep(0.01)
            return None

    entry = asyncio.run(run())
    assert entry is not None and entry.state == pb.ENTRY_STATE_WRITTEN
    assert Path(entry.abs_attempt_path).read_bytes() == b"whole"


def test_a_resumable_write_is_resumed_by_the_next_attempt(
        client: Client, registry: RegistryHandle, staging: Path) -> None:
    """A resumable aproduce that fails keeps the bytes its resume point recorded; the next
    attempt adopts them and writes only the rest, as the blocking produce does."""
    task(client, "t1", ["big"])
    payload = bytes(range(256)) * 16  # 4 KiB

    async def run() -> tuple[int, pb.Entry | None]:
        async with AsyncClient(registry.address) as c, c.session("writer") as s:
            with pytest.raises(RuntimeError):
                async with aproduce(s, "t1", "big", resumable=True, resume_every=1024) as out:
                    await out.write(payload[:2500])  # two resume points: 2048 bytes kept
                    raise RuntimeError("killed")
            for _ in range(500):
                with contextlib.suppress(errors.NothingToClaim, errors.IllegalTransition):
                    async with aproduce(s, "t1", "big", resumable=True,
                                        resume_every=1024) as out:
                        start = out.size
                        await out.write(payload[start:])
                    return start, out.entry
                await asyncio.sleep(0.01)
            return -1, None

    start, entry = asyncio.run(run())
    assert start == 2048
    assert entry is not None and entry.digest == digest(payload)
    assert Path(entry.abs_attempt_path).read_bytes() == payload


def test_aconsume_refuses_bytes_that_are_not_the_verified_ones(
        client: Client, registry: RegistryHandle, staging: Path) -> None:
    """A file changed after its verification raises ChecksumMismatch and is nacked: the
    group's next consume gets it again."""
    task(client, "t1", ["a"])
    with client.open_session("writer") as s, produce(client, s, "t1", "a") as out:
        out.write(b"the verified bytes")
    client.watcher.report("t1", "a", out.size, out.digest)
    assert out.entry is not None
    Path(out.entry.abs_attempt_path).write_bytes(b"the tampered bytes")  # the same length

    async def run() -> None:
        async with AsyncClient(registry.address) as c, c.session("reader") as s:
            with pytest.raises(errors.ChecksumMismatch):
                async with aconsume(s, "t1", timeout=10):
                    pytest.fail("the block ran on bytes that are not the verified ones")
            lease = await s.consume("t1")  # handed back to the group
            assert lease.file_id == "a"

    asyncio.run(run())


def test_aproduce_each_and_aconsume_each_hand_off_a_whole_task(
        client: Client, registry: RegistryHandle, watcher_factory: Callable[..., Any],
        wait_for: Callable[..., None]) -> None:
    """The async loops produce every entry (steps of commit-and-claim) and consume every
    one (ack-and-consume), as the blocking loops do."""
    ids = [f"e{i}" for i in range(6)]
    task(client, "t1", ids)
    watcher_factory()

    async def produce() -> list[str]:
        made = []
        async with AsyncClient(registry.address) as c, c.session("writer") as s, \
                contextlib.aclosing(aproduce_each(s, "t1")) as outputs:
            async for out in outputs:
                with out:
                    await out.write(out.claim.file_id.encode())
                made.append(out.claim.file_id)
        return made

    assert sorted(asyncio.run(produce())) == ids
    wait_for(lambda: all(e.state == pb.ENTRY_STATE_VERIFIED
                         for e in client.operator.list_entries("t1")), 20, "all verified")

    async def consume() -> dict[str, bytes]:
        got = {}
        async with AsyncClient(registry.address) as c, c.session("reader") as s:
            async for delivery in aconsume_each(s, "t1", timeout=1):
                got[delivery.lease.file_id] = delivery.data
        return got

    assert asyncio.run(consume()) == {f: f.encode() for f in ids}
    assert {e.state for e in client.operator.list_entries("t1")} == {pb.ENTRY_STATE_CONSUMED}


def test_the_asyncio_client_makes_the_agents_unary_calls(
        client: Client, registry: RegistryHandle) -> None:
    """A session without a stream (open_unary_session) claims, commits, refreshes and
    closes with unary calls, as the blocking client's keepalive=False session does; a
    call naming no session (unary()) commits with the token alone."""
    task(client, "t1", ["a", "b"], digest_optional=True)

    async def run() -> tuple[int, list[int]]:
        async with AsyncClient(registry.address) as c:
            s = await c.open_unary_session("oneshot", ttl=30)
            first = await s.claim("t1", "a")
            second = await s.claim("t1", "b")
            ttl = await s.refresh()
            await s.commit("t1", "a", first.token, 0)
            await c.unary().commit("t1", "b", second.token, 0)  # the token is enough
            with pytest.raises(errors.StaleToken):
                await c.unary().commit("t1", "b", second.token - 1, 0)
            await s.close()
            with pytest.raises(errors.BatonError):
                await s.refresh()  # its lease is gone
            return ttl, [(await c.get_entry("t1", f)).state for f in ("a", "b")]

    ttl, states = asyncio.run(run())
    assert ttl == 30
    assert states == [pb.ENTRY_STATE_WRITTEN, pb.ENTRY_STATE_WRITTEN]


def test_a_blocking_call_on_the_clients_own_loop_is_refused(client: Client) -> None:
    """Waiting on the loop that would run the call is refused with an error that says
    so, not a hang."""
    task(client, "t1", ["a"])

    async def blocking_inside() -> None:
        client.claim("t1", session=0)

    with pytest.raises(RuntimeError, match="would wait for itself"):
        client.spawn(lambda _: blocking_inside()).result(timeout=10)
