"""Fuzzing manifest validation: any TaskSpec is accepted well-formed or refused clearly."""

from __future__ import annotations

import math
import time

from hypothesis import given
from hypothesis import strategies as st

from baton_relay.kernel.errors import InvalidManifest
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.manifest import ID_RE, path_problem, validate

from .strategies import fuzz_settings, messages

#: seconds one validation may take before it counts as a hang
HANG = 10.0
KNOWN = ("t", "f0", "f1", "a/b.bin", "default", "sink", "$[?(@.score > 95)]")


@st.composite
def valid_specs(draw: st.DrawFn) -> pb.TaskSpec:
    """A manifest validate() accepts: a few entries, groups, a rule."""
    n = draw(st.integers(1, 5))
    return pb.TaskSpec(
        task_id=draw(st.sampled_from(("t", "task-1", "T_2"))),
        entries=[pb.EntrySpec(file_id=f"f{i}", path=f"d{i % 2}/f{i}.bin") for i in range(n)],
        consumers=draw(st.sampled_from((["default"], ["a", "b"], []))),
        routing_rules=draw(st.sampled_from(
            ([], [pb.RoutingRule(condition="$[?(@.score > 95)]", groups=["a"])]))))


@fuzz_settings(300)
@given(spec=messages(pb.TaskSpec, KNOWN, valid=valid_specs()))
def test_any_manifest_is_accepted_well_formed_or_refused_clearly(spec: pb.TaskSpec) -> None:
    """validate() returns a task whose ids, paths and numbers are sound, or raises
    InvalidManifest with its problems listed — nothing else, and never slowly."""
    start = time.monotonic()
    try:
        valid = validate(spec)
    except InvalidManifest as e:
        assert e.problems and all(p.strip() for p in e.problems), e
        assert str(e).strip()
        return
    finally:
        assert time.monotonic() - start < HANG, "validation hung"
    assert ID_RE.match(valid.task_id)
    assert valid.entries and valid.consumers
    ids = [r.file_id for r in valid.entries]
    assert len(set(ids)) == len(ids) and all(ID_RE.match(i) for i in ids)
    assert all(path_problem(r.path) is None for r in valid.entries)
    assert math.isfinite(valid.aging) and valid.aging > 0
    assert all(math.isfinite(b) and b >= 0 for b in valid.backoff)
