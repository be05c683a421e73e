"""An agent's session on one stream: its calls, its keepalive, its resumption."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import TEST_RETRY, RegistryHandle

from baton_relay.client import Client, consume_each, produce_each
from baton_relay.client.aio import AsyncClient
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

DIGEST = "0" * 64


def manifest(task: str, n: int, **extra: Any) -> dict[str, Any]:
    return {"task_id": task, "entries": [{"file_id": f"f{i:03d}", "path": f"f{i:03d}"}
                                         for i in range(n)], **extra}


def streams_of(registry: RegistryHandle) -> Any:
    return registry._running.streams


def test_a_keepalive_session_sends_its_calls_on_its_stream(
        registry: RegistryHandle, client: Client) -> None:
    """Claim, commit, consume and ack of a kept-alive session travel as stream messages."""
    client.operator.create_task(manifest("t", 1))
    streams = streams_of(registry)
    with client.open_session("p", ttl=10) as s:
        assert s.stream is not None and streams.open == 1
        claim = client.claim("t", session=s)
        client.commit("t", claim.file_id, claim.token, 1, DIGEST, session=s)
        client.watcher.report("t", claim.file_id, 1, DIGEST)
        lease = client.consume("t", "default", session=s)
        entry = client.ack("t", lease.file_id, "default", lease.token, session=s)
    assert entry.state == pb.ENTRY_STATE_CONSUMED
    assert {k: streams.served[k] for k in ("claim", "commit", "consume", "ack")} == {
        "claim": 1, "commit": 1, "consume": 1, "ack": 1}


def test_concurrent_calls_on_one_stream_each_get_their_own_reply_or_error(
        registry: RegistryHandle) -> None:
    """Thirty calls in flight at once on one stream: each reply is its own call's, and a
    call's error is that call's alone."""
    with Client(registry.address, retry=TEST_RETRY) as c:
        c.operator.create_task(manifest("t", 20))

    async def run() -> list[Any]:
        async with AsyncClient(registry.address) as ac, ac.session("many", ttl=10) as s:
            good = [s.claim("t", f"f{i:03d}") for i in range(20)]
            bad = [s.claim("t", f"nope{i}") for i in range(5)]
            other = [s.claim("missing-task") for _ in range(5)]
            return await asyncio.gather(*good, *bad, *other, return_exceptions=True)

    results = asyncio.run(run())
    assert [r.file_id for r in results[:20]] == [f"f{i:03d}" for i in range(20)]
    assert all(r.token > 0 for r in results[:20])
    assert all(isinstance(r, errors.NotFound) for r in results[20:])
    assert all("nope" in str(r) for r in results[20:25])
    assert all("missing-task" in str(r) for r in results[25:])


def test_keepalive_rides_on_the_stream_and_holds_a_claim_past_its_ttl(
        registry: RegistryHandle, client: Client) -> None:
    """A 2 s session keeps its claim for 5 s on keepalive messages alone."""
    client.operator.create_task(manifest("t", 1))
    streams = streams_of(registry)
    with client.open_session("p", ttl=2) as s:
        claim = client.claim("t", session=s)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert client.operator.get_entry("t", claim.file_id).token == claim.token
            time.sleep(0.25)
        assert streams.served["keepalive"] >= 4
        assert client.commit("t", claim.file_id, claim.token, 1, DIGEST,
                             session=s).state == pb.ENTRY_STATE_WRITTEN


def test_a_reply_lost_with_its_stream_is_answered_from_the_request_record(
        registry: RegistryHandle, client: Client) -> None:
    """The stream breaks after a commit applied and before its reply: the session is
    resumed on a new stream, the commit sent again answers as the first did, and the
    entry was committed once."""
    client.operator.create_task(manifest("t", 1))
    streams = streams_of(registry)
    cuts: list[str] = []

    def cut_first_commit(kind: str) -> bool:
        if kind == "commit" and not cuts:
            cuts.append(kind)
            return True
        return False

    with client.open_session("p", ttl=10) as s:
        claim = client.claim("t", session=s)
        streams.cut = cut_first_commit
        entry = client.commit("t", claim.file_id, claim.token, 1, DIGEST, session=s)
        assert cuts == ["commit"] and s.stream is not None and s.stream.resumed == 1
        assert entry.state == pb.ENTRY_STATE_WRITTEN and entry.file_id == claim.file_id
        assert streams.served["commit"] == 2  # handled twice: sent again on the new stream
    commits = [r for r in client.operator.journal("t", claim.file_id) if r.event == "committed"]
    assert len(commits) == 1


def test_a_session_outlives_its_registry_restarting(
        registry_factory: Callable[..., RegistryHandle], staging: Path) -> None:
    """The replica stops and another starts on its port: the session is resumed there,
    its claim still commits."""
    first = registry_factory()
    with Client(first.address, retry=TEST_RETRY) as c:
        c.operator.create_task(manifest("t", 1))
        s = c.open_session("p", ttl=10)
        claim = c.claim("t", session=s)
        first.stop()
        second = registry_factory(listen=first.address)
        entry = c.commit("t", claim.file_id, claim.token, 1, DIGEST, session=s)
        assert entry.state == pb.ENTRY_STATE_WRITTEN
        assert s.stream is not None and s.stream.resumed >= 1
        assert streams_of(second).served["commit"] == 1
        s.close()


def test_a_session_without_a_stream_for_its_whole_ttl_is_lost(
        registry_factory: Callable[..., RegistryHandle], wait_for: Any) -> None:
    """No registry for longer than the TTL: the session is lost and its calls refused."""
    first = registry_factory()
    with Client(first.address, retry=TEST_RETRY) as c:
        c.operator.create_task(manifest("t", 1))
        s = c.open_session("p", ttl=2)
        first.stop()
        wait_for(s.lost.is_set, timeout=10, what="the session to be lost")
        with pytest.raises(errors.SessionExpired):
            c.claim("t", session=s)
        registry_factory(listen=first.address)
        with pytest.raises(errors.SessionExpired):
            c.claim("t", session=s)


def test_a_call_in_flight_when_its_session_is_lost_is_said_unknown_not_refused(
        registry: RegistryHandle, client: Client, wait_for: Any) -> None:
    """A checkpoint applies, its stream breaks before the reply and the registry refuses
    to resume the session: the call raises OutcomeUnknown (it may have applied; here it
    did), not SessionExpired, which would say it certainly did not."""
    client.operator.create_task(manifest("t", 1))
    streams = streams_of(registry)

    async def gone(session_id: int, caller: Any) -> pb.Session:
        raise errors.SessionExpired(f"session {session_id:x} expired", session_id=session_id)

    def cut_checkpoint(kind: str) -> bool:
        if kind != "checkpoint":
            return False
        streams.cut = None
        streams.sessions.resume = gone  # the lease ran out while the stream was down
        return True

    s = client.open_session("p", ttl=10)
    claim = client.claim("t", session=s)
    streams.cut = cut_checkpoint
    with pytest.raises(errors.OutcomeUnknown) as e:
        client.checkpoint("t", claim.file_id, claim.token, data=b"page 9", session=s)
    assert e.value.call == "checkpoint" and "may have applied" in str(e.value)
    assert s.lost.is_set()
    with pytest.raises(errors.SessionExpired):  # not sent at all: a definite refusal
        client.checkpoint("t", claim.file_id, claim.token, data=b"page 10", session=s)
    assert streams.served["checkpoint"] == 1
    client.close_session(s.session_id)  # its claim goes back, with what it checkpointed
    wait_for(lambda: "claimable" in client.operator.explain("t", claim.file_id).text, timeout=10,
             what="the retry backoff to end")
    with client.open_session("q", ttl=10) as q:
        again = client.claim("t", session=q)
    assert again.token > claim.token and again.checkpoint.data == b"page 9"


def test_a_stream_must_open_before_it_calls(registry: RegistryHandle) -> None:
    """A stream whose first message is a call ends with INVALID_ARGUMENT and opens nothing."""
    import grpc

    with grpc.insecure_channel(registry.address) as channel:
        session = channel.stream_stream(
            "/baton.v1.AgentService/Session",
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString)
        call = pb.SessionRequest(call=pb.AgentCall(call_id=1, claim=pb.ClaimRequest(
            task_id="t")))
        with pytest.raises(grpc.RpcError) as e:
            list(session(iter([call]), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "starts with open or resume" in (e.value.details() or "")
    assert streams_of(registry).served == {}


def test_the_asyncio_client_runs_a_whole_cycle(registry: RegistryHandle) -> None:
    """An asyncio agent claims, commits, consumes and acks through AsyncClient."""
    with Client(registry.address, retry=TEST_RETRY) as c:
        c.operator.create_task(manifest("t", 3))

    async def run() -> list[int]:
        states = []
        async with AsyncClient(registry.address) as ac, ac.session("aio", ttl=10) as s:
            claims = await s.claim_batch("t", 3)
            for claim in claims:
                await s.commit("t", claim.file_id, claim.token, 1, DIGEST)
            with Client(registry.address, retry=TEST_RETRY) as c:
                for claim in claims:
                    c.watcher.report("t", claim.file_id, 1, DIGEST)
            for _ in claims:
                lease = await s.consume("t")
                states.append((await s.ack("t", lease.file_id, lease.group,
                                           lease.token)).state)
        return states

    assert asyncio.run(run()) == [pb.ENTRY_STATE_CONSUMED] * 3


def test_produce_each_commits_and_claims_the_next_in_one_step(
        registry: RegistryHandle, client: Client) -> None:
    """produce_each on a stream session, one at a time (``ahead=1``): one plain claim,
    then each step commits the entry written and claims the next in one message; every
    entry is committed once with its bytes."""
    client.operator.create_task(manifest("t", 5))
    streams = streams_of(registry)
    with client.open_session("p", ttl=10) as s:
        for out in produce_each(client, s, "t", ahead=1):
            out.write(out.claim.file_id.encode())
    assert streams.served["claim"] == 1
    assert streams.served["commit_and_claim_batch"] == 5 and streams.served["commit"] == 0
    for e in client.operator.list_entries("t"):
        assert (e.state == pb.ENTRY_STATE_WRITTEN and Path(e.abs_attempt_path).read_bytes()
                == e.file_id.encode())
        assert [r.event for r in client.operator.journal("t", e.file_id)].count("committed") == 1


def test_a_quick_producer_loop_works_ahead_several_entries_per_message(
        registry: RegistryHandle, client: Client) -> None:
    """A loop whose steps are quick claims several entries per step and commits them
    together: 60 entries take fewer than a quarter as many messages as entries, each
    entry committed once with its bytes and its output's ``entry`` set, no retry spent,
    none left claimed."""
    client.operator.create_task(manifest("t", 60))
    streams = streams_of(registry)
    outs = []
    with client.open_session("p", ttl=10) as s:
        for out in produce_each(client, s, "t", ahead=8, linger=5.0):
            out.write(out.claim.file_id.encode())
            outs.append(out)
    steps = streams.served["commit_and_claim_batch"] + streams.served["claim"]
    assert len(outs) == 60 and steps < 60 / 4, steps
    assert all(o.entry is not None and o.entry.state == pb.ENTRY_STATE_WRITTEN
               for o in outs)
    entries = client.operator.list_entries("t")
    assert {e.state for e in entries} == {pb.ENTRY_STATE_WRITTEN}
    for e in entries:
        assert Path(e.abs_attempt_path).read_bytes() == e.file_id.encode()
        assert e.retry_count == 0
        assert [r.event for r in client.operator.journal("t", e.file_id)].count("committed") == 1


def test_leaving_a_loop_that_works_ahead_commits_the_written_and_releases_the_rest(
        registry: RegistryHandle, client: Client) -> None:
    """``break`` in a loop holding entries claimed ahead: what was written is committed,
    the entry in hand (not written) is failed as ``produce`` does, and the entries
    claimed ahead and not begun are pending again at once, no retry spent, journalled
    ``released``; no claim is left."""
    client.operator.create_task(manifest("t", 30, backoff={"base_seconds": 60, "cap_seconds": 60}))
    written: list[str] = []
    with client.open_session("p", ttl=10) as s:
        steps = produce_each(client, s, "t", ahead=8, linger=5.0)
        for out in steps:
            if len(written) == 5:
                in_hand = out.claim.file_id
                break
            out.write(b"x")
            written.append(out.claim.file_id)
        steps.close()  # as the loop's end would, while the session is open
        by_id = {e.file_id: e for e in client.operator.list_entries("t")}
    assert all(by_id[f].state == pb.ENTRY_STATE_WRITTEN for f in written)
    assert by_id[in_hand].state == pb.ENTRY_STATE_PENDING and by_id[in_hand].retry_count == 1
    released = [f for f, e in by_id.items()
                if "released" in [r.event for r in client.operator.journal("t", f)]]
    assert released, "nothing was claimed ahead"
    for f in released:
        assert by_id[f].state == pb.ENTRY_STATE_PENDING and by_id[f].retry_count == 0
        assert f not in written and f != in_hand
    assert not any(e.state == pb.ENTRY_STATE_WRITING for e in by_id.values())
    # released entries are claimable at once: the next loop takes every one left
    with client.open_session("q", ttl=10) as s:
        rest = []
        for out in produce_each(client, s, "t"):
            out.write(b"y")
            rest.append(out.claim.file_id)
    assert set(released) <= set(rest)


def test_release_is_refused_with_permanent_or_a_delay(
        registry: RegistryHandle, client: Client) -> None:
    """A release gives an unbegun claim back as it was: with ``permanent`` or a delay it
    is refused before anything changes."""
    client.operator.create_task(manifest("t", 1))
    with client.open_session("p", ttl=10) as s:
        claim = client.claim("t", session=s)
        for extra in ({"permanent": True}, {"delay": 5.0}):
            with pytest.raises(errors.InvalidArgument, match="release"):
                client.fail("t", claim.file_id, claim.token, session=s, release=True,
                            **extra)
        assert client.operator.get_entry("t", claim.file_id).state == pb.ENTRY_STATE_WRITING
        entry = client.fail("t", claim.file_id, claim.token, session=s, release=True,
                            reason="stopping")
    assert entry.state == pb.ENTRY_STATE_PENDING and entry.retry_count == 0
    assert entry.error == ""  # a release is no failure
    last = list(client.operator.journal("t", claim.file_id))[-1]
    assert last.event == "released" and "stopping" in last.reason


def test_a_batch_step_commits_even_when_nothing_is_left_to_claim(
        registry: RegistryHandle, client: Client) -> None:
    """The batch step's commits apply when nothing is left to claim; ``next`` is empty.
    A step with neither commits nor claims, and two commits of one entry, are refused."""
    client.operator.create_task(manifest("t", 2))
    with client.open_session("p", ttl=10) as s:
        claims = client.claim_batch("t", 2, session=s)
        entries, nxt = client.commit_and_claim_batch(
            [(c.task_id, c.file_id, c.token, 1, DIGEST) for c in claims], "t", 4, session=s)
        assert [e.state for e in entries] == [pb.ENTRY_STATE_WRITTEN] * 2 and nxt == []
        with pytest.raises(errors.InvalidArgument, match="at least one commit"):
            client.commit_and_claim_batch([], "t", 0, session=s)
        c = claims[0]
        with pytest.raises(errors.InvalidArgument, match="both commit"):
            client.commit_and_claim_batch([(c.task_id, c.file_id, c.token, 1, DIGEST)] * 2,
                                          "t", 1, session=s)


def test_consume_each_acks_and_takes_the_next_in_one_step(
        registry: RegistryHandle, client: Client) -> None:
    """consume_each on a stream session: each ack takes the next lease in the same step;
    every entry is consumed once."""
    client.operator.create_task(manifest("t", 4))
    with client.open_session("p", ttl=10) as s:
        for out in produce_each(client, s, "t"):
            out.write(b"x")
    for e in client.operator.list_entries("t"):
        client.watcher.report("t", e.file_id, 1, blake3.blake3(b"x").hexdigest())
    streams = streams_of(registry)
    with client.open_session("c", ttl=10) as s:
        seen = [d.lease.file_id for d in consume_each(client, s, "t", timeout=1)]
    assert sorted(seen) == [f"f{i:03d}" for i in range(4)]
    assert streams.served["ack_and_consume"] == 4 and streams.served["ack"] == 0
    assert {e.state for e in client.operator.list_entries("t")} == {pb.ENTRY_STATE_CONSUMED}


def test_a_fused_step_with_nothing_next_still_commits(
        registry: RegistryHandle, client: Client) -> None:
    """The last entry's commit-and-claim commits it and says there is no next."""
    client.operator.create_task(manifest("t", 1))
    with client.open_session("p", ttl=10) as s:
        claim = client.claim("t", session=s)
        entry, nxt = client.commit_and_claim("t", claim.file_id, claim.token, 1, DIGEST,
                                             session=s)
    assert entry.state == pb.ENTRY_STATE_WRITTEN and nxt is None


