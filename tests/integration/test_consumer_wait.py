"""An idle consumer's wait (issue 39): resumed from where its watch stood, not a new
attempt per wait. Each wait of ``next_lease`` lasts a third of the session's TTL (to
notice a drain); while nothing is verified, the waits after the first are resumed
streams and the registry is asked to consume once only. A verification still wakes
the consumer at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from test_ack_batch import digest
from test_metrics import metrics_port, scrape

from baton_relay.client import Client
from baton_relay.client.consumer import next_lease
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores


def calls(registry: Any, method: str) -> float:
    found = scrape(metrics_port(registry))
    return sum(v for n, labels, v in found.samples
               if n == "baton_grpc_calls_total" and labels.get("method") == method)


def test_an_idle_consumer_resumes_its_wait_without_asking_again(
        registry_factory: Callable[..., Any], wait_for: Callable[..., None]) -> None:
    registry = registry_factory(metrics="127.0.0.1:0")
    with Client(registry.address, timeout=10) as client, \
            client.open_session("producer", ttl=30) as producer, \
            client.open_session("consumer", ttl=3) as consumer:
        client.operator.create_task({"task_id": "t", "consumers": ["g"],
                                     "entries": [{"file_id": "late", "path": "late"}]})
        got: list[Any] = []
        waiting = threading.Thread(target=lambda: got.append(
            next_lease(client, consumer, "t", "g", timeout=60)), daemon=True)
        watches = calls(registry, "Watch")
        waiting.start()
        # three waits of a second each (a third of the TTL), nothing verified meanwhile
        wait_for(lambda: calls(registry, "Watch") >= watches + 4, timeout=20,
                 what="the consumer's wait resumed three times")
        assert calls(registry, "Consume") == 1, "one attempt, before the first wait"
        assert not got
        c = client.claim("t", "late", session=producer)
        client.commit("t", c.file_id, c.token, 1, digest(b"x"))
        client.watcher.report("t", c.file_id, 1, digest(b"x"))
        waiting.join(10)
        assert got and got[0].file_id == "late"
        assert calls(registry, "Consume") == 2
        assert client.operator.get_entry("t", "late").state == pb.ENTRY_STATE_VERIFIED
        assert got[0].token > 0
