"""Regression test for a bug the fault runs found (seed 5, ``pause-agent`` on a producer
holding a written payload, TTL 2 s; docs/faults.md).

A session took the time of a successful keepalive when its reply had been handled,
not when the call was sent. A process paused while a keepalive was in flight (or just
after its reply arrived) woke up with a session that looked fresh, although its
lease had expired during the pause: the session's check passed, and the producer
published its bytes over the attempt that had replaced it. A lease refreshed by a
call is only known to live for its TTL from when that call was sent.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from baton_relay.client.aio import AsyncSession
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb


def test_a_late_keepalive_reply_does_not_make_the_session_look_fresh() -> None:
    """Sent at 0, its reply handled at 2.5 s: the 2 s lease is only known to live until 2 s."""

    async def scenario() -> None:
        session = AsyncSession(None, pb.OpenSessionRequest(agent="a", ttl=2))  # type: ignore[arg-type]
        session.session_id = 1
        session.last_ok = time.monotonic()

        async def late_reply(kind: str, request: Any, wait: float | None = None) -> Any:
            await asyncio.sleep(2.5)  # the agent was stopped with the keepalive in flight
            return pb.KeepAliveResponse(ttl=2)

        session._ask = late_reply  # type: ignore[method-assign]
        assert await session.refresh() == 2
        with pytest.raises(errors.SessionExpired):
            session.check()

    asyncio.run(scenario())
