"""Routing rules: attributes committed with an entry decide, when it is verified, which
of its consumer groups receive it; numbers compare exactly."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import blake3
import pytest

from baton_relay.client import Client, parse_manifest, produce, put
from baton_relay.kernel import errors
from baton_relay.kernel.contract import MAX_ATTRIBUTES_BYTES
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.manifest import validate
from baton_relay.registry.records.routing import MAX_RULES, condition, parse_attributes

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

#: the seed's report pipeline: a report that fails compliance goes to people instead
REPORTS = {
    "task_id": "reports",
    "consumers": ["pdf-composer", "human-review"],
    "routing_rules": [
        {"condition": "$[?(@.compliance == 'fail')]", "groups": ["human-review"]},
        {"condition": "$[?(@.compliance == 'pass')]", "groups": ["pdf-composer"]},
    ],
    "entries": [{"file_id": f"r{i}", "path": f"r{i}.json"} for i in range(3)],
    "backoff": {"base_seconds": 0.001},
}


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def verify(client: Client, task: str, file_id: str, data: bytes,
           attributes: Any = None) -> pb.Entry:
    """Produce ``file_id`` with ``attributes`` and report it as a watcher would."""
    with client.open_session("producer", ttl=10) as s, produce(
            client, s, task, file_id, attributes=attributes) as out:
        out.write(data)
    return client.watcher.report(task, file_id, len(data), digest(data))


# conditions ------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("rule", "attributes", "holds"),
    [
        # the seed's incident: a score just over the line is over it
        ("$[?(@.score > 95)]", '{"score": 95.0000000000000000001}', True),
        ("$[?(@.score > 95)]", '{"score": 95.0}', False),
        ("$[?(@.score >= 95)]", '{"score": 95}', True),
        ("$[?(@.score > 95.00000000000000000001)]", '{"score": 95.00000000000000000002}', True),
        ("$[?(@.score == 0.1)]", '{"score": 0.10}', True),
        ("$[?(@.score > 0.3)]", '{"score": 0.30000000000000004}', True),
        # integers past a double's 53 bits stay distinct
        ("$[?(@.n > 9007199254740992)]", '{"n": 9007199254740993}', True),
        ("$[?(@.n == 9007199254740992)]", '{"n": 9007199254740993}', False),
        # a string is never a number, true is never 1
        ("$[?(@.score > 95)]", '{"score": "96"}', False),
        ("$[?(@.score == '96')]", '{"score": 96}', False),
        ("$[?(@.ok == true)]", '{"ok": 1}', False),
        # a missing member equals nothing, differs from everything
        ("$[?(@.compliance == null)]", "{}", False),
        ("$[?(@.compliance == null)]", '{"compliance": null}', True),
        ("$[?(@.compliance != 'fail')]", "{}", True),
        ("$[?(@.compliance < 'x')]", "{}", False),
        # existence, negation, nesting, boolean operators, two queries
        ("$[?(@.a.b[0] >= -3)]", '{"a": {"b": [-3]}}', True),
        ("$[?(@.a && !@.b)]", '{"a": 0}', True),
        ("$[?((@.a > 1 || @.b) && @.c)]", '{"a": 2, "c": 1}', True),
        ("$[?((@.a > 1 || @.b) && @.c)]", '{"a": 2}', False),
        ("$[?(@.a > @.b)]", '{"a": 2, "b": 1.99999999999999999999}', True),
        ("$[?(@.a == @.b)]", '{"a": [1, {"x": 2.0}], "b": [1.0, {"x": 2}]}', True),
        ("$[?(@.a <= 'b')]", '{"a": "a"}', True),
    ],
)
def test_conditions_hold_exactly(rule: str, attributes: str, holds: bool) -> None:
    """Numbers compare as exact decimals from their JSON text; types never coerce."""
    assert condition(rule).holds(parse_attributes(attributes)) is holds


@pytest.mark.parametrize(
    ("rule", "why"),
    [
        ("$[?(@.score > )]", "Parse error at 1:14"),
        ("$[?(@.score > 1e3)]", "Parse error at 1:15"),
        ("$[?(@.s =~ 'x.*')]", "regular expressions"),
        ("$[?(@.a + 1 > 2)]", "arithmetic"),
        ("$.score", "expected a filter"),
        ("$[?(@.a > 1)].b", "expected a filter"),
        ("$[?(@.a > $.b)]", "the attributes are @"),
        ("$[?(@..a > 1)]", "not supported"),
        ("$[?(@.a[*] > 1)]", "not supported"),
        ("$[?(@.a[?(@.x > 3)])]", "not supported"),
        ("$[?(@.a > 1)]" + " " * 1024, "longer than"),
    ],
)
def test_bad_conditions_are_refused_with_their_position(rule: str, why: str) -> None:
    """A condition that does not parse, or that routing cannot evaluate, is refused at
    creation, naming the rule's index and (for a parse error) the line and column."""
    manifest = {**REPORTS, "routing_rules": [
        REPORTS["routing_rules"][0], {"condition": rule, "groups": ["pdf-composer"]}]}
    with pytest.raises(errors.InvalidManifest, match=r"routing_rules\[1\]") as info:
        validate(parse_manifest(manifest))
    assert why in str(info.value) and len(info.value.problems) == 1


