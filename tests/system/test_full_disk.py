"""A full staging filesystem (a real 2 MiB tmpfs as the staging root): the producer
gets the kernel's ENOSPC, nothing that was not written is committed, no temp file is
left behind, and once space is back the same entry is produced (real etcd, real
registry, the producer helper and the `baton put` CLI)."""

from __future__ import annotations

import errno
import io
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from registry_fixtures import RegistryHandle

from baton_relay.client import Client, put
from baton_relay.client.cli import cli
from baton_relay.kernel.contract import TEMP_MARKER
from baton_relay.kernel.v1 import baton_pb2 as pb

Wait = Callable[..., None]


@pytest.fixture
def staging(tmp_path: Path) -> Iterator[Path]:
    """A staging root that holds 2 MiB, on a tmpfs of its own."""
    root = tmp_path / "staging"
    root.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if TEMP_MARKER in p.name]


def test_a_full_staging_root_fails_the_producer_and_commits_nothing(
    client: Client, staging: Path, registry: RegistryHandle, wait_for: Wait,
) -> None:
    client.operator.create_task({"task_id": "t1", "digest_optional": True,
                                 "entries": [{"file_id": "big", "path": "big.bin"},
                                    {"file_id": "small", "path": "small.bin"}]})
    with client.open_session("p", ttl=30) as session:
        with pytest.raises(OSError) as full:
            put(client, session, "t1", "big", io.BytesIO(os.urandom(3 << 20)))
        assert full.value.errno == errno.ENOSPC
        entry = client.operator.get_entry("t1", "big")
        assert entry.state == pb.ENTRY_STATE_PENDING and entry.size == 0
        assert "No space left on device" in entry.error
        assert [r.event for r in client.operator.journal("t1", "big")][-1] == "failed"
        assert temp_files(staging) == [] and not (staging / "t1" / "big.bin").exists()
        # the CLI says what happened, and exits 1 (a local file error)
        src = staging.parent / "big.src"
        src.write_bytes(os.urandom(3 << 20))
        wait_for(lambda: "claimable" in client.operator.explain("t1", "big").text,
                 what="backoff over")
        result = CliRunner().invoke(cli, ["put", "t1", "big", str(src)],
                                    env={"BATON_REGISTRY": registry.address})
        assert result.exit_code == 1 and "No space left on device" in result.output
        assert client.operator.get_entry("t1", "big").state == pb.ENTRY_STATE_PENDING
        # what fits still goes through, and the staging root is usable again
        done = put(client, session, "t1", "small", io.BytesIO(b"fits"))
        assert done.state == pb.ENTRY_STATE_WRITTEN and done.size == 4
    assert temp_files(staging) == []
