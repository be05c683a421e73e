"""What a registry accepts and what its errors carry: sizes, bad bytes, deadlines.

Errors travel in gRPC trailing metadata, which gRPC drops above 8 KiB; requests are
bounded by the largest valid manifest. Everything here runs against a real registry
on a real etcd, through the library, the CLI as a process, or a raw gRPC channel.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import pytest
from registry_fixtures import TEST_RETRY, RegistryHandle
from test_cli import cli_env

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.contract import MAX_MANIFEST_BYTES, MAX_REQUEST_BYTES
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.edge import server as registry_server

#: every method of the three services, by name
METHODS = {m.name: m for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}

SUBPROCESS_TIMEOUT = 60
#: gRPC's soft limit on metadata; what an error carries stays well under it
METADATA_SOFT_LIMIT = 8 * 1024


def baton(registry: RegistryHandle, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "baton_relay.client.cli", *args], capture_output=True, text=True,
        env=cli_env(registry.address), timeout=SUBPROCESS_TIMEOUT, check=False,
    )


def write_manifest(tmp_path: Path, manifest: dict[str, Any]) -> Path:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path


def metadata_bytes(error: errors.BatonError) -> int:
    """Bytes ``error`` takes in trailing metadata: status message (percent-encoded) and pairs."""
    _, details, metadata = errors.to_status(error)
    return len(quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")) + sum(
        len(k) + len(v) for k, v in metadata)


# --- errors that would not fit in trailing metadata -------------------------------------


def test_a_20000_character_path_is_a_readable_invalid_manifest(
    registry: RegistryHandle, tmp_path: Path
) -> None:
    """A manifest with a 20,000-character path exits 2 with one short line naming the problem."""
    manifest = {"task_id": "t1", "entries": [{"file_id": "a", "path": "x" * 20_000}]}
    result = baton(registry, "task", "create", str(write_manifest(tmp_path, manifest)))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and len(line) < 1000, line
    assert line.startswith("baton: invalid manifest:"), line
    assert "longer than 1024 bytes" in line and "20,000 characters" in line, line


def test_300_bad_paths_are_a_readable_invalid_manifest(
    registry: RegistryHandle, client: Client, tmp_path: Path
) -> None:
    """300 bad paths exit 2, the message counts them, and the list that travels is capped."""
    manifest = {"task_id": "t1", "entries": [
        {"file_id": f"f{i}", "path": f"/absolute/{i}/" + "y" * 200} for i in range(300)]}
    result = baton(registry, "task", "create", str(write_manifest(tmp_path, manifest)))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith("baton: invalid manifest: 300 problems:"), line
    assert "is absolute" in line and "more)" in line, line

    with pytest.raises(errors.InvalidManifest) as info:
        client.operator.create_task(manifest)
    e = info.value
    assert len(e.problems) == errors.MAX_LIST_ITEMS  # type: ignore[attr-defined]
    assert e.problems_more == 300 - errors.MAX_LIST_ITEMS  # type: ignore[attr-defined]
    assert all("is absolute" in p for p in e.problems)  # type: ignore[attr-defined]


def test_what_an_error_carries_is_bounded() -> None:
    """Huge messages, values and lists still fit in well under 8 KiB of metadata."""
    nasty = [
        errors.InvalidManifest("invalid manifest: " + "≤" * 50_000,
                               problems=["p" * 20_000] * 5_000),
        errors.InvalidArgument("x" * 100_000, **{f"field{i}": "v" * 5_000 for i in range(50)}),
        errors.NotFound("%" * 10_000, task_id="t" * 30_000, nested={"k": ["v" * 9_000]}),
    ]
    for error in nasty:
        assert metadata_bytes(error) < METADATA_SOFT_LIMIT // 2, type(error).__name__
        code, details, metadata = errors.to_status(error)
        back = errors.from_status(code, details, metadata)
        assert type(back) is type(error)
        assert "more characters" in str(back)


def test_a_list_says_how_many_items_were_left_out() -> None:
    """A capped list keeps its first items whole and names the rest as <name>_more."""
    problems = [f"problem {i}" for i in range(25)]
    code, details, metadata = errors.to_status(errors.InvalidManifest("bad", problems=problems))
    back = errors.from_status(code, details, metadata)
    assert back.problems == problems[:errors.MAX_LIST_ITEMS]  # type: ignore[attr-defined]
    assert back.problems_more == 25 - errors.MAX_LIST_ITEMS  # type: ignore[attr-defined]


def test_fields_cannot_replace_what_every_error_has() -> None:
    """Fields named message, code or exit_code do not break or change the rebuilt error."""
    metadata = (("baton-error", "NotFound"),
                ("baton-fields", '{"message": "x", "code": 1, "exit_code": 0, "task_id": "t"}'))
    back = errors.from_status(grpc.StatusCode.NOT_FOUND, "no task", metadata)
    assert type(back) is errors.NotFound
    assert (str(back), back.exit_code, back.fields) == ("no task", 5, {"task_id": "t"})
    assert back.code == grpc.StatusCode.NOT_FOUND


def test_transport_resource_exhausted_is_not_slots_exhausted() -> None:
    """RESOURCE_EXHAUSTED without Baton's error name is a size limit, not full slots."""
    bare = errors.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "Received message larger than max (9 vs. 4)")
    assert type(bare) is errors.MessageTooLarge
    assert bare.exit_code == 2
    named = errors.from_status(*errors.to_status(errors.SlotsExhausted("slots full")))
    assert type(named) is errors.SlotsExhausted


