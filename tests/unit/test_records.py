"""Stored records: a record loaded from its bytes is the one its constructor makes, and a
record of its own — what one writer changes in place, no other load sees."""

from __future__ import annotations

import pytest

from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records import model
from baton_relay.registry.records.model import EntryRecord, TaskRecord


def _stored_entry() -> bytes:
    rec = EntryRecord(task_id="t", file_id="f", path="f")
    rec.routed_to, rec.labels, rec.nacked_until = ["g1"], {"k": "v"}, {"g1": 5.0}
    rec.observed = {"size": 5, "digest": "d"}
    return rec.dump()


def test_loading_the_same_bytes_twice_gives_two_records_that_share_nothing() -> None:
    """Two loads of one stored value are equal; changing one's lists and dicts (nested
    too) in place leaves the other, and every later load, as stored."""
    raw = _stored_entry()
    a, b = EntryRecord.load(raw), EntryRecord.load(raw)
    assert a == b and a is not b
    a.routed_to.append("g2")
    a.labels["k"] = "changed"
    a.nacked_until.clear()
    a.observed["size"] = 6
    a.state = "writing"
    c = EntryRecord.load(raw)
    for rec in (b, c):
        assert rec.routed_to == ["g1"] and rec.labels == {"k": "v"}
        assert rec.nacked_until == {"g1": 5.0} and rec.observed["size"] == 5
        assert rec.state == "pending" and rec._from == "pending" and rec._events == []


def test_a_loaded_record_is_the_one_its_constructor_makes() -> None:
    """A record loaded from stored bytes equals the one built from the same fields, its
    attributes in the constructor's order (it dumps the same bytes); a field stored by a
    later version is left out, and a record missing a field it needs is refused as the
    constructor refuses it."""
    raw = _stored_entry()
    loaded = EntryRecord.load(raw)
    built = EntryRecord(**model.json.loads(raw))
    assert loaded == built and list(vars(loaded)) == list(vars(built))
    a, b = model.json.loads(loaded.dump()), model.json.loads(built.dump())
    assert list(a) == list(b)  # the same keys in the same order
    assert {**a, "updated_at": ""} == {**b, "updated_at": ""}
    newer = model.json.loads(raw) | {"field_of_a_later_version": 1}
    assert EntryRecord.load(model.json.dumps(newer).encode()) == EntryRecord.load(raw)
    with pytest.raises(TypeError):
        TaskRecord.load(b'{"task_id": "a"}')


def test_an_entry_stores_the_fields_that_differ_from_their_defaults() -> None:
    """``dump`` leaves out every field at its default and keeps every other one (an
    attribute set beside the fields too), and ``load`` restores the defaults."""
    rec = EntryRecord(task_id="t", file_id="f", path="p")
    rec.size, rec.routed_to, rec.state = 7, ["g"], "written"
    stored = model.json.loads(rec.dump())
    assert stored == {"task_id": "t", "file_id": "f", "path": "p", "state": "written",
                      "size": 7, "routed_to": ["g"], "updated_at": rec.updated_at}
    assert EntryRecord.load(rec.dump()) == rec
    rec.extra = "kept"  # type: ignore[attr-defined]
    assert model.json.loads(rec.dump())["extra"] == "kept"


def test_an_entry_on_the_wire_keeps_the_fields_that_have_presence() -> None:
    """``to_pb`` leaves empty values unsaid, but a routing rule numbered 0 is a rule,
    and pools named only for consumer groups are pools: both stay present; an entry
    without either has neither."""
    rec = EntryRecord(task_id="t", file_id="f", path="d/f")
    plain = rec.to_pb("/staging/", revision=3)
    assert not plain.HasField("routing_rule") and not plain.HasField("pools")
    assert (plain.task_id, plain.abs_path, plain.revision) == ("t", "/staging/d/f", 3)
    assert plain.max_retries == rec.max_retries and plain.state == pb.ENTRY_STATE_PENDING
    rec.rule, rec.routed_to, rec.consume_pools = 0, ["g"], {"g": "gpu"}
    routed = rec.to_pb("/staging", token=7, consuming={"g": "agent-1"})
    assert routed.HasField("routing_rule") and routed.routing_rule == 0
    assert routed.HasField("pools") and routed.pools.produce == ""
    assert dict(routed.pools.consume) == {"g": "gpu"} and list(routed.routed_to) == ["g"]
    assert routed.token == 7 and dict(routed.consuming) == {"g": "agent-1"}
