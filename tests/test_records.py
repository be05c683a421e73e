"""Stored records: a record loaded again from the same bytes is decoded once and is still
a record of its own — what one writer changes in place, no other load sees."""

from __future__ import annotations

import pytest

from baton_relay.registry import model
from baton_relay.registry.model import EntryRecord, TaskRecord


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


def _task(task_id: str) -> bytes:
    return TaskRecord(task_id=task_id, status="active", staging_dir="/s", entry_count=1,
                      manifest_digest="m", consumers=["g"], max_retries=3).dump()


def test_a_stored_value_is_decoded_once_while_it_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second load of the same bytes does not decode them again; different bytes
    are decoded, and the oldest kept value gives way at the bound."""
    decoded: list[bytes] = []
    real = model.json.loads

    def counting(raw: bytes) -> object:
        decoded.append(raw)
        return real(raw)

    monkeypatch.setattr(model, "DECODED_KEPT", 2)
    monkeypatch.setattr(model, "_DECODED", {})
    monkeypatch.setattr(model.json, "loads", counting)
    first, second, third = _task("a"), _task("b"), _task("c")
    TaskRecord.load(first)
    TaskRecord.load(first)
    assert decoded == [first]
    TaskRecord.load(second)
    TaskRecord.load(third)  # two kept at most: ``first`` gives way
    TaskRecord.load(second)
    assert decoded == [first, second, third]
    assert TaskRecord.load(first).task_id == "a"
    assert decoded == [first, second, third, first]


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