@pytest.mark.parametrize(
    ("rules", "entry", "why"),
    [
        ([{"condition": "$[?(@.a)]", "groups": ["printer"]}], {}, "'printer' is not a consumer"),
        ([{"condition": "$[?(@.a)]", "groups": []}], {}, "names no consumer group"),
        ([{"condition": "$[?(@.a)]", "groups": ["human-review", "human-review"]}], {},
         "repeated"),
        ([{"condition": "$[?(@.a)]", "groups": ["human-review"]}],
         {"consumers": ["pdf-composer"]}, "entry 'r0' and 2 more has consumers"),
        ([{"condition": "$[?(@.a)]", "groups": ["human-review"]}] * (MAX_RULES + 1), {},
         f"at most {MAX_RULES}"),
    ],
)
def test_rules_name_consumer_groups_of_what_they_route(
        rules: list[dict[str, Any]], entry: dict[str, Any], why: str) -> None:
    """A rule sends entries to some of their own consumer groups, and there are few."""
    manifest = {**REPORTS, "routing_rules": rules,
                "entries": [{**e, **entry} for e in REPORTS["entries"]]}
    with pytest.raises(errors.InvalidManifest, match="routing_rules") as info:
        validate(parse_manifest(manifest))
    assert why in str(info.value)


def test_parts_are_not_routed_and_only_tasks_with_rules_route() -> None:
    """Entries are marked for routing only where rules exist, parts never (they are
    consumed as their assembly, which is)."""
    valid = validate(parse_manifest({**REPORTS, "entries": [
        {"file_id": "p", "path": "p"}, {"file_id": "whole", "path": "whole", "parts": ["p"]}]}))
    assert {e.file_id: e.routing for e in valid.entries} == {"p": False, "whole": True}
    plain = validate(parse_manifest({**REPORTS, "routing_rules": []}))
    assert not any(e.routing for e in plain.entries)


# the registry ------------------------------------------------------------------------

def test_reports_go_where_their_compliance_sends_them(client: Client) -> None:
    """The seed's example: a failing report goes to human-review, never to the
    pdf-composer, a passing one the other way; the task completes once the groups
    each was routed to acked it."""
    task, _ = client.operator.create_task(REPORTS)
    assert [(r.condition, list(r.groups)) for r in task.spec.routing_rules] == [
        ("$[?(@.compliance == 'fail')]", ["human-review"]),
        ("$[?(@.compliance == 'pass')]", ["pdf-composer"])]
    failed = verify(client, "reports", "r0", b"bad", {"compliance": "fail"})
    passed = verify(client, "reports", "r1", b"good", {"compliance": "pass", "score": 97.5})
    assert (failed.routing_rule, list(failed.routed_to)) == (0, ["human-review"])
    assert (passed.routing_rule, list(passed.routed_to)) == (1, ["pdf-composer"])
    assert json.loads(client.operator.get_entry("reports", "r1").attributes) == {
        "compliance": "pass", "score": 97.5}
    with client.open_session("consumer", ttl=10) as s:
        review = client.consume("reports", "human-review", session=s)
        assert review.file_id == "r0"
        with pytest.raises(errors.NothingToClaim):
            client.consume("reports", "human-review", session=s)
        with pytest.raises(errors.IllegalTransition, match="routed to"):
            client.consume("reports", "human-review", "r1", session=s)
        pdf = client.consume("reports", "pdf-composer", session=s)
        assert pdf.file_id == "r1"
        with pytest.raises(errors.NothingToClaim):
            client.consume("reports", "pdf-composer", session=s)
        assert client.ack("reports", "r0", "human-review",
                          review.token).state == pb.ENTRY_STATE_CONSUMED
        assert client.ack("reports", "r1", "pdf-composer",
                          pdf.token).state == pb.ENTRY_STATE_CONSUMED
        # r2 is the last open entry: the task is not done before it is
        assert client.operator.get_task("reports").status == pb.TASK_STATUS_ACTIVE
        verify(client, "reports", "r2", b"?", {"compliance": "fail"})
        last = client.consume("reports", "human-review", session=s)
        client.ack("reports", "r2", "human-review", last.token)
    task = client.operator.get_task("reports")
    assert task.open == 0 and dict(task.consumed_by_group) == {
        "human-review": 2, "pdf-composer": 1}
    (verified,) = [r for r in client.operator.journal("reports", "r0") if r.event == "verified"]
    assert (verified.routing_rule, list(verified.routed_to)) == (0, ["human-review"])
    assert "routing rule 0 held: to human-review" in verified.reason
    text = client.operator.explain("reports", "r0").text
    assert "Routing rule 0 ($[?(@.compliance == 'fail')]) held" in text
    assert "human-review only, not to pdf-composer." in text
    assert '"compliance":"fail"' in text


