"""A task's end racing its entries, on a real etcd: completion against an entry opened
again, cancel against commits and the reaper while its claims go a chunk at a time."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import blake3
import pytest
from registry_fixtures import on_etcd

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.identity import ANONYMOUS
from baton_relay.registry.rules.core import Core
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import ClaimRef, Keys
from baton_relay.registry.store.txn import Txn
from baton_relay.registry.sweeps.scheduler import Scheduler
from baton_relay.registry.verbs.consumers import Consumers
from baton_relay.registry.verbs.operators import CANCEL_FINISHED_AFTER, CLAIM_CHUNK, Operators
from baton_relay.registry.verbs.producers import Producers
from baton_relay.registry.verbs.sessions import Sessions
from baton_relay.registry.verbs.tasks import Tasks
from baton_relay.registry.verbs.verify import Verifier

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


# --- completion -------------------------------------------------------------------------


async def _finished_task(core: Core) -> None:
    """Task t: part p of assembly a, both done (p verified, a consumed), and d dead."""
    await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(
        task_id="t", entries=[
            pb.EntrySpec(file_id="p", path="p"),
            pb.EntrySpec(file_id="d", path="d", max_retries=0),
            pb.EntrySpec(file_id="a", path="a", parts=["p"])])))
    session = (await Sessions(core).open(pb.OpenSessionRequest(agent="x", ttl=30),
                                         ANONYMOUS)).session_id
    producers = Producers(core)
    claim = await producers.claim(pb.ClaimRequest(task_id="t", file_id="p",
                                                  session_id=session), ANONYMOUS)
    await producers.commit(pb.CommitRequest(task_id="t", file_id="p", token=claim.token,
                                            size=1, digest=digest(b"x")), ANONYMOUS)
    await Verifier(core).report(pb.ReportVerificationRequest(task_id="t", file_id="p", size=1,
                                                      digest=digest(b"x")))
    assert await Scheduler(core).check_waiting("t", "a")  # the assembly is verified
    consumers = Consumers(core)
    lease = await consumers.consume(pb.ConsumeRequest(task_id="t", group="default",
                                                      session_id=session), ANONYMOUS)
    await consumers.ack(pb.AckRequest(task_id="t", file_id="a", group="default",
                                      token=lease.token), ANONYMOUS)
    claim = await producers.claim(pb.ClaimRequest(task_id="t", file_id="d",
                                                  session_id=session), ANONYMOUS)
    await producers.fail(pb.FailRequest(task_id="t", file_id="d", token=claim.token),
                         ANONYMOUS)


async def _requeue_dead(core: Core) -> None:
    await Operators(core).requeue(pb.RequeueRequest(task_id="t", file_id="d"), ANONYMOUS)


async def _part_changed_on_disk(core: Core) -> None:
    """The watcher finds the verified part changed: it takes the retry path (open again);
    nothing writes the task header."""
    await Verifier(core).report(pb.ReportVerificationRequest(task_id="t", file_id="p", size=1,
                                                      digest=digest(b"y")))


@pytest.mark.parametrize("reopen", [_requeue_dead, _part_changed_on_disk],
                         ids=["requeue", "part-changed"])
def test_an_entry_opened_between_the_count_and_the_completion_keeps_the_task_active(
        etcd: Any, prefix: str, monkeypatch: pytest.MonkeyPatch,
        reopen: Callable[[Core], Awaitable[None]]) -> None:
    """Completion planned on an empty open index, an entry opened before it commits: the
    task stays active with its open entry, and is not completed on the next look."""
    real = Scheduler._complete_plan
    fired: list[str] = []

    async def body() -> tuple[int, int, str, str]:
        conn = Etcd(etcd.endpoint)
        await conn.connect()
        core = Core(conn, Keys(prefix), "/staging")
        await core.start()

        def interleaved(self: Scheduler, task_id: str) -> Callable[[Txn], Awaitable[bool]]:
            plan = real(self, task_id)

            async def then_reopen(txn: Txn) -> bool:
                complete = await plan(txn)
                if complete and not fired:
                    fired.append(task_id)
                    await reopen(core)  # commits before the completion does
                return complete

            return then_reopen

        monkeypatch.setattr(Scheduler, "_complete_plan", interleaved)
        try:
            await _finished_task(core)
            scheduler = Scheduler(core)
            first = await scheduler.complete_tasks()
            again = await scheduler.complete_tasks()
            task = await Tasks(core).get("t")
            states = sorted(f"{e.file_id}:{pb.EntryState.Name(e.state)}" for e in (
                await Tasks(core).list_entries(pb.ListEntriesRequest(task_id="t"))).entries)
            return first, again, pb.TaskStatus.Name(task.status), " ".join(states)
        finally:
            await core.stop()
            await conn.close()

    first, again, status, states = asyncio.run(body())
    assert fired == ["t"]
    assert (first, again, status) == (0, 0, "TASK_STATUS_ACTIVE")
    assert "PENDING" in states, states


def test_a_finished_task_still_completes(etcd: Any, prefix: str) -> None:
    """(The same task with nothing in between completes: the hook above is what stops it.)"""
    async def body() -> str:
        conn = Etcd(etcd.endpoint)
        await conn.connect()
        core = Core(conn, Keys(prefix), "/staging")
        await core.start()
        try:
            await _finished_task(core)
            assert await Scheduler(core).complete_tasks() == 1
            return pb.TaskStatus.Name((await Tasks(core).get("t")).status)
        finally:
            await core.stop()
            await conn.close()

    assert asyncio.run(body()) == "TASK_STATUS_COMPLETED"


# --- cancel -----------------------------------------------------------------------------

CLAIMS = 250  # more than six chunks of revocation, and than MAX_TXN_OPS keys


def _count(registry: Any, base: bytes) -> int:
    async def work(etcd: Etcd) -> int:
        return await etcd.count(base)

    return on_etcd(registry.etcd, work)


def _journal_events(registry: Any, task_id: str) -> list[str]:
    base = Keys(registry.prefix).journal_all(task_id)

    async def work(etcd: Etcd) -> list[str]:
        return [json.loads(kv.value)["event"] async for kv in etcd.scan(base, page=1000)]

    return on_etcd(registry.etcd, work)


def _on_loop(registry: Any, work: Coroutine[Any, Any, int]) -> int:
    """``work`` run on the registry's own loop (while its calls go on)."""
    done: int = asyncio.run_coroutine_threadsafe(work, registry._loop).result(30)
    return done


