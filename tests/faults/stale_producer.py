"""A producer that can be paused between writing its payload and publishing it.

    python -m tests.faults.stale_producer REGISTRY TASK FILE TTL

It claims FILE with the ``produce`` helper, writes ``A`` bytes, prints
``{"token": N}`` and waits for a line on stdin before the block ends (publish:
rename, then commit). It then prints ``{"outcome": ...}``: "committed" or the
error's class name.
"""

from __future__ import annotations

import json
import sys

from baton_relay.client import Client, RetryPolicy, produce
from baton_relay.kernel import errors

PAYLOAD = b"A" * 1000


def main() -> None:
    address, task, file, ttl = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = Client(address, retry=RetryPolicy(attempts=2, deadline=2.0))
    session = client.open_session("stale-producer", ttl=ttl)
    outcome = "committed"
    try:
        with produce(client, session, task, file) as out:
            out.write(PAYLOAD)
            print(json.dumps({"token": out.claim.token}), flush=True)
            sys.stdin.readline()
    except errors.BatonError as e:
        outcome = type(e).__name__
    print(json.dumps({"outcome": outcome}), flush=True)


if __name__ == "__main__":
    main()
