"""The client library: retries, waiting for work through Watch, end-to-end digest checks."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import start_registry

from baton_relay.client import Client, RetryPolicy, consume, next_lease, produce
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import free_port

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores


def one_entry(client: Client, task: str = "t1") -> None:
    client.operator.create_task({"task_id": task, "entries": [{"file_id": "a", "path": "a.bin"}]})


def test_unavailable_is_retried_with_jittered_backoff() -> None:
    """A call to a registry that is down is retried with growing, capped, jittered waits."""
    slept: list[float] = []
    policy = RetryPolicy(attempts=5, initial=0.1, cap=0.4, deadline=60, sleep=slept.append)
    with Client(f"127.0.0.1:{free_port()}", timeout=1, retry=policy) as c, \
            pytest.raises(errors.Unavailable):
        c.operator.list_tasks()
    assert len(slept) == 4  # five attempts, four waits between them
    assert all(0 <= s <= 0.4 for s in slept)
    assert len(set(slept)) > 1  # jitter: not a fixed schedule


def test_retries_stop_at_the_deadline_of_the_policys_clock() -> None:
    """Retries end once the policy's clock passes its deadline; other errors are not retried."""
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    policy = RetryPolicy(attempts=100, initial=1.0, cap=4.0, deadline=10.0, sleep=sleep,
                         clock=lambda: now[0], jitter=lambda low, high: high)
    calls: list[float] = []

    def down() -> None:
        calls.append(now[0])
        raise errors.DeadlineExceeded("no reply")

    with pytest.raises(errors.DeadlineExceeded):
        policy.call(down)
    assert slept == [1.0, 2.0, 4.0, 4.0]  # doubling up to the cap, until 10 s have passed
    assert calls == [0.0, 1.0, 3.0, 7.0, 11.0]

    def refused() -> None:
        calls.append(now[0])
        raise errors.StaleToken("stale")

    calls.clear()
    with pytest.raises(errors.StaleToken):
        policy.call(refused)
    assert len(calls) == 1


def test_call_succeeds_once_the_registry_comes_up(etcd: Any, prefix: str, staging: Path) -> None:
    """A client started before its registry gets through when the registry appears."""
    port = free_port()
    handles: list[Any] = []
    refused = threading.Event()  # the client found no registry and waits to retry

    def sleep(seconds: float) -> None:
        refused.set()
        time.sleep(seconds)

    def late() -> None:
        # the registry is late on purpose (that is the scenario): up once the client
        # has been refused
        if refused.wait(30):
            handles.append(start_registry(etcd.endpoint, prefix, staging,
                                          listen=f"127.0.0.1:{port}"))

    starter = threading.Thread(target=late)
    starter.start()
    try:
        policy = RetryPolicy(attempts=100, initial=0.05, cap=0.2, deadline=30, sleep=sleep)
        with Client(f"127.0.0.1:{port}", timeout=2, retry=policy) as c:
            assert c.operator.list_tasks() == []
        assert refused.is_set()
    finally:
        refused.set()  # the starter ends even if the client never retried
        starter.join()
        for h in handles:
            h.stop()


def test_consumer_waits_for_work_without_polling(client: Client) -> None:
    """A consumer blocked in next_lease wakes when a producer's entry becomes verified."""
    one_entry(client)
    got: list[Any] = []
    with client.open_session("consumer", ttl=10) as cs:
        waiter = threading.Thread(
            target=lambda: got.append(next_lease(client, cs, "t1", "default", timeout=20)))
        waiter.start()
        with client.open_session("producer", ttl=10) as ps:
            with produce(client, ps, "t1") as out:
                out.write(b"data")
            client.watcher.report("t1", "a", out.size, out.digest)  # what the watcher does
        waiter.join(25)
        assert got and got[0].file_id == "a" and got[0].digest == out.digest


def test_consumer_times_out_when_nothing_comes(client: Client) -> None:
    """next_lease gives up with NothingToClaim when its timeout passes."""
    one_entry(client)
    with client.open_session("c", ttl=10) as s, pytest.raises(errors.NothingToClaim):
        next_lease(client, s, "t1", timeout=0.5)


def test_a_consume_whose_reply_is_lost_is_not_reported_as_nothing(client: Client,
                                                                   monkeypatch: Any) -> None:
    """The registry applies a consume and its reply never comes back (the replica died):
    next_lease raises Unavailable at once, not NothingToClaim once its time is up, so the
    caller knows a lease may be held (a fault run once found one held all run long)."""
    one_entry(client)
    with client.open_session("producer", ttl=10) as ps:
        with produce(client, ps, "t1") as out:
            out.write(b"data")
        client.watcher.report("t1", "a", out.size, out.digest)
    applied: list[int] = []
    real = client.consume

    def reply_lost(*args: Any, **kwargs: Any) -> Any:
        applied.append(real(*args, **kwargs).token)
        raise errors.Unavailable("the registry went away before it replied")

    monkeypatch.setattr(client, "consume", reply_lost)
    with client.open_session("c", ttl=10) as s:
        with pytest.raises(errors.Unavailable):
            next_lease(client, s, "t1", timeout=5)
        assert len(applied) == 1  # not retried: a second lease would be another entry
        (held,) = [a for a in client.operator.list_agents() if a.session_id == s.session_id]
        assert [(c.file_id, c.token) for c in held.claims] == [("a", applied[0])]


def test_consume_refuses_bytes_that_differ_from_the_verified_digest(client: Client) -> None:
    """consume() checks the file against the verified digest, and nacks on a mismatch."""
    one_entry(client)
    with client.open_session("a", ttl=10) as s:
        with produce(client, s, "t1") as out:
            out.write(b"original")
        client.watcher.report("t1", "a", out.size, out.digest)
        Path(out.claim.path).write_bytes(b"tampered")  # same size, other bytes
        with pytest.raises(errors.ChecksumMismatch), consume(client, s, "t1", timeout=5):
            pytest.fail("the body must not run with unverified bytes")
        entry = client.operator.get_entry("t1", "a")
        assert (entry.state == pb.ENTRY_STATE_VERIFIED
                and not entry.consumed_by)  # handed back, not acked


def test_consume_acks_on_success(client: Client) -> None:
    """consume() yields the checked bytes and acks when the block ends."""
    one_entry(client)
    with client.open_session("a", ttl=10) as s:
        with produce(client, s, "t1") as out:
            out.write(b"payload")
        client.watcher.report("t1", "a", 7, blake3.blake3(b"payload").hexdigest())
        with consume(client, s, "t1", timeout=5) as delivery:
            assert delivery.data == b"payload"
        assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_CONSUMED



def test_a_closed_client_refuses_calls_and_its_sessions_stop(
    registry: Any, wait_for: Any
) -> None:
    """Calls on a closed client raise ClientClosed (nothing is sent; gRPC would crash the
    process making a call on a closed channel), the calls of a session that outlives
    its client too, and its stream is gone from the registry."""
    c = Client(registry.address, retry=RetryPolicy(attempts=1))
    session = c.open_session("left-open", ttl=2)
    c.close()
    for call in (c.operator.list_tasks, lambda: c.keepalive(session.session_id),
                 lambda: next(c.operator.watch_tasks(timeout=1))):
        with pytest.raises(errors.ClientClosed):
            call()
    with pytest.raises(errors.ClientClosed):
        c.claim("t1", session=session)
    with pytest.raises(errors.ClientClosed):
        session.refresh()
    streams = registry._running.streams
    wait_for(lambda: streams.open == 0, timeout=10, what="the session's stream ended")
