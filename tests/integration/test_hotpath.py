"""The hot path: a claim is one etcd transaction and a commit is one, from a watch-fed view."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import blake3
import pytest

from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.identity import ANONYMOUS
from baton_relay.registry.rules.core import Core
from baton_relay.registry.store.etcd import KV, Compare, Etcd, Guarded, TxnOp, TxnResult
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.verbs.consumers import Consumers
from baton_relay.registry.verbs.fused import Fused
from baton_relay.registry.verbs.producers import Producers
from baton_relay.registry.verbs.sessions import Sessions
from baton_relay.registry.verbs.tasks import Tasks

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

#: the digest each commit carries (of no bytes: the cycles write no file, nothing compares)
EMPTY = blake3.blake3(b"").hexdigest()


class CountingEtcd(Etcd):
    """The real etcd client, counting the key-value requests it sends."""

    requests = 0
    ranges = 0
    #: (compares, operations) of each transaction sent, in order
    shapes: list[tuple[int, int]]

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.shapes = []

    async def get(self, key: bytes) -> KV | None:
        self.requests += 1
        return await super().get(key)

    async def range(self, prefix: bytes, **kw: Any) -> tuple[list[KV], int, bool]:
        self.requests += 1
        self.ranges += 1
        return await super().range(prefix, **kw)

    async def txn(self, compares: Sequence[Compare], success: Sequence[TxnOp],
                  failure: Sequence[TxnOp] = ()) -> TxnResult:
        self.requests += 1
        self.shapes.append((len(compares), len(success)))
        return await super().txn(compares, success, failure)

    async def txn_group(self, group: Sequence[Guarded]) -> tuple[int, list[TxnResult]]:
        self.requests += 1
        self.shapes += [(len(g.compares), len(g.success)) for g in group]
        return await super().txn_group(group)


async def _started(endpoint: str, prefix: str) -> tuple[CountingEtcd, Core]:
    """A counting etcd client and a core on it, started."""
    etcd = CountingEtcd(endpoint, timeout=60)
    await etcd.connect()
    core = Core(etcd, Keys(prefix), "/staging")
    await core.start()
    return etcd, core


async def _cycles(endpoint: str, prefix: str, size: int, cycles: int,
                  request_ids: bool) -> tuple[CountingEtcd, Core]:
    etcd, core = await _started(endpoint, prefix)
    spec = pb.TaskSpec(task_id="t", entries=[
        pb.EntrySpec(file_id=f"e{i:06d}", path=f"e{i:06d}") for i in range(size)])
    await Tasks(core).create(pb.CreateTaskRequest(spec=spec))
    session = await Sessions(core).open(pb.OpenSessionRequest(agent="a", ttl=30), ANONYMOUS)
    producers = Producers(core)
    # The first claim fills the view's window of the ready index.
    first = await producers.claim(pb.ClaimRequest(task_id="t", session_id=session.session_id),
                                  ANONYMOUS)
    await producers.commit(pb.CommitRequest(task_id="t", file_id=first.entry.file_id,
                                            token=first.token, digest=EMPTY), ANONYMOUS)
    etcd.requests = etcd.ranges = 0
    for i in range(cycles):
        claim = await producers.claim(pb.ClaimRequest(
            task_id="t", session_id=session.session_id,
            request_id=f"c{i}" if request_ids else ""), ANONYMOUS)
        await producers.commit(pb.CommitRequest(
            task_id="t", file_id=claim.entry.file_id, token=claim.token, digest=EMPTY,
            request_id=f"m{i}" if request_ids else ""), ANONYMOUS)
    return etcd, core


def test_a_claim_and_a_commit_are_one_request_each(etcd: Any, prefix: str) -> None:
    """A claim → commit cycle at one agent costs at most two etcd requests, retries recorded."""
    async def body() -> float:
        client, core = await _cycles(etcd.endpoint, prefix, 300, 100, request_ids=True)
        try:
            return client.requests / 100
        finally:
            await core.stop()
            await client.close()

    per_cycle = asyncio.run(body())
    # Two transactions per cycle, plus one window refill per page of the index.
    assert per_cycle <= 2.1, f"{per_cycle:.2f} etcd requests per claim → commit cycle"


def test_a_fused_commit_and_claim_is_one_request(etcd: Any, prefix: str) -> None:
    """Commit-and-claim-the-next at one agent costs at most 1.1 etcd requests per cycle,
    and the claims it hands out are the live ones."""
    async def body() -> tuple[float, int]:
        client, core = await _started(etcd.endpoint, prefix)
        try:
            spec = pb.TaskSpec(task_id="t", entries=[
                pb.EntrySpec(file_id=f"e{i:06d}", path=f"e{i:06d}") for i in range(300)])
            await Tasks(core).create(pb.CreateTaskRequest(spec=spec))
            session = await Sessions(core).open(pb.OpenSessionRequest(agent="a", ttl=30),
                                                ANONYMOUS)
            sid = session.session_id
            producers = Producers(core)
            fused = Fused(producers, Consumers(core))
            claim = await producers.claim(pb.ClaimRequest(task_id="t", session_id=sid),
                                          ANONYMOUS)
            client.requests = 0
            committed = 0
            for i in range(100):
                step = await fused.commit_and_claim(pb.CommitAndClaimRequest(
                    commit=pb.CommitRequest(task_id="t", file_id=claim.entry.file_id,
                                            token=claim.token, digest=EMPTY, session_id=sid,
                                            request_id=f"m{i}"),
                    claim=pb.ClaimRequest(session_id=sid)), ANONYMOUS)
                assert step.entry.state == pb.ENTRY_STATE_WRITTEN and step.HasField("next")
                committed += 1
                claim = step.next
            return client.requests / 100, committed
        finally:
            await core.stop()
            await client.close()

    per_cycle, committed = asyncio.run(body())
    assert committed == 100
    assert per_cycle <= 1.1, f"{per_cycle:.2f} etcd requests per fused cycle"


def test_claims_do_not_range_over_the_task(etcd: Any, prefix: str) -> None:
    """Range reads per claim do not grow with the task: a window page per 128 claims."""
    async def body() -> int:
        client, core = await _cycles(etcd.endpoint, prefix, 5000, 300, request_ids=False)
        try:
            return client.ranges
        finally:
            await core.stop()
            await client.close()

    ranges = asyncio.run(body())
    assert ranges <= 300 // 128 + 2, f"{ranges} range reads for 300 claims"


def test_manifest_validation_runs_off_the_event_loop(
        etcd: Any, prefix: str, monkeypatch: Any) -> None:
    """CreateTask validates the manifest in a worker thread, never on the event loop."""
    import threading

    import baton_relay.registry.verbs.tasks as tasks_module

    seen: list[str] = []
    real = tasks_module.validate

    def spy(spec: pb.TaskSpec) -> Any:
        seen.append(threading.current_thread().name)
        return real(spec)

    monkeypatch.setattr(tasks_module, "validate", spy)

    async def body() -> str:
        client = Etcd(etcd.endpoint)
        await client.connect()
        core = Core(client, Keys(prefix), "/staging")
        try:
            spec = pb.TaskSpec(task_id="t", entries=[pb.EntrySpec(file_id="a", path="a")])
            await Tasks(core).create(pb.CreateTaskRequest(spec=spec))
            return threading.current_thread().name
        finally:
            await core.stop()
            await client.close()

    loop_thread = asyncio.run(body())
    assert seen and all(name != loop_thread for name in seen)


def test_completion_looks_at_the_tasks_whose_entries_finished(etcd: Any, prefix: str) -> None:
    """Finishing an entry writes its finishing key; the completion sweep reads only those,
    completes the task and deletes them."""
    from baton_relay.registry.sweeps.scheduler import Scheduler
    from baton_relay.registry.verbs.consumers import Consumers
    from baton_relay.registry.verbs.verify import Verifier

    async def body() -> tuple[int, str, str, int]:
        client = Etcd(etcd.endpoint)
        await client.connect()
        core = Core(client, Keys(prefix), "/staging")
        await core.start()
        try:
            await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(
                task_id="t", entries=[pb.EntrySpec(file_id="a", path="a")])))
            session = await Sessions(core).open(pb.OpenSessionRequest(agent="a", ttl=30),
                                                ANONYMOUS)
            producers = Producers(core)
            claim = await producers.claim(pb.ClaimRequest(task_id="t",
                                                          session_id=session.session_id),
                                          ANONYMOUS)
            digest = EMPTY
            await producers.commit(pb.CommitRequest(task_id="t", file_id="a",
                                                    token=claim.token, size=0, digest=digest),
                                   ANONYMOUS)
            await Verifier(core).report(pb.ReportVerificationRequest(task_id="t", file_id="a",
                                                              size=0, digest=digest))
            # Consumed by its one group: the entry is done, on this replica.
            consumers = Consumers(core)
            lease = await consumers.consume(pb.ConsumeRequest(
                task_id="t", group="default", session_id=session.session_id), ANONYMOUS)
            await consumers.ack(pb.AckRequest(task_id="t", file_id="a", group="default",
                                              token=lease.token), ANONYMOUS)
            marked = await client.count(core.keys.finishing_all())
            before = (await Tasks(core).get("t")).status
            await Scheduler(core).complete_tasks()
            after = (await Tasks(core).get("t")).status
            left = await client.count(core.keys.finishing_all())
            return marked, pb.TaskStatus.Name(before), pb.TaskStatus.Name(after), left
        finally:
            await core.stop()
            await client.close()

    marked, before, after, left = asyncio.run(body())
    assert marked == 1  # written with the ack that finished the entry
    assert (before, after, left) == ("TASK_STATUS_ACTIVE", "TASK_STATUS_COMPLETED", 0)


def test_a_replica_whose_view_is_behind_still_releases_a_dependent(
        etcd: Any, prefix: str) -> None:
    """A dependency verified through another replica releases its dependent on this one."""
    from baton_relay.registry.sweeps.scheduler import Scheduler
    from baton_relay.registry.verbs.verify import Verifier

    async def body() -> tuple[bool, str]:
        client = Etcd(etcd.endpoint)
        await client.connect()
        a = Core(client, Keys(prefix), "/staging")
        b = Core(client, Keys(prefix), "/staging")
        await a.start()
        await b.start()
        try:
            await Tasks(a).create(pb.CreateTaskRequest(spec=pb.TaskSpec(task_id="t", entries=[
                pb.EntrySpec(file_id="d", path="d"),
                pb.EntrySpec(file_id="x", path="x", depends_on=["d"])])))
            session = await Sessions(a).open(pb.OpenSessionRequest(agent="a", ttl=30),
                                             ANONYMOUS)
            claim = await Producers(a).claim(pb.ClaimRequest(
                task_id="t", file_id="d", session_id=session.session_id), ANONYMOUS)
            digest = EMPTY
            # Committed through A (A now holds `d` as written), verified through B.
            await Producers(a).commit(pb.CommitRequest(task_id="t", file_id="d",
                                                       token=claim.token, digest=digest),
                                      ANONYMOUS)
            await Verifier(b).report(pb.ReportVerificationRequest(task_id="t", file_id="d",
                                                           digest=digest))
            released = await Scheduler(a).check_waiting("t", "x")
            kv = await client.get(Keys(prefix).entry("t", "x"))
            assert kv is not None
            return released, str(json.loads(kv.value).get("deps_ok", True))
        finally:
            await a.stop()
            await b.stop()
            await client.close()

    released, deps_ok = asyncio.run(body())
    assert released and deps_ok == "True"


def test_routing_reads_nothing_from_etcd(etcd: Any, prefix: str) -> None:
    """A verification that routes by the task's rules costs the requests of one that
    does not: the rules come from the view's copy of the task header."""
    from baton_relay.registry.verbs.verify import Verifier

    async def requests_per_verification(task: str, rules: list[pb.RoutingRule]) -> float:
        client, core = await _started(etcd.endpoint, prefix)
        try:
            await Tasks(core).create(pb.CreateTaskRequest(spec=pb.TaskSpec(
                task_id=task, consumers=["pdf", "review"], routing_rules=rules,
                entries=[pb.EntrySpec(file_id=f"e{i}", path=f"e{i}") for i in range(20)])))
            session = await Sessions(core).open(pb.OpenSessionRequest(agent="a", ttl=30),
                                                ANONYMOUS)
            producers, verifier = Producers(core), Verifier(core)
            for _ in range(20):
                claim = await producers.claim(pb.ClaimRequest(
                    task_id=task, session_id=session.session_id), ANONYMOUS)
                await producers.commit(pb.CommitRequest(
                    task_id=task, file_id=claim.entry.file_id, token=claim.token,
                    digest=EMPTY, attributes=json.dumps(
                        {"score": 90 + int(claim.entry.file_id[1:])})), ANONYMOUS)
            client.requests = 0
            for i in range(20):
                entry = await verifier.report(pb.ReportVerificationRequest(
                    task_id=task, file_id=f"e{i}", digest=EMPTY))
                assert entry.state == pb.ENTRY_STATE_VERIFIED
                assert list(entry.routed_to) == (["review"] if rules and i > 5 else [])
            return client.requests / 20
        finally:
            await core.stop()
            await client.close()

    plain = asyncio.run(requests_per_verification("plain", []))
    routed = asyncio.run(requests_per_verification("routed", [pb.RoutingRule(
        condition="$[?(@.score > 95)]", groups=["review"])]))
    assert routed <= plain, f"{routed:.2f} requests per routed verification, {plain:.2f} without"


