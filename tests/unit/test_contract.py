"""The wire contract: committed stubs are fresh; errors survive the trip both ways."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from baton_relay.kernel import errors
from baton_relay.kernel.v1 import regen

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    """Regenerating from baton.proto reproduces the committed stubs byte for byte."""
    regen.generate(tmp_path)
    for name in ("baton_pb2.py", "baton_pb2.pyi", "baton_pb2_grpc.py"):
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "kernel" / "v1" / name).read_text()
        assert fresh == committed, (
            f"kernel/v1/{name} is stale: run python -m baton_relay.kernel.v1.regen")


ALL_ERRORS = [cls for cls in vars(errors).values()
              if isinstance(cls, type) and issubclass(cls, errors.BatonError)
              and cls is not errors.BatonError]


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_error_round_trip(cls: type[errors.BatonError]) -> None:
    """Every domain error maps to a status and back to the same class and fields."""
    original = cls("something happened", task_id="t1", token=7)
    code, details, metadata = errors.to_status(original)
    assert code == cls.code
    back = errors.from_status(code, details, metadata)
    assert type(back) is cls
    assert (str(back), back.fields) == ("something happened", {"task_id": "t1", "token": 7})


def test_status_codes_follow_the_table() -> None:
    """Conflicts are ABORTED, preconditions FAILED_PRECONDITION, bad input INVALID_ARGUMENT."""
    assert errors.Conflict.code == grpc.StatusCode.ABORTED
    assert errors.StaleToken.code == grpc.StatusCode.FAILED_PRECONDITION
    assert errors.InvalidManifest.code == grpc.StatusCode.INVALID_ARGUMENT
    assert errors.TaskExists.code == grpc.StatusCode.ALREADY_EXISTS


def test_unnamed_status_falls_back_to_code() -> None:
    """A status without Baton metadata (e.g. from a proxy) still becomes a typed error."""
    assert isinstance(errors.from_status(grpc.StatusCode.UNAVAILABLE, "down"), errors.Unavailable)
    assert isinstance(errors.from_status(grpc.StatusCode.UNKNOWN, "?"), errors.Internal)