# --- sizes ---------------------------------------------------------------------------


def test_a_manifest_over_the_limit_is_refused_before_sending() -> None:
    """The client refuses a manifest larger than a registry accepts without sending it."""
    spec = pb.TaskSpec(task_id="big", entries=[
        pb.EntrySpec(file_id="a", path="p" * (MAX_MANIFEST_BYTES + 1))])
    # Nothing listens on port 9: only a refusal before any call can be InvalidManifest.
    with Client("127.0.0.1:9", retry=TEST_RETRY) as c, \
            pytest.raises(errors.InvalidManifest, match=r"at most 160\.0 MiB"):
        c.operator.create_task(spec)


def test_any_request_over_the_limit_is_refused_before_sending() -> None:
    """Any request over MAX_REQUEST_BYTES is MessageTooLarge before it is sent."""
    with Client("127.0.0.1:9", retry=TEST_RETRY) as c, \
            pytest.raises(errors.MessageTooLarge, match="CommitBatch"):
        c.commit_batch([("t", "f", 1, 1, "d" * (MAX_REQUEST_BYTES + 1))])


def test_the_registry_refuses_a_request_over_its_limit_at_once(
    monkeypatch: pytest.MonkeyPatch, registry_factory: Callable[..., RegistryHandle]
) -> None:
    """A request over the registry's receive limit comes back MessageTooLarge (exit 2)."""
    monkeypatch.setattr(registry_server, "MAX_REQUEST_BYTES", 64 * 1024)
    registry = registry_factory()
    entries = [{"file_id": f"f{i}", "path": f"dir/{i:06d}.bin"} for i in range(5_000)]
    with Client(registry.address, retry=TEST_RETRY) as c:
        with pytest.raises(errors.MessageTooLarge, match="larger than max"):
            c.operator.create_task({"task_id": "t1", "entries": entries})
        assert c.operator.list_tasks() == []


def test_a_slow_upload_is_a_deadline_not_unavailable(
    registry: RegistryHandle, tmp_path: Path
) -> None:
    """A call that outlives --timeout says so (exit 6), not that the registry is unavailable."""
    manifest = {"task_id": "slow", "entries": [
        {"file_id": f"f{i}", "path": f"dir/{i:06d}/" + "n" * 400} for i in range(20_000)]}
    result = baton(registry, "--timeout", "0.05", "task", "create",
                   str(write_manifest(tmp_path, manifest)))
    assert result.returncode == 6, result.stderr
    line = result.stderr.strip()
    assert "CreateTask: no reply from the registry within 0.05 s (deadline exceeded)" in line
    assert "--timeout" in line and "unavailable" not in line, line

    with Client(registry.address, timeout=0.05, retry=TEST_RETRY) as c, \
            pytest.raises(errors.DeadlineExceeded) as info:
        c.operator.create_task(manifest)
    assert info.value.method == "CreateTask"  # type: ignore[attr-defined]


# --- bytes that are not a request ------------------------------------------------------


@pytest.mark.parametrize("method, request_type, streaming", [
    ("GetTask", "GetTaskRequest", False),
    ("CreateTask", "CreateTaskRequest", False),
    ("Watch", "WatchRequest", True),
])
def test_raw_bytes_are_invalid_argument(
    registry: RegistryHandle, caplog: pytest.LogCaptureFixture, method: str, request_type: str,
    streaming: bool,
) -> None:
    """Bytes that are not the method's protobuf come back INVALID_ARGUMENT, logged as nothing."""
    caplog.set_level(logging.INFO, logger="baton")
    with grpc.insecure_channel(registry.address) as channel:
        path = f"/{METHODS[method].containing_service.full_name}/{method}"
        with pytest.raises(grpc.RpcError) as info:
            if streaming:
                list(channel.unary_stream(path)(b"\xff\xfenot protobuf", timeout=10))
            else:
                channel.unary_unary(path)(b"\xff\xfenot protobuf", timeout=10)
    e: Any = info.value
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"not a valid baton.v1.{request_type}" in e.details()
    assert ("baton-error", "InvalidArgument") in tuple(e.trailing_metadata())
    # The registry's records only: a client of an earlier test may still be logging.
    assert not [r for r in caplog.records
                if r.levelno >= logging.WARNING and r.name.startswith("baton.registry")]