#: compares and operations of each step's one transaction, with a slot and a deadline
#: (as on the revision before the claim object: writing a claim in one place costs none;
#: a verification compares the task header too: a cancelled task's entries stay as they were)
SHAPES = {
    "claim": (7, 7), "commit": (4, 5), "verify": (3, 3), "commit and claim": (10, 12),
    "fail": (4, 6), "consume": (6, 6), "nack": (4, 6), "ack and consume": (9, 13),
    # the last ack of an entry also writes its finishing key (task completion's signal)
    "ack": (4, 7),
}


def test_each_step_is_one_transaction_of_a_fixed_size(etcd: Any, prefix: str) -> None:
    """Each step of the agents' loops (claim, commit, consume, ack, fail, nack, the
    fused steps) is one transaction whose compares and operations stay as listed."""
    async def body() -> dict[str, list[tuple[int, int]]]:
        client, core = await _started(etcd.endpoint, prefix)
        shapes: dict[str, list[tuple[int, int]]] = {}
        try:
            spec = pb.TaskSpec(task_id="t", consumers=["g"], claim_deadline_seconds=60,
                               consume_deadline_seconds=60, entries=[
                                   pb.EntrySpec(file_id=f"e{i}", path=f"e{i}")
                                   for i in range(4)])
            await Tasks(core).create(pb.CreateTaskRequest(spec=spec))
            sid = (await Sessions(core).open(pb.OpenSessionRequest(
                agent="a", ttl=30, slots=4), ANONYMOUS)).session_id
            producers, consumers = Producers(core), Consumers(core)
            fused = Fused(producers, consumers)

            async def step(name: str, call: Any) -> Any:
                client.shapes.clear()
                out = await call
                shapes[name] = client.shapes[-1:]  # the step's own: the last
                return out

            def commit(c: pb.ClaimResponse) -> pb.CommitRequest:
                return pb.CommitRequest(task_id="t", file_id=c.entry.file_id,
                                        token=c.token, size=0, digest=EMPTY, session_id=sid)

            def report(file_id: str) -> pb.ReportVerificationRequest:
                return pb.ReportVerificationRequest(task_id="t", file_id=file_id, size=0,
                                             digest=EMPTY)

            c = await step("claim", producers.claim(
                pb.ClaimRequest(task_id="t", session_id=sid), ANONYMOUS))
            await step("commit", producers.commit(commit(c), ANONYMOUS))
            await step("verify", producers.verifier.report(report(c.entry.file_id)))
            c2 = await producers.claim(pb.ClaimRequest(task_id="t", session_id=sid), ANONYMOUS)
            both = await step("commit and claim", fused.commit_and_claim(
                pb.CommitAndClaimRequest(commit=commit(c2), claim=pb.ClaimRequest()),
                ANONYMOUS))
            await producers.verifier.report(report(c2.entry.file_id))
            await step("fail", producers.fail(pb.FailRequest(
                task_id="t", file_id=both.next.entry.file_id, token=both.next.token,
                reason="test"), ANONYMOUS))
            lease = await step("consume", consumers.consume(
                pb.ConsumeRequest(task_id="t", group="g", session_id=sid), ANONYMOUS))
            await step("nack", consumers.nack(pb.NackRequest(
                task_id="t", file_id=lease.entry.file_id, group="g", token=lease.token),
                ANONYMOUS))
            lease = await consumers.consume(
                pb.ConsumeRequest(task_id="t", group="g", session_id=sid), ANONYMOUS)
            nxt = await step("ack and consume", fused.ack_and_consume(
                pb.AckAndConsumeRequest(ack=pb.AckRequest(
                    task_id="t", file_id=lease.entry.file_id, group="g", token=lease.token,
                    session_id=sid), consume=pb.ConsumeRequest()), ANONYMOUS))
            assert nxt.HasField("next"), nxt.next_error
            await step("ack", consumers.ack(pb.AckRequest(
                task_id="t", file_id=nxt.next.entry.file_id, group="g",
                token=nxt.next.token), ANONYMOUS))
            return shapes
        finally:
            await core.stop()
            await client.close()

    shapes = asyncio.run(body())
    assert shapes == {name: [shape] for name, shape in SHAPES.items()}


