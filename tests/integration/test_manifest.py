"""Manifest validation: every bad manifest is refused with its reasons and changes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from baton_relay.client import Client, parse_manifest
from baton_relay.kernel import errors
from baton_relay.registry.records.manifest import MAX_ENTRIES, MAX_PATH, path_problem, validate

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores


def spec(entries: list[dict[str, Any]], **fields: Any) -> Any:
    return parse_manifest({"task_id": "t1", "entries": entries, **fields})


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../escape", "'..'"),
        ("a/../../b", "'..'"),
        ("/etc/passwd", "absolute"),
        ("a//b", "normalised"),
        ("./a", "normalised"),
        ("a/", "normalised"),
        ("", "empty"),
        ("a\0b", "NUL"),
        ("x" * (MAX_PATH + 1), "longer"),
    ],
)
def test_bad_paths_are_refused(path: str, why: str) -> None:
    """Paths that are absolute, escape the task dir or are not normalised are refused."""
    problem = path_problem(path)
    assert problem is not None and why in problem
    with pytest.raises(errors.InvalidManifest, match="path"):
        validate(spec([{"file_id": "a", "path": path}]))


def test_smallest_manifest_gets_defaults() -> None:
    """The smallest manifest is valid; consumers, retries and sizes get their defaults."""
    valid = validate(spec([{"file_id": "a", "path": "a.json"}]))
    (entry,) = valid.entries
    assert valid.consumers == ["default"] and valid.max_retries == 3
    assert (entry.consumers, entry.max_retries, entry.state) == (["default"], 3, "pending")


def test_entry_settings_override_task_defaults() -> None:
    """An entry's consumers and max_retries (even 0) override the task's."""
    valid = validate(spec([{"file_id": "a", "path": "a", "consumers": ["x"], "max_retries": 0}],
                          consumers=["y"], max_retries=5))
    assert (valid.entries[0].consumers, valid.entries[0].max_retries) == (["x"], 0)


@pytest.mark.parametrize(
    ("entries", "fields", "match"),
    [
        ([{"file_id": "a", "path": "a"}, {"file_id": "a", "path": "b"}], {}, "duplicate file_id"),
        ([{"file_id": "a", "path": "x"}, {"file_id": "b", "path": "x"}], {}, "used by another"),
        ([{"file_id": "a/b", "path": "a"}], {}, "file_id"),
        ([{"file_id": "a", "path": "a"}], {"schema_version": 2}, "schema_version"),
        ([{"file_id": "a", "path": "a", "depends_on": ["zz"]}], {}, "unknown entry"),
        ([{"file_id": "a", "path": "a", "depends_on": ["a"]}], {}, "itself"),
        ([{"file_id": "a", "path": "a", "depends_on": ["b"]},
          {"file_id": "b", "path": "b", "depends_on": ["a"]}], {}, "cycle"),
        ([{"file_id": "a", "path": "a", "expected_digest": "abc"}], {}, "expected_digest"),
        ([{"file_id": "a", "path": "a"}], {"max_retries": 1000}, "max_retries"),
        ([{"file_id": "a", "path": "a"}], {"consumers": ["bad group"]}, "consumer group"),
        ([], {}, "at least one entry"),
    ],
)
def test_invalid_manifests(entries: list[dict[str, Any]], fields: dict[str, Any],
                           match: str) -> None:
    """Each kind of bad manifest is refused with a reason that names the problem."""
    with pytest.raises(errors.InvalidManifest, match=match):
        validate(spec(entries, **fields))


@pytest.mark.parametrize("backoff", [{"factor": float("inf")}, {"factor": float("nan")},
                                     {"base_seconds": float("inf")},
                                     {"base_seconds": float("nan")}])
def test_a_backoff_that_is_not_a_finite_number_is_refused(backoff: dict[str, float]) -> None:
    """Infinite or NaN backoff values are refused (fuzzing found factor ∞ accepted: NaN
    passes every comparison, and 0 times infinity makes a delay of NaN)."""
    from baton_relay.kernel.v1 import baton_pb2 as pb

    bad = pb.TaskSpec(task_id="t1", entries=[pb.EntrySpec(file_id="a", path="a")],
                      backoff=pb.RetryBackoff(**backoff))
    with pytest.raises(errors.InvalidManifest, match="finite"):
        validate(bad)


@pytest.mark.parametrize("after", [float("inf"), float("-inf"), float("nan")])
def test_an_archive_delay_that_is_not_a_finite_number_is_refused(after: float) -> None:
    """archive_after_seconds must be a finite number (negative says never)."""
    from baton_relay.kernel.v1 import baton_pb2 as pb

    bad = pb.TaskSpec(task_id="t1", entries=[pb.EntrySpec(file_id="a", path="a")],
                      archive_after_seconds=after)
    with pytest.raises(errors.InvalidManifest, match="archive_after_seconds"):
        validate(bad)


def test_too_many_routing_rules_are_refused_without_parsing_them_all() -> None:
    """2,000 routing rules: refused for their number, and only the first MAX_RULES are
    looked into (fuzzing found such a manifest taking 12 s to refuse: every empty
    condition was parsed)."""
    from baton_relay.kernel.v1 import baton_pb2 as pb
    from baton_relay.registry.records.routing import MAX_RULES

    bad = pb.TaskSpec(task_id="t1", entries=[pb.EntrySpec(file_id="a", path="a")],
                      routing_rules=[pb.RoutingRule() for _ in range(2000)])
    with pytest.raises(errors.InvalidManifest) as refused:
        validate(bad)
    problems = refused.value.problems
    assert f"routing_rules: 2000 rules, at most {MAX_RULES}" in problems
    looked = {p.split(":")[0] for p in problems if p.startswith("routing_rules[")}
    assert looked == {f"routing_rules[{i}]" for i in range(MAX_RULES)}


def test_every_problem_is_reported() -> None:
    """A manifest with several problems lists all of them at once."""
    with pytest.raises(errors.InvalidManifest) as info:
        validate(spec([{"file_id": "a", "path": "/abs"}, {"file_id": "a", "path": "../up"}]))
    assert len(info.value.problems) == 3  # type: ignore[attr-defined]


def test_a_part_with_consumers_is_refused() -> None:
    """Parts are consumed as their assembly: consumers given to a part refuse the manifest."""
    with pytest.raises(errors.InvalidManifest, match="take no consumers"):
        validate(spec([{"file_id": "whole", "path": "whole", "parts": ["p1"]},
                       {"file_id": "p1", "path": "p1", "consumers": ["ocr"]}]))


def test_problems_quote_long_values_cut_short() -> None:
    """A long path or id is quoted cut to 60 characters with its length, once per problem."""
    with pytest.raises(errors.InvalidManifest) as info:
        validate(spec([{"file_id": "a" * 5_000, "path": "p" * 20_000}]))
    message = str(info.value)
    assert "20,000 characters" in message and "5,000 characters" in message
    assert len(message) < 1_000


def test_oversize_manifest_is_refused() -> None:
    """More than MAX_ENTRIES entries is refused."""
    big = [{"file_id": f"e{i}", "path": f"e{i}"} for i in range(MAX_ENTRIES + 1)]
    with pytest.raises(errors.InvalidManifest, match="at most"):
        validate(spec(big))


def test_unknown_manifest_field_is_refused() -> None:
    """A typo in a manifest field is an error, not silently ignored."""
    with pytest.raises(errors.InvalidManifest, match="priorty"):
        parse_manifest({"task_id": "t", "entries": [{"file_id": "a", "path": "a", "priorty": 1}]})


def test_refused_manifest_changes_nothing(client: Client) -> None:
    """The registry refuses a bad manifest over the wire and creates no task."""
    with pytest.raises(errors.InvalidManifest) as info:
        client.operator.create_task({"task_id": "t1",
                                     "entries": [{"file_id": "a", "path": "../x"}]})
    assert "'..'" in str(info.value)
    assert info.value.problems  # type: ignore[attr-defined]  # the list survives the wire
    with pytest.raises(errors.NotFound):
        client.operator.get_task("t1")
    assert client.operator.list_tasks() == []
