"""The cut-streams nemesis's tool: aborting one process's connections to the registry."""

from __future__ import annotations

import os

from registry_fixtures import TEST_RETRY, RegistryHandle
from tools import require

from baton_relay.client import Client
from baton_relay.kernel.v1 import baton_pb2 as pb

from . import sockets

DIGEST = "0" * 64


def test_an_aborted_connection_breaks_the_stream_and_the_session_resumes(
        registry: RegistryHandle) -> None:
    """``destroy`` aborts this process's connection to the registry mid-session: the
    stream breaks, the session is resumed on a new one and its claims stay good."""
    require("ss")
    port = int(registry.address.rsplit(":", 1)[1])
    with Client(registry.address, retry=TEST_RETRY) as c:
        c.operator.create_task({"task_id": "t", "entries": [
            {"file_id": f"f{i}", "path": f"f{i}"} for i in range(2)]})
        with c.open_session("p", ttl=10) as s:
            assert s.stream is not None
            first = c.claim("t", session=s)
            assert sockets.connections(os.getpid(), [port]), "no connection to cut"
            assert sockets.destroy(os.getpid(), [port]) >= 1
            second = c.claim("t", session=s)
            assert s.stream.resumed >= 1
            for claim in (first, second):
                entry = c.commit("t", claim.file_id, claim.token, 1, DIGEST, session=s)
                assert entry.state == pb.ENTRY_STATE_WRITTEN
        assert not sockets.connections(os.getpid(), [1])  # another port: nothing of ours