def test_a_fused_step_whose_reply_was_lost_hands_out_the_same_next_claim(
        registry: RegistryHandle, client: Client) -> None:
    """The stream breaks after a commit-and-claim applied: sent again, it answers with
    the same next claim, whose token then commits; nothing applied twice."""
    client.operator.create_task(manifest("t", 2))
    streams = streams_of(registry)
    cut = [False]

    def once(kind: str) -> bool:
        if kind == "commit_and_claim" and not cut[0]:
            cut[0] = True
            return True
        return False

    with client.open_session("p", ttl=10) as s:
        first = client.claim("t", session=s)
        streams.cut = once
        entry, nxt = client.commit_and_claim("t", first.file_id, first.token, 1, DIGEST,
                                             session=s)
        assert cut[0] and s.stream is not None and s.stream.resumed == 1
        assert entry.state == pb.ENTRY_STATE_WRITTEN and nxt is not None
        assert client.commit("t", nxt.file_id, nxt.token, 1, DIGEST,
                             session=s).state == pb.ENTRY_STATE_WRITTEN
    for e in client.operator.list_entries("t"):
        events = [r.event for r in client.operator.journal("t", e.file_id)]
        assert events.count("claimed") == 1 and events.count("committed") == 1


def test_a_batch_step_whose_reply_was_lost_hands_out_the_same_claims(
        registry: RegistryHandle, client: Client) -> None:
    """The stream breaks after a batch step applied: sent again on a new stream, it is
    answered from its request record with the same commits and the same next claims,
    whose tokens then commit; nothing applied twice."""
    client.operator.create_task(manifest("t", 6))
    streams = streams_of(registry)
    cut = [False]

    def once(kind: str) -> bool:
        if kind == "commit_and_claim_batch" and not cut[0]:
            cut[0] = True
            return True
        return False

    with client.open_session("p", ttl=10) as s:
        first = client.claim_batch("t", 2, session=s)
        streams.cut = once
        entries, nxt = client.commit_and_claim_batch(
            [(c.task_id, c.file_id, c.token, 1, DIGEST) for c in first], "t", 3, session=s)
        assert cut[0] and s.stream is not None and s.stream.resumed == 1
        assert [e.state for e in entries] == [pb.ENTRY_STATE_WRITTEN] * 2 and len(nxt) == 3
        entries, more = client.commit_and_claim_batch(
            [(c.task_id, c.file_id, c.token, 1, DIGEST) for c in nxt], "t", 0, session=s)
        assert [e.state for e in entries] == [pb.ENTRY_STATE_WRITTEN] * 3 and more == []
    by_id = {e.file_id: e for e in client.operator.list_entries("t")}
    assert [by_id[f].state for f in sorted(by_id)].count(pb.ENTRY_STATE_WRITTEN) == 5
    for f in [c.file_id for c in first + nxt]:
        events = [r.event for r in client.operator.journal("t", f)]
        assert events.count("claimed") == 1 and events.count("committed") == 1


