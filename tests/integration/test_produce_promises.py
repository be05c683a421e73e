"""What the producing helpers promise about leaving a loop, progress and resume points,
on a real etcd and registry: ``produce_each`` commits an output the loop closed before
it left, ``produce`` takes its progress total from the entry, and a resumable write's
points bound the work a later attempt re-does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from registry_fixtures import RegistryHandle

from baton_relay.client import Client, produce, produce_each
from baton_relay.client.producer import Output
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

MIB = 1 << 20
#: a retry backoff long enough that a failed entry stays failed while a test looks
SLOW_BACKOFF = {"base_seconds": 60, "cap_seconds": 60}


def manifest(n: int, **extra: Any) -> dict[str, Any]:
    return {"task_id": "t", "backoff": SLOW_BACKOFF,
            "entries": [{"file_id": f"f{i:02d}", "path": f"f{i:02d}"} for i in range(n)],
            **extra}


def events(client: Client, file_id: str) -> list[pb.JournalRecord]:
    return list(client.operator.journal("t", file_id))


def close_by_method(out: Output, data: bytes) -> None:
    out.write(data)
    out.close()


def close_as_a_block(out: Output, data: bytes) -> None:
    with out:
        out.write(data)


def close_the_file(out: Output, data: bytes) -> None:
    out.write(data)
    out.file.close()


@pytest.mark.parametrize("finish", [close_by_method, close_as_a_block, close_the_file])
@pytest.mark.parametrize(("ahead", "stream"), [(1, True), (8, True), (1, False)])
def test_breaking_out_after_closing_an_output_commits_it(
        registry: RegistryHandle, client: Client, ahead: int, stream: bool,
        finish: Callable[[Output, bytes], None]) -> None:
    """A loop that writes and closes an output, then breaks (a deadline), commits that
    output with its bytes: no `failed` record, no retry spent; the entries claimed
    ahead are released and none is left claimed (on a stream session or not)."""
    client.operator.create_task(manifest(12))
    outs: list[Output] = []
    with client.open_session("p", ttl=10, keepalive=stream) as s:
        steps = produce_each(client, s, "t", ahead=ahead, linger=5.0)
        for out in steps:
            finish(out, out.claim.file_id.encode())
            outs.append(out)
            if len(outs) == 3:
                break  # the deadline
        steps.close()  # what leaving the loop does (CPython at once), the session open
        by_id = {e.file_id: e for e in client.operator.list_entries("t")}
    last = outs[-1]
    assert last.entry is not None and last.entry.state == pb.ENTRY_STATE_WRITTEN
    for out in outs:
        e = by_id[out.claim.file_id]
        assert e.state == pb.ENTRY_STATE_WRITTEN and e.size == len(out.claim.file_id)
    assert all(e.retry_count == 0 for e in by_id.values())
    assert not [(f, r.reason) for f in by_id for r in events(client, f) if r.event == "failed"]
    assert not any(e.state == pb.ENTRY_STATE_WRITING for e in by_id.values())


def test_breaking_out_with_an_output_written_but_not_closed_fails_it_saying_why(
        registry: RegistryHandle, client: Client) -> None:
    """An output written but not closed when the loop is left may be partial (a break
    and an exception in the body close the loop alike): it is failed, and the reason
    says it was left open and how much was written, not ``GeneratorExit``."""
    client.operator.create_task(manifest(3))
    with client.open_session("p", ttl=10) as s:
        steps = produce_each(client, s, "t", ahead=1)
        for out in steps:
            out.write(b"half")
            break
        steps.close()
    failed = [r for r in events(client, out.claim.file_id) if r.event == "failed"]
    assert len(failed) == 1 and "GeneratorExit" not in failed[0].reason
    assert "not closed" in failed[0].reason and "4 bytes" in failed[0].reason
    assert client.operator.get_entry("t", out.claim.file_id).retry_count == 1


def test_an_output_is_refused_writes_once_closed(
        registry: RegistryHandle, client: Client) -> None:
    """Closing an output ends its bytes: a later write raises ValueError, as a closed
    file's does."""
    client.operator.create_task(manifest(1))
    with (client.open_session("p", ttl=10) as s, pytest.raises(ValueError, match="closed"),
          produce(client, s, "t", "f00") as out):
        out.write(b"all of it")
        out.close()
        out.write(b"more")
    assert client.operator.get_entry("t", "f00").state == pb.ENTRY_STATE_PENDING  # the block raised


def test_produce_takes_its_progress_total_from_the_entry(
        registry: RegistryHandle, client: Client, wait_for: Callable[..., None]) -> None:
    """No ``expected_size`` passed: the claim carries the entry's, and a resume point's
    progress is the bytes written over it (1 MiB of 4 MiB: 0.25)."""
    client.operator.create_task({"task_id": "t", "backoff": {"base_seconds": 0.01},
                                 "entries": [{"file_id": "big", "path": "big.bin",
                                     "expected_size": 4 * MIB}]})
    with client.open_session("p", ttl=10) as s:
        with pytest.raises(RuntimeError), produce(client, s, "t", "big", resumable=True,
                                                  resume_every=MIB) as out:
            assert out.claim.entry.expected_size == 4 * MIB
            out.write(b"\0" * MIB)
            raise RuntimeError("stopped after the first MiB")
        got: list[Any] = []

        def claimed() -> bool:
            try:
                got.append(client.claim("t", "big", session=s))
            except errors.IllegalTransition:  # its retry backoff not over yet
                return False
            return True

        wait_for(claimed, what="the entry claimable again")
    (claim,) = got
    assert claim.checkpoint is not None and claim.checkpoint.progress == pytest.approx(0.25)


@pytest.mark.parametrize(("options", "apart"), [
    ({}, 2 * MIB),                               # 5 % of 40 MiB, under 8 MiB
    ({"resume_every": MIB}, MIB),                 # the caller's, smaller
    ({"resume_fraction": 0.1}, 4 * MIB),          # 10 % of 40 MiB
    ({"resume_fraction": 0.0}, 8 * MIB),          # no fraction: every 8 MiB alone
])
def test_resume_points_bound_the_work_a_killed_write_loses(
        registry: RegistryHandle, client: Client, options: dict[str, Any],
        apart: int) -> None:
    """A resumable write of a 40 MiB entry keeps at most the smaller of ``resume_every``
    (8 MiB) and ``resume_fraction`` (5 %) of the entry's expected size beyond its last
    resume point after each of its write calls."""
    size = 40 * MIB
    client.operator.create_task({"task_id": "t", "entries": [
        {"file_id": "big", "path": "big.bin", "expected_size": size}]})
    behind: list[int] = []
    with (client.open_session("p", ttl=10) as s,
          produce(client, s, "t", "big", resumable=True, **options) as out):
        for chunk in (MIB // 2, 3 * MIB, MIB // 2, 5 * MIB) * 10:
            chunk = min(chunk, size - out.size)
            if chunk:
                out.write(b"\1" * chunk)
                behind.append(out.size - max(out._saved, 0))
    assert out.entry is not None and out.entry.size == size
    assert max(behind) <= apart, (max(behind), apart)


def test_baton_put_resumes_by_the_library_default() -> None:
    """`baton put --resume` records resume points as often as the library does by default."""
    from baton_relay.client.cli.agents import put as put_command
    from baton_relay.client.producer import RESUME_EVERY

    (every,) = [p for p in put_command.params if p.name == "resume_every"]
    assert every.default << 20 == RESUME_EVERY
