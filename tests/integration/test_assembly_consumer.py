"""The consumer helper on an assembly: its parts read in order, each checked against its
verified digest, acked once; a corrupted part is nacked, never acked. Real etcd, real
registry, real files in its staging directory."""

from __future__ import annotations

from io import BytesIO
from pathlib import Path
from typing import Any

import blake3
import pytest

from baton_relay.client import Client, Session, consume, iter_parts, next_lease, put
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

PARTS = {"p1": b"first part, ", "p2": b"second part, ", "p3": b"third."}


def produce_parts(client: Client, s: Session) -> None:
    """Task t: parts p1..p3 of assembly `whole`, written through the producer helper
    and verified as a watcher would (no watcher runs here)."""
    client.operator.create_task({"task_id": "t", "entries": [
        *({"file_id": name, "path": f"whole.{name}"} for name in PARTS),
        {"file_id": "whole", "path": "whole", "parts": list(PARTS)}]})
    for name, data in reversed(PARTS.items()):  # the order they are produced in is free
        entry = put(client, s, "t", name, BytesIO(data))
        client.watcher.report("t", name, entry.size, blake3.blake3(data).hexdigest())


def events(client: Client, file_id: str) -> list[str]:
    return [r.event for r in client.operator.journal("t", file_id)]


def test_an_assembly_is_delivered_as_its_parts_in_order_and_acked_once(
        client: Client) -> None:
    """The helper waits for the assembly's verification, yields the parts' bytes
    concatenated in `parts` order, and acks the assembly once."""
    with client.open_session("a", ttl=30) as s:
        produce_parts(client, s)
        with consume(client, s, "t", timeout=20) as got:
            assert got.lease.file_id == "whole"
            assert got.data == b"".join(PARTS.values())
        whole = client.operator.get_entry("t", "whole")
        assert whole.state == pb.ENTRY_STATE_CONSUMED
        assert events(client, "whole").count("acked") == 1
        assert "nacked" not in events(client, "whole")


def test_iter_parts_yields_one_checked_part_at_a_time(client: Client) -> None:
    """`iter_parts` on a lease yields each part's bytes, in order."""
    with client.open_session("a", ttl=30) as s:
        produce_parts(client, s)
        lease = next_lease(client, s, "t", timeout=20)
        assert list(iter_parts(client, lease)) == list(PARTS.values())
        client.ack("t", lease.file_id, lease.group, lease.token)


def test_a_corrupted_part_is_a_checksum_mismatch_and_is_nacked(
        client: Client, registry: Any) -> None:
    """A part's file changed on disk (same size, other bytes) after it was verified:
    ChecksumMismatch names it, the assembly is nacked back to its group, not acked."""
    with client.open_session("a", ttl=30) as s:
        produce_parts(client, s)
        corrupted = Path(client.operator.get_entry("t", "p2").abs_attempt_path)
        corrupted.write_bytes(b"SECOND PART, ")
        with pytest.raises(errors.ChecksumMismatch, match=r"whole~t\d+\.p2"), \
                consume(client, s, "t", timeout=20):
            pytest.fail("a corrupted assembly was delivered")
        whole = client.operator.get_entry("t", "whole")
        assert whole.state == pb.ENTRY_STATE_VERIFIED and not whole.consumed_by
        assert events(client, "whole").count("nacked") == 1
        assert "acked" not in events(client, "whole")
        # Handed back to its group: the next consumer gets it again.
        assert client.consume("t", "default", session=s).file_id == "whole"


def test_a_part_that_left_verified_is_refused_before_any_read(client: Client) -> None:
    """A part no longer verified (the registry took it back): refused, nothing read."""
    with client.open_session("a", ttl=30) as s:
        produce_parts(client, s)
        lease = next_lease(client, s, "t", timeout=20)
        client.watcher.report("t", "p1", len(PARTS["p1"]), blake3.blake3(b"other").hexdigest())
        with pytest.raises(errors.ChecksumMismatch, match="part p1 is pending"):
            next(iter_parts(client, lease))