def test_task_completes_when_routed_groups_acked(client: Client,
                                                 wait_for: Callable[..., None]) -> None:
    """Completion counts only the groups an entry was routed to."""
    client.operator.create_task({**REPORTS, "entries": REPORTS["entries"][:1]})
    verify(client, "reports", "r0", b"bad", {"compliance": "fail"})
    with client.open_session("consumer", ttl=10) as s:
        lease = client.consume("reports", "human-review", session=s)
        client.ack("reports", "r0", "human-review", lease.token)
    wait_for(lambda: client.operator.get_task("reports").status == pb.TASK_STATUS_COMPLETED,
             what="the task to complete")


def test_no_rule_holds_every_group_receives_it(client: Client) -> None:
    """Without attributes (or when no rule holds) every consumer group gets the entry."""
    client.operator.create_task(REPORTS)
    entry = verify(client, "reports", "r0", b"x")
    assert not entry.HasField("routing_rule") and not entry.attributes
    with client.open_session("consumer", ttl=10) as s:
        a = client.consume("reports", "pdf-composer", session=s)
        b = client.consume("reports", "human-review", session=s)
        assert client.ack("reports", "r0", "pdf-composer", a.token).state == pb.ENTRY_STATE_VERIFIED
        assert client.ack("reports", "r0", "human-review", b.token).state == pb.ENTRY_STATE_CONSUMED
    (verified,) = [r for r in client.operator.journal("reports", "r0") if r.event == "verified"]
    assert not verified.HasField("routing_rule")
    assert sorted(verified.routed_to) == ["human-review", "pdf-composer"]
    assert "None of the task's 2 routing rules held" in client.operator.explain("reports",
                                                                                "r0").text


def test_routing_is_decided_again_after_the_bytes_change(client: Client) -> None:
    """An entry that leaves verified forgets where it went; its next verification
    routes it by the attributes of its next commit."""
    client.operator.create_task(REPORTS)
    first = verify(client, "reports", "r0", b"one", {"compliance": "pass"})
    assert list(first.routed_to) == ["pdf-composer"]
    changed = client.watcher.report("reports", "r0", 5, digest(b"other"))
    assert changed.state == pb.ENTRY_STATE_PENDING and not changed.HasField("routing_rule")
    assert not changed.attributes
    again = verify(client, "reports", "r0", b"two", {"compliance": "fail"})
    assert (again.routing_rule, list(again.routed_to)) == (0, ["human-review"])
    with client.open_session("consumer", ttl=10) as s:
        with pytest.raises(errors.NothingToClaim):
            client.consume("reports", "pdf-composer", session=s)
        assert client.consume("reports", "human-review", session=s).file_id == "r0"


def test_assembly_is_routed_when_its_parts_are_verified(client: Client,
                                                        wait_for: Callable[..., None]) -> None:
    """An assembly has no commit of its own: the rules see no attributes."""
    client.operator.create_task({**REPORTS, "routing_rules": [
        {"condition": "$[?(!@.compliance)]", "groups": ["human-review"]}], "entries": [
        {"file_id": "p1", "path": "p1"}, {"file_id": "whole", "path": "whole",
                                          "parts": ["p1"]}]})
    verify(client, "reports", "p1", b"part", {"compliance": "pass"})
    wait_for(lambda: client.operator.get_entry("reports", "whole").state == pb.ENTRY_STATE_VERIFIED,
             what="the assembly to be verified")
    whole = client.operator.get_entry("reports", "whole")
    assert (whole.routing_rule, list(whole.routed_to)) == (0, ["human-review"])
    with client.open_session("consumer", ttl=10) as s:
        with pytest.raises(errors.NothingToClaim):
            client.consume("reports", "pdf-composer", session=s)
        assert client.consume("reports", "human-review", session=s).file_id == "whole"