def test_two_clients_of_one_process_share_the_loop_their_streams_run_on(
        registry_factory: Callable[..., RegistryHandle]) -> None:
    """Two blocking clients (two replicas) in one process, their stream sessions used
    at once from two threads: every call is answered (gRPC's asyncio layer serves one
    running loop per process, so the clients share one)."""
    import threading

    first, second = registry_factory(), registry_factory()
    with Client(first.address, retry=TEST_RETRY) as c:
        c.operator.create_task(manifest("t", 40))
    done: list[int] = []

    def loop(address: str, name: str) -> None:
        with Client(address, retry=TEST_RETRY) as c, c.open_session(name, ttl=10) as s:
            n = 0
            while (claim := _claim_or_none(c, s)) is not None:
                c.commit("t", claim.file_id, claim.token, 1, DIGEST, session=s)
                n += 1
            done.append(n)

    threads = [threading.Thread(target=loop, args=(r.address, f"a{i}"))
               for i, r in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(done) == 40 and len(done) == 2


def _claim_or_none(c: Client, s: Any) -> Any:
    try:
        return c.claim("t", session=s)
    except errors.NothingToClaim:
        return None


def test_a_call_unanswered_within_the_timeout_raises_deadline_exceeded_and_the_session_goes_on(
        registry: RegistryHandle, client: Client) -> None:
    """A registry that stops answering (its event loop held up) ends a stream call with
    DeadlineExceeded after the client's timeout, naming the call; the session still
    serves the next call once the registry answers again."""
    client.operator.create_task(manifest("t", 2))

    async def run() -> tuple[float, str, Any]:
        async with AsyncClient(registry.address, timeout=0.5) as ac, \
                ac.session("slow", ttl=30) as s:
            over = threading.Event()
            registry._loop.call_soon_threadsafe(time.sleep, 2.0)  # the replica stalls
            registry._loop.call_soon_threadsafe(over.set)  # ... and then runs again
            start = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded) as info:
                await s.claim("t")
            took = time.monotonic() - start
            assert not s._pending  # the call is forgotten, not left waiting
            assert await asyncio.to_thread(over.wait, 30)  # the late reply finds no caller
            return took, str(info.value), await s.claim("t")

    took, message, claim = asyncio.run(run())
    assert 0.45 <= took < 1.9
    assert "claim: no reply from the registry within 0.5 s (deadline exceeded)" in message
    assert claim.file_id in {"f000", "f001"}
