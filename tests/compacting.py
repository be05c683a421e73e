"""An etcd of a test's own that compacts its history every second, and the writes that
move its revision on while what the test watches stays idle (tests of streams at rest)."""

from __future__ import annotations

import os
from pathlib import Path

from baton_relay.kernel import errors
from baton_relay.local.etcdproc import EtcdProcess
from baton_relay.registry.store.etcd import Etcd, Put

#: etcd compacts its history every second, to the revision of a second ago
COMPACTING = ("--auto-compaction-mode=periodic", "--auto-compaction-retention=1s")


def start_etcd(tmp_path: Path, *flags: str) -> EtcdProcess:
    """A started etcd (the suite's binary, ``BATON_TEST_ETCD``) with ``flags``."""
    process = EtcdProcess(tmp_path / "etcd", log_path=tmp_path / "etcd.log",
                          binary=os.environ.get("BATON_TEST_ETCD") or None,
                          extra_args=flags)
    process.start()
    return process


async def tick(etcd: Etcd) -> int:
    """Write a key outside every test's prefix (etcd's revision moves on); its revision."""
    return (await etcd.txn([], [Put(b"/elsewhere/tick", b"x")])).revision


async def compacted(etcd: Etcd, revision: int) -> bool:
    """Whether etcd has compacted ``revision`` away (a read at it is refused)."""
    try:
        await etcd.range(b"/elsewhere/", limit=1, revision=revision)
    except errors.BatonError:
        return True
    return False
