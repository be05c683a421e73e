"""ConsumeBatch (`baton consume --batch N`): many verified entries leased to one session
for a group in one guarded transaction, all or nothing, on a real etcd and registry."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_ack_batch import keys_under, verified_task
from test_cli import invoke, ok_json

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.verbs.consumers import MAX_CONSUMES

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores


def test_a_batch_of_leases_applies_together(client: Client) -> None:
    """Five verified entries, a batch of up to ten: all five leased at one token, each a
    live consume-claim of the session with its journal record; then acked together."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 5, ["g"])
        held = client.consume_batch("t", "g", 10, session=s)
        assert sorted(x.file_id for x in held) == [f"e{i:02d}" for i in range(5)]
        assert len({x.token for x in held}) == 1 and held[0].token > 0
        assert {(x.group, x.size, x.session_id) for x in held} == {("g", 1, s.session_id)}
        # each lease names its entry's committed attempt's file
        assert all(x.path.endswith(f"/{x.entry.attempt_path}")
                   and x.entry.attempt_path.startswith(f"{x.file_id}~t") for x in held)
        claims = client.operator.list_agents()[0].claims
        assert sorted(c.file_id for c in claims) == sorted(x.file_id for x in held)
        for x in held:
            events = [r.event for r in client.operator.journal("t", x.file_id)]
            assert events.count("consuming") == 1
        acked = client.ack_batch([("t", x.file_id, "g", x.token) for x in held])
        assert {e.state for e in acked} == {pb.ENTRY_STATE_CONSUMED}
        with pytest.raises(errors.NothingToClaim):
            client.consume_batch("t", "g", 10, session=s)


def test_a_batch_is_bounded_by_what_fits_in_one_transaction(client: Client) -> None:
    """Asking for more than fits etcd's operation limit leases MAX_CONSUMES."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, MAX_CONSUMES + 3, ["g"])
        held = client.consume_batch("t", "g", 1000, session=s)
        assert len(held) == MAX_CONSUMES == len({x.file_id for x in held})
        rest = client.consume_batch("t", "g", 1000, session=s)
        assert len(rest) == 3
        assert not {x.file_id for x in held} & {x.file_id for x in rest}


def test_a_batch_takes_no_more_than_the_sessions_free_slots(client: Client) -> None:
    """A session of three slots gets three of five; with none free, SlotsExhausted."""
    with client.open_session("a", ttl=30, slots=3) as s:
        verified_task(client, s, 5, ["g"])
        held = client.consume_batch("t", "g", 5, session=s)
        assert len(held) == 3
        before = entry_states(client)
        with pytest.raises(errors.SlotsExhausted):
            client.consume_batch("t", "g", 5, session=s)
        assert entry_states(client) == before


def entry_states(client: Client) -> list[tuple[str, str, int]]:
    """What a refused call must leave alone: every entry's state and revision."""
    return sorted((e.file_id, pb.EntryState.Name(e.state), e.revision)
                  for e in client.operator.list_entries("t"))


def test_each_group_leases_its_own_copy(client: Client) -> None:
    """Group g's batch leaves group h every entry; g's second batch finds nothing."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 3, ["g", "h"])
        g = client.consume_batch("t", "g", 10, session=s)
        h = client.consume_batch("t", "h", 10, session=s)
        assert sorted(x.file_id for x in g) == sorted(x.file_id for x in h) == [
            "e00", "e01", "e02"]
        client.ack_batch([("t", x.file_id, x.group, x.token) for x in g + h])
        assert {e.state for e in client.operator.list_entries("t")} == {pb.ENTRY_STATE_CONSUMED}
        with pytest.raises(errors.NothingToClaim):
            client.consume_batch("t", "g", 10, session=s)


def test_a_refused_batch_changes_nothing(registry: Any, client: Client) -> None:
    """Bad max, a group that is not the task's, a paused task: precise errors, no key
    touched."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 2, ["g"])
        before = keys_under(registry)
        with pytest.raises(errors.InvalidArgument, match="max must be at least 1"):
            client.consume_batch("t", "g", 0, session=s)
        with pytest.raises(errors.NothingToClaim, match="group 'nope'"):
            client.consume_batch("t", "nope", 5, session=s)
        assert keys_under(registry) == before
        client.operator.pause_task("t")
        paused = keys_under(registry)
        with pytest.raises(errors.TaskNotActive):
            client.consume_batch("t", "g", 5, session=s)
        assert keys_under(registry) == paused


def test_a_retried_batch_is_answered_once(client: Client) -> None:
    """The same request id twice: the first reply again, no second set of leases."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 4, ["g"])
        req = pb.ConsumeBatchRequest(task_id="t", group="g", session_id=s.session_id, max=2,
                                     request_id="leases-1")
        first = client._call("ConsumeBatch", req)
        again = client._call("ConsumeBatch", req)
        assert [x.entry.file_id for x in again.leases] == [
            x.entry.file_id for x in first.leases]
        assert {x.token for x in again.leases} == {x.token for x in first.leases}
        assert len(client.operator.list_agents()[0].claims) == 2


def test_leases_of_a_batch_are_counted_per_entry(registry_factory: Any) -> None:
    """`baton_consumes_total{outcome="ok"}` counts the entries a batch leased."""
    from test_metrics import metrics_port, scrape

    registry = registry_factory(metrics="127.0.0.1:0")
    with Client(registry.address, timeout=10) as client, \
            client.open_session("a", ttl=30) as s:
        verified_task(client, s, 3, ["g"])
        client.consume_batch("t", "g", 10, session=s)
        with pytest.raises(errors.NothingToClaim):
            client.consume_batch("t", "g", 10, session=s)
    found = scrape(metrics_port(registry))
    assert found.value("baton_consumes_total", outcome="ok") == 3
    assert found.value("baton_consumes_total", outcome="NothingToClaim") == 1


# --- the command line -----------------------------------------------------------------


def test_cli_consume_batch_feeds_ack_batch(registry: Any, client: Client, tmp_path: Any
                                           ) -> None:
    """`consume --batch 3 -o json` is a list of leases that `ack-batch` acks."""
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 3, ["g"])
    held = ok_json(invoke(registry, "consume", "t", "--group", "g", "--batch", "3",
                          "-o", "json"))
    assert sorted(x["file_id"] for x in held) == ["e00", "e01", "e02"]
    assert len({x["token"] for x in held}) == 1
    path = tmp_path / "leases.json"
    path.write_text(json.dumps(held))
    done = invoke(registry, "ack-batch", str(path))
    assert done.exit_code == 0, done.output
    assert {e.state for e in client.operator.list_entries("t")} == {pb.ENTRY_STATE_CONSUMED}


def test_cli_consume_batch_prints_a_table(registry: Any, client: Client) -> None:
    with client.open_session("a", ttl=30) as s:
        verified_task(client, s, 2, ["g"])
    out = invoke(registry, "consume", "t", "--group", "g", "--batch", "5")
    assert out.exit_code == 0, out.output
    assert "e00" in out.stdout and "e01" in out.stdout and "session" in out.stdout


@pytest.mark.parametrize("extra", [["e00"], ["--wait", "1"]])
def test_cli_consume_batch_refuses_a_file_id_or_wait(registry: Any, extra: list[str]
                                                     ) -> None:
    result = invoke(registry, "consume", "t", "--batch", "2", *extra)
    assert result.exit_code == 2
    assert result.stderr.startswith("baton: consume: --batch takes the next verified entries")
