"""Regression test for a bug the fault runs found (seed 5, ``pause-agent`` on a producer
holding a written payload, TTL 2 s; docs/faults.md).

``Session`` took the time of a successful keepalive when its reply had been handled,
not when the call was sent. A process paused while a keepalive was in flight (or just
after its reply arrived) woke up with a session that looked fresh, although its
lease had expired during the pause: ``Session.check`` passed, and the producer
published its bytes over the attempt that had replaced it. A lease refreshed by a
call is only known to live for its TTL from when that call was sent.
"""

from __future__ import annotations

import threading
import time

import pytest

from baton_relay.client import Session
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb


class LateReplies:
    """A registry whose keepalive replies reach the agent ``delay`` s after the call,
    as when the agent is stopped (SIGSTOP) with the call in flight."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.replied = threading.Event()

    def refresh_session(self, session_id: int) -> pb.KeepAliveResponse:
        time.sleep(self.delay)
        self.replied.set()
        return pb.KeepAliveResponse(ttl=2)


def test_a_late_keepalive_reply_does_not_make_the_session_look_fresh() -> None:
    """Sent at 0.67 s, handled at 3.2 s: the lease is only known to live until 2.67 s."""
    registry = LateReplies(delay=2.5)
    session = Session(client=registry, session_id=1, agent="a", ttl=2)  # type: ignore[arg-type]
    session.start()
    try:
        assert registry.replied.wait(10)
        time.sleep(0.05)
        with pytest.raises(errors.SessionExpired):
            session.check()
    finally:
        session.close(revoke=False)
