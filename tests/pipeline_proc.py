"""A real agent process of a two-stage pipeline, for the back-pressure acceptance test.

    python pipeline_proc.py REGISTRY producer TASK SECONDS
    python pipeline_proc.py REGISTRY consumer TASK GROUP SECONDS

A producer writes the task's entries one after another with ``produce`` (which waits
out back-pressure), taking SECONDS per entry, and reports each as a lone watcher
would; it exits once nothing is left to claim. A consumer takes the group's entries
one after another, taking SECONDS per entry before it acks; it runs until killed.
Each prints one JSON line per entry done.
"""

from __future__ import annotations

import json
import sys
import time

import blake3

from baton_relay.client import Client, RetryPolicy, produce
from baton_relay.kernel import errors


def producer(client: Client, task: str, seconds: float) -> None:
    with client.open_session("pipeline-producer", ttl=30) as session:
        while True:
            try:
                with produce(client, session, task, wait=120) as out:
                    time.sleep(seconds)  # the work of producing it
                    data = f"{out.claim.file_id}\n".encode()
                    out.write(data)
            except errors.NothingToClaim:
                return
            assert out.entry is not None
            client.watcher.report(task, out.entry.file_id, len(data),
                                  blake3.blake3(data).hexdigest(),
                                  reporter="pipeline-watcher")
            print(json.dumps({"produced": out.entry.file_id}), flush=True)


def consumer(client: Client, task: str, group: str, seconds: float) -> None:
    with client.open_session("pipeline-consumer", ttl=30) as session:
        while True:
            try:
                lease = client.consume(task, group, session=session)
            except errors.NothingToClaim:
                time.sleep(0.02)  # nothing verified yet: look again
                continue
            time.sleep(seconds)  # the work of consuming it
            client.ack(task, lease.file_id, group, lease.token, session=session)
            print(json.dumps({"consumed": lease.file_id}), flush=True)


def main() -> None:
    address, role, task = sys.argv[1], sys.argv[2], sys.argv[3]
    client = Client(address, retry=RetryPolicy(attempts=5, deadline=10.0))
    if role == "producer":
        producer(client, task, float(sys.argv[4]))
    else:
        consumer(client, task, sys.argv[4], float(sys.argv[5]))


if __name__ == "__main__":
    main()
