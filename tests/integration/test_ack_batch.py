"""AckBatch (`baton ack-batch`): many consume-claims acked in one guarded transaction, all
or nothing, on a real etcd and registry."""

from __future__ import annotations

import json
from typing import Any

import blake3
import pytest
from registry_fixtures import on_etcd
from test_cli import invoke, ok_json, one_error_line

from baton_relay.client import Client, Lease, Session
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import KV, Etcd
from baton_relay.registry.verbs.consumers import MAX_ACKS

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def keys_under(registry: Any) -> dict[bytes, KV]:
    """Every key of the test's prefix (to show a refused batch changed nothing)."""
    async def work(etcd: Etcd) -> dict[bytes, KV]:
        return {kv.key: kv async for kv in etcd.scan(registry.prefix.encode(), page=500)}

    return on_etcd(registry.etcd, work)


def verified_task(client: Client, s: Session, n: int, consumers: list[str]) -> None:
    """Task t with ``n`` entries e00.. produced and verified (no file: the reports say so)."""
    client.operator.create_task({"task_id": "t", "consumers": consumers,
                                 "entries": [{"file_id": f"e{i:02d}", "path": f"e{i:02d}"}
                                    for i in range(n)]})
    for i in range(n):
        c = client.claim("t", f"e{i:02d}", session=s)
        client.commit("t", c.file_id, c.token, 1, digest(b"x"))
        client.watcher.report("t", c.file_id, 1, digest(b"x"))


def leases(client: Client, s: Session, group: str, n: int) -> list[Lease]:
    return [client.consume("t", group, session=s) for _ in range(n)]


def test_a_batch_of_acks_applies_together(client: Client) -> None:
    """Five acks in one call: one revision for all, each entry consumed, slots freed."""
    with client.open_session("a", ttl=30, slots=5) as s:
        verified_task(client, s, 5, ["g"])
        held = leases(client, s, "g", 5)
        acked = client.ack_batch([("t", x.file_id, "g", x.token) for x in held])
        assert [e.file_id for e in acked] == [x.file_id for x in held]
        assert {e.state for e in acked} == {pb.ENTRY_STATE_CONSUMED}
        assert len({e.revision for e in acked}) == 1
        assert {e.state for e in client.operator.list_entries("t")} == {pb.ENTRY_STATE_CONSUMED}
        # Every slot is free again: five more claims of the session's would fit.
        assert len(client.operator.list_agents()[0].claims) == 0


def test_two_groups_acking_one_entry_in_one_batch_both_count(client: Client) -> None:
    """Both groups' acks of one entry in one batch: the entry is consumed by both."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 1, ["g", "h"])
        g, h = client.consume("t", "g", session=s), client.consume("t", "h", session=s)
        acked = client.ack_batch([("t", "e00", "g", g.token), ("t", "e00", "h", h.token)])
        entry = client.operator.get_entry("t", "e00")
        assert entry.state == pb.ENTRY_STATE_CONSUMED and sorted(entry.consumed_by) == ["g", "h"]
        assert [e.state for e in acked] == [pb.ENTRY_STATE_CONSUMED, pb.ENTRY_STATE_CONSUMED]
        acks = [r for r in client.operator.journal("t", "e00") if r.event == "acked"]
        assert sorted(r.group for r in acks) == ["g", "h"]


def test_one_stale_token_refuses_the_whole_batch(client: Client, registry: Any) -> None:
    """A stale token anywhere in the batch: nothing is acked, and the error names it."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 3, ["g"])
        held = leases(client, s, "g", 3)
        batch = [("t", x.file_id, "g", x.token) for x in held]
        stale = ("t", held[1].file_id, "g", held[1].token + 1000)
        before = keys_under(registry)
        with pytest.raises(errors.StaleToken) as refused:
            client.ack_batch([batch[0], stale, batch[2]])
        assert f"token {stale[3]}" in str(refused.value)
        assert f"t/{held[1].file_id}" in str(refused.value)
        assert keys_under(registry) == before
        # The batch as it should have been still applies.
        assert {e.state for e in client.ack_batch(batch)} == {pb.ENTRY_STATE_CONSUMED}