@pytest.mark.parametrize(
    ("attributes", "why"),
    [
        ("[1, 2]", "must be a JSON object"),
        ('"fail"', "must be a JSON object"),
        ('{"score": ', "not valid JSON"),
        ('{"score": NaN}', "not valid JSON"),
        ('{"a": ' + "[" * 40 + "]" * 40 + "}", "nest more than"),
        (json.dumps({"a": "x" * MAX_ATTRIBUTES_BYTES}), f"at most {MAX_ATTRIBUTES_BYTES}"),
    ],
)
def test_bad_attributes_are_refused_and_change_nothing(client: Client, attributes: str,
                                                        why: str) -> None:
    """Attributes must be a small JSON object: anything else is refused, naming the
    entry, and the claim is still there to commit properly."""
    client.operator.create_task(REPORTS)
    with client.open_session("producer", ttl=10) as s:
        claim = client.claim("reports", "r0", session=s)
        with pytest.raises(errors.InvalidArgument, match="reports/r0") as info:
            client.commit("reports", "r0", claim.token, 1, digest(b"x"), attributes=attributes)
        assert why in str(info.value)
        assert client.operator.get_entry("reports", "r0").state == pb.ENTRY_STATE_WRITING
        entry = client.commit("reports", "r0", claim.token, 1, digest(b"x"),
                              attributes={"compliance": "fail"})
        assert entry.state == pb.ENTRY_STATE_WRITTEN and json.loads(entry.attributes) == {
            "compliance": "fail"}


def test_commit_batch_and_put_carry_attributes(client: Client, tmp_path: Any) -> None:
    """Attributes ride on batch commits (as text, every digit kept) and on ``put``;
    an empty object is not stored."""
    client.operator.create_task(REPORTS)
    with client.open_session("producer", ttl=10) as s:
        a = client.claim("reports", "r0", session=s)
        b = client.claim("reports", "r1", session=s)
        entries = client.commit_batch([
            ("reports", "r0", a.token, 1, digest(b"x"), '{"score": 95.0000000000000000001}'),
            ("reports", "r1", b.token, 1, digest(b"x"), {})])
        assert [e.attributes for e in entries] == ['{"score": 95.0000000000000000001}', ""]
        src = tmp_path / "r2.json"
        src.write_bytes(b"{}")
        entry = put(client, s, "reports", "r2", src, attributes={"compliance": "pass"})
        assert json.loads(entry.attributes) == {"compliance": "pass"}


def test_attributes_set_while_producing_are_committed(client: Client) -> None:
    """A producer that learns the verdict while writing sets ``out.attributes``."""
    client.operator.create_task(REPORTS)
    with client.open_session("producer", ttl=10) as s, produce(
            client, s, "reports", "r0") as out:
        out.write(b"report")
        out.attributes = {"compliance": "fail"}
    entry = client.watcher.report("reports", "r0", 6, digest(b"report"))
    assert list(entry.routed_to) == ["human-review"]


# the command line ------------------------------------------------------------------

def test_cli_commits_attributes_as_written(registry: Any, client: Client,
                                           tmp_path: Any) -> None:
    """`commit --attributes` and `put --attributes` send the JSON as written (every
    digit kept); one that is not an object is exit 2 and the claim stays; `task get`
    lists the rules in order."""
    from test_cli import create, invoke, ok_json

    create(registry, REPORTS)
    shown = invoke(registry, "task", "get", "reports").stdout
    assert "0: $[?(@.compliance == 'fail')] → human-review" in shown
    assert "1: $[?(@.compliance == 'pass')] → pdf-composer" in shown
    with client.open_session("producer", ttl=10) as s:
        claim = client.claim("reports", "r0", session=s)
        src = tmp_path / "r0.json"
        src.write_bytes(b"x")
        common = ["commit", "reports", "r0", "--token", str(claim.token), "--file", str(src)]
        bad = invoke(registry, *common, "--attributes", "[95]")
        assert bad.exit_code == 2 and "must be a JSON object" in bad.stderr
        assert client.operator.get_entry("reports", "r0").state == pb.ENTRY_STATE_WRITING
        entry = ok_json(invoke(registry, *common, "--attributes",
                               '{"score": 95.0000000000000000001}', "-o", "json"))
        assert entry["attributes"] == '{"score": 95.0000000000000000001}'
    src = tmp_path / "r1.json"
    src.write_bytes(b"y")
    put_entry = ok_json(invoke(registry, "put", "reports", "r1", str(src), "--attributes",
                               '{"compliance": "pass"}', "-o", "json"))
    assert json.loads(put_entry["attributes"]) == {"compliance": "pass"}
