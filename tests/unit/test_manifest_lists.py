"""Manifest validation of long and repeated dependency and part lists."""

from __future__ import annotations

from typing import Any

import pytest

from baton_relay.client import parse_manifest
from baton_relay.kernel import errors
from baton_relay.registry.records.manifest import validate


def spec(entries: list[dict[str, Any]]) -> Any:
    return parse_manifest({"task_id": "t1", "entries": entries})


def test_hundreds_of_dependencies_and_parts_are_valid() -> None:
    """A dependent of 300 entries and an assembly of 300 parts pass validation."""
    ids = [f"e{i:03d}" for i in range(600)]
    entries: list[dict[str, Any]] = [{"file_id": i, "path": i} for i in ids]
    entries += [{"file_id": "dependent", "path": "dependent", "depends_on": ids[:300]},
                {"file_id": "assembly", "path": "assembly", "parts": ids[300:]}]
    valid = {e.file_id: e for e in validate(spec(entries)).entries}
    assert len(valid["dependent"].depends_on) == 300 and not valid["dependent"].deps_ok
    assert len(valid["assembly"].parts) == 300 and valid["e300"].assembly == "assembly"
    assert valid["e000"].dependents == ["dependent"]


@pytest.mark.parametrize("field", ["depends_on", "parts"])
def test_a_name_listed_twice_is_refused(field: str) -> None:
    """depends_on or parts naming one entry twice is refused, saying which."""
    entries: list[dict[str, Any]] = [{"file_id": "a", "path": "a"}, {"file_id": "b", "path": "b"},
               {"file_id": "x", "path": "x", field: ["a", "b", "a"]}]
    with pytest.raises(errors.InvalidManifest) as raised:
        validate(spec(entries))
    assert f"entry 'x': {field} names ['a'] more than once" in str(raised.value)
    assert "part of both" not in str(raised.value)