def test_many_planners_at_once_keep_the_window(etcd: Any, prefix: str) -> None:
    """Many agents' fused loops at once on one replica: a planner whose candidates
    another planner of the replica took while it read them plans again on the same
    window, which is current; it neither reads the index again from etcd (its window
    thrown away as if behind) nor is told there is nothing to claim. (How often plans
    are made again on the view depends on how the planners meet — 0 to 300 here, at
    no etcd request — and is not bounded.)"""
    agents, steps, size = 48, 30, 3000

    async def body() -> tuple[int, int]:
        client, core = await _started(etcd.endpoint, prefix)
        try:
            spec = pb.TaskSpec(task_id="t", entries=[
                pb.EntrySpec(file_id=f"e{i:06d}", path=f"e{i:06d}") for i in range(size)])
            await Tasks(core).create(pb.CreateTaskRequest(spec=spec))
            producers = Producers(core)
            fused = Fused(producers, Consumers(core))
            sids = [(await Sessions(core).open(pb.OpenSessionRequest(agent=f"a{n}", ttl=30),
                                               ANONYMOUS)).session_id for n in range(agents)]
            gate = asyncio.Event()

            async def loop(sid: str) -> list[str]:
                await gate.wait()
                claim = await producers.claim(pb.ClaimRequest(task_id="t", session_id=sid),
                                              ANONYMOUS)
                done = []
                for _ in range(steps):
                    step = await fused.commit_and_claim(pb.CommitAndClaimRequest(
                        commit=pb.CommitRequest(task_id="t", file_id=claim.entry.file_id,
                                                token=claim.token, digest=EMPTY,
                                                session_id=sid),
                        claim=pb.ClaimRequest(session_id=sid)), ANONYMOUS)
                    assert step.HasField("next"), step.next_error
                    done.append(claim.entry.file_id)
                    claim = step.next
                return done

            tasks = [asyncio.create_task(loop(sid)) for sid in sids]
            client.requests = client.ranges = 0
            gate.set()
            committed = [f for done in await asyncio.gather(*tasks) for f in done]
            assert len(set(committed)) == len(committed) == agents * steps
            return client.ranges, client.requests
        finally:
            await core.stop()
            await client.close()

    ranges, requests = asyncio.run(body())
    claims = agents * (steps + 1)
    # a window page per 128 claims (and the delayed index's once), as for one agent
    assert ranges <= claims // 128 + 4, f"{ranges} range reads for {claims} claims"
    assert requests <= claims, f"{requests} etcd requests for {claims} fused steps"