def test_too_many_acks_are_invalid_and_change_nothing(client: Client, registry: Any) -> None:
    """One ack more than fits a transaction is InvalidArgument naming the limit."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, MAX_ACKS + 1, ["g"])
        held = leases(client, s, "g", MAX_ACKS + 1)
        before = keys_under(registry)
        with pytest.raises(errors.InvalidArgument,
                           match=f"{MAX_ACKS + 1} acks in one batch; at most {MAX_ACKS}"):
            client.ack_batch([("t", x.file_id, "g", x.token) for x in held])
        assert keys_under(registry) == before
        acked = client.ack_batch([("t", x.file_id, "g", x.token) for x in held[:MAX_ACKS]])
        assert len(acked) == MAX_ACKS == 21


def test_an_ack_twice_in_one_batch_is_invalid(client: Client) -> None:
    """The same (entry, group) twice in one batch is refused before anything is read."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 1, ["g"])
        lease = client.consume("t", "g", session=s)
        with pytest.raises(errors.InvalidArgument, match=r"acks \[0\] and \[1\] both ack t/e00"):
            client.ack_batch([("t", "e00", "g", lease.token)] * 2)
        with pytest.raises(errors.InvalidArgument, match="at least one ack"):
            client.ack_batch([])


def test_a_retried_batch_replays_its_reply(client: Client) -> None:
    """The same request id again: the first reply, applied once (one journal record each)."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 2, ["g"])
        held = leases(client, s, "g", 2)
        req = pb.AckBatchRequest(request_id="acks-1", acks=[
            pb.AckRequest(task_id="t", file_id=x.file_id, group="g", token=x.token)
            for x in held])
        first = client._call("AckBatch", req)
        again = client._call("AckBatch", req)
        assert again == first and len(first.entries) == 2
        for x in held:
            assert [r.event for r in client.operator.journal("t", x.file_id)].count("acked") == 1


def test_acks_of_a_cancelled_task_are_refused(client: Client) -> None:
    """Once the task is cancelled its consume tokens are void, in a batch as alone."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 2, ["g"])
        held = leases(client, s, "g", 2)
        client.operator.cancel_task("t")
        with pytest.raises(errors.StaleToken):
            client.ack_batch([("t", x.file_id, "g", x.token) for x in held])
        assert {e.state for e in client.operator.list_entries("t")} == {pb.ENTRY_STATE_VERIFIED}


# --- the command line -----------------------------------------------------------------


def test_cli_ack_batch_takes_consume_output(registry: Any, client: Client, tmp_path: Any
                                            ) -> None:
    """`ack-batch` reads `consume -o json` objects (extra keys ignored) and acks them."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 2, ["g"])
    held = [ok_json(invoke(registry, "consume", "t", "--group", "g", "-o", "json"))
            for _ in range(2)]
    path = tmp_path / "acks.json"
    path.write_text(json.dumps(held))
    done = invoke(registry, "ack-batch", str(path))
    assert done.exit_code == 0, done.output
    assert sorted(done.stdout.splitlines()) == [
        "t/e00: consumed, 1 bytes, acked by g", "t/e01: consumed, 1 bytes, acked by g"]
    again = invoke(registry, "ack-batch", "-", stdin=json.dumps(held))
    assert again.exit_code == 4 and "token" in one_error_line(again.stderr)


@pytest.mark.parametrize(("content", "message"), [
    ("nope", "<stdin>: not valid JSON"),
    ("[]", "<stdin>: expected a non-empty JSON list of acks"),
    ('[{"task": "t", "file_id": "a", "token": 1, "owner": "x"}]',
     "<stdin>: ack [0]: unknown field(s) owner"),
    ('[{"task": "t", "file_id": "a", "token": "1"}]', "<stdin>: ack [0]: token must be an "
                                                      "integer"),
    ('[{"task": "t", "file_id": "a", "token": 1, "group": 2}]',
     "<stdin>: ack [0]: group must be a string"),
])
def test_cli_ack_batch_refuses_a_malformed_file(registry: Any, content: str,
                                                message: str) -> None:
    """A file that is not a list of acks is exit 2 with where it is wrong."""
    result = invoke(registry, "ack-batch", "-", stdin=content)
    assert result.exit_code == 2 and one_error_line(result.stderr).startswith(
        f"baton: {message}")



def test_acks_of_a_batch_are_counted_per_entry(registry_factory: Any) -> None:
    """`baton_acks_total{outcome="ok"}` counts the entries a batch acked; a refused batch
    counts once under its error."""
    from test_metrics import metrics_port, scrape

    registry = registry_factory(metrics="127.0.0.1:0")
    with Client(registry.address, timeout=10) as client, \
            client.open_session("a", ttl=30) as s:
        verified_task(client, s, 3, ["g"])
        held = leases(client, s, "g", 3)
        with pytest.raises(errors.StaleToken):
            client.ack_batch([("t", held[0].file_id, "g", held[0].token + 1000)])
        client.ack_batch([("t", x.file_id, "g", x.token) for x in held])
    found = scrape(metrics_port(registry))
    assert found.value("baton_acks_total", outcome="ok") == 3
    assert found.value("baton_acks_total", outcome="StaleToken") == 1