def _sweep(registry: Any) -> int:
    """One reaper sweep (while the cancel is under way)."""
    return _on_loop(registry, registry.reaper.sweep())


def _claimed_task(client: Client, session: Any) -> list[Any]:
    client.operator.create_task({"task_id": "t", "entries": [
        {"file_id": f"e{i:03d}", "path": f"e{i:03d}"} for i in range(CLAIMS)]})
    claims: list[Any] = []
    while len(claims) < CLAIMS:
        claims += client.claim_batch("t", 21, session=session)
    return claims


@pytest.fixture
def paused_revocation(monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[threading.Event, threading.Event]:
    """Cancel stops after its first chunk of claims until the test says go on."""
    halfway, go = threading.Event(), threading.Event()
    real = Operators._revoke_chunk

    async def revoke_chunk(self: Operators, keys: list[bytes]) -> None:
        await real(self, keys)
        if not halfway.is_set():
            halfway.set()
            await asyncio.to_thread(go.wait, 30)

    monkeypatch.setattr(Operators, "_revoke_chunk", revoke_chunk)
    return halfway, go


def test_commits_racing_a_cancel_are_refused_once_the_status_changed(
        registry: Any, client: Client,
        paused_revocation: tuple[threading.Event, threading.Event]) -> None:
    """Cancel of a task with 250 claims, held after its first chunk: a claim not yet
    revoked can no longer commit or fail, and a reaper sweep moves nothing; at the end
    no claim or twin is left and every entry is as its claim left it."""
    halfway, go = paused_revocation
    keys = Keys(registry.prefix)
    with client.open_session("p", ttl=60, slots=CLAIMS) as s:
        claims = _claimed_task(client, s)
        done: list[pb.Task] = []
        cancel = threading.Thread(target=lambda: done.append(client.operator.cancel_task("t")))
        cancel.start()
        try:
            assert halfway.wait(30), "cancel never revoked a chunk"
            left = _count(registry, keys.claims_of_task("p", "t"))
            assert left == CLAIMS - CLAIM_CHUNK  # the rest of the claims still live
            last = claims[-1]
            assert _count(registry, keys.claim(ClaimRef("p", "t", last.file_id))) == 1
            with pytest.raises(errors.StaleToken, match="task 't' is cancelled"):
                client.commit("t", last.file_id, last.token, 1, digest(b"x"))
            with pytest.raises(errors.StaleToken, match="is void"):
                client.fail("t", last.file_id, last.token, "racing the cancel")
            assert client.operator.get_entry("t", last.file_id).state == pb.ENTRY_STATE_WRITING
            assert _sweep(registry) == 0
        finally:
            go.set()
            cancel.join(30)
        assert done and done[0].status == pb.TASK_STATUS_CANCELLED
        for base in (keys.claims_of_task("p", "t"), keys.inflight_of_task("p", "t"),
                     keys.ready_all("t"), keys.slots(s.session_id)):
            assert _count(registry, base) == 0, base
        assert _sweep(registry) == 0
        assert registry.reaper.reaped == 0
        events = _journal_events(registry, "t")
        assert events.count("claimed") == CLAIMS and set(events) == {"claimed"}
        assert {e.state for e in client.operator.list_entries("t")} == {pb.ENTRY_STATE_WRITING}


@pytest.mark.parametrize("finish", ["cancel again", "scheduler"])
def test_a_cancel_interrupted_half_way_is_finished(
        registry: Any, client: Client, monkeypatch: pytest.MonkeyPatch, finish: str) -> None:
    """The registry fails after the first chunk of claims: the task is cancelled (no
    token of it commits), and the same cancel again, or the scheduler's sweep of
    cancelled tasks, revokes the rest."""
    keys = Keys(registry.prefix)
    real = Operators._revoke_chunk
    chunks: list[int] = []

    async def failing(self: Operators, chunk: list[bytes]) -> None:
        chunks.append(len(chunk))
        if len(chunks) == 2:
            raise RuntimeError("registry stopped")
        await real(self, chunk)

    monkeypatch.setattr(Operators, "_revoke_chunk", failing)
    with client.open_session("p", ttl=60, slots=CLAIMS) as s:
        claims = _claimed_task(client, s)
        with pytest.raises(errors.Internal):
            client.operator.cancel_task("t", "wrong input")
        assert _count(registry, keys.claims_of_task("p", "t")) == CLAIMS - CLAIM_CHUNK
        with pytest.raises(errors.StaleToken):
            client.commit("t", claims[-1].file_id, claims[-1].token, 1, digest(b"x"))

        if finish == "cancel again":
            assert client.operator.cancel_task("t",
                                               "wrong input").status == pb.TASK_STATUS_CANCELLED
        else:
            # The cancel's key falls due 30 s on: as then (the scheduler's own sweep may
            # come first: the same code; then this finds none).
            scheduler = registry._running.scheduler
            core = registry._running.core
            later = core.clock() + CANCEL_FINISHED_AFTER + 1
            monkeypatch.setattr(core, "clock", lambda: later)
            assert _on_loop(registry, scheduler.finish_cancels()) in (0, 1)
            assert _on_loop(registry, scheduler.finish_cancels()) == 0  # nothing left
            assert _count(registry, keys.cancels()) == 0  # handled: its key gone

        for base in (keys.claims_of_task("p", "t"), keys.inflight_of_task("p", "t"),
                     keys.ready_all("t"), keys.slots(s.session_id)):
            assert _count(registry, base) == 0, base
        assert _sweep(registry) == 0


def test_a_lease_lost_during_a_cancel_leaves_the_entry_as_it_was(
        registry: Any, client: Client,
        paused_revocation: tuple[threading.Event, threading.Event]) -> None:
    """An agent's lease ends while the cancel is revoking claims: the reaper deletes
    the twin its claim left, and moves the entry of the cancelled task nowhere."""
    halfway, go = paused_revocation
    keys = Keys(registry.prefix)
    with client.open_session("p", ttl=60, slots=CLAIMS) as s:
        claims = _claimed_task(client, s)
        lost = client.open_session("lost", ttl=2, keepalive=False)
        # the claim to lose is of the task being cancelled: hand one over to it
        last = claims[-1]
        client.fail("t", last.file_id, last.token, "handed on", session=s)
        cancel = threading.Thread(target=lambda: client.operator.cancel_task("t"))
        try:
            while "claimable" not in client.operator.explain("t", last.file_id).text:
                halfway.wait(0.05)
            client.claim("t", last.file_id, session=lost)
            cancel.start()
            assert halfway.wait(30), "cancel never revoked a chunk"
            twin = keys.inflight(ClaimRef("p", "t", last.file_id))
            deadline = 30.0
            while _count(registry, keys.claim(ClaimRef("p", "t", last.file_id))) and deadline:
                halfway.wait(0.1)  # the lost session's lease runs out (2 s)
                deadline -= 0.1
            # The claim went with its lease. The twin it left is deleted by the reaper,
            # woken by that deletion, or else by this sweep (whichever comes first; a
            # race the test cannot order), and neither moves the entry.
            assert _sweep(registry) == 0
            assert _count(registry, twin) == 0
            assert client.operator.get_entry("t", last.file_id).state == pb.ENTRY_STATE_WRITING
        finally:
            go.set()
            if cancel.is_alive():
                cancel.join(30)
